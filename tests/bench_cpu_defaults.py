"""Benchmark (by hand, not a test): every algorithm file's CPU default, as the README runs it, one after another on
this machine: wall time and the peak resident memory of the run's whole process tree (the Lean stand-in and the code
sandboxes included), sampled every 0.5 s, and how many steps the run logged.

    python tests/bench_cpu_defaults.py                 # all six, then the table
    python tests/bench_cpu_defaults.py gasp eva        # some of them

The Lean files run against the stand-in REPL (tests/fake_lean_repl.py --accept hash:0.3), as the README's CPU
commands do without a Lean toolchain. Each run writes to its own temporary directory, deleted afterwards."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
FILES = ["sgs", "stp", "gasp", "eva", "coprover", "rir"]
LEAN = {"sgs", "stp", "coprover", "rir"}


def tree_peak(proc: subprocess.Popen) -> float:
    """Peak summed RSS of a process and all its descendants, sampled every 0.5 s (GNU time reports the largest single
    process, not the tree: the Lean stand-in and code_exec's sandboxes are separate processes)."""
    import psutil

    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.5)
    return peak / 2**30


def run(name: str) -> dict:
    out = pathlib.Path(tempfile.mkdtemp(prefix=f"cpu_default_{name}_"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if name in LEAN:
        env["LEAN_REPL_CMD"] = (
            f"{sys.executable} {REPO / 'tests' / 'fake_lean_repl.py'} --accept hash:0.3"
        )
    cmd = [sys.executable, f"{name}.py", "--output-dir", str(out)]
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        peak = tree_peak(proc)
    wall = time.perf_counter() - start
    rows = [
        json.loads(line)
        for path in out.glob("*/metrics.jsonl")
        for line in path.read_text().splitlines()
    ]
    text = (out / "log.txt").read_text()
    tail, said = (
        text[-2000:],
        [line for line in text.splitlines() if line.strip() and "it/s" not in line][-1:],
    )
    shutil.rmtree(out, ignore_errors=True)
    return {
        "name": name,
        "returncode": proc.returncode,
        "wall_s": wall,
        "peak_gib": peak,
        "steps": len(rows),
        "last": rows[-1] if rows else {},
        "said": said[0] if said else "",
        "tail": tail if proc.returncode else "",
    }


def main() -> None:
    names = sys.argv[1:] or FILES
    results = [run(name) for name in names]
    print(f"\n{'file':10}{'exit':>5}{'wall':>9}{'peak GiB':>10}  logged steps")
    for r in results:
        minutes, seconds = divmod(round(r["wall_s"]), 60)
        print(
            f"{r['name']:10}{r['returncode']:>5}{minutes:>6}:{seconds:02d}{r['peak_gib']:10.2f}  {r['steps']}"
        )
    for r in results:  # what each run logged last, and the last line it printed
        print(f"\n{r['name']}: {json.dumps(r['last'])}\n  {r['said']}")
    for r in results:
        if r["tail"]:
            print(f"\n--- {r['name']} failed:\n{r['tail']}")


if __name__ == "__main__":
    main()
