"""Overhead of lean_verify's REPL pool, measured against the stand-in REPL (Lean itself
instant). Run by hand (not collected by pytest):

    python tests/bench_lean_verify.py [--proofs 600] [--workers 1 2 4]

Prints checks per second for each worker count, with and without the Lean-side checks
(`#check`/`#print axioms`: one more REPL round trip per proof), and tactic steps per second.
Real Lean takes 0.1-10 s per proof, so this is the ceiling the pool itself imposes.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lean_verify as lv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proofs", type=int, default=600)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    rows = [json.loads(x) for x in (ROOT / "data" / "lean_smoke.jsonl").read_text().splitlines() if x.strip()]
    jobs = [lv.ProofJob(r["header"], r["formal_statement"], lv.proof_from_tactics(r["formal_statement"], [r["proof"]]),
                        r["name"]) for r in rows]
    jobs = (jobs * (a.proofs // len(jobs) + 1))[:a.proofs]
    cmd = " ".join(shlex.quote(x) for x in [sys.executable, str(ROOT / "tests" / "fake_lean_repl.py")])
    text_t0 = time.perf_counter()
    for j in jobs:
        lv.check_text(j)
    text_dt = time.perf_counter() - text_t0
    print(f"text rules alone: {len(jobs) / text_dt:8.0f} proofs/s ({1e3 * text_dt / len(jobs):.2f} ms per proof)")
    for checks in (True, False):
        for w in a.workers:
            with lv.LeanVerifier(repl_cmd=cmd, workers=w, lean_checks=checks, max_uses=10**9) as v:
                v.verify(jobs[:4 * w])            # start the REPLs and import the header
                t0 = time.perf_counter()
                res = v.verify(jobs)
                dt = time.perf_counter() - t0
            assert all(r.valid for r in res), [r.reason for r in res if not r.valid][:3]
            print(f"workers={w} lean_checks={checks!s:5}: {len(jobs) / dt:8.0f} checks/s "
                  f"({1e3 * dt / len(jobs):.2f} ms per check, {len(jobs)} proofs)")
    row = next(r for r in rows if r["name"] == "smoke_lt_trans")
    with lv.LeanVerifier(repl_cmd=cmd, workers=1, max_uses=10**9) as v:
        root = v.start_proof(row["header"], row["formal_statement"])
        t0 = time.perf_counter()
        for i in range(a.steps):
            s = v.apply_tactic(root, "have h := h₀" if i % 2 else "linarith")
            assert s.error is None
        dt = time.perf_counter() - t0
    print(f"tactic mode: {a.steps / dt:8.0f} steps/s ({1e3 * dt / a.steps:.2f} ms per step)")


if __name__ == "__main__":
    main()
