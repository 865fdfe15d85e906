"""Benchmark (by hand, not a test): the block's token_logprobs against a naive full-logits reference and TRL 1.16.0's
fused LM head (what a GRPO user would otherwise run), at two shapes, side by side in one run.

    python tests/bench_logprobs.py                 # every variant at both shapes, then the table
    python tests/bench_logprobs.py --shapes 1024x256 --repeat 1

A 2-layer Llama with a 151,936-token vocabulary (Qwen2.5's, hidden 256, tied head), batch 4 x (prompt + completion)
tokens, fp32 on the CPU; one forward + backward of the completion tokens' summed log-probs. Each variant runs in its
own process, so that its peak memory (resident set size above the level before the step, sampled every 2 ms) is its
own; each process takes one untimed step first (thread pool, allocator). Variants:
  naive            logits for every prompt and completion position, one fp32 log-softmax (what the block did once)
  token_logprobs   the block: the head inside the forward, a chunk of completion positions at a time, again in backward
  trl              TRL's GRPOTrainer path (trl.trainer.utils.add_fused_lm_head, trl/kernels/chunked_logprob.py: tiles of
                   4096 tokens x 32768 vocabulary entries, online logsumexp, the head recomputed in backward); on a CPU
                   it scores every position of the sequence
  trl_completion   the same with the selection it makes on CUDA: completion rows only (torch tiles on a CPU)
TRL is not a requirement of this project: install it in a virtualenv of its own and the bench uses it,
    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 transformers==5.23.0 trl==1.16.0 psutil
(or pass --trl-python PATH); without it the TRL rows are left out. Values and gradients are compared with naive's."""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

VOCAB, HIDDEN, BATCH = 151_936, 256, 4
REPO = pathlib.Path(__file__).resolve().parent.parent


def build(prompt: int, completion: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (BATCH, prompt + completion), generator=g)
    return LlamaForCausalLM(config), ids


def naive(policy, ids, prompt):
    z = policy(input_ids=ids, use_cache=False).logits.float()
    return z.log_softmax(-1)[:, prompt - 1 : -1].gather(-1, ids[:, prompt:, None])[..., 0]


def block(policy, ids, prompt):
    samples = [
        B.Sample("", row[:prompt].tolist(), row[prompt:].tolist(), [], "length") for row in ids
    ]
    return B.token_logprobs(policy, samples)[0]


def trl(policy, ids, prompt):
    labels = ids.clone()
    labels[:, :prompt] = -100
    out = policy(
        input_ids=ids, attention_mask=ids.new_ones(ids.shape), labels=labels, fused_lm_head=True
    )
    return out.log_probs[:, -(ids.shape[1] - prompt) :]


def run(variant: str, prompt: int, completion: int, out: str) -> None:
    import psutil
    import torch

    torch.set_num_threads(os.cpu_count())
    policy, ids = build(prompt, completion)
    if variant == "token_logprobs":  # imports before the clock starts
        global B
        sys.path.insert(0, str(REPO / "tests"))
        from _block import load_block

        B = load_block()
    if variant.startswith("trl"):
        import trl.trainer.utils as trl_utils

        if (
            variant == "trl_completion"
        ):  # the selection TRL makes on CUDA; the tiles stay torch's on a CPU
            trl_utils._use_triton = lambda device: True
        trl_utils.add_fused_lm_head(policy, temperature=1.0, outputs=("log_probs",))
    fn = {"naive": naive, "token_logprobs": block, "trl": trl, "trl_completion": trl}[variant]
    fn(
        policy, ids, prompt
    ).sum().backward()  # a first step warms the thread pool and the allocator: not timed
    policy.zero_grad(set_to_none=True)
    proc, peak, running = psutil.Process(), [0], [True]

    def sample_rss():
        while running[0]:
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    before = proc.memory_info().rss
    watcher = threading.Thread(target=sample_rss)
    watcher.start()
    start = time.perf_counter()
    logp = fn(policy, ids, prompt)
    logp.sum().backward()
    seconds = time.perf_counter() - start
    running[0] = False
    watcher.join()
    grads = {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}
    torch.save(
        {
            "logp": logp.detach(),
            "grads": {k: v[:2000] if v.dim() > 1 else v for k, v in grads.items()},
        },
        out + ".pt",
    )
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "peak_gib": (peak[0] - before) / 2**30}, f)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shapes", nargs="+", default=["1024x256", "256x1024"], help="prompt x completion"
    )
    parser.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each variant, alternating; the median is shown",
    )
    args = parser.parse_args()
    has_trl = (
        os.path.exists(args.trl_python)
        and subprocess.run([args.trl_python, "-c", "import trl"], capture_output=True).returncode
        == 0
    )
    tmp = tempfile.mkdtemp()
    print(
        f"2-layer Llama, vocabulary {VOCAB}, hidden {HIDDEN}, tied head, fp32, CPU ({os.cpu_count()} cores), "
        f"forward + backward; batch {BATCH} x (prompt + completion)"
        + ("" if has_trl else "; no TRL (see --help)")
    )
    print(
        f"{'shape':>12} {'variant':16}{'seconds':>9}{'peak GiB':>10}{'max |dlogp|':>13}{'max |dgrad|':>13}"
        "  (median seconds and largest peak of the runs)"
    )
    for shape in args.shapes:
        prompt, completion = map(int, shape.split("x"))
        results, variants = (
            {},
            ["naive", "token_logprobs"] + (["trl", "trl_completion"] if has_trl else []),
        )
        # alternating, so that a busy spell of the machine hits every variant
        for _ in range(args.repeat):
            for variant in variants:
                out = os.path.join(tmp, f"{variant}-{shape}")
                python = args.trl_python if variant.startswith("trl") else sys.executable
                subprocess.run(
                    [python, __file__, "--run", variant, str(prompt), str(completion), out],
                    check=True,
                )
                run_ = {**json.load(open(out)), **torch.load(out + ".pt")}
                runs = results.setdefault(variant, {**run_, "all_seconds": [], "all_peaks": []})
                runs["all_seconds"].append(run_["seconds"])
                runs["all_peaks"].append(run_["peak_gib"])
        for r in results.values():
            r["seconds"], r["peak_gib"] = (
                sorted(r["all_seconds"])[len(r["all_seconds"]) // 2],
                max(r["all_peaks"]),
            )
        ref = results["naive"]
        for variant, r in results.items():
            dlogp = (r["logp"] - ref["logp"]).abs().max().item()
            dgrad = max((r["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
            print(
                f"{prompt:>5}+{completion:<6} {variant:16}{r['seconds']:9.2f}{r['peak_gib']:10.2f}{dlogp:13.1e}"
                f"{dgrad:13.1e}"
            )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--run":
        run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
