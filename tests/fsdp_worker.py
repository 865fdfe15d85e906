"""Run by tests/test_infrastructure.py under `torchrun --nproc_per_node 2`: the FSDP2 path of the block on CPU."""

import json
import pathlib
import sys

import torch

from _block import load_block

B = load_block()
model_dir, out = sys.argv[1], pathlib.Path(sys.argv[2])
dist = B.setup_distributed(seed=1)
assert dist.world_size == 2
tok = B.load_tokenizer(model_dir)
policy = B.prepare_policy(B.load_model(model_dir, dist), dist, gradient_checkpointing=True)
from torch.distributed.fsdp import FSDPModule  # noqa: E402

assert isinstance(policy, FSDPModule)
opt = B.make_optimizer(policy, 1e-2)
sampler = B.make_sampler(model_dir, policy, tok, dist, backend="hf")
before = {k: v.clone() for k, v in B.full_state_dict_items(policy)}
# rank-specific samples, uneven counts: 3 items -> rank 0 has 2, rank 1 has 1, both run 1 micro-batch of 2
groups = sampler.generate([B.chat_prompt(tok, f"question {i}") for i in range(3)], n=1, max_new_tokens=6)
items = [g[0] for g in B.all_gather_objects(groups, dist)[0]]  # rank 0's samples, the same list on every rank
for batch, scale in B.micro_batches(items, 2, dist):
    logp, mask, _ = B.token_logprobs(policy, batch)
    (-(logp * mask).sum() * scale).backward()
norm = B.optimizer_step(policy, opt, 1.0)
after = {k: v.clone() for k, v in B.full_state_dict_items(policy)}
changed = any(not torch.equal(before[k], after[k]) for k in before)
sampler.sync_weights(policy)
own = sampler.model.state_dict()
synced = all(torch.equal(own[k], after[k]) for k in after if k in own)
B.save_checkpoint(out, 1, {"policy": (policy, opt)}, tok, {"n": 1}, dist)
fresh = B.prepare_policy(B.load_model(model_dir, dist), dist)
fresh_opt = B.make_optimizer(fresh, 1e-2)
iteration, state = B.load_checkpoint(out, {"policy": (fresh, fresh_opt)}, dist)
resumed = {k: v for k, v in B.full_state_dict_items(fresh)}
resumed_equal = iteration == 1 and state == {"n": 1} and all(torch.equal(resumed[k], after[k]) for k in after)
results = B.all_gather_objects({"changed": changed, "synced": synced, "resumed_equal": resumed_equal,
                                "grad_norm": norm}, dist)
if dist.is_main:
    assert results[0]["grad_norm"] == results[1]["grad_norm"]
    merged = {k: all(r[k] for r in results) for k in ("changed", "synced", "resumed_equal")}
    (out / "result.json").write_text(json.dumps({**merged, "grad_norm": norm}))
B.finish(dist)
