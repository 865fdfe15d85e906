"""Benchmark of the embedded CPU default of gasp.py (run by hand; pytest does not collect it).

    python tests/bench_gasp.py                 # `python gasp.py` as a user runs it, in a temporary run directory
    python tests/bench_gasp.py -- --iterations 3    # extra flags after `--` go to gasp.py

It runs gasp.py in a subprocess and reads back the run's metrics.jsonl, then prints: the wall time (start-up
included), each iteration's time split into generation, program execution, embedding (novelty filter), update
and the loop's own overhead (everything else: parsing, rewards, gathering, logging, checkpoints), the share of that
overhead (target: under 5%), generated tokens (the run's tokens/* metrics, per phase) per second of generation,
and the run's GASP metrics per iteration.
Uses both cores for ~10 minutes: run it on an otherwise idle machine for meaningful numbers.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
PARTS = ["generation", "execution", "embedding", "update"]
SHOWN = [
    "charts/lemma_proposals",
    "charts/lemma_accepted",
    "charts/lemma_valid_rate",
    "charts/lemma_reward",
    "charts/lift_proposals",
    "charts/lift_accepted",
    "charts/solver_tasks",
    "charts/buffer_size",
    "charts/buffer_dissimilarity",
    "losses/updates",
    "losses/skipped_updates",
    "losses/policy_loss",
    "losses/grad_norm",
    "eval/pass@1",
    "eval/pass@4",
    "eval/goalposts_solved",
]


def main() -> None:
    extra = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "gasp.py", "--output-dir", tmp, "--run-name", "bench", *extra]
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-5000:])
            raise SystemExit(f"gasp.py failed with exit code {done.returncode}")
        rows = [
            json.loads(line)
            for line in (pathlib.Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()
        ]
    print(
        f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (after the run)"
    )
    in_loop = sum(r.get("time/iteration", 0.0) for r in rows)
    print(
        f"wall time {wall:.1f} s: {in_loop:.1f} s in {len(rows)} iterations, {wall - in_loop:.1f} s start-up "
        "(model loading, data, sandbox servers), checkpoint writes (after each iteration) and exit\n"
    )
    print(
        f"{'iter':>4} {'total s':>8} "
        + " ".join(f"{p:>11}" for p in PARTS)
        + f" {'overhead':>9} {'ovh %':>6} {'tok/s':>7}"
    )
    totals = {p: 0.0 for p in PARTS + ["overhead", "iteration"]}
    tokens = 0.0
    for r in rows:
        it = r.get("time/iteration", 0.0)
        parts = [r.get(f"time/{p}", 0.0) for p in PARTS]
        ovh = it - sum(parts)
        generated = sum(v for k, v in r.items() if k.startswith("tokens/"))
        for p, v in zip(PARTS, parts):
            totals[p] += v
        totals["overhead"] += ovh
        totals["iteration"] += it
        tokens += generated
        print(
            f"{r['step']:>4} {it:>8.1f} "
            + " ".join(f"{v:>11.1f}" for v in parts)
            + f" {ovh:>9.2f} {100 * ovh / max(it, 1e-9):>6.2f} {generated / max(parts[0], 1e-9):>7.1f}"
        )
    it = max(totals["iteration"], 1e-9)
    print(
        f"{'all':>4} {it:>8.1f} "
        + " ".join(f"{totals[p]:>11.1f}" for p in PARTS)
        + f" {totals['overhead']:>9.2f} {100 * totals['overhead'] / it:>6.2f} "
        f"{tokens / max(totals['generation'], 1e-9):>7.1f}"
    )
    print("share   " + " ".join(f"{100 * totals[p] / it:>10.1f}%" for p in PARTS))
    print("\nmetrics per iteration")
    for key in SHOWN:
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            print(
                f"  {key:<32}"
                + " ".join(f"{v:>9.3g}" if v is not None else f"{'-':>9}" for v in values)
            )
    reasons = sorted({k for r in rows for k in r if k.startswith("charts/rejected_")})
    for key in reasons:
        print(f"  {key:<32}" + " ".join(f"{r.get(key, 0):>9.3g}" for r in rows))


if __name__ == "__main__":
    main()
