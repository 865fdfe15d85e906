"""Benchmark (by hand, not a test): the block's token_logprobs against a naive full-logits reference.

    python tests/bench_logprobs.py            # both variants, side by side, then the comparison

A 2-layer Llama with a 151,936-token vocabulary (Qwen2.5's), micro-batch 4, prompt 1024 and completion 256 tokens, fp32
on CPU; one forward + backward of the summed log-probs. Each variant runs in its own process so that its peak
memory (resident set size above the level before the step, sampled every 2 ms) is its own. The reference is what
the block did before: logits for every prompt and completion position, an fp32 log-softmax over all of them."""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

VOCAB, HIDDEN, PROMPT, COMPLETION, BATCH = 151_936, 256, 1024, 256, 4


def naive(policy, samples, temperature=1.0):
    import torch

    ids = torch.tensor([s.prompt_ids + s.token_ids for s in samples])
    z = policy(input_ids=ids, use_cache=False).logits.float() / temperature
    P = len(samples[0].prompt_ids)
    logp = z.log_softmax(-1)[:, P - 1 : -1].gather(-1, ids[:, P:, None])[..., 0]
    return logp, torch.ones_like(logp)


def run(variant: str, out: str) -> None:
    import psutil
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(__file__))
    from _block import load_block

    B = load_block()
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    policy = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    samples = [B.Sample("", torch.randint(VOCAB, (PROMPT,), generator=g).tolist(),
                        torch.randint(VOCAB, (COMPLETION,), generator=g).tolist(), [], "length") for _ in range(BATCH)]
    fn = naive if variant == "naive" else B.token_logprobs
    proc, peak, running = psutil.Process(), [0], [True]

    def sample_rss():
        while running[0]:
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    before = proc.memory_info().rss
    watcher = threading.Thread(target=sample_rss)
    watcher.start()
    start = time.perf_counter()
    logp, mask = fn(policy, samples)[:2]
    (logp * mask).sum().backward()
    seconds = time.perf_counter() - start
    running[0] = False
    watcher.join()
    torch.save({"logp": logp.detach(), "grad": policy.model.embed_tokens.weight.grad[:1000].clone()}, out + ".pt")
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "peak_gb": (peak[0] - before) / 2**30}, f)


def main() -> None:
    import torch

    tmp = tempfile.mkdtemp()
    results = {}
    for variant in ("naive", "token_logprobs"):
        out = os.path.join(tmp, variant)
        subprocess.run([sys.executable, __file__, variant, out], check=True)
        results[variant] = {**json.load(open(out)), **torch.load(out + ".pt")}
    a, b = results["naive"], results["token_logprobs"]
    diff = (a["logp"] - b["logp"]).abs().max().item()
    grad_diff = (a["grad"] - b["grad"]).abs().max().item()
    print(f"2-layer Llama, vocab {VOCAB}, hidden {HIDDEN}, batch {BATCH} x (prompt {PROMPT} + completion {COMPLETION}),"
          f" fp32, CPU ({os.cpu_count()} cores), forward + backward")
    print(f"{'':16}{'seconds':>10}{'peak GiB':>10}")
    for name, r in results.items():
        print(f"{name:16}{r['seconds']:10.2f}{r['peak_gb']:10.2f}")
    print(f"token_logprobs: {a['peak_gb'] / b['peak_gb']:.1f}x less peak memory, {a['seconds'] / b['seconds']:.1f}x faster;"
          f" max |logp difference| {diff:.2e}, max |gradient difference| {grad_diff:.2e}")
    assert diff <= 1e-5, diff


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2]) if len(sys.argv) == 3 else main()
