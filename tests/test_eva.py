"""Tests of eva.py: every informativeness metric, sampler and loss against values worked out by hand; the mutation chain
and its filter on scripted replies; malformed creator output (policy or endpoint) as dropped prompts with a reason in
the run directory; a learning test of the update; and (marked slow) end-to-end runs with the tiny model: two rounds,
the ablation flags, and the embedded model once. Two ranks against one and resume after a kill are test_family's, on
the same reference run (conftest.py)."""

import collections
import http.server
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import threading
import time
import types
import typing
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import tyro

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from conftest import official_args  # noqa: E402

import eva  # noqa: E402

CPU = eva.Dist(0, 1, 1, torch.device("cpu"), True)
SIG1 = math.log1p(math.exp(-1.0))  # -log sigmoid(1) = 0.313262


def args(**kw):  # as main() sees them: the loss's official values for the flags left unset
    return eva.resolve(official_args(eva)(**kw))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- informativeness and sampling (Tables 2-4) ----
def subset(values, weights, rng, **flags):
    """The informative subset sample_informative draws with these flags (--sampling, --evolve-fraction, ...)."""
    return eva.sample_informative(values, weights, rng, args(**flags))


def test_informativeness_metrics_by_hand():
    r = [1.0, 3.0, 2.0, 6.0, 4.0, 2.0]  # max 6, min 1, mean 3, second best 4, E[r^2] = 70/6
    expected = {
        "a_min": 5.0,
        "a_avg": 3.0,
        "a_dts": 2.0,
        "var": 70 / 6 - 9,
        "avg": 3.0,
        "inv_avg": -3.0,  # the negated value: the official 1 - normalised weight (sampling_weights)
        "inv_a_min": -5.0,
        "uniform": 1.0,
    }
    for metric, value in expected.items():
        assert eva.informativeness(r, args(info_metric=metric)) == pytest.approx(value), metric
    # a tie at the top: no dueling advantage
    assert eva.informativeness([2.0, 2.0, 1.0], args(info_metric="a_dts")) == 0.0


@pytest.mark.parametrize(
    "rewards, expected",
    [
        # one response: no gap, no second best, no variance; the mean is the reward
        ([4.0], {"a_min": 0, "a_avg": 0, "a_dts": 0, "var": 0, "avg": 4, "inv_avg": -4}),
        # all rewards equal: every gap and the variance 0
        ([2.0, 2.0, 2.0], {"a_min": 0, "a_avg": 0, "a_dts": 0, "var": 0, "avg": 2, "inv_a_min": 0}),
        # no responses: 0 for every row (a run's groups are all empty or none is)
        ([], {"a_min": 0, "a_avg": 0, "a_dts": 0, "var": 0, "avg": 0, "uniform": 0}),
    ],
)
def test_informativeness_edges(rewards, expected):
    for metric, value in expected.items():
        a = args(info_metric=metric)
        assert eva.informativeness(rewards, a) == pytest.approx(value), metric


def test_sampling_weights_by_hand():
    # min-max [0, 0.5, 1] / 1.5; the least informative prompt gets weight 0
    assert eva.sampling_weights([1.0, 3.0, 5.0]) == pytest.approx([0.0, 1 / 3, 2 / 3])
    # inv_*: the negated values [-1, -3, -5] give the official 1 - normalised, [1, 0.5, 0] / 1.5
    inv_avg = args(info_metric="inv_avg")
    inverted = [eva.informativeness([v], inv_avg) for v in (1.0, 3.0, 5.0)]
    assert eva.sampling_weights(inverted) == pytest.approx([2 / 3, 1 / 3, 0.0])
    # uniform: every value 1
    assert eva.sampling_weights([1.0] * 3) == pytest.approx([1 / 3] * 3)
    # all equal (official code: 0 / 0), one prompt, none
    assert eva.sampling_weights([2.0, 2.0]) == pytest.approx([0.5, 0.5])
    assert eva.sampling_weights([-7.0]).tolist() == [1.0]
    assert eva.sampling_weights([]).tolist() == []


def test_greedy_takes_the_highest_weights():
    w = np.array([0.1, 0.4, 0.2, 0.3])
    greedy = dict(sampling="greedy", evolve_fraction=0.5)
    assert subset([0, 0, 0, 0], w, np.random.default_rng(0), **greedy) == [1, 3]
    greedy["evolve_fraction"] = 0.25
    assert subset([0, 0, 0, 0], w, np.random.default_rng(0), **greedy) == [1]
    # equal weights: the lower index first
    tied = np.array([0.2, 0.4, 0.4, 0.0])
    assert subset([0] * 4, tied, np.random.default_rng(0), **greedy) == [1]
    # no prompts: none, whatever the method
    for method in eva.SAMPLINGS:
        assert subset([], np.zeros(0), np.random.default_rng(0), sampling=method) == []


def test_weighted_sampling_without_replacement_by_hand():
    """Two of four by successive draws with weights (0.5, 0.3, 0.2, 0): P(2 is drawn) = 1 - (0.5 * 0.3/0.5 +
    0.3 * 0.5/0.7) = 0.485714; P(0 is drawn) = 1 - (0.3 * 0.2/0.7 + 0.2 * 0.3/0.8) = 0.839286; never 3."""
    w, rng, counts = np.array([0.5, 0.3, 0.2, 0.0]), np.random.default_rng(0), np.zeros(4)
    for _ in range(4000):
        chosen = subset([0] * 4, w, rng, sampling="weighted", evolve_fraction=0.5)
        assert len(chosen) == 2 == len(set(chosen))
        counts[chosen] += 1
    assert counts[3] == 0
    assert counts / 4000 == pytest.approx(
        [0.839286, 2 - 0.839286 - 0.485714, 0.485714, 0.0], abs=0.03
    )
    # fewer positive weights than places: the rest is filled uniformly from the others
    chosen = subset(
        [0] * 4, np.array([1.0, 0, 0, 0]), rng, sampling="weighted", evolve_fraction=0.5
    )
    assert 0 in chosen and len(set(chosen)) == 2
    # int(0.9) = 0 places
    assert subset([0] * 3, np.zeros(3), rng, sampling="weighted", evolve_fraction=0.3) == []


def test_stratified_sampling_matches_qcut_bins():
    pd = pytest.importorskip("pandas")
    # 10 quantile bins of two prompts each: round(0.5 * 2) = 1 per bin
    values = [float(v) for v in range(20)]
    stratified = dict(sampling="stratified", evolve_fraction=0.5, stratified_bins=10)
    chosen = subset(values, np.full(20, 0.05), np.random.default_rng(0), **stratified)
    assert sorted(c // 2 for c in chosen) == list(range(10))
    codes = pd.qcut(pd.Series(values), q=10, duplicates="drop").cat.codes.tolist()
    assert codes == [i // 2 for i in range(20)]  # the bins this file computes are pandas' bins
    # duplicate edges dropped: edges 0, 1.3, 2.2, 3.1, 4 make bins of 6, 1, 1, 1, 1 prompts; round(0.5 * 6) = 3 from
    # the first (all weights 0: uniformly), round(0.5 * 1) = 0 (Python's and pandas' rounding) from the others
    values = [0.0] * 6 + [1.0, 2.0, 3.0, 4.0]
    codes = pd.qcut(pd.Series(values), q=10, duplicates="drop").cat.codes.tolist()
    assert codes == [0] * 6 + [1, 2, 3, 4]
    w = np.array([0.0] * 6 + [0.1, 0.2, 0.3, 0.4])
    chosen = subset(values, w, np.random.default_rng(1), **stratified)
    assert len(chosen) == 3 and all(c < 6 for c in chosen)


def test_a_draw_of_no_prompt_is_said(monkeypatch, capsys):
    """stratified takes round(f x bin size) per bin: 8 prompts in 10 quantile bins (one or none each) at f = 0.25 draw
    round(0.25) = 0 from every bin, no prompt; sample_subset says so (rank 0) instead of evolving nothing silently.
    weighted takes int(0.25 x 8) = 2 of the same prompts and says nothing."""
    monkeypatch.delenv("RANK", raising=False)
    info = [0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0]
    stratified = args(sampling="stratified", evolve_fraction=0.25, stratified_bins=10)
    assert eva.sample_subset(info, 0, stratified) == []
    assert "drew none of the 8 prompts" in capsys.readouterr().out
    assert len(eva.sample_subset(info, 0, args(evolve_fraction=0.25))) == 2
    assert eva.sample_subset([], 0, stratified) == []  # no prompts: nothing to say
    monkeypatch.setenv("RANK", "1")
    assert eva.sample_subset(info, 0, stratified) == []
    assert capsys.readouterr().out == ""


def test_win_probability_rloo_and_win_rate_by_hand():
    r = [0.0, math.log(3.0)]  # sigmoid(log 3) = 3/4
    assert eva.win_probability(r, 1) == pytest.approx((0.5 + 0.75) / 2)
    assert eva.win_probability(r, 0) == pytest.approx((0.25 + 0.5) / 2)
    assert [
        eva.rloo_advantage(x, [1.0, 2.0, 3.0, 6.0]) for x in (1.0, 2.0, 3.0, 6.0)
    ] == pytest.approx([1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])
    assert eva.win_rate([1.0, 2.0, 3.0, 0.0], [0.5, 2.0, 4.0, -1.0]) == pytest.approx(
        (1 + 0.5 + 0 + 1) / 4
    )


def test_win_probability_rloo_and_win_rate_edges():
    # one response: itself only, 1/2; no advantage over no other
    assert eva.win_probability([3.0], 0) == 0.5
    assert eva.rloo_advantage(3.0, [3.0]) == 0.0
    # all equal: 1/2 each, advantage 0
    assert eva.win_probability([1.0, 1.0, 1.0], 2) == pytest.approx(0.5)
    assert eva.rloo_advantage(1.0, [1.0, 1.0, 1.0]) == 0.0
    # a reward gap of 2000 (an unbounded classifier's): (1/2 + sigmoid(2000) = 1) / 2, no overflow
    assert eva.win_probability([0.0, 2000.0], 1) == pytest.approx(0.75)
    assert eva.win_probability([0.0, 2000.0], 0) == pytest.approx(0.25)
    # no prompts compared: nan, and no note; two lists of different prompts: an error, not a silent zip
    assert math.isnan(eva.win_rate([], []))
    assert eva.win_rate_note(float("nan"), 0) is None
    with pytest.raises(ValueError):
        eva.win_rate([1.0, 2.0], [1.0])
    evaluated = eva.evaluate([], [])
    assert all(math.isnan(value) for value in evaluated.values())


def rewarded(rewards):
    """A group of one prompt's responses with these rewards."""
    samples = [sample([1], [2]) for _ in rewards]
    return eva.Group("x", samples, list(rewards), list(rewards))


def test_preference_pair_and_group_teaches_by_hand():
    # argmax, argmin; ties: the first index of each
    assert eva.preference_pair(rewarded([1.0, 3.0, 0.0, 3.0, 0.0]), args()) == (1, 2)
    # all equal: the official chosen = rejected, (0, 0)
    assert eva.preference_pair(rewarded([2.0, 2.0]), args()) == (0, 0)
    assert eva.preference_pair(rewarded([5.0]), args()) == (0, 0)
    assert eva.group_teaches(rewarded([1.0, 3.0]), args())
    assert not eva.group_teaches(rewarded([2.0, 2.0]), args())
    assert not eva.group_teaches(rewarded([5.0]), args())
    assert not eva.group_teaches(rewarded([]), args())


def test_example_length_by_hand():
    example = eva.Example(sample(range(3), [7, 8]), 0.5)  # 3 prompt + 2 target tokens
    assert eva.example_length(example) == 5 and example.source is None


# ---- losses (Table 1 and the official scripts) ----
def t(*values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_dpo_ipo_rpo_by_hand():
    h = t(2.0, 0.0)
    loss = eva.dpo_loss(h, 0.5)  # -log sigmoid(1), -log sigmoid(0)
    assert loss.tolist() == pytest.approx([SIG1, math.log(2.0)])
    loss.sum().backward()
    # raises h
    assert h.grad.tolist() == pytest.approx([-0.5 * (1 - 1 / (1 + math.exp(-1))), -0.25])
    assert eva.ipo_loss(t(3.0), 0.25).item() == pytest.approx(1.0)  # (3 - 2)^2
    assert eva.rpo_loss(t(2.0), t(2.0), 0.5, 1.0).item() == pytest.approx(SIG1 + 2.0)


def test_sppo_simpo_orpo_by_hand():
    # ((1 - (0.75 - 0.5) / 0.5)^2 + (-1 - (0.25 - 0.5) / 0.5)^2) / 2 = (0.25 + 0.25) / 2
    assert eva.sppo_loss(t(1.0), t(-1.0), t(0.75), t(0.25), 0.5).item() == pytest.approx(0.25)
    # -log sigmoid(2 * (-1 + 2 - 0.5)) = -log sigmoid(1)
    assert eva.simpo_loss(t(-1.0), t(-2.0), 2.0, 0.5).item() == pytest.approx(SIG1)
    # p_w = 1/2: odds 1; p_l = 1/4: odds 1/3; sigmoid(log 3) = 3/4 -> log 2 - 0.1 log(3/4)
    loss = eva.orpo_loss(t(math.log(0.5)), t(math.log(0.25)), 0.1)
    assert loss.item() == pytest.approx(math.log(2.0) - 0.1 * math.log(0.75))


def test_rloo_loss_by_hand():
    logp, old = t(-1.0, -1.0, -2.0), torch.tensor([-1.0, -1.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64)
    loss = eva.rloo_loss(logp, old, adv, args(loss="rloo", rloo_clip=0.2))
    # rho = 1 -> -2; rho = e^0.5 = 1.6487 clipped to 1.2 for A > 0 -> -1.2; rho = e^-1 = 0.3679, A < 0 -> min(-0.3679
    # * -1, -0.8 * -1)... -min(rho A, clip A) = -min(-0.3679, -0.8) = 0.8
    assert loss.tolist() == pytest.approx([-2.0, -1.2, 0.8], abs=1e-4)
    loss.sum().backward()
    # on-policy: REINFORCE's -A; clipped: no gradient
    assert logp.grad.tolist() == pytest.approx([-2.0, 0.0, 0.0])


def test_item_losses_dispatch():
    pi = torch.tensor([[-2.0, -4.0], [-6.0, -4.0]])  # rows: chosen, rejected; 2 pairs
    ref = torch.tensor([[-3.0, -4.0], [-5.0, -4.0]])
    n = torch.tensor([[2.0, 4.0], [3.0, 2.0]])
    p = torch.tensor([[0.75, 0.5], [0.25, 0.5]])
    h = torch.tensor([2.0, 0.0])  # (-2 + 3) - (-6 + 5), 0
    a = args(beta=0.5)
    assert torch.allclose(eva.item_losses("dpo", pi, ref, n, p, a), eva.dpo_loss(h, 0.5))
    # RPO's NLL: the chosen mean token NLL (-pi / n = 1, 1), officially divided again by its length (2, 4)
    assert torch.allclose(
        eva.item_losses("rpo", pi, ref, n, p, a), eva.dpo_loss(h, 0.5) + torch.tensor([0.5, 0.25])
    )
    assert torch.allclose(
        eva.item_losses("rpo", pi, ref, n, p, args(beta=0.5, rpo_penalize_length_nll=False)),
        eva.dpo_loss(h, 0.5) + torch.tensor([1.0, 1.0]),
    )
    assert torch.allclose(
        eva.item_losses("ipo", pi, ref, n, p, a),
        eva.ipo_loss(torch.tensor([0.5 + 1 / 3, 0.0]), 0.5),
    )
    assert torch.allclose(
        eva.item_losses("sppo", pi, ref, n, p, a),
        eva.sppo_loss(torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0]), p[0], p[1], 0.5),
    )
    assert torch.allclose(
        eva.item_losses("simpo", pi, ref, n, p, a),
        eva.simpo_loss(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0]), 0.5, 0.5),
    )
    assert torch.allclose(
        eva.item_losses("orpo", pi, ref, n, p, a),
        eva.orpo_loss(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0]), 0.5),
    )
    # a rollout's one row: its weight (the advantage) is w; rho = exp(-2 + 3) = e clipped to 1.2 for A = 2 > 0,
    # rho = 1 for A = -1: -(1.2 * 2), -(1 * -1)
    rollout = eva.item_losses(
        "rloo", pi[:1], ref[:1], n[:1], torch.tensor([[2.0, -1.0]]), args(loss="rloo")
    )
    assert rollout.tolist() == pytest.approx([-2.4, 1.0])


def test_lr_at_matches_transformers_schedules():
    # 5 steps, warm-up ceil(0.2 * 5) = 1: step 0 at 0, then decay over the 4 remaining
    assert [eva.lr_at(s, 5, 1.0, 1, "cosine") for s in range(5)] == pytest.approx(
        [0.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    )
    assert [eva.lr_at(s, 5, 1.0, 1, "linear") for s in range(5)] == pytest.approx(
        [0.0, 1.0, 0.75, 0.5, 0.25]
    )
    assert eva.lr_at(0, 3, 1.0, 0, "cosine") == 1.0  # no warm-up
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_cosine_schedule_with_warmup(opt, 2, 9)
    for step in range(9):
        assert opt.param_groups[0]["lr"] == pytest.approx(eva.lr_at(step, 9, 1.0, 2, "cosine"))
        opt.step()
        sched.step()


# ---- the creator: the mutation chain and its filter ----
def test_read_evolution():
    seen, a = {"an old prompt"}, args()
    assert eva.read_evolution(
        "#Rewritten Prompt#: Explain tides step by step.", "stop", "Explain tides.", seen, a
    ) == ("Explain tides step by step.", "")
    # kept, marked
    assert eva.read_evolution("A new one", "length", "p", seen, a) == ("A new one", "truncated")
    assert eva.read_evolution("x", "error", "p", seen, a) == (None, "failed")
    assert eva.read_evolution("x", "abort", "p", seen, a) == (None, "failed")
    assert eva.read_evolution("#New Prompt#:   ", "stop", "p", seen, a) == (None, "empty")
    assert eva.read_evolution("Rewrite the #Given Prompt# as X", "stop", "p", seen, a) == (
        None,
        "marker",
    )
    assert eva.read_evolution("#New Prompt#: a #REWRITTEN PROMPT# leak", "stop", "p", seen, a) == (
        None,
        "marker",
    )
    # only the templates' markers: a prompt may speak of a new or a given prompt in its own words
    for text in (
        "Write a new prompt for a story generator.",
        "Critique the given prompt: 'list three birds'.",
    ):
        assert eva.read_evolution(text, "stop", "p", seen, a) == (text, "")
    assert eva.read_evolution("Explain  TIDES.", "stop", "Explain tides.", seen, a) == (
        None,
        "unchanged",
    )
    assert eva.read_evolution("An old\nprompt", "stop", "p", seen, a) == (None, "duplicate")


class ScriptedSampler:
    """Replies to each mutation prompt by a script: reply(parent, call) -> (text, finish_reason)."""

    batch_size, llm = 8, None  # sample() chunks prompts as for transformers

    def __init__(self, reply):
        self.reply, self.calls, self.params = reply, 0, []

    def generate(self, prompts, n=1, **kw):
        self.params.append(kw)
        out = []
        for p in prompts:
            parent = p.split("#Given Prompt#:\n")[-1].split("\n#")[0]
            text, finish = self.reply(parent, self.calls)
            self.calls += 1
            out.append([eva.Sample(text, [], [], [], finish) for _ in range(n)])
        return out


PLAIN = SimpleNamespace(apply_chat_template=lambda messages, **kw: messages[-1]["content"])


def test_evolve_chains_mutations_and_drops_bad_steps(tmp_path):
    failed_once = set()

    def reply(parent, call):
        # B's second step: empty -> dropped, B stays at "B +"
        if parent == "B +" and parent not in failed_once:
            failed_once.add(parent)
            return "", "stop"
        if parent == "C":
            return "#Rewritten Prompt#: A", "stop"  # a copy of a known prompt
        return f"#Rewritten Prompt#: {parent} +", "stop"

    a = args(num_evolutions=3, seed=7)
    evolved, records = eva.evolve(
        sampler=ScriptedSampler(reply),
        tokenizer=PLAIN,
        seeds=["A", "B", "C"],
        known=["A", "B", "C", "D"],
        iteration=2,
        args=a,
        dist=CPU,
    )
    assert evolved == ["A +", "B +", "A + +", "A + + +", "B + +"]
    assert [(r["seed"], r["evolution"], r["parent"], r["kept"], r["reason"]) for r in records] == [
        (0, 0, "A", True, ""),
        (1, 0, "B", True, ""),
        (2, 0, "C", False, "duplicate"),
        (0, 1, "A +", True, ""),
        (1, 1, "B +", False, "empty"),
        (2, 1, "C", False, "duplicate"),
        (0, 2, "A + +", True, ""),
        (1, 2, "B +", True, ""),
        (2, 2, "C", False, "duplicate"),
    ]
    rng = random.Random("7/2/mutations")  # uniform over the five mutations, drawn in the same order
    assert [r["mutation"] for r in records] == [rng.choice(list(eva.MUTATIONS)) for _ in range(9)]
    assert set(eva.MUTATIONS) == {
        "constraints",
        "deepening",
        "concretizing",
        "reasoning",
        "breadth",
    }
    assert all("<PROMPT>" in m and "Prompt#:" in m for m in eva.MUTATIONS.values())


def test_evolve_with_only_malformed_replies_keeps_nothing():
    replies = iter(
        [("", "stop"), ("junk", "abort"), ("The #Given Prompt#, harder", "stop"), ("Q", "stop")]
    )
    sampler = ScriptedSampler(lambda parent, call: next(replies))
    evolved, records = eva.evolve(
        sampler=sampler,
        tokenizer=PLAIN,
        seeds=["P", "Q"],
        known=["P", "Q"],
        iteration=0,
        args=args(num_evolutions=2),
        dist=CPU,
    )
    assert evolved == [] and not any(r["kept"] for r in records)
    assert [r["reason"] for r in records] == ["empty", "failed", "marker", "unchanged"]


def test_a_reward_term_trains_and_the_win_rate_keeps_the_score(monkeypatch):
    """solver_reward is the training reward of every reader of a Group; the held-out rewards stay the reward
    model's scores. The official reward is the score itself; a fork's term (here -0.5 a token) reaches the pairs."""
    assert eva.solver_reward(2.5, eva.Sample("r", [1], [5, 5], [], "stop"), args()) == 2.5
    monkeypatch.setattr(
        eva, "score_responses", lambda model, prompt, responses, args: [2.0] * len(responses)
    )

    class Lengths(ScriptedSampler):  # the j-th response to a prompt has j + 1 tokens
        def generate(self, prompts, n=1, **kw):
            row = [eva.Sample("r", [1], [5] * (j + 1), [], "stop") for j in range(n)]
            return [row for _ in prompts]

    def shorter(score, sample, args):
        return score - 0.5 * len(sample.token_ids)

    monkeypatch.setattr(eva, "solver_reward", shorter)
    run = dict(sampler=Lengths(None), tokenizer=PLAIN, reward_model=None, args=args(), dist=CPU)
    [group] = eva.solve(**run, prompts=["a"], n=3, key="1/0/solve")
    assert group.rewards == [1.5, 1.0, 0.5] and group.scores == [2.0, 2.0, 2.0]
    assert eva.preference_pair(group, args()) == (0, 2)  # the shortest over the longest
    assert eva.heldout_rewards(**run, heldout=["a"], key="1/0/heldout") == [2.0]


def test_solver_and_creator_ask_the_sampler_for_no_logprobs(monkeypatch):
    """Nothing reads the sampled responses' or evolutions' log-probs (the losses take their own): none are asked for."""
    monkeypatch.setattr(
        eva, "score_responses", lambda model, prompt, responses, args: [0.0] * len(responses)
    )
    sampler = ScriptedSampler(lambda parent, call: (f"#Rewritten Prompt#: {parent} {call}", "stop"))
    groups = eva.solve(
        sampler=sampler,
        tokenizer=PLAIN,
        reward_model=None,
        prompts=["a", "b", "c"],
        n=2,
        key="1/0/solve",
        args=args(),
        dist=CPU,
    )
    assert [len(g.samples) for g in groups] == [2, 2, 2]
    a = args(num_evolutions=2)
    eva.evolve(
        sampler=sampler, tokenizer=PLAIN, seeds=["a"], known=["a"], iteration=0, args=a, dist=CPU
    )
    assert len(sampler.params) == 3 and all(
        kw.get("logprobs", True) is False for kw in sampler.params
    )


class Endpoint:
    """A local OpenAI-compatible chat endpoint replying from a script; records the requests."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, self.headers.get("Authorization"), body))
                if outer.replies:
                    status, payload = outer.replies.pop(0)
                else:  # the script is done: a fresh prompt for every further request
                    status, payload = chat(f"#Rewritten Prompt#: fresh {len(outer.requests)}")
                if isinstance(payload, str):
                    data = payload.encode()
                else:
                    data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()


def chat(content, finish="stop"):
    return 200, {"choices": [{"message": {"content": content}, "finish_reason": finish}]}


def test_endpoint_creator_request_and_failures(monkeypatch):
    monkeypatch.setattr(eva.time, "sleep", lambda s: None)
    monkeypatch.setenv("EVA_TEST_KEY", "sk-test")
    endpoint = Endpoint(
        [
            chat("#Rewritten Prompt#: Harder."),
            (500, "busy"),
            (500, "busy"),
            (500, "busy"),
            (200, "not json"),
            (200, "{}"),
            chat("x"),
        ]
    )
    try:
        a = args(
            evolver_url=endpoint.url,
            evolver_key_env="EVA_TEST_KEY",
            evolve_max_new_tokens=50,
            evolver_workers=1,
        )
        assert eva.ask_endpoint("rewrite this", a) == ("#Rewritten Prompt#: Harder.", "stop")
        path, auth, body = endpoint.requests[0]
        assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
        assert body == {
            "model": "gpt-4-0125-preview",
            "messages": [{"role": "user", "content": "rewrite this"}],
            "temperature": 0.88,
            "max_tokens": 50,
        }
        text, finish = eva.ask_endpoint("again", a)  # three HTTP 500s: given up, never raised
        assert finish == "error" and "HTTPError" in text
        # a reply that is not JSON, then one without choices, then ok
        text, finish = eva.ask_endpoint("again", a)
        assert (text, finish) == ("x", "stop") and len(endpoint.requests) == 7
    finally:
        endpoint.close()


# ---- data ----
def test_builtin_prompts_and_splits():
    rows = [
        json.loads(line) for line in (REPO / "data" / "chat_prompts.jsonl").read_text().splitlines()
    ]
    assert len(rows) >= 250 and len({r["prompt"] for r in rows}) == len(rows)
    assert {r["split"] for r in rows} == {"train", "heldout"} and len(
        {r["task"] for r in rows}
    ) >= 10
    parts, heldout = eva.load_prompts(
        args(dataset=str(REPO / "data" / "chat_prompts.jsonl"), heldout_size=1000)
    )
    train = [r["prompt"] for r in rows if r["split"] == "train"]
    assert (
        len(parts) == 6
        and sum(map(len, parts)) == len(train)
        and sorted(sum(parts, [])) == sorted(train)
    )
    assert [len(p) for p in parts[:5]] == [len(train) // 6] * 5
    assert set(heldout) == {r["prompt"] for r in rows if r["split"] == "heldout"}
    small, held = eva.load_prompts(
        args(dataset=str(REPO / "data" / "chat_prompts.jsonl"), num_prompts=3, heldout_size=2)
    )
    assert [len(p) for p in small] == [3] * 6 and small[0] == parts[0][:3] and len(held) == 2


# the official runs (ZIYU-DEEP/eva at d605e6f: scripts/*/iterate.sh and evolve-1.sh over recipes/*/config_full.yaml;
# SimPO: princeton-nlp/SimPO's training_configs/gemma-2-9b-it-simpo.yaml): beta, learning rate, epochs, optimizer,
# schedule, max_length, max_prompt_length
OFFICIAL_RUNS = {
    # gemma-2-9b-it-dpo, iterative-dpo
    "dpo": (0.05, 5e-7, 2, "adamw", "cosine", 2048, 1024),
    # gemma-2-9b-it-ipo: BETA=0.6, N_EPOCHS=1
    "ipo": (0.6, 5e-7, 1, "adamw", "cosine", 2048, 1024),
    # rpo-split-by-6: BETA="0.1", N_EPOCHS=2
    "rpo": (0.1, 5e-7, 2, "adamw", "cosine", 2048, 1024),
    # gemma-9b: N_EPOCHS=9; recipes/default
    "sppo": (0.001, 5e-7, 9, "rmsprop", "linear", 1024, 512),
    "simpo": (10.0, 8e-7, 1, "adamw", "cosine", 2048, 1800),  # SimPO's recipe
    # ORPO's lambda; the rest DPO's
    "orpo": (0.1, 5e-7, 2, "adamw", "cosine", 2048, 1024),
    # TRL's RLOO learning rate, one pass
    "rloo": (None, 1e-6, 1, "adamw", "cosine", 2048, 1024),
}
RESOLVED = (
    "beta",
    "learning_rate",
    "epochs",
    "optim",
    "lr_schedule",
    "max_length",
    "max_prompt_length",
)


@pytest.mark.parametrize("loss", list(OFFICIAL_RUNS))
def test_each_loss_resolves_to_its_official_run(loss, tmp_path):
    official = dict(zip(RESOLVED, OFFICIAL_RUNS[loss]))
    a = eva.resolve(
        tyro.cli(official_args(eva), args=["--loss", loss, "--output-dir", str(tmp_path)])
    )
    assert {k: getattr(a, k) for k in RESOLVED} == official
    given = eva.resolve(
        tyro.cli(
            official_args(eva),
            args=["--loss", loss, "--beta", "0.3", "--epochs", "5", "--optim", "adamw"],
        )
    )
    # a passed flag keeps its value
    assert (given.beta, given.epochs, given.optim) == (0.3, 5, "adamw")
    # the docstring table
    row = next(line.split() for line in eva.__doc__.splitlines() if line.split()[:1] == [loss])
    assert [
        None if row[1] == "-" else float(row[1]),
        float(row[2]),
        int(row[3]),
        *row[4:6],
        int(row[6]),
        int(row[7]),
    ] == list(OFFICIAL_RUNS[loss])
    # without CUDA the CPU sizes are the defaults: resolve leaves them
    a = eva.resolve(tyro.cli(eva.Args, args=["--loss", loss, "--output-dir", str(tmp_path)]))
    assert (
        a.learning_rate == eva.CPU_DEFAULTS["learning_rate"]
        and a.max_length == eva.CPU_DEFAULTS["max_length"]
    )
    assert {
        k: getattr(a, k) for k in ("beta", "epochs", "optim", "lr_schedule")
    }.items() <= official.items()


# ---- safe to fork: a value added to a Literal flag works, or the run stops at start saying what to add ----
def literal_values(flag: str) -> tuple:
    """The values Args' Literal flag lists (without the None of `Literal[...] | None`)."""
    hint = typing.get_type_hints(eva.Args)[flag]
    if typing.get_origin(hint) is not typing.Literal:
        [hint] = [part for part in typing.get_args(hint) if part is not type(None)]
    return typing.get_args(hint)


@pytest.mark.parametrize(
    "flag", ["loss", "info_metric", "sampling", "reward_kind", "optim", "lr_schedule"]
)
def test_every_literal_value_passes_the_start_checks(flag):
    """Each value a Literal lists has its entries: its line in the function that dispatches on it (check_choices
    runs them all, reward_rule included), its optimizer (new_optimizer), its schedule (lr_at)."""
    values = literal_values(flag)
    assert len(values) >= 2
    for value in values:
        a = args(**{flag: value})
        eva.check_choices(a)
        eva.new_optimizer(torch.nn.Linear(2, 1), a)
        eva.lr_at(step=0, total=1, peak=1.0, schedule=a.lr_schedule)


@pytest.mark.parametrize(
    "flag, value, where",
    [
        ("loss", "hinge_in_test", "add its line to item_losses"),
        ("info_metric", "entropy_in_test", "add its entry to INFO_METRICS"),
        ("sampling", "top_half_in_test", "add its entry to SAMPLINGS"),
        ("reward_kind", "pairwise_in_test", "add its entry to REWARD_KINDS"),
    ],
)
def test_a_value_added_to_a_literal_alone_stops_at_start(tmp_path, flag, value, where):
    """A fork that adds a value to a Literal but not its entry (its line in item_losses) stops in main's first lines,
    before the run directory exists, with a message that names what to add (not a KeyError rounds later)."""
    a = eva.Args(**{flag: value}, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} {value}: {where}"):
        eva.main(a)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="--optim sgd: new_optimizer"):
        eva.new_optimizer(torch.nn.Linear(2, 1), args(optim="sgd"))
    with pytest.raises(ValueError, match="--reward-kind pairwise: add its entry to REWARD_KINDS"):
        # before loading anything
        eva.load_reward_model(args(reward_kind="pairwise", reward_model="unused"), CPU)


@pytest.mark.parametrize(
    "flag, value", [("evolve_fraction", 1.5), ("old_pair_ratio", -0.1), ("new_pair_ratio", 2.0)]
)
def test_a_share_outside_0_1_stops_at_start(tmp_path, flag, value):
    """A share of a set (a fraction, a mix ratio) outside [0, 1] stops in main's first lines, before the run
    directory exists; the edges 0 and 1 pass."""
    a = eva.Args(**{flag: value}, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} {value}: a share"):
        eva.main(a)
    assert list(tmp_path.iterdir()) == []
    for edge in (0.0, 1.0):
        eva.check_choices(args(**{flag: edge}))


HINGE_LOSS = '''

def hinge_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC's hinge: max(0, 1 - beta h)."""
    return torch.relu(1 - beta * h)
'''


def test_a_loss_added_with_its_function_and_line_trains(monkeypatch, capsys):
    """The fork a reader writes: the name in --loss's Literal, the loss function, its line in item_losses. It parses,
    resolves (OFFICIAL has no row for it: DPO's values, no KeyError, and resolve says which), passes the start checks
    and computes its loss."""
    source = (REPO / "eva.py").read_text()
    # --loss's Literal, whatever values a fork has added to it (on one line or several): "hinge" goes first
    edits = [
        ("\n    loss: Literal[", '\n    loss: Literal["hinge", '),
        ("\n\ndef item_losses(", HINGE_LOSS + "\n\ndef item_losses("),
        (
            '    if loss == "dpo":\n',
            '    if loss == "hinge":\n        return hinge_loss(h, args.beta)\n'
            '    if loss == "dpo":\n',
        ),
    ]
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    fork = types.ModuleType("eva_hinge")
    fork.__file__ = str(REPO / "eva_hinge.py")
    monkeypatch.setitem(sys.modules, "eva_hinge", fork)
    exec(compile(source, fork.__file__, "exec"), fork.__dict__)
    a = fork.resolve(tyro.cli(official_args(fork), args=["--loss", "hinge", "--epochs", "3"]))
    resolved = (a.beta, a.learning_rate, a.epochs, a.optim, a.lr_schedule)
    assert resolved == (0.05, 5e-7, 3, "adamw", "cosine")  # DPO's row, --epochs as given
    # not silently: the values it took from DPO's row, and only those
    printed = capsys.readouterr().out
    assert "--loss hinge has no row in OFFICIAL" in printed
    assert "--beta 0.05" in printed and "--learning-rate 5e-07" in printed
    assert "--epochs" not in printed
    fork.check_choices(a)
    pi = torch.tensor([[-2.0, -4.0], [-6.0, -4.0]])  # h = (-2 + 3) - (-6 + 5) = 2, then 0
    ref = torch.tensor([[-3.0, -4.0], [-5.0, -4.0]])
    losses = fork.item_losses("hinge", pi, ref, torch.ones(2, 2), torch.full((2, 2), 0.5), a)
    assert losses.tolist() == pytest.approx([1 - 0.05 * 2, 1.0])


# the losses of the file with an official row (a fork's loss in --loss's Literal may have none: it borrows DPO's)
OFFICIAL_LOSSES = ["dpo", "ipo", "rpo", "sppo", "simpo", "orpo", "rloo"]


def test_resolve_names_what_a_loss_without_a_row_takes_from_dpo(monkeypatch, capsys):
    """A loss with its own row in OFFICIAL (each of the file's) borrows nothing and resolve prints nothing; one without
    borrows DPO's value of each flag left unset, printed once, on torchrun's rank 0 only."""
    for loss in OFFICIAL_LOSSES:
        assert eva.borrowed_from_dpo(official_args(eva)(loss=loss)) == {}
        eva.resolve(official_args(eva)(loss=loss))
    assert capsys.readouterr().out == ""
    monkeypatch.delitem(eva.OFFICIAL, "ipo")  # ipo as a fork's loss without a row
    unset = official_args(eva)(loss="ipo", beta=0.3)
    borrowed = eva.borrowed_from_dpo(unset)
    assert borrowed == {k: v for k, v in eva.OFFICIAL["dpo"].items() if k != "beta"}
    monkeypatch.setenv("RANK", "1")
    eva.resolve(official_args(eva)(loss="ipo"))
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    a = eva.resolve(unset)
    assert (a.beta, a.epochs, a.max_length) == (0.3, 2, 2048)
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("eva.py: --loss ipo has no row in OFFICIAL") and "--beta" not in line


def test_a_row_added_to_a_table_is_dispatched(monkeypatch):
    """A fork's informativeness metric, subset draw or reward kind is its function and its entry: the dispatch reads
    the entry (and check_choices passes it), and the entry reads its own parameters from args (here --evolve-fraction,
    as a new flag would be), passed by nothing else."""

    def top_reward(r, args):
        return r[-1]

    def last_ones(values, weights, rng, args):  # the last ceil(f P) prompts
        k = math.ceil(args.evolve_fraction * len(weights))
        return list(range(len(weights) - k, len(weights)))

    monkeypatch.setitem(eva.INFO_METRICS, "top", top_reward)
    monkeypatch.setitem(eva.SAMPLINGS, "last", last_ones)
    kind = eva.RewardKind(eva.load_judge, eva.judge_scores)
    monkeypatch.setitem(eva.REWARD_KINDS, "judge2", kind)
    assert eva.informativeness([3.0, 1.0, 2.0], args(info_metric="top")) == 3.0
    assert subset([0] * 3, np.ones(3) / 3, None, sampling="last", evolve_fraction=0.5) == [1, 2]
    assert subset([0] * 3, np.ones(3) / 3, None, sampling="last", evolve_fraction=0.2) == [2]
    assert eva.reward_rule("judge2") is kind
    eva.check_choices(args(info_metric="top", sampling="last", reward_kind="judge2"))
    with pytest.raises(ValueError, match="--optim sgd: new_optimizer"):
        eva.check_choices(args(optim="sgd"))


# ---- the solver: pairs, reference log-probs, the update ----
def sample(prompt_ids, token_ids):
    return eva.Sample("", list(prompt_ids), list(token_ids), [], "stop")


def test_training_items_pairs_ties_rloo_and_truncation():
    s = [sample(range(10), [i] * (i + 1)) for i in range(4)]
    groups = [eva.Group("x", s, [1.0, 3.0, 0.0, 3.0]), eva.Group("y", s, [2.0, 2.0, 2.0, 2.0])]
    # the tie group gives no pair
    [pair] = eva.training_items(groups, args(max_prompt_length=4, max_length=6))
    assert pair.rewards == (3.0, 0.0)  # argmax (the first of the two 3s) and argmin
    assert [pair.chosen.token_ids, pair.rejected.token_ids] == [[1, 1], [2, 2]]  # cut to 6 - 4
    assert pair.chosen.prompt_ids == [6, 7, 8, 9]  # the prompt's last 4 tokens
    assert pair.source is groups[0]  # the group it came from
    assert pair.win_probs == pytest.approx(
        [eva.win_probability(groups[0].rewards, 1), eva.win_probability(groups[0].rewards, 2)]
    )
    # the group's leave-one-out advantages as the Examples' weights, where it trains
    rollouts = eva.training_items(groups, args(loss="rloo"))
    assert [r.weight for r in rollouts] == pytest.approx(
        [1.0 - 6.0 / 3, 3.0 - 4.0 / 3, 0.0 - 7.0 / 3, 3.0 - 4.0 / 3]
    )
    assert all(r.source is groups[0] for r in rollouts)
    assert [r.sample.token_ids for r in rollouts] == [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]
    # one response, or none: nothing to learn
    lone = [eva.Group("z", s[:1], [5.0]), eva.Group("e", [], [])]
    assert eva.training_items(lone, args()) == [] == eva.training_items(lone, args(loss="rloo"))


def test_rm_margin_is_the_reward_models_margin():
    """charts/rm_margin is r(x, y_w) - r(x, y_l), the reward model's scores of the pair the training rewards chose
    (a reward term changes which pair, not what the chart measures): rewards [1, 3, 0] pick (1, 2), whose scores
    are 2 and 4, a margin of -2 (the training rewards' margin would be 3). Where the reward is the score (official),
    both are 3. Rollouts are no pairs: a mean of nothing, 0."""
    s = [sample([1], [i + 1]) for i in range(3)]
    shaped = eva.Group("x", s, [1.0, 3.0, 0.0], [5.0, 2.0, 4.0])
    official = eva.Group("y", s, [1.0, 3.0, 0.0], [1.0, 3.0, 0.0])
    for group, margin in ((shaped, -2.0), (official, 3.0)):
        items = eva.training_items([group], args())
        assert items[0].indices == (1, 2)
        charts = eva.chart_metrics(["x"], [group], [group], items, eva_round=True)
        assert charts["charts/rm_margin"] == margin
    rollouts = eva.training_items([shaped], args(loss="rloo"))
    charts = eva.chart_metrics(["x"], [shaped], [shaped], rollouts, eva_round=True)
    assert charts["charts/rm_margin"] == 0.0


@pytest.mark.parametrize(
    "prompt, chosen, rejected, kept, alone",
    [
        # the responses to 2048 - 1024, the prompt kept
        (100, 2048, 1, [(100, 1024), (100, 1)], [(100, 1024), (100, 1)]),
        # 1801 tokens fit: nothing is cut
        (1500, 300, 1, [(1500, 300), (1500, 1)], [(1500, 300), (1500, 1)]),
        # the pair's longer response decides
        (1500, 300, 600, [(1024, 300), (1024, 600)], [(1500, 300), (1024, 600)]),
        # both cuts
        (1500, 1500, 10, [(1024, 1024), (1024, 10)], [(1024, 1024), (1500, 10)]),
    ],
)
def test_training_items_cut_as_the_official_tokenize_row(prompt, chosen, rejected, kept, alone):
    g = eva.Group(
        "x",
        [sample(range(prompt), [1] * chosen), sample(range(prompt), [2] * rejected)],
        [1.0, 0.0],
    )
    [pair] = eva.training_items([g], args())  # max_length 2048, max_prompt_length 1024
    fitted = [pair.chosen, pair.rejected]
    assert [(len(s.prompt_ids), len(s.token_ids)) for s in fitted] == kept
    assert pair.chosen.prompt_ids == list(range(prompt))[-kept[0][0] :]  # the prompt's end
    # a rollout is cut alone, by its own length
    rollouts = eva.training_items([g], args(loss="rloo"))
    assert [(len(r.sample.prompt_ids), len(r.sample.token_ids)) for r in rollouts] == alone


def test_mix_takes_the_official_shares():
    mixed = eva.mix(list(range(10)), list(range(100, 105)), random.Random(0), args())
    # int(0.2 * 10) old, int(0.8 * 5) new
    assert len(mixed) == 2 + 4 and sum(x >= 100 for x in mixed) == 4


def test_mix_edges():
    rng = random.Random(0)
    # empty lists: none of them; int(0.2 * 4) = 0 old
    assert eva.mix([], [], rng, args()) == []
    assert eva.mix([1, 2, 3, 4], [], rng, args()) == []
    # shares 0 and 1: none of the old, all of the new, each once
    whole = eva.mix([1, 2], [5, 6, 7], rng, args(old_pair_ratio=0.0, new_pair_ratio=1.0))
    assert sorted(whole) == [5, 6, 7]


def encode_reply(tok, prompt, reply):
    ids = eva.encode_prompt(tok, eva.chat_prompt(tok, prompt))
    return eva.Sample(
        reply, ids, tok(reply, add_special_tokens=False).input_ids + [tok.eos_token_id], [], "stop"
    )


def test_sequence_logprobs_match_token_logprobs(tiny_model_dir):
    tok, policy = eva.load_tokenizer(tiny_model_dir), eva.load_model(tiny_model_dir, CPU)
    samples = [
        encode_reply(tok, "Say hi.", r) for r in (" hi", " hello there", " hey you all", " yo")
    ]
    got = eva.sequence_logprobs(policy, samples, args(micro_batch_size=1), CPU)
    for s, value in zip(samples, got):
        with torch.no_grad():
            logp, mask, _ = eva.token_logprobs(policy, [s])
        assert value == pytest.approx(float((logp * mask).sum()), abs=1e-4)


def test_rloo_logprobs_follow_the_sampling_distribution(tiny_model_dir):
    """RLOO's ratio pi / pi_old is of the distribution the solver sampled from (T 0.7, top-p 0.9), in the reference
    and in the update alike; the preference losses keep T = 1 (TRL's DPO)."""
    tok, policy = eva.load_tokenizer(tiny_model_dir), eva.load_model(tiny_model_dir, CPU)
    samples = [encode_reply(tok, "Say hi.", r) for r in (" hi there", " hello", " hey you")]
    with torch.no_grad():
        # a peaked next-token distribution, as a trained model's
        policy.get_output_embeddings().weight.mul_(20.0)
        sampled = [
            float((lp * m).sum())
            for lp, m in zip(*eva.token_logprobs(policy, samples, 0.7, 0.9)[:2])
        ]
        plain = [float((lp * m).sum()) for lp, m in zip(*eva.token_logprobs(policy, samples)[:2])]
    # the two distributions differ here
    assert all(abs(a - b) > 0.1 for a, b in zip(sampled, plain))
    rloo = args(loss="rloo", micro_batch_size=1)
    assert (rloo.temperature, rloo.top_p) == (0.7, 0.9)
    assert eva.sequence_logprobs(policy, samples, rloo, CPU) == pytest.approx(sampled, abs=1e-4)
    assert eva.sequence_logprobs(policy, samples, args(), CPU) == pytest.approx(plain, abs=1e-4)
    items = eva.training_items([eva.Group("Say hi.", samples, [1.0, 0.0, 2.0])], rloo)
    refs = eva.sequence_logprobs(policy, [item.sample for item in items], rloo, CPU)
    with_refs = [(item, [r]) for item, r in zip(items, refs)]
    loss, stats = eva.micro_batch_loss(policy, with_refs, size=len(items), args=rloo)
    assert stats["ratio"] == pytest.approx(1.0, abs=1e-4)  # on-policy at the round's start: rho = 1
    # the advantages 1 - 1, 0 - 1.5, 2 - 0.5 (a group's sum to 0): the loss -mean(A) = 0 at rho = 1
    assert [item.weight for item in items] == pytest.approx([0.0, -1.5, 1.5])
    assert loss.item() == pytest.approx(0.0, abs=1e-4)


def test_armorm_score_head(tiny_model_dir, tmp_path):
    """A classifier with ArmoRM's interface, loaded as ArmoRM is (its own modelling code, trust_remote_code): the reward
    is its `score` (the gated sum of its objectives), not its first logit."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig.from_pretrained(tiny_model_dir, num_labels=3)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    eva.load_tokenizer(tiny_model_dir).save_pretrained(tmp_path)
    (tmp_path / "modeling_tiny_armo.py").write_text(ARMO_MODELING)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["auto_map"] = {"AutoModelForSequenceClassification": "modeling_tiny_armo.TinyArmoRM"}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    rm = eva.load_reward_model(args(reward_model=str(tmp_path)), CPU)
    assert type(rm[0]).__name__ == "TinyArmoRM"
    scores = eva.score_responses(rm, "What is 2 + 2?", ["4", "five"], args())
    for response, score in zip(["4", "five"], scores):
        chat = [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": response},
        ]
        ids = rm[1].apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            objectives = LlamaForSequenceClassification.forward(rm[0], input_ids=ids).logits[0]
        assert score == pytest.approx(float(objectives @ torch.tensor([0.2, 0.3, 0.5])), abs=1e-5)
        assert abs(score - float(objectives[0])) > 1e-3  # the first logit would be another reward


ARMO_MODELING = """import dataclasses

import torch
from transformers import LlamaForSequenceClassification
from transformers.utils import ModelOutput


@dataclasses.dataclass
class ArmoOutput(ModelOutput):
    logits: torch.Tensor = None
    score: torch.Tensor = None


class TinyArmoRM(LlamaForSequenceClassification):  # ArmoRM's outputs: per-objective rewards and their gated score
    def forward(self, input_ids=None, **kwargs):
        rewards = super().forward(input_ids=input_ids, **kwargs).logits
        return ArmoOutput(logits=rewards, score=rewards @ torch.tensor([[0.2], [0.3], [0.5]]))
"""


def test_judge_and_classifier_scores(tiny_model_dir, tmp_path):
    tok = eva.load_tokenizer(tiny_model_dir)
    judge = eva.load_reward_model(args(reward_model=tiny_model_dir, reward_kind="judge"), CPU)
    scores = eva.score_responses(
        judge, "What is 2 + 2?", ["4", "five", "4"], args(reward_kind="judge")
    )
    assert all(1.0 <= s <= 9.0 for s in scores) and scores[0] == scores[2] != scores[1]
    text = eva.chat_prompt(tok, eva.JUDGE_PROMPT.format(prompt="What is 2 + 2?", response="4"))
    with torch.no_grad():
        logits = judge[0](input_ids=torch.tensor([eva.encode_prompt(tok, text)])).logits[0, -1]
    digits = [tok.encode(str(d), add_special_tokens=False)[-1] for d in range(1, 10)]
    assert scores[0] == pytest.approx(
        float((logits[digits].softmax(-1) * torch.arange(1, 10)).sum()), abs=1e-5
    )
    from transformers import LlamaForSequenceClassification

    config = judge[0].config
    config.num_labels = 1
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = eva.load_reward_model(args(reward_model=str(tmp_path / "rm")), CPU)
    [score] = eva.score_responses(rm, "What is 2 + 2?", ["4"], args())
    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    ids = tok.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        assert score == pytest.approx(float(rm[0](input_ids=ids).logits[0, 0]), abs=1e-5)


def test_update_steps_schedule_and_fresh_optimizer(tiny_model_dir):
    tok, policy = eva.load_tokenizer(tiny_model_dir), eva.load_model(tiny_model_dir, CPU)
    groups = [
        eva.Group(p, [encode_reply(tok, p, r) for r in (" yes", " no")], [1.0, 0.0])
        for p in "abcde"
    ]
    a = args(batch_size=2, micro_batch_size=1, epochs=2, learning_rate=1e-3)
    # update() takes the reference log-probs under the policy it starts from
    items = eva.training_items(groups, a)
    before = [p.detach().clone() for p in policy.parameters()]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1.0, weight_decay=0.0)
    stats = eva.update(
        policy=policy, optimizer=optimizer, items=items, rng=random.Random(0), args=a, dist=CPU
    )
    assert stats["losses/steps"] == 6  # 2 epochs x ceil(5 / 2)
    # policy = reference at step 0
    assert stats["losses/loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    assert stats["losses/margin_first"] == pytest.approx(0.0, abs=1e-4)
    assert all(s["step"] == 6 for s in optimizer.state.values())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(eva.lr_at(5, 6, 1e-3, 1, "cosine"))
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))
    a = args(batch_size=2, epochs=1)
    eva.update(
        policy=policy, optimizer=optimizer, items=items[:2], rng=random.Random(0), args=a, dist=CPU
    )
    assert all(s["step"] == 1 for s in optimizer.state.values())  # a fresh state every round
    # no items, or no epochs: no step, the policy as it was
    before = [p.detach().clone() for p in policy.parameters()]
    for kept, a in ((items[:0], args(batch_size=2)), (items, args(batch_size=2, epochs=0))):
        stats = eva.update(
            policy=policy, optimizer=optimizer, items=kept, rng=random.Random(0), args=a, dist=CPU
        )
        assert stats["losses/steps"] == 0.0 and "losses/loss" not in stats
    assert all(torch.equal(b, p) for b, p in zip(before, policy.parameters()))


@pytest.mark.parametrize("loss", ["dpo", "simpo"])
def test_update_learns_what_the_reward_favours(tiny_model_dir, loss):
    """The loop's own path: a fixed reward (it favours replies with the marker " yes") -> training_items -> reference
    log-probs -> update. The marked reply's log-probability rises over 20 updates; when the reward favours another
    reply, it falls."""
    tok = eva.load_tokenizer(tiny_model_dir)
    prompts = ["Answer me.", "Tell me.", "Say it."]
    replies = [" yes", " no", " maybe so"]
    a = args(
        loss=loss,
        beta=0.1 if loss == "dpo" else 2.0,
        learning_rate=3e-3,
        epochs=20,
        batch_size=3,
        micro_batch_size=3,
        warmup_ratio=0.0,
        lr_schedule="linear",
    )

    def marked_logp(policy) -> float:
        return float(
            np.mean(
                eva.sequence_logprobs(
                    policy, [encode_reply(tok, p, " yes") for p in prompts], a, CPU
                )
            )
        )

    moved = {}
    for marker in (" yes", " no"):
        policy = eva.load_model(tiny_model_dir, CPU)
        reward = lambda text: 1.0 if text == marker else 0.0  # noqa: E731
        groups = [
            eva.Group(p, [encode_reply(tok, p, r) for r in replies], [reward(r) for r in replies])
            for p in prompts
        ]
        items = eva.training_items(groups, a)
        before = marked_logp(policy)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=a.learning_rate, weight_decay=0.0)
        stats = eva.update(
            policy=policy, optimizer=optimizer, items=items, rng=random.Random(0), args=a, dist=CPU
        )
        moved[marker] = (before, marked_logp(policy))
        print(
            f"{loss}, reward favours {marker!r}: log p(' yes') {before:.2f} -> {moved[marker][1]:.2f}, "
            f"loss {stats['losses/loss_first']:.3f} -> {stats['losses/loss_last']:.3f}"
        )
        assert stats["losses/loss_last"] < stats["losses/loss_first"]
    assert moved[" yes"][1] > moved[" yes"][0] + 1.0
    assert moved[" no"][1] < moved[" no"][0] - 1.0


# ---- end to end (slow) ----
def tiny_flags(model_dir):
    return [
        "--model",
        model_dir,
        "--reward-model",
        model_dir,
        "--num-prompts",
        "8",
        "--n-samples",
        "4",
        "--max-new-tokens",
        "12",
        "--evolve-max-new-tokens",
        "12",
        "--heldout-size",
        "4",
        "--learning-rate",
        "1e-3",
    ]


def run_in_process(monkeypatch, tmp_path, name, *flags):
    argv = ["eva.py", "--output-dir", str(tmp_path), "--run-name", name, *flags]
    monkeypatch.setattr(sys, "argv", argv)
    eva.main(tyro.cli(eva.Args, args=argv[1:]))
    return tmp_path / name


def metrics_of(run_dir: pathlib.Path) -> dict:
    """step -> the LAST metrics line of that step (a resumed run may log a step twice)."""
    return {
        row["step"]: row
        for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def subprocess_cmd(model_dir, out, name, *flags, ranks=0):
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        if ranks
        else [sys.executable]
    )
    return head + [
        "eva.py",
        "--output-dir",
        str(out),
        "--run-name",
        name,
        *tiny_flags(model_dir),
        *flags,
    ]


def test_checkpoint_keeps_no_optimizer_state(monkeypatch, tiny_model_dir, tmp_path):
    """Every round starts from a fresh optimizer, so a checkpoint holds the policy's weights and no moments; a resume
    loads it into a fresh optimizer's run."""
    flags = [
        "--model",
        tiny_model_dir,
        "--reward-model",
        tiny_model_dir,
        "--num-prompts",
        "4",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "4",
        "--evolve-max-new-tokens",
        "4",
        "--num-evolutions",
        "1",
        "--heldout-size",
        "1",
        "--iterations",
        "1",
        "--no-baseline-round",
    ]
    run_dir = run_in_process(monkeypatch, tmp_path, "ckpt", *flags)
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(
        FileSystemReader(str(run_dir / "checkpoints" / "iter_000001" / "policy.dcp"))
        .read_metadata()
        .state_dict_metadata
    )
    assert any(k.startswith("model.") for k in keys) and not [k for k in keys if "optim" in k]
    policy = eva.load_model(tiny_model_dir, CPU)
    optimizer = torch.optim.AdamW(policy.parameters())
    assert (
        eva.load_checkpoint(run_dir, eva.weights_only({"policy": (policy, optimizer)}), CPU)[0] == 1
    )


# the plain-DPO round, then an eva round (eva_reference)
TWO_ROUNDS = ["--iterations", "2", "--baseline-round"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_two_rounds_end_to_end(eva_reference, tiny_model_dir):
    """conftest.py's eva_reference: the two rounds of TWO_ROUNDS, uninterrupted."""
    two_rounds = eva_reference.run_dir
    rows = metrics_of(two_rounds)
    assert (
        sorted(rows) == [0, 1, 2]
        and rows[1]["charts/eva_round"] == 0
        and rows[2]["charts/eva_round"] == 1
    )
    # the initial policy's held-out reward, the first reference
    assert set(rows[0]) == {"step", "eval/reward"}
    assert rows[1]["eval/reference_reward"] == rows[0]["eval/reward"]
    # int(0.25 * 8), then 4 steps each
    assert rows[2]["creator/subset"] == 2 and rows[2]["creator/evolved"] > 0
    for row in (rows[1], rows[2]):
        assert row["charts/train_items"] > 0 and 0.0 <= row["eval/win_rate"] <= 1.0
        assert row["losses/loss_first"] == pytest.approx(math.log(2), abs=1e-3)
        assert row["losses/loss_last"] < row["losses/loss_first"] and row["losses/margin_last"] > 0
    records = [
        json.loads(line) for line in (two_rounds / "evolutions.jsonl").read_text().splitlines()
    ]
    # the loop's index, from 0
    assert len(records) == 2 * 4 and all(r["round"] == 1 for r in records)
    state = torch.load(two_rounds / "checkpoints" / "iter_000002" / "state.pt", weights_only=False)
    assert state["iteration"] == 2 and len(state["state"]["prompts"]) == sum(
        r["kept"] for r in records
    )
    from safetensors.torch import load_file

    before = load_file(pathlib.Path(tiny_model_dir) / "model.safetensors")
    after = load_file(two_rounds / "checkpoints" / "iter_000002" / "policy" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)


@pytest.mark.slow
def test_malformed_endpoint_output_is_dropped_with_a_reason(monkeypatch, tiny_model_dir, tmp_path):
    monkeypatch.setattr(eva.time, "sleep", lambda s: None)
    replies = [
        chat(""),
        (500, "busy"),
        (500, "busy"),
        (500, "busy"),
        chat("I rewrote the #Given Prompt#, oops"),
        (200, "not json"),
        (200, "not json"),
        (200, "not json"),
        chat("#Rewritten Prompt#: Tell me more."),
    ]
    endpoint = Endpoint(replies)
    try:
        run_dir = run_in_process(
            monkeypatch,
            tmp_path,
            "url",
            *tiny_flags(tiny_model_dir),
            "--iterations",
            "1",
            "--no-baseline-round",
            "--evolver-url",
            endpoint.url,
            "--evolver-workers",
            "1",
        )
    finally:
        endpoint.close()
    records = [json.loads(line) for line in (run_dir / "evolutions.jsonl").read_text().splitlines()]
    reasons = [r["reason"] for r in records]
    assert (
        reasons.count("empty") == 1
        and reasons.count("failed") == 2
        and reasons.count("marker") == 1
    )
    assert any(r["kept"] for r in records) and metrics_of(run_dir)[1]["creator/failed"] == 2


ABLATIONS = {
    "no_evolve_greedy": ["--no-evolve", "--sampling", "greedy"],
    "stratified_a_dts_sppo": [
        "--sampling",
        "stratified",
        "--stratified-bins",
        "2",
        "--info-metric",
        "a_dts",
        "--loss",
        "sppo",
        "--beta",
        "0.01",
        "--batch-size",
        "64",
    ],
    "rloo": ["--loss", "rloo", "--batch-size", "64"],
    "new_human_prompts_orpo_rmsprop": [
        "--new-human-prompts",
        "--loss",
        "orpo",
        "--optim",
        "rmsprop",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ABLATIONS))
def test_ablations_change_what_they_name(monkeypatch, tiny_model_dir, tmp_path, case):
    """Each flag's effect in a round of main(): the subset it samples (by the info metric it names), the loss it
    trains (its value at the first step, where the policy is its reference), the optimizer, the prompts."""
    seen = {"groups": {}, "items": [], "optimizers": [], "losses": collections.Counter()}
    solve, training_items, update = eva.solve, eva.training_items, eva.update

    # the rounds' Groups by key: reference, 0/solve, 0/solve_evolved, 0/eval
    def spy_solve(**named):
        groups = solve(**named)
        seen["groups"][named["key"].split("/", 1)[1]] = groups
        return groups

    def spy_training_items(groups, a):
        items = training_items(groups, a)
        seen["items"].append((groups, items))
        return items

    def spy_update(**named):
        seen["optimizers"].append(type(named["optimizer"]).__name__)
        return update(**named)

    def counted(name):  # the loss function `name`, counting its calls
        loss_fn = getattr(eva, name)

        def count_and_call(*values):
            seen["losses"].update([name])
            return loss_fn(*values)

        return count_and_call

    monkeypatch.setattr(eva, "solve", spy_solve)
    monkeypatch.setattr(eva, "training_items", spy_training_items)
    monkeypatch.setattr(eva, "update", spy_update)
    for name in ("dpo_loss", "sppo_loss", "orpo_loss", "rloo_loss"):
        monkeypatch.setattr(eva, name, counted(name))
    monkeypatch.setitem(eva.ROLLOUT_LOSSES, "rloo", eva.rloo_loss)  # the table holds the function
    run_dir = run_in_process(
        monkeypatch,
        tmp_path,
        "ablation",
        *tiny_flags(tiny_model_dir),
        "--iterations",
        "1",
        "--no-baseline-round",
        "--n-samples",
        "3",
        *ABLATIONS[case],
    )
    row, groups = metrics_of(run_dir)[1], seen["groups"]["0/solve"]
    [(train_groups, items)] = seen["items"]
    seeds = []  # the subset's prompts: the first parents of the mutation chains
    if (run_dir / "evolutions.jsonl").exists():
        for line in (run_dir / "evolutions.jsonl").read_text().splitlines():
            if json.loads(line)["evolution"] == 0:
                seeds.append(json.loads(line)["parent"])
    a_min = [max(g.rewards) - min(g.rewards) for g in groups]
    assert row["charts/train_items"] == len(items) > 0
    if case == "no_evolve_greedy":  # the 2 prompts of highest A*_min, trained on as they are
        top = sorted(sorted(range(8), key=lambda i: -a_min[i])[:2])
        assert [g.prompt for g in train_groups] == [groups[i].prompt for i in top] and not seeds
        assert row["creator/evolved"] == 0 and "0/solve_evolved" not in seen["groups"]
        assert seen["losses"]["dpo_loss"] > 0 and seen["optimizers"] == ["AdamW"]
    if case == "stratified_a_dts_sppo":
        a_dts = [sorted(g.rewards)[-1] - sorted(g.rewards)[-2] for g in groups]
        assert (
            row["creator/info_mean"]
            == pytest.approx(np.mean(a_dts))
            != pytest.approx(np.mean(a_min))
        )
        median = np.median(a_dts)  # two quantile bins of A*_dts, round(0.25 * 4) = 1 seed from each
        assert sorted(a_dts[[g.prompt for g in groups].index(p)] > median for p in seeds) == [
            False,
            True,
        ]
        rng = np.random.default_rng(zlib.crc32(b"42/0"))  # main()'s draw for round 0, seed 42
        flags = dict(sampling="stratified", evolve_fraction=0.25, stratified_bins=2)
        drawn = subset(a_dts, eva.sampling_weights(a_dts), rng, **flags)
        assert seeds == [groups[i].prompt for i in drawn]
        # SPPO at the first step (policy = reference; one batch of every pair): the mean of ((P_w - 1/2)^2 +
        # (P_l - 1/2)^2) / (2 beta^2), beta 0.01 (the tiny judge's rewards lie close: P ~ 1/2)
        pairs = [item.win_probs for item in items]
        expected = np.mean(
            [((p_w - 0.5) ** 2 + (p_l - 0.5) ** 2) / (2 * 1e-4) for p_w, p_l in pairs]
        )
        assert row["losses/loss_first"] == pytest.approx(expected, rel=1e-3) and expected > 1e-3
        assert seen["losses"]["sppo_loss"] > 0 and not seen["losses"]["dpo_loss"]
    # every response of every group with a reward gap, each against its group's other N - 1
    if case == "rloo":
        assert all(isinstance(i, eva.Example) for i in items) and len(items) == 3 * sum(
            max(g.rewards) > min(g.rewards) for g in train_groups
        )
        advantages = [i.weight for i in items]
        # rho = 1 at the first step
        assert row["losses/loss_first"] == pytest.approx(-np.mean(advantages), abs=1e-4)
        assert "losses/ratio" in row and "losses/margin" not in row
        assert seen["losses"]["rloo_loss"] > 0 and not seen["losses"]["dpo_loss"]
    # a plain round on the human split: no creator at all
    if case == "new_human_prompts_orpo_rmsprop":
        assert row["charts/eva_round"] == 0 and "creator/subset" not in row and not seeds
        assert set(seen["groups"]) == {"reference", "0/solve", "0/eval"} and train_groups == groups
        assert (
            seen["losses"]["orpo_loss"] > 0
            and not seen["losses"]["dpo_loss"]
            and seen["optimizers"] == ["RMSprop"]
        )


@pytest.mark.slow
def test_cpu_default_on_the_embedded_model(tmp_path):
    if not pathlib.Path(eva.resolve_model(eva.EMBEDDED_MODEL), "config.json").exists():
        pytest.skip("the embedded model is not converted (bash setup.sh)")
    cmd = [
        sys.executable,
        "eva.py",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "embedded",
        "--num-prompts",
        "4",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "8",
        "--evolve-max-new-tokens",
        "16",
        "--num-evolutions",
        "2",
        "--heldout-size",
        "2",
        "--epochs",
        "1",
    ]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "No CUDA" in done.stdout and "reward_kind=judge" in done.stdout
    row = metrics_of(tmp_path / "embedded")[1]
    assert row["charts/eva_round"] == 1 and row["creator/subset"] == 1 and "eval/win_rate" in row
    last_line = done.stdout.splitlines()[-1]
    assert "within two standard errors of chance" in last_line  # on 2 prompts any win rate is


# ---- the loop learns (slow): main() on a primed tiny model, rewarded by a stand-in reward model ----
# The loop learning test. A fixture primes the tiny model (50 supervised steps) to answer any prompt, the
# creator's too, with a few words of LOOP_WORDS; the reward model is a stand-in classifier (its own modelling code, as
# ArmoRM's) that scores 1 a reply holding the marker word, 0 one without: the word of LOOP_WORDS the primed model's
# iteration-0 replies hold nearest 40% of the time (printed). eva's own main() runs LOOP_ITERATIONS eva rounds; the
# share of its replies that hold the marker, its logged charts/reward_mean, must rise by LOOP_MARGIN from iteration 0
# (the untrained policy) to the mean of the last two; with the preference inverted (1 without the marker) the marker's
# share (1 - charts/reward_mean) must not rise.
LOOP_WORDS = ("red", "blue", "green", "gold", "sun", "moon", "tree", "rock")
LOOP_ITERATIONS, LOOP_MARGIN = 5, 0.25
LOOP = [
    "--reward-kind",
    "classifier",
    "--num-prompts",
    "8",
    "--n-samples",
    "4",
    "--max-new-tokens",
    "8",
    "--evolve-max-new-tokens",
    "8",
    "--heldout-size",
    "8",
    "--learning-rate",
    "3e-3",
    "--micro-batch-size",
    "8",
    "--no-gradient-checkpointing",
    "--iterations",
    str(LOOP_ITERATIONS),
    "--save-every",
    "100",
]
MARKER_MODELING = """import torch
from transformers import LlamaForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast


class MarkerRM(LlamaForSequenceClassification):  # 1 for a reply (after the last <|im_start|>) with a marker token
    def forward(self, input_ids=None, **kwargs):
        ids = input_ids[0].tolist()
        held = any(t in self.config.marker_ids for t in ids[len(ids) - ids[::-1].index(self.config.turn_id) :])
        return SequenceClassifierOutputWithPast(logits=torch.tensor([[float(held == self.config.prefer_marker)]]))
"""


def prime(model_dir: str, out: pathlib.Path, steps: int = 50, lr: float = 1e-2) -> str:
    """The model taught by supervised steps to answer a chat prompt, or a mutation prompt, with 2-6 words of
    LOOP_WORDS (uniformly drawn) and EOS; saved to `out`."""
    tok, rng = eva.load_tokenizer(model_dir), random.Random(0)
    prompts = eva.load_prompts(args(dataset="data/chat_prompts.jsonl", num_splits=1))[0][0]
    torch.manual_seed(0)
    policy = eva.load_model(model_dir, CPU, gradient_checkpointing=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    for _ in range(steps):
        asked = [rng.choice(prompts) for _ in range(16)]
        asked = [
            rng.choice(list(eva.MUTATIONS.values())).replace("<PROMPT>", p)
            if rng.random() < 0.3
            else p
            for p in asked
        ]
        replies = [
            "".join(" " + rng.choice(LOOP_WORDS) for _ in range(rng.randint(2, 6))) for _ in asked
        ]
        logp, mask, _ = eva.token_logprobs(
            policy, [encode_reply(tok, p, r) for p, r in zip(asked, replies)]
        )
        (-(logp * mask).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    policy.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def marker_reward_model(model_dir: str, out: pathlib.Path, word: str, prefer_marker: bool) -> str:
    """The stand-in reward model of MARKER_MODELING: the marker is `word`'s token with and without a leading space."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = eva.load_tokenizer(model_dir)
    marker_ids = sorted(
        {tok(w, add_special_tokens=False).input_ids[-1] for w in (word, " " + word)}
    )
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        marker_ids=marker_ids,
        turn_id=tok.convert_tokens_to_ids("<|im_start|>"),
        prefer_marker=prefer_marker,
        auto_map={"AutoModelForSequenceClassification": "modeling_marker_rm.MarkerRM"},
    )
    LlamaForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "modeling_marker_rm.py").write_text(MARKER_MODELING)
    return str(out)


def replies_at_iteration_0(model_dir: str) -> tuple[list[str], list[list[str]]]:
    """The loop's first solve, as main() samples it: the first split's prompts, n = 4, key "42/0/solve", the solver's
    T and top-p, the HF sampler's chunks. Returns (the prompts, each one's replies)."""
    tok, a = (
        eva.load_tokenizer(model_dir),
        tyro.cli(official_args(eva), args=["--dataset", "data/chat_prompts.jsonl", *LOOP]),
    )
    sampler = eva.Sampler(
        model_dir, eva.load_model(model_dir, CPU, train=False), tok, CPU, "hf", 1024
    )
    prompts = eva.load_prompts(a)[0][0]
    rows = eva.sample(
        sampler,
        [eva.chat_prompt(tok, p) for p in prompts],
        a.n_samples,
        "42/0/solve",
        temperature=a.temperature,
        top_p=a.top_p,
        max_new_tokens=a.max_new_tokens,
        logprobs=False,
    )
    return prompts, [[s.text for s in row] for row in rows]


@pytest.fixture(scope="module")
def primed_model_dir(tiny_model_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return prime(tiny_model_dir, tmp_path_factory.mktemp("eva_primed"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_loop_learns_what_the_reward_model_prefers(primed_model_dir, tmp_path):
    started = time.time()
    prompts, replies = replies_at_iteration_0(primed_model_dir)
    texts = [t for row in replies for t in row]
    shares = {w: sum(w in t.split() for t in texts) / len(texts) for w in LOOP_WORDS}
    marker = min(LOOP_WORDS, key=lambda w: abs(shares[w] - 0.4))
    rm = {
        prefer: marker_reward_model(primed_model_dir, tmp_path / f"rm_{prefer}", marker, prefer)
        for prefer in (True, False)
    }
    judge = eva.load_reward_model(args(reward_model=rm[True]), CPU)
    base = np.mean(
        [r for p, row in zip(prompts, replies) for r in eva.score_responses(judge, p, row, args())]
    )
    print(
        f"\niteration 0's replies (e.g. {texts[:4]}): the share holding each word {shares}; marker {marker!r}, "
        f"the stand-in pays {base:.3f} of them"
    )
    assert 0.2 <= base <= 0.6, shares  # a moderate base rate
    runs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "eva.py",
                "--output-dir",
                str(tmp_path),
                "--run-name",
                name,
                "--model",
                primed_model_dir,
                "--reward-model",
                rm[prefer],
                *LOOP,
            ],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, prefer in (("normal", True), ("inverted", False))
    }  # in parallel, a core each
    curves = {}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:] + err[-5000:]
        rows = metrics_of(tmp_path / name)
        assert sorted(rows) == list(range(LOOP_ITERATIONS + 1))
        rewards = [rows[step]["charts/reward_mean"] for step in range(1, LOOP_ITERATIONS + 1)]
        # the marker's share
        curves[name] = rewards if name == "normal" else [1.0 - r for r in rewards]
        print(
            f"{name}: charts/reward_mean {[round(r, 2) for r in rewards]}; eval/reward "
            f"{[round(rows[s]['eval/reward'], 2) for s in sorted(rows)]}; eval/win_rate "
            f"{[round(rows[s]['eval/win_rate'], 2) for s in range(1, LOOP_ITERATIONS + 1)]}"
        )
    print(f"loop learning test: {time.time() - started:.0f} s")
    (normal, inverted) = curves["normal"], curves["inverted"]
    # iteration 0 is the untrained policy's solve
    assert normal[0] == inverted[0] == pytest.approx(base)
    # the marker's share rises where it is paid
    assert np.mean(normal[-2:]) >= normal[0] + LOOP_MARGIN, normal
    assert np.mean(inverted[-2:]) <= inverted[0], inverted  # and does not where its absence is


def test_nothing_learned_says_why_when_no_group_taught():
    a = args()
    assert eva.nothing_learned(collections.Counter(groups=4), trained=2, args=a) is None
    assert eva.nothing_learned(collections.Counter(), trained=0, args=a) is None  # no round ran
    line = eva.nothing_learned(collections.Counter(groups=4), trained=0, args=a)
    assert "none of 4 training groups taught" in line and "group_teaches" in line
