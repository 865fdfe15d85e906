"""Lean 4 proof verification for the self-play algorithms.

A model writes a Lean 4 proof of a given theorem; this module says whether the
proof is valid, and why not. ``LeanVerifier`` is the front (the text rules, the
original statement's check, ``#print axioms``, the verdict); running Lean is a
backend's (``LeanBackend``), and there are two, named by ``backend=``:

* ``backend="repl"`` (the default): a pool of leanprover-community/repl
  processes (written against its v4.15.0 tag), each started inside a mathlib
  project (``lake env <repl>``). A worker runs a problem's header
  (``import Mathlib ...``) once, then checks every proof against that
  environment (``{"cmd": proof, "env": <header env>}``), so mathlib is imported
  once per process, not once per proof. Workers are keyed by header. A proof
  that runs past ``timeout`` seconds kills its REPL (status "timeout"); a REPL
  above ``memory_limit_mb`` (RSS of the process tree), after ``max_uses`` checks
  or ``max_proof_states`` proof states is restarted; a REPL that crashes or
  prints something that is not a JSON reply is restarted and the proof retried
  once, then recorded as "crash". Every job gets exactly one result, in order.
  The pool has ``workers`` REPLs; the default is this rank's share of the
  machine (cores and RAM divided by torchrun's ``LOCAL_WORLD_SIZE``; one REPL
  per core, less one, and per 8 GB), logged when the verifier is built.
* ``backend="kimina"``: a client for a Kimina Lean Server (``POST /api/check``),
  for verifying on a cluster of CPU machines, in batches of ``kimina_batch_size``
  snippets. Written against PyPI's kimina-ast-server 2.1.3 (the tests run it,
  with the stand-in REPL behind it) and the server's GitHub main (fb2393d); what
  each does is in "Kimina Lean Server" below. Every snippet starts with its
  header's imports (``import Init`` if it has none): Kimina runs a snippet's
  leading import lines as a separate header command, and with none it runs
  later snippets in the first one's environment. A busy server (no free REPL)
  and an unreachable one are retried with exponential backoff; a POST that
  fails as a whole is split until the bad snippet is alone, so it alone is
  "server_error". Timeouts and server errors are failures ("timeout",
  "server_error"), never successes, and "timeout" means the server ran the
  proof past ``timeout``: a proof that did not run (no answer in time, a header
  import that timed out) is "server_error".

Adding a backend (LeanInteract, Pantograph, a remote REPL farm): subclass
``LeanBackend`` and write ``check(snippets, timeout, progress=False)``: for each
``Snippet`` (a header, the code to run in its environment, ``checked``: a theorem
whose check block ``_check_block(checked)`` runs after the code, or ``names`` to
``#check``) one ``RawResult`` (Lean's messages and sorries, the check block's
messages, the ``#check`` texts, the time; or ``failure``, a LeanResult, when there
was no answer), in order, never raising. Set ``name``, ``workers``,
``lean_checks`` (it runs check blocks) and ``all_tactics`` (it fills
``RawResult.tactics``), and ``stats()``/``close()`` if it has them; then
``LeanVerifier(backend=MyBackend(...))``. ``ReplBackend`` and ``KiminaBackend``
are the two examples; tactic mode (``TacticEngine``) needs a ``ReplBackend``.

``LeanResult.time`` is what the proof itself cost: the seconds of its own REPL
requests (the proof and its ``#check``/``#print axioms``; on Kimina the server's
time for the snippet), not starting a REPL, importing the header or waiting for
a free one. STP weighs proofs by exp(-0.01 time).

Tactic mode: proof search (local REPL only)
-------------------------------------------
The REPL's tactic mode (``{"tactic": t, "proofState": n}``) is a step engine for
best-first search (ReProver, RiR, CoProver)::

    roots = v.start_proofs([(header, statement), ...])   # one root per theorem, spread over the pool
    kids = v.expand(root, ["intro x", "simp", "omega"])  # many tactics on one state, results in order
    kids = v.apply_tactics([(s1, "ring"), (s7, "linarith"), ...])   # many states, in parallel
    k.status      # "open" | "solved" | "error" | "timeout" | "crash"
    k.goals       # the new goals, as the REPL prints them; k.pretty joins them
    k.key         # goals_key(k.goals): equal keys = the same goals (merge search nodes on it)
    k.tactics     # the path from the root
    v.check_tactic_path(k)    # the final verdict: the whole proof in command mode -> LeanResult
    v.replay(roots, [["intro x", "simp"], ...])   # tactic paths in lockstep: their states, or None if one fails
    v.free_states()           # the search is over: restart the REPLs that hold its proof states

* Affinity: a proof state lives in the REPL that made it and its children are
  made there (``apply_tactics`` runs one thread per REPL: steps on one REPL in
  order, different REPLs in parallel). A state whose REPL was restarted
  (timeout, crash, memory, the bounds below) is replayed on a REPL of its
  header, its statement and then its path, from the longest prefix already
  replayed there; nothing else moves between processes.
* "solved": the REPL reports no goals, no error message and no sorry. v4.15.0
  has no ``proofStatus`` (REPL/JSON.lean ProofStepResponse: proofState, goals,
  messages, sorries, traces; newer REPLs add it, and then it must also say the
  proof is complete). An elaboration error closes its goal with sorry and shows
  only as a message, so goals [] alone proves nothing; nor has the kernel seen
  anything: ``check_tactic_path`` is the verdict (the same rules as ``verify``).
  Tactic text goes through the text rules first (no ``sorry``, no cheats).
* One tactic per request: the REPL parses the text as exactly one tactic and
  must reach the end of it (REPL/Snapshots.lean runString). What models emit (a
  block of lines, ``t1; t2``) is sent as one parenthesised tactic sequence,
  ``one_tactic(text)``, which runs like the same lines in a ``by`` block; the
  path keeps the text as given, so ``check_tactic_path`` assembles the same proof.
* Memory: the REPL never forgets a state. At v4.15.0 ``State.proofStates`` and
  ``cmdStates`` only grow (REPL/Main.lean); no command deletes one, and pickling
  (``pickleTo``/``unpickleProofStateFrom``) writes a state to a file and makes a
  new one on reading it back, which frees nothing. So a REPL holds at most
  ``max_proof_states`` states before it is restarted, and ``free_states(states)``
  restarts the REPLs holding a finished search's states (all if None).
* Each step has a ``timeout`` (the verifier's, or ``timeout=`` per call); a
  timeout kills that REPL, so its other states are replayed when next used.
* A built-in theorem set for search: data/lean_tactics.jsonl, small theorems
  each with its header, statement, root goal, a known proof (a tactic list) and
  the table of (goal, tactic) -> new goals or error, with alternatives and dead
  ends. The stand-in REPL (tests/fake_lean_repl.py) follows the table, so a
  search can be tested without Lean.

Constants and statements (for STP's conjecturer)
------------------------------------------------
``verify(jobs, used_constants=True)`` sends each proof with ``"allTactics": true``
and fills ``LeanResult.used_constants``: the REPL's per-tactic ``usedConstants``
(the constants in the terms each tactic assigned; REPL/Lean/InfoTree.lean) that
the proof text names, in order. ``statements(header, names)`` returns each
name's signature as ``#check _root_.name`` prints it (``Nat.add_comm (n m : ℕ) :
n + m = m + n``), one REPL round trip (or one Kimina snippet) per call. Kimina
passes no ``allTactics``, so there ``used_constants`` stays None.

Task formats
------------
What the algorithms parse, written once here and needing no Lean: ``clean_statement`` (a dataset's statement
as a task ending in ``:= by``), ``theorem_conclusion``, ``extract_proof``, ``extract_last_block`` and
``extract_conjecture`` (a model's proof or new statement, from a ```` ```lean4 ```` block or up to an end marker),
``proof_tactics`` (a whole proof's top-level tactics, to replay it), ``invoked_lemmas`` (the lemma names a proof's
text uses, a static scan), ``load_triples`` and ``format_state`` (LeanDojo's traced tactics).

Kimina Lean Server
------------------
What the client relies on, in PyPI's 2.1.3 and on GitHub main (fb2393d):

* Both split a snippet with ``str.splitlines()`` and join the lines with "\\n",
  while Lean breaks lines at "\\n" only ("\\r\\n" counts as one; a lone "\\r" and
  the other breaks are errors outside comments: Lean 4.35 in the tests,
  test_lean_reads_only_newlines_as_line_breaks). A proof with such a break
  would have more lines on the server than here, and a bad tactic's error could
  be taken for one of the check block's. So "\\r\\n" becomes "\\n", and any other
  break ``str.splitlines()`` knows (``LINE_BREAKS``) outside a comment fails
  the text rule ``lex``, through both backends.
* Message lines: 2.1.3 reports them relative to the body (the header's import
  lines not counted), main in the snippet's numbering (it adds them back). The
  check block's messages are told apart either way (``_kimina_code``); without
  the Lean-side checks a snippet is the proof alone, so every message is its.
* Neither reads a REPL's stderr (the pipe is opened and never read). A REPL that
  dies fails its snippet in 2.1.3 ("Snippet execution failed"), the whole POST
  with HTTP 500 on main.
* No free REPL: 2.1.3 waits ``LEAN_SERVER_MAX_WAIT`` (default 3600 s), then
  answers that snippet "No available REPLs" with HTTP 200 ("Failed to get REPL"
  and the like when it cannot start one); main waits 60 s, then fails the whole
  POST with HTTP 429. Both are sent again with the same backoff and limit
  (``kimina_retries``), and counted in ``stats()``.
* 2.1.3 answers HTTP 504 when a POST runs past its own limit, ``timeout`` x
  snippets + 10 s (its REPLs work through a batch in turn); main has no limit.
  The client's HTTP deadline (``http_timeout``, by default sized per POST) is
  above both, so the server answers first; a batch answered 504 is split.
* A fresh REPL imports the header under the request's ``timeout``: a header that
  takes longer fails every proof sent to that REPL with "Lean REPL header
  command timed out" ("server_error" here). Mathlib takes tens of seconds to
  import, so a server for a run needs a ``timeout`` above the import time, and
  REPLs pre-warmed for the run's header, one per REPL::

      LEAN_SERVER_MAX_REPLS=31 LEAN_SERVER_INIT_REPLS='{"import Mathlib\\nimport Aesop": 31}' \\
      LEAN_SERVER_REPL_PATH=.lean/repl/.lake/build/bin/repl LEAN_SERVER_PROJECT_DIR=.lean/mathlib4 \\
      LEAN_SERVER_SKIP_VALIDATION=1 kimina-ast-server

  The key is the header as the server splits it: the import lines, with every
  ``import Mathlib...`` as one ``import Mathlib`` first. Pre-warming imports
  with a limit of 3600 s (main: 60 s), but a REPL that replaces one (killed
  after a timeout, ``LEAN_SERVER_MAX_REPL_USES`` or the memory limit; in 2.1.3
  also when a reused REPL does not answer ``#eval 1`` within min(5, timeout/4)
  seconds) imports under the proof's ``timeout`` again.
* ``LEAN_SERVER_MAX_REPL_MEM``: 8G by default in 2.1.3, 12G in main's
  settings.py. ``LEAN_SERVER_API_KEY``: the server then answers 401 to a POST
  without ``Authorization: Bearer <key>``.

Configuration (arguments win over the environment, the environment over ``.env``):

* ``LEAN_REPL_CMD``: a full command line that starts a REPL process; used instead
  of ``lake env <repl>``. Tests point it at the stand-in::

      LEAN_REPL_CMD="python tests/fake_lean_repl.py --accept hash:0.3"

* ``LEAN_REPL_PATH`` or ``SGS_REPL_PATH``: the REPL binary (``repl/.lake/build/bin/repl``)
  or the repl checkout; ``LEAN_MATHLIB_PATH`` or ``SGS_MATHLIB_PATH``: the mathlib4
  project the REPL runs in (its ``lake env``).
* ``KIMINA_URL`` (and ``LEAN_SERVER_API_KEY``): the Kimina server, for ``backend="kimina"``.
* ``<repo>/.env``: ``KEY=VALUE`` lines written by ``bash setup.sh --lean``.

Importing this module never needs Lean. Constructing a verifier without one
raises ``LeanNotInstalled``, whose message says to run ``bash setup.sh --lean``.

The verdict
-----------
A proof is valid only if all of these hold:

1. The text rules below pass (before Lean sees anything).
2. Lean reports no message of severity "error" and no warning containing
   "failed" (the DeepSeek-Prover/STP/SGS rule).
3. The REPL reports no ``sorries`` and no warning says "declaration uses 'sorry'".
4. ``#print axioms _root_.<name>`` lists only propext, Classical.choice and
   Quot.sound (rule ``axioms``; ``sorryAx`` gives status "sorry", anything else
   "cheat"). ``_root_.`` names the proof's own theorem even when the header opens
   a namespace with a theorem of the same name; and since ``#print axioms`` prints
   one message per declaration a name resolves to, only the message naming the
   checked theorem is read (none: the proof fails).
5. ``set_option pp.all true in #check @_root_.<name>`` prints the same type after
   the proof as the original statement does on its own in the header environment
   (rule ``elaborated_statement``): the checked theorem is the one asked for,
   even if notation, instances or namespaces were played with.

Checks 4 and 5 cost one extra REPL round trip per proof (and one per distinct
statement, cached); ``lean_checks=False`` turns them off.

Text rules (``CHEAT_RULES``; each with an example in ``CHEAT_EXAMPLES``)
------------------------------------------------------------------------
Comments are blanked first (``strip_comments``: ``--`` lines and nested
``/- -/`` blocks, aware of string and char literals and ``«»`` names), so
``-- sorry`` in a comment is fine. Lean then receives exactly the text the rules
scanned (comments blanked, positions kept), so nothing hidden from the scanner
can reach Lean: a lexing disagreement can only break the proof, not smuggle
code in. String literals are scanned too (``"sorry"`` is rejected: fail closed).

===================== ======== ===================================================
rule                  status   rejects (example)
===================== ======== ===================================================
lex                   error    unterminated comment or string (``/- ...``), a
                               line break other than "\\n" outside comments
sorry                 sorry    ``sorry``, ``admit``, ``stop``, ``sorryAx``
axiom                 cheat    ``axiom cheat : 1 = 2``, ``constant c : ℕ``
hash_command          cheat    ``#exit``, ``#eval``, ``#print`` ... (any ``#cmd``)
meta_code             cheat    ``run_tac``, ``run_cmd``, ``by_elab``, ``elab``,
                               ``initialize``, ``simproc``
syntax_extension      cheat    ``macro "linarith" : tactic => ...``,
                               ``local notation "π" => (3 : ℝ)``, ``infixl``
unsafe                cheat    ``unsafe def``, ``@[implemented_by f]``,
                               ``@[extern "c"]``, ``@[csimp]``
native                cheat    ``native_decide``, ``Lean.ofReduceBool``,
                               ``decide +native``
set_option            cheat    options outside ``ALLOWED_OPTIONS``, e.g.
                               ``set_option debug.skipKernelTC true in``
instance              cheat    ``instance : Add ℕ := ⟨fun _ _ => 0⟩``,
                               ``local instance``, ``@[instance]``
attribute             cheat    ``attribute [local instance] foo``
namespace             cheat    ``namespace Foo`` (name resolution changes),
                               ``export Foo (bar)``
scoping               cheat    before the statement: ``variable``/``include``/
                               ``omit``, an ``open X`` not already in the header,
                               ``open X in`` directly on the statement
modifier              cheat    ``@[simp] theorem``/``private theorem`` on the
                               target theorem
statement             cheat    the original statement (whitespace-normalised,
                               ``lemma`` = ``theorem``) is missing or altered
duplicate_name        cheat    the theorem's name declared twice (also as
                               ``theorem Foo.name`` or ``_root_.name``)
shadowing             cheat    a helper declaration named like an identifier
                               of the statement (``def sqrt ...``)
import                error    an ``import`` not in the header
===================== ======== ===================================================

Results are ``LeanResult`` dataclasses; nothing here raises on model output.
Run ``python lean_verify.py [proofs.jsonl]`` to check a file from the shell.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import dataclasses
import functools
import json
import logging
import math
import os
import random
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

try:  # psutil measures the REPL's process tree; /proc is the fallback
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

logger = logging.getLogger("lean_verify")

REPO_ROOT = Path(__file__).resolve().parent
DOTENV_PATH = REPO_ROOT / ".env"
SETUP_HINT = "run `bash setup.sh --lean`"

# The header of a statement that comes without one: DeepSeek-Prover's and STP's (only the wall clock bounds a check)
DEFAULT_HEADER = "import Mathlib\nimport Aesop\nset_option maxHeartbeats 0\nopen BigOperators Real Nat Topology Rat\n\n"
ALLOWED_AXIOMS = frozenset({"propext", "Classical.choice", "Quot.sound"})
STATUSES = ("valid", "error", "sorry", "cheat", "timeout", "crash", "server_error")
# options a proof may set: resource limits and diagnostics only (exact name, or a prefix ending in ".")
ALLOWED_OPTIONS = (
    "maxHeartbeats",
    "maxRecDepth",
    "synthInstance.",
    "maxSynthPendingDepth",
    "linter.",
    "trace.",
    "profiler",
    "diagnostics",
    "exponentiation.threshold",
    "push_neg.use_distrib",
)
# per REPL: kimina-lean-server's MAX_REPL_MEM on GitHub main (settings.py: 12G; PyPI's 2.1.3 has 8G)
DEFAULT_MEMORY_LIMIT_MB = 12288
DEFAULT_MAX_USES = 500  # REPL memory grows with every stored env; recycle it
# The REPL keeps every proof state it ever made (REPL/Main.lean: State.proofStates only grows; v4.15.0 has no
# command that deletes one), so a REPL is restarted after this many; live states are then replayed.
DEFAULT_MAX_PROOF_STATES = 10000
EXAMPLE_NAME = "lean_verify_example_"


# --------------------------------------------------------------------------- records


@dataclass
class ProofJob:
    """One proof to check.

    statement: the ORIGINAL formal statement, ending in ":= by" (no header).
    proof: the full Lean code the model submitted (statement + tactics, no imports).
    """

    header: str
    statement: str
    proof: str
    name: str = ""


@dataclass
class LeanResult:
    """``time``: seconds Lean spent on this proof's own requests (the proof command and its ``#check``/
    ``#print axioms``; on Kimina the server's time for the snippet), not starting a REPL, importing the
    header, elaborating the original statement or waiting for a free REPL (STP weighs proofs by
    exp(-0.01 time)). ``used_constants``: with ``verify(..., used_constants=True)`` on the local REPL, the
    constants Lean resolved the proof's identifiers to (see ``verify``); None otherwise."""

    valid: bool
    status: str  # one of STATUSES
    errors: list = field(default_factory=list)  # Lean error messages, "line:col: text"
    reason: str = ""  # "<rule>: <detail>" for failures, "" when valid
    time: float = 0.0  # seconds of the proof's own REPL round trips (see above)
    messages: list = field(default_factory=list)  # raw Lean messages of the proof
    used_constants: list | None = None


TACTIC_STATUSES = ("open", "solved", "error", "timeout", "crash")


@dataclass
class TacticState:
    """A proof state in tactic mode (see "Tactic mode" in the module docstring).

    ``status``: "open" (goals left), "solved", "error" (Lean rejected the tactic, or a text rule did),
    "timeout", "crash". ``solved`` means the REPL reports no goals, no error message and no sorry
    (v4.15.0 sends no proofStatus; a newer REPL's proofStatus, if sent, must also say the proof is
    complete); the kernel has not checked anything yet: ``check_tactic_path(state)`` does. A failed step
    has ``state_id=None`` and ``error`` set. ``tactics`` is the path from the root (to re-check it, and to
    replay the state on a fresh REPL when its process was restarted). ``key`` identifies the goal list
    (merge search nodes on it). ``time``: seconds of this step's REPL round trip."""

    state_id: int | None
    goals: list
    error: str | None = None
    solved: bool = False
    proof_status: str | None = None  # only from REPLs newer than v4.15.0
    tactics: list = field(default_factory=list)
    header: str = ""
    statement: str = ""
    messages: list = field(default_factory=list)
    status: str = "open"
    time: float = 0.0
    _worker: object = field(default=None, repr=False, compare=False)
    _generation: int = field(default=-1, repr=False, compare=False)

    @property
    def pretty(self) -> str:
        """All goals, separated by blank lines (LeanDojo's TacticState.pp style)."""
        return "\n\n".join(self.goals)

    @property
    def key(self) -> str:
        return goals_key(self.goals)


def goals_key(goals: list) -> str:
    """A key for a goal list: equal for states a search should merge. Whitespace is normalised and a
    goal's `case <tag>` line dropped (tags only name goals); hypotheses, targets and order are kept."""
    out = []
    for g in goals:
        lines = [" ".join(ln.split()) for ln in str(g).strip().split("\n")]
        if lines and lines[0].startswith("case "):
            lines = lines[1:]
        out.append("\n".join(ln for ln in lines if ln))
    return "\n\n".join(out)


class LeanNotInstalled(RuntimeError):
    """No Lean toolchain (or Kimina server) is configured."""

    def __init__(self, detail: str = ""):
        msg = (
            "Lean 4 is not installed or not configured"
            + (f" ({detail})" if detail else "")
            + f". To install it, {SETUP_HINT} (elan, Lean v4.15.0, mathlib4 and the REPL; "
            "it writes LEAN_REPL_PATH and LEAN_MATHLIB_PATH to .env). Or set LEAN_REPL_PATH and "
            "LEAN_MATHLIB_PATH (or SGS_REPL_PATH/SGS_MATHLIB_PATH), or LEAN_REPL_CMD, or KIMINA_URL "
            "with backend='kimina'."
        )
        super().__init__(msg)


# --------------------------------------------------------------------------- configuration


def _read_dotenv(path: Path | None = None) -> dict:
    path = Path(path) if path is not None else DOTENV_PATH
    out = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        if line.startswith("export "):
            line = line[len("export ") :]
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _setting(*names: str, dotenv: dict | None = None) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    for name in names:
        if dotenv and dotenv.get(name):
            return dotenv[name]
    return None


def _repo_path(p: str) -> Path:
    path = Path(os.path.expanduser(p))
    return path if path.is_absolute() else (REPO_ROOT / path)


def _command_argv(cmd: str) -> list:
    """Split LEAN_REPL_CMD; `python` means this interpreter, and a relative script
    path that is missing from the cwd is looked up in the repo root."""
    argv = shlex.split(cmd)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    for i, a in enumerate(argv[1:], 1):
        if (
            a.endswith(".py")
            and not os.path.isabs(a)
            and not os.path.exists(a)
            and (REPO_ROOT / a).exists()
        ):
            argv[i] = str(REPO_ROOT / a)
    return argv


def _find_lake() -> str | None:
    lake = shutil.which("lake")
    if lake:
        return lake
    cand = Path.home() / ".elan" / "bin" / "lake"
    return str(cand) if cand.exists() else None


@dataclass
class _ReplConfig:
    argv: list
    cwd: str | None
    real: bool


def _resolve_repl_config(repl_path=None, mathlib_path=None, repl_cmd=None) -> _ReplConfig:
    if repl_cmd:
        return _ReplConfig(_command_argv(repl_cmd), None, False)
    dotenv = _read_dotenv()
    if not (repl_path or mathlib_path):
        env_cmd = os.environ.get("LEAN_REPL_CMD")
        if env_cmd:
            return _ReplConfig(_command_argv(env_cmd), None, False)
        repl_path = _setting("LEAN_REPL_PATH", "SGS_REPL_PATH")
        mathlib_path = _setting("LEAN_MATHLIB_PATH", "SGS_MATHLIB_PATH")
        if not (repl_path or mathlib_path):
            if dotenv.get("LEAN_REPL_CMD"):
                return _ReplConfig(_command_argv(dotenv["LEAN_REPL_CMD"]), None, False)
            repl_path = _setting("LEAN_REPL_PATH", "SGS_REPL_PATH", dotenv=dotenv)
            mathlib_path = _setting("LEAN_MATHLIB_PATH", "SGS_MATHLIB_PATH", dotenv=dotenv)
    if not repl_path or not mathlib_path:
        raise LeanNotInstalled("no REPL configured: LEAN_REPL_PATH/LEAN_MATHLIB_PATH are not set")
    repl = _repo_path(repl_path)
    if repl.is_dir():
        repl = repl / ".lake" / "build" / "bin" / "repl"
    mathlib = _repo_path(mathlib_path)
    if not repl.exists():
        raise LeanNotInstalled(f"REPL binary not found at {repl}")
    if not mathlib.is_dir():
        raise LeanNotInstalled(f"mathlib project not found at {mathlib}")
    lake = _find_lake()
    if not lake:
        raise LeanNotInstalled("`lake` (elan) not found on PATH or in ~/.elan/bin")
    return _ReplConfig([lake, "env", str(repl)], str(mathlib), True)


def _kimina_url(url=None) -> str | None:
    return url or _setting("KIMINA_URL", dotenv=_read_dotenv())


def lean_available(real: bool = False) -> bool:
    """True when a verifier can be built: a REPL (real Lean, or LEAN_REPL_CMD) or a
    Kimina URL. With ``real=True``, only a real Lean REPL + mathlib counts."""
    try:
        cfg = _resolve_repl_config()
        if cfg.real or not real:
            return True
    except LeanNotInstalled:
        pass
    if real:
        try:
            return _resolve_repl_config(
                repl_path=_setting("LEAN_REPL_PATH", "SGS_REPL_PATH", dotenv=_read_dotenv()),
                mathlib_path=_setting(
                    "LEAN_MATHLIB_PATH", "SGS_MATHLIB_PATH", dotenv=_read_dotenv()
                ),
            ).real
        except LeanNotInstalled:
            return False
    return bool(_kimina_url())


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 16.0


def _local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        return 1


def _default_workers() -> int:
    """REPLs per pool: this rank's share of the machine (torchrun starts LOCAL_WORLD_SIZE ranks per node,
    each with its own pool): its cores minus one, at most one REPL per 8 GB of its memory (a REPL with
    mathlib imported takes several GB)."""
    n = _local_world_size()
    cpus = (os.cpu_count() or 1) // n
    return max(1, min(cpus - 1, int(_memory_gb() / n // 8)))


# --------------------------------------------------------------------------- text rules

_CHAR_LIT = re.compile(r"'(?:\\(?:[\\'\"nrt0]|x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\})|[^\\'\n])'")
_RAW_STR = re.compile(r'r(#*)"')


def _is_ident_char(c: str) -> bool:
    return c.isalnum() or c in "_'!?."


_SPECIAL = re.compile(r'--|/-|"|\'|«|r#*"')
_BLOCK = re.compile(r"/-|-/")


def strip_comments(text: str) -> tuple:
    """Blank out Lean comments. Returns ``(code, None)`` or ``(None, error)``.

    ``--`` runs to the end of the line; ``/- ... -/`` blocks nest (``/--`` doc and
    ``/-!`` module comments too). String, raw-string and char literals and ``«»``
    names are copied verbatim, so ``"--"`` does not start a comment. Every comment
    character but newlines becomes a space, so line/column positions are kept."""
    out = []
    i, n = 0, len(text)
    while i < n:
        m = _SPECIAL.search(text, i)
        if m is None:
            out.append(text[i:])
            break
        j, tok = m.start(), m.group(0)
        out.append(text[i:j])
        i = j
        prev_ident = j > 0 and _is_ident_char(text[j - 1])
        if tok == "--":
            k = text.find("\n", i)
            k = n if k < 0 else k
            out.append(" " * (k - i))
            i = k
        elif tok == "/-":
            depth, k = 1, i + 2
            while depth:
                b = _BLOCK.search(text, k)
                if b is None:
                    return None, "unterminated comment"
                depth += 1 if b.group(0) == "/-" else -1
                k = b.end()
            out.append("".join("\n" if ch == "\n" else " " for ch in text[i:k]))
            i = k
        elif tok == '"':
            k = i + 1
            while k < n and text[k] != '"':
                k += 2 if text[k] == "\\" else 1
            if k >= n:
                return None, "unterminated string literal"
            out.append(text[i : k + 1])
            i = k + 1
        elif tok[0] == "r":
            if prev_ident:  # the end of an identifier, then a string
                out.append("r")
                i += 1
                continue
            end = '"' + tok[1:-1]
            k = text.find(end, m.end())
            if k < 0:
                return None, "unterminated raw string literal"
            out.append(text[i : k + len(end)])
            i = k + len(end)
        elif tok == "'":
            c = None if prev_ident else _CHAR_LIT.match(text, i)
            if c is None:  # a prime in an identifier (h')
                out.append("'")
                i += 1
            else:
                out.append(c.group(0))
                i = c.end()
        else:  # «name»
            k = text.find("»", i)
            if k < 0:
                return None, "unterminated «name»"
            out.append(text[i : k + 1])
            i = k + 1
    return "".join(out), None


_NORM_BRACKETS = re.compile(r"\s*([()\[\]{}⟨⟩⦃⦄,])\s*")
_NORM_COLON = re.compile(r"\s*(?<!:):(?![=:])\s*")


# Every line break str.splitlines() knows but "\n" ("\r\n" is made "\n" first). Lean reads none of them as a line
# break (a lone "\r" is an error, the others are not whitespace), a Kimina server splits snippets at all of them:
# see "Kimina Lean Server" in the module docstring.
LINE_BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
_LINE_BREAK_RX = re.compile("[" + "".join(LINE_BREAKS) + "]")


def _unify_line_breaks(text: str) -> str:
    """The text with each "\\r\\n" made "\\n": the one line break besides "\\n" that Lean reads as such."""
    return text.replace("\r\n", "\n")


def _odd_line_break(text: str) -> str | None:
    """Where `text` has a line break of LINE_BREAKS ("U+2028 on line 3"), or None."""
    found = _LINE_BREAK_RX.search(text)
    if found is None:
        return None
    line = text.count("\n", 0, found.start()) + 1
    return f"U+{ord(found.group(0)):04X} on line {line}"


def normalize_lean(code: str) -> str:
    """Whitespace-normalise comment-free Lean code for comparing statements: runs of
    whitespace become one space, and spaces next to brackets, commas and a type
    colon are dropped, so ``(x:ℝ)`` equals ``(x : ℝ)``."""
    s = " ".join(code.split())
    s = _NORM_BRACKETS.sub(r"\1", s)
    return _NORM_COLON.sub(":", s)


def _tok(*words: str) -> str:
    """Regex for whole Lean tokens (not part of a longer or dotted identifier)."""
    return r"(?<![\w'.])(?:" + "|".join(re.escape(w) for w in words) + r")(?![\w'!?])"


_HASH_COMMANDS = (
    "exit",
    "eval",
    "print",
    "check",
    "check_failure",
    "reduce",
    "synth",
    "help",
    "lint",
    "guard",
    "guard_expr",
    "guard_msgs",
    "guard_target",
    "where",
    "find",
    "simp",
    "norm_num",
    "conv",
    "time",
    "explode",
    "html",
    "widget",
    "version",
    "info_trees",
    "test",
    "sample",
    "count_heartbeats",
    "leansearch",
    "loogle",
    "moogle",
    "unfold?",
    "kerodon",
    "stacks",
)

# (rule, status, regex, what it catches) -- scanned over comment-free text
_TOKEN_RULES = [
    (
        "sorry",
        "sorry",
        re.compile(_tok("sorry", "admit", "stop") + r"|sorryAx"),
        "`sorry`/`admit`/`stop` leave the goal unproved",
    ),
    (
        "axiom",
        "cheat",
        re.compile(_tok("axiom", "axioms", "constant")),
        "declares a new axiom or constant",
    ),
    (
        "hash_command",
        "cheat",
        re.compile(
            r"(?<![\w'.#])#(?:"
            + "|".join(re.escape(w) for w in _HASH_COMMANDS)
            + r")(?![\w'!?])|(?m:^[ \t]*#[A-Za-z_])"
        ),
        "`#` commands (`#exit`, `#eval`, `#print`, ...) are not allowed in a proof",
    ),
    (
        "meta_code",
        "cheat",
        re.compile(
            _tok(
                "run_cmd",
                "run_tac",
                "run_elab",
                "run_meta",
                "by_elab",
                "elab",
                "elab_rules",
                "initialize",
                "builtin_initialize",
                "simproc",
                "dsimproc",
                "simproc_decl",
                "unif_hint",
            )
        ),
        "runs user meta code during elaboration",
    ),
    (
        "syntax_extension",
        "cheat",
        re.compile(
            _tok(
                "macro",
                "macro_rules",
                "syntax",
                "notation",
                "notation3",
                "infix",
                "infixl",
                "infixr",
                "prefix",
                "postfix",
                "declare_syntax_cat",
                "binder_predicate",
                "delab",
                "app_unexpander",
            )
        ),
        "changes the syntax (can redefine tactics or notation)",
    ),
    (
        "unsafe",
        "cheat",
        re.compile(_tok("unsafe", "implemented_by", "extern", "csimp")),
        "unsafe code or code replaced by an implementation the kernel does not check",
    ),
    (
        "native",
        "cheat",
        re.compile(
            _tok(
                "native_decide",
                "ofReduceBool",
                "ofReduceNat",
                "trustCompiler",
                "reduceBool",
                "reduceNat",
            )
            + r"|\+\s*native\b|\bnative\s*:=\s*true"
        ),
        "trusts the compiler (axiom Lean.ofReduceBool)",
    ),
    (
        "attribute",
        "cheat",
        re.compile(_tok("attribute")),
        "`attribute [...]` can add or remove instances and simp lemmas",
    ),
    (
        "instance",
        "cheat",
        re.compile(_tok("instance", "default_instance")),
        "declares an instance (can change what the statement means)",
    ),
    (
        "namespace",
        "cheat",
        re.compile(_tok("namespace", "export")),
        "`namespace`/`export` change name resolution",
    ),
]
_SET_OPTION = re.compile(_tok("set_option") + r"(\s+([^\s]+))?")
_IMPORT = re.compile(r"(?m)^[ \t]*import[ \t]+([^\s]+)[ \t]*$")
_DECL = re.compile(
    r"(?<![\w'.])(theorem|lemma|def|abbrev|instance|structure|inductive|class|opaque|axiom|constant|example)"
    r"(?![\w'!?])\s*(«[^»]*»|[^\s(\[{:⦃⟨»]+)?"
)
_MODIFIERS = {
    "private",
    "protected",
    "noncomputable",
    "unsafe",
    "partial",
    "nonrec",
    "scoped",
    "local",
}
_IDENT = re.compile(r"«[^»]*»|[^\W\d][\w'!?]*(?:\.[^\W\d][\w'!?]*)*")

CHEAT_RULES = {
    "lex": 'an unterminated comment or string literal, or a line break other than "\\n" outside comments',
    "sorry": "`sorry`, `admit`, `stop` or `sorryAx` outside comments (also a sorry reported by Lean)",
    "axiom": "a new `axiom` or `constant`",
    "hash_command": "a `#` command: `#exit`, `#eval`, `#print`, `#check`, ...",
    "meta_code": "user meta code: `run_tac`, `run_cmd`, `by_elab`, `elab`, `initialize`, `simproc`",
    "syntax_extension": "`macro`, `syntax`, `notation`, `infix`, ... (can redefine tactics or notation)",
    "unsafe": "`unsafe`, `@[implemented_by]`, `@[extern]`, `@[csimp]`",
    "native": "`native_decide`, `Lean.ofReduceBool`, `decide +native`",
    "set_option": "a `set_option` outside ALLOWED_OPTIONS (e.g. debug.skipKernelTC)",
    "instance": "an `instance` (also `local instance`, `@[instance]`)",
    "attribute": "an `attribute [...]` command",
    "namespace": "`namespace` or `export`",
    "scoping": "before the statement: `variable`/`include`/`omit`, a new top-level `open`, `open ... in` on it",
    "modifier": "an attribute or modifier on the target theorem",
    "statement": "the original statement missing or altered",
    "duplicate_name": "the theorem name declared more than once",
    "shadowing": "a helper declaration named like an identifier of the statement",
    "import": "an `import` that the header does not have",
    "axioms": "(Lean) `#print axioms` lists more than propext, Classical.choice, Quot.sound",
    "elaborated_statement": "(Lean) the proved theorem's type differs from the original statement's",
}

_CHEAT_TARGET = "theorem cheat_target (x : ℕ) (h₀ : x = 2) : x + x = 4 := by"
# (rule, original statement, submitted proof): each passes the stand-in REPL with
# `--accept all` and is rejected here by the named rule. The tests run all of them.
CHEAT_EXAMPLES = [
    ("lex", _CHEAT_TARGET, _CHEAT_TARGET + "\n  omega /- unterminated"),
    ("lex", _CHEAT_TARGET, _CHEAT_TARGET + "\n  omega\u2028  exact bogus"),
    ("sorry", _CHEAT_TARGET, _CHEAT_TARGET + "\n  sorry"),
    ("sorry", _CHEAT_TARGET, _CHEAT_TARGET + "\n  admit"),
    ("sorry", _CHEAT_TARGET, _CHEAT_TARGET + "\n  exact sorryAx _ false"),
    ("sorry", _CHEAT_TARGET, _CHEAT_TARGET + '\n  simp [show "sorry" = "sorry" from rfl]'),
    (
        "axiom",
        _CHEAT_TARGET,
        "axiom cheat : ∀ x : ℕ, x + x = 4\n" + _CHEAT_TARGET + "\n  exact cheat x",
    ),
    ("hash_command", _CHEAT_TARGET, _CHEAT_TARGET + "\n  omega\n#exit"),
    ("hash_command", _CHEAT_TARGET, '#eval IO.println "hi"\n' + _CHEAT_TARGET + "\n  omega"),
    (
        "meta_code",
        _CHEAT_TARGET,
        _CHEAT_TARGET + "\n  run_tac Lean.Elab.Tactic.evalTactic (← `(tactic| omega))",
    ),
    (
        "meta_code",
        _CHEAT_TARGET,
        'elab "cheat" : tactic => pure ()\n' + _CHEAT_TARGET + "\n  cheat",
    ),
    (
        "syntax_extension",
        _CHEAT_TARGET,
        'macro "omega" : tactic => `(tactic| simp)\n' + _CHEAT_TARGET + "\n  omega",
    ),
    (
        "syntax_extension",
        _CHEAT_TARGET,
        'local notation "four" => (4 : ℕ)\n' + _CHEAT_TARGET + "\n  omega",
    ),
    (
        "syntax_extension",
        _CHEAT_TARGET,
        'infixl:65 " +\' " => HAdd.hAdd\n' + _CHEAT_TARGET + "\n  omega",
    ),
    ("unsafe", _CHEAT_TARGET, "unsafe def f : ℕ := 4\n" + _CHEAT_TARGET + "\n  omega"),
    (
        "unsafe",
        _CHEAT_TARGET,
        "@[implemented_by id] def g (n : ℕ) : ℕ := n\n" + _CHEAT_TARGET + "\n  omega",
    ),
    (
        "unsafe",
        _CHEAT_TARGET,
        '@[extern "lean_nat_add"] def h (a b : ℕ) : ℕ := a + b\n' + _CHEAT_TARGET + "\n  omega",
    ),
    ("native", _CHEAT_TARGET, _CHEAT_TARGET + "\n  subst h₀\n  native_decide"),
    ("native", _CHEAT_TARGET, _CHEAT_TARGET + "\n  subst h₀\n  decide +native"),
    (
        "set_option",
        _CHEAT_TARGET,
        "set_option debug.skipKernelTC true in\n" + _CHEAT_TARGET + "\n  omega",
    ),
    (
        "set_option",
        _CHEAT_TARGET,
        _CHEAT_TARGET + "\n  set_option debug.skipKernelTC true in omega",
    ),
    ("set_option", _CHEAT_TARGET, "set_option autoImplicit true\n" + _CHEAT_TARGET + "\n  omega"),
    ("instance", _CHEAT_TARGET, "instance : Add ℕ := ⟨fun _ _ => 4⟩\n" + _CHEAT_TARGET + "\n  rfl"),
    (
        "instance",
        _CHEAT_TARGET,
        "local instance weird : OfNat ℕ 4 := ⟨0⟩\n" + _CHEAT_TARGET + "\n  omega",
    ),
    (
        "attribute",
        _CHEAT_TARGET,
        "attribute [local instance] Classical.propDecidable\n" + _CHEAT_TARGET + "\n  omega",
    ),
    ("namespace", _CHEAT_TARGET, "namespace Foo\n" + _CHEAT_TARGET + "\n  omega\nend Foo"),
    (
        "scoping",
        _CHEAT_TARGET,
        "variable (hf : False)\ninclude hf\n" + _CHEAT_TARGET + "\n  exact hf.elim",
    ),
    ("scoping", _CHEAT_TARGET, "open Finset\n" + _CHEAT_TARGET + "\n  omega"),
    ("scoping", _CHEAT_TARGET, "open Finset in\n" + _CHEAT_TARGET + "\n  omega"),
    ("modifier", _CHEAT_TARGET, "private " + _CHEAT_TARGET + "\n  omega"),
    ("modifier", _CHEAT_TARGET, "@[simp] " + _CHEAT_TARGET + "\n  omega"),
    (
        "statement",
        _CHEAT_TARGET,
        "theorem cheat_target (x : ℕ) (h₀ : x = 2) : x + x = 4 ∨ True := by\n  simp",
    ),
    (
        "statement",
        _CHEAT_TARGET,
        "theorem cheat_target (x : ℕ) (h₀ : x = 2) (h₁ : False) : x + x = 4 := by\n  omega",
    ),
    (
        "statement",
        _CHEAT_TARGET,
        "theorem other_name (x : ℕ) (h₀ : x = 2) : x + x = 4 := by\n  omega",
    ),
    (
        "duplicate_name",
        _CHEAT_TARGET,
        "theorem cheat_target : True := trivial\n" + _CHEAT_TARGET + "\n  omega",
    ),
    (
        "duplicate_name",
        _CHEAT_TARGET,
        "theorem Foo.cheat_target : True := trivial\n" + _CHEAT_TARGET + "\n  omega",
    ),
    (
        "duplicate_name",
        _CHEAT_TARGET,
        _CHEAT_TARGET + "\n  omega\ntheorem _root_.cheat_target : True := trivial",
    ),
    (
        "shadowing",
        "theorem cheat_sqrt : sqrt 4 = 2 := by",
        "def sqrt (x : ℝ) : ℝ := 2\ntheorem cheat_sqrt : sqrt 4 = 2 := by\n  rfl",
    ),
    (
        "import",
        _CHEAT_TARGET,
        "import Mathlib.Tactic.Linarith.Frontend\nimport Cheats\n" + _CHEAT_TARGET + "\n  omega",
    ),
]


def _allowed_option(name: str) -> bool:
    return any(
        name == p
        or (p.endswith(".") and name.startswith(p))
        or (not p.endswith(".") and name.startswith(p + "."))
        for p in ALLOWED_OPTIONS
    ) or name in ("profiler", "diagnostics")


def _scan_tokens(code: str) -> tuple | None:
    """Global text rules; returns (status, rule, detail) for the first hit, else None."""
    for rule, status, rx, what in _TOKEN_RULES:
        m = rx.search(code)
        if m:
            return status, rule, f"{what} (found {m.group(0).strip()!r})"
    for m in _SET_OPTION.finditer(code):
        opt = m.group(2)
        if not opt or not _allowed_option(opt):
            return (
                "cheat",
                "set_option",
                f"option {opt!r} is not allowed (allowed: {', '.join(ALLOWED_OPTIONS)})",
            )
    return None


def _last_component(name: str) -> str:
    name = name.replace("«", "").replace("»", "")
    if name.startswith("_root_."):
        name = name[len("_root_.") :]
    return name.rsplit(".", 1)[-1]


@functools.lru_cache(maxsize=256)
def _header_info(header: str) -> tuple:
    code, _ = strip_comments(header or "")
    code = code or ""
    imports = set(_IMPORT.findall(code))
    opens = set()
    for m in re.finditer(r"(?m)^[ \t]*open[ \t]+([^\n]*)$", code):
        opens.update(_open_names(m.group(1)))
    return imports, opens


def _open_names(clause: str) -> list:
    main = re.split(r"\(|" + _tok("hiding", "renaming"), clause)[0]
    return [w for w in _IDENT.findall(main) if w not in ("scoped", "in")]


@dataclass
class _Prepared:
    name: str  # theorem name used for #check / #print axioms
    core: str  # normalised statement up to (excluding) the final ':='
    lean_statement: str  # statement text for Lean (comments blanked, example renamed)
    lean_proof: str  # proof text for Lean (comments blanked, imports dropped, example renamed)


class _Reject(Exception):
    def __init__(self, status: str, rule: str, detail: str):
        super().__init__(f"{rule}: {detail}")
        self.status, self.rule, self.detail = status, rule, detail


def _prepare_statement(statement: str) -> tuple:
    """Check an original statement; returns (name, core, lean_statement, normalised)."""
    code, err = strip_comments(_unify_line_breaks(statement or ""))
    if err:
        raise _Reject("error", "lex", f"statement: {err}")
    odd = _odd_line_break(code)
    if odd is not None:
        raise _Reject("error", "lex", f"statement: a line break other than \\n ({odd})")
    hit = _scan_tokens(code)
    if hit:
        raise _Reject(hit[0], hit[1], "statement: " + hit[2])
    norm = normalize_lean(code)
    m = re.match(r"(theorem|lemma|example)(?![\w'!?])", norm)
    if not m:
        raise _Reject(
            "error", "statement", "the statement must start with `theorem`, `lemma` or `example`"
        )
    decls = _DECL.findall(code)
    if len(decls) != 1:
        raise _Reject("error", "statement", "the statement must declare exactly one theorem")
    mb = re.search(r":=\s*by$", norm)
    if not mb:
        raise _Reject("error", "statement", "the statement must end in ':= by'")
    core = norm[: mb.start()].rstrip()
    lean_statement = code.rstrip()
    if m.group(1) == "example":
        name = EXAMPLE_NAME
        core = "theorem " + name + core[len("example") :]
        pos = re.search(_tok("example"), lean_statement).start()
        lean_statement = (
            lean_statement[:pos] + "theorem " + name + lean_statement[pos + len("example") :]
        )
    else:
        if m.group(1) == "lemma":
            core = "theorem" + core[len("lemma") :]
        mn = re.match(r"theorem\s*(«[^»]*»|[^\s(\[{:⦃⟨]+)", core)
        if not mn:
            raise _Reject("error", "statement", "cannot read the theorem name")
        name = mn.group(1)
    return name, core, lean_statement


def _statement_identifiers(core: str) -> set:
    """Identifiers the statement mentions that are not bound by its explicit binders."""
    head = re.match(r"theorem\s*(«[^»]*»|[^\s(\[{:⦃⟨]+)", core)
    body = core[head.end() :] if head else core
    bound = set()
    for grp in re.finditer(r"[(\[{⦃]([^()\[\]{}⦃⦄]*?):", body):
        bound.update(grp.group(1).split())
    for q in re.finditer(r"(?:∀|∃|∃!|fun|λ)\s*([^,:=>]*)", body):
        bound.update(re.findall(r"[^\W\d][\w'!?]*", q.group(1)))
    keywords = {
        "theorem",
        "by",
        "fun",
        "Type",
        "Sort",
        "Prop",
        "if",
        "then",
        "else",
        "let",
        "have",
        "show",
        "from",
        "in",
        "at",
        "with",
        "match",
    }
    idents = set()
    for ident in _IDENT.findall(body):
        if ident in bound or ident in keywords:
            continue
        idents.add(ident.replace("«", "").replace("»", ""))
        idents.add(_last_component(ident))
    return idents


def prepare(job: ProofJob) -> _Prepared:
    """Run every text rule on a job; raises _Reject. Returns what Lean must check."""
    # The header goes to Lean (and to a Kimina server) as it is, comments included.
    header = _unify_line_breaks(job.header or "")
    odd = _odd_line_break(header)
    if odd is not None:
        raise _Reject("error", "lex", f"header: a line break other than \\n ({odd})")
    name, core, lean_statement = _prepare_statement(job.statement)
    code, err = strip_comments(_unify_line_breaks(job.proof or ""))
    if err:
        raise _Reject("error", "lex", err)
    # Comments are blanked by now, so a break left here is one Lean would read (and a Kimina server split at).
    odd = _odd_line_break(code)
    if odd is not None:
        raise _Reject("error", "lex", f"a line break other than \\n outside comments ({odd})")
    # imports: allowed only when the header already has them (then dropped)
    h_imports, h_opens = _header_info(header)
    for m in list(_IMPORT.finditer(code)):
        if m.group(1) not in h_imports:
            raise _Reject("error", "import", f"`import {m.group(1)}` is not in the header")
    code = _IMPORT.sub(lambda m: " " * len(m.group(0)), code)
    hit = _scan_tokens(code)
    if hit:
        raise _Reject(*hit)
    if name == EXAMPLE_NAME:  # find the `example` that carries the statement and name it
        orig_core = "example" + core[len("theorem " + EXAMPLE_NAME) :]
        spots = [
            m.start()
            for m in re.finditer(_tok("example"), code)
            if _starts_with_core(normalize_lean(code[m.start() :]), orig_core)
        ]
        if len(spots) != 1:
            raise _Reject(
                "cheat", "statement", "the original `example` statement is missing or repeated"
            )
        code = code[: spots[0]] + "theorem " + EXAMPLE_NAME + code[spots[0] + len("example") :]
    decls = [(m.group(1), m.group(2) or "", m.start()) for m in _DECL.finditer(code)]
    target_last = _last_component(name)
    same = [d for d in decls if d[1] and _last_component(d[1]) == target_last]
    if not same:
        raise _Reject("cheat", "statement", f"the theorem `{name}` is missing from the proof")
    if len(same) > 1:
        raise _Reject("cheat", "duplicate_name", f"`{target_last}` is declared {len(same)} times")
    kind, dname, pos = same[0]
    rest = normalize_lean(code[pos:])
    if kind == "lemma":
        rest = "theorem" + rest[len("lemma") :]
    if kind not in ("theorem", "lemma") or not _starts_with_core(rest, core):
        raise _Reject(
            "cheat",
            "statement",
            "the statement was altered (it must match the original up to whitespace)",
        )
    _check_prefix(code[:pos], h_opens)
    idents = _statement_identifiers(core)
    for k, dn, p in decls:
        if p == pos or not dn:
            continue
        full = dn.replace("«", "").replace("»", "").removeprefix("_root_.")
        if full in idents or _last_component(dn) in idents:
            raise _Reject("cheat", "shadowing", f"`{k} {dn}` shadows a name used in the statement")
    return _Prepared(name, core, lean_statement, code)


def _starts_with_core(rest: str, core: str) -> bool:
    return rest.startswith(core) and rest[len(core) :].lstrip().startswith(":=")


def _check_prefix(prefix: str, header_opens: set) -> None:
    m = re.search(_tok("variable", "include", "omit"), prefix)
    if m:
        raise _Reject(
            "cheat", "scoping", f"`{m.group(0)}` before the statement can add hypotheses to it"
        )
    for m in re.finditer(_tok("open") + r"([^\n]*)", prefix):
        clause = m.group(1)
        if re.search(_tok("in"), clause):
            continue
        extra = [w for w in _open_names(clause) if w not in header_opens]
        if extra:
            raise _Reject(
                "cheat",
                "scoping",
                f"`open {' '.join(extra)}` before the statement changes what it means",
            )
    tail = prefix.rstrip()
    while tail:
        if re.search(r"@\[[^\]]*\]$", tail):
            raise _Reject("cheat", "modifier", "an attribute on the target theorem")
        last = tail.split()[-1]
        if last in _MODIFIERS:
            raise _Reject("cheat", "modifier", f"`{last}` on the target theorem")
        if last != "in":
            break
        start = tail.rfind("\n") + 1
        line = tail[start:]
        mo = re.fullmatch(r"\s*set_option\s+([^\s]+)\s+[^\s]+\s+in", line)
        if mo and _allowed_option(mo.group(1)):
            tail = tail[:start].rstrip()
            continue
        raise _Reject("cheat", "scoping", f"`{line.strip()}` applied to the statement")


def check_text(job: ProofJob) -> LeanResult | None:
    """Only the text rules: a failed LeanResult, or None when Lean should decide."""
    try:
        prepare(job)
    except _Reject as r:
        return _fail(r.status, f"{r.rule}: {r.detail}")
    except Exception as e:  # never raise on model output
        return _fail("error", f"internal: {type(e).__name__}: {e}")
    return None


def proof_from_tactics(statement: str, tactics: list) -> str:
    """Assemble a whole proof from a statement ending in ':= by' and a tactic path."""
    lines = [
        textwrap.indent(textwrap.dedent(t).strip("\n"), "  ") for t in tactics if t and t.strip()
    ]
    return statement.rstrip() + "\n" + "\n".join(lines)


def one_tactic(text: str) -> str:
    """The text apply_tactic sends as the REPL's `tactic`. The REPL parses it as exactly one tactic that
    must consume the whole input (REPL/Snapshots.lean runString: Parser.runParserCategory), so
    `"ext1 x; ext1 n"` fails there with "expected end of input" and a second line is an error or is read
    as arguments of the first. A block of several tactics (more than one line, or a `;`) is sent as one
    parenthesised tactic sequence, `(t1\n t2)`, with its lines' relative indentation kept; it runs like
    the same lines in a `by` block, and the path stores the text as given."""
    lines = textwrap.dedent(str(text)).strip("\n").split("\n")
    lines = [ln.rstrip() for ln in lines]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return ""
    if len([ln for ln in lines if ln.strip()]) == 1 and ";" not in lines[0]:
        return lines[0].strip()
    return "(" + lines[0].strip() + "".join("\n " + ln for ln in lines[1:]) + ")"


_NAME = re.compile(r"(?:«[^»\n]+»|[^\W\d][\w'!?]*)(?:\.(?:«[^»\n]+»|[^\W\d][\w'!?]*))*")


def _is_name(name: str) -> bool:
    return (
        bool(_NAME.fullmatch(name.removeprefix("_root_."))) and name.removeprefix("_root_.") != ""
    )


def _used_constants(tactics: list, proof: str, mode) -> list:
    """The `usedConstants` of allTactics' tactics, deduplicated in order; unless mode == "all", only those
    the proof text names: the identifier itself, a suffix after a dot (`add_comm` for `Nat.add_comm` under
    `open Nat`), or the field of a dot-notation access (`h.le` for `LT.lt.le`)."""
    seen = list(
        dict.fromkeys(
            str(c) for t in tactics if isinstance(t, dict) for c in (t.get("usedConstants") or [])
        )
    )
    if mode == "all":
        return seen
    idents = set(_IDENT.findall(proof))
    fields = {i.rsplit(".", 1)[1] for i in idents if "." in i}
    return [
        c
        for c in seen
        if c in idents
        or any(c.endswith("." + i) for i in idents)
        or c.rsplit(".", 1)[-1] in fields
        and "." in c
    ]


# --------------------------------------------------------------------------- task formats (the algorithms' parsing)

# A statement to prove: its id, header (imports, options, opens) and statement ("theorem name ... := by", no proof).
Problem = collections.namedtuple("Problem", "id header statement")


def read_rows(source: str, split: str = "train") -> list:
    """The rows of a .jsonl or .json (a list) file, local or at a URL (fetched once into $SELFPLAY_CACHE/data), or of a
    split of a Hugging Face dataset (`datasets` is imported only then: it takes seconds)."""
    if "://" in source:
        cache = Path(os.environ.get("SELFPLAY_CACHE", Path.home() / ".cache" / "selfplay")) / "data"
        path = cache / f"{zlib.crc32(source.encode()):08x}-{os.path.basename(source)}"
        if not path.exists():  # ranks fetch at once: each renames a whole file into place
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(urllib.request.urlretrieve(source, f"{path}.{os.getpid()}")[0], path)
        source = str(path)
    if source.endswith((".json", ".jsonl")):
        with open(source) as f:
            return (
                json.load(f)
                if source.endswith(".json")
                else [json.loads(line) for line in f if line.strip()]
            )
    import datasets

    return list(datasets.load_dataset(source, split=split))


def load_problems(source: str, limit: int | None = None, split: str | None = None) -> list:
    """Problems from a dataset (read_rows) in any of the usual fields: D_3k (id, header, theorem), miniF2F (name,
    split, header, formal_statement), LeanWorkbook and Kimina-Prover-Promptset (formal_statement, whose text before
    the declaration is its header). `split`: keep rows whose split names it (STP's "miniF2F test" names "test") and
    rows with no split. The id is the row's id or name, else the theorem's name, else the row's index; a repeated id
    gets "#<index>" (ProofNet repeats names across books). A statement that is not a ':= by' task is skipped."""
    problems, seen = [], set()
    for i, row in enumerate(read_rows(source)):
        text = (row.get("theorem") or row.get("formal_statement") or "").strip()
        decl = re.search(r"^(?:theorem|lemma)\s", text, re.M)
        statement = clean_statement(text[decl.start() :] if decl else text)
        if statement is None or (
            split is not None and "split" in row and split not in str(row["split"]).split()
        ):
            continue
        name, pid = (
            re.match(r"(?:theorem|lemma)\s+(\S+)", statement),
            row.get("id", row.get("name")),
        )
        pid = str(pid if pid not in (None, "") else name.group(1) if name else i)
        pid = f"{pid}#{i}" if pid in seen else pid
        seen.add(pid)
        problems.append(
            Problem(
                pid,
                row.get("header") or (text[: decl.start()] if decl else "") or DEFAULT_HEADER,
                statement,
            )
        )
    return problems[:limit] if limit else problems


def clean_statement(text: str) -> str | None:
    """A dataset's statement as a task: stripped, a trailing 'sorry' dropped and ':=' given ' by'; None unless it
    then ends with ':= by' and holds no 'sorry' (no proof)."""
    statement = (text or "").strip().removesuffix("sorry").rstrip()
    statement += " by" if statement.endswith(":=") else ""
    return statement if statement.endswith(":= by") and "sorry" not in statement else None


def theorem_conclusion(statement: str) -> str:
    """The conclusion of 'theorem name binders : conclusion := by': the text after the first ':' outside
    brackets (binders are bracketed), or '' if there is none."""
    body, depth = statement.removesuffix(":= by"), 0
    for i, ch in enumerate(body):
        depth += (ch in "([{⦃⟨") - (ch in ")]}⦄⟩")
        if ch == ":" and depth == 0 and body[i + 1 : i + 2] != "=":
            return body[i + 1 :].strip()
    return ""


def extract_proof(completion: str, whole_block: bool = False) -> str | None:
    """A model's tactics after ':= by', or None if empty. whole_block=False: the completion continues a prompt
    that ends inside a ```lean4 block with the statement, so the proof is the completion up to the closing fence
    (a truncated completion is still checked: Lean rejects an unfinished proof). whole_block=True (strict): the
    completion must be exactly one ```lean4 block holding exactly one declaration (theorem / lemma / def); the
    proof is what follows its first ':= by'."""
    if not whole_block:
        proof = completion.split("\n```", 1)[0].split("```", 1)[0].rstrip()
        return proof if proof.strip() else None
    text = completion.strip()
    if not (text.startswith("```lean4") and text.endswith("```") and text.count("```") == 2):
        return None
    block = text[len("```lean4") : -len("```")]
    if (
        sum(block.count(word) for word in ("theorem ", "lemma ", "def ")) != 1
        or ":= by" not in block
    ):
        return None
    proof = block[block.find(":= by") + len(":= by") :].rstrip()
    return proof if proof.strip() else None


def _declaration(code: str, statement: str) -> re.Match | None:
    """Where `code` declares the theorem of `statement` (`theorem <name>` or `lemma <name>`)."""
    name = re.match(r"\s*(?:theorem|lemma)\s+(\S+)", statement).group(1)
    return re.search(rf"(?m)^\s*(?:theorem|lemma)\s+{re.escape(name)}(?![\w'.])", code)


def extract_last_block(completion: str, statement: str) -> str | None:
    """The whole code of a completion that answers in a new ```lean4 block (DeepSeek-Prover's format): its last closed
    block (CoProver's lean_reward.py rule) without import lines (the header has them), or None if empty; a block
    without the declaration of `statement` is its tactic body, put under the statement."""
    blocks = re.findall(r"```lean4?[ \t]*\n(.*?)```", completion, re.S)
    code = "\n".join(
        line for line in (blocks or [""])[-1].rstrip().split("\n") if not line.startswith("import ")
    )
    if not code.strip():
        return None
    return (
        code
        if _declaration(code, statement)
        else statement + "\n" + textwrap.indent(textwrap.dedent(code).strip("\n"), "  ")
    )


def proof_tactics(code: str, statement: str) -> list:
    """The top-level tactics of a whole proof of `statement`, to replay it: the lines after the ':= by' (or ':=\n  by')
    of its declaration, comments blanked, up to a line indented less than the block or, for a block at column 0, one
    starting a command (`#check t`, another theorem); [] for a term-mode proof. A line indented deeper than the block
    (a `·` body, a `calc` step) or starting with `|` or `<;>` continues the tactic above it, which is then a block
    (apply_tactic sends it as one parenthesised sequence)."""
    code = strip_comments(code)[0] or code
    decl = _declaration(code, statement)
    i, depth = decl.start() if decl else 0, 0
    while i < len(code) and not (
        depth == 0 and code.startswith(":=", i)
    ):  # the declaration's ':=', not a binder's
        depth, i = depth + (code[i] in "([{⦃") - (code[i] in ")]}⦄"), i + 1
    by = re.match(r":=\s*by(?![\w'!?])", code[i:])
    first, *rest = code[i + by.end() :].split("\n") if by else [""]
    tactics, rest = (
        [first.strip()] if first.strip() else [],
        [line for line in rest if line.strip()],
    )
    indent = len(rest[0]) - len(rest[0].lstrip()) if rest else 0
    command = re.compile(
        r"(#|@\[|(theorem|lemma|def|example|abbrev|instance|namespace|section|end|noncomputable|"
        r"variable|attribute|structure|inductive|class|axiom|private|protected)(?![\w'!?.]))"
    )
    for line in rest:
        if len(line) - len(line.lstrip()) < indent or indent == 0 and command.match(line):
            break
        if tactics and (
            len(line) - len(line.lstrip()) > indent or line.lstrip().startswith(("|", "<;>"))
        ):
            tactics[-1] += "\n" + line[indent:].rstrip()
        else:
            tactics.append(line.strip())
    return tactics


# A traced tactic (LeanDojo): the state before it, the tactic, the state after it (for RiR, the target state).
Triple = collections.namedtuple("Triple", "state tactic target")


def format_state(text: str) -> str:
    """LeanDojo's pretty-printed state without its leading 'N goals' line (RiR's common.format_state)."""
    head, _, rest = text.partition("\n")
    return rest.strip() if head.endswith(" goals") and head.split()[0].isdigit() else text.strip()


def load_triples(source: str, limit: int | None = None) -> list:
    """Traced tactics as Triples (format_state'd) from LeanDojo's theorem rows (traced_tactics: tactic, state_before,
    state_after, as in LeanDojo Benchmark 4's train.json) or from rows that are triples themselves (read_rows). The
    tactic as RiR's and ReProver's data modules write it (common.format_tactic; keep_marks, normalize_tactics): from
    annotated_tactic when given, each premise `<a>name</a>` as `<a>full name</a>`, whitespace runs as one space."""
    triples = []
    for row in read_rows(source):
        for t in row.get("traced_tactics") or [row]:
            if not {"tactic", "state_before", "state_after"} <= set(t):
                raise ValueError(
                    f"{source}: a row with neither traced_tactics nor tactic, state_before, state_after: "
                    f"{sorted(t)}"
                )
            text, premises = t.get("annotated_tactic") or (t["tactic"], [])
            parts = re.split(r"<a>.+?</a>", " ".join(text.split()))
            if premises and len(parts) == len(premises) + 1:  # the marks name the premises in order
                text = (
                    "".join(f"{part}<a>{p['full_name']}</a>" for part, p in zip(parts, premises))
                    + parts[-1]
                )
            triples.append(
                Triple(
                    format_state(t["state_before"]),
                    " ".join(text.split()),
                    format_state(t["state_after"]),
                )
            )
    return triples[:limit] if limit else triples


def extract_conjecture(
    completion: str, end_marker: str | None = None, finish_reason: str = "stop", banned: tuple = ()
) -> str | None:
    """A model's new statement, ending with ':= by', or None.

    end_marker None: the last ```lean4 block, closed by a fence, with exactly one ':= by' and at most one
    'sorry', ending with 'sorry' or ':= by'; header lines (import/open/set_option) before the declaration are
    dropped, and it must start with `theorem` or `lemma`.
    end_marker given: the text before it, with 'theorem ' in front (replacing 'lemma '), cut before its first
    ':=', then ':= by'; a completion that failed (finish_reason not "stop"/"length") or ran out of tokens before
    the marker is dropped, and so is a statement holding 'sorry', a fence or one of `banned`.
    Either way the statement needs a name and a conclusion (theorem_conclusion)."""
    if end_marker is None:
        start, end = completion.rfind("```lean4"), completion.rfind("```")
        if start < 0 or end <= start:
            return None  # no block, or a truncated one
        block = completion[start + len("```lean4") : end].strip()
        if (
            block.count(":= by") != 1
            or block.count("sorry") > 1
            or not block.endswith(("sorry", ":= by"))
        ):
            return None
        block = re.sub(
            r"\A(\s*((import|open|set_option)\b.*)?\n)*", "", block
        )  # blank and header lines
        if ":= by" not in block or not re.match(r"(theorem|lemma)\s+\S", block):
            return None
        statement = block[: block.index(":= by") + len(":= by")]
        return statement if theorem_conclusion(statement) else None
    if finish_reason not in ("stop", "length") or (
        finish_reason == "length" and end_marker not in completion
    ):
        return None
    text = re.sub(r"^(lemma |theorem |)", "theorem ", completion.split(end_marker, 1)[0].strip())
    statement = text.split(":=", 1)[0].rstrip() + " := by"
    if any(bad in statement for bad in ("sorry", "```", *banned)):
        return None
    return (
        statement
        if re.match(r"theorem\s+[^\s:(\[{]+", statement) and theorem_conclusion(statement)
        else None
    )


_LEMMA_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_'.!?₀-₉]*")
_BINDERS = re.compile(
    r"\b(?:have|haveI|let|set|obtain|intro|intros|rintro|rcases|cases'|induction'|by_cases"
    r"|by_contra|by_contra!|generalize|with|fun|λ|at)\b([^:=\n]*)"
)
TACTIC_NAMES = frozenset(  # snake_case tactics, which invoked_lemmas would otherwise take for lemmas
    "norm_num simp_all field_simp ring_nf push_cast exact_mod_cast norm_cast linear_combination simp_arith split_ifs "
    "by_contra by_cases push_neg interval_cases fin_cases apply_fun rw_mod_cast simp_rw nth_rewrite nth_rw "
    "induction' cases' conv_lhs conv_rhs norm_num1 all_goals any_goals on_goal pick_goal rotate_left rotate_right "
    "infer_instance assumption_mod_cast apply_rules solve_by_elim cancel_denoms compute_degree apply_assumption "
    "simp_intro match_target refine_lift exists_intro decreasing_tactic mod_cases field_simp! contrapose! "
    "by_contra! push_neg! norm_num! simp_all! positivity_ext nlinarith! linarith! simp! exact? apply? rw? "
    "aesop_cat unfold_let apply_mod_cast bound_nf".split()
)


def invoked_lemmas(proof: str, statement: str = "") -> list:
    """Mathlib lemmas a proof names, by a static scan of its text (no Lean; ``verify(used_constants=True)`` asks
    Lean instead): identifiers whose last component has an underscore (Mathlib's snake_case theorem names:
    sq_nonneg, Nat.succ_le_iff), minus TACTIC_NAMES, names the proof binds (have h_pos ..., obtain ⟨x, hx_1⟩ ...)
    and names of the statement. In order of first use."""
    bound = set(_LEMMA_IDENT.findall(statement)).union(
        *(_LEMMA_IDENT.findall(m.group(1)) for m in _BINDERS.finditer(proof))
    )
    found = []
    for name in (name.rstrip(".") for name in _LEMMA_IDENT.findall(proof)):
        last = name.split(".")[-1]
        if (
            "_" in last.strip("_")
            and name not in found
            and name not in TACTIC_NAMES
            and not {name, last} & bound
        ):
            found.append(name)
    return found


# --------------------------------------------------------------------------- judging Lean's answer

_SORRY_WARNING = re.compile(r"declaration uses ['`‘]sorry['`’]")


def _fail(status: str, reason: str, errors=None, messages=None, t: float = 0.0) -> LeanResult:
    return LeanResult(False, status, list(errors or []), reason, t, list(messages or []))


def _fmt(msg: dict) -> str:
    pos = msg.get("pos") or {}
    return f"{pos.get('line', 0)}:{pos.get('column', 0)}: {msg.get('data', '')}"


def _root(name: str) -> str:
    """`_root_.name`: resolves to the root declaration only, even when the header opens a namespace that
    has a `name` too (Lean's ResolveName.resolveExact)."""
    return name if name.startswith("_root_.") else "_root_." + name


def _check_block(name: str) -> str:
    return f"set_option pp.all true in\n#check @{_root(name)}\n\n#print axioms {_root(name)}\n"


_AXIOMS_MSG = re.compile(
    r"'(.+?)' (?:depends on axioms:\s*\[(.*?)\]|(does not depend on any axioms))", re.S
)


def _bare(name: str) -> str:
    return name.removeprefix("_root_.").replace("«", "").replace("»", "")


def _parse_checks(msgs: list, name: str) -> tuple:
    """From the messages of `_check_block(name)`: (pp.all type string or None, axioms set or None).
    `#print axioms` prints one message per declaration the name resolves to; only the one naming the
    checked theorem counts (none: None, so the verdict fails closed)."""
    ctype, axioms = None, None
    for m in msgs:
        if m.get("severity") == "error":
            continue
        d = str(m.get("data", ""))
        am = _AXIOMS_MSG.search(d)
        if am:
            if _bare(am.group(1)) == _bare(name):
                axioms = (
                    set()
                    if am.group(3)
                    else {a.strip() for a in am.group(2).split(",") if a.strip()}
                )
        elif ctype is None and m.get("severity") == "info":
            ctype = " ".join(d.split())
            if " : " in ctype:  # drop the "@name" part: only the type is compared
                ctype = ctype.split(" : ", 1)[1]
    return ctype, axioms


def _judge(
    messages: list,
    sorries: list,
    check_msgs: list | None,
    orig_type: str | None,
    name: str,
    lean_checks: bool,
) -> tuple:
    """Verdict from Lean's output: (status, reason, errors)."""
    errors = [_fmt(m) for m in messages if m.get("severity") == "error"]
    if errors:
        return (
            "error",
            "lean: "
            + str(messages[[m.get("severity") for m in messages].index("error")].get("data", ""))[
                :300
            ],
            errors,
        )
    warnings = [str(m.get("data", "")) for m in messages if m.get("severity") == "warning"]
    if sorries or any(_SORRY_WARNING.search(w) for w in warnings):
        return "sorry", "sorry: Lean reports that the proof uses sorry", []
    failed = [w for w in warnings if "failed" in w]
    if failed:
        return "error", "lean: warning: " + failed[0][:300], []
    if not lean_checks:
        return "valid", "", []
    check_msgs = check_msgs or []
    cerr = [_fmt(m) for m in check_msgs if m.get("severity") == "error"]
    if cerr:
        return "error", f"lean: cannot inspect `{name}` after the proof: {cerr[0][:200]}", cerr
    ctype, axioms = _parse_checks(check_msgs, name)
    if axioms is None or ctype is None:
        return "error", "lean: no output from #check / #print axioms", []
    extra = sorted(axioms - ALLOWED_AXIOMS)
    if "sorryAx" in extra:
        return "sorry", "sorry: the proof depends on sorryAx", []
    if extra:
        return "cheat", f"axioms: the proof uses axioms {', '.join(extra)}", []
    if orig_type is not None and ctype != orig_type:
        return (
            "cheat",
            "elaborated_statement: the proved theorem's type differs from the original statement",
            [],
        )
    return "valid", "", []


# --------------------------------------------------------------------------- REPL processes


class _Timeout(Exception):
    pass


class _Crash(Exception):
    pass


class _Garbled(Exception):
    pass


class _MemoryExceeded(Exception):
    pass


class _HeaderFailed(Exception):
    pass


_LIVE_PROCS: weakref.WeakSet[_ReplProcess] = weakref.WeakSet()


@atexit.register
def _kill_all_processes():  # no orphan REPLs when the program ends
    for p in list(_LIVE_PROCS):
        p.kill()


class _ReplProcess:
    """One REPL subprocess speaking JSON over stdin/stdout, in its own process group."""

    POLL = 0.25  # seconds between memory checks while waiting

    def __init__(self, argv: list, cwd: str | None):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            start_new_session=True,
            bufsize=0,
        )
        self.fd = self.proc.stdout.fileno()
        self.in_fd = self.proc.stdin.fileno()
        os.set_blocking(self.in_fd, False)
        self.buf = b""
        self.noise = 0
        self.dead = False
        self._tree = None
        self._tree_time = 0.0
        _LIVE_PROCS.add(self)

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    TREE_REFRESH = 5.0  # seconds; `lake env` starts the real REPL as its child

    def rss_mb(self) -> float:
        """Resident memory of the process tree (the process and its children), in MiB.
        The tree is listed every few seconds (listing children scans all of /proc)."""
        pid = self.proc.pid
        if psutil is not None:
            now = time.monotonic()
            try:
                if self._tree is None or now - self._tree_time > self.TREE_REFRESH:
                    root = psutil.Process(pid)
                    self._tree = [root] + root.children(recursive=True)
                    self._tree_time = now
                total = 0
                for p in self._tree:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        self._tree = None
                return total / 2**20
            except psutil.Error:
                self._tree = None
                return 0.0
        try:  # pragma: no cover
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError, IndexError):
            return 0.0

    def stderr_tail(self, n: int = 600) -> str:
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - n))
            return self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def request(self, obj: dict, timeout: float, memory_limit_mb: float | None = None) -> dict:
        deadline = time.monotonic() + max(0.01, timeout)
        data = (json.dumps(obj, ensure_ascii=False) + "\n\n").encode("utf-8", "replace")
        self._write(data, deadline, memory_limit_mb)
        return self._read(deadline, memory_limit_mb)

    def _check_memory(self, limit):
        if limit and self.rss_mb() > limit:
            raise _MemoryExceeded(f"REPL memory above {limit:.0f} MB")

    def _write(self, data: bytes, deadline: float, limit) -> None:
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout("timed out sending to the REPL")
            try:
                _, w, _ = select.select([], [self.in_fd], [], min(left, self.POLL))
            except (OSError, ValueError) as e:
                raise _Crash(f"REPL pipe closed: {e}") from e
            if not w:
                if not self.alive():
                    raise _Crash(self._died())
                self._check_memory(limit)
                continue
            try:
                k = os.write(self.in_fd, view)
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError) as e:
                raise _Crash(f"REPL pipe closed: {e}; {self._died()}") from e
            view = view[k:]

    def _died(self) -> str:
        rc = self.proc.poll()
        tail = self.stderr_tail()
        return f"REPL exited (code {rc})" + (f": {tail}" if tail else "")

    def _take_reply(self) -> dict | None:
        """Parse the first complete reply in the buffer. Replies are JSON objects followed
        by a blank line; text before a reply that has no line starting with '{' is noise
        (some REPL builds print progress lines) and is skipped."""
        while True:
            k = self.buf.find(b"\n\n")
            if k < 0:
                return None
            chunk, self.buf = self.buf[:k], self.buf[k + 2 :]
            text = chunk.decode("utf-8", "replace")
            if not text.strip():
                continue
            lines = text.split("\n")
            starts = [i for i, ln in enumerate(lines) if ln.startswith("{")]
            if not starts:
                self.noise += 1
                continue
            for i in starts:
                try:
                    obj = json.loads("\n".join(lines[i:]))
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    return obj
            raise _Garbled("the REPL printed something that is not a JSON reply: " + text[:200])

    def _read(self, deadline: float, limit) -> dict:
        last_mem = time.monotonic()
        while True:
            reply = self._take_reply()
            if reply is not None:
                return reply
            if len(self.buf) > 64 * 2**20:
                raise _Garbled("REPL reply larger than 64 MiB")
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise _Timeout("timed out")
            if limit and now - last_mem >= self.POLL:
                last_mem = now
                self._check_memory(limit)
            try:
                r, _, _ = select.select([self.fd], [], [], min(left, self.POLL))
            except (OSError, ValueError) as e:
                raise _Crash(f"REPL pipe closed: {e}") from e
            if r:
                data = os.read(self.fd, 1 << 16)
                if not data:
                    self.dead = True
                    raise _Crash(self._died())
                self.buf += data

    def kill(self) -> None:
        if self.dead and self.proc.returncode is not None:
            return
        self.dead = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except (OSError, ValueError):
                pass


class _Worker:
    """A REPL process that has imported one header (env id `env`). `states` counts the proof states the
    REPL holds; `paths` maps (statement, tactic path) to a proof state made by replaying it there."""

    def __init__(self, header: str):
        self.header = header
        self.proc: _ReplProcess | None = None
        self.env = None
        self.uses = 0
        self.states = 0
        self.paths: dict = {}
        self.generation = 0
        self.busy = False
        self.retired = False
        self.last_used = 0.0
        self.last_start = 0.0  # when the last request was sent
        self.last_time = 0.0  # how long it took
        self.last_states = 0  # proof states the last proof check made

    def live(self) -> bool:
        return self.proc is not None and self.proc.alive() and self.env is not None

    def ensure(self, pool: _ReplPool) -> None:
        if self.live():
            return
        self.stop()
        self.proc = _ReplProcess(pool.config.argv, pool.config.cwd)
        self.generation += 1
        self.uses = 0
        pool.starts += 1
        resp = self.proc.request({"cmd": self.header}, pool.header_timeout, pool.memory_limit_mb)
        errs = [_fmt(m) for m in resp.get("messages", []) if m.get("severity") == "error"]
        if "message" in resp or errs or not isinstance(resp.get("env"), int):
            self.stop()
            raise _HeaderFailed("; ".join(errs) or str(resp.get("message", resp))[:500])
        self.env = resp["env"]

    def request(self, pool: _ReplPool, obj: dict, timeout: float) -> dict:
        self.last_start = time.monotonic()
        try:
            return self.proc.request(obj, timeout, pool.memory_limit_mb)
        finally:
            self.last_time = time.monotonic() - self.last_start

    def note_use(self, pool: _ReplPool, uses: int = 1, states: int = 0) -> None:
        """Count commands (each stores an environment) and proof states; recycle the REPL after
        max_uses commands, max_proof_states states, or above the memory limit."""
        self.uses += uses
        self.states += states
        if self.proc is None:
            return
        if (
            (pool.max_uses and self.uses >= pool.max_uses)
            or (pool.max_proof_states and self.states >= pool.max_proof_states)
            or (pool.memory_limit_mb and self.proc.rss_mb() > pool.memory_limit_mb)
        ):
            pool.recycles += 1
            self.stop()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        self.proc = None
        self.env = None
        self.states = 0
        self.paths = {}


class _ReplPool:
    """At most `size` workers; a job takes an idle worker with its header, else a new
    one, else replaces the least recently used idle worker of another header."""

    def __init__(
        self,
        config: _ReplConfig,
        size: int,
        memory_limit_mb,
        max_uses,
        header_timeout,
        max_proof_states=None,
    ):
        self.config = config
        self.size = max(1, int(size))
        self.memory_limit_mb = memory_limit_mb
        self.max_uses = max_uses
        self.max_proof_states = max_proof_states
        self.header_timeout = header_timeout
        self.workers: list[_Worker] = []
        self.cond = threading.Condition()
        self.starts = 0  # REPL processes started (stats)
        self.recycles = 0  # restarts for max_uses / memory

    def acquire(
        self, header: str, worker: _Worker | None = None, prefer=None, wait: bool = True
    ) -> _Worker | None:
        """A worker for `header` (or `worker` itself), marked busy; None if `worker` was retired, or if
        wait=False and one would have to wait. `prefer(w)` ranks idle workers of the header."""
        victim = None
        with self.cond:
            while True:
                if worker is not None:
                    if worker.retired:
                        return None
                    if not worker.busy:
                        worker.busy = True
                        return worker
                    self.cond.wait()
                    continue
                same = [w for w in self.workers if not w.busy and w.header == header]
                if same:
                    w = max(same, key=lambda w: (w.live(), prefer(w) if prefer else 0))
                    w.busy = True
                    return w
                if len(self.workers) < self.size:
                    w = _Worker(header)
                    w.busy = True
                    self.workers.append(w)
                    return w
                idle = [w for w in self.workers if not w.busy]
                if idle:
                    victim = min(idle, key=lambda w: w.last_used)
                    victim.retired = True
                    self.workers.remove(victim)
                    w = _Worker(header)
                    w.busy = True
                    self.workers.append(w)
                    break
                if not wait:
                    return None
                self.cond.wait()
        victim.stop()
        return w

    def release(self, w: _Worker) -> None:
        with self.cond:
            w.busy = False
            w.last_used = time.monotonic()
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            ws, self.workers = self.workers, []
            for w in ws:
                w.retired = True
            self.cond.notify_all()
        for w in ws:
            w.stop()


# --------------------------------------------------------------------------- the backend interface


def _in_parallel(tasks: list, n: int, width: int) -> list:
    """Run tasks [(index, fn)] on up to `width` threads; results[index] = fn()."""
    results: list = [None] * n
    lock = threading.Lock()
    it = iter(tasks)

    def run():
        while True:
            with lock:
                task = next(it, None)
            if task is None:
                return
            results[task[0]] = task[1]()

    threads = max(1, min(width, len(tasks)))
    if threads == 1:
        run()
    else:
        with ThreadPoolExecutor(threads) as ex:
            for f in [ex.submit(run) for _ in range(threads)]:
                f.result()
    return results


def _has_error(messages: list) -> bool:
    return any(m.get("severity") == "error" for m in messages)


def _read_signatures(messages: list, n: int, first: float, spacing: int) -> list:
    """The info text of the k-th `#check` line (k = ceil((line - first) / spacing)) for k < n, else None."""
    signatures: list = [None] * n
    for m in messages:
        k = math.ceil((_line(m) - first) / spacing)
        if m.get("severity") == "info" and 0 <= k < n and signatures[k] is None:
            signatures[k] = " ".join(str(m.get("data", "")).split())
    return signatures


@dataclass
class Snippet:
    """One thing for a backend to check: `code` run in the environment of `header`. `checked` names a
    theorem whose check block (`_check_block`) runs in the environment after `code`, at least when `code`
    has no error; `names` asks instead for `#check _root_.n` of each name (`code` is then empty);
    `all_tactics` asks for the REPL's per-tactic info (``"allTactics": true``)."""

    header: str
    code: str = ""
    checked: str = ""
    names: tuple = ()
    all_tactics: bool = False


@dataclass
class RawResult:
    """What a backend saw for one Snippet, unjudged. `failure` is set when there is nothing to judge (no
    answer: a timeout, a crash, a server error, a header that fails, a reply without messages); otherwise
    `messages` and `sorries` are the code's, `check_messages` the check block's (None: it did not run),
    `tactics` the allTactics info, `signatures` one `#check` text (or None) per name, and `time` the seconds
    the snippet itself cost (not starting a REPL or importing the header)."""

    messages: list = field(default_factory=list)
    sorries: list = field(default_factory=list)
    check_messages: list | None = None
    tactics: list = field(default_factory=list)
    signatures: list = field(default_factory=list)
    time: float = 0.0
    failure: LeanResult | None = None


class LeanBackend:
    """The interface between LeanVerifier and a way of running Lean (see "Adding a backend" in the module
    docstring). `check` runs a batch of Snippets under a timeout and returns one RawResult each, in order,
    and never raises on model output: it reports failures in RawResult.failure. A backend also says its
    `name`, `workers` (how many snippets it runs at once), `lean_checks` (whether it runs a Snippet's check
    block; a verifier with the Lean-side checks refuses a backend without) and `all_tactics` (whether it
    fills RawResult.tactics; without, used_constants stays None), and has `stats()` and `close()`."""

    name = "custom"
    workers = 1
    lean_checks = True
    all_tactics = False

    def check(self, snippets: list, timeout: float, progress: bool = False) -> list:
        raise NotImplementedError

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the local REPL backend


class ReplBackend(LeanBackend):
    """The pool of local REPLs (see the module docstring): snippets grouped by header, `workers` at once.
    A snippet whose REPL crashes is retried once on a fresh REPL; a header that fails fails the rest of
    its batch without being imported again. The tactic engine (TacticEngine) runs on the same pool."""

    name = "repl"
    all_tactics = True

    def __init__(
        self,
        config: _ReplConfig,
        workers: int | None = None,
        memory_limit_mb: float | None = DEFAULT_MEMORY_LIMIT_MB,
        max_uses: int | None = DEFAULT_MAX_USES,
        header_timeout: float = 300.0,
        max_proof_states: int | None = DEFAULT_MAX_PROOF_STATES,
    ):
        self.config = config
        self.workers = int(workers) if workers else _default_workers()
        self.pool = _ReplPool(
            config,
            self.workers,
            memory_limit_mb=memory_limit_mb,
            max_uses=max_uses,
            header_timeout=header_timeout,
            max_proof_states=max_proof_states,
        )
        logger.info(
            "lean_verify: a pool of %d REPL worker(s)%s (%d cores, %.0f GB, LOCAL_WORLD_SIZE=%d)",
            self.workers,
            "" if workers else " by default",
            os.cpu_count() or 1,
            _memory_gb(),
            _local_world_size(),
        )

    def check(self, snippets: list, timeout: float, progress: bool = False) -> list:
        """One RawResult per snippet, in order; grouped by header so that a worker keeps its environment."""
        snippets = list(snippets)
        header_failures: dict = {}
        order = sorted(range(len(snippets)), key=lambda i: snippets[i].header)
        bar = _Progress(len(snippets), progress)

        def one(i):
            raw = self._check_one(snippets[i], timeout, header_failures)
            bar.step()
            return raw

        tasks = [(i, functools.partial(one, i)) for i in order]
        results = _in_parallel(tasks, len(snippets), self.workers)
        bar.close()
        return results

    def _check_one(self, snippet: Snippet, timeout: float, header_failures: dict) -> RawResult:
        """One snippet on a worker of its header: a crash is retried once on a fresh REPL, a timeout is not."""
        try:
            failed = header_failures.get(snippet.header)
            if failed is not None:
                return RawResult(failure=dataclasses.replace(failed))
            last = None
            for _attempt in range(2):
                w = self.pool.acquire(snippet.header)
                try:
                    raw = self._run(w, snippet, timeout)
                    w.note_use(self.pool, states=w.last_states)
                    return raw
                except _Timeout as e:
                    w.stop()
                    spent = time.monotonic() - w.last_start
                    reason = f"timeout: {e} after {timeout:g} s"
                    return RawResult(failure=_fail("timeout", reason, t=spent))
                except _HeaderFailed as e:
                    w.stop()
                    reason = f"header: the header does not elaborate: {e}"
                    header_failures[snippet.header] = _fail("error", reason, errors=[str(e)])
                    return RawResult(failure=dataclasses.replace(header_failures[snippet.header]))
                except _HeaderTimeout as e:
                    w.stop()
                    reason = f"header: importing the header timed out ({e})"
                    header_failures[snippet.header] = _fail("timeout", reason)
                    return RawResult(failure=dataclasses.replace(header_failures[snippet.header]))
                except (_Crash, _Garbled, _MemoryExceeded) as e:
                    w.stop()
                    last = e
                finally:
                    self.pool.release(w)
            kind = "memory" if isinstance(last, _MemoryExceeded) else "crash"
            return RawResult(failure=_fail("crash", f"{kind}: {last} (restarted and retried once)"))
        except Exception as e:  # never lose a proof
            return RawResult(failure=_fail("crash", f"internal: {type(e).__name__}: {e}"))

    def ensure(self, w: _Worker) -> None:
        """Start `w`'s REPL and import its header if needed; a header import past its time is _HeaderTimeout."""
        try:
            w.ensure(self.pool)
        except _Timeout as e:
            raise _HeaderTimeout(str(e)) from e

    def _run(self, w: _Worker, snippet: Snippet, timeout: float) -> RawResult:
        """The snippet's code, then its check block in the environment after it (when the code has no error)."""
        self.ensure(w)
        w.last_states = 0
        if snippet.names:
            return self._run_names(w, snippet, timeout)
        request = {"cmd": snippet.code, "env": w.env}
        if snippet.all_tactics:
            request["allTactics"] = True
        resp = w.request(self.pool, request, timeout)
        spent = w.last_time
        if "message" in resp and "env" not in resp:
            message = str(resp["message"])
            failure = _fail("error", f"lean: {message[:300]}", errors=[message], t=spent)
            return RawResult(failure=failure)
        messages = list(resp.get("messages") or [])
        sorries = list(resp.get("sorries") or [])
        tactics = list(resp.get("tactics") or [])
        w.last_states = len(sorries) + len(tactics)
        check_messages = None
        if snippet.checked and not _has_error(messages):
            check_messages = self._run_checks(w, resp.get("env"), snippet.checked, timeout)
            spent += w.last_time
        return RawResult(
            messages=messages,
            sorries=sorries,
            check_messages=check_messages,
            tactics=tactics,
            time=spent,
        )

    def _run_checks(self, w: _Worker, env, name: str, timeout: float) -> list:
        """Messages of `_check_block(name)` run in `env`."""
        request = {"cmd": _check_block(name), "env": env}
        chk = w.request(self.pool, request, min(timeout, 60.0) + 5.0)
        if "message" in chk and "env" not in chk:
            return [{"severity": "error", "data": str(chk["message"])}]
        return list(chk.get("messages") or [])

    def _run_names(self, w: _Worker, snippet: Snippet, timeout: float) -> RawResult:
        """`#check _root_.n` for each name, one line each, in one command."""
        text = "\n".join(f"#check {_root(n)}" for n in snippet.names)
        resp = w.request(self.pool, {"cmd": text, "env": w.env}, timeout)
        messages = list(resp.get("messages") or [])
        signatures = _read_signatures(messages, len(snippet.names), first=1, spacing=1)
        return RawResult(messages=messages, signatures=signatures, time=w.last_time)

    def stats(self) -> dict:
        """REPL processes started and recycled so far, workers alive, pool size, proof states held."""
        return {
            "starts": self.pool.starts,
            "recycles": self.pool.recycles,
            "workers": len(self.pool.workers),
            "size": self.pool.size,
            "proof_states": sum(w.states for w in self.pool.workers),
        }

    def close(self) -> None:
        self.pool.close()


# --------------------------------------------------------------------------- tactic mode


def _failed_state(header, statement, tactics, error, status="error", **kw) -> TacticState:
    return TacticState(
        state_id=None,
        goals=[],
        error=error,
        header=header,
        statement=statement,
        tactics=list(tactics),
        status=status,
        **kw,
    )


def _root_state(resp: dict, header: str, statement: str, w: _Worker) -> TacticState:
    """The root proof state from the REPL's answer to `statement sorry`, or a failed state."""
    if "message" in resp and "env" not in resp:
        return _failed_state(header, statement, [], f"lean: {resp['message']}")
    msgs = list(resp.get("messages") or [])
    errs = [_fmt(m) for m in msgs if m.get("severity") == "error"]
    if errs:
        return _failed_state(header, statement, [], "lean: " + "; ".join(errs), messages=msgs)
    sorries = [s for s in resp.get("sorries") or [] if isinstance(s.get("proofState"), int)]
    if not sorries:
        return _failed_state(header, statement, [], "lean: no proof state for the statement")
    s = sorries[0]
    return TacticState(
        state_id=s["proofState"],
        goals=[str(s.get("goal", "")).strip()],
        header=header,
        statement=statement,
        tactics=[],
        time=w.last_time,
        _worker=w,
        _generation=w.generation,
    )


def _step_state(resp: dict, parent: TacticState, path: list, w: _Worker, gen: int) -> TacticState:
    """The state after a tactic, from the REPL's answer, or a failed state."""
    t = w.last_time
    header, statement = parent.header, parent.statement
    if not isinstance(resp.get("proofState"), int):
        return _failed_state(header, statement, path, f"lean: {resp.get('message', resp)}", time=t)
    msgs = list(resp.get("messages") or [])
    errs = [_fmt(m) for m in msgs if m.get("severity") == "error"]
    goals = [str(g) for g in resp.get("goals") or []]
    status = resp.get("proofStatus")  # REPLs newer than v4.15.0 only
    kw = dict(messages=msgs, proof_status=status, time=t)
    if errs:  # an elaboration error closes goals with sorry: goals [] proves nothing
        return _failed_state(header, statement, path, "lean: " + "; ".join(errs), **kw)
    if resp.get("sorries"):
        return _failed_state(header, statement, path, "sorry: the tactic introduced sorry", **kw)
    if not goals and status is not None and status != "Completed":
        return _failed_state(header, statement, path, f"lean: proof status {status!r}", **kw)
    return TacticState(
        state_id=resp["proofState"],
        goals=goals,
        error=None,
        solved=not goals,
        tactics=path,
        header=header,
        statement=statement,
        status="open" if goals else "solved",
        _worker=w,
        _generation=gen,
        **kw,
    )


def _tactic_text(tactic: str) -> tuple:
    """(the tactic with comments blanked, None), or (None, why the text rules reject it)."""
    code, err = strip_comments(_unify_line_breaks(tactic))
    if err:
        return None, f"error: lex: {err}"
    odd = _odd_line_break(code)
    if odd is not None:
        return None, f"error: lex: a line break other than \\n ({odd})"
    hit = _scan_tokens(code)
    if hit:
        return None, f"{hit[0]}: {hit[1]}: {hit[2]}"
    if not code.strip():
        return None, "error: empty tactic"
    return code, None


def _stale_path(state: TacticState, w: _Worker) -> int:
    """The length of the longest prefix of `state`'s tactic path already replayed on `w` (-1: none)."""
    path = list(state.tactics)
    k = len(path)
    while k >= 0 and (state.statement, tuple(path[:k])) not in w.paths:
        k -= 1
    return k


class TacticEngine:
    """The REPL's tactic mode on a ReplBackend's pool (see "Tactic mode" in the module docstring): proof
    states live in the REPL that made it, steps on one REPL run in order and different REPLs in parallel, a
    state whose REPL was restarted is replayed. LeanVerifier's search methods call it."""

    def __init__(self, backend: ReplBackend, timeout: float):
        self.backend = backend
        self.pool = backend.pool
        self.timeout = float(timeout)

    def start_proof(self, header: str, statement: str) -> TacticState:
        """Root proof state of `statement` (which ends in ':= by') under `header`."""
        return self._start(str(header or ""), str(statement or ""), None)

    def _start(self, header: str, statement: str, held: _Worker | None) -> TacticState:
        """start_proof on the worker `held` (the caller holds it), or on one acquired here."""
        try:
            _, _, lean_statement = _prepare_statement(statement)
        except _Reject as r:
            return _failed_state(header, statement, [], f"{r.status}: {r.rule}: {r.detail}")
        last = None
        for _attempt in range(2):
            w = held or self.pool.acquire(header)
            try:
                self.backend.ensure(w)
                request = {"cmd": lean_statement + " sorry", "env": w.env}
                resp = w.request(self.pool, request, self.timeout)
                root = _root_state(resp, header, statement, w)
                w.note_use(self.pool, states=len(resp.get("sorries") or []))
                return root
            except (_Timeout, _HeaderTimeout) as e:
                w.stop()
                return _failed_state(header, statement, [], f"timeout: {e}", "timeout")
            except _HeaderFailed as e:
                w.stop()
                return _failed_state(header, statement, [], f"header: {e}")
            except (_Crash, _Garbled, _MemoryExceeded) as e:
                w.stop()
                last = e
            finally:
                if held is None:
                    self.pool.release(w)
        return _failed_state(header, statement, [], f"crash: {last}", "crash")

    def start_proofs(self, items: list) -> list:
        """start_proof for each (header, statement), spread evenly over the pool's REPLs (round robin over
        as many REPLs of the header as it can have, started in parallel)."""
        items = [(str(h or ""), str(st or "")) for h, st in items]
        results: list = [None] * len(items)
        by_header: dict = {}
        for i, (h, _) in enumerate(items):
            by_header.setdefault(h, []).append(i)
        for header, idx in by_header.items():
            held = []
            while len(held) < min(self.pool.size, len(idx)):
                w = self.pool.acquire(header, wait=False)
                if w is None:
                    break
                held.append(w)
            try:
                if held:
                    self._start_on(held, items, idx, results)
                else:  # every REPL is busy: one at a time, as they free up
                    for i in idx:
                        results[i] = self.start_proof(*items[i])
            finally:
                for w in held:
                    self.pool.release(w)
        return results

    def _start_on(self, held: list, items: list, idx: list, results: list) -> None:
        """Start items[i] for i in idx round robin over the held workers, one thread per worker."""
        shares = [(w, idx[j :: len(held)]) for j, w in enumerate(held)]

        def start_share(w, share):
            return [self._start(*items[i], w) for i in share]

        tasks = [
            (k, functools.partial(start_share, w, share)) for k, (w, share) in enumerate(shares)
        ]
        for (_worker, share), roots in zip(shares, _in_parallel(tasks, len(tasks), len(tasks))):
            for i, root in zip(share, roots):
                results[i] = root

    def _hold(self, state: TacticState) -> _Worker | None:
        """The live REPL that holds `state`, acquired; None when it was restarted or retired."""
        w = state._worker
        if not isinstance(w, _Worker):
            return None
        got = self.pool.acquire(state.header, worker=w)
        if got is None:
            return None
        if w.generation != state._generation or not w.live():
            self.pool.release(w)
            return None
        return w

    def _replay(self, state: TacticState, timeout: float) -> tuple:
        """Rebuild `state` on a live REPL of its header (its own was restarted): the statement, then the
        tactic path, from the longest prefix already rebuilt there. Returns (state, held worker or None)."""
        w = self.pool.acquire(state.header, prefer=lambda w: (state.statement, ()) in w.paths)
        ok = False
        header, statement, path = state.header, state.statement, list(state.tactics)
        try:
            self.backend.ensure(w)
            k = _stale_path(state, w)
            if k < 0:
                _, _, lean_statement = _prepare_statement(statement)
                request = {"cmd": lean_statement + " sorry", "env": w.env}
                resp = w.request(self.pool, request, timeout)
                w.note_use(self.pool, states=len(resp.get("sorries") or []))
                root = _root_state(resp, header, statement, w)
                if root.error or not w.live():
                    error = root.error or "replay failed"
                    return _failed_state(header, statement, path, error, "crash"), None
                sid, k = root.state_id, 0
                w.paths[(statement, ())] = sid
            else:
                sid = w.paths[(statement, tuple(path[:k]))]
            for i in range(k, len(path)):
                request = {"tactic": one_tactic(_strip_or_raw(path[i])), "proofState": sid}
                r = w.request(self.pool, request, timeout)
                if not isinstance(r.get("proofState"), int) or _has_error(r.get("messages") or []):
                    error = f"replay failed at {path[i]!r}"
                    return _failed_state(header, statement, path, error, "crash"), None
                sid = r["proofState"]
                w.paths[(statement, tuple(path[: i + 1]))] = sid
                w.note_use(self.pool, uses=0, states=1 + len(r.get("sorries") or []))
                if not w.live():
                    error = "replay failed: REPL recycled"
                    return _failed_state(header, statement, path, error, "crash"), None
            ok = True
            return dataclasses.replace(state, state_id=sid, _worker=w, _generation=w.generation), w
        except (
            _Timeout,
            _HeaderTimeout,
            _HeaderFailed,
            _Crash,
            _Garbled,
            _MemoryExceeded,
            _Reject,
        ) as e:
            w.stop()
            return _failed_state(header, statement, path, f"replay failed: {e}", "crash"), None
        finally:
            if not ok:
                self.pool.release(w)

    def apply_tactic(
        self, state: TacticState, tactic: str, timeout: float | None = None
    ) -> TacticState:
        """Run a tactic on `state`: the new state, or a failed one (`error` set, `state_id` None). The text
        may be a block of several tactics (lines, `;`): the REPL takes exactly one tactic per request, so it
        is sent as one parenthesised sequence (`one_tactic`), which runs like the same lines in a `by` block.
        Runs on the REPL that holds `state`; if that REPL was restarted, the state is replayed first (its
        statement and tactic path) on a REPL of its header. Never raises on model output."""
        timeout = self.timeout if timeout is None else float(timeout)
        tactic = "" if tactic is None else str(tactic)
        header, statement = state.header, state.statement
        path = list(state.tactics) + [tactic]
        if state.error is not None or state.state_id is None:
            return _failed_state(header, statement, path, "cannot apply a tactic to a failed state")
        if state.solved or not state.goals:
            return _failed_state(header, statement, path, "no goals left")
        code, rejected = _tactic_text(tactic)
        if rejected is not None:
            return _failed_state(header, statement, path, rejected)
        last = None
        for _attempt in range(2):
            try:
                w = self._hold(state)
                if w is None:
                    state, w = self._replay(state, timeout)
                    if w is None:
                        error = state.error or "replay failed"
                        return _failed_state(header, statement, path, error, "crash")
            except Exception as e:  # pragma: no cover - defensive
                return _failed_state(header, statement, path, f"crash: internal: {e}", "crash")
            try:
                request = {"tactic": one_tactic(code), "proofState": state.state_id}
                resp = w.request(self.pool, request, timeout)
                new = _step_state(resp, state, path, w, w.generation)
                made_state = isinstance(resp.get("proofState"), int)
                states = 1 + len(resp.get("sorries") or []) if made_state else 0
                w.note_use(self.pool, uses=0, states=states)
                return new
            except _Timeout as e:
                w.stop()
                spent = time.monotonic() - w.last_start
                error = f"timeout: {e} after {timeout:g} s"
                return _failed_state(header, statement, path, error, "timeout", time=spent)
            except (_Crash, _Garbled, _MemoryExceeded) as e:
                w.stop()
                last = e
            finally:
                self.pool.release(w)
        return _failed_state(header, statement, path, f"crash: {last}", "crash")

    def apply_tactics(self, steps: list, timeout: float | None = None) -> list:
        """apply_tactic for each (state, tactic), results in order. Steps on states held by the same REPL
        run one after another on it, steps on different REPLs in parallel (one thread per REPL)."""
        steps = list(steps)
        groups: dict = {}
        for i, (state, _tactic) in enumerate(steps):
            w = getattr(state, "_worker", None)
            key = id(w) if isinstance(w, _Worker) else ("header", getattr(state, "header", ""))
            groups.setdefault(key, []).append(i)
        results: list = [None] * len(steps)

        def run(idx):
            for i in idx:
                state, tactic = steps[i]
                if not isinstance(state, TacticState):
                    results[i] = _failed_state("", "", [], "not a TacticState")
                else:
                    results[i] = self.apply_tactic(state, tactic, timeout)
            return True

        tasks = [(k, functools.partial(run, idx)) for k, idx in enumerate(groups.values())]
        _in_parallel(tasks, len(groups), max(self.pool.size, 1))
        return results

    def free_states(self, states: list | None = None) -> int:
        """Restart the REPLs holding `states` (all REPLs holding proof states if None); the number restarted."""
        if states is None:
            targets = [w for w in list(self.pool.workers) if w.live() and w.states > 0]
        else:
            held = {}
            for s in states:
                w = getattr(s, "_worker", None)
                if isinstance(w, _Worker) and w.generation == s._generation and w.live():
                    held[id(w)] = w
            targets = list(held.values())
        n = 0
        for w in targets:
            if self.pool.acquire(w.header, worker=w) is None:
                continue
            try:
                if w.live():
                    w.stop()
                    n += 1
            finally:
                self.pool.release(w)
        return n


# --------------------------------------------------------------------------- the Kimina backend


def _kimina_code(
    header: str,
    body: str,
    name: str = "",
    checks: list | None = None,
    check_block: bool = True,
) -> tuple:
    """A snippet: the header's imports first (Kimina runs a snippet's leading import/blank lines as its
    header command; with none it would run later snippets in the first one's environment, so a header
    without imports gets `import Init`), the rest of the header, the body, then the check block of
    `name` (or `#check` lines for `checks`) after a gap. Message lines come back in the snippet's
    numbering (GitHub main adds the header's H lines back) or relative to the body, H lines less (PyPI's
    2.1.3). With a gap and spacing larger than H, the check messages are told apart either way. Lines are
    counted at "\\n" only, as the server counts them once no other line break is left (LINE_BREAKS).
    Returns (code, first check line, spacing, H). With check_block=False the snippet ends with the body
    and the first check line is infinite: every message is the body's, even one that Lean puts at the end
    of its command (where a check block would follow)."""
    head = header if header.endswith("\n") or not header else header + "\n"
    lines = (strip_comments(head)[0] or "").split("\n")
    kinds = [bool(_IMPORT.match(ln)) for ln in lines if ln.strip()]
    if not any(kinds):
        head = "import Init\n" + head
    elif not all(kinds[: kinds.count(True)]):  # an import after other lines: move the imports up
        head = "\n".join(
            [ln.strip() for ln in lines if _IMPORT.match(ln)]
            + [ln for ln in lines if not _IMPORT.match(ln)]
        )
    pre = head + body.rstrip() + "\n"
    pre_lines = pre.split("\n")
    h = 0
    while h < len(pre_lines) and (
        not pre_lines[h].strip() or pre_lines[h].strip().startswith("import ")
    ):
        h += 1
    spacing = h + 2
    if not check_block:
        return pre, math.inf, spacing, h
    first = pre.count("\n") + spacing + 1
    if checks is None:
        tail = _check_block(name)
    else:
        tail = "".join(f"#check {_root(n)}" + "\n" * spacing for n in checks)
    return pre + "\n" * spacing + tail, first, spacing, h


@dataclass
class _KiminaSnippet:
    """A Snippet laid out for Kimina: its id and code, the line from which messages are the check block's
    (`threshold`), and for `#check` lines the first line and spacing (`_kimina_code`)."""

    sid: str
    code: str
    threshold: float
    first: float
    spacing: int


class KiminaBackend(LeanBackend):
    """A client for a Kimina Lean Server (see "Kimina Lean Server" in the module docstring): snippets in
    POSTs of `batch_size`, `workers` POSTs at once; a busy or unreachable server is retried with backoff, a
    POST that fails as a whole is split until the bad snippet is alone."""

    name = "kimina"

    def __init__(
        self,
        url: str,
        workers: int | None = None,
        batch_size: int = 8,
        api_key: str | None = None,
        http_timeout: float | None = None,
        retries: int = 3,
        retry_delay: float = 1.0,
    ):
        self.url = url.rstrip("/")
        self.workers = int(workers) if workers else 4
        self.batch_size = max(1, int(batch_size))
        self.api_key = api_key or _setting(
            "LEAN_SERVER_API_KEY", "KIMINA_API_KEY", dotenv=_read_dotenv()
        )
        # None: a deadline per POST, from its size (deadline)
        self.http_timeout = float(http_timeout) if http_timeout else None
        self.retries = max(0, int(retries))
        self.retry_delay = float(retry_delay)
        self.counts = dict.fromkeys(KIMINA_COUNTS, 0)
        self.counts_lock = threading.Lock()

    def check(self, snippets: list, timeout: float, progress: bool = False) -> list:
        """One RawResult per snippet, in order, from the server's answers to a few POSTs."""
        snippets = list(snippets)
        laid_out = [self._lay_out(f"k{i}", s) for i, s in enumerate(snippets)]
        to_send = [k for k in laid_out if k is not None]
        answers = self._run_batches(to_send, timeout, progress)
        results = []
        for snippet, sent in zip(snippets, laid_out):
            if sent is None:  # the server would count the header's lines differently
                results.append(RawResult(signatures=[None] * len(snippet.names)))
                continue
            results.append(self._raw(answers.get(sent.sid), snippet, sent))
        return results

    @staticmethod
    def _lay_out(sid: str, snippet: Snippet) -> _KiminaSnippet | None:
        """The snippet as Kimina gets it; None for `#check` lines under a header with an odd line break."""
        if snippet.names:
            if _odd_line_break(snippet.header) is not None:
                return None
            code, first, spacing, _ = _kimina_code(snippet.header, "", checks=list(snippet.names))
            return _KiminaSnippet(sid, code, math.inf, first, spacing)
        # Without the Lean-side checks the snippet is the code alone, so that no message of it can be
        # taken for one of the check block's and dropped.
        code, first, spacing, h = _kimina_code(
            snippet.header, snippet.code, snippet.checked, check_block=bool(snippet.checked)
        )
        return _KiminaSnippet(sid, code, first - h, first, spacing)

    def _run_batches(self, snippets: list, timeout: float, progress: bool) -> dict:
        """{id: answer} for the laid-out snippets, POSTed in batches, `workers` at a time."""
        size = self.batch_size
        batches = [snippets[k : k + size] for k in range(0, len(snippets), size)]
        bar = _Progress(len(batches), progress)

        def run(batch):
            try:
                got = self._run([(k.sid, k.code) for k in batch], timeout)
            except Exception as e:  # pragma: no cover
                failed = {"_status": "server_error", "_reason": f"server_error: {e}"}
                got = {k.sid: dict(failed) for k in batch}
            bar.step()
            return got

        answers: dict = {}
        if batches:
            with ThreadPoolExecutor(max(1, min(self.workers, len(batches)))) as ex:
                for got in ex.map(run, batches):
                    answers.update(got)
        bar.close()
        return answers

    def deadline(self, n_snippets: int, timeout: float) -> float:
        """Seconds to wait for the answer to a POST of `n_snippets`: past the server's own limits, so that it
        answers first. PyPI's 2.1.3 gives up on a POST after timeout x snippets + 10 s (HTTP 504): its REPLs
        work through a batch in turn, so a batch may wait that long although each proof has `timeout`. GitHub
        main waits up to 60 s for a free REPL (then HTTP 429), then runs the header and the body under
        `timeout` each. `http_timeout`, when given, is used as it is."""
        if self.http_timeout is not None:
            return self.http_timeout
        sent_timeout = math.ceil(timeout)
        limit_2_1_3 = sent_timeout * n_snippets + 10.0
        limit_main = 60.0 + 2 * sent_timeout
        return max(limit_2_1_3, limit_main) + 30.0

    def _post(self, snippets: list, timeout: float) -> dict:
        """POST one batch; returns {id: result dict} or raises _Timeout (no answer within the deadline) or
        _ServerError."""
        payload = {
            "snippets": [{"id": sid, "code": code} for sid, code in snippets],
            "timeout": int(math.ceil(timeout)),
            "debug": False,
            "reuse": True,
        }
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8", "replace")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            self.url + "/api/check", data=data, headers=headers, method="POST"
        )
        deadline = self.deadline(len(snippets), timeout)
        self._count("posts")
        try:
            with urllib.request.urlopen(req, timeout=deadline) as r:
                body = json.loads(r.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            raise _ServerError(f"HTTP {e.code} from the Kimina server", e.code) from e
        except (TimeoutError, OSError) as e:
            if isinstance(e, TimeoutError) or "timed out" in str(e):
                raise _Timeout(f"no answer from the Kimina server within {deadline:g} s") from e
            raise _ServerError(f"cannot reach the Kimina server: {e}", 0) from e
        except ValueError as e:
            raise _ServerError(f"malformed response from the Kimina server: {e}", 0) from e
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list):
            raise _ServerError("malformed response from the Kimina server", 0)
        return {str(x.get("id")): x for x in results if isinstance(x, dict)}

    def _count(self, what: str, n: int = 1) -> None:
        with self.counts_lock:
            self.counts[what] += n

    def _run(self, batch: list, timeout: float) -> dict:
        """POST a batch [(id, code)] -> {id: answer}. Answers of snippets that did not run because the server
        was busy (HTTP 429 for the POST on GitHub main; in 2.1.3 an error per snippet, _kimina_busy) are sent
        again, alone, with exponential backoff, up to `retries` times; so are POSTs to an unreachable
        server. A POST that fails as a whole with another status (a 5xx: on main a REPL that died; 504: past
        2.1.3's limit) is split in halves, so a bad snippet costs only itself; a single snippet is tried once
        more (after a 504, like a busy server). No answer within the deadline fails the batch: the proofs
        may not have run, so it is "server_error", not "timeout", and not retried."""
        answers = {}
        pending = list(batch)
        failure = None  # the last POST's _ServerError; None after an answer
        busy_error = ""  # the last per-snippet busy error
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
                delay = self.retry_delay * 2 ** (attempt - 1)
                time.sleep(delay * random.uniform(1.0, 1.25))
            try:
                got = self._post(pending, timeout)
            except _Timeout as e:
                self._count("no_answer")
                return _kimina_failed(pending, f"server_error: {e}", answers)
            except _ServerError as e:
                failure = e
                if e.busy:
                    self._count("busy", len(pending))
                if _give_up_posting(e, len(pending), attempt):
                    break
                continue
            failure = None
            still_busy = []
            for sid, code in pending:
                answer = got.get(sid)
                if answer is None:  # left out of the answer: "returned no result"
                    continue
                if _kimina_busy(answer):
                    still_busy.append((sid, code))
                    busy_error = str(answer.get("error"))
                    continue
                answers[sid] = answer
            if not still_busy:
                return answers
            self._count("busy", len(still_busy))
            pending = still_busy
        if failure is None:
            tries = self.retries + 1
            reason = f"server_error: the Kimina server stayed busy ({busy_error[:200]}) for {tries} tries"
            return _kimina_failed(pending, reason, answers)
        if len(pending) > 1 and failure.splittable:
            self._count("splits")
            half = len(pending) // 2
            answers.update(self._run(pending[:half], timeout))
            answers.update(self._run(pending[half:], timeout))
            return answers
        return _kimina_failed(pending, f"server_error: {failure}", answers)

    @staticmethod
    def _raw(ans: dict | None, snippet: Snippet, sent: _KiminaSnippet) -> RawResult:
        """The RawResult of one snippet's answer; the time is the server's for the snippet (its body
        command, without the header import)."""
        if ans is None:
            reason = "server_error: the Kimina server returned no result for this proof"
            return RawResult(failure=_fail("server_error", reason))
        if "_status" in ans:
            return RawResult(failure=_fail(ans["_status"], ans["_reason"]))
        try:
            t = float(ans.get("time") or 0.0)
        except (TypeError, ValueError):
            t = 0.0
        if ans.get("error"):
            return RawResult(failure=_kimina_error(str(ans["error"]), t))
        resp = ans.get("response")
        if not isinstance(resp, dict):
            reason = "server_error: result has neither `response` nor `error`"
            return RawResult(failure=_fail("server_error", reason, t=t))
        msgs = list(resp.get("messages") or [])
        if snippet.names:
            signatures = _read_signatures(msgs, len(snippet.names), sent.first, sent.spacing)
            return RawResult(messages=msgs, signatures=signatures, time=t)
        if "message" in resp and "env" not in resp and "messages" not in resp:
            message = str(resp["message"])
            failure = _fail("error", f"lean: {message[:300]}", errors=[message], t=t)
            return RawResult(failure=failure)
        thr = sent.threshold
        return RawResult(
            messages=[m for m in msgs if _line(m) < thr],
            sorries=[s for s in resp.get("sorries") or [] if _line(s) < thr],
            check_messages=[m for m in msgs if _line(m) >= thr],
            time=t,
        )

    def stats(self) -> dict:
        """The counts of KIMINA_COUNTS so far."""
        with self.counts_lock:
            return dict(self.counts)


def _give_up_posting(e: _ServerError, n_pending: int, attempt: int) -> bool:
    """Whether a POST that failed with `e` is not sent again as it is: not retryable, to be split, or a
    lone snippet that failed twice (not for want of a REPL)."""
    if not e.retryable:
        return True
    if e.splittable and n_pending > 1:
        return True
    return e.splittable and not e.busy and attempt >= 1


def _kimina_failed(pending: list, reason: str, answers: dict) -> dict:
    """`answers` with every pending snippet failed as "server_error" for `reason`."""
    for sid, _ in pending:
        answers[sid] = {"_status": "server_error", "_reason": reason}
    return answers


def _kimina_error(err: str, t: float) -> LeanResult:
    """The failure for a snippet the server answered with an error."""
    status = _kimina_error_status(err)
    if status == "timeout":
        return _fail("timeout", f"timeout: {err[:300]}", t=t)
    if _KIMINA_HEADER_TIMEOUT in err:
        reason = (
            f"server_error: the proof did not run: {err[:200]} (the server imports the header "
            "under the proof's timeout: give it a timeout above the import time and REPLs "
            "pre-warmed with LEAN_SERVER_INIT_REPLS)"
        )
        return _fail("server_error", reason)
    return _fail("server_error", f"server_error: {err[:300]}", t=t)


# --------------------------------------------------------------------------- the verifier


def _make_backend(
    backend: str,
    repl_path=None,
    mathlib_path=None,
    repl_cmd=None,
    workers=None,
    kimina_url=None,
    repl=None,
    kimina=None,
) -> LeanBackend:
    """The backend named "repl", "kimina" or "auto" (the local REPL if it is installed, else Kimina if a
    URL is set); `repl` and `kimina` are the keyword arguments of ReplBackend and KiminaBackend."""
    if backend == "auto":
        try:
            _resolve_repl_config(repl_path, mathlib_path, repl_cmd)
            backend = "repl"
        except LeanNotInstalled:
            if not _kimina_url(kimina_url):
                raise
            backend = "kimina"
    if backend == "repl":
        config = _resolve_repl_config(repl_path, mathlib_path, repl_cmd)
        return ReplBackend(config, workers, **(repl or {}))
    if backend == "kimina":
        url = _kimina_url(kimina_url)
        if not url:
            raise LeanNotInstalled("backend='kimina' needs kimina_url= or KIMINA_URL")
        return KiminaBackend(url, workers, **(kimina or {}))
    raise ValueError(f"backend must be 'repl', 'kimina', 'auto' or a backend, not {backend!r}")


def _original_type(raw: RawResult, name: str):
    """From the check of the original `statement sorry`: (its pp.all type, None) or (None, why it does not
    elaborate); the failure itself (a LeanResult) when the check got no answer to judge."""
    if raw.failure is not None and raw.failure.status != "error":
        return raw.failure
    if raw.failure is not None:
        return None, "; ".join(raw.failure.errors or [raw.failure.reason])[:500]
    errors = [_fmt(m) for m in raw.messages if m.get("severity") == "error"]
    if errors:
        return None, "; ".join(errors)[:500]
    ctype, _ = _parse_checks(raw.check_messages or [], name)
    if ctype is None:
        return None, "no output from #check"
    return ctype, None


def _against_statement(original, raw: RawResult, name: str) -> tuple:
    """(status, reason) of a proof Lean found valid, held against the original statement's check (rule
    elaborated_statement): the same pp.all type, or the proof fails."""
    if isinstance(
        original, LeanResult
    ):  # the statement's check got no answer: the proof is not judged
        status = original.status if original.status in ("timeout", "crash") else "server_error"
        return (
            status,
            f"{status}: could not elaborate the original statement ({original.reason[:200]})",
        )
    orig_type, orig_error = original
    if orig_type is None:
        return "error", f"statement: the original statement does not elaborate: {orig_error}"
    ctype, _ = _parse_checks(raw.check_messages or [], name)
    if ctype != orig_type:
        reason = (
            "elaborated_statement: the proved theorem's type differs from the original statement"
        )
        return "cheat", reason
    return "valid", ""


class LeanVerifier:
    """Checks Lean 4 proofs; see the module docstring. Use as a context manager. The text rules, the
    original statement's check, `#print axioms` and the verdict are here; running Lean is the backend's
    (`backend`: "repl", "kimina", "auto" or a LeanBackend object); tactic mode is a TacticEngine's."""

    def __init__(
        self,
        backend: str | LeanBackend = "repl",
        repl_path: str | None = None,
        mathlib_path: str | None = None,
        workers: int | None = None,
        timeout: float = 60.0,
        memory_limit_mb: float | None = DEFAULT_MEMORY_LIMIT_MB,
        max_uses: int | None = DEFAULT_MAX_USES,
        kimina_url: str | None = None,
        repl_cmd: str | None = None,
        *,
        header_timeout: float | None = None,
        lean_checks: bool = True,
        kimina_batch_size: int = 8,
        kimina_api_key: str | None = None,
        http_timeout: float | None = None,
        max_proof_states: int | None = DEFAULT_MAX_PROOF_STATES,
        kimina_retries: int = 3,
        kimina_retry_delay: float = 1.0,
    ):
        self.timeout = float(timeout)
        self.lean_checks = lean_checks
        self.header_timeout = float(header_timeout) if header_timeout else max(300.0, self.timeout)
        self._orig_cache: dict = {}
        self._closed = False
        self.lean = backend
        if isinstance(backend, str):
            repl = dict(
                memory_limit_mb=memory_limit_mb,
                max_uses=max_uses,
                header_timeout=self.header_timeout,
                max_proof_states=max_proof_states,
            )
            kimina = dict(
                batch_size=kimina_batch_size,
                api_key=kimina_api_key,
                http_timeout=http_timeout,
                retries=kimina_retries,
                retry_delay=kimina_retry_delay,
            )
            self.lean = _make_backend(
                backend,
                repl_path=repl_path,
                mathlib_path=mathlib_path,
                repl_cmd=repl_cmd,
                workers=workers,
                kimina_url=kimina_url,
                repl=repl,
                kimina=kimina,
            )
        if lean_checks and not self.lean.lean_checks:
            raise ValueError(f"backend {self.lean.name!r} cannot run the Lean-side checks")
        self.backend = self.lean.name
        self.workers = self.lean.workers
        self.engine = None
        if isinstance(self.lean, ReplBackend):
            self.engine = TacticEngine(self.lean, self.timeout)

    @property
    def kimina_url(self) -> str | None:
        return getattr(self.lean, "url", None)

    # ---------------------------------------------------------------- checking proofs

    def verify_attempts(self, problems: list, proofs: list, whole: bool = False) -> list:
        """Lean's verdict on each attempt, row i holding the attempts at problems[i] (Problem records): a LeanResult,
        or None where the attempt has no proof. Each distinct (problem, proof) is checked once. A proof is the text
        after the original statement (the model cannot change the statement), or with whole=True its whole code,
        which must then keep the statement (the statement rule checks it)."""
        jobs = {
            (p.id, x): ProofJob(p.header, p.statement, x if whole else p.statement + x, p.id)
            for p, row in zip(problems, proofs)
            for x in row
            if x is not None
        }
        verdicts = dict(zip(jobs, self.verify(list(jobs.values())) if jobs else []))
        return [[verdicts.get((p.id, x)) for x in row] for p, row in zip(problems, proofs)]

    def verify(
        self, jobs: list, progress: bool = False, used_constants: bool | str = False
    ) -> list:
        """One LeanResult per job, in order. Never raises on model output. The text rules first; then one
        batch for the backend: each original statement not yet cached (`statement sorry` and its check
        block) and each proof (and its check block).

        ``used_constants=True`` (local REPL only; None on Kimina, which has no allTactics) sends each proof
        with ``"allTactics": true`` and fills ``LeanResult.used_constants``: the ``usedConstants`` of all its
        tactics (the constants in the terms they assigned), kept when the proof text names them (``rw
        [add_comm]`` -> ``add_comm``, also through ``open`` or dot notation: ``h.le`` -> ``LT.lt.le``), in
        order of appearance; instances and the like that Lean adds are dropped (``"all"`` keeps them)."""
        self._check_open()
        jobs = list(jobs)
        results: list = [None] * len(jobs)
        prepared = {}
        for i, job in enumerate(jobs):
            try:
                job = _as_job(job)
                prepared[i] = (job, prepare(job))
            except _Reject as r:
                results[i] = _fail(r.status, f"{r.rule}: {r.detail}")
            except Exception as e:
                results[i] = _fail("crash", f"internal: {type(e).__name__}: {e}")
        originals = self._originals_to_check(prepared.values())
        proofs = []
        for job, prep in prepared.values():
            checked = prep.name if self.lean_checks else ""
            all_tactics = bool(used_constants)
            proofs.append(Snippet(job.header, prep.lean_proof, checked, all_tactics=all_tactics))
        raws = self.lean.check(list(originals.values()) + proofs, self.timeout, progress)
        checked_originals = {}
        for (key, snippet), raw in zip(originals.items(), raws):
            checked_originals[key] = _original_type(raw, snippet.checked)
            if raw.failure is None:
                self._orig_cache[key] = checked_originals[key]
        proof_raws = raws[len(originals) :]
        for (i, (job, prep)), raw in zip(prepared.items(), proof_raws):
            key = (job.header, prep.lean_statement)
            original = self._orig_cache.get(key) or checked_originals.get(key)
            results[i] = self._verdict(raw, prep, original, used_constants)
        return [r if r is not None else _fail("crash", "internal: no result") for r in results]

    def _originals_to_check(self, prepared) -> dict:
        """{(header, statement): the Snippet of `statement sorry` and its check block}, for each original
        statement not in the cache (none without the Lean-side checks)."""
        originals: dict = {}
        if not self.lean_checks:
            return originals
        for job, prep in prepared:
            key = (job.header, prep.lean_statement)
            if key in self._orig_cache or key in originals:
                continue
            originals[key] = Snippet(job.header, prep.lean_statement + " sorry", prep.name)
        return originals

    def _verdict(self, raw: RawResult, prep: _Prepared, original, used_constants) -> LeanResult:
        """The verdict on one proof from what the backend saw (module docstring, "The verdict")."""
        if raw.failure is not None:
            return dataclasses.replace(raw.failure)
        status, reason, errors = _judge(
            raw.messages, raw.sorries, raw.check_messages, None, prep.name, self.lean_checks
        )
        if status == "valid" and self.lean_checks:
            status, reason = _against_statement(original, raw, prep.name)
        used = None
        if used_constants and self.lean.all_tactics:
            used = _used_constants(raw.tactics, prep.lean_proof, used_constants)
        return LeanResult(status == "valid", status, errors, reason, raw.time, raw.messages, used)

    def statements(self, header: str, names: list) -> dict:
        """{name: its signature as `#check _root_.name` prints it (``Nat.add_comm (n m : ℕ) : n + m = m +
        n``), or None (unknown, not a name, or Lean failed)}, in one round trip for the whole list, in the
        environment of `header`. Use with ``verify(..., used_constants=True)`` to show a lemma a proof
        invokes (STP's conjecturer)."""
        self._check_open()
        names = [str(n) for n in names]
        out = dict.fromkeys(names)
        good = list(dict.fromkeys(n for n in names if _is_name(n)))
        if not good:
            return out
        header = _unify_line_breaks(str(header or ""))
        snippet = Snippet(header, names=tuple(good))
        raw = self.lean.check([snippet], self.timeout)[0]
        for name, signature in zip(good, raw.signatures):
            out[name] = signature
        return out

    def stats(self) -> dict:
        """The backend's counts: for the local REPL, REPL processes started and recycled so far, workers
        alive, pool size, proof states held; for Kimina, the counts of KIMINA_COUNTS so far."""
        return self.lean.stats()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LeanVerifier is closed")

    def close(self) -> None:
        self._closed = True
        self.lean.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- tactic mode (TacticEngine)

    def _tactics(self) -> TacticEngine:
        if self.engine is None:
            raise NotImplementedError(
                f"tactic mode needs the local REPL backend ({self.backend!r} has no tactic endpoint)"
            )
        self._check_open()
        return self.engine

    def start_proof(self, header: str, statement: str) -> TacticState:
        """Root proof state of `statement` (which ends in ':= by') under `header`: the REPL's proof state at
        `statement sorry`. The state lives in the REPL that made it (its affinity)."""
        return self._tactics().start_proof(header, statement)

    def start_proofs(self, items: list) -> list:
        """start_proof for each (header, statement), spread evenly over the pool's REPLs (round robin over
        as many REPLs of the header as it can have, started in parallel): the searches from these roots
        then run in parallel."""
        return self._tactics().start_proofs(items)

    def apply_tactic(
        self, state: TacticState, tactic: str, timeout: float | None = None
    ) -> TacticState:
        """Run a tactic on `state` (TacticEngine.apply_tactic): the new state, or a failed one (`error`
        set, `state_id` None). Never raises on model output."""
        return self._tactics().apply_tactic(state, tactic, timeout)

    def apply_tactics(self, steps: list, timeout: float | None = None) -> list:
        """apply_tactic for each (state, tactic), results in order. Steps on states held by the same REPL
        run one after another on it, steps on different REPLs in parallel (one thread per REPL): a search
        expanding many nodes of many theorems keeps the whole pool busy, and no state moves to another
        process. States whose REPL was restarted are replayed (once per path and REPL)."""
        return self._tactics().apply_tactics(steps, timeout)

    def replay(self, roots: list, paths: list) -> list:
        """Each tactic path from its root state (roots[i] for paths[i]; a root may repeat), all paths in lockstep (one
        apply_tactics per depth): the states it passes, root first, or None when it does not run to its end (a tactic
        fails, or follows a solved state)."""
        states = [[root] for root in roots]
        for depth in range(max(map(len, paths), default=0)):
            todo = [
                (s, p[depth])
                for s, p in zip(states, paths)
                if depth < len(p) and s[-1].status == "open"
            ]
            children = self.apply_tactics([(s[-1], tactic) for s, tactic in todo])
            for (s, _), child in zip(todo, children):
                s.append(child)
        return [
            s if len(s) == len(p) + 1 and s[-1].status in ("open", "solved") else None
            for s, p in zip(states, paths)
        ]

    def expand(self, state: TacticState, tactics: list, timeout: float | None = None) -> list:
        """The children of `state`: apply_tactics([(state, t) for t in tactics])."""
        return self.apply_tactics([(state, t) for t in tactics], timeout)

    def free_states(self, states: list | None = None) -> int:
        """Free the REPL memory of a finished search: restart the REPLs holding `states` (all REPLs holding
        proof states if None). The REPL at v4.15.0 cannot delete a proof state (no such command; pickling
        only adds states), so restarting is the only way; the states become stale and are replayed if used
        again. Returns the number of REPLs restarted (0 without tactic mode)."""
        if self.engine is None:
            return 0
        return self.engine.free_states(states)

    def check_tactic_path(
        self,
        state_or_header,
        statement: str | None = None,
        tactics: list | None = None,
        name: str = "",
    ) -> LeanResult:
        """Re-check an assembled tactic path as one whole proof (command mode: errors, sorry, kernel,
        axioms, the statement). Call with a TacticState, or with (header, statement, tactics)."""
        if isinstance(state_or_header, TacticState):
            s = state_or_header
            header, statement, tactics = s.header, s.statement, s.tactics
        else:
            header = state_or_header
        proof = proof_from_tactics(str(statement or ""), list(tactics or []))
        return self.verify([ProofJob(str(header or ""), str(statement or ""), proof, name)])[0]


# What stats() counts on the Kimina backend: POSTs sent, POSTs sent again (after a busy or unreachable server,
# or a failed POST), snippets the server was too busy to run (HTTP 429 or 504 for their POST, or a busy error
# of their own), batches split after a failed POST, POSTs with no answer within the deadline.
KIMINA_COUNTS = ("posts", "retries", "busy", "splits", "no_answer")
# Per-snippet errors of kimina-lean-server 2.1.3 (server/routers/check.py) for a snippet that did not run
# because no REPL was free in LEAN_SERVER_MAX_WAIT or a REPL could not be started or replaced.
_KIMINA_BUSY_ERRORS = (
    "No available REPLs",
    "Failed to get REPL",
    "Failed to get replacement REPL",
    "REPL prep failed",
)
_KIMINA_HEADER_TIMEOUT = "header command timed out"


def _kimina_busy(answer: dict) -> bool:
    """Whether a snippet's answer says that the server did not run it for want of a REPL."""
    error = answer.get("error")
    if not isinstance(error, str):
        return False
    for sign in _KIMINA_BUSY_ERRORS:
        if error.startswith(sign):
            return True
    return False


def _kimina_error_status(error: str) -> str:
    """ "timeout" for a snippet whose proof ran past the timeout; "server_error" for any other error, among
    them a header import that timed out (the proof never ran)."""
    if _KIMINA_HEADER_TIMEOUT in error:
        return "server_error"
    lowered = error.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return "timeout"
    return "server_error"


class _HeaderTimeout(Exception):
    pass


class _ServerError(Exception):
    """A failed POST to Kimina; code is the HTTP status (0: unreachable or a malformed answer)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code
        self.retryable = code in (0, 429) or code >= 500  # busy, unreachable, server trouble
        self.splittable = code >= 400 and code not in (
            401,
            403,
            404,
            429,
        )  # maybe one snippet's fault
        # no REPL was free (GitHub main), or the POST ran past the server's limit (PyPI's 2.1.3)
        self.busy = code in (429, 504)


def _line(m: dict) -> int:
    try:
        return int((m.get("pos") or {}).get("line", 0))
    except (TypeError, ValueError):
        return 0


def _strip_or_raw(t: str) -> str:
    code, err = strip_comments(t)
    return code if code is not None else t


def _as_job(job) -> ProofJob:
    """A ProofJob of strings, with "\\r\\n" line breaks made "\\n" (see LINE_BREAKS)."""
    if isinstance(job, ProofJob):
        header, statement, proof, name = job.header, job.statement, job.proof, job.name
    elif isinstance(job, dict):
        header = job.get("header")
        statement = job.get("statement") or job.get("formal_statement")
        proof = job.get("proof")
        name = job.get("name")
    else:
        raise TypeError(f"expected a ProofJob, got {type(job).__name__}")
    header = _unify_line_breaks(str(header or ""))
    statement = _unify_line_breaks(str(statement or ""))
    proof = _unify_line_breaks(str(proof or ""))
    return ProofJob(header, statement, proof, str(name or ""))


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.total = total
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="lean", leave=False)
            except ImportError:  # pragma: no cover
                self.bar = None
        self.lock = threading.Lock()

    def step(self, _res=None):
        if self.bar is not None:
            with self.lock:
                self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- CLI


def _cli(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Check Lean 4 proofs from a jsonl file (fields: header, "
        "formal_statement or statement, proof = full proof or tactics after ':= by')."
    )
    ap.add_argument("file", nargs="?", default=str(REPO_ROOT / "data" / "lean_smoke.jsonl"))
    ap.add_argument("--backend", default="auto", choices=["auto", "repl", "kimina"])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument(
        "--repl-cmd", default=None, help="command line of a REPL (overrides LEAN_REPL_CMD)"
    )
    ap.add_argument("--kimina-url", default=None)
    ap.add_argument("--out", default=None, help="write one JSON result per line here")
    a = ap.parse_args(argv)
    try:
        v = LeanVerifier(
            backend=a.backend,
            workers=a.workers,
            timeout=a.timeout,
            repl_cmd=a.repl_cmd,
            kimina_url=a.kimina_url,
        )
    except LeanNotInstalled as e:
        print(f"LeanNotInstalled: {e}", file=sys.stderr)
        return 2
    rows = []
    with open(a.file, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    jobs = []
    for r in rows:
        stmt = r.get("formal_statement") or r.get("statement") or ""
        proof = r.get("proof") or ""
        code = strip_comments(proof)[0] or ""
        if not re.search(_tok("theorem", "lemma", "example"), code):  # tactics only
            proof = proof_from_tactics(stmt, [proof])
        jobs.append(ProofJob(r.get("header") or DEFAULT_HEADER, stmt, proof, r.get("name", "")))
    with v:
        t0 = time.monotonic()
        res = v.verify(jobs, progress=True)
        dt = time.monotonic() - t0
    counts: dict = {}
    for r, job in zip(res, jobs):
        counts[r.status] = counts.get(r.status, 0) + 1
        print(f"{r.status:12s} {job.name or '?':40s} {r.time:7.2f}s {r.reason[:100]}")
    print(
        f"{len(res)} proofs in {dt:.1f} s: "
        + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            for r, job in zip(res, jobs):
                f.write(
                    json.dumps({"name": job.name, **dataclasses.asdict(r)}, ensure_ascii=False)
                    + "\n"
                )
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
