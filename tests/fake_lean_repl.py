#!/usr/bin/env python3
"""A stand-in for the Lean 4 REPL (leanprover-community/repl at v4.15.0), for tests without Lean.

It speaks the REPL's protocol on stdin/stdout: JSON requests separated by blank lines (a request
whose text starts with ``#`` or ``--`` is skipped); each reply is one JSON object followed by a
blank line. Requests are read as the REPL reads them (REPL/Main.lean ``parse``), in this order:

* ``{"tactic": t, "proofState": N}``: ``{"proofState": M, "goals": [...]}`` plus ``messages``,
  ``sorries`` (``{"proofState", "goal"}``, no position) when non-empty; no ``proofStatus`` (v4.15.0
  has none; ``--proof-status`` emulates a newer REPL). ``t`` must be exactly ONE tactic, as the
  REPL parses it (``Parser.runParserCategory env `tactic``, which must consume the whole input):
  ``"ext1 x; ext1 n"`` gives ``{"message": "Lean error:\\n<input>:1:6: expected end of input"}``, and
  so does a second tactic on a new line. A block is one tactic when Lean reads it so: ``(t1; t2)``,
  ``{ ... }``, ``· ...``, ``case _ => ...``, ``induction x with`` and its ``| ...`` alternatives,
  a line ending in ``=>``/``by``/``with``/``:=`` and the deeper-indented lines after it.
  A tactic that throws (a parse error, a failed ``linarith``) gives ``{"message": "Lean error:\\n..."}``;
  one that logs an error (an unclosed ``{ ... }``) gives a proof state with the error message
  (position 0:0) and the goal closed, as the REPL does. ``"Unknown proof state."`` for a bad N.
* ``{"pickleTo": path, "env": N}`` / ``{"unpickleEnvFrom": path}``, ``{"pickleTo": path, "proofState": N}``
  / ``{"unpickleProofStateFrom": path, "env"?: N}``: JSON files standing in for .olean files.
* ``{"cmd": text, "env"?: N, "allTactics"?: true}``: a new environment; leading ``import X`` lines are
  "imported" (counted in ``--stats``) when there is no ``env``. Reply ``{"env": M}`` plus
  ``messages`` (``{"severity", "pos", "endPos", "data"}``, ``endPos`` may be null), ``sorries``
  (``{"goal", "proofState", "pos", "endPos"}``) and, with ``allTactics``, ``tactics``
  (``{"tactic", "proofState", "pos", "endPos", "goals", "usedConstants"}``), each left out when
  empty; ``{"message": "Unknown environment."}`` for a bad N.
* ``{"path": file, "allTactics"?: ...}``: the file's text as a command without ``env``.
* anything else (bad JSON, no known request shape): the REPL throws, prints ``uncaught exception:
  ...`` on stderr and exits with code 1; so does this stand-in.

Inside commands: ``theorem``/``lemma``/``example``/``def`` with ``sorry`` give the warning
"declaration uses 'sorry'" and a sorries entry whose proof state works in tactic mode.
``open X`` is remembered; a short name that also resolves through an opened namespace is
ambiguous: ``#check @name`` fails with "ambiguous, possible interpretations", ``#print axioms name``
prints one message per declaration (the opened ones first, as Lean's resolveGlobalName orders them),
``_root_.name`` names the root one. ``#check name`` prints ``name <signature>``; ``#check @name``
(also after ``set_option pp.all true in``) ``@name : <signature>`` (the normalised signature text);
``#print axioms name`` ``'name' depends on axioms: [propext, Classical.choice, Quot.sound]`` (plus
``sorryAx`` for a proof with sorry or errors, ``Lean.ofReduceBool`` for ``native_decide``, any
declared ``axiom`` the proof mentions). A few Mathlib lemmas are known (LIBRARY) for ``#check``.
``usedConstants`` lists the dotted or snake_case names a tactic mentions (not its local names),
plus ``OfNat.ofNat``/``instOfNatNat`` when it has a numeral, as Lean lists instances too.

Which proofs it accepts (``--accept``):

* ``known`` (default): tactic proofs run through a small tactic engine. A goal listed in the
  tactic table (``--tactics``, default data/lean_tactics.jsonl: theorems with the transitions
  (goal, tactic) -> new goals or error) follows the table only, so a search over it meets
  alternatives and dead ends; any other tactic there fails ("<tactic> failed"). Elsewhere a tactic
  must be in KNOWN_TACTICS ("unknown tactic" otherwise); in command mode a ``by`` block is accepted
  iff every tactic (each line, split on ``;`` and ``<;>``; its first word) is known and the last one
  is in CLOSING_TACTICS; in tactic mode a closing tactic closes the first goal, ``constructor``
  splits ``∧``/``↔``, ``intro h`` moves a premise of ``→`` into the context, ``have h : T := ...``
  adds ``h : T`` (``have h : T`` alone first asks for ``T``), ``sorry`` closes the goal with a
  sorry, other known tactics keep the goal. Term proofs (``:= term``) are accepted.
* ``hash:P``: accepted iff sha256(normalised signature + tactic text) falls under P: a
  deterministic pseudo-random share P, for algorithm tests that need mixed solve rates from a
  random model. In tactic mode the hash of (goals, tactic) closes the first goal with probability P,
  else errors or makes progress.
* ``tactic:REGEX``: accepted iff the regular expression matches (``re.search``) the proof's tactic
  text: its tactics, comments and ``fake_`` lines dropped, joined by spaces, whitespace normalised
  (``tactic:^omega``: the first tactic starts with ``omega``; ``tactic:nlinarith``: some tactic
  contains it). In tactic mode a matching tactic closes the first goal, any other throws. For loop
  learning tests: a rule the model meets at a rate chosen from what it samples.
* ``not:RULE`` (RULE ``hash:P`` or ``tactic:REGEX``): the opposite verdict of RULE on the same proofs
  (what RULE rejects for its own reason, brackets included, stays rejected).
* ``all`` / ``none``: accept every proof / no proof.
In every mode a missing ``:=``, an empty proof and a repeated theorem name are errors, and
``sorry``/``admit``/``stop`` are reported as sorry (like the real REPL); ``known``, ``none`` and
``tactic:`` also reject unbalanced brackets (``hash:P`` and ``all`` do not, so that random text is
accepted at the rate P).

Misbehaviour, for tests. Flags: ``--hang`` (never answer a non-header command),
``--crash-after N`` (exit instead of answering the N-th command), ``--garbage-after N``
(print non-JSON for the N-th command), ``--delay S`` (sleep before every answer),
``--import-delay S`` (per header), ``--leak-mb MB`` (keep MB more memory per command),
``--base-mb MB``. Trigger words inside a proof or tactic (their own lines, ignored
by the acceptance rule), so one test can make a single proof misbehave:
``fake_hang``, ``fake_crash``, ``fake_crash_once KEY`` (crash only the first time,
needs ``--state-dir``), ``fake_garbage``, ``fake_noise`` (non-JSON lines before a valid
reply), ``fake_slow SEC``, ``fake_leak MB``, ``fake_axiom NAME`` (``#print axioms``
adds NAME), ``fake_alter_type`` (``#check`` shows a different type),
``fake_sorry_warning`` (a sorry warning without a sorry), ``fake_trap`` (tactic
mode: no goals, but an error; with ``--proof-status`` also "Incomplete: contains sorry"),
``fake_stderr`` (write to stderr; the Kimina stand-in answers HTTP 500 for it).
``--stats FILE`` appends ``start PID``, ``header PID N_IMPORTS``, ``cmd PID``,
``tactic PID`` lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

DEFAULT_TACTICS = Path(__file__).resolve().parent.parent / "data" / "lean_tactics.jsonl"
KNOWN_TACTICS = {
    "norm_num",
    "simp",
    "simp_all",
    "linarith",
    "nlinarith",
    "omega",
    "decide",
    "ring",
    "ring_nf",
    "field_simp",
    "positivity",
    "rfl",
    "exact",
    "intro",
    "intros",
    "constructor",
    "use",
    "aesop",
    "tauto",
    "trivial",
    "apply",
    "rw",
    "have",
    "refine",
    "cases",
    "rcases",
    "obtain",
    "induction",
    "subst",
    "norm_cast",
    "push_cast",
    "exact_mod_cast",
    "gcongr",
    "unfold",
    "specialize",
    "left",
    "right",
    "exists",
    "calc",
    "show",
    "by_contra",
    "push_neg",
    "contradiction",
    "assumption",
    "interval_cases",
    "all_goals",
    "any_goals",
    "try",
    "repeat",
    "first",
    "nth_rewrite",
    "rwa",
    "simpa",
    "set",
    "let",
    "by_cases",
    "split_ifs",
    "exfalso",
    "congr",
    "ext",
    "funext",
    "bound",
    "simp_rw",
    "induction'",
    "cases'",
    "next",
    "case",
    "on_goal",
    "focus",
    "trace",
    "sorry",
    "done",
    "ext1",
    "exact?",
    "apply?",
    "refine'",
}
CLOSING_TACTICS = {
    "norm_num",
    "simp",
    "simp_all",
    "linarith",
    "nlinarith",
    "omega",
    "decide",
    "ring",
    "field_simp",
    "positivity",
    "rfl",
    "exact",
    "aesop",
    "tauto",
    "trivial",
    "assumption",
    "contradiction",
    "simpa",
    "rwa",
    "exact_mod_cast",
    "interval_cases",
    "bound",
    "use",
    "simp_rw",
}
COMBINATORS = {"all_goals", "any_goals", "try", "repeat", "focus"}
DEFAULT_AXIOMS = ["propext", "Classical.choice", "Quot.sound"]
# a few Mathlib lemmas, by signature, for `#check` (the stand-in has no Mathlib)
LIBRARY = {
    "lt_trans": "{α : Type u_1} [Preorder α] {a b c : α} : a < b → b < c → a < c",
    "le_of_lt": "{α : Type u_1} [Preorder α] {a b : α} (h : a < b) : a ≤ b",
    "Nat.lt_trans": "{n m k : ℕ} (h₁ : n < m) : m < k → n < k",
    "Nat.le_of_lt": "{n m : ℕ} (h : n < m) : n ≤ m",
    "Nat.left_distrib": "(n m k : ℕ) : n * (m + k) = n * m + n * k",
    "mul_add": "{R : Type u_1} [Mul R] [Add R] [LeftDistribClass R] (a b c : R) : a * (b + c) = a * b + a * c",
    "sq_nonneg": "{α : Type u_1} [LinearOrderedRing α] (a : α) : 0 ≤ a ^ 2",
    "abs_of_nonneg": "{α : Type u_1} [Lattice α] [AddGroup α] {a : α} [CovariantClass α α (· + ·) (· ≤ ·)] "
    "(h : 0 ≤ a) : |a| = a",
    "Finset.sum_range_succ": "{β : Type u} [AddCommMonoid β] (f : ℕ → β) (n : ℕ) : "
    "∑ x ∈ Finset.range (n + 1), f x = ∑ x ∈ Finset.range n, f x + f n",
    "Nat.succ_le_of_lt": "{n m : ℕ} (h : n < m) : n.succ ≤ m",
}
SORRY_RE = re.compile(r"(?<![\w'.])(sorry|admit|stop)(?![\w'!?])")
DIRECTIVE_RE = re.compile(
    r"(?<![\w])fake_(hang|crash_once|crash|garbage|noise|slow|leak|axiom|alter_type|sorry_warning|trap|stderr)"
    r"(?:[ \t]+([^\s]+))?"
)
CMD_START = re.compile(
    r"(theorem|lemma|example|def|abbrev|instance|axiom|constant|open|set_option|namespace|end|section|"
    r"noncomputable|universe|variable|include|omit|macro|macro_rules|syntax|notation|local|scoped|"
    r"attribute|#\w+|private|protected|elab|import|infix|infixl|infixr|prefix|postfix|structure|"
    r"inductive|class|opaque|mutual|unsafe|partial|run_cmd)(?![\w'])|@\["
)
PAIRS = {"(": ")", "[": "]", "{": "}", "⟨": "⟩", "⦃": "⦄"}
CLOSERS = {v: k for k, v in PAIRS.items()}
IDENT = re.compile(r"[A-Za-z_][\w'!?₀-₉]*(?:\.[A-Za-z_][\w'!?₀-₉]*)*")
# a line ending like this opens a block: the deeper-indented lines below belong to the same tactic
BLOCK_END = re.compile(r"(=>|\bby|\bwith|:=|\bfrom|\bcalc|<;>|,|·)\s*$")

_LEAKS = []  # memory kept on purpose (--leak-mb / fake_leak)


class TacticError(Exception):
    """A tactic that throws: the REPL answers {"message": "Lean error:\\n..."}."""


# --------------------------------------------------------------------------- text helpers


def _strip_comments(text: str) -> str:
    text = re.sub(r"/-.*?-/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    return re.sub(r"--[^\n]*", lambda m: " " * len(m.group(0)), text)


def _balanced(text: str) -> int:
    """-1 if brackets balance, else the index of the first offending character."""
    stack = []
    in_str = False
    for i, c in enumerate(text):
        if c == '"':
            in_str = not in_str
        if in_str:
            continue
        if c in PAIRS:
            stack.append((c, i))
        elif c in CLOSERS:
            if not stack or stack[-1][0] != CLOSERS[c]:
                return i
            stack.pop()
    return stack[0][1] if stack else -1


def _scan(text: str, start: int = 0):
    """(index, char, bracket depth after it, inside a string literal) for each character from `start`."""
    depth, in_str = 0, False
    for j in range(start, len(text)):
        c = text[j]
        if c == '"':
            in_str = not in_str
        elif not in_str and c in PAIRS:
            depth += 1
        elif not in_str and c in CLOSERS:
            depth -= 1
        yield j, c, depth, in_str


def _find_top(text: str, token: str) -> int:
    return next(
        (
            j
            for j, c, depth, in_str in _scan(text)
            if depth == 0 and not in_str and c not in CLOSERS and text.startswith(token, j)
        ),
        -1,
    )


def _matching(text: str, i: int) -> int:
    """Index of the bracket that closes text[i], or -1."""
    return next(
        (j for j, c, depth, in_str in _scan(text, i) if c in CLOSERS and not in_str and depth == 0),
        -1,
    )


def _norm(text: str) -> str:
    return " ".join(text.split())


def _position(text: str, i: int) -> tuple:
    """(line, column) of offset i, lines from 1 as in Lean's messages."""
    return text.count("\n", 0, i) + 1, i - (text.rfind("\n", 0, i) + 1)


def goal_from_signature(sig: str) -> str:
    """`(x y : ℝ) (h₀ : x = 1) : x + y = 2` -> 'x y : ℝ\\nh₀ : x = 1\\n⊢ x + y = 2'."""
    hyps, i, s = [], 0, sig.strip()
    while i < len(s):
        c = s[i]
        if c.isspace():
            i += 1
            continue
        if c in PAIRS:
            depth, j = 0, i
            while j < len(s):
                if s[j] in PAIRS:
                    depth += 1
                elif s[j] in CLOSERS:
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            inner = s[i + 1 : j]
            k = _find_top(inner, ":")
            if k >= 0:
                hyps.append(f"{_norm(inner[:k])} : {_norm(inner[k + 1 :])}")
            else:
                hyps.append(f"inst✝ : {_norm(inner)}")
            i = j + 1
            continue
        if c == ":":
            return "\n".join(hyps + ["⊢ " + _norm(s[i + 1 :])])
        break
    return "\n".join(hyps + ["⊢ " + _norm(s[i:])])


def _split_goal(goal: str) -> tuple:
    k = goal.rfind("⊢ ")
    return goal[:k], goal[k + 2 :]


def _without_case(goal: str) -> str:
    return re.sub(r"^case [^\n]*\n", "", goal)


def _hypothesis_names(goals) -> set:
    names = set()
    for g in goals:
        for line in _split_goal(g)[0].split("\n"):
            if " : " in line and not line.startswith("case "):
                names.update(line.split(" : ", 1)[0].split())
    return names


def tactic_pieces(text: str) -> list:
    pieces = []
    for line in text.split("\n"):
        s = line.strip()
        s = re.sub(r"^[·.]\s*", "", s)
        for part in re.split(r"<;>|;", s):
            part = part.strip()
            if part and not part.startswith("fake_"):
                pieces.append(part)
    return pieces


def head_word(piece: str) -> str:
    while True:
        m = re.match(r"[A-Za-z_][\w'!?]*", piece)
        if not m:
            return piece[:1]
        w = m.group(0)
        rest = piece[m.end() :].strip()
        if w in COMBINATORS and rest:
            piece = rest
            continue
        return w


def split_tactics(text: str, strict: bool, col0: int = 0) -> list:
    """The top-level tactics of `text` as [(start offset, end offset, error offset or None)].

    strict=False reads a tactic sequence (a ``by`` block, ``( ... )``); strict=True reads what the
    REPL's tactic mode reads: exactly one tactic, with no saved position. A ``;`` outside brackets
    ends a tactic. A further line continues the tactic above when it starts with ``|``, ``_ `` (a
    calc step) or ``<;>``, when the tactic opened a block (a line ending in ``=>``, ``by``, ``with``,
    ``:=``, ...) and the line is deeper than the tactic's first column, or when it does not start
    with a tactic (Lean reads it as more arguments; in a sequence only if it is deeper). Otherwise it
    starts the next tactic. The error offset of a second tactic is where Lean stops parsing: the
    ``;``, or the first character of the line. `col0` is the column of text[0] in its line."""
    out, n = [], len(text)
    start = next((j for j in range(n) if not text[j].isspace()), None)
    if start is None:
        return []
    base = start - (text.rfind("\n", 0, start) + 1) + (col0 if "\n" not in text[:start] else 0)
    opened, skip_to = False, start
    for i, c, depth, in_str in _scan(text, start):
        if i < skip_to or in_str or depth > 0:
            continue
        if c == ";" and not text.startswith("<;>", i - 1):
            nxt = next((j for j in range(i + 1, n) if not text[j].isspace()), n)
            out.append((start, i, i))
            start, opened, skip_to = nxt, False, nxt
        elif c == "\n":
            if BLOCK_END.search(text[text.rfind("\n", 0, i) + 1 : i]):
                opened = True
            j = next((j for j in range(i + 1, n) if text[j] not in " \t\n"), n)
            if j >= n:
                break
            col = j - (text.rfind("\n", 0, j) + 1)
            word = re.match(r"[^\s(\[{⟨]*", text[j:]).group(0)
            tactic_start = (
                word in KNOWN_TACTICS or word in ("·", ".") or head_word(text[j:]) in KNOWN_TACTICS
            )
            if text.startswith(("|", "<;>", "_ "), j) or (opened and col > base):
                cont = True
            else:
                cont = not tactic_start and (strict or col > base)
            if not cont:
                out.append((start, i, j))
                start, opened = j, False
            skip_to = j
    if start < n and text[start:].strip():
        out.append((start, n, None))
    return out


def _unit_hash(*parts: str) -> float:
    h = hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()
    return int(h[:16], 16) / 2**64


def load_table(path) -> tuple:
    """(transitions {(goal without case line, normalised tactic): row}, root goals {normalised signature: goal})."""
    table, roots = {}, {}
    if not path or not Path(path).exists():
        return table, roots
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        sig = re.sub(r"^\s*(theorem|lemma)\s+\S+", "", r["formal_statement"])
        sig = re.sub(r":=\s*by\s*$", "", sig)
        roots[_norm(sig)] = r["goal"]
        for t in r["transitions"]:
            table[(_without_case(t["goal"]), _norm(t["tactic"]))] = t
    return table, roots


# --------------------------------------------------------------------------- the REPL's state


class FakeLean:
    """The REPL's state and rules, usable in-process (the Kimina stand-in does)."""

    def __init__(
        self,
        accept: str = "known",
        proof_status: bool = False,
        stats: str | None = None,
        state_dir: str | None = None,
        import_delay: float = 0.0,
        tactics: str | None = str(DEFAULT_TACTICS),
    ):
        self.invert, self.rule = (
            accept.startswith("not:"),
            accept,
        )  # not:RULE: RULE's verdict, reversed
        self.accept = accept = accept[len("not:") :] if self.invert else accept
        if accept.startswith("hash:"):
            self.p = float(accept.split(":", 1)[1])
        elif accept.startswith("tactic:"):
            self.pattern = re.compile(accept.split(":", 1)[1])
        elif accept not in ("known", "all", "none") or self.invert:
            raise ValueError(f"bad --accept {self.rule!r}")
        self.brackets = accept in ("known", "none") or accept.startswith(
            "tactic:"
        )  # rules that parse brackets
        self.proof_status = proof_status
        self.stats = stats
        self.state_dir = state_dir
        self.import_delay = import_delay
        self.table, self.roots = load_table(tactics)
        self.table_goals = {g for g, _ in self.table}
        self.envs: list = []  # {"parent": id|None, "decls": {name: info}, "axioms": set, "opens": list}
        self.states: list = []  # {"goals": [...], "sorry": bool}
        self.log("start")

    # ------------------------------------------------------------ bookkeeping
    def log(self, *words):
        if self.stats:
            with open(self.stats, "a", encoding="utf-8") as f:
                f.write(" ".join([words[0], str(os.getpid()), *map(str, words[1:])]) + "\n")

    def chain(self, env):
        while env is not None:
            yield self.envs[env]
            env = self.envs[env]["parent"]

    def exact(self, env, name: str):
        for e in self.chain(env):
            if name in e["decls"]:
                return e["decls"][name]
        if name in LIBRARY:
            return {"type": LIBRARY[name], "axioms": list(DEFAULT_AXIOMS)}
        return None

    def resolve(self, env, name: str) -> list:
        """[(full name, info)] that `name` may mean: `_root_.x` means x only; an atomic name also
        resolves through the opened namespaces (those first, as Lean's resolveGlobalName does)."""
        if name.startswith("_root_."):
            info = self.exact(env, name[len("_root_.") :])
            return [(name[len("_root_.") :], info)] if info else []
        found = []
        if "." not in name:
            for ns in dict.fromkeys(o for e in self.chain(env) for o in e["opens"]):
                info = self.exact(env, f"{ns}.{name}")
                if info:
                    found.append((f"{ns}.{name}", info))
        info = self.exact(env, name)
        return found + ([(name, info)] if info else [])

    def lookup(self, env: int, name: str):
        hits = self.resolve(env, name)
        return hits[-1][1] if hits else None

    def env_axioms(self, env):
        out = set()
        for e in self.chain(env):
            out |= e["axioms"]
        return out

    def new_env(self, parent, decls, axioms, opens=()) -> int:
        self.envs.append({"parent": parent, "decls": decls, "axioms": axioms, "opens": list(opens)})
        return len(self.envs) - 1

    def new_state(self, goals, sorry=False) -> int:
        self.states.append({"goals": list(goals), "sorry": sorry})
        return len(self.states) - 1

    def root_goal(self, sig: str) -> str:
        return self.roots.get(_norm(sig)) or goal_from_signature(sig)

    # ------------------------------------------------------------ requests
    def handle(self, req) -> tuple:
        """Returns (reply, directives found in the request's text); raises SystemExit(1) where the
        REPL dies (a request of no known shape)."""

        def nat(k):
            return isinstance(req.get(k), int) and not isinstance(req.get(k), bool) and req[k] >= 0

        if not isinstance(req, dict):
            _die("Could not parse as a valid JSON command:\nexpected an object")
        if nat("proofState") and isinstance(req.get("tactic"), str):
            self.log("tactic")
            return self.run_tactic(req["proofState"], req["tactic"])
        if nat("env") and isinstance(req.get("pickleTo"), str):
            if req["env"] >= len(self.envs):
                return {"message": "Unknown environment."}, []
            env = req["env"]
            decls = {}
            for e in reversed(list(self.chain(env))):
                decls.update(e["decls"])
            opens = [o for e in self.chain(env) for o in e["opens"]]
            with open(req["pickleTo"], "w", encoding="utf-8") as f:
                json.dump(
                    {"decls": decls, "axioms": sorted(self.env_axioms(env)), "opens": opens}, f
                )
            return {"env": env}, []
        if isinstance(req.get("unpickleEnvFrom"), str):
            with open(req["unpickleEnvFrom"], encoding="utf-8") as f:
                d = json.load(f)
            return {"env": self.new_env(None, d["decls"], set(d["axioms"]), d.get("opens", []))}, []
        if nat("proofState") and isinstance(req.get("pickleTo"), str):
            if req["proofState"] >= len(self.states):
                return {"message": "Unknown proof State."}, []
            st = self.states[req["proofState"]]
            with open(req["pickleTo"], "w", encoding="utf-8") as f:
                json.dump(st, f)
            return self.step_reply(
                self.new_state(st["goals"], st["sorry"]), st["goals"], [], [], False
            ), []
        if isinstance(req.get("unpickleProofStateFrom"), str) and (
            req.get("env") is None or nat("env")
        ):
            if req.get("env") is not None and req["env"] >= len(self.envs):
                return {"message": "Unknown environment."}, []
            with open(req["unpickleProofStateFrom"], encoding="utf-8") as f:
                st = json.load(f)
            return self.step_reply(
                self.new_state(st["goals"], st["sorry"]), st["goals"], [], [], False
            ), []
        if isinstance(req.get("cmd"), str) and (req.get("env") is None or nat("env")):
            self.log("cmd")
            env = req.get("env")
            if env is not None and env >= len(self.envs):
                return {"message": "Unknown environment."}, []
            return self.run_command(req["cmd"], env, req.get("allTactics") is True)
        if isinstance(req.get("path"), str):
            try:
                text = Path(req["path"]).read_text(encoding="utf-8")
            except OSError as e:
                return {
                    "message": f"no such file or directory (error code: 2)\n  file: {req['path']}"
                    if isinstance(e, FileNotFoundError)
                    else str(e)
                }, []
            return self.run_command(text, None, req.get("allTactics") is True)
        _die("Could not parse as a valid JSON command:\nproperty not found: cmd")

    def run_command(self, text: str, env, all_tactics: bool = False) -> tuple:
        directives = DIRECTIVE_RE.findall(text)
        code = _strip_comments(text)
        lines = code.split("\n")
        messages, sorries, tactics = [], [], []
        start = 0
        if env is None:  # imports only here
            n_imports = 0
            while start < len(lines) and (
                not lines[start].strip() or lines[start].startswith("import ")
            ):
                if lines[start].startswith("import "):
                    mod = lines[start].split()[1] if len(lines[start].split()) > 1 else ""
                    if not re.fullmatch(r"[A-Za-z][\w.]*", mod) or "NoSuch" in mod:
                        messages.append(
                            self.msg("error", start + 1, 0, f"unknown module prefix '{mod}'")
                        )
                    n_imports += 1
                start += 1
            if n_imports:
                self.log("header", n_imports)
                if self.import_delay:
                    time.sleep(self.import_delay)
        new = self.new_env(env, {}, set())
        for cmd_line, cmd in self.split_commands(lines, start, messages):
            if cmd is None:
                break
            self.run_one(
                cmd, cmd_line, new, messages, sorries, directives, tactics if all_tactics else None
            )
        reply = {"env": new}
        for key, val in (("messages", messages), ("sorries", sorries), ("tactics", tactics)):
            if val:
                reply[key] = val
        return reply, directives

    @staticmethod
    def msg(sev, line, col, data, end=None):
        """A message as the REPL writes it; `end` None gives endPos one token on, "null" a null endPos."""
        end_pos = (
            None
            if end == "null"
            else {"line": end[0], "column": end[1]}
            if end
            else {"line": line, "column": col + 1}
        )
        return {
            "severity": sev,
            "pos": {"line": line, "column": col},
            "endPos": end_pos,
            "data": data,
        }

    def split_commands(self, lines, start, messages):
        cur, cur_line = [], None
        for i in range(start, len(lines)):
            ln = lines[i]
            if ln and not ln[0].isspace() and CMD_START.match(ln):
                if cur and not re.search(r"\bin\s*$", cur[-1]):
                    yield cur_line, "\n".join(cur)
                    cur, cur_line = [], None
                if cur_line is None:
                    cur_line = i + 1
                cur.append(ln)
                if ln.startswith("#exit"):
                    yield cur_line, "\n".join(cur)
                    yield None, None
                    return
            elif ln.strip():
                if cur_line is None:
                    messages.append(
                        self.msg("error", i + 1, 0, "unexpected identifier; expected command")
                    )
                    cur_line = i + 1
                cur.append(ln)
            elif cur:
                cur.append(ln)
        if cur:
            yield cur_line, "\n".join(cur)

    def run_one(self, cmd: str, line: int, env: int, messages, sorries, directives, tactics):
        cmd = re.sub(r"^(?:\s*(?:set_option\s+\S+\s+\S+|open\s+[^\n]*?)\s+in(?=\s))+\s*", "", cmd)
        cmd = re.sub(
            r"^(?:@\[[^\]]*\]\s*|(?:private|protected|noncomputable|unsafe|partial)\s+)+", "", cmd
        )
        first = cmd.split(None, 1)[0] if cmd.split() else ""
        if first in ("theorem", "lemma", "example", "def", "abbrev"):
            return self.declaration(cmd, line, env, messages, sorries, directives, tactics)
        if first == "opaque":
            m = re.match(r"\w+\s+(\S+?)(?=[\s(\[{:⦃]|$)", cmd)
            if m:
                self.envs[env]["decls"][m.group(1)] = {"type": _norm(cmd), "axioms": []}
            return
        if first in ("axiom", "constant"):
            m = re.match(r"\w+\s+(\S+?)(?=[\s(\[{:⦃]|$)", cmd)
            if m:
                self.envs[env]["axioms"].add(m.group(1))
                self.envs[env]["decls"][m.group(1)] = {"type": _norm(cmd), "axioms": [m.group(1)]}
            return
        if first == "import":
            messages.append(
                self.msg(
                    "error",
                    line,
                    0,
                    "invalid 'import' command, it must be used in the beginning of the file",
                )
            )
            return
        if first == "open":
            self.envs[env]["opens"].extend(w for w in cmd.split()[1:] if IDENT.fullmatch(w))
            return
        if first == "#check":
            m = re.match(r"#check\s+(@?)(\S+)", cmd)
            hits = self.resolve(env, m.group(2)) if m else []
            name = m.group(2) if m else ""
            if not hits:
                messages.append(
                    self.msg(
                        "error", line, 7, f"unknown identifier '{name}'", (line, 7 + len(name))
                    )
                )
            elif m.group(1) and len(hits) > 1:
                alts = "\n  \n".join(
                    f"  _root_.{n} : {i['type']}" if "." not in n else f"  {n} : {i['type']}"
                    for n, i in hits
                )
                messages.append(
                    self.msg(
                        "error",
                        line,
                        7,
                        f"ambiguous, possible interpretations \n{alts}",
                        (line, 8 + len(name)),
                    )
                )
            elif m.group(1):
                messages.append(
                    self.msg("info", line, 0, f"@{hits[0][0]} : {hits[0][1]['type']}", (line, 6))
                )
            else:
                messages.append(
                    self.msg("info", line, 0, f"{hits[0][0]} {hits[0][1]['type']}", (line, 6))
                )
            return
        if first == "#print":
            m = re.match(r"#print\s+(axioms\s+)?(\S+)", cmd)
            hits = self.resolve(env, m.group(2)) if m else []
            if not hits:
                messages.append(
                    self.msg("error", line, 0, f"unknown constant '{m.group(2) if m else ''}'")
                )
            for n, info in hits if m and m.group(1) else hits[:1]:
                if not m.group(1):
                    messages.append(
                        self.msg("info", line, 0, f"theorem {n} : {info['type']}", (line, 6))
                    )
                elif info["axioms"]:
                    messages.append(
                        self.msg(
                            "info",
                            line,
                            0,
                            f"'{n}' depends on axioms: [{', '.join(info['axioms'])}]",
                            (line, 6),
                        )
                    )
                else:
                    messages.append(
                        self.msg("info", line, 0, f"'{n}' does not depend on any axioms", (line, 6))
                    )
            return
        if first == "#eval":
            messages.append(self.msg("info", line, 0, "fake: #eval output"))
            return
        if first == "variable":
            return
        # set_option, namespace, section, end, notation, macro, instance, ... : accepted silently

    def declaration(self, cmd, line, env, messages, sorries, directives, tactics):
        m = re.match(r"(theorem|lemma|def|abbrev)\s+(\S+?)(?=[\s(\[{:⦃]|$)", cmd)
        if m:
            kind, name, rest = m.group(1), m.group(2), cmd[m.end() :]
        else:
            kind, name, rest = "example", None, cmd[len("example") :]
        k = _find_top(rest, ":=")
        if k < 0:
            messages.append(
                self.msg(
                    "error", line + cmd.count("\n"), 0, "unexpected end of input; expected ':='"
                )
            )
            return
        sig, body = rest[:k], rest[k + 2 :]
        bad = _balanced(sig + " := " + body) if self.brackets else -1
        if bad >= 0:
            messages.append(self.msg("error", line, 0, "unexpected token; unbalanced brackets"))
            return
        if name and self.exact(env, name) is not None and kind in ("theorem", "lemma"):
            messages.append(self.msg("error", line, 8, f"'{name}' has already been declared"))
            return
        if (
            kind in ("def", "abbrev")
            and _find_top(sig, ":") < 0
            and not body.strip().startswith("by")
        ):
            sig = sig + " : " + (_norm(body) if re.fullmatch(r"\s*\d+\s*", body) is None else "Nat")
        goal = self.root_goal(sig)
        used_sorry = bool(SORRY_RE.search(body) or SORRY_RE.search(sig))
        body_off = len(cmd) - len(body)
        name_col = (len(kind) + 1) if name else 0
        name_end = (line, name_col + (len(name) if name else len(kind)))
        if body.strip() == "_":
            p = _position(cmd, body_off + body.find("_"))
            messages.append(
                self.msg(
                    "error",
                    line + p[0] - 1,
                    p[1],
                    "don't know how to synthesize placeholder\ncontext:\n" + goal,
                )
            )
            self.record(name, sig, env, ["sorryAx"], directives)
            return
        if kind in ("def", "abbrev") and self.accept != "known":  # only `known` judges definitions
            ok, err = bool(body.strip()), "expected term"
        else:
            ok, err = self.accept_body(sig, body, goal)
        axioms = list(DEFAULT_AXIOMS)
        if "native_decide" in body:
            axioms.append("Lean.ofReduceBool")
        for ax in sorted(self.env_axioms(env)):
            if re.search(r"(?<![\w'.])" + re.escape(ax) + r"(?![\w'])", body):
                axioms.append(ax)
        for kind_d, arg in directives:
            if kind_d == "axiom" and arg:
                axioms.append(arg)
            if kind_d == "sorry_warning":
                messages.append(self.msg("warning", line, 8, "declaration uses 'sorry'"))
        if (
            used_sorry
        ):  # one entry per sorry, recorded before the tactics' states (REPL/Main.lean runCommand)
            messages.append(
                self.msg("warning", line, name_col, "declaration uses 'sorry'", name_end)
            )
            for sm in SORRY_RE.finditer(body):
                off = body_off + sm.start()
                s_line, s_col = line + cmd[:off].count("\n"), _position(cmd, off)[1]
                g = self.sorry_goal(body[: sm.start()], goal)
                sorries.append(
                    {
                        "goal": g,
                        "proofState": self.new_state([g]),
                        "pos": {"line": s_line, "column": s_col},
                        "endPos": {"line": s_line, "column": s_col + len(sm.group(0))},
                    }
                )
            axioms.append("sorryAx")
        if tactics is not None:
            self.all_tactics(cmd, line, body_off, goal, tactics)
        if not used_sorry and not ok:
            if err == "unexpected end of input; expected '{'":  # `:= by` and nothing after it
                end = _position(cmd, len(cmd.rstrip()))
                messages.append(self.msg("error", line + end[0] - 1, end[1], err, "null"))
                by = _position(cmd, len(cmd.rstrip()) - 2)
                messages.append(
                    self.msg(
                        "error",
                        line + by[0] - 1,
                        by[1],
                        "unsolved goals\n" + goal,
                        (line + end[0] - 1, end[1]),
                    )
                )
            else:
                messages.append(self.msg("error", line + cmd.count("\n"), 0, err))
            axioms.append("sorryAx")
        self.record(name, sig, env, axioms, directives)

    @staticmethod
    def sorry_goal(before: str, goal: str) -> str:
        """The goal a sorry stands for: `have h : T := by sorry` and a calc step `a = b := by sorry` prove T
        and `a = b` in the context of the theorem; any other sorry proves the theorem's goal."""
        prefix = before[before.rfind("\n") + 1 :]
        m = re.search(
            r"(?:\bhave\s+[^\s:]*\s*:\s*|^\s*(?:calc\s+)?)(?P<t>[^\s:][^\n]*?)\s*:=\s*(?:by\s*)?$",
            prefix,
        )
        return _split_goal(goal)[0] + "⊢ " + _norm(m.group("t")) if m else goal

    def record(self, name, sig, env, axioms, directives):
        if name:
            typ = _norm(sig)
            if any(kind == "alter_type" for kind, _ in directives):
                typ += " ∧ True"
            self.envs[env]["decls"][name] = {"type": typ, "axioms": axioms}

    def all_tactics(self, cmd, line, body_off, goal, out):
        """allTactics: one entry per top-level tactic of a `by` block."""
        body = cmd[body_off:]
        m = re.match(r"\s*by(?![\w'])", body)
        if not m:
            return
        goals = [goal]
        base = body_off + m.end()
        text = cmd[base:]
        for s, e, _ in split_tactics(text, strict=False):
            tac = text[s:e].rstrip()
            p0, p1 = _position(cmd, base + s), _position(cmd, base + s + len(tac))
            out.append(
                {
                    "tactic": tac,
                    "proofState": self.new_state(goals),
                    "pos": {"line": line + p0[0] - 1, "column": p0[1]},
                    "endPos": {"line": line + p1[0] - 1, "column": p1[1]},
                    "goals": "\n\n".join(goals) or "no goals",
                    "usedConstants": self.used_constants(tac, goals),
                }
            )
            try:
                goals, _, _ = (
                    self.engine(goals, tac) if self.accept == "known" else (goals[1:], [], [])
                )
            except TacticError:
                break

    def used_constants(self, tac: str, goals) -> list:
        local = (
            _hypothesis_names(goals) | KNOWN_TACTICS | {"at", "with", "using", "fun", "by", "only"}
        )
        out = []
        for ident in IDENT.findall(tac):
            if ident.split(".")[0] in local or ident in out:
                continue
            if "." in ident or "_" in ident.strip("_"):
                out.append(ident)
        if re.search(r"(?<![\w.])\d", tac):
            out += ["OfNat.ofNat", "instOfNatNat"]
        return out

    def accept_body(self, sig: str, body: str, goal: str) -> tuple:
        text = body.strip()
        is_tactic = text.startswith("by") and (
            len(text) == 2 or not (text[2].isalnum() or text[2] == "_")
        )
        tactics = text[2:] if is_tactic else text
        pieces = tactic_pieces(tactics) if is_tactic else [p for p in [tactics] if p]
        if not pieces:
            return False, "unexpected end of input; expected '{'" if is_tactic else "expected term"
        if SORRY_RE.search(tactics):
            return True, ""
        if self.accept == "all":
            return True, ""
        if self.accept == "none":
            return False, "fake: rejected (--accept none)"
        if self.accept.startswith("hash:"):
            key = _norm(" ".join(pieces))
            if (_unit_hash(_norm(sig), key) < self.p) != self.invert:
                return True, ""
            return False, "linarith failed to find a contradiction"
        if self.accept.startswith("tactic:"):
            if bool(self.pattern.search(_norm(" ".join(pieces)))) != self.invert:
                return True, ""
            return False, f"fake: rejected (--accept {self.rule})"
        if not is_tactic:
            return True, ""
        if _without_case(goal) in self.table_goals:  # a table theorem: run its transitions
            body_tactics = body[body.find("by") + 2 :]
            try:
                goals, _, logged = self.run_seq([goal], body_tactics)
            except TacticError as e:
                return False, str(e)
            if logged:
                return False, logged[0]["data"]
            return (True, "") if not goals else (False, "unsolved goals\n" + "\n\n".join(goals))
        heads = [head_word(p) for p in pieces]
        for h in heads:
            if h not in KNOWN_TACTICS:
                return False, f"unknown tactic '{h}'"
        if heads[-1] not in CLOSING_TACTICS:
            return False, "unsolved goals\n" + goal
        return True, ""

    # ------------------------------------------------------------ the tactic engine (--accept known)
    def run_seq(self, goals, text) -> tuple:
        """Run a tactic sequence on `goals`; returns (goals, sorry goals, logged error messages)."""
        sorries, logged = [], []
        for s, e, _ in split_tactics(text, strict=False):
            goals, s2, l2 = self.engine(goals, text[s:e])
            sorries += s2
            logged += l2
        return goals, sorries, logged

    def focus(self, goals, text, tag=None):
        """`· tacs`, `{ tacs }`, `case tag => tacs`: run on one goal, which must be closed."""
        if not goals:
            raise TacticError("no goals to be proved")
        i = 0
        if tag:
            i = next((k for k, g in enumerate(goals) if g.startswith(f"case {tag}\n")), -1)
            if i < 0:
                raise TacticError(f"Case tag '{tag}' not found.")
        left, sorries, logged = self.run_seq([goals[i]], text)
        if left:
            logged.append(self.msg("error", 0, 0, "unsolved goals\n" + "\n\n".join(left), (0, 0)))
        return goals[:i] + goals[i + 1 :], sorries, logged

    def engine(self, goals, text: str) -> tuple:
        """One tactic on `goals` -> (goals, sorry goals, logged error messages); raises TacticError."""
        t = text.strip()
        if not t:
            raise TacticError("<input>:1:0: expected tactic")
        if not goals:
            raise TacticError("no goals to be proved")
        if t[0] in "({" and _matching(t, 0) == len(t) - 1:
            inner = t[1:-1]
            return self.run_seq(goals, inner) if t[0] == "(" else self.focus(goals, inner)
        if t[0] in "·." and (len(t) == 1 or t[1].isspace()):
            return self.focus(goals, t[1:])
        m = re.match(r"(case\s+(\S+)[^=]*|next[^=]*)=>", t)
        if m:
            return self.focus(goals, t[m.end() :], tag=m.group(2))
        m = re.match(r"on_goal\s+(-?\d+)\s*=>", t)
        if m:  # run on goal n (from 1; negative from the end), its new goals in its place
            n = int(m.group(1))
            i = n - 1 if n > 0 else len(goals) + n
            if not 0 <= i < len(goals):
                raise TacticError(f"not enough goals: there is no goal {n}")
            new, sorries, logged = self.run_seq([goals[i]], t[m.end() :])
            return goals[:i] + new + goals[i + 1 :], sorries, logged
        k = _find_top(t, "<;>")
        if k >= 0:
            first, sorries, logged = self.engine(goals[:1], t[:k])
            out = []
            for g in first:
                g2, s2, l2 = self.engine([g], t[k + 3 :])
                out += g2
                sorries += s2
                logged += l2
            return out + goals[1:], sorries, logged
        head = (
            head_word(t)
            if not re.match(r"(all_goals|any_goals|try|repeat|focus)\b", t)
            else t.split()[0]
        )
        rest = t[len(head) :].strip() if t.startswith(head) else ""
        if head in ("all_goals", "any_goals"):
            out, sorries, logged, worked = [], [], [], False
            for g in goals:
                try:
                    g2, s2, l2 = self.engine([g], rest)
                    out += g2
                    sorries += s2
                    logged += l2
                    worked = True
                except TacticError:
                    if head == "all_goals":
                        raise
                    out.append(g)
            if not worked:
                raise TacticError("any_goals failed")
            return out, sorries, logged
        if head == "try":
            try:
                return self.engine(goals, rest)
            except TacticError:
                return goals, [], []
        if head == "repeat":
            sorries, logged = [], []
            for _ in range(64):
                try:
                    goals, s2, l2 = self.engine(goals, rest)
                    sorries += s2
                    logged += l2
                except TacticError:
                    break
                if not goals:
                    break
            return goals, sorries, logged
        if head == "first":
            for alt in (a for a in t[len("first") :].split("|") if a.strip()):
                try:
                    return self.engine(goals, alt)
                except TacticError:
                    continue
            raise TacticError("first failed")
        return self.atomic(goals, t)

    def atomic(self, goals, t: str) -> tuple:
        g = goals[0]
        head = head_word(t)
        if SORRY_RE.fullmatch(t) or t in ("sorry", "admit"):
            return goals[1:], [g], []
        hit = self.table.get((_without_case(g), _norm(t)))
        if hit is not None:
            if "error" in hit:
                raise TacticError(hit["error"])
            return list(hit["goals"]) + goals[1:], [], []
        if head not in KNOWN_TACTICS:
            raise TacticError("<input>:1:1: unknown tactic")
        if _without_case(g) in self.table_goals:
            raise TacticError(f"{head} failed")
        hyps, target = _split_goal(g)
        args = t.split()[1:]
        if head == "have":
            hm = re.match(r"have\s+(?:([^\s:]+)\s*)?:\s*(.+?)(?:\s*:=\s*(.*))?$", t, re.S)
            if hm:
                name, typ, proof = hm.group(1) or "this", _norm(hm.group(2)), hm.group(3)
                added = f"{hyps}{name} : {typ}\n⊢ {target}"
                if proof is None:
                    return [f"{hyps}⊢ {typ}", added] + goals[1:], [], []
                return [added] + goals[1:], [f"{hyps}⊢ {typ}"] if SORRY_RE.search(proof) else [], []
            return goals, [], []
        if head == "induction":
            done = self.induction(goals, t)
            if done is not None:
                return done
        if head == "by_cases":
            bm = re.match(r"by_cases\s+(?:([^\s:]+)\s*:\s*)?(.+)$", t, re.S)
            if bm:
                name, prop = bm.group(1) or "h", _norm(bm.group(2))
                return (
                    [
                        f"case pos\n{_without_case(hyps)}{name} : {prop}\n⊢ {target}",
                        f"case neg\n{_without_case(hyps)}{name} : ¬{prop}\n⊢ {target}",
                    ]
                    + goals[1:],
                    [],
                    [],
                )
        if SORRY_RE.search(
            t
        ):  # `... => sorry` alternatives, `exact sorry`: the goal is closed with a sorry
            return goals[1:], [g], []
        if head in CLOSING_TACTICS and not re.search(
            r"\sat\s+[^*]", t
        ):  # `simp at h` changes h, not the goal
            return goals[1:], [], []
        if head == "constructor" and (
            _find_top(target, " ∧ ") >= 0 or _find_top(target, " ↔ ") >= 0
        ):
            k = _find_top(target, " ∧ ")
            if k >= 0:
                parts = [target[:k], target[k + 3 :]]
            else:
                k = _find_top(target, " ↔ ")
                a, b = target[:k], target[k + 3 :]
                parts = [f"{a} → {b}", f"{b} → {a}"]
            return [f"{hyps}⊢ {p.strip()}" for p in parts] + goals[1:], [], []
        if head in ("intro", "intros") and _find_top(target, " → ") >= 0:
            k = _find_top(target, " → ")
            hname = args[0] if args else "a✝"
            return (
                [f"{hyps}{hname} : {target[:k].strip()}\n⊢ {target[k + 3 :].strip()}"] + goals[1:],
                [],
                [],
            )
        return [f"{hyps}⊢ {target}"] + goals[1:], [], []

    def induction(self, goals, t: str):
        """`induction n` on a natural number n: goals `case zero` and `case succ` (n✝, a✝), as Lean names
        them; `induction n with | zero => tacs | succ m ih => tacs` runs each alternative on its goal."""
        m = re.match(r"induction\s+([^\s]+)\s*(?:with\b(.*))?$", t, re.S)
        hyps, target = _split_goal(goals[0])
        lines = hyps.rstrip("\n").split("\n") if hyps.strip() else []
        where = next(
            (
                i
                for i, ln in enumerate(lines)
                if " : " in ln
                and m
                and m.group(1) in ln.split(" : ")[0].split()
                and ln.split(" : ", 1)[1].strip() in ("ℕ", "Nat")
            ),
            None,
        )
        if m is None or where is None:
            return None
        var = m.group(1)
        names = [w for w in lines[where].split(" : ")[0].split() if w != var]
        rest = (
            lines[:where]
            + ([" ".join(names) + " : " + lines[where].split(" : ", 1)[1]] if names else [])
            + lines[where + 1 :]
        )
        ctx = "".join(ln + "\n" for ln in _without_case("\n".join(rest) + "\n").split("\n") if ln)

        def at(value):  # target[var := value], in parentheses unless only relations are next to it
            def put(mm):
                before, after = target[: mm.start()].rstrip()[-1:], target[mm.end() :].lstrip()[:1]
                loose = {"", "=", "<", ">", "≤", "≥", "≠", "∧", "∨", "→", "↔", ","}
                bare = " " not in value or (before in loose | {"("} and after in loose | {")"})
                return value if bare else f"({value})"

            return re.sub(r"(?<![\w'.])" + re.escape(var) + r"(?![\w'])", put, target)

        def cases(n, ih):
            return [
                f"case zero\n{ctx}⊢ {at('0')}",
                f"case succ\n{ctx}{n} : ℕ\n{ih} : {at(n)}\n⊢ {at(n + ' + 1')}",
            ]

        if not m.group(2):
            return cases("n✝", "a✝") + goals[1:], [], []
        out, sorries, logged = [], [], []
        for alt in re.split(r"(?m)^\s*\|", m.group(2))[1:]:
            am = re.match(r"\s*(zero|succ)((?:\s+[^\s=]+)*)\s*=>(.*)$", alt, re.S)
            if not am:
                raise TacticError("<input>:1:1: unexpected token; expected '|'")
            vs = am.group(2).split()
            g = cases(vs[0] if vs else "n✝", vs[1] if len(vs) > 1 else "a✝")[
                0 if am.group(1) == "zero" else 1
            ]
            g2, s2, l2 = self.run_seq([g], am.group(3))
            out += g2
            sorries += s2
            logged += l2
        return out + goals[1:], sorries, logged

    # ------------------------------------------------------------ tactic mode
    def run_tactic(self, sid, tactic: str) -> tuple:
        directives = DIRECTIVE_RE.findall(tactic)
        if not 0 <= sid < len(self.states):
            return {"message": "Unknown proof state."}, directives
        st = self.states[sid]
        goals = list(st["goals"])
        code = "\n".join(
            ln for ln in _strip_comments(tactic).split("\n") if not ln.strip().startswith("fake_")
        )
        if any(k == "trap" for k, _ in directives):
            msgs = [
                self.msg("error", 0, 0, "unsolved goals\n" + (goals[0] if goals else ""), (0, 0))
            ]
            return self.step_reply(self.new_state([], sorry=True), [], msgs, [], True), directives
        if not code.strip():
            return {"message": "Lean error:\n<input>:1:0: expected tactic"}, directives
        parts = split_tactics(code, strict=True)
        if len(parts) > 1:  # Parser.runParserCategory must consume the whole input
            line, col = _position(code, parts[0][2])
            return {
                "message": f"Lean error:\n<input>:{line}:{col}: expected end of input"
            }, directives
        bad = _balanced(code) if self.brackets else -1
        if bad >= 0:
            line, col = _position(code, bad)
            return {"message": f"Lean error:\n<input>:{line}:{col}: unexpected token"}, directives
        if not goals:
            return {"message": "Lean error:\nno goals to be proved"}, directives
        pieces = tactic_pieces(code)
        messages, sorry, sorry_goals = [], st["sorry"], []
        if self.accept == "known":
            try:
                goals, sorry_goals, messages = self.engine(goals, code)
            except TacticError as e:
                return {"message": f"Lean error:\n{e}"}, directives
        elif SORRY_RE.search(code):
            goals, sorry_goals = goals[1:], goals[:1]
        elif self.accept == "none":
            return {"message": "Lean error:\nfake: rejected (--accept none)"}, directives
        elif self.accept == "all":
            goals = goals[1:]
        elif self.accept.startswith("tactic:"):
            if bool(self.pattern.search(_norm(" ".join(pieces)))) == self.invert:
                return {
                    "message": f"Lean error:\nfake: rejected (--accept {self.rule})"
                }, directives
            goals = goals[1:]
        else:  # hash:P (not:hash:P closes the goal where hash:P does not)
            u = _unit_hash("\n\n".join(goals), _norm(" ".join(pieces)))
            lo, hi = (0.0, self.p) if self.invert else (self.p, 1.0)  # where the goal is not closed
            f = (u - lo) / max(
                hi - lo, 1e-12
            )  # a failure of one of three kinds, by where u falls in [lo, hi)
            if not lo <= u < hi:
                goals = goals[1:]
            elif f < 1 / 3:
                return {
                    "message": "Lean error:\nlinarith failed to find a contradiction"
                }, directives
            elif f < 2 / 3:
                messages.append(self.msg("error", 0, 0, "simp made no progress", (0, 0)))
            else:
                hyps, target = _split_goal(goals[0])
                goals[0] = f"{hyps}h{int(u * 1e6)} : True\n⊢ {target}"
        sorries = [{"proofState": self.new_state([g], True), "goal": g} for g in sorry_goals]
        new = self.new_state(goals, sorry or bool(sorries))
        return self.step_reply(new, goals, messages, sorries, sorry or bool(sorries)), directives

    def step_reply(self, new, goals, messages, sorries, sorry):
        reply = {"proofState": new, "goals": goals}
        if messages:
            reply["messages"] = messages
        if sorries:
            reply["sorries"] = sorries
        if self.proof_status:  # REPLs after v4.15.0 (2025-04) add this; v4.15.0 does not
            if goals:
                reply["proofStatus"] = "Incomplete: open goals remain"
            elif sorry:
                reply["proofStatus"] = "Incomplete: contains sorry"
            else:
                reply["proofStatus"] = "Completed"
        return reply


def _die(message: str) -> None:
    """The REPL's `parse` throws on a request it cannot read; nothing catches it, so it exits."""
    sys.stderr.write(
        "uncaught exception: " + json.dumps({"message": message}, ensure_ascii=False) + "\n"
    )
    sys.stderr.flush()
    raise SystemExit(1)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--accept", default="known", help="known | all | none | hash:P | tactic:REGEX | not:RULE"
    )
    ap.add_argument(
        "--proof-status", action="store_true", help="add proofStatus as REPLs after v4.15.0 do"
    )
    ap.add_argument(
        "--no-proof-status", action="store_true", help="(the default; kept for old command lines)"
    )
    ap.add_argument(
        "--tactics", default=str(DEFAULT_TACTICS), help="the tactic table (jsonl); '' for none"
    )
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--crash-after", type=int, default=0)
    ap.add_argument("--garbage-after", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--import-delay", type=float, default=0.0)
    ap.add_argument("--leak-mb", type=float, default=0.0)
    ap.add_argument("--base-mb", type=float, default=0.0)
    ap.add_argument("--stats", default=os.environ.get("FAKE_LEAN_STATS"))
    ap.add_argument("--state-dir", default=os.environ.get("FAKE_LEAN_STATE_DIR"))
    a = ap.parse_args(argv)
    lean = FakeLean(
        a.accept,
        a.proof_status and not a.no_proof_status,
        a.stats,
        a.state_dir,
        a.import_delay,
        a.tactics or None,
    )
    if a.base_mb:
        _LEAKS.append(b"\x01" * int(a.base_mb * 2**20))
    n = 0
    buf = []
    while True:
        line = sys.stdin.readline()
        if line.strip():
            buf.append(line)
            continue
        if not buf:  # a blank line between requests, or the end of the input
            if line == "":
                return
            continue
        text, buf = "".join(buf), []
        if text.startswith(("#", "--")):
            continue
        try:
            req = json.loads(text)
        except ValueError as e:  # the real REPL dies on bad JSON
            _die(f"Could not parse JSON:\n{e}")
        n += 1
        is_header = isinstance(req, dict) and "cmd" in req and "env" not in req
        reply, directives = lean.handle(req)
        kinds = {k: arg for k, arg in directives}
        if a.crash_after and n >= a.crash_after:
            sys.stderr.write("fake: crash (--crash-after)\n")
            os._exit(3)
        if "crash_once" in kinds:
            marker = os.path.join(
                a.state_dir or "", "crash_once_" + re.sub(r"\W", "_", kinds["crash_once"] or "x")
            )
            if not a.state_dir or not os.path.exists(marker):
                if a.state_dir:
                    open(marker, "w").close()
                os._exit(4)
        if "crash" in kinds:
            sys.stderr.write("fake: crash (fake_crash)\n")
            os._exit(5)
        if "stderr" in kinds:
            sys.stderr.write("fake: something on stderr\n")
            sys.stderr.flush()
        if (a.hang and not is_header) or "hang" in kinds:
            while True:
                time.sleep(3600)
        leak = a.leak_mb + float(kinds.get("leak") or 0)
        if leak:
            _LEAKS.append(b"\x01" * int(leak * 2**20))
        delay = a.delay + float(kinds.get("slow") or 0)
        if delay:
            time.sleep(delay)
        if (a.garbage_after and n == a.garbage_after) or "garbage" in kinds:
            _write('{"env": 1, "messages": [oops this is not json\n\n')
            continue
        if "noise" in kinds:
            _write("Processing incremental state [pos: 0..10]:\nsome text\n\nmore progress text\n")
        _write(json.dumps(reply, ensure_ascii=False, indent=2) + "\n\n")
        if line == "":
            return


if __name__ == "__main__":
    main()
