"""Tests of coprover.py: the labels, the search priority, the GRPO advantages and clip-higher loss against values worked
out by hand; the search on a scripted prover over the stand-in REPL's tactic table (expansion order, merged states,
failed edges); whole proofs replayed for labels; learning tests of the value head and of the prover update; and
(marked slow) end-to-end runs in a subprocess with the tiny model and the stand-in REPL: both models' weights change,
a checkpoint is written, and the embedded model runs. Two ranks against one and resume after a kill are test_family's,
on the same reference run (conftest.py)."""

import collections
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from conftest import official_args  # noqa: E402

import coprover as cp  # noqa: E402
from lean_verify import (  # noqa: E402
    DEFAULT_HEADER,
    LeanResult,
    LeanVerifier,
    TacticState,
    goals_key,
)

CPU = cp.Dist(0, 1, 1, torch.device("cpu"), True)
ROWS = [
    json.loads(line)
    for line in (REPO / "data" / "lean_tactics.jsonl").read_text().splitlines()
    if line.strip()
]
PROBLEMS = {p.id: p for p in cp.load_problems(str(REPO / "data" / "lean_tactics.jsonl"))}
STAND_IN = f"{sys.executable} {REPO / 'tests' / 'fake_lean_repl.py'}"


def args(**kw):
    return official_args(cp)(**kw)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def verifier(tmp_path):
    v = LeanVerifier(repl_cmd=STAND_IN + f" --state-dir {tmp_path}", workers=1, timeout=10)
    yield v
    v.close()


class Scripted:
    """A prover that proposes, for a tactic prompt, the tactics `propose(first goal)` with log-prob `lp` per token (3
    tokens each), and records the goals it was asked about, in order."""

    def __init__(self, propose):
        self.propose, self.asked, self.llm = propose, [], None

    def generate(self, prompts, n=1, temperature=1.0, max_new_tokens=256, stop=None, **kw):
        out = []
        for prompt in prompts:
            goals = prompt.split("/- tactic state:\n")[-1].split("\n  -/")[0]
            first = "\n".join(line[2:] for line in goals.split("\n")).split("\n\n")[0]
            self.asked.append(first)
            out.append(
                [
                    cp.Sample(t, [], [0, 0, 0], [lp] * 3, reason)
                    for t, lp, reason in self.propose(first)
                ][:n]
            )
        return out


def table_tactics(goal: str) -> list[str]:
    return [
        t["tactic"]
        for r in ROWS
        for t in r["transitions"]
        if goals_key([t["goal"]]) == goals_key([goal])
    ]


# ---- labels, priority, advantages, losses (by hand) ----
def test_value_labels_on_a_hand_written_tree():
    # root r -> a -> b -> QED (3 tactics); r -> c (dead end); a -> d (expanded, failed); e never expanded
    labels = cp.value_labels(["r", "a", "c", "d", "b"], [["r", "a", "b"]], gamma=0.95)
    assert labels == pytest.approx({"r": 0.95**3, "a": 0.95**2, "b": 0.95, "c": 0.0, "d": 0.0})
    assert labels["r"] == pytest.approx(0.857375) and "e" not in labels
    # the README's 4-step trace: gamma^4 = 0.81 ... gamma = 0.95
    trace = cp.value_labels([], [["s0", "s1", "s2", "s3"]], 0.95)
    assert [round(v, 2) for v in trace.values()] == [0.81, 0.86, 0.9, 0.95]
    # a state on two proof paths takes the nearer QED; nothing proved: every expanded state is 0
    assert cp.value_labels(["r", "x"], [["r", "x", "y"], ["r", "x"]], 0.5) == {
        "r": 0.25,
        "x": 0.5,
        "y": 0.5,
    }
    assert cp.value_labels(["r", "x"], [], 0.95) == {"r": 0.0, "x": 0.0}


def priority(logprob, tokens, value, alpha):
    """The priority of a node whose path has `tokens` tactic tokens of summed log-prob `logprob`."""
    node = cp.Node(state=None, logprob=logprob, tokens=tokens)
    return cp.priority(node, value, args(alpha=alpha))


def test_priority_by_hand():
    # alpha 0.3: 0.3 * exp(-2 / 4) + 0.7 * 0.8 = 0.3 * 0.60653 + 0.56 = 0.741959
    assert priority(-2.0, 4, 0.8, 0.3) == pytest.approx(0.3 * math.exp(-0.5) + 0.56)
    assert priority(0.0, 0, 0.0, 1.0) == 1.0  # the root: no tactic yet
    assert priority(-100.0, 1, 0.9, 0.0) == pytest.approx(0.9)  # alpha 0: pure value
    assert priority(-3.5, 7, None, 0.3) == -3.5  # no value model: ReProver's cumulative log-prob
    # normalised: a long confident path is not buried under a short unconfident one (the cumulative log-prob would)
    assert priority(-0.1 * 40, 40, 0.5, 0.3) > priority(-2.0, 2, 0.5, 0.3)
    # --priority picks the rule of a scored node (official weighted_priority); value None never reaches it
    assert cp.priority_rule(args()) is cp.weighted_priority
    node = cp.Node(state=None, logprob=-3.0, tokens=3)
    assert cp.weighted_priority(node, 0.5, args(alpha=0.5)) == pytest.approx(
        0.5 * math.exp(-1.0) + 0.25
    )


def test_grpo_advantages_by_hand():
    # rewards [1, 0, 0, 0]: mean 0.25, std with Bessel's correction sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    assert cp.grpo_advantages([1, 0, 0, 0]) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert cp.grpo_advantages([0, 1, 1, 1]) == pytest.approx([-1.5, 0.5, 0.5, 0.5], abs=1e-5)
    assert (
        cp.grpo_advantages([1, 1, 1, 1]) == [0.0] * 4 and cp.grpo_advantages([0.0] * 8) == [0.0] * 8
    )


def test_clip_higher_loss_by_hand():
    # two sequences, two tokens each (the second sequence has one real token)
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.1, 9.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, held = cp.clip_higher_loss(logp, old, mask, adv, n_tokens=4, eps_low=0.2, eps_high=0.28)
    # seq 0 (A = 1): ratio 1.5 -> min(1.5, 1.28) = 1.28 (held back); ratio 0.5 -> min(0.5, 0.8) = 0.5
    # seq 1 (A = -2): ratio 1.1 -> min(-2.2, -2.2) = -2.2; the masked token does not count
    assert loss.item() == pytest.approx(-(1.28 + 0.5 - 2.2) / 4)
    assert held.item() == 1.0
    loss.backward()
    # d/dlogp of -ratio * A / 4 = -ratio * A / 4 where the unclipped term is taken, 0 where the clip holds
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 4, 2.2 / 4, 0.0])
    # clip-higher is asymmetric: with A > 0 a ratio of 1.25 is not clipped (it would be at eps_high = 0.2)
    up = torch.log(torch.tensor([[1.25]]))
    assert (
        cp.clip_higher_loss(up, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1), 1, 0.2, 0.28)[
            1
        ].item()
        == 0.0
    )
    assert (
        cp.clip_higher_loss(up, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1), 1, 0.2, 0.2)[
            1
        ].item()
        == 1.0
    )


def test_value_loss_and_pass_at_k():
    assert cp.value_loss_rule(args()) is cp.squared_error_loss
    assert cp.squared_error_loss(
        torch.tensor([0.5, 1.0]), torch.tensor([0.0, 0.9])
    ).item() == pytest.approx(0.25 + 0.01)
    # 1 - C(3,2) / C(4,2) = 0.5
    assert cp.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert (
        cp.pass_at_k(32, 0, 8) == 0.0
        and cp.pass_at_k(32, 25, 8) == 1.0
        and cp.pass_at_k(8, 2, 1) == 0.25
    )


# ---- rewards: timeouts and server errors are failures ----
@pytest.mark.parametrize("status", ["timeout", "server_error", "crash", "error", "sorry", "cheat"])
def test_timeouts_and_errors_are_never_rewarded(status):
    assert cp.accepted(LeanResult(valid=False, status=status)) is False
    assert cp.accepted(LeanResult(valid=True, status=status)) is False  # only "valid" pays
    assert cp.accepted(LeanResult(valid=True, status="valid")) is True
    args = official_args(cp)()
    sample = cp.Sample("```lean4\n...```", [1, 2], [3, 4, 5], [-0.5] * 3, "stop")
    failed = cp.Attempt(sample, None, status, False)
    proved = cp.Attempt(sample, "theorem t : True := trivial", "valid", True)
    assert cp.proof_reward(failed, args) == 0.0
    assert cp.proof_reward(proved, args) == 1.0


@pytest.mark.parametrize(
    "flag, table",
    [
        ("value_labels", "VALUE_LABELS"),
        ("advantage", "ADVANTAGES"),
        ("value_loss", "VALUE_LOSSES"),
        ("priority", "PRIORITIES"),
    ],
)
def test_a_choice_without_its_entry_stops_at_start(flag, table):
    """A Literal value a fork added without its table entry stops in check_choices, naming the
    table to add it to."""
    option = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{option} new: add its entry to {table}"):
        cp.check_choices(args(**{flag: "new"}))
    cp.check_choices(args())


def test_check_choices_stops_alpha_outside_its_range():
    with pytest.raises(ValueError, match="--alpha 1.5"):
        cp.check_choices(args(alpha=1.5))
    cp.check_choices(args(alpha=1.0))


def test_dr_grpo_advantages_by_hand():
    """Dr. GRPO: r_i - mean(r), no std division; --advantage picks it."""
    assert cp.dr_grpo_advantages([1, 0, 0, 0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert cp.dr_grpo_advantages([2.0, 0.0]) == pytest.approx([1.0, -1.0])
    assert cp.dr_grpo_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]
    assert cp.advantage_estimator(args(advantage="dr_grpo")) is cp.dr_grpo_advantages
    assert cp.advantage_estimator(args()) is cp.grpo_advantages


def test_value_label_choices_by_depth():
    """state labels every state below the root, root none (the root is always labelled)."""
    assert [cp.every_state(d) for d in (1, 2)] == [True, True]
    assert [cp.root_only(d) for d in (1, 2)] == [False, False]


def test_clipfrac_counts_the_trained_tokens(monkeypatch):
    """losses/grpo_clipfrac = tokens the clip held back / tokens of the samples trained on. By
    hand: a group (1, 0) of 2-token samples trains; a group (1, 1) of 4-token samples (advantage
    0) does not. The rewarded sample's first token has ratio 2 > 1 + eps_high: held back, 1 of
    the 4 trained tokens (the loss still divides by all 12 tokens, as the official)."""
    policy = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    new_logp = {"a": [math.log(2.0), 0.0], "b": [0.0, 0.0], "c": [0.0] * 4, "d": [0.0] * 4}

    def fake_logprobs(model, samples, temperature=1.0, **kw):
        width = max(len(s.token_ids) for s in samples)
        rows = []
        for s in samples:
            row = new_logp[s.text] + [0.0] * (width - len(s.token_ids))
            rows.append(row)
        logp = torch.tensor(rows) + 0.0 * policy.weight.sum()
        mask = torch.tensor(
            [[1.0] * len(s.token_ids) + [0.0] * (width - len(s.token_ids)) for s in samples]
        )
        return logp, mask, torch.zeros_like(logp)  # entropy: a term may ask for it

    monkeypatch.setattr(cp, "token_logprobs", fake_logprobs)

    def attempt(text, tokens, correct):
        sample = cp.Sample(text, [1], [7] * tokens, [0.0] * tokens, "stop")
        return cp.Attempt(sample, None, "valid", correct)

    groups = [
        [attempt("a", 2, True), attempt("b", 2, False)],
        [attempt("c", 4, True), attempt("d", 4, True)],
    ]
    examples = cp.grpo_examples(groups, args())
    stats = cp.update(policy, optimizer, examples, lr=None, args=args(), dist=CPU)
    assert stats["losses/grpo_clipfrac"] == pytest.approx(1 / 4)


def test_an_update_with_no_groups_changes_nothing():
    """A batch whose rollouts in_batch all left out trains nothing and does not crash."""
    policy = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in policy.parameters()]
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    dist = cp.Dist(0, 1, 1, torch.device("cpu"), True)
    stats = cp.update(policy, optimizer, [], None, official_args(cp), dist)
    assert stats == {}
    for old, new in zip(before, policy.parameters()):
        assert torch.equal(old, new)


def flat_logprobs(policy):
    """A token_logprobs stand-in: every token's log-prob 0 (ratio 1 against old log-probs 0), so
    clip_higher_loss is -(1 / n_tokens) sum_i A_i T_i."""

    def fake_logprobs(model, samples, temperature=1.0, **kw):
        width = max(len(s.token_ids) for s in samples)
        mask = []
        for s in samples:
            mask.append([1.0] * len(s.token_ids) + [0.0] * (width - len(s.token_ids)))
        mask = torch.tensor(mask)
        logp = torch.zeros_like(mask) + 0.0 * policy.weight.sum()
        return logp, mask, torch.zeros_like(logp)  # entropy: a term may ask for it

    return fake_logprobs


def rollout(text, tokens, correct, reason="stop"):
    """An Attempt whose sample has `tokens` tokens, all of old log-prob 0."""
    sample = cp.Sample(text, [1], [7] * tokens, [0.0] * tokens, reason)
    status = "valid" if correct else "error"
    return cp.Attempt(sample, None, status, correct)


def overlong_filter(example, args):
    """A fork's in_batch (DAPO's overlong filter): a rollout cut off at max_new_tokens does not
    train."""
    return example.sample.finish_reason != "length"


def test_the_batch_filter_and_the_zero_advantage_skip_by_hand(monkeypatch):
    """Dr. GRPO advantages: group (1, 0) of a (2 tokens) and b (3 tokens, cut off): A = +0.5,
    -0.5; group (1, 1) of c, d (4 tokens each): A = 0, skipped by adds_gradient, but their tokens
    count in n_tokens (official): loss = -(0.5 * 2 - 0.5 * 3) / (2 + 3 + 4 + 4) = 0.5 / 13. An
    overlong filter in in_batch (a fork: the rule alone) leaves b out of the batch: a keeps
    its advantage (the group counts every rollout), b counts nowhere:
    loss = -(0.5 * 2) / (2 + 4 + 4) = -0.1, and 1 rollout trains instead of 2."""
    policy = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    monkeypatch.setattr(cp, "token_logprobs", flat_logprobs(policy))
    groups = [
        [rollout("a", 2, True), rollout("b", 3, False, reason="length")],
        [rollout("c", 4, True), rollout("d", 4, True)],
    ]
    a = args(advantage="dr_grpo")
    examples = cp.grpo_examples(groups, a)
    assert [e.weight for e in examples] == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert [e.source for e in examples] == groups[0] + groups[1]
    assert [cp.adds_gradient(e, a) for e in examples] == [True, True, False, False]
    stats = cp.update(policy, optimizer, examples, lr=None, args=a, dist=CPU)
    assert stats["losses/grpo_loss"] == pytest.approx(0.5 / 13)
    monkeypatch.setattr(cp, "in_batch", overlong_filter)
    examples = cp.grpo_examples(groups, a)
    assert [e.sample.text for e in examples] == ["a", "c", "d"]
    assert examples[0].weight == pytest.approx(0.5)
    stats = cp.update(policy, optimizer, examples, lr=None, args=a, dist=CPU)
    assert stats["losses/grpo_loss"] == pytest.approx(-0.1)


class Asleep:
    """A sampler stand-in for grpo_round: it records its sleeps and weight syncs."""

    def __init__(self):
        self.calls = []

    def sleep(self):
        self.calls.append("sleep")

    def sync_weights(self, policy):
        self.calls.append("sync")


def test_trained_counts_the_rollouts_the_update_ran(monkeypatch):
    """grpo_round's count (main's `trained`) is the rollouts update ran (adds_gradient), not Lean's
    accepted proofs: of p's group (1, 0, 0, 0) all 4 train, of q's (1, 1, 1, 1) none, though 5
    proofs were accepted; a reward fork paying every proof 0 trains none. The sampler wakes
    with the policy's weights first, sleeps for each update and gets its weights after it."""
    problems = [cp.Problem("p", "", "theorem p : True"), cp.Problem("q", "", "theorem q : True")]
    rows = {
        "p": [rollout("p0", 2, True)] + [rollout("p", 2, False) for _ in range(3)],
        "q": [rollout("q", 2, True) for _ in range(4)],
    }
    monkeypatch.setattr(cp, "attempt_proofs", lambda *a, **kw: rows)
    monkeypatch.setattr(cp, "whole_proof_labels", lambda *a, **kw: [])
    updated = []

    def update(policy, optimizer, examples, lr, args, dist):
        updated.append(examples)
        return {}

    monkeypatch.setattr(cp, "update", update)
    a = args(iterations=1, grpo_steps_per_round=2, prompts_per_step=2, samples_per_prompt=4)
    sampler = Asleep()
    stats, attempts, labels, trained = cp.grpo_round(
        sampler, None, None, None, train_set=problems, first_batch=0, args=a, dist=CPU
    )
    assert trained == 2 * 4 and len(attempts) == 2 * 8 and len(updated) == 2
    assert sampler.calls == ["sync", "sleep", "sync", "sleep", "sync"]
    monkeypatch.setattr(cp, "proof_reward", lambda attempt, args: 0.0)
    _, _, _, trained = cp.grpo_round(
        Asleep(), None, None, None, train_set=problems, first_batch=0, args=a, dist=CPU
    )
    assert trained == 0


def test_a_hanging_proof_times_out_and_earns_nothing(tmp_path):
    row = ROWS[0]
    p = PROBLEMS[row["name"]]
    good = "```lean4\n" + p.statement + "\n" + "\n".join("  " + t for t in row["proof"]) + "\n```"
    hang = (
        "```lean4\n"
        + p.statement
        + "\n  fake_hang\n"
        + "\n".join("  " + t for t in row["proof"])
        + "\n```"
    )
    sampler = SimpleNamespace(
        llm=None,
        generate=lambda prompts, n, **kw: [
            [cp.Sample(t, [], [], [], "stop") for t in (good, hang)] for _ in prompts
        ],
    )
    with LeanVerifier(repl_cmd=STAND_IN, workers=1, timeout=2) as v:
        attempts = cp.attempt_proofs(
            sampler, v, [p], n=2, temperature=1.0, key="k", args=args(), dist=CPU
        )
    assert list(attempts) == [p.id]  # keyed by the problem's id
    row_attempts = attempts[p.id]
    assert [(a.status, float(a.correct)) for a in row_attempts] == [
        ("valid", 1.0),
        ("timeout", 0.0),
    ]


# ---- parsing model output ----
def test_load_problems(tmp_path):
    assert len(PROBLEMS) == 5 and all(p.statement.endswith(":= by") for p in PROBLEMS.values())
    assert len(cp.load_problems(str(REPO / "data" / "minif2f.jsonl"), split="test")) == 244
    rows = [
        {
            "name": "a",
            "formal_statement": "import Mathlib\nopen Real\n\ntheorem a : (1 : ℝ) = 1 := by sorry",
        },
        {
            "name": "a",
            "formal_statement": "theorem a2 : True :=",
        },  # a repeated name, ':=' gets ' by'
        {"name": "c", "formal_statement": "theorem c (h : sorry) : True := by"},
    ]  # sorry inside: skipped
    (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    a, b = cp.load_problems(str(tmp_path / "s.jsonl"))
    assert (a.id, a.header, a.statement) == (
        "a",
        "import Mathlib\nopen Real\n\n",
        "theorem a : (1 : ℝ) = 1 := by",
    )
    assert (b.id, b.header, b.statement) == ("a#1", DEFAULT_HEADER, "theorem a2 : True := by")


def test_rollout_prompts_cover_each_epoch():
    problems = [cp.Problem(str(i), "", "") for i in range(5)]
    ids = [
        p.id for step in range(15) for p in cp.rollout_prompts(problems, step, 2, seed=1)
    ]  # 6 epochs of 5
    epochs = [tuple(ids[i : i + 5]) for i in range(0, 30, 5)]
    assert all(sorted(e) == [str(i) for i in range(5)] for e in epochs) and len(set(epochs)) > 1
    assert [p.id for p in cp.rollout_prompts(problems, 3, 2, 1)] == ids[6:8]


# ---- the search on the stand-in REPL's tactic table ----
def test_tactic_prompt_ends_at_the_newline(tiny_model_dir, verifier):
    """The tactic prompt ends at the line break, so its last token holds no indentation (it was the
    embedded tokenizer's '\\n  ', a token natural text never has before a tactic: '\\n ' then ' exact'); the model
    writes the indentation and the search strips it."""
    tok, p = cp.load_tokenizer(tiny_model_dir), PROBLEMS["search_and_le"]
    goals = "\n".join("  " + line for line in ROWS[0]["goal"].split("\n"))
    prompt = cp.TACTIC_PROMPT.format(
        header=p.header, statement=p.statement, goals=goals, proof=p.statement
    )
    ids = cp.encode_prompt(tok, prompt)
    assert (
        tok.decode(ids[-1:]) == "\n"
        and tok.decode(ids[-2:]).endswith("/\n")
        and prompt.endswith("  -/\n")
    )
    tactic = tok("  exact h₀.le", add_special_tokens=False).input_ids
    assert tok.decode(ids + tactic) == tok.decode(ids) + "  exact h₀.le"
    table = {
        "⊢ 0 < b ∧ a ≤ b": "constructor",
        "⊢ 0 < b": "exact Nat.lt_trans h₁ h₀",
        "⊢ a ≤ b": "exact Nat.le_of_lt h₀",
    }
    sampler = Scripted(lambda goal: [("  " + table["⊢ " + goal.split("⊢ ")[-1]], -1.0, "stop")])
    [tree] = cp.best_first_search(sampler, verifier, [p], None, "k", args())
    assert tree.proof == list(table.values())  # the indentation the model wrote is stripped


def test_search_order_merging_and_labels(verifier):
    """search_and_le: `constructor` and `refine ⟨?_, ?_⟩` reach the same goals (only the case tags differ): merged.
    From the split state, `exact h₀.le`... the scripted values decide which state is expanded next."""
    p = PROBLEMS["search_and_le"]
    good = {"⊢ 0 < b": ["exact Nat.lt_trans h₁ h₀"], "⊢ a ≤ b": ["exact Nat.le_of_lt h₀"]}

    def propose(goal):
        target = "⊢ " + goal.split("⊢ ")[-1]
        if target == "⊢ 0 < b ∧ a ≤ b":
            return [
                ("refine ⟨?_, ?_⟩", -2.0, "stop"),
                ("constructor", -0.1, "stop"),
                ("exact h₀", -0.1, "stop"),
            ]
        return [(t, -1.0, "stop") for t in good[target]]

    values = {
        "0 < b": 0.9
    }  # V by the first goal's target: the split state (first goal 0 < b) is promising
    score = lambda texts: [values.get(t.split("\n\n")[0].split("⊢ ")[-1], 0.1) for t in texts]  # noqa: E731
    sampler = Scripted(propose)
    [tree] = cp.best_first_search(sampler, verifier, [p], score, "k", args(max_expansions=10))
    assert [g.split("⊢ ")[-1] for g in sampler.asked] == ["0 < b ∧ a ≤ b", "0 < b", "a ≤ b"]
    assert tree.proof == [
        "refine ⟨?_, ?_⟩",
        "exact Nat.lt_trans h₁ h₀",
        "exact Nat.le_of_lt h₀",
    ]  # the first path in
    assert (tree.expansions, tree.merged, tree.edges, tree.failed_edges) == (
        3,
        1,
        5,
        1,
    )  # `exact h₀` fails
    labels = sorted(label.value for label in tree.labels)
    assert labels == pytest.approx([0.95**3, 0.95**2, 0.95])
    # the root only (the official labels)
    [tree] = cp.best_first_search(
        Scripted(propose), verifier, [p], score, "k", args(value_labels="root")
    )
    assert [label.value for label in tree.labels] == pytest.approx([0.95**3])


def test_search_priority_orders_expansions(verifier):
    """search_imp_chain: the root's children `intro hp` (log-prob -0.1 a token) and `intro h` (-3 a token, but V 0.9
    against 0.2). Log-prob only (alpha 1), `intro hp` is expanded next; at the default alpha 0.3 and with pure value,
    `intro h` (0.3 e^-3 + 0.7 * 0.9 = 0.645 against 0.3 e^-0.1 + 0.7 * 0.2 = 0.411). The official unnormalised sum,
    0.3 * (-9) + 0.63 against 0.3 * (-0.3) + 0.14, would have picked `intro hp`: the log-prob decides."""
    p = PROBLEMS["search_imp_chain"]

    def propose(goal):
        return (
            [("intro hp", -0.1, "stop"), ("intro h", -3.0, "stop")]
            if goal.endswith("⊢ p → s")
            else [("exfalso", -1.0, "stop")]
        )

    score = lambda texts: [0.9 if "\nh : p\n" in t else 0.2 for t in texts]  # noqa: E731
    for alpha, hypothesis in [(1.0, "\nhp : p\n"), (0.3, "\nh : p\n"), (0.0, "\nh : p\n")]:
        sampler = Scripted(propose)
        [tree] = cp.best_first_search(
            sampler, verifier, [p], score, "k", args(max_expansions=2, alpha=alpha)
        )
        assert (
            tree.expansions == 2 and len(sampler.asked) == 2 and hypothesis in sampler.asked[1]
        ), alpha


def test_malformed_tactics_become_failed_edges(verifier):
    p = PROBLEMS["search_exists_double"]
    junk = [
        ("", -1.0, "stop"),
        ("   ", -1.0, "stop"),
        ("refine ⟨3,", -1.0, "length"),
        ("use 3", -1.0, "abort"),
        ("```", -1.0, "stop"),
        ("sorry", -1.0, "stop"),
        ("(((", -1.0, "stop"),
        ("#exit", -1.0, "stop"),
        ("\u2028\x00 garbage ⟨⟩", -1.0, "stop"),
        ("norm_num", -1.0, "stop"),
        ("fake_crash", -1.0, "stop"),
    ]
    [tree] = cp.best_first_search(
        Scripted(lambda goal: junk), verifier, [p], None, "k", args(num_sampled_tactics=len(junk))
    )
    assert (
        tree.proof is None and tree.expansions == 1 and tree.edges == tree.failed_edges == len(junk)
    )
    assert [label[:2] for label in tree.labels] == [
        (ROWS[3]["goal"], 0.0)
    ]  # the expanded root, on failed paths only
    # a theorem whose root cannot even be started is a search with no expansion
    bad = cp.Problem("bad", p.header, "theorem bad (h : sorry) : True := by")
    [tree] = cp.best_first_search(Scripted(lambda goal: junk), verifier, [bad], None, "k", args())
    assert (tree.proof, tree.expansions, tree.labels) == (None, 0, [])


def test_search_budget_and_sharding(verifier, monkeypatch):
    """Each theorem runs its max_expansions (search_imp_chain: `intro hp` opens a state, then `exfalso` another) or
    until its queue is empty (search_odd_ne_zero: both tactics fail at the root); with no time, nothing is expanded.
    Rank 1 of 2 searches only its share (the odd positions) and the gather puts every result in its place."""
    p, odd, both = (
        PROBLEMS["search_imp_chain"],
        PROBLEMS["search_odd_ne_zero"],
        PROBLEMS["search_and_le"],
    )
    sampler = Scripted(lambda goal: [("exfalso", -1.0, "stop"), ("intro hp", -1.0, "stop")])
    trees = cp.search(
        sampler, verifier, [p, odd], None, "k", args(max_expansions=2, search_batch=2), CPU
    )
    assert [(t.id, t.expansions, t.nodes, t.edges, t.failed_edges) for t in trees] == [
        (p.id, 2, 3, 4, 2),
        (odd.id, 1, 1, 2, 2),
    ]
    assert len(sampler.asked) == 3 and all(t.seconds > 0 for t in trees)
    [tree] = cp.search(sampler, verifier, [p], None, "k", args(search_timeout=0.0), CPU)
    assert tree.expansions == 0  # no time at all
    gathered = []
    # rank 0's part, {position: result}, as the gather brings it
    monkeypatch.setattr(
        cp,
        "all_gather_objects",
        lambda obj, dist: gathered.append(obj) or [{0: "r0", 2: "r0'"}, obj],
    )
    sampler = Scripted(lambda goal: [("exfalso", -1.0, "stop")])
    out = cp.search(
        sampler,
        verifier,
        [p, odd, both],
        None,
        "k",
        args(max_expansions=1),
        cp.Dist(1, 2, 2, torch.device("cpu"), False),
    )
    assert (
        out[0] == "r0"
        and out[2] == "r0'"
        and out[1].id == odd.id
        and [{i: r.id for i, r in part.items()} for part in gathered] == [{1: odd.id}]
    )
    assert sampler.asked == [ROWS[1]["goal"]]


def test_search_budget_is_a_cap_and_each_theorem_pays_its_own_time(verifier):
    """A theorem stops applying its tactics once its budget is spent, within a step too (the overshoot is
    its last tactic), and is charged its own tactics' time, not the lockstep batch's wall clock."""
    slow, quick = PROBLEMS["search_imp_chain"], PROBLEMS["search_odd_ne_zero"]

    def propose(
        goal,
    ):  # five failing tactics of 0.4 s each for one theorem, two instant ones for the other
        return (
            [(f"t{i} fake_slow 0.4", -1.0, "stop") for i in range(5)]
            if "⊢ p → s" in goal
            else [("exfalso", -1.0, "stop"), ("norm_num", -1.0, "stop")]
        )

    a = args(num_sampled_tactics=5, search_timeout=1.0, max_expansions=1)
    t0 = time.monotonic()
    trees = cp.best_first_search(Scripted(propose), verifier, [slow, quick], None, "k", a)
    wall = time.monotonic() - t0
    assert (
        trees[0].edges == trees[0].failed_edges == 3
    )  # 0.4, 0.8, 1.2 s: spent; two tactics never run
    assert 1.2 <= trees[0].seconds < 1.6 and trees[1].edges == 2 and trees[1].seconds < 0.25 < wall
    assert trees[0].role_seconds["env"] >= 1.2 and not trees[0].proved


# ---- the shared search (the same expectations in test_rir.py) ----
class ScriptedLean:
    """A verifier double: table[(goal, tactic)] is the goals after the tactic ([]: solved) or an
    error; each tactic takes `cost` seconds (its state's time); `invalid` lists tactic paths the
    kernel rejects. Records each apply_tactics call's tactics."""

    workers = 2

    def __init__(self, table, cost=0.0, invalid=()):
        self.table, self.cost, self.invalid, self.calls = table, cost, set(map(tuple, invalid)), []

    def start_proofs(self, items):
        return [TacticState(0, ["⊢ A"], header=h, statement=s) for h, s in items]

    def apply_tactics(self, steps):
        self.calls.append([tactic for _, tactic in steps])
        return [self.apply(state, tactic) for state, tactic in steps]

    def apply(self, state, tactic):
        goals = self.table.get((state.goals[0], tactic), "unknown tactic")
        tactics = state.tactics + [tactic]
        if isinstance(goals, str):
            return TacticState(
                None, [], error=goals, status="error", tactics=tactics, time=self.cost
            )
        status = "open" if goals else "solved"
        return TacticState(
            1, goals, solved=not goals, status=status, tactics=tactics, time=self.cost
        )

    def check_tactic_path(self, state):
        return SimpleNamespace(valid=tuple(state.tactics) not in self.invalid)

    def free_states(self):
        return 0


# root A: t1 and t2 reach B (t2 merges), bad fails, t3 reaches C; B's `win` closes the proof
TABLE = {
    ("⊢ A", "t1"): ["⊢ B"],
    ("⊢ A", "t2"): ["⊢ B"],
    ("⊢ A", "t3"): ["⊢ C"],
    ("⊢ B", "win"): [],
    ("⊢ C", "t4"): ["⊢ D"],
}
PROPOSE = {"⊢ A": ["t1", "t2", "bad", "t3"], "⊢ B": ["win"], "⊢ C": ["t4"], "⊢ D": ["t4"]}
THEOREM = cp.Problem("t", "", "theorem t : A := by")


def scripted_prover(lp=-1.0):
    """The prover double: PROPOSE's tactics for the node's first goal, `lp` a token."""
    return Scripted(lambda goal: [(t, lp, "stop") for t in PROPOSE.get(goal, [])])


def test_the_shared_search_counts_nodes_merges_and_the_path():
    """nodes: distinct open states, the root included (A, B, C; not the error, not the proof);
    merged: t2 reached the known B; the proof's path as Triples, "no goals" after the last."""
    lean = ScriptedLean(TABLE, cost=1.0)
    a = args(num_sampled_tactics=4)
    [result] = cp.best_first_search(scripted_prover(), lean, [THEOREM], None, "k", a, lambda: 0.0)
    assert result.proved and result.proof == ["t1", "win"] and result.expansions == 2
    assert (result.nodes, result.merged, result.edges, result.failed_edges) == (3, 1, 5, 1)
    assert result.path == [("⊢ A", "t1", "⊢ B"), ("⊢ B", "win", cp.NO_GOALS)]
    # charged: the five tactics of 1 s (the clock stands still: sampling takes no time)
    assert result.seconds == result.role_seconds["env"] == 5.0
    # the kernel rejects the proof: a failed edge, and the search goes on
    lean = ScriptedLean(TABLE, invalid=[["t1", "win"]])
    [result] = cp.best_first_search(scripted_prover(), lean, [THEOREM], None, "k", a)
    assert result.proof is None and result.path == [] and not result.proved
    assert (result.expansions, result.failed_edges) == (4, 3)  # bad, the rejected win, t4 at D


def test_the_shared_search_reads_the_budget_before_each_tactic():
    """Tactics of 1 s, a 2.5 s budget: the third tactic starts at 2 s and runs, the fourth is never
    tried; a proof whose tactic ends past the budget is a proof, not proved (proved_overrun)."""
    lean = ScriptedLean(TABLE, cost=1.0)
    a = args(num_sampled_tactics=4, search_timeout=2.5)
    [result] = cp.best_first_search(scripted_prover(), lean, [THEOREM], None, "k", a, lambda: 0.0)
    assert lean.calls == [["t1"], ["t2"], ["bad"]] and result.seconds == 3.0
    assert result.expansions == 1 and not result.proved
    lean = ScriptedLean({("⊢ A", "win"): []}, cost=3.0)
    propose = Scripted(lambda goal: [("win", -1.0, "stop")])
    [late] = cp.best_first_search(propose, lean, [THEOREM], None, "k", a, lambda: 0.0)
    assert late.proof == ["win"] and not late.proved and late.seconds == 3.0
    metrics = cp.search_metrics([late, result], "search", 1.0)
    assert (metrics["search/proved"], metrics["search/proved_overrun"]) == (0.0, 1.0)


def test_the_shared_search_runs_in_lockstep(monkeypatch):
    """One sampling call a round for every live theorem, and one apply_tactics call for the i-th
    tactic of every theorem (here 2 theorems, 2 rounds: 2 sampling calls of 2 prompts)."""
    calls = []
    real = cp.sample

    def counting(sampler, prompts, **kw):
        calls.append(len(prompts))
        return real(sampler, prompts, **kw)

    monkeypatch.setattr(cp, "sample", counting)
    endless = {("⊢ A", "t1"): ["⊢ B"], ("⊢ B", "t1"): ["⊢ C"], ("⊢ A", "t2"): ["⊢ D"]}
    lean = ScriptedLean(endless)
    other = cp.Problem("u", "", "theorem u : A := by")
    propose = Scripted(lambda goal: [("t1", -1.0, "stop"), ("t2", -2.0, "stop")])
    a = args(max_expansions=2, num_sampled_tactics=2)
    results = cp.best_first_search(propose, lean, [THEOREM, other], None, "k", a)
    assert calls == [2, 2] and [r.expansions for r in results] == [2, 2]
    assert lean.calls == [["t1", "t1"], ["t2", "t2"], ["t1", "t1"], ["t2", "t2"]]


def test_search_metrics_by_hand():
    """Proofs per second divide by the phase's wall time (not the theorems' summed seconds);
    proved counts proofs within the budget, proved_overrun those past it; each role's seconds."""

    def r(proof, proved, seconds, exp):
        return cp.SearchResult(
            id="t",
            proof=proof,
            proved=proved,
            seconds=seconds,
            expansions=exp,
            nodes=5,
            edges=10,
            failed_edges=4,
            merged=1,
            role_seconds={"prover": seconds / 2, "env": seconds / 2},
            path=[],
            path_edges=[],
            labels=[],
        )

    results = [r(["a", "b"], True, 3.0, 2), r(None, False, 7.5, 6), r(["c"], True, 2.0, 1)]
    metrics = cp.search_metrics(results + [r(["d"], False, 9.0, 1)], "search", 4.0)
    assert metrics == pytest.approx(
        {
            "search/theorems": 4,
            "search/proved": 2,
            "search/pass@1": 2 / 4,
            "search/proved_overrun": 1,
            "search/proofs_per_expansion": 2 / 10,
            "search/proofs_per_second": 0.5,
            "search/expansions_per_proof": 1.5,
            "search/nodes_per_proof": 5,
            "search/proof_length": 1.5,
            "search/expansions": 10,
            "search/merged": 4,
            "search/failed_edge_share": 0.4,
            "search/search_time_proved": 2.5,
            "search/search_time_proved_median": 2.5,
            "search/env_seconds": 10.75,
            "search/env_time_proved": 1.25,
            "search/prover_seconds": 10.75,
            "search/prover_time_proved": 1.25,
        }
    )
    assert cp.search_metrics([], "search", 0.0)["search/pass@1"] == 0.0


def test_logprob_only_search_is_reprovers(verifier):
    """Without a value model the priority is ReProver's cumulative log-prob, not exp(mean token log-prob):
    after the root (`intro hp` at -0.1 a token, `intro h` at -0.5) and `intro hp`'s state (`apply hrs` at -0.6 a
    token), `intro h`'s state (-1.5 in all, -0.5 a token) goes before `apply hrs`'s (-2.1 in all, -0.35 a token)."""
    table = {
        "⊢ p → s": [("intro hp", -0.1, "stop"), ("intro h", -0.5, "stop")],
        "⊢ s": [("apply hrs", -0.6, "stop")],
        "⊢ r": [("apply hqr", -0.6, "stop")],
    }
    sampler = Scripted(lambda goal: table.get("⊢ " + goal.split("⊢ ")[-1], []))
    [tree] = cp.best_first_search(
        sampler, verifier, [PROBLEMS["search_imp_chain"]], None, "k", args(max_expansions=3)
    )
    assert tree.expansions == 3 and sampler.asked[2].endswith(
        "\nh : p\n⊢ s"
    )  # normalised: "hp : p\n⊢ r"


# ---- whole proofs: replay for labels, the frontier filter ----
def test_whole_proof_labels(verifier):
    p = PROBLEMS["search_and_le"]
    code = p.statement + "\n  constructor\n  · exact Nat.lt_trans h₁ h₀\n  · exact Nat.le_of_lt h₀"
    helper = (
        "lemma aux : True := trivial\n"
        + p.statement
        + "\n  constructor\n  · exact aux.elim\n  · omega"
    )
    row = [
        cp.Attempt(None, code, "valid", True),
        cp.Attempt(None, None, "error", False),
        cp.Attempt(None, helper, "valid", True),
    ]
    labels = cp.whole_proof_labels(verifier, [p], {p.id: row}, args(), CPU)
    root = ROWS[0]["goal"]
    # the failed attempt: root 0; the proof of 3 steps: root 0.95^3, then the two states after each step; the one whose
    # replay fails (its lemma is not in the REPL's environment) labels its root only
    assert [(label.state == root, round(label.value, 6)) for label in labels] == [
        (True, 0.0),
        (True, round(0.95**3, 6)),
        (True, round(0.95**3, 6)),
        (False, round(0.95**2, 6)),
        (False, 0.95),
    ]
    root_only = cp.whole_proof_labels(verifier, [p], {p.id: row}, args(value_labels="root"), CPU)
    assert [label.value for label in root_only] == pytest.approx([0.0, 0.95**3, 0.95**3])


def test_whole_proof_labels_count_at_least_one_step(verifier):
    """A term-mode proof labels its root gamma^1 (the collector's floor), not gamma^0 = 1; a proof whose
    'by' is on the next line is replayed; a #check after the proof is not a step."""
    p = PROBLEMS["search_and_le"]
    term = p.statement.removesuffix(" by") + " ⟨Nat.lt_trans h₁ h₀, Nat.le_of_lt h₀⟩"
    split = p.statement.removesuffix(" by") + (
        "\n  by\n  constructor\n  · exact Nat.lt_trans h₁ h₀\n"
        "  · exact Nat.le_of_lt h₀\n\n#check search_and_le"
    )
    row = [cp.Attempt(None, term, "valid", True), cp.Attempt(None, split, "valid", True)]
    labels = cp.whole_proof_labels(verifier, [p], {p.id: row}, args(), CPU)
    assert [label.value for label in labels] == pytest.approx([0.95, 0.95**3, 0.95**2, 0.95])


def test_frontier_filter_keeps_one_to_six_of_eight():
    """filter_dataset.py's frontier with its check fixed: a pass is a proof Lean accepts (the official code counts a
    sample as passed only when kimina sends no response: a timeout or server error)."""
    problems = [
        cp.Problem(f"p{c}", "", f"theorem p{c} : True := by") for c in range(9)
    ]  # p<c>: c of 8 proofs pass
    sampler = SimpleNamespace(
        llm=None,
        generate=lambda prompts, n, **kw: [
            [
                cp.Sample(
                    f"```lean4\nok{j}\n```"
                    if j < int(prompt.split("theorem p")[1][0])
                    else "```lean4\nno\n```",
                    [],
                    [],
                    [],
                    "stop",
                )
                for j in range(n)
            ]
            for prompt in prompts
        ],
    )
    lean = SimpleNamespace(
        verify=lambda jobs: [
            LeanResult(valid="ok" in j.proof, status="valid" if "ok" in j.proof else "error")
            for j in jobs
        ]
    )
    lean.verify_attempts = lambda *a, **kw: LeanVerifier.verify_attempts(
        lean, *a, **kw
    )  # the grid over `verify`
    kept = cp.frontier_filter(sampler, lean, problems, args(), CPU)
    assert kept == ["p1", "p2", "p3", "p4", "p5", "p6"]
    assert cp.frontier_filter(sampler, lean, problems, args(frontier_max=7), CPU)[-1] == "p7"


# ---- the value model and the prover update learn ----
def test_value_head_learns_a_labelled_set(tiny_model_dir):
    """The file's own value update on a fixed labelled set of 8 states: the loss falls and V orders them."""
    tok = cp.load_tokenizer(tiny_model_dir)
    tok.truncation_side = "left"
    a = args(
        value_learning_rate=1e-2,
        value_warmup_steps=0,
        value_epochs=30,
        value_batch_size=8,
        value_micro_batch_size=8,
        positive_oversample=1,
        gradient_checkpointing=False,
    )
    model = cp.load_value_model(tiny_model_dir, CPU, a)
    head = [t.detach().clone() for t in model.value_head.parameters()]
    goals = sorted({t["goal"] for r in ROWS for t in r["transitions"]})[:8]
    labels = [cp.Label(g, 0.9 if i % 2 else 0.0) for i, g in enumerate(goals)]
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], a.value_learning_rate
    )
    stats = cp.update_value(model, optimizer, tok, labels, cp.random.Random(0), a, CPU)
    print(stats)
    assert (
        stats["losses/value_loss"] < 0.2 * stats["losses/value_loss_first_epoch"]
        and stats["value/steps"] == 30
    )
    assert any(not torch.equal(h, t) for h, t in zip(head, model.value_head.parameters()))
    values = cp.value_scorer(model, tok, a, CPU)(goals)
    assert model.training and np.corrcoef(values, [label.value for label in labels])[0, 1] > 0.8
    # positives are repeated positive_oversample times
    assert (
        cp.update_value(
            model,
            optimizer,
            tok,
            labels[:2],
            cp.random.Random(0),
            args(value_epochs=1, value_batch_size=64),
            CPU,
        )["value/examples"]
        == 4
    )


def test_value_batches_are_slices_of_the_epoch(monkeypatch):
    """Each step takes its batch as one slice of the epoch's order (never the rest of the epoch copied),
    every label once an epoch."""
    taken, batches = [], []

    class Order(list):  # records the length of every slice taken
        def __getitem__(self, i):
            taken.append(len(range(*i.indices(len(self)))) if isinstance(i, slice) else 1)
            return super().__getitem__(i)

    class Rng(cp.random.Random):
        def sample(self, population, k):
            return Order(super().sample(population, k))

    monkeypatch.setattr(
        cp,
        "train_step",
        lambda m, o, batch, *a, **k: batches.append(batch) or dict(loss=0.0, grad_norm=0.0),
    )
    labels = [cp.Label(str(i), 0.0) for i in range(10)]
    stats = cp.update_value(
        None, None, None, labels, Rng(0), args(value_epochs=2, value_batch_size=4), CPU
    )
    assert (
        [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
        and stats["value/steps"] == 6
        and max(taken) == 4
    )
    assert (
        sorted(x for b in batches[:3] for x in b)
        == sorted(labels)
        == sorted(x for b in batches[3:] for x in b)
    )


def test_value_scorer_copy_is_filled_a_tensor_at_a_time(tiny_model_dir, monkeypatch):
    """Under torchrun each rank's scoring copy of the value model is filled one gathered tensor at a time
    (never the whole model gathered at once), and scores as the model does. One process poses as rank 0 of 2: the
    copy path, with full_state_dict_items handing out fresh tensors as a gather does."""
    a = args(gradient_checkpointing=False, value_backbone=tiny_model_dir)
    tok = cp.load_tokenizer(tiny_model_dir)
    model = cp.load_value_model(tiny_model_dir, CPU, a)
    with torch.no_grad():  # weights the directory does not have
        model.value_head[2].bias.fill_(0.3)
        model.model.layers[0].mlp.up_proj.weight.mul_(3.0)
    alive, peaks = weakref.WeakSet(), []

    def gathered(policy, dtype=None):
        for name, tensor in policy.state_dict().items():
            alive.add(tensor := tensor.detach().clone())
            peaks.append(len(alive))
            yield name, tensor

    monkeypatch.setattr(cp, "full_state_dict_items", gathered)
    goals = sorted({t["goal"] for r in ROWS for t in r["transitions"]})[:4]
    copied = cp.value_scorer(model, tok, a, cp.Dist(0, 2, 2, torch.device("cpu"), True))(goals)
    assert len(peaks) == len(model.state_dict()) > 10 and max(peaks) <= 2
    assert copied == pytest.approx(cp.value_scorer(model, tok, a, CPU)(goals), abs=1e-6)


def test_checkpoint_directories_hold_each_models_tokenizer(tiny_model_dir, tmp_path, monkeypatch):
    """value/ holds the value model's tokenizer before the checkpoint's atomic rename (the block writes
    one tokenizer into every model's directory; writing the right one after the rename left a window)."""
    tok, value_tok = cp.load_tokenizer(tiny_model_dir), cp.load_tokenizer(tiny_model_dir)
    value_tok.add_tokens(["<only-the-value-model-has-it>"])
    models = {
        name: (cp.load_model(tiny_model_dir, CPU, train=False), None)
        for name in ("prover", "value")
    }
    replace, renamed = os.replace, []

    def spy(src, dst):  # the checkpoint's rename into place
        if pathlib.Path(src).name.startswith(".tmp_iter_"):
            renamed.append(
                {name: len(cp.load_tokenizer(str(pathlib.Path(src) / name))) for name in models}
            )
        replace(src, dst)

    monkeypatch.setattr(cp.os, "replace", spy)
    cp.save_checkpoint(tmp_path, 1, models, cp.Tokenizers(prover=tok, value=value_tok), {}, CPU)
    assert renamed == [{"prover": len(tok), "value": len(tok) + 1}]


def test_value_model_directory_brings_its_head(tiny_model_dir, tmp_path):
    a = args(gradient_checkpointing=False)
    model = cp.load_value_model(tiny_model_dir, CPU, a)
    assert torch.equal(
        model.value_head[0].weight, cp.load_value_model(tiny_model_dir, CPU, a).value_head[0].weight
    )
    with torch.no_grad():
        model.value_head[2].bias.fill_(0.123)
    model.save_pretrained(tmp_path / "value")
    loaded = cp.load_value_model(str(tmp_path / "value"), CPU, a)
    assert loaded.value_head[2].bias.item() == pytest.approx(0.123)
    assert (
        loaded.value_head.trained and not model.value_head.trained
    )  # main warns before a seed-0 head would guide
    frozen = cp.load_value_model(tiny_model_dir, CPU, args(freeze_value_backbone=True))
    assert [n for n, p in frozen.named_parameters() if p.requires_grad] == [
        "value_head.0.weight",
        "value_head.0.bias",
        "value_head.2.weight",
        "value_head.2.bias",
    ]


def test_update_learns_what_the_reward_favours(tiny_model_dir):
    """The file's own update path: Lean's verdicts (rewards) -> grpo_advantages -> update. When only one fixed
    proof is accepted, its probability rises over 20 updates; when only the others are, it falls."""
    torch.manual_seed(0)
    tok = cp.load_tokenizer(tiny_model_dir)
    p = PROBLEMS["search_exists_double"]
    prompt_ids = cp.encode_prompt(
        tok, cp.PROVER_PROMPT.format(header=p.header, statement=p.statement)
    )
    texts = [
        "```lean4\nuse 3\n```",
        "```lean4\nnorm_num\n```",
        "```lean4\nrfl\n```",
        "```lean4\ndecide\n```",
    ]
    a = args(learning_rate=1e-3, weight_decay=0.0, micro_batch_size=4, gradient_checkpointing=False)

    def samples(policy):  # on-policy: the sampler's log-probs are the policy's own
        out = [
            cp.Sample(
                t,
                prompt_ids,
                tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id],
                [],
                "stop",
            )
            for t in texts
        ]
        with torch.no_grad():
            lp, _, _ = cp.token_logprobs(policy, out)
        return [s._replace(logprobs=lp[i, : len(s.token_ids)].tolist()) for i, s in enumerate(out)]

    def margin(policy):  # log p(the fixed proof) - the mean log p of the others
        lp = [sum(s.logprobs) for s in samples(policy)]
        return lp[0] - float(np.mean(lp[1:]))

    moved = {}
    for favoured in (True, False):
        policy = cp.load_model(tiny_model_dir, CPU, gradient_checkpointing=False)
        optimizer = torch.optim.AdamW(
            policy.parameters(), a.learning_rate, betas=a.adam_betas, weight_decay=0.0
        )
        before = margin(policy)
        for _ in range(20):
            group = [
                cp.Attempt(
                    s, None, "valid" if (i == 0) == favoured else "error", (i == 0) == favoured
                )
                for i, s in enumerate(samples(policy))
            ]
            stats = cp.update(policy, optimizer, cp.grpo_examples([group], a), None, a, CPU)
        moved[favoured] = (before, margin(policy))
        print(favoured, moved[favoured], stats)
    (b1, a1), (b2, a2) = moved[True], moved[False]
    assert (
        b1 == pytest.approx(b2) and a1 > b1 + 5.0 and a2 < b2 - 5.0
    )  # -6.9 -> 12.3 and -6.9 -> -22.8 here
    # a group whose samples all earn the same reward has no advantage: no optimizer step at all
    flat = [cp.Attempt(s, None, "error", False) for s in samples(policy)]
    assert cp.update(policy, optimizer, cp.grpo_examples([flat], a), None, a, CPU) == {}


def test_nothing_learned():
    """The line ending a run whose updates trained on no rollout (`trained` 0) counts Lean's verdicts; with no proof
    accepted it says every reward was 0 and names the test that shows the loop learning; a run that trained on a
    rollout, or had none at all, ends without it."""
    outcomes, a = (
        collections.Counter(["no_code"] * 7 + ["error"]),
        args(model="embedded:smollm2"),
    )
    note = cp.nothing_learned(outcomes, 0, a)
    assert (
        cp.nothing_learned(outcomes, 1, a) is None
        and cp.nothing_learned(collections.Counter(), 0, a) is None
    )
    assert "\n" not in note and "(7/8 no closed ```lean4 block, 1/8 Lean error)" in note
    assert "embedded:smollm2" in note and "test_loop_learns_what_the_stand_in_rewards" in note
    assert note.startswith("coprover.py: Lean accepted no GRPO rollout ")
    # Lean accepted proofs, but no update trained on one (a group all accepted; a reward fork)
    accepted = collections.Counter(["valid"] * 4 + ["error"] * 4)
    note = cp.nothing_learned(accepted, 0, a)
    assert "Lean accepted no GRPO rollout" not in note and "Lean accepted 4 proof(s)" in note
    assert "(4/8 valid, 4/8 Lean error)" in note and cp.nothing_learned(accepted, 3, a) is None


# ---- end to end (slow): the tiny model behind a driver that answers some prompts from the tactic table ----
# The tiny random model writes noise, so no search would find a proof and every GRPO reward would be 0. The driver
# wraps the real sampler and replaces a share of the samples with table tactics (search) or with the table's proof or
# a truncated one (whole proofs), re-scored by the model so that training sees consistent log-probs. Its choices use
# torch's RNG, which coprover seeds per prompt: the same on any number of ranks and after a resume.
DRIVER = r"""
import json, re, sys
import torch, tyro
sys.path.insert(0, REPO)
import coprover as cp
from lean_verify import goals_key

ROWS = [json.loads(line) for line in open(REPO + "/data/lean_tactics.jsonl") if line.strip()]
TABLE = {}
for row in ROWS:
    for t in row["transitions"]:
        TABLE.setdefault(goals_key([t["goal"]]), []).append(t["tactic"])


def canned(prompt):
    u = int(torch.randint(0, 4, (1,)))
    if "/- tactic state:" in prompt:
        goals = prompt.split("/- tactic state:\n")[-1].split("\n  -/")[0]
        first = "\n".join(line[2:] for line in goals.split("\n")).split("\n\n")[0]
        options = [t for t in TABLE.get(goals_key([first]), []) if "\n" not in t]
        return options[int(torch.randint(0, len(options), (1,)))] if options and u < 3 else None
    row = next((r for r in ROWS if r["formal_statement"] in prompt), None)
    if row is None or u == 3:
        return None
    proof = row["proof"] if u < 2 else row["proof"][:-1]
    return "```lean4\n" + row["formal_statement"] + "\n" + "\n".join("  " + t for t in proof) + "\n```"


class Driver:
    def __init__(self, inner):
        self.inner, self.tokenizer, self.llm = inner, inner.tokenizer, None

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc="generate"):
        out = self.inner.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                  stop=stop, desc=desc)
        for prompt, group in zip(prompts, out):
            for j, s in enumerate(group):
                text = canned(prompt)
                if text is not None:
                    ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                    new = cp.Sample(text, s.prompt_ids, ids, [0.0] * len(ids), "stop")
                    with torch.no_grad():
                        lp, _, _ = cp.token_logprobs(self.inner.model, [new], temperature, top_p)
                    group[j] = new._replace(logprobs=lp[0, : len(ids)].tolist())
        return out

    def sleep(self):
        self.inner.sleep()

    def sync_weights(self, policy):
        self.inner.sync_weights(policy)


Real = cp.Sampler
cp.Sampler = lambda *a, **k: Driver(Real(*a, **k))
cp.main(tyro.cli(cp.Args))
"""

SMALL = [
    "--dataset",
    "data/lean_tactics.jsonl",
    "--eval-dataset",
    "data/lean_tactics.jsonl",
    "--eval-split",
    "tactics",
    "--search-theorems-per-round",
    "5",
    "--num-sampled-tactics",
    "4",
    "--max-expansions",
    "4",
    "--tactic-max-new-tokens",
    "6",
    "--value-batch-size",
    "8",
    "--value-micro-batch-size",
    "8",
    "--value-max-length",
    "128",
    "--value-epochs",
    "1",
    "--value-warmup-steps",
    "1",
    "--grpo-steps-per-round",
    "1",
    "--prompts-per-step",
    "4",
    "--samples-per-prompt",
    "4",
    "--max-new-tokens",
    "12",
    "--learning-rate",
    "1e-3",
    "--micro-batch-size",
    "8",
    "--max-model-len",
    "1024",
    "--no-frontier-filter",
    "--eval-limit",
    "2",
    "--eval-samples",
    "2",
    "--eval-budgets",
    "1",
    "2",
    "--eval-search-limit",
    "1",
    "--no-gradient-checkpointing",
    "--backend",
    "hf",
    "--lean-workers",
    "1",
    "--no-freeze-value-backbone",
]  # the paper's value training whole


def driver_command(run_dir: pathlib.Path, model: str, *flags, torchrun=0) -> tuple[list, dict]:
    """SMALL through the driver (written next to run_dir) against the stand-in REPL: the command line and its env."""
    driver = run_dir.parent / "driver.py"
    driver.write_text(DRIVER.replace("REPO", repr(str(REPO))))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAN_", "SGS_", "KIMINA"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", LEAN_REPL_CMD=STAND_IN)
    head = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={torchrun}",
        ]
        if torchrun
        else [sys.executable]
    )
    return head + [
        str(driver),
        "--model",
        model,
        "--value-backbone",
        model,
        "--output-dir",
        str(run_dir.parent),
        "--run-name",
        run_dir.name,
        *SMALL,
        *flags,
    ], env


def run_driver(tmp: pathlib.Path, name: str, model: str, *flags):
    cmd, env = driver_command(tmp / name, model, *flags)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def metrics_of(run_dir: pathlib.Path) -> dict:
    """step -> the LAST metrics line of that step (a resumed run may log a step twice)."""
    return {
        row["step"]: row
        for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(next(pathlib.Path(path).glob("*.safetensors"))))


@pytest.mark.slow
def test_two_iterations_end_to_end(
    coprover_reference, tiny_model_dir
):  # conftest.py: two iterations, uninterrupted
    run_dir, done = coprover_reference.run_dir, coprover_reference.done
    assert (
        "lean_verify: 1 REPL(s) on each of the node's 1 rank(s)" in done.stdout
    )  # --lean-workers 1 on one rank
    rows = metrics_of(run_dir)
    assert sorted(rows) == [1, 2]
    for key in (
        "search/pass@1",
        "search/expansions_per_proof",
        "search/proofs_per_second",
        "value/new_labels",
        "losses/value_loss",
        "losses/grpo_loss",
        "losses/grpo_clipfrac",
        "charts/reward_mean",
        "eval/pass@1",
        "eval/pass@2",
        "eval/search_value/proofs_per_expansion",
        "eval/search_logprob/proofs_per_expansion",
        "time/search",
        "time/value",
        "time/grpo",
        "time/eval",
    ):
        assert all(key in r for r in rows.values()), key
    assert (
        rows[1]["search/value_guided"] == 0.0 and rows[2]["search/value_guided"] == 1.0
    )  # none in iteration 1
    assert (
        rows[1]["search/pass@1"] > 0 and rows[1]["value/new_positive_share"] > 0
    )  # the table's proofs
    assert (
        0 < rows[1]["charts/reward_mean"] < 1 and rows[2]["value/labels"] > rows[1]["value/labels"]
    )
    ckpt = run_dir / "checkpoints" / "iter_000002"
    assert (
        (ckpt / "prover.dcp").is_dir()
        and (ckpt / "value.dcp").is_dir()
        and (ckpt / "state.pt").exists()
    )
    base = weights(tiny_model_dir)
    for name in ("prover", "value"):  # both models trained
        trained = weights(ckpt / name)
        assert any(not torch.equal(base[k], trained[k]) for k in base), name
    head = cp.load_value_model(
        tiny_model_dir, CPU, args(gradient_checkpointing=False)
    ).value_head.state_dict()
    assert any(
        not torch.equal(v, weights(ckpt / "value")["value_head." + k]) for k, v in head.items()
    )
    state = torch.load(ckpt / "state.pt", weights_only=False)["state"]
    assert (
        state["grpo_step"] == 2
        and state["value_rounds"] == 2
        and len(state["labels"]) == rows[2]["value/labels"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--no-value-model", "--no-co-training"])
def test_ablations_run(tiny_model_dir, tmp_path, flag):
    iterations = "2" if flag == "--no-co-training" else "1"
    run_driver(
        tmp_path,
        "ablation",
        tiny_model_dir,
        "--iterations",
        iterations,
        "--eval-search-limit",
        "0",
        flag,
    )
    rows = metrics_of(tmp_path / "ablation")
    if flag == "--no-value-model":
        assert all(
            "losses/value_loss" not in r and r["search/value_guided"] == 0.0 for r in rows.values()
        )
        assert not (tmp_path / "ablation" / "checkpoints" / "iter_000001" / "value.dcp").exists()
    else:
        assert "losses/value_loss" in rows[1] and "losses/value_loss" not in rows[2]
        assert rows[2]["search/value_guided"] == 1.0  # the value model of iteration 1 still guides


@pytest.mark.slow
def test_evaluation_only_from_a_checkpoint(coprover_reference, tmp_path):
    """--iterations 0 with a checkpoint's prover and value directories (the value head comes with its directory)."""
    ckpt = coprover_reference.run_dir / "checkpoints" / "iter_000002"
    done = run_driver(
        tmp_path,
        "eval",
        str(ckpt / "prover"),
        "--iterations",
        "0",
        "--value-backbone",
        str(ckpt / "value"),
    )
    [row] = metrics_of(tmp_path / "eval").values()
    assert row["step"] == 0 and "eval/pass@2" in row and "eval/search_value/pass@1" in row
    assert (
        "search/theorems" not in row and "no trained value head" not in done.stdout
    )  # no training iteration
    saved = weights(
        ckpt / "value"
    )  # the head the evaluation loads is the trained one, not the seed-0 head
    head = cp.load_value_model(
        str(ckpt / "value"), CPU, args(gradient_checkpointing=False)
    ).value_head
    assert head.trained and all(
        torch.equal(v, saved["value_head." + k]) for k, v in head.state_dict().items()
    )


@pytest.mark.slow
def test_evaluation_only_without_a_trained_value_head(tiny_model_dir, tmp_path):
    """--iterations 0 with a value backbone that has no value head: the evaluation says so and searches by log-prob
    only (a seed-0 head would guide the search at random)."""
    done = run_driver(tmp_path, "base", tiny_model_dir, "--iterations", "0")
    [row] = metrics_of(tmp_path / "base").values()
    assert "no trained value head" in done.stdout and "eval/search_logprob/pass@1" in row
    assert not any(k.startswith("eval/search_value/") for k in row)


@pytest.mark.slow
def test_cpu_default_runs_on_the_embedded_model(tmp_path):
    if not (pathlib.Path(cp.resolve_model(cp.EMBEDDED_MODEL)) / "config.json").exists():
        pytest.skip("the embedded model is not installed (bash setup.sh)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAN_", "SGS_", "KIMINA"))}
    env.update(OMP_NUM_THREADS="1", LEAN_REPL_CMD=STAND_IN + " --accept hash:0.3")
    done = subprocess.run(
        [
            sys.executable,
            "coprover.py",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "embedded",
            "--iterations",
            "1",
            "--search-theorems-per-round",
            "2",
            "--max-expansions",
            "2",
            "--num-sampled-tactics",
            "2",
            "--tactic-max-new-tokens",
            "8",
            "--prompts-per-step",
            "2",
            "--samples-per-prompt",
            "2",
            "--max-new-tokens",
            "16",
            "--eval-limit",
            "1",
            "--eval-samples",
            "2",
            "--eval-budgets",
            "1",
            "2",
            "--eval-search-limit",
            "0",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "No CUDA" in done.stdout and "smollm2" in done.stdout
    [row] = metrics_of(tmp_path / "embedded").values()
    assert row["search/theorems"] == 2 and "losses/value_loss" in row and "eval/pass@2" in row
    # a run whose rollouts were never rewarded says so once, at the end, with Lean's verdicts
    note = [line for line in done.stdout.splitlines() if "Lean accepted no GRPO rollout" in line]
    assert len(note) == (row["charts/reward_mean"] == 0) and (not note or "/4 " in note[0]), (
        done.stdout[-2000:]
    )
    print(*note)


# ---- the loop learns (slow): main() on a primed model, rewarded by a stand-in rule on its own samples ----
# The loop learning test. A random model never writes a ```lean4 block, so every GRPO reward would be 0: the
# primed model (a 2-layer Llama, a 400-token BPE vocabulary trained on coprover's prompts, fitted for 150 steps) answers
# the whole-proof prompt with a block holding one of PRIMED_TACTICS and the tactic prompt with one of them, noisily.
# The stand-in accepts a proof iff its first tactic is one the model samples most in iteration 0's rollouts
# (--accept tactic:^(a|b)\b, chosen from those very samples, a 25-60% base rate). The loop's logged GRPO reward
# (charts/reward_mean, the iteration's rollouts) must rise by LOOP_MARGIN from iteration 0 (the untrained prover: one
# rollout batch an iteration) to the mean of the last two; with the rule inverted (not:tactic:...) the loop rewards
# their absence, and their share (the stand-in's rejections, lean/error_share) must not rise.
PRIMED_TACTICS = ["norm_num", "simp", "linarith", "omega", "decide", "positivity"]
LOOP_ITERATIONS, LOOP_MARGIN, LOOP_PROMPTS, LOOP_SAMPLES, LOOP_TOKENS = 8, 0.25, 5, 8, 16
LOOP = [
    "--dataset",
    "data/lean_tactics.jsonl",
    "--eval-dataset",
    "data/lean_tactics.jsonl",
    "--eval-split",
    "tactics",
    "--iterations",
    str(LOOP_ITERATIONS),
    "--search-theorems-per-round",
    "2",
    "--num-sampled-tactics",
    "2",
    "--max-expansions",
    "1",
    "--tactic-max-new-tokens",
    "8",
    "--value-batch-size",
    "64",
    "--value-micro-batch-size",
    "32",
    "--value-max-length",
    "128",
    "--value-epochs",
    "1",
    "--value-warmup-steps",
    "0",
    "--grpo-steps-per-round",
    "1",
    "--prompts-per-step",
    str(LOOP_PROMPTS),
    "--samples-per-prompt",
    str(LOOP_SAMPLES),
    "--max-new-tokens",
    str(LOOP_TOKENS),
    "--learning-rate",
    "1e-3",
    "--micro-batch-size",
    "20",
    "--max-model-len",
    "512",
    "--no-frontier-filter",
    "--eval-every",
    "0",
    "--eval-limit",
    "1",
    "--eval-samples",
    "2",
    "--eval-budgets",
    "1",
    "2",
    "--eval-search-limit",
    "0",
    "--save-every",
    "100",
    "--no-gradient-checkpointing",
    "--backend",
    "hf",
    "--lean-workers",
    "1",
]


def build_primed_model(out: pathlib.Path, steps: int = 150) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    pairs = []
    for p, row in zip(PROBLEMS.values(), ROWS):
        goals = "\n".join("  " + line for line in row["goal"].split("\n"))
        tactic_prompt = cp.TACTIC_PROMPT.format(
            header=p.header, statement=p.statement, goals=goals, proof=p.statement
        )
        pairs += [
            (cp.PROVER_PROMPT.format(header=p.header, statement=p.statement), f"```lean4\n{t}\n```")
            for t in PRIMED_TACTICS
        ] + [(tactic_prompt, f"  {t}\n") for t in PRIMED_TACTICS]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = (
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(
        [p + t for p, t in pairs] + [cp.VALUE_PROMPT] + PRIMED_TACTICS * 5, trainer
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<pad>"
    )
    tok.add_tokens(["```lean4"])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    data, rng = [(ids(p), ids(t) + [tok.eos_token_id]) for p, t in pairs], cp.random.Random(0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):  # the loss on the answers' tokens only, right-padded
        batch = rng.sample(data, 16)
        width = max(len(p) + len(y) for p, y in batch)
        labels = torch.tensor(
            [[-100] * len(p) + y + [-100] * (width - len(p) - len(y)) for p, y in batch]
        )
        inputs = torch.tensor(
            [p + y + [tok.pad_token_id] * (width - len(p) - len(y)) for p, y in batch]
        )
        mask = (
            torch.arange(width) < torch.tensor([len(p) + len(y) for p, y in batch])[:, None]
        ).long()
        loss = model(input_ids=inputs, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)


@pytest.fixture(scope="module")
def primed_model_dir(tmp_path_factory) -> str:
    out, threads = tmp_path_factory.mktemp("coprover_primed") / "model", torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores are slower here
    try:
        build_primed_model(out)
    finally:
        torch.set_num_threads(threads)
    return str(out)


def first_tactics_of_iteration0(model_dir: str) -> list[str]:
    """The first tactic of every rollout of iteration 0's GRPO batch, as the loop samples it: the same statements,
    keys, sizes and (untrained) weights, so the same samples; '<no code>' where no block was extracted."""
    a = args(
        prompts_per_step=LOOP_PROMPTS, samples_per_prompt=LOOP_SAMPLES, max_new_tokens=LOOP_TOKENS
    )
    tok = cp.load_tokenizer(model_dir)
    sampler = cp.Sampler(model_dir, cp.load_model(model_dir, CPU, train=False), tok, CPU, "hf", 512)
    batch = cp.rollout_prompts(list(PROBLEMS.values()), 0, a.prompts_per_step, a.seed)
    rows = cp.sample(
        sampler,
        [cp.PROVER_PROMPT.format(header=p.header, statement=p.statement) for p in batch],
        a.samples_per_prompt,
        [f"{a.seed}/grpo0/{p.id}" for p in batch],
        temperature=a.temperature,
        max_new_tokens=a.max_new_tokens,
    )
    heads = []
    for p, row in zip(batch, rows):
        for s in row:
            code = cp.extract_last_block(s.text, p.statement)
            tactics = cp.proof_tactics(code, p.statement) if code else []
            heads.append(tactics[0].split()[0] if tactics and tactics[0].split() else "<no code>")
    return heads


def first_tactic_rule(
    heads: list[str], floor: float = 0.25
) -> tuple[str, float, collections.Counter]:
    """The stand-in rule accepting the most frequent primed first tactics, as few as reach `floor` together."""
    tally, chosen, share = collections.Counter(heads), [], 0.0
    for word, count in tally.most_common():
        if share < floor and word in PRIMED_TACTICS:
            chosen.append(word)
            share += count / len(heads)
    return "tactic:^(" + "|".join(chosen) + r")\b", share, tally


@pytest.mark.slow
def test_loop_learns_what_the_stand_in_rewards(primed_model_dir, tmp_path):
    started = time.time()
    rule, share, tally = first_tactic_rule(first_tactics_of_iteration0(primed_model_dir))
    print(
        f"\niteration 0's first tactics ({sum(tally.values())} rollouts): {dict(tally.most_common())}\n"
        f"rule: --accept '{rule}' ({share:.0%} of them)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAN_", "SGS_", "KIMINA"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    runs = {}
    for name, accept in (("rule", rule), ("inverted", "not:" + rule)):  # in parallel, a core each
        cmd = [
            sys.executable,
            "coprover.py",
            "--model",
            primed_model_dir,
            "--value-backbone",
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
            env={**env, "LEAN_REPL_CMD": f"{STAND_IN} --accept '{accept}'"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        runs[name] = [metrics_of(tmp_path / name)[step] for step in range(1, LOOP_ITERATIONS + 1)]
    rewards = [r["charts/reward_mean"] for r in runs["rule"]]
    favoured = [
        r.get("lean/error_share", 0.0) for r in runs["inverted"]
    ]  # the inverted rule rejects those tactics
    print("charts/reward_mean, rule:  ", " ".join(f"{v:.3f}" for v in rewards))
    print(
        "lean/error_share, inverted:",
        " ".join(f"{v:.3f}" for v in favoured),
        "(its own reward_mean:",
        " ".join(f"{r['charts/reward_mean']:.3f}" for r in runs["inverted"]) + ")",
    )
    print("search/pass@1, rule: ", " ".join(f"{r['search/pass@1']:.2f}" for r in runs["rule"]))
    assert rewards[0] == pytest.approx(
        share
    )  # the loop rewarded the samples the rule was chosen from
    assert 0.2 <= share <= 0.6 and favoured[0] == pytest.approx(share)
    first, last = rewards[0], sum(rewards[-2:]) / 2
    first_inv, last_inv = favoured[0], sum(favoured[-2:]) / 2
    assert last >= first + LOOP_MARGIN, (first, last)
    assert last_inv <= first_inv + LOOP_MARGIN / 4, (
        first_inv,
        last_inv,
    )  # rewarding their absence: no rise
    assert all(
        r["losses/grpo_steps"] == 1 for r in runs["rule"]
    )  # every rollout batch updated the prover
    print(f"loop learning test: {time.time() - started:.0f} s")


def test_search_theorems_draws_a_rounds_share():
    """Step 1's theorems: search_theorems_per_round of the training statements, drawn with the
    iteration's rng (the same draw on every rank), all of them when fewer."""
    problems = [cp.Problem(str(i), "", "") for i in range(5)]
    a = args(search_theorems_per_round=3)
    drawn = cp.search_theorems(problems, {"proved": {}}, random.Random("0/0"), a)
    again = cp.search_theorems(problems, {"proved": {}}, random.Random("0/0"), a)
    assert len(drawn) == 3 and len({p.id for p in drawn}) == 3 and drawn == again
    every = cp.search_theorems(
        problems, {"proved": {}}, random.Random("0/0"), args(search_theorems_per_round=9)
    )
    assert sorted(p.id for p in every) == ["0", "1", "2", "3", "4"]
