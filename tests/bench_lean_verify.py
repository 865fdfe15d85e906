"""Overhead of lean_verify's REPL pool, measured against the stand-in REPL (Lean itself
instant). Run by hand (not collected by pytest):

    python tests/bench_lean_verify.py [--proofs 600] [--workers 1 2 4] [--steps 2000]
                                      [--tactic-workers 1 4] [--lean-ms 20]

Prints
* checks per second for each worker count, with and without the Lean-side checks
  (`#check`/`#print axioms`: one more REPL round trip per proof);
* tactic steps per second through the pool (`apply_tactics` batches over the theorems of
  data/lean_tactics.jsonl: every tactic the table lists for each state, as a search would
  expand it), for each worker count, with the stand-in answering at once and answering
  after `--lean-ms` (a quick Lean tactic), where the pool's parallelism shows;
* the pool's overhead per tactic step: one step through `apply_tactic` minus the same
  request written straight to the REPL's pipe, and the pipe round trip minus the stand-in's
  own work for it (measured in process).
Real Lean takes 0.01-10 s per tactic and 0.1-10 s per proof, so these are the ceilings the
pool itself imposes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lean_verify as lv  # noqa: E402

FAKE = ROOT / "tests" / "fake_lean_repl.py"
ROWS = [
    json.loads(x)
    for x in (ROOT / "data" / "lean_tactics.jsonl").read_text(encoding="utf-8").splitlines()
    if x.strip()
]


def stand_in(*args) -> str:
    return " ".join(shlex.quote(str(x)) for x in [sys.executable, str(FAKE), *args])


def proposals(state) -> list:
    main = re.sub(r"^case [^\n]*\n", "", state.goals[0]) if state.goals else ""
    return [
        t["tactic"]
        for r in ROWS
        for t in r["transitions"]
        if re.sub(r"^case [^\n]*\n", "", t["goal"]) == main
    ]


def bench_checks(a) -> None:
    rows = [
        json.loads(x)
        for x in (ROOT / "data" / "lean_smoke.jsonl").read_text().splitlines()
        if x.strip()
    ]
    jobs = [
        lv.ProofJob(
            r["header"],
            r["formal_statement"],
            lv.proof_from_tactics(r["formal_statement"], [r["proof"]]),
            r["name"],
        )
        for r in rows
    ]
    jobs = (jobs * (a.proofs // len(jobs) + 1))[: a.proofs]
    t0 = time.perf_counter()
    for j in jobs:
        lv.check_text(j)
    dt = time.perf_counter() - t0
    print(
        f"text rules alone: {len(jobs) / dt:8.0f} proofs/s ({1e3 * dt / len(jobs):.2f} ms per proof)"
    )
    for checks in (True, False):
        for w in a.workers:
            with lv.LeanVerifier(
                repl_cmd=stand_in(), workers=w, lean_checks=checks, max_uses=10**9
            ) as v:
                v.verify(jobs[: 4 * w])  # start the REPLs and import the header
                t0 = time.perf_counter()
                res = v.verify(jobs)
                dt = time.perf_counter() - t0
            assert all(r.valid for r in res), [r.reason for r in res if not r.valid][:3]
            print(
                f"workers={w} lean_checks={checks!s:5}: {len(jobs) / dt:8.0f} checks/s "
                f"({1e3 * dt / len(jobs):.2f} ms per check, {len(jobs)} proofs)"
            )


def bench_steps(a, workers: int, lean_ms: float) -> float:
    """Steps/s of a breadth-first sweep over the table: each round expands every open state with every tactic
    the table lists for it, as one apply_tactics batch; theorems are repeated to fill the pool."""
    args = ("--delay", lean_ms / 1000) if lean_ms else ()
    with lv.LeanVerifier(
        repl_cmd=stand_in(*args), workers=workers, max_uses=10**9, max_proof_states=10**9
    ) as v:
        roots = v.start_proofs(
            [(r["header"], r["formal_statement"]) for r in ROWS] * max(1, workers)
        )
        frontier, steps, t0 = list(roots), 0, time.perf_counter()
        while steps < a.steps:
            batch = [(s, t) for s in frontier for t in proposals(s)]
            if not batch:
                frontier = list(roots)
                continue
            out = v.apply_tactics(batch)
            steps += len(batch)
            frontier = [s for s in out if s.status == "open"]
        dt = time.perf_counter() - t0
        assert v.stats()["starts"] == workers, v.stats()  # no REPL restarted, no state moved
    return steps / dt


def bench_overhead(a) -> None:
    """Per step: the pool (apply_tactic) vs the same request on the pipe vs the stand-in's own work."""
    row = ROWS[2]
    n = max(200, a.steps // 4)

    def per_step(fn) -> float:  # the best of five runs: the machine is shared, noise only adds
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    with lv.LeanVerifier(
        repl_cmd=stand_in(), workers=1, max_uses=10**9, max_proof_states=10**9
    ) as v:
        root = v.start_proof(row["header"], row["formal_statement"])
        assert v.apply_tactic(root, "intro hp").status == "open"
        pool = per_step(lambda: v.apply_tactic(root, "intro hp"))
        proc = root._worker.proc
        pipe = per_step(
            lambda: proc.request({"tactic": "intro hp", "proofState": root.state_id}, 10.0)
        )
    spec = importlib.util.spec_from_file_location("fake_lean_repl", FAKE)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    lean = fake.FakeLean()
    lean.handle({"cmd": row["header"]})
    lean.handle({"cmd": row["formal_statement"] + " sorry", "env": 0})
    work = per_step(
        lambda: json.dumps(
            lean.handle({"tactic": "intro hp", "proofState": 0})[0], ensure_ascii=False, indent=2
        )
    )
    print(
        f"one tactic step: {1e3 * pool:.3f} ms through the pool = {1e3 * work:.3f} ms stand-in work "
        f"+ {1e3 * (pipe - work):.3f} ms pipe, JSON and process switch + {1e3 * (pool - pipe):.3f} ms pool "
        f"(text rules, one_tactic, locking, memory check, the new TacticState)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proofs", type=int, default=600)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tactic-workers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--lean-ms", type=float, default=20.0)
    ap.add_argument("--skip-checks", action="store_true", help="only the tactic-mode numbers")
    a = ap.parse_args()
    if not a.skip_checks:
        bench_checks(a)
    for lean_ms in (0.0, a.lean_ms):
        for w in a.tactic_workers:
            rate = bench_steps(a, w, lean_ms)
            print(
                f"tactic steps, workers={w}, stand-in answers after {lean_ms:g} ms: {rate:8.0f} steps/s "
                f"({1e3 / rate:.2f} ms per step)"
            )
    bench_overhead(a)


if __name__ == "__main__":
    main()
