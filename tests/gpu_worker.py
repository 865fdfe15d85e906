"""Run by tests/test_infrastructure.py::test_gpu_vllm_greedy_survives_sleep_and_sync under torchrun on GPUs (vLLM):
greedy output is identical before and after sleep(level 2) + sync, and vLLM's processed log-probs stay close to
token_logprobs of the same weights (bf16 engine, so the tolerance is loose). argv: model_dir, out_dir."""

import json
import pathlib
import sys

import torch

from _block import load_block

B = load_block()
model_dir, out = sys.argv[1], pathlib.Path(sys.argv[2])
dist = B.setup_distributed(seed=0)
tok = B.load_tokenizer(model_dir)
policy = B.load_model(model_dir, dist)
sampler = B.Sampler(model_dir, policy, tok, dist, backend="vllm", max_model_len=512, gpu_memory_utilization=0.3)
prompts = [B.chat_prompt(tok, f"Count to {i}.") for i in range(4)]
first = sampler.generate(prompts, temperature=0, max_new_tokens=32)
sampler.sleep()  # level 2: the weights are dropped
sampler.sync_weights(policy)
second = sampler.generate(prompts, temperature=0, max_new_tokens=32)
greedy_equal = all(a[0].token_ids == b[0].token_ids for a, b in zip(first, second))
sampled = [g[0] for g in sampler.generate(prompts, temperature=0.7, max_new_tokens=32)]
with torch.no_grad():
    logp, mask, _ = B.token_logprobs(policy, sampled, temperature=0.7)
diff = max((logp[i, : len(s.token_ids)].float().cpu() - torch.tensor(s.logprobs)).abs().mean().item()
           for i, s in enumerate(sampled))
results = B.all_gather_objects({"greedy_equal": greedy_equal, "diff": diff}, dist)
if dist.is_main:
    (out / "result.json").write_text(json.dumps({"greedy_equal": all(r["greedy_equal"] for r in results),
                                                 "max_logprob_diff": max(r["diff"] for r in results)}))
