"""Run by tests/test_infrastructure.py::test_gpu_vllm_greedy_survives_sleep_and_sync under torchrun on GPUs (vLLM).

The engine is built (it sleeps at level 2 right away), the policy takes one training step (its weights now differ from
the files the engine read), the engine sleeps and wakes with the trained weights: its greedy output must equal
greedy generation from the same trained weights that never went through a sleep (plain transformers, float32 like the
engine), so weights or buffers lost in the sleep/wake cycle show. vLLM's processed log-probs must stay close to
token_logprobs of the same weights. The engine runs vLLM's default model runner for the model (V2 for dense models on
GPUs in 0.25.1). argv: model_dir, out_dir."""

import json
import pathlib
import sys

import torch
from _block import load_block
from transformers import AutoModelForCausalLM

B = load_block()
model_dir, out = sys.argv[1], pathlib.Path(sys.argv[2])
dist = B.setup_distributed(seed=0)
tok = B.load_tokenizer(model_dir)
policy = B.load_model(model_dir, dist)
sampler = B.Sampler(
    model_dir,
    policy,
    tok,
    dist,
    backend="vllm",
    max_model_len=512,
    gpu_memory_utilization=0.3,
    dtype="float32",
)
prompts = [B.chat_prompt(tok, f"Count to {i}.") for i in range(4)]
target = tok(" one two three", add_special_tokens=False).input_ids * 4
batch = [
    B.Sample("", B.encode_prompt(tok, p), target, [0.0] * len(target), "length") for p in prompts
]
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
sampler.sleep()
B.train_step(
    policy,
    optimizer,
    batch,
    lambda micro: (-B.token_logprobs(policy, micro)[0].sum() / 64, {}),
    4,
    1.0,
    dist,
)
sampler.sync_weights(policy)  # wake the weights, load the trained ones, wake the KV cache
after = [g[0].token_ids for g in sampler.generate(prompts, temperature=0, max_new_tokens=32)]

reference = (
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dist.device).eval()
)
reference.load_state_dict({k: v.float() for k, v in B.full_state_dict_items(policy)})  # never slept
expected = []
with torch.no_grad():
    for p in prompts:
        ids = torch.tensor([B.encode_prompt(tok, p)], device=dist.device)
        seq = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=tok.pad_token_id,
        )
        expected.append(seq[0, ids.shape[1] :].tolist())
sampled = [g[0] for g in sampler.generate(prompts, temperature=0.7, max_new_tokens=32)]
with torch.no_grad():
    logp, mask, _ = B.token_logprobs(policy, sampled, temperature=0.7)
diff = max(
    (logp[i, : len(s.token_ids)].float().cpu() - torch.tensor(s.logprobs)).abs().mean().item()
    for i, s in enumerate(sampled)
)
results = B.all_gather_objects({"greedy_equal": after == expected, "diff": diff}, dist)
if dist.is_main:
    (out / "result.json").write_text(
        json.dumps(
            {
                "greedy_equal": all(r["greedy_equal"] for r in results),
                "max_logprob_diff": max(r["diff"] for r in results),
            }
        )
    )
