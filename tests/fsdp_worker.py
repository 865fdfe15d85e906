"""Run by tests/test_infrastructure.py under `torchrun --nproc_per_node 2`: the FSDP2 path of the block on CPU.

argv: model_dir, out_dir, backend ("hf": each rank's full sampler copy; "vllm": the vLLM double on PYTHONPATH)."""

import json
import pathlib
import sys

import torch
from _block import load_block
from torch.distributed.fsdp import FSDPModule

B = load_block()
model_dir, out, backend = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
dist = B.setup_distributed(seed=1)
assert dist.world_size == 2
tok = B.load_tokenizer(model_dir)
policy = B.load_model(model_dir, dist, gradient_checkpointing=True)  # only rank 0 reads the weights
assert isinstance(policy, FSDPModule)
from transformers import AutoModelForCausalLM  # noqa: E402

plain = AutoModelForCausalLM.from_pretrained(model_dir)
loaded = dict(B.full_state_dict_items(policy))
same_as_plain = all(torch.equal(loaded[k], v) for k, v in plain.state_dict().items()) and all(
    torch.equal(a, b) for a, b in zip(policy.buffers(), plain.buffers())
)  # rotary frequencies: rank 0's
opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
sampler = B.Sampler(model_dir, policy, tok, dist, backend=backend)
before = {k: v.clone() for k, v in B.full_state_dict_items(policy)}
# rank-specific samples, uneven counts: 3 items -> rank 0 has 2, rank 1 has 1, both run 1 micro-batch of 2
groups = sampler.generate(
    [B.chat_prompt(tok, f"question {i}") for i in range(3)], n=1, max_new_tokens=6
)
items = [
    g[0] for g in B.all_gather_objects(groups, dist)[0]
]  # rank 0's samples, the same list on every rank
tokens = sum(len(s.token_ids) for s in items)  # the whole batch's denominator


def loss_fn(micro):
    logp, mask, _ = B.token_logprobs(policy, micro)
    return -(logp * mask).sum() / tokens, {"tokens": float(mask.sum())}


stats = B.train_step(
    policy, opt, items, loss_fn, 2, 1.0, dist, length=lambda s: len(s.prompt_ids) + len(s.token_ids)
)
norm = stats["grad_norm"]
assert stats["tokens"] == tokens  # the statistics are summed over the ranks
after = {k: v.clone() for k, v in B.full_state_dict_items(policy)}
changed = any(not torch.equal(before[k], after[k]) for k in before)
sampler.sync_weights(policy)
if (
    backend == "vllm"
):  # the sharded names arrived as checkpoint names with full shapes (the double checks both)
    loaded = sampler.llm.model.loaded
    synced = all(
        torch.equal(loaded[k], after[k].to(torch.bfloat16)) for k in after if k != "lm_head.weight"
    )
else:
    own = sampler.model.state_dict()
    synced = all(torch.equal(own[k], after[k]) for k in after if k in own)
result = {"changed": changed, "synced": synced, "grad_norm": norm, "same_as_plain": same_as_plain}
if backend == "hf":
    with torch.no_grad():  # a forward without backward (e.g. scoring) right before the checkpoint
        B.token_logprobs(policy, items[:1])
    B.save_checkpoint(out, 1, {"policy": (policy, opt)}, tok, {"n": 1}, dist)
    fresh = B.load_model(model_dir, dist)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    iteration, state = B.load_checkpoint(out, {"policy": (fresh, fresh_opt)}, dist)
    resumed = dict(B.full_state_dict_items(fresh))
    result["resumed_equal"] = (
        iteration == 1
        and state == {"n": 1}
        and all(torch.equal(resumed[k], after[k]) for k in after)
    )
    result["sharded_map"] = B.map_sharded(
        lambda xs: [x * 10 + dist.rank for x in xs], [1, 2, 3], dist
    ) == [10, 21, 30]
results = B.all_gather_objects(result, dist)
if dist.is_main:
    assert results[0]["grad_norm"] == results[1]["grad_norm"]
    merged = {k: all(r[k] for r in results) for k in result if k != "grad_norm"}
    (out / "result.json").write_text(json.dumps({**merged, "grad_norm": norm}))
