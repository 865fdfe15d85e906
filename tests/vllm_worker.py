"""Run by tests/test_vllm.py under `torchrun --nproc_per_node 2` in .venv-vllm: an FSDP2-sharded policy (gloo), one
real vLLM engine per rank (float32), weights synced from the shards. Writes every rank's findings to result.json."""

import json
import os
import pathlib
import sys

import torch
import vllm.model_executor.models.llama as vllm_llama
from _block import load_block

B = load_block()
model_dir, out = sys.argv[1], pathlib.Path(sys.argv[2])
os.environ.setdefault(
    "VLLM_CPU_KVCACHE_SPACE", "1"
)  # GiB; otherwise a share of all host RAM per engine

# record what reaches the real load_weights (names, shapes, what vLLM says it loaded), then call it
calls = []
real_load_weights = vllm_llama.LlamaForCausalLM.load_weights


def recording_load_weights(self, weights):
    weights = list(weights)
    loaded = real_load_weights(self, weights)
    calls.append(([n for n, _ in weights], [tuple(t.shape) for _, t in weights], sorted(loaded)))
    return loaded


vllm_llama.LlamaForCausalLM.load_weights = recording_load_weights

dist = B.setup_distributed(seed=0)
assert dist.world_size == 2
tok = B.load_tokenizer(model_dir)
policy = B.load_model(model_dir, dist)  # FSDP2-sharded under torchrun
sharded = all(hasattr(p, "full_tensor") for p in policy.parameters())
sampler = B.Sampler(
    model_dir,
    policy,
    tok,
    dist,
    backend="vllm",
    max_model_len=256,
    gpu_memory_utilization=0.3,
    seed=0,
    dtype="float32",
)
prompts = [B.chat_prompt(tok, q) for q in ("What is 2+2?", "Name three prime numbers.")]


def greedy():
    return [g[0].token_ids for g in sampler.generate(prompts, temperature=0.0, max_new_tokens=32)]


greedy_before = greedy()
sampled = [g[0].token_ids for g in sampler.generate(prompts, temperature=1.0, max_new_tokens=16)]

# one training step through the block's train_step: the batch is shared out so that each rank trains on its own
# target (rank r takes items r, r + 2, ...), and FSDP2 averages the gradients over the ranks
targets = [
    tok(t, add_special_tokens=False).input_ids * 3
    for t in (" The answer is 42.", " Primes: 2, 3, 5.")
]
batch = [
    B.Sample("", B.encode_prompt(tok, p), t, [0.0] * len(t), "length")
    for p in prompts
    for t in targets
]
tokens = sum(len(s.token_ids) for s in batch)
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)


def nll(micro):
    assert all(s.token_ids == targets[dist.rank] for s in micro)
    logp, mask, _ = B.token_logprobs(policy, micro)
    return -(logp * mask).sum() / tokens, {}


B.train_step(policy, optimizer, batch, nll, len(batch), 1.0, dist)
calls.clear()
sampler.sync_weights(policy)  # a collective: every rank gathers every parameter
synced = list(calls)
greedy_after = greedy()

# the reference: the gathered trained weights in a plain transformers model, greedy
from transformers import AutoModelForCausalLM  # noqa: E402

full = {name: tensor.detach().clone() for name, tensor in B.full_state_dict_items(policy)}
reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
reference.load_state_dict(full)
hf_greedy_after = []
with torch.no_grad():
    for p in prompts:
        ids = torch.tensor([B.encode_prompt(tok, p)])
        seq = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=tok.pad_token_id,
        )
        hf_greedy_after.append(seq[0, ids.shape[1] :].tolist())

names = [n for names, _, _ in synced for n in names]
result = {
    "rank": dist.rank,
    "sharded": sharded,
    "names": names,
    "hf_names": list(full),
    "full_shapes": all(
        list(shape) == list(full[n].shape)
        for ns, shapes, _ in synced
        for n, shape in zip(ns, shapes)
    ),
    "unloaded": [ns[0] for ns, _, loaded in synced if not loaded],
    "greedy_before": greedy_before,
    "greedy_after": greedy_after,
    "hf_greedy_after": hf_greedy_after,
    "sampled": sampled,
}
results = B.all_gather_objects(result, dist)
if dist.is_main:
    (out / "result.json").write_text(json.dumps(results))
