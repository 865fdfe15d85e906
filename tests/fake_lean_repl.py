#!/usr/bin/env python3
"""A stand-in for the Lean 4 REPL (leanprover-community/repl), for tests without Lean.

It speaks the REPL's protocol on stdin/stdout: JSON commands separated by blank
lines; each reply is one (pretty-printed) JSON object followed by a blank line.

* ``{"cmd": text}``: a new environment; leading ``import X`` lines are "imported"
  (counted in ``--stats``), the rest is processed as commands. ``{"cmd": text, "env": N}``
  runs in environment N. Reply: ``{"env": M, "messages": [...], "sorries": [...]}``
  (empty lists left out), ``{"message": "Unknown environment."}`` for a bad N.
* messages: ``{"severity", "pos": {"line", "column"}, "endPos", "data"}``. A ``sorry``
  gives a warning "declaration uses 'sorry'" and a sorries entry ``{"goal",
  "proofState", "pos", "endPos"}`` whose proof state can be used in tactic mode.
* ``#check @name`` (also after ``set_option pp.all true in``) prints ``@name : <type>``
  where the type is the normalised signature text; ``#print axioms name`` prints
  ``'name' depends on axioms: [propext, Classical.choice, Quot.sound]`` (plus
  ``sorryAx`` for a proof with sorry or errors, ``Lean.ofReduceBool`` for
  ``native_decide``, any declared ``axiom`` the proof mentions).
* ``{"tactic": t, "proofState": N}``: ``{"proofState": M, "goals": [...], "proofStatus": ...}``
  or ``{"message": "Lean error:\\n..."}``; ``proofStatus`` is left out with
  ``--no-proof-status`` (older REPLs).
* ``{"pickleTo": path, "env": N}`` / ``{"unpickleEnvFrom": path}``: a JSON file of the env.

Which proofs it accepts (``--accept``):

* ``known`` (default): a ``by`` block is accepted iff every tactic (each line, split on
  ``;`` and ``<;>``, bullets dropped; its first word) is in KNOWN_TACTICS and the last
  one is in CLOSING_TACTICS ("the goal closes"); otherwise an error "unsolved goals"
  or "unknown tactic". Term proofs (``:= term``) are accepted. In tactic mode a
  closing tactic closes the first goal, ``constructor`` splits ``∧``/``↔``,
  ``intro h`` moves a premise of ``→`` into the context, other known tactics
  keep the goal.
* ``hash:P``: accepted iff sha256(normalised signature + tactic text) falls under P:
  a deterministic pseudo-random share P, for algorithm tests that need mixed
  solve rates from a random model. In tactic mode the hash of (goals, tactic)
  closes the first goal with probability P, else errors or makes progress.
* ``all`` / ``none``: accept every proof / no proof.
In every mode a missing ``:=``, an empty proof and a repeated theorem name are errors,
and ``sorry``/``admit``/``stop`` are reported as sorry (like the real REPL); ``known``
and ``none`` also reject unbalanced brackets (``hash:P`` and ``all`` do not, so that
random text is accepted at the rate P).

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
mode: no goals, but an error and proofStatus "Incomplete: contains sorry").
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

KNOWN_TACTICS = {
    "norm_num", "simp", "simp_all", "linarith", "nlinarith", "omega", "decide", "ring", "ring_nf",
    "field_simp", "positivity", "rfl", "exact", "intro", "intros", "constructor", "use", "aesop",
    "tauto", "trivial", "apply", "rw", "have", "refine", "cases", "rcases", "obtain", "induction",
    "subst", "norm_cast", "push_cast", "exact_mod_cast", "gcongr", "unfold", "specialize", "left",
    "right", "exists", "calc", "show", "by_contra", "push_neg", "contradiction", "assumption",
    "interval_cases", "all_goals", "any_goals", "try", "repeat", "first", "nth_rewrite", "rwa",
    "simpa", "set", "let", "by_cases", "split_ifs", "exfalso", "congr", "ext", "funext", "bound",
}
CLOSING_TACTICS = {
    "norm_num", "simp", "simp_all", "linarith", "nlinarith", "omega", "decide", "ring", "field_simp",
    "positivity", "rfl", "exact", "aesop", "tauto", "trivial", "assumption", "contradiction",
    "simpa", "rwa", "exact_mod_cast", "interval_cases", "bound", "use",
}
COMBINATORS = {"all_goals", "any_goals", "try", "repeat", "focus"}
DEFAULT_AXIOMS = ["propext", "Classical.choice", "Quot.sound"]
SORRY_RE = re.compile(r"(?<![\w'.])(sorry|admit|stop)(?![\w'!?])")
DIRECTIVE_RE = re.compile(
    r"(?<![\w])fake_(hang|crash_once|crash|garbage|noise|slow|leak|axiom|alter_type|sorry_warning|trap)"
    r"(?:[ \t]+([^\s]+))?")
CMD_START = re.compile(
    r"(theorem|lemma|example|def|abbrev|instance|axiom|constant|open|set_option|namespace|end|section|"
    r"noncomputable|universe|variable|include|omit|macro|macro_rules|syntax|notation|local|scoped|"
    r"attribute|@\[|#\w+|private|protected|elab|import|infix|infixl|infixr|prefix|postfix|structure|"
    r"inductive|class|opaque|mutual|unsafe|partial|run_cmd)(?![\w'])")
PAIRS = {"(": ")", "[": "]", "{": "}", "⟨": "⟩", "⦃": "⦄"}

_LEAKS = []   # memory kept on purpose (--leak-mb / fake_leak)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/-.*?-/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    return re.sub(r"--[^\n]*", lambda m: " " * len(m.group(0)), text)


def _balanced(text: str) -> int:
    """-1 if brackets balance, else the index of the first offending character."""
    stack = []
    closing = {v: k for k, v in PAIRS.items()}
    in_str = False
    for i, c in enumerate(text):
        if c == '"':
            in_str = not in_str
        if in_str:
            continue
        if c in PAIRS:
            stack.append((c, i))
        elif c in closing:
            if not stack or stack[-1][0] != closing[c]:
                return i
            stack.pop()
    return stack[0][1] if stack else -1


def _find_top(text: str, token: str) -> int:
    depth = 0
    for i, c in enumerate(text):
        if c in PAIRS:
            depth += 1
        elif c in PAIRS.values():
            depth -= 1
        elif depth == 0 and text.startswith(token, i):
            return i
    return -1


def _norm(text: str) -> str:
    return " ".join(text.split())


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
                elif s[j] in PAIRS.values():
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            inner = s[i + 1:j]
            k = _find_top(inner, ":")
            if k >= 0:
                hyps.append(f"{_norm(inner[:k])} : {_norm(inner[k + 1:])}")
            else:
                hyps.append(f"inst✝ : {_norm(inner)}")
            i = j + 1
            continue
        if c == ":":
            return "\n".join(hyps + ["⊢ " + _norm(s[i + 1:])])
        break
    return "\n".join(hyps + ["⊢ " + _norm(s[i:])])


def _split_goal(goal: str) -> tuple:
    k = goal.rfind("⊢ ")
    return goal[:k], goal[k + 2:]


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
        rest = piece[m.end():].strip()
        if w in COMBINATORS and rest:
            piece = rest
            continue
        return w.rstrip("?!") if w.endswith("?") else w


def _unit_hash(*parts: str) -> float:
    h = hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()
    return int(h[:16], 16) / 2**64


class FakeLean:
    """The REPL's state and rules, usable in-process (the Kimina stand-in does)."""

    def __init__(self, accept: str = "known", proof_status: bool = True, stats: str | None = None,
                 state_dir: str | None = None, import_delay: float = 0.0):
        self.accept = accept
        if accept.startswith("hash:"):
            self.p = float(accept.split(":", 1)[1])
        elif accept not in ("known", "all", "none"):
            raise ValueError(f"bad --accept {accept!r}")
        self.proof_status = proof_status
        self.stats = stats
        self.state_dir = state_dir
        self.import_delay = import_delay
        self.envs: list = []       # {"parent": id|None, "decls": {name: info}, "axioms": set}
        self.states: list = []     # {"goals": [...], "sorry": bool}
        self.log("start")

    # ------------------------------------------------------------ bookkeeping
    def log(self, *words):
        if self.stats:
            with open(self.stats, "a", encoding="utf-8") as f:
                f.write(" ".join([words[0], str(os.getpid()), *map(str, words[1:])]) + "\n")

    def lookup(self, env: int, name: str):
        while env is not None:
            e = self.envs[env]
            if name in e["decls"]:
                return e["decls"][name]
            env = e["parent"]
        return None

    def env_axioms(self, env):
        out = set()
        while env is not None:
            out |= self.envs[env]["axioms"]
            env = self.envs[env]["parent"]
        return out

    def new_env(self, parent, decls, axioms) -> int:
        self.envs.append({"parent": parent, "decls": decls, "axioms": axioms})
        return len(self.envs) - 1

    def new_state(self, goals, sorry=False) -> int:
        self.states.append({"goals": list(goals), "sorry": sorry})
        return len(self.states) - 1

    # ------------------------------------------------------------ requests
    def handle(self, req: dict) -> tuple:
        """Returns (reply, directives found in the request's text)."""
        if "tactic" in req and "proofState" in req:
            self.log("tactic")
            return self.run_tactic(req["proofState"], str(req["tactic"]))
        if "pickleTo" in req:
            env = req.get("env")
            if not isinstance(env, int) or env >= len(self.envs):
                return {"message": "Unknown environment."}, []
            decls, env_i = {}, env
            while env_i is not None:
                decls = {**self.envs[env_i]["decls"], **decls}
                env_i = self.envs[env_i]["parent"]
            with open(req["pickleTo"], "w", encoding="utf-8") as f:
                json.dump({"decls": decls, "axioms": sorted(self.env_axioms(env))}, f)
            return {"env": env}, []
        if "unpickleEnvFrom" in req:
            with open(req["unpickleEnvFrom"], encoding="utf-8") as f:
                d = json.load(f)
            return {"env": self.new_env(None, d["decls"], set(d["axioms"]))}, []
        if "cmd" in req:
            self.log("cmd")
            env = req.get("env")
            if env is not None and (not isinstance(env, int) or env >= len(self.envs) or env < 0):
                return {"message": "Unknown environment."}, []
            return self.run_command(str(req["cmd"]), env)
        return {"message": "Could not parse as a valid JSON command"}, []

    def run_command(self, text: str, env) -> tuple:
        directives = DIRECTIVE_RE.findall(text)
        code = _strip_comments(text)
        lines = code.split("\n")
        messages, sorries = [], []
        start = 0
        if env is None:   # imports only here
            n_imports = 0
            while start < len(lines) and (not lines[start].strip() or lines[start].startswith("import ")):
                if lines[start].startswith("import "):
                    mod = lines[start].split()[1] if len(lines[start].split()) > 1 else ""
                    if not re.fullmatch(r"[A-Za-z][\w.]*", mod) or "NoSuch" in mod:
                        messages.append(self.msg("error", start + 1, 0, f"unknown module prefix '{mod}'"))
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
            self.run_one(cmd, cmd_line, new, messages, sorries, directives)
        reply = {"env": new}
        if messages:
            reply["messages"] = messages
        if sorries:
            reply["sorries"] = sorries
        return reply, directives

    @staticmethod
    def msg(sev, line, col, data, end=None):
        m = {"severity": sev, "pos": {"line": line, "column": col}, "data": data}
        if end:
            m["endPos"] = {"line": end[0], "column": end[1]}
        return m

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
                    messages.append(self.msg("error", i + 1, 0, "unexpected identifier; expected command"))
                    cur_line = i + 1
                cur.append(ln)
            elif cur:
                cur.append(ln)
        if cur:
            yield cur_line, "\n".join(cur)

    def run_one(self, cmd: str, line: int, env: int, messages, sorries, directives):
        cmd = re.sub(r"^(?:\s*(?:set_option\s+\S+\s+\S+|open\s+[^\n]*?)\s+in(?=\s))+\s*", "", cmd)
        cmd = re.sub(r"^(?:@\[[^\]]*\]\s*|(?:private|protected|noncomputable|unsafe|partial)\s+)+", "", cmd)
        first = cmd.split(None, 1)[0] if cmd.split() else ""
        if first in ("theorem", "lemma", "example"):
            return self.declaration(cmd, line, env, messages, sorries, directives)
        if first in ("def", "abbrev", "opaque"):
            m = re.match(r"\w+\s+(\S+?)(?=[\s(\[{:⦃]|$)", cmd)
            if m:
                if _find_top(cmd, ":=") < 0 and first != "opaque":
                    messages.append(self.msg("error", line, 0, "unexpected end of input; expected ':='"))
                self.envs[env]["decls"][m.group(1)] = {"type": _norm(cmd), "axioms": []}
            return
        if first in ("axiom", "constant"):
            m = re.match(r"\w+\s+(\S+?)(?=[\s(\[{:⦃]|$)", cmd)
            if m:
                self.envs[env]["axioms"].add(m.group(1))
                self.envs[env]["decls"][m.group(1)] = {"type": _norm(cmd), "axioms": [m.group(1)]}
            return
        if first == "import":
            messages.append(self.msg("error", line, 0, "invalid 'import' command, it must be used in the "
                                                        "beginning of the file"))
            return
        if first == "#check":
            m = re.match(r"#check\s+@?(\S+)", cmd)
            info = self.lookup(env, m.group(1)) if m else None
            if info is None:
                messages.append(self.msg("error", line, 7, f"unknown identifier '{m.group(1) if m else ''}'"))
            else:
                messages.append(self.msg("info", line, 0, f"@{m.group(1)} : {info['type']}"))
            return
        if first == "#print":
            m = re.match(r"#print\s+axioms\s+(\S+)", cmd)
            info = self.lookup(env, m.group(1)) if m else None
            if info is None:
                messages.append(self.msg("error", line, 0, f"unknown constant '{m.group(1) if m else ''}'"))
            elif info["axioms"]:
                messages.append(self.msg("info", line, 0, f"'{m.group(1)}' depends on axioms: "
                                                          f"[{', '.join(info['axioms'])}]"))
            else:
                messages.append(self.msg("info", line, 0, f"'{m.group(1)}' does not depend on any axioms"))
            return
        if first == "#eval":
            messages.append(self.msg("info", line, 0, "fake: #eval output"))
            return
        # open, set_option, namespace, section, end, notation, macro, instance, ... : accepted silently

    def declaration(self, cmd, line, env, messages, sorries, directives):
        m = re.match(r"(theorem|lemma)\s+(\S+?)(?=[\s(\[{:⦃])", cmd)
        if m:
            name, rest = m.group(2), cmd[m.end():]
        else:
            name, rest = None, cmd[len("example"):]
        k = _find_top(rest, ":=")
        if k < 0:
            messages.append(self.msg("error", line + cmd.count("\n"), 0, "unexpected end of input; expected ':='"))
            return
        sig, body = rest[:k], rest[k + 2:]
        bad = _balanced(sig + " := " + body) if self.accept in ("known", "none") else -1
        if bad >= 0:
            messages.append(self.msg("error", line, 0, "unexpected token; unbalanced brackets"))
            return
        goal = goal_from_signature(sig)
        if name and self.lookup(env, name) is not None:
            messages.append(self.msg("error", line, 8, f"'{name}' has already been declared"))
            return
        used_sorry = bool(SORRY_RE.search(body) or SORRY_RE.search(sig))
        ok, err = self.accept_body(sig, body)
        axioms = list(DEFAULT_AXIOMS)
        if "native_decide" in body:
            axioms.append("Lean.ofReduceBool")
        for ax in sorted(self.env_axioms(env)):
            if re.search(r"(?<![\w'.])" + re.escape(ax) + r"(?![\w'])", body):
                axioms.append(ax)
        for kind, arg in directives:
            if kind == "axiom" and arg:
                axioms.append(arg)
            if kind == "sorry_warning":
                messages.append(self.msg("warning", line, 8, "declaration uses 'sorry'"))
        if used_sorry:
            sm = SORRY_RE.search(body)
            off = cmd.find(body) + (sm.start() if sm else 0)
            s_line = line + cmd[:off].count("\n")
            s_col = off - (cmd.rfind("\n", 0, off) + 1)
            messages.append(self.msg("warning", line, 8 if name else 0, "declaration uses 'sorry'"))
            sorries.append({"goal": goal, "proofState": self.new_state([goal]),
                            "pos": {"line": s_line, "column": s_col},
                            "endPos": {"line": s_line, "column": s_col + 5}})
            axioms.append("sorryAx")
        elif not ok:
            messages.append(self.msg("error", line + cmd.count("\n"), 0, err))
            axioms.append("sorryAx")
        if name:
            typ = _norm(sig)
            if any(kind == "alter_type" for kind, _ in directives):
                typ += " ∧ True"
            self.envs[env]["decls"][name] = {"type": typ, "axioms": axioms}

    def accept_body(self, sig: str, body: str) -> tuple:
        text = body.strip()
        is_tactic = text.startswith("by") and (len(text) == 2 or not (text[2].isalnum() or text[2] == "_"))
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
            if _unit_hash(_norm(sig), key) < self.p:
                return True, ""
            return False, "linarith failed to find a contradiction"
        if not is_tactic:
            return True, ""
        heads = [head_word(p) for p in pieces]
        for h in heads:
            if h not in KNOWN_TACTICS:
                return False, f"unknown tactic '{h}'"
        if heads[-1] not in CLOSING_TACTICS:
            return False, "unsolved goals\n" + goal_from_signature(sig)
        return True, ""

    # ------------------------------------------------------------ tactic mode
    def run_tactic(self, sid, tactic: str) -> tuple:
        directives = DIRECTIVE_RE.findall(tactic)
        if not isinstance(sid, int) or not 0 <= sid < len(self.states):
            return {"message": "Unknown proof state."}, directives
        st = self.states[sid]
        goals = list(st["goals"])
        code = _strip_comments(tactic)
        pieces = tactic_pieces(code)
        if not goals:
            return {"message": "Lean error:\nno goals to be proved"}, directives
        bad = _balanced(code) if self.accept in ("known", "none") else -1
        if bad >= 0:
            return {"message": f"Lean error:\n<input>:1:{bad}: unexpected token"}, directives
        if not pieces and not any(k == "trap" for k, _ in directives):
            return {"message": "Lean error:\n<input>:1:0: expected tactic"}, directives
        messages, sorry = [], st["sorry"]
        if any(k == "trap" for k, _ in directives):
            new = self.new_state([], sorry=True)
            messages.append(self.msg("error", 1, 0, "unsolved goals\n" + goals[0]))
            return self.step_reply(new, [], messages, sorry=True), directives
        if SORRY_RE.search(code):
            goals, sorry = goals[1:], True
        elif self.accept == "none":
            return {"message": "Lean error:\nfake: rejected (--accept none)"}, directives
        elif self.accept == "all":
            goals = goals[1:]
        elif self.accept.startswith("hash:"):
            u = _unit_hash("\n\n".join(goals), _norm(" ".join(pieces)))
            if u < self.p:
                goals = goals[1:]
            elif u < self.p + (1 - self.p) / 3:
                return {"message": "Lean error:\nlinarith failed to find a contradiction"}, directives
            elif u < self.p + 2 * (1 - self.p) / 3:
                new = self.new_state(goals, sorry)
                messages.append(self.msg("error", 1, 0, "simp made no progress"))
                return self.step_reply(new, goals, messages, sorry), directives
            else:
                hyps, target = _split_goal(goals[0])
                goals[0] = f"{hyps}h{int(u * 1e6)} : True\n⊢ {target}"
        else:
            heads = [head_word(p) for p in pieces]
            for h in heads:
                if h not in KNOWN_TACTICS:
                    return {"message": f"Lean error:\n<input>:1:0: unknown tactic '{h}'"}, directives
            last, args = heads[-1], pieces[-1].split()[1:]
            hyps, target = _split_goal(goals[0])
            if last in CLOSING_TACTICS:
                goals = goals[1:]
            elif last == "constructor" and (_find_top(target, " ∧ ") >= 0 or _find_top(target, " ↔ ") >= 0):
                k = _find_top(target, " ∧ ")
                if k >= 0:
                    parts = [target[:k], target[k + 3:]]
                else:
                    k = _find_top(target, " ↔ ")
                    a, b = target[:k], target[k + 3:]
                    parts = [f"{a} → {b}", f"{b} → {a}"]
                goals = [f"{hyps}⊢ {p.strip()}" for p in parts] + goals[1:]
            elif last in ("intro", "intros") and _find_top(target, " → ") >= 0:
                k = _find_top(target, " → ")
                hname = args[0] if args else "a✝"
                goals[0] = f"{hyps}{hname} : {target[:k].strip()}\n⊢ {target[k + 3:].strip()}"
            else:
                goals[0] = f"{hyps}⊢ {target}"
        new = self.new_state(goals, sorry)
        return self.step_reply(new, goals, messages, sorry), directives

    def step_reply(self, new, goals, messages, sorry):
        reply = {"proofState": new, "goals": goals}
        if messages:
            reply["messages"] = messages
        if self.proof_status:
            if goals:
                reply["proofStatus"] = "Incomplete: open goals remain"
            elif sorry:
                reply["proofStatus"] = "Incomplete: contains sorry"
            else:
                reply["proofStatus"] = "Completed"
        return reply


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accept", default="known", help="known | all | none | hash:P")
    ap.add_argument("--no-proof-status", action="store_true")
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
    lean = FakeLean(a.accept, not a.no_proof_status, a.stats, a.state_dir, a.import_delay)
    if a.base_mb:
        _LEAKS.append(b"\x01" * int(a.base_mb * 2**20))
    n = 0
    buf = []
    while True:
        line = sys.stdin.readline()
        if line == "":
            return
        if line.strip():
            buf.append(line)
            continue
        if not buf:
            continue
        text, buf = "".join(buf), []
        if text.lstrip().startswith(("#", "--")):
            continue
        try:
            req = json.loads(text)
        except ValueError as e:   # the real REPL dies on bad JSON
            sys.stderr.write(f"Could not parse JSON: {e}\n")
            sys.exit(1)
        n += 1
        is_header = isinstance(req, dict) and "cmd" in req and "env" not in req
        reply, directives = lean.handle(req)
        kinds = {k: arg for k, arg in directives}
        if a.crash_after and n >= a.crash_after:
            sys.stderr.write("fake: crash (--crash-after)\n")
            os._exit(3)
        if "crash_once" in kinds:
            marker = os.path.join(a.state_dir or "", "crash_once_" + re.sub(r"\W", "_", kinds["crash_once"] or "x"))
            if not a.state_dir or not os.path.exists(marker):
                if a.state_dir:
                    open(marker, "w").close()
                os._exit(4)
        if "crash" in kinds:
            sys.stderr.write("fake: crash (fake_crash)\n")
            os._exit(5)
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


if __name__ == "__main__":
    main()
