"""The checks every algorithm file shares, written once and run for each of the six: the CPU scaling of the defaults
keeps every flag that was passed, `--help` lists every flag the README's experiment maps use, and a Lean file stops at
once, with a clear message, when there is no Lean. (Two ranks against one rank and resume after a kill run in each
file's end-to-end tests, where its own run set-up and reference run live: issue 17 asks for them here too, not done.)"""

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
FILES = ["sgs", "stp", "gasp", "eva", "coprover", "rir"]
LEAN_FILES = ["sgs", "stp", "coprover", "rir"]
MAP_HEADINGS = {"sgs": "**SGS**", "stp": "**STP**", "gasp": "**GASP**", "eva": "**eva**", "coprover": "**CoProver**",
                "rir": "**RiR**"}


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


@pytest.mark.parametrize("name", FILES)
def test_cpu_defaults_keep_every_given_flag(name, tmp_path, capsys, monkeypatch):
    """Without CUDA, CPU_DEFAULTS replace the paper's sizes; a flag passed on the command line keeps its value, for
    every key of CPU_DEFAULTS at once (booleans as --x and --no-x included), and the notice names what was scaled."""
    import tyro

    mod = module(name)
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    paper = mod.Args()
    run = ["--output-dir", str(tmp_path)]
    # nothing passed: every key takes its CPU value
    args = tyro.cli(mod.Args, args=run)
    mod.start_run(args, mod.CPU_DEFAULTS, run)
    notice = capsys.readouterr().out
    for key, value in mod.CPU_DEFAULTS.items():
        assert getattr(args, key) == value, key
        if getattr(paper, key) != value:
            assert f"  {key}: " in notice, key
    # every key passed with the paper's value: nothing is scaled
    argv = run + [a for i, key in enumerate(mod.CPU_DEFAULTS) for a in as_argv(key, getattr(paper, key), i % 2)]
    args = tyro.cli(mod.Args, args=argv)
    mod.start_run(args, mod.CPU_DEFAULTS, argv)
    assert "No CUDA" not in capsys.readouterr().out
    for key in mod.CPU_DEFAULTS:
        assert getattr(args, key) == getattr(paper, key), key


def readme_flags(name: str) -> set[str]:
    """The flags in the rows of `name`'s experiment-map table in the README."""
    text = (REPO / "README.md").read_text()
    start = text.index(MAP_HEADINGS[name], text.index("## Experiment maps"))
    end = min((text.find(h, start + 1) for h in list(MAP_HEADINGS.values()) + ["\n## "]
               if text.find(h, start + 1) > 0), default=len(text))
    rows = [line for line in text[start:end].splitlines() if line.startswith("|")]  # the map's table
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(rows)))


@pytest.mark.parametrize("name", FILES)
def test_help_lists_the_readme_experiment_flags(name):
    done = subprocess.run([sys.executable, f"{name}.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-3000:]
    flags = readme_flags(name)
    assert flags, f"no experiment map for {name} in the README"
    missing = [f for f in sorted(flags) if f not in done.stdout and f"--no-{f[5:]}" not in done.stdout
               and not (f.startswith("--no-") and f"--{f[5:]}" in done.stdout)]
    assert not missing, f"{name}.py --help lacks the README's {missing}"


@pytest.mark.parametrize("name", LEAN_FILES)
def test_stops_at_once_without_lean(name, tmp_path):
    """No Lean toolchain, no Kimina server, no stand-in: the run stops before loading any model, and says how to get
    Lean."""
    lean_verify = module("lean_verify")
    if lean_verify.lean_available():
        pytest.skip("a Lean toolchain is configured here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAN_", "KIMINA_", "SGS_"))}
    done = subprocess.run([sys.executable, f"{name}.py", "--output-dir", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "setup.sh --lean" in done.stderr and "LEAN_REPL_CMD" in done.stderr
    assert "Loading weights" not in done.stderr + done.stdout  # it stopped before loading any model
