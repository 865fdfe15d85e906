"""The infrastructure block (identical in every algorithm file), tested once, on its own.

Fast tests use the `tiny_model_dir` fixture; the FSDP2 path runs under `torchrun --nproc_per_node 2` with gloo on
CPU (`slow`); the vLLM path runs against a double of vLLM 0.25.1 (tests/vllm_double) that enforces the engine's
sleep/wake rules."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from _block import REPO, block_source, load_block

try:
    block_source()
except FileNotFoundError:
    pytest.skip("no algorithm file yet", allow_module_level=True)

B = load_block()
ONE = B.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_micro_batches_same_count_on_every_rank():
    items = list(range(7))
    per_rank = [B.micro_batches(items, 2, B.Dist(r, r, 3, torch.device("cpu"))) for r in range(3)]
    # 7 items over 3 ranks: 3, 2, 2 items -> ceil(ceil(7/3)/2) = 2 batches each
    assert [len(p) for p in per_rank] == [2, 2, 2]
    assert per_rank[0] == [([0, 3], 3 / 7), ([6], 3 / 7)]
    assert per_rank[1] == [([1, 4], 3 / 7), ([0], 0.0)]  # padding batch: weight 0
    real = sorted(x for p in per_rank for batch, scale in p if scale for x in batch)
    assert real == items  # every item trained exactly once
    # world size 1: the scale makes sum-of-losses * scale the mean
    assert B.micro_batches(items, 4, ONE) == [([0, 1, 2, 3], 1 / 7), ([4, 5, 6], 1 / 7)]
    assert B.micro_batches([], 4, ONE) == []


def test_stopwatch_and_shard():
    sw = B.Stopwatch()
    with sw("a"):
        pass
    with sw("a"):
        pass
    out = sw.pop()
    assert set(out) == {"time/a"} and out["time/a"] >= 0 and sw.pop() == {}
    assert B.shard(list(range(5)), B.Dist(1, 1, 2, torch.device("cpu"))) == [1, 3]


def test_cut_at_stop():
    assert B._cut_at_stop("abc```def```", ["```"]) == ("abc", True)
    assert B._cut_at_stop("abc", ["x"]) == ("abc", False)
    assert B._cut_at_stop("abc", None) == ("abc", False)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    torch.manual_seed(0)
    tok = B.load_tokenizer(tiny_model_dir)
    model = B.load_model(tiny_model_dir, ONE, train=True)
    return tiny_model_dir, tok, model


def test_hf_sampler_logprobs_match_the_policy(tiny):
    """The sampler's per-token log-probs are those of the sampling distribution: recomputing them with the policy
    at the same temperature gives the same numbers (top_p=1, so temperature is the only processing)."""
    path, tok, model = tiny
    sampler = B.make_sampler(path, model, tok, ONE, backend="hf", batch_size=3)
    prompts = [B.chat_prompt(tok, "Say hi."), B.chat_prompt(tok, "Add 2 and 3, then explain at length.")]
    out = sampler.generate(prompts, n=2, temperature=0.7, max_new_tokens=12)
    assert [len(x) for x in out] == [2, 2]
    flat = [s for group in out for s in group]
    for s in flat:
        assert len(s.token_ids) == len(s.logprobs) >= 1 and s.finish_reason in ("stop", "length")
        assert s.prompt_ids == B.encode_prompt(tok, prompts[out.index(next(g for g in out if s in g))])
        assert all(lp <= 0 for lp in s.logprobs)
    logp, mask, ent = B.token_logprobs(model, flat, temperature=0.7, micro_batch=3, with_entropy=True)
    assert logp.shape == mask.shape == ent.shape == (4, max(len(s.token_ids) for s in flat))
    for row, s in enumerate(flat):
        L = len(s.token_ids)
        assert mask[row].sum() == L
        assert torch.allclose(logp[row, :L], torch.tensor(s.logprobs), atol=2e-3), (logp[row, :L], s.logprobs)
        assert (ent[row, :L] > 0).all()
    assert logp.requires_grad and not ent.requires_grad  # entropy for logging only, by default
    _, _, ent_grad = B.token_logprobs(model, flat[:1], temperature=0.7, with_entropy=True, entropy_grad=True)
    assert ent_grad.requires_grad  # for an entropy bonus in the loss


def test_one_sampler_serves_several_roles(tiny, tiny_model_dir):
    """sync_weights(policy) decides whose weights the next generation uses (SGS shares one engine among roles)."""
    path, tok, model = tiny
    other = B.load_model(tiny_model_dir, ONE, train=False)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    sampler = B.make_sampler(path, model, tok, ONE, backend="hf")
    prompt = [B.chat_prompt(tok, "hi")]
    torch.manual_seed(0)
    a = sampler.generate(prompt, temperature=0, max_new_tokens=8)[0][0]
    sampler.sync_weights(other)
    b = sampler.generate(prompt, temperature=0, max_new_tokens=8)[0][0]
    sampler.sync_weights(model)
    c = sampler.generate(prompt, temperature=0, max_new_tokens=8)[0][0]
    assert a.token_ids == c.token_ids != b.token_ids


def test_token_logprobs_gradient_reaches_the_weights(tiny):
    path, tok, model = tiny
    s = B.Sample("x", B.encode_prompt(tok, "hello"), [5, 6, 7], [0.0, 0.0, 0.0], "length")
    logp, mask, _ = B.token_logprobs(model, [s])
    (-(logp * mask).sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


def test_checkpoint_round_trip(tmp_path, tiny_model_dir):
    tok = B.load_tokenizer(tiny_model_dir)
    model = B.load_model(tiny_model_dir, ONE)
    opt = B.make_optimizer(model, 1e-3)
    s = B.Sample("x", [1, 2, 3], [4, 5], [0.0, 0.0], "stop")
    for step in range(2):
        logp, mask, _ = B.token_logprobs(model, [s])
        (-(logp * mask).sum()).backward()
        B.optimizer_step(model, opt, 1.0)
        B.save_checkpoint(tmp_path, step + 1, {"policy": (model, opt)}, tok, {"buffer": [step]}, ONE)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    expected_next = torch.rand(3)
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text() == "iter_000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_000001", "iter_000002", "latest"]  # no temp dirs
    assert (ckpts / "iter_000002" / "policy" / "config.json").exists()
    # a fresh model and optimizer resume exactly: same weights, same Adam moments, same RNG stream
    fresh = B.load_model(tiny_model_dir, ONE)
    fresh_opt = B.make_optimizer(fresh, 1e-3)
    torch.manual_seed(123)
    iteration, state = B.load_checkpoint(tmp_path, {"policy": (fresh, fresh_opt)}, ONE)
    assert iteration == 2 and state == {"buffer": [1]}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, after[k]), k
    assert torch.equal(torch.rand(3), expected_next)
    st = fresh_opt.state_dict()["state"]
    assert st and all(v["step"] == 2 for v in st.values())
    # the saved HF directory loads with plain transformers
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpts / "iter_000002" / "policy")
    for i in range(3, 6):
        B.save_checkpoint(tmp_path, i, {"policy": (model, opt)}, tok, {}, ONE, keep=2)
    assert sorted(p.name for p in ckpts.glob("iter_*")) == ["iter_000004", "iter_000005"]
    assert B.load_checkpoint(tmp_path / "nothing", {"policy": (fresh, fresh_opt)}, ONE) is None


def test_logger(tmp_path):
    log = B.Logger(tmp_path, {"lr": 1e-6}, ONE)
    log.log({"charts/x": 1, "losses/y": torch.tensor(2.5).item(), "note": "a"}, step=3)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 3, "charts/x": 1.0, "losses/y": 2.5, "note": "a"}]
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-6}


@pytest.fixture
def vllm_double(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests" / "vllm_double"))
    sys.modules.pop("vllm", None)
    import vllm

    vllm.CALLS.clear()
    yield vllm
    sys.modules.pop("vllm", None)


def test_vllm_sampler_call_sequence(tiny, vllm_double):
    """Against the vLLM double: engine arguments, sleep level 2 at start, wake weights -> load -> wake KV cache ->
    reset prefix cache on every sync, generation only with fresh weights, never a reload from disk."""
    path, tok, model = tiny
    sampler = B.make_sampler(path, model, tok, ONE, backend="vllm", gpu_memory_utilization=0.3, seed=7)
    calls = vllm_double.CALLS
    name, kwargs = calls[0]
    assert name == "LLM"
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["enable_sleep_mode"] is True
    assert kwargs["seed"] == 7 and kwargs["gpu_memory_utilization"] == 0.3
    names = [c[0] for c in calls]
    n_params = len(model.state_dict())
    assert names == ["LLM", "sleep", "wake_up"] + ["load_weights"] * n_params + ["wake_up", "reset_prefix_cache"]
    assert calls[1] == ("sleep", 2) and calls[2] == ("wake_up", ("weights",)) and calls[-2] == ("wake_up", ("kv_cache",))
    out = sampler.generate(["a", "b"], n=3, temperature=1.0, max_new_tokens=5)
    assert [len(g) for g in out] == [3, 3]
    s = out[0][0]
    assert len(s.token_ids) == len(s.logprobs) and s.prompt_ids == B.encode_prompt(tok, "a")
    sampler.sleep()
    with pytest.raises(RuntimeError, match="sync_weights"):
        sampler.generate(["a"])  # level 2 dropped the weights: generating now would be gibberish
    calls.clear()
    sampler.sync_weights(model)
    assert calls[0] == ("wake_up", ("weights",)) and calls[-2:] == [("wake_up", ("kv_cache",)), ("reset_prefix_cache", None)]
    sampler.generate(["a"])
    assert not any(c == ("collective_rpc", "reload_weights") for c in vllm_double.CALLS)
    # a long prompt gets a smaller token budget instead of a rejected request (max_model_len 4096 by default)
    [[long]] = sampler.generate([" ".join(["word"] * 5000)], max_new_tokens=4000)
    assert len(long.prompt_ids) == 4095 and 1 <= len(long.token_ids) <= 1
    engine_model = sampler.llm.model
    for k, v in model.state_dict().items():
        assert torch.equal(engine_model.loaded[k], v.to(torch.bfloat16))


def test_vllm_frozen_sampler_sleeps_at_level_one(tiny, vllm_double):
    path, tok, _ = tiny
    sampler = B.make_sampler(path, None, tok, ONE, backend="vllm")
    sampler.sleep()  # already asleep after construction: no second call
    assert [c for c in vllm_double.CALLS if c[0] == "sleep"] == [("sleep", 1)]
    sampler.generate(["x"])  # level 1 kept the weights: a plain wake-up is enough
    assert ("wake_up", None) in vllm_double.CALLS


@pytest.mark.slow
def test_embedded_model_resolves_and_generates():
    path = B.resolve_model(B.EMBEDDED_MODEL)
    assert (pathlib.Path(path) / "config.json").exists()
    tok = B.load_tokenizer(B.EMBEDDED_MODEL)
    model = B.load_model(B.EMBEDDED_MODEL, ONE, train=False)
    sampler = B.make_sampler(B.EMBEDDED_MODEL, model, tok, ONE, backend="hf")
    [[s]] = sampler.generate([B.chat_prompt(tok, "What is 2+2? Answer with a number.")], temperature=0,
                             max_new_tokens=16)
    assert "4" in s.text and s.finish_reason == "stop"


@pytest.mark.slow
def test_fsdp2_two_ranks_on_cpu(tmp_path, tiny_model_dir):
    """FSDP2 (`fully_shard`) with gloo under torchrun: sharded training step, weight sync into each rank's
    sampler copy, full-state-dict checkpoint and resume, equal micro-batch counts."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
         str(REPO / "tests" / "fsdp_worker.py"), tiny_model_dir, str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["changed"] and result["synced"] and result["resumed_equal"]
    assert math.isfinite(result["grad_norm"])
