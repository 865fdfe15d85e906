"""The checks every algorithm file shares, written once and run for each of the six: the CPU scaling of the defaults
keeps every flag that was passed, `--help` lists every flag the README's experiment maps use, a Lean file stops at
once, with a clear message, when there is no Lean, and (slow) two ranks under torchrun reproduce the one-rank run and a
run killed midway then resumed continues exactly as the uninterrupted one. The last two rerun each file's reference
run (conftest.py: its command line, its one uninterrupted run); FAMILY says what each file's runs must reproduce."""

import dataclasses
import importlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from conftest import official_args

REPO = pathlib.Path(__file__).resolve().parent.parent
FILES = ["sgs", "stp", "gasp", "eva", "coprover", "rir"]
LEAN_FILES = ["sgs", "stp", "coprover", "rir"]
MAP_HEADINGS = {
    "sgs": "**SGS**",
    "stp": "**STP**",
    "gasp": "**GASP**",
    "eva": "**eva**",
    "coprover": "**CoProver**",
    "rir": "**RiR**",
}


def module(name: str):
    sys.path.insert(0, str(REPO))
    return importlib.import_module(name)


def as_argv(name: str, value, joined: bool = False) -> list[str]:
    """The command-line form of `value` for the field `name`, as tyro reads it (a boolean x: --x or --no-x, so a
    field no_x takes --no-x or --no-no-x); `joined`: a single value as --flag=value."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + name.replace("_", "-")]
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    return [f"{flag}={value}"] if joined else [flag, str(value)]


class Started(Exception):
    """Raised by a stand-in start_run: main got this far, with these args."""

    def __init__(self, args):
        super().__init__()
        self.run_args = args


@pytest.mark.parametrize("name", FILES)
def test_cpu_defaults_keep_every_given_flag(name, tmp_path, capsys, monkeypatch):
    """Without CUDA, CPU_DEFAULTS are Args' defaults (with_cpu_defaults): the command line and Args(...) from Python
    take them; a value given, on the command line (booleans as --x and --no-x included) or as a keyword, keeps it, for
    every key of CPU_DEFAULTS at once, through main() to start_run; start_run names the CPU sizes in use."""
    import tyro

    mod = module(name)
    official = official_args(mod)()
    assert issubclass(mod.Args, official_args(mod))  # this machine has no CUDA
    run = ["--output-dir", str(tmp_path)]
    # nothing passed: every key takes its CPU value, on the command line and from Python
    for args in (tyro.cli(mod.Args, args=run), mod.Args(output_dir=str(tmp_path))):
        for key, value in mod.CPU_DEFAULTS.items():
            assert getattr(args, key) == value, key
    mod.start_run(mod.Args(output_dir=str(tmp_path)), mod.CPU_DEFAULTS)
    notice = capsys.readouterr().out
    assert "No CUDA" in notice
    for key, value in mod.CPU_DEFAULTS.items():
        if getattr(official, key) != value:
            assert f"{key}=" in notice, key
    # every key given the official value: on the command line, and as keywords
    argv = run + [
        a
        for i, key in enumerate(mod.CPU_DEFAULTS)
        for a in as_argv(key, getattr(official, key), i % 2)
    ]
    keywords = {key: getattr(official, key) for key in mod.CPU_DEFAULTS}
    from_argv = tyro.cli(mod.Args, args=argv)
    from_python = mod.Args(output_dir=str(tmp_path), **keywords)
    assert from_argv == from_python
    # main() keeps them to start_run (resolve and the start checks change nothing given)

    def started(args, cpu_defaults):
        raise Started(args)

    monkeypatch.setattr(mod, "start_run", started)
    expected = dataclasses.replace(official)
    if hasattr(mod, "resolve"):  # a None is a flag left to the official scripts' table
        expected = mod.resolve(expected)
    for args in (from_argv, from_python):
        with pytest.raises(Started) as stop:
            mod.main(args)
        for key in mod.CPU_DEFAULTS:
            assert getattr(stop.value.run_args, key) == getattr(expected, key), key
    monkeypatch.undo()
    mod.start_run(from_python, mod.CPU_DEFAULTS)
    notice = capsys.readouterr().out
    for key, value in mod.CPU_DEFAULTS.items():
        if getattr(official, key) != value:
            assert f" {key}=" not in notice, key


def readme_flags(name: str) -> set[str]:
    """The flags in the rows of `name`'s experiment-map table in the README."""
    text = (REPO / "README.md").read_text()
    start = text.index(MAP_HEADINGS[name], text.index("## Experiment maps"))
    end = min(
        (
            text.find(h, start + 1)
            for h in list(MAP_HEADINGS.values()) + ["\n## "]
            if text.find(h, start + 1) > 0
        ),
        default=len(text),
    )
    rows = [
        line for line in text[start:end].splitlines() if line.startswith("|")
    ]  # the map's table
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(rows)))


@pytest.mark.parametrize("name", FILES)
def test_help_lists_the_readme_experiment_flags(name):
    done = subprocess.run(
        [sys.executable, f"{name}.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    flags = readme_flags(name)
    assert flags, f"no experiment map for {name} in the README"
    missing = [
        f
        for f in sorted(flags)
        if f not in done.stdout
        and f"--no-{f[5:]}" not in done.stdout
        and not (f.startswith("--no-") and f"--{f[5:]}" in done.stdout)
    ]
    assert not missing, f"{name}.py --help lacks the README's {missing}"


@pytest.mark.parametrize("name", LEAN_FILES)
def test_stops_at_once_without_lean(name, tmp_path):
    """No Lean toolchain, no Kimina server, no stand-in: the run stops before loading any model, and says how to get
    Lean."""
    lean_verify = module("lean_verify")
    if lean_verify.lean_available():
        pytest.skip("a Lean toolchain is configured here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAN_", "KIMINA_", "SGS_"))}
    done = subprocess.run(
        [sys.executable, f"{name}.py", "--output-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "setup.sh --lean" in done.stderr and "LEAN_REPL_CMD" in done.stderr
    assert "Loading weights" not in done.stderr + done.stdout  # it stopped before loading any model


# ---- two ranks = one rank, resume after a kill (slow): the same checks on each file's reference run ----
def not_timing(key: str) -> bool:
    return not key.startswith("time/")


@dataclasses.dataclass(frozen=True)
class Family:
    """What a file's reference run (conftest.py) must reproduce on two ranks and after a kill and a resume."""

    steps: tuple  # the steps of the reference run's metrics.jsonl, one line each
    saved: str  # what the two-rank run's last checkpoint holds (a .dcp directory: a shard of each rank)
    reference: Callable[
        [dict], bool
    ]  # the reference run did what the comparison needs (step -> metrics)
    deterministic: Callable[[str], bool] = (
        not_timing  # the metrics both runs log and a resumed run reproduces
    )
    resume_tolerance: dict | None = None  # pytest.approx's rel/abs; None: exactly equal
    two_ranks_left_out: Callable[[str], bool] = lambda key: (
        False
    )  # deterministic metrics two ranks do not reproduce
    # two ranks: the same samples (seeded by position, not rank) and verdicts; FSDP2 sums in another order
    two_ranks_tolerance: dict = dataclasses.field(
        default_factory=lambda: {"rel": 1e-3, "abs": 1e-4}
    )
    stdout: tuple = ()  # (what the one-rank run prints, what the two-rank run prints)
    weights: tuple = ()  # the checkpoint's models whose weights two ranks reproduce, to weights_tolerance
    weights_tolerance: dict = dataclasses.field(default_factory=dict)
    resumed_weights: tuple = ()  # the checkpoint's models whose weights a resumed run reproduces bit for bit
    records: str = ""  # a .jsonl file of records both checks reproduce (records_after_resume: the resume check too)
    record_fields: tuple = ()  # the fields compared (empty: all but record_floats)
    record_floats: tuple = ()  # float fields compared to abs 1e-5 (embeddings computed in other batches)
    records_after_resume: bool = False


FAMILY = {
    "sgs": Family(
        steps=(1, 2),
        saved="solver/model.safetensors",
        reference=lambda rows: (
            rows[1]["charts/targets_attempted"] == 6 and rows[1]["conjecturer/selected"] >= 1
        ),
        # a different sample or verdict would move these far more than float32 rounding does
        two_ranks_tolerance={"rel": 1e-4, "abs": 1e-9},
    ),
    "stp": Family(
        steps=(1, 2),
        saved="policy.dcp",
        reference=lambda rows: rows[1]["charts/problems"] == 6 and rows[2]["conjecturer/seeds"] > 0,
        stdout=(
            "lean_verify: 2 REPL(s) on each of the node's 1 rank(s)",
            "lean_verify: 1 REPL(s) on each of the node's 2 rank(s)",
        ),  # --lean-workers 2, a node's
        # a proof's weight counts its Lean wall-clock seconds (--time-penalty): the loss from run to run too
        resume_tolerance={"rel": 1e-3, "abs": 1e-4},
    ),
    "gasp": Family(
        steps=(1, 2),
        saved="state.pt",
        reference=lambda rows: (
            rows[1]["charts/lemma_proposals"] >= 2
        ),  # both ranks' proposals gathered
        records="proposals.jsonl",
        record_floats=("max_similarity",),
        # a resumed buffer's features are embedded again, in other batches: 1e-7 apart
        resume_tolerance={"rel": 1e-6},
    ),
    "eva": Family(
        steps=(0, 1, 2),
        saved="policy.dcp",
        reference=lambda rows: rows[2]["creator/evolved"] > 0,
        # FSDP2's last bits decide the sign of h = 0 at the first step: the accuracy (h > 0) is left out
        two_ranks_left_out=lambda key: key == "losses/accuracy",
    ),
    "coprover": Family(
        steps=(1, 2),
        saved="value.dcp",
        reference=lambda rows: rows[1]["search/pass@1"] > 0,
        deterministic=lambda key: (
            not_timing(key) and not any(word in key for word in ("time", "second"))
        ),
        resume_tolerance={"rel": 1e-6},
        two_ranks_tolerance={"rel": 1e-3, "abs": 1e-6},
        # both models; two ranks also export the tied lm_head.weight, which one rank's leaves out
        weights=("prover", "value"),
        weights_tolerance={"rtol": 1e-3, "atol": 1e-5},
    ),
    "rir": Family(
        steps=(1, 2),
        saved="policy.dcp",
        reference=lambda rows: rows[1]["selfplay/proved"] > 0,
        # search_metrics' seconds and search times are wall clock
        deterministic=lambda key: not any(word in key for word in ("time", "second")),
        # (its gradient norm, summed over FSDP2's shards in another order, lands 1e-4 apart)
        two_ranks_tolerance={"rel": 1e-4},
        two_ranks_left_out=lambda key: key == "losses/grad_norm",
        weights=("policy",),
        weights_tolerance={"atol": 1e-5},
        resumed_weights=("policy",),
        records="searches.jsonl",
        record_fields=("step", "phase", "id", "proved", "proof", "expansions", "nodes"),
        records_after_resume=True,
    ),
}


def run(command: Callable, run_dir: pathlib.Path, *flags, ranks=0) -> subprocess.CompletedProcess:
    cmd, env = command(run_dir, *flags, ranks=ranks)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def metrics_by_step(run_dir: pathlib.Path, once: bool = True) -> dict:
    """step -> its metrics; `once`: each step logged once (a resumed run may log again the step it was killed in)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if once:
        steps = [row["step"] for row in rows]
        assert len(set(steps)) == len(steps), steps
    return {row["step"]: row for row in rows}  # the last line of a step


def differences(
    a: dict, b: dict, family: Family, tolerance: dict | None, left_out=lambda key: False
) -> dict:
    """The deterministic metrics of a and b (both must log the same ones) that differ beyond `tolerance`."""
    a, b = ({k: v for k, v in row.items() if family.deterministic(k)} for row in (a, b))
    assert a.keys() == b.keys(), set(a) ^ set(b)
    same = (
        (lambda x, y: x == y)
        if tolerance is None
        else (lambda x, y: x == pytest.approx(y, **tolerance))
    )
    return {k: (a[k], b[k]) for k in a if not left_out(k) and not same(a[k], b[k])}


def records_of(run_dir: pathlib.Path, family: Family) -> tuple[list, list]:
    """The records of family.records: (the exactly reproduced part of each, their float fields)."""
    rows = [json.loads(line) for line in (run_dir / family.records).read_text().splitlines()]
    floats = [
        row.pop(k, -2.0) for row in rows for k in family.record_floats
    ]  # (-2: a record without one)
    return [
        {k: row[k] for k in family.record_fields} if family.record_fields else row for row in rows
    ], floats


def weights_of(checkpoint: pathlib.Path, model: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(next((checkpoint / model).glob("*.safetensors"))))


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_two_ranks_reproduce_one_rank(name, request, tmp_path):
    """The same seed on one rank and on two (FSDP2 over gloo, CPU): the same metrics, records and weights."""
    import torch

    family, reference = FAMILY[name], request.getfixturevalue(f"{name}_reference")
    run_dir = tmp_path / "ranks2"
    done = run(reference.command, run_dir, ranks=2)
    last = f"iter_{family.steps[-1]:06d}"
    saved = run_dir / "checkpoints" / last / family.saved
    assert saved.exists() and (saved.suffix != ".dcp" or len(list(saved.glob("*.distcp"))) == 2), (
        saved
    )
    one, two = metrics_by_step(reference.run_dir), metrics_by_step(run_dir)
    assert tuple(one) == tuple(two) == family.steps
    assert family.reference(one), one
    if family.stdout:
        assert family.stdout[0] in reference.done.stdout and family.stdout[1] in done.stdout
    for step in family.steps:
        differ = differences(
            two[step], one[step], family, family.two_ranks_tolerance, family.two_ranks_left_out
        )
        assert not differ, (step, differ)
    for model in family.weights:
        two_w, one_w = (
            weights_of(d / "checkpoints" / last, model) for d in (run_dir, reference.run_dir)
        )
        assert set(one_w) <= set(two_w) and len(one_w) > 10, model
        assert all(torch.allclose(two_w[k], one_w[k], **family.weights_tolerance) for k in one_w), (
            model
        )
    if family.records:
        (records, floats), (records_one, floats_one) = (
            records_of(d, family) for d in (run_dir, reference.run_dir)
        )
        assert records == records_one and floats == pytest.approx(floats_one, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_resume_after_a_kill_continues_exactly(name, request, tmp_path):
    """SIGKILL once the first checkpoint is whole (directories are renamed in whole), before the last, then --resume:
    the RNGs, optimizer and run state restored, the run logs, records and saves what the uninterrupted run did."""
    import torch

    family, reference = FAMILY[name], request.getfixturevalue(f"{name}_reference")
    run_dir = tmp_path / "killed"
    first, last = (run_dir / "checkpoints" / f"iter_{i:06d}" for i in (1, family.steps[-1]))
    cmd, env = reference.command(run_dir)
    process = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # its REPLs and sandboxes in its process group
    try:
        deadline = time.time() + 900
        while not first.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert first.exists(), "no checkpoint was written"
    assert (first / "state.pt").exists() and not last.exists(), (
        "killed too late: the last iteration had finished"
    )
    done = run(reference.command, run_dir, "--resume")
    assert f"resuming {run_dir} after iteration 1" in done.stdout
    resumed, full = metrics_by_step(run_dir, once=False), metrics_by_step(reference.run_dir)
    assert tuple(sorted(resumed)) == family.steps
    for step in family.steps:
        differ = differences(resumed[step], full[step], family, family.resume_tolerance)
        assert not differ, (step, differ)
    for model in family.resumed_weights:
        a, b = (
            weights_of(d / "checkpoints" / last.name, model) for d in (run_dir, reference.run_dir)
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model
    if family.records_after_resume:
        assert records_of(run_dir, family) == records_of(reference.run_dir, family)
