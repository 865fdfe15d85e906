"""Tests of rir.py: the loss, the schedule and the search arithmetic against values worked out by
hand; BFS priorities, node merging and the stop at the first proof on a scripted tree; the official
order of an expansion (one target at a time); the budget as a cap inside an expansion, counted alike
for RiR and the flat baseline; MCTS selection and backup on a hand-made tree; malformed
planner/actor output as failed edges; the built-in data against the stand-in REPL and a held-out CPU
benchmark; a learning test of co-training; and (marked slow) end-to-end runs in a subprocess with a
tiny model and the stand-in REPL (weights change, checkpoint), once with the embedded model. Two
ranks against one and resume after a kill are test_family's, on the same reference run
(conftest.py)."""

import ast
import collections
import dataclasses
import json
import math
import os
import pathlib
import random
import shlex
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from conftest import official_args  # noqa: E402

import rir  # noqa: E402
from lean_verify import (  # noqa: E402
    LeanVerifier,
    Problem,
    TacticState,
    format_state,
    load_problems,
)

CPU = rir.Dist(0, 1, 1, torch.device("cpu"), True)
FAKE_REPL = (
    f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'tests' / 'fake_lean_repl.py'))}"
)
THEOREMS = {t.id: t for t in load_problems(str(REPO / "data" / "rir_theorems.jsonl"))}


def args(**kw):
    return official_args(rir)(**kw)


def stand_in(*flags) -> LeanVerifier:
    return LeanVerifier(repl_cmd=" ".join([FAKE_REPL, *flags]), workers=1, timeout=10.0)


def proof_triples(v, theorem, proof):
    """The Triples a search that found `proof` has on its path (proof_steps): the states it
    passes, replayed through the stand-in; [] when it does not run to a solved end."""
    root = v.start_proof(theorem.header, theorem.statement)
    [states] = v.replay([root], [proof])
    if not states or states[-1].status != "solved":
        return []
    steps = []
    for before, after in zip(states, states[1:]):
        steps.append(rir.Triple(before.pretty, after.tactics[-1], after.pretty or rir.NO_GOALS))
    return steps


# ---- losses and schedule ----
def test_co_training_loss_hand_values():
    logp = torch.tensor(
        [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-3.0, -1.0, -2.0]], requires_grad=True
    )
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    roles = torch.tensor([0, 1, 1])  # one planner sequence (s*), two actor sequences (y*)
    # sequence sums: -3, -0.5, -6. Token mean: planner 3 / 2 tokens, actor (0.5 + 6) / 4 tokens ->
    # 1.5 + 1.625
    loss = rir.co_training_loss(logp, mask, roles, [2, 4])
    assert loss.item() == pytest.approx(3.125)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx(
        [-0.5, -0.5, 0.0, -0.25, 0.0, 0.0, -0.25, -0.25, -0.25]
    )
    # L_co as written: both terms over N = 2 triples -> 3 / 2 + 6.5 / 2
    assert rir.co_training_loss(logp, mask, roles, [2, 2]).item() == pytest.approx(4.75)
    # micro-batches add up to the batch's loss; a role with denominator 0 (the flat baseline's
    # planner) drops out
    parts = rir.co_training_loss(logp[:1], mask[:1], roles[:1], [2, 4]) + rir.co_training_loss(
        logp[1:], mask[1:], roles[1:], [2, 4]
    )
    assert parts.item() == pytest.approx(3.125)
    assert rir.co_training_loss(logp[1:], mask[1:], roles[1:], [0, 4]).item() == pytest.approx(
        1.625
    )


def test_lr_schedule():
    # warm-up over 2 steps, cosine over the remaining 4 of 6: transformers'
    # get_cosine_schedule_with_warmup, as the official Lightning run steps it (the warm-up starts at
    # 0: step 0 trains at lr 0, step 1 at half the peak)
    c = 0.5 * math.cos(math.pi / 4)
    assert [rir.lr_at(s, 6, 1.0, 2, "cosine") for s in range(7)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.5 + c, 0.5, 0.5 - c, 0.0]
    )
    assert rir.lr_at(0, 3, 1.0, 0, "cosine") == 1.0


def test_every_co_training_warms_up_then_decays(monkeypatch):
    """Each iteration's co-training warms up and decays; a later one (selfplay_train_steps) warms up
    for the first's share of its steps (here 10 of 20 -> 5 of 10), so it no longer ends at the peak
    (warm-up = steps)."""
    lrs = []
    monkeypatch.setattr(
        rir,
        "train_step",
        lambda *a, lr=None, **kw: (
            lrs.append(lr) or dict(loss=1.0, goal=1.0, tactic=1.0, grad_norm=0.0)
        ),
    )
    planner = rir.Example(rir.Sample("s*", [1], [2, 3], [], "stop"), weight=1.0, role=0)
    actor = rir.Example(rir.Sample("y", [1], [4], [], "stop"), weight=1.0, role=1)
    items = [[planner, actor]]
    a = args(train_steps=20, selfplay_train_steps=10, warmup_steps=10, learning_rate=1.0)
    rir.co_train(None, None, items, 20, a, CPU, random.Random(0))  # the first iteration
    assert (
        lrs == pytest.approx([rir.lr_at(s, 20, 1.0, 10, "cosine") for s in range(20)])
        and lrs[10] == 1.0
    )
    lrs.clear()
    stats = rir.co_train(None, None, items, 10, a, CPU, random.Random(0))  # a later one
    c = 0.5 * math.cos(math.pi / 5)
    assert lrs == pytest.approx(
        [
            0.0,
            0.2,
            0.4,
            0.6,
            0.8,
            1.0,
            0.5 + c,
            0.5 + 0.5 * math.cos(2 * math.pi / 5),
            0.5 - 0.5 * math.cos(2 * math.pi / 5),
            0.5 - c,
        ]
    )
    assert stats["losses/learning_rate_last"] == lrs[-1] < 0.1


def test_search_scores():
    parent = rir.Node(state=None, priority=-1.0)
    edge = rir.Edge("simp", math.log(0.25), 3, "⊢ True", math.log(0.5))
    child = rir.Node(state=None, parent=parent, edge=edge)
    assert rir.priority(child, args()) == pytest.approx(-1.0 + math.log(0.125))
    assert rir.edge_priors([math.log(0.2), math.log(0.6)]) == pytest.approx([0.25, 0.75])
    assert rir.edge_priors([-1000.0, -1000.0]) == pytest.approx(
        [0.5, 0.5]
    )  # no underflow for long sequences
    # Q + c P sqrt(N_parent) / (1 + N): visited 0.5 / 1 + 0.6 sqrt(3) / 2; unvisited: the parent's
    # mean 1 / 3
    assert rir.puct_score(0.5, 1, 0.6, 1.0, 3, 1.0) == pytest.approx(0.5 + 0.6 * math.sqrt(3) / 2)
    assert rir.puct_score(0.0, 0, 0.3, 1.0, 3, 2.0) == pytest.approx(1 / 3 + 2 * 0.3 * math.sqrt(3))
    assert rir.search_time_cdf([3.0, 1.0], 4) == [(1.0, 1, 0.25), (3.0, 2, 0.5)]
    assert rir.search_time_cdf([], 4) == []


# ---- data and prompts ----
# format_state and load_triples themselves: tests/test_lean_verify.py
def test_built_in_triples_and_theorems():
    triples = rir.load_triples(str(REPO / "data" / "rir_triples.jsonl"))
    assert len(triples) == 18 and triples[0].tactic == "constructor"
    assert (
        triples[1].tactic == "exact <a>Nat.lt_trans</a> h₁ h₀"
    )  # premises marked, as the official configs train
    assert triples[0].target.startswith("case left") and "2 goals" not in triples[0].target
    assert sum(t.target == rir.NO_GOALS for t in triples) == 5  # each theorem's last step closes it
    assert len(THEOREMS) == 5 and all(t.statement.endswith(":= by") for t in THEOREMS.values())
    assert len(load_problems(str(REPO / "data" / "minif2f.jsonl"), split="test")) == 244
    assert len(load_problems(str(REPO / "data" / "minif2f.jsonl"), 3, split="valid")) == 3


def test_built_in_data_follows_the_stand_in():
    """data/rir_triples.jsonl are the traced steps of the known proofs of data/rir_theorems.jsonl,
    as the stand-in REPL (data/lean_tactics.jsonl's table) runs them: replaying each proof, its
    tactics as load_triples reads them without premise marks (as the search writes them), gives
    exactly these triples."""
    rows = [json.loads(line) for line in open(REPO / "data" / "rir_triples.jsonl")]
    triples = iter(rir.load_triples(str(REPO / "data" / "rir_triples.jsonl")))
    with stand_in() as v:
        for row in rows:
            theorem = THEOREMS[row["full_name"]]
            steps = [next(triples) for _ in row["traced_tactics"]]
            proof = [t.tactic.replace("<a>", "").replace("</a>", "") for t in steps]
            assert proof == [t["tactic"] for t in row["traced_tactics"]]
            replayed = proof_triples(v, theorem, proof)
            assert replayed == [t._replace(tactic=y) for t, y in zip(steps, proof)]
            assert replayed == [
                rir.Triple(
                    format_state(t["state_before"]), t["tactic"], format_state(t["state_after"])
                )
                for t in row["traced_tactics"]
            ]
        broken = SimpleNamespace(
            proved=True, proof=["constructor", "exact h₁"]
        )  # a dead end: nothing is kept
        assert proof_triples(v, THEOREMS["search_and_le"], broken.proof) == []


def test_truncate_right_cuts_at_a_character(tiny_model_dir):
    """A state cut to its first k tokens is a prefix of it with at most k tokens, never half a
    character (byte-level BPE splits ℕ, ⊢, ₀ over two tokens: decoding the first k ids gave
    U+FFFD)."""
    tok = rir.load_tokenizer(tiny_model_dir)
    state = "case right\na b : ℕ\nh₀ : a < b\nh₁ : 0 < a\n⊢ a ≤ b ∧ ∀ x ∈ Finset.range n, x ≥ 0"
    n = len(tok(state, add_special_tokens=False).input_ids)
    for k in range(1, n + 2):
        cut = rir.truncate_right(tok, state, k)
        assert (
            state.startswith(cut)
            and "\ufffd" not in cut
            and len(tok(cut, add_special_tokens=False).input_ids) <= k
        )
    assert rir.truncate_right(tok, state, n) == state and len(
        rir.truncate_right(tok, state, n - 1)
    ) < len(state)


def test_no_import_twice():  # the module once imported collections, json, os, ... twice
    tree = ast.parse((REPO / "rir.py").read_text())
    names = [
        (getattr(n, "module", None), a.name)
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    ]
    assert len(names) == len(set(names))


def test_training_items_keep_the_official_formats(tiny_model_dir):
    tok = rir.load_tokenizer(tiny_model_dir)
    triple = rir.Triple("x : ℕ\n⊢ x = x", "rfl", "no goals")

    def texts(item):
        return [
            (tok.decode(e.sample.prompt_ids), tok.decode(e.sample.token_ids), e.role) for e in item
        ]

    [item] = rir.training_items([(triple, (1.0, 1.0), None)], tok, args())
    eos = tok.eos_token
    assert texts(item) == [
        ("[CURRENT GOAL]\nx : ℕ\n⊢ x = x\n[TARGET GOAL]\n", "no goals" + eos, 0),
        ("[CURRENT GOAL]\nx : ℕ\n⊢ x = x\n[TARGET GOAL]\nno goals\n[PROOFSTEP]\n", "rfl" + eos, 1),
    ]
    [item] = rir.training_items([(triple, (1.0, 1.0), None)], tok, args(joint_format=True))
    assert texts(item) == [
        ("[CURRENT GOAL]\nx : ℕ\n⊢ x = x\n", "[TARGET GOAL]\nno goals\n[PROOFSTEP]\nrfl\n" + eos, 0)
    ]
    [item] = rir.training_items([(triple, (1.0, 1.0), None)], tok, args(planner=False))
    assert texts(item) == [("[CURRENT GOAL]\nx : ℕ\n⊢ x = x\n[PROOFSTEP]\n", "rfl" + eos, 1)]
    long = rir.Triple("⊢ " + " + ".join(["1"] * 500), "norm_num", "no goals")
    [item] = rir.training_items([(long, (1.0, 1.0), None)], tok, args(max_state_tokens=20))
    assert len(item[0].sample.prompt_ids) < 40  # the state is cut to 20 tokens


def test_the_cpu_default_benchmark_is_held_out(tmp_path):
    """The CPU default evaluates theorems that neither self-play searches nor D_0 holds proofs of
    (it used to evaluate the 5 built-in theorems themselves, a training-set number)."""
    a = rir.Args(output_dir=str(tmp_path))  # without CUDA: the CPU defaults
    benchmark = load_problems(str(REPO / a.eval_dataset), a.eval_limit, split=a.eval_split)
    problems = load_problems(str(REPO / a.selfplay_dataset), a.num_problems, split=a.selfplay_split)
    proved = {json.loads(line)["full_name"] for line in open(REPO / a.dataset)}  # D_0's theorems
    assert len(benchmark) == 5 and {p.id for p in problems} == proved
    assert not {p.id for p in benchmark} & proved and not {p.statement for p in benchmark} & {
        p.statement for p in problems
    }


# ---- the search on scripted trees ----
class ScriptedLean:
    """A verifier double: `table` maps (goal, tactic) to the new goals or an error string; `invalid`
    lists tactic paths the final check rejects. Records every tactic it runs. A tactic takes `cost`
    seconds and the final check `check_cost`, on the fake clock `clock` (a one-item list) or, with
    clock=None, as real sleeps."""

    def __init__(self, table, invalid=(), clock=None, cost=0.0, check_cost=0.0):
        self.table, self.invalid, self.ran, self.ids = table, set(map(tuple, invalid)), [], 0
        self.calls = []
        self.clock, self.cost, self.check_cost = clock, cost, check_cost

    def spend(self, seconds):
        if self.clock is not None:
            self.clock[0] += seconds
        elif seconds:
            time.sleep(seconds)

    workers = 1

    def start_proof(self, header, statement):
        return TacticState(state_id=0, goals=["⊢ A"], header=header, statement=statement)

    def start_proofs(self, items):
        return [self.start_proof(header, statement) for header, statement in items]

    def free_states(self):
        return 0

    def result(self, state, tactic):
        goals = self.table.get((state.goals[0], tactic), "unknown tactic")
        return (
            TacticState(None, [], error=goals, status="error", tactics=state.tactics + [tactic])
            if isinstance(goals, str)
            else TacticState(
                self.ids,
                goals,
                solved=not goals,
                status="open" if goals else "solved",
                tactics=state.tactics + [tactic],
            )
        )

    def apply_tactic(self, state, tactic, timeout=None):
        self.ran.append(tactic)
        self.ids += 1
        self.spend(self.cost)
        return dataclasses.replace(self.result(state, tactic), time=self.cost)

    def apply_tactics(self, steps, timeout=None):
        self.calls.append([tactic for _, tactic in steps])
        return [self.apply_tactic(state, tactic) for state, tactic in steps]

    def check_tactic_path(self, state):
        self.spend(self.check_cost)
        return SimpleNamespace(valid=tuple(state.tactics) not in self.invalid)


class EndlessLean(ScriptedLean):
    """Every tactic opens a new state: only the budget ends a search."""

    def __init__(self, **kw):
        super().__init__({}, **kw)

    def result(self, state, tactic):
        return TacticState(self.ids, [state.goals[0] + "'"], tactics=state.tactics + [tactic])


P = collections.namedtuple("P", "target tactic logp_goal logp_tactic")  # a proposal
L = math.log
# root A: two targets. Under "B" two tactics reach B (merged); under "C" one reaches C, one errors;
# a malformed sample. B leads to D; C closes the proof ("close"); a later target at C is never run.
TABLE = {
    ("⊢ A", "tB"): ["⊢ B"],
    ("⊢ A", "tB2"): ["⊢ B"],
    ("⊢ A", "tC"): ["⊢ C"],
    ("⊢ A", "noop"): ["⊢ A"],
    ("⊢ B", "tD"): ["⊢ D"],
    ("⊢ C", "close"): [],
    ("⊢ C", "after"): [],
    ("⊢ D", "tE"): ["⊢ E"],
}
PROPOSALS = {
    "⊢ A": [
        P("⊢ B", "tB", L(0.5), L(0.5)),
        P("⊢ B", "tB2", L(0.5), L(0.25)),
        P("⊢ B", "noop", L(0.5), L(0.1)),
        P("⊢ C", "tC", L(0.25), L(0.8)),
        P("⊢ C", "bad", L(0.25), L(0.1)),
        P("⊢ C", "tB", L(0.25), L(0.1)),
        P(None, None, 0.0, 0.0),
    ],
    "⊢ B": [P("no goals", "tBx", L(0.5), L(0.5)), P("⊢ D", "tD", L(0.5), L(0.5))],
    "⊢ C": [
        P("no goals", "close", L(0.9), L(0.9)),
        P("⊢ Z", "after", L(0.1), L(0.9)),
    ],
    "⊢ D": [P("⊢ E", "tE", L(0.9), L(0.9))],
}
THEOREM = Problem("t", "", "theorem t : A := by")


class WholeText:
    """A tokenizer double for truncate_right: no state is long enough to cut."""

    def __call__(self, text, **kw):
        return SimpleNamespace(input_ids=[], offset_mapping=[])


def proposal_rows(proposals):
    """The planner's and the actor's samples that propose `proposals` ({state: [P]}): a P without
    target and tactic is a malformed planner sample, one without tactic a malformed actor
    sample."""
    rows = {}
    for state, edges in proposals.items():
        targets, malformed = {}, []
        for e in edges:
            if e.target is None and e.tactic is None:
                malformed.append(("", 0.0))
                continue
            targets.setdefault(e.target, e.logp_goal)
            rows.setdefault(act(state, e.target), []).append((e.tactic or "", e.logp_tactic))
        rows[plan(state)] = list(targets.items()) + malformed
    return rows


def scripted(proposals, clock=None, dt=0.0):
    """A sampler that proposes `proposals`; each sampling call advances the fake clock dt s."""
    return PromptSampler(WholeText(), proposal_rows(proposals), clock=clock, cost=dt)


def prove(theorem, sampler, lean, a, clock=time.monotonic):
    """One theorem's search (best_first_search on it alone)."""
    [result] = rir.best_first_search(sampler, lean, [theorem], "k", a, clock=clock)
    return result


def test_an_expansion_merges_counts_and_sets_priorities_and_priors():
    """try_tactics and end_expansion on the root's edges: tB2 merges into B, noop into the root,
    tB under C runs once and merges; `bad` and the malformed edge fail; the children's BFS
    priorities (priority) and MCTS priors (edge_priors)."""
    lean = ScriptedLean(TABLE)
    a = args()
    [tree] = rir.start_trees(lean, [THEOREM])
    tree.root.priority = -1.0
    rir.start_expansion(tree, a)
    tree.pending = [
        rir.Edge(p.tactic, p.logp_tactic, 0, p.target, p.logp_goal) for p in PROPOSALS["⊢ A"]
    ]
    rir.try_tactics(lean, [tree], a)
    rir.end_expansion([tree], a)
    root = tree.root
    assert tree.proof is None and root.expanded and not root.dead
    assert [c.state.goals for c in root.children] == [["⊢ B"], ["⊢ C"]]
    b, c = root.children
    assert b.priority == pytest.approx(-1.0 + L(0.5) + L(0.5))
    assert c.priority == pytest.approx(-1.0 + L(0.25) + L(0.8))
    assert lean.ran == ["tB", "tB2", "noop", "tC", "bad"]  # tB again under C: run once
    assert (tree.counts["edges"], tree.counts["failed_edges"], tree.counts["merged"]) == (7, 2, 3)
    assert len(tree.nodes) == 3  # A, B, C: open states only
    # MCTS priors: the mass of the edges into each child, B: .25 + .125 (+ the tB edge under C:
    # .025), C: .2
    mass_b, mass_c = 0.25 + 0.125 + 0.025, 0.2
    assert [b.prior, c.prior] == pytest.approx(
        [mass_b / (mass_b + mass_c), mass_c / (mass_b + mass_c)]
    )
    assert [node for _, _, node in sorted(tree.queue)] == [b, c]  # BFS: queued by priority


def test_best_first_search_on_a_scripted_tree():
    lean = ScriptedLean(TABLE)
    result = prove(THEOREM, scripted(PROPOSALS), lean, args())
    # pops A, then B (log .25 > log .2), then C (log .2 > D's log .0625): C's first target proves
    # the theorem
    assert result.proved and result.proof == ["tC", "close"]
    assert result.expansions == 3 and result.nodes == 4  # A, B, C, D: open states only
    assert "after" not in lean.ran  # the expansion stops at the first proof
    assert result.path == [("⊢ A", "tC", "⊢ C"), ("⊢ C", "close", rir.NO_GOALS)]
    # the final check rejects that proof: it is a failed edge and the search goes on to the second
    # one
    lean = ScriptedLean(TABLE, invalid=[["tC", "close"]])
    result = prove(THEOREM, scripted(PROPOSALS), lean, args())
    assert result.proved and result.proof == ["tC", "after"]
    # nothing provable: the search ends when no open node is left
    dead_end = {k: v for k, v in PROPOSALS.items() if k != "⊢ C"}
    result = prove(THEOREM, scripted(dead_end), ScriptedLean(TABLE), args())
    assert not result.proved and result.proof is None and result.expansions == 5  # A, B, C, D, E


def test_mcts_selection_and_backup_on_a_hand_made_tree():
    state = lambda g: TacticState(1, [g])  # noqa: E731
    root = rir.Node(state("⊢ R"), visits=3, value_sum=1.0, expanded=True)
    a = rir.Node(state("⊢ a"), prior=0.6, visits=1, value_sum=0.5, expanded=True)
    b = rir.Node(state("⊢ b"), prior=0.3)
    c = rir.Node(state("⊢ c"), prior=0.1, visits=1, value_sum=0.0, expanded=True)
    a1, c1 = rir.Node(state("⊢ a1"), prior=1.0), rir.Node(state("⊢ c1"), prior=1.0)
    root.children, a.children, c.children = [a, b, c], [a1], [c1]
    # a: 0.5 + 0.6 sqrt(3) / 2 = 1.02 > b: 1/3 + 0.3 sqrt(3) = 0.85 > c: 0 + 0.1 sqrt(3) / 2
    assert rir.select(root, 1.0) == [root, a, a1]
    rir.backup([root, a, a1], 0.5)
    assert (root.visits, root.value_sum, a.visits, a.value_sum, a1.visits, a1.value_sum) == (
        4,
        1.5,
        2,
        1.0,
        1,
        0.5,
    )
    a1.expanded, a1.dead = (
        True,
        True,
    )  # its expansion found nothing new: a dead end, backed up with 0
    rir.backup([root, a, a1], 0.0)
    assert a.dead and not root.dead and a.visits == 3
    assert rir.select(root, 1.0) == [root, b]  # dead subtrees are never selected again
    b.expanded = b.dead = True
    rir.backup([root, b], 0.0)
    assert rir.select(root, 1.0) == [root, c, c1] and not root.dead
    c1.expanded = c1.dead = True
    rir.backup([root, c, c1], 0.0)
    assert c.dead and root.dead  # once every child is dead, so is the parent


def test_mcts_search_on_a_scripted_tree():
    # without the tB edge under C the priors are B .375 / .575, C .2 / .575. Simulation 1 expands A
    # (backs up 0.5), 2 expands B (U_B = .652 > U_C = .348), 3 scores B 0.5 + .652 sqrt(2) / 2 =
    # .961 against C (unvisited: the parent's mean 0.5) 0.5 + .348 sqrt(2) = .992: C, which proves
    # the theorem
    proposals = {
        **PROPOSALS,
        "⊢ A": [e for e in PROPOSALS["⊢ A"] if (e.target, e.tactic) != ("⊢ C", "tB")],
    }
    result = prove(
        THEOREM, scripted(proposals), ScriptedLean(TABLE), args(search="mcts", leaf_value=0.5)
    )
    assert result.proved and result.proof == ["tC", "close"] and result.expansions == 3
    # C a dead end: 3 expands C (dead, backs up 0), 4 goes B -> D, 5 goes B -> D -> E, a dead end:
    # D, B, A die
    dead_end = {k: v for k, v in proposals.items() if k != "⊢ C"}
    result = prove(THEOREM, scripted(dead_end), ScriptedLean(TABLE), args(search="mcts"))
    assert not result.proved and result.expansions == 5


def test_the_budget_is_a_cap_inside_an_expansion():
    """No tactic starts once the budget is spent, even inside an expansion (official: Dojo's hard
    timeout of budget + 60 s); the seconds past the budget are logged; a proof whose tactic ends
    past it does not count."""
    now = [0.0]
    proposals = {"⊢ A": [P("⊢ B", f"t{i}", 0.0, -1.0) for i in range(10)]}
    lean = EndlessLean(clock=now, cost=10.0)
    result = prove(
        THEOREM, scripted(proposals), lean, args(search_timeout=25.0), clock=lambda: now[0]
    )
    assert (
        lean.ran == ["t0", "t1", "t2"] and result.expansions == 1
    )  # at 0, 10 and 20 s; not at 30 s
    assert result.seconds == result.role_seconds["env"] == 30.0 and not result.proved
    now = [0.0]
    lean = ScriptedLean({("⊢ A", "win"): []}, clock=now, cost=30.0)
    result = prove(
        THEOREM,
        scripted({"⊢ A": [P("no goals", "win", 0.0, 0.0)]}),
        lean,
        args(search_timeout=25.0),
        clock=lambda: now[0],
    )
    assert result.proof == ["win"] and not result.proved and result.seconds == 30.0
    metrics = rir.search_metrics([result], "eval", seconds=30.0)
    assert (metrics["eval/proved"], metrics["eval/proved_overrun"]) == (0.0, 1.0)


class PromptSampler:
    """A sampler double: rows(prompt) (or rows[prompt]) are a prompt's samples, (text, summed
    log-prob); each generate call takes `cost` seconds (on the fake clock `clock`, or as a real
    sleep) and is recorded as its list of prompts."""

    llm, batch_size = None, 8  # what the block's sample() reads of a sampler

    def __init__(self, tokenizer, rows, clock=None, cost=0.0):
        self.tokenizer, self.rows, self.clock, self.cost, self.calls = (
            tokenizer,
            rows,
            clock,
            cost,
            [],
        )

    def generate(self, prompts, n, **kw):
        self.calls.append(list(prompts))
        if self.clock is not None:
            self.clock[0] += self.cost
        elif self.cost:
            time.sleep(self.cost)
        rows = [self.rows(p) if callable(self.rows) else self.rows.get(p, []) for p in prompts]
        return [
            [sample(*sampled[:1], [sampled[1]], *sampled[2:]) for sampled in row][:n]
            for row in rows
        ]


def plan(state):
    return rir.PLANNER_PROMPT.format(state=state)


def act(state, target):
    return rir.ACTOR_PROMPT.format(state=state, target=target)


def any_prompt(
    prompt,
):  # the planner: three targets; the actor: six tactics named after the target (flat: "t")
    if prompt.endswith("[TARGET GOAL]\n"):
        return [(f"⊢ {x}", -0.1 * i) for i, x in enumerate("XYZ")]
    name = prompt.split("[TARGET GOAL]\n")[1][2] if "[TARGET GOAL]" in prompt else "t"
    return [(f"{name}{i}", -1.0 - i) for i in range(6)]


@pytest.mark.parametrize("joint", [False, True])
def test_the_actor_samples_one_target_at_a_time_and_stops_at_the_first_proof(tiny_model_dir, joint):
    """The official order: the planner's targets, then the actor's tactics for the best target, run
    before the actor is asked about the next target; the first proof ends the expansion, so the
    second target is never sampled. The actor's premise marks are removed before Lean runs the
    tactic. With --joint-format the actor's prompt holds s* too (deviation 10)."""
    tok = rir.load_tokenizer(tiny_model_dir)
    rows = {
        plan("⊢ A"): [("no goals", -0.1), ("⊢ B", -0.5)],
        act("⊢ A", "no goals"): [("exact <a>Nat.win</a>", -0.2)],
        act("⊢ A", "⊢ B"): [("tB", -0.3)],
    }
    sampler, lean = (
        PromptSampler(tok, rows),
        ScriptedLean({("⊢ A", "exact Nat.win"): [], ("⊢ A", "tB"): ["⊢ B"]}),
    )
    [result] = rir.search(sampler, lean, [THEOREM], "k", args(joint_format=joint), CPU)
    assert result.proved and result.proof == lean.ran == ["exact Nat.win"]
    assert sampler.calls == [[plan("⊢ A")], [act("⊢ A", "no goals")]]  # never act("⊢ A", "⊢ B")


def test_the_budget_counts_the_same_on_both_sides(tiny_model_dir, monkeypatch, tmp_path):
    """RiR and the flat baseline (plan_and_act reads --no-planner) get the same budget, counted the
    same way: the search's wall clock, sampling and Lean together, checked before each sampling call
    and tactic; each side overshoots by at most its last sampling (planner + one actor call) or
    tactic. The CPU defaults give both sides the same budget; the expansion cap gives both the same
    number of expansions."""
    import tyro

    scaled = []
    for flags in ([], ["--no-planner"]):
        a = tyro.cli(rir.Args, args=["--output-dir", str(tmp_path), *flags])  # the CPU defaults
        scaled.append((a.search_timeout, a.max_expansions, a.num_sampled_tactics))
    assert scaled[0] == scaled[1] == (300.0, 4, 8)
    tok = rir.load_tokenizer(tiny_model_dir)
    for flat in (False, True):
        # a sampling call takes 3 s, a tactic 1 s, the budget is 18 s. RiR: planner, X's actor call,
        # 4 tactics, Y's call (the same tactics: run once) to 13 s; at A', planner and X's call end
        # at 19 s: no tactic runs after them. Flat: an actor call and 4 tactics, 7 s an expansion;
        # the third's second tactic would start at 18 s, spent: 18 s.
        now, a = (
            [0.0],
            args(planner=not flat, search_timeout=18.0, num_sampled_goals=2, num_sampled_tactics=4),
        )
        sampler = PromptSampler(
            tok,
            lambda p: (
                any_prompt(p)[:2]
                if p.endswith("GOAL]\n")
                else [(f"t{i}", -1.0 - i) for i in range(4)]
            ),
            clock=now,
            cost=3.0,
        )
        lean = EndlessLean(clock=now, cost=1.0)
        result = prove(THEOREM, sampler, lean, a, clock=lambda: now[0])
        roles = result.role_seconds
        assert result.seconds == sum(roles.values()) == (18.0 if flat else 19.0)
        assert roles.get("planner", 0.0) == (0.0 if flat else 6.0)
        capped = args(planner=not flat, max_expansions=3)
        assert prove(THEOREM, sampler, EndlessLean(), capped).expansions == 3


def test_the_budget_stops_a_long_expansion_in_real_time(tiny_model_dir):
    """The budget on the wall clock, through search(): an RiR expansion of 3 targets x 6 tactics at
    0.1 s each takes 1.8 s; with a 0.5 s budget the search stops after the tactic that crosses it
    (as the flat baseline's does)."""
    tok = rir.load_tokenizer(tiny_model_dir)
    for flat in (False, True):
        lean = EndlessLean(cost=0.1)
        [result] = rir.search(
            PromptSampler(tok, any_prompt),
            lean,
            [THEOREM],
            "k",
            args(planner=not flat, search_timeout=0.5),
            CPU,
        )
        assert len(lean.ran) <= 7 and result.seconds < 0.5 + 0.1 + 0.3, (flat, lean.ran, result)
        assert not result.proved


def test_the_kernel_re_check_is_no_environment_time(tiny_model_dir):
    """Figure 2's env time is Lean's tactic runs (official run_tac), not check_tactic_path's
    re-check."""
    tok = rir.load_tokenizer(tiny_model_dir)
    rows = {plan("⊢ A"): [("no goals", -0.1)], act("⊢ A", "no goals"): [("win", -0.2)]}
    lean = ScriptedLean({("⊢ A", "win"): []}, check_cost=0.4)
    [result] = rir.search(PromptSampler(tok, rows), lean, [THEOREM], "k", args(), CPU)
    assert result.proved and result.role_seconds["env"] < 0.2 and result.seconds >= 0.4


# ---- malformed model output ----
def sample(text, logprobs=(), finish="stop"):
    return rir.Sample(text, [], [], list(logprobs), finish)


class ScriptedSampler:
    llm, batch_size = None, 8  # what the block's sample() reads of a sampler
    tokenizer = WholeText()

    def __init__(self, planner, actor):
        self.planner, self.actor, self.calls = planner, actor, []

    def generate(self, prompts, n, **kw):
        self.calls.append((prompts, n, kw.get("stop")))
        rows = self.planner if kw.get("desc") == "plan" else self.actor
        return [rows[:n] for _ in prompts]


def test_malformed_planner_and_actor_output_are_failed_edges():
    planner = [
        sample(""),
        sample("⊢ B", [-0.1, -0.2]),
        sample("⊢ X", [-1.0], "abort"),
        sample("⊢ B ", [-0.5]),
    ]
    actor = [
        sample("  "),
        sample("simp", [-1.0]),
        sample("junk", [-0.1], "error"),
        sample("omega", [-0.5]),
        sample("omega\n", [-0.7]),
        sample("t\n  cont", [-2.0], "length"),
    ]
    sampler, lean = ScriptedSampler(planner, actor), ScriptedLean({})
    a = args(num_sampled_goals=4, num_sampled_tactics=6)
    result = prove(THEOREM, sampler, lean, a)
    # one target, ⊢ B; its tactics by log-prob; 2 malformed actor and 2 malformed planner samples
    assert lean.ran == ["omega", "simp", "t\n  cont"]
    assert (result.expansions, result.edges, result.failed_edges) == (1, 7, 7)
    assert sampler.calls[0][0] == ["[CURRENT GOAL]\n⊢ A\n[TARGET GOAL]\n"]
    assert sampler.calls[0][2] is None  # s*: EOS
    assert sampler.calls[1][0] == ["[CURRENT GOAL]\n⊢ A\n[TARGET GOAL]\n⊢ B\n[PROOFSTEP]\n"]
    # the joint sequence goes on after s*: its planner stops at [PROOFSTEP]
    joint = ScriptedSampler(planner, actor)
    prove(THEOREM, joint, ScriptedLean({}), args(num_sampled_goals=4, joint_format=True))
    assert joint.calls[0][2] == [rir.GOAL_STOP] and joint.calls[1][2] is None
    flat_lean = ScriptedLean({})
    flat = prove(THEOREM, ScriptedSampler([], actor), flat_lean, args(planner=False))
    assert flat_lean.ran == ["omega", "simp", "t\n  cont"] and flat.failed_edges == 5
    # every planner sample malformed: no actor call, only failed edges, and no crash
    sampler = ScriptedSampler([sample(""), sample("x", [], "abort")], actor)
    result = prove(THEOREM, sampler, ScriptedLean(TABLE), args(num_sampled_goals=2))
    assert (result.expansions, result.edges, result.failed_edges) == (1, 2, 2)
    assert len(sampler.calls) == 1 and not result.proved


def test_garbage_tactics_through_lean_are_failed_edges():
    """Model output that Lean or lean_verify's text rules reject (sorry, commands, unbalanced
    brackets, several lines) is a failed edge; the table's tactics still prove the theorem."""
    garbage = [
        "sorry",
        "#eval 1",
        "(((",
        "exact h₀\n  junk :=",
        "simp; omega",
        "norm_num at *",
        "λ",
    ]
    proposals = {}
    with stand_in() as v:
        theorem = THEOREMS["search_and_le"]
        root = v.start_proof(theorem.header, theorem.statement).pretty
        proposals[root] = [P("t", g, 0.0, -1.0) for g in garbage] + [
            P("t", "constructor", 0.0, -2.0)
        ]
        after = v.apply_tactic(v.start_proof(theorem.header, theorem.statement), "constructor")
        proposals[after.pretty] = [P("t", g, 0.0, -1.0) for g in garbage] + [
            P("t", "omega", 0.0, -2.0)
        ]
        last = v.apply_tactic(after, "omega")
        proposals[last.pretty] = [P("t", "omega", 0.0, -1.0)]
        for search in ("bfs", "mcts"):
            result = prove(theorem, scripted(proposals), v, args(search=search))
            assert result.proved and result.proof == ["constructor", "omega", "omega"]
            assert result.failed_edges == 2 * len(garbage)


def result(name, proved, t, exp, edges=10, failed=5, proof=None):
    """A SearchResult by hand: its roles split its seconds 1:2:1."""
    if proof is None and proved:
        proof = ["x"]
    return rir.SearchResult(
        id=name,
        proof=proof,
        proved=proved,
        seconds=t,
        expansions=exp,
        nodes=exp + 1,
        edges=edges,
        failed_edges=failed,
        merged=0,
        role_seconds={"planner": t / 4, "actor": t / 2, "env": t / 4},
        path=[],
        path_edges=[],
    )


def proved_along(found, path):
    """found with its proof's steps: each Triple of path and its Edge (as a search's would be:
    the tactic, a log-prob, the planner's target s*)."""
    edges = [
        rir.Edge(step.tactic, -1.0, 1, target=step.target, target_logprob=-1.0) for step in path
    ]
    return found._replace(path=path, path_edges=edges)


def test_search_metrics():
    """By hand; proofs per second divide by the phase's wall time (10 s here), not the searches'
    summed 612 s, as coprover's: ranks search at once. A proof past the budget is not proved."""
    results = [
        result("a", True, 4.0, 1),
        result("b", True, 8.0, 3),
        result("c", False, 600.0, 9),
        result("d", False, 601.0, 9, proof=["y"]),
    ]
    m = rir.search_metrics(results, "eval", 10.0)
    assert m["eval/proofs_per_second"] == 0.2 and m["eval/proved_overrun"] == 1.0
    assert m["eval/pass@1"] == pytest.approx(2 / 4) and m["eval/proved"] == 2
    assert (m["eval/search_time_proved"], m["eval/search_time_proved_median"]) == (6.0, 6.0)
    assert (
        m["eval/planner_time_proved"],
        m["eval/actor_time_proved"],
        m["eval/env_time_proved"],
    ) == (1.5, 3.0, 1.5)
    assert (m["eval/expansions_per_proof"], m["eval/nodes_per_proof"]) == (2.0, 3.0)
    assert m["eval/failed_edge_share"] == 0.5 and m["eval/actor_seconds"] == 606.5
    assert rir.search_metrics([], "eval", 0.0)["eval/pass@1"] == 0.0


def test_nothing_learned_says_what_the_tactics_did(tmp_path):
    """One line at the end when no search of the run proved a theorem, with what the tactics did:
    from the run's searches as record_searches counts them (and writes them to searches.jsonl)."""
    outcomes = collections.Counter()
    assert rir.nothing_learned(outcomes, 0, args()) is None  # no search at all
    searches = [result("a", False, 5.0, 1, 8, 8), result("b", False, 5.0, 2, 4, 3)]
    rir.record_searches(tmp_path, searches, "eval", 1, outcomes, CPU)
    rows = (tmp_path / "searches.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in rows] == ["a", "b"]
    assert rir.nothing_learned(outcomes, 0, args()) == (
        "No theorem proved within the budget in the run's 2 searches (3 expansions; trains_on "
        "officially trains on those only): of the 12 tactics tried, 11 "
        "failed in Lean or were malformed, 1 left goals open. The loop ran; "
        "tests/test_rir.py::test_the_loop_learns_what_the_rule_accepts shows it learn."
    )
    assert rir.nothing_learned(outcomes, 1, args()) is None  # self-play triples were trained on
    rir.record_searches(tmp_path, [result("c", True, 1.0, 1, 1, 0)], "eval", 1, outcomes, CPU)
    # a proof found, but no triple added: the filter rejected it, or D_t had its steps
    line = rir.nothing_learned(outcomes, 0, args())
    assert line.startswith("The run's 3 searches proved 1 theorem(s), but self-play added no")


def test_a_stored_triple_keeps_its_weights_and_source():
    """state.pt keeps a self-play triple as plain values; restored, it is the same triple, the
    same (planner's, actor's) weights and the same SearchResult, its path's records rebuilt."""
    step = rir.Triple("⊢ A", "intro", rir.NO_GOALS)
    edge = rir.Edge("intro", -0.5, 2, target=rir.NO_GOALS, target_logprob=-0.25)
    found = result("a", True, 1.0, 3)._replace(path=[step], path_edges=[edge])
    entry = rir.stored_triple(step, (2.0, 0.5), found)
    assert all(type(value) in (str, float, dict) for value in entry)  # loads without rir.py
    assert rir.restored_triple(entry) == (step, (2.0, 0.5), found)
    assert rir.restored_triple(entry)[2].path_edges[0].target_logprob == -0.25


def test_each_role_takes_its_own_weight(tiny_model_dir):
    """training_items: the planner's sequence takes the first weight, the actor's the second;
    the joint sequence the planner's, the flat one the actor's."""
    tok = rir.load_tokenizer(tiny_model_dir)
    triple = rir.Triple("⊢ A", "intro", rir.NO_GOALS)
    data = [(triple, (2.0, 0.5), None)]
    [item] = rir.training_items(data, tok, args())
    assert [(e.role, e.weight) for e in item] == [(0, 2.0), (1, 0.5)]
    [item] = rir.training_items(data, tok, args(joint_format=True))
    assert [(e.role, e.weight) for e in item] == [(0, 2.0)]
    [item] = rir.training_items(data, tok, args(planner=False))
    assert [(e.role, e.weight) for e in item] == [(1, 0.5)]


# ---- learning ----
def test_co_training_learns_the_proofs_search_found(tiny_model_dir):
    """The self-play path: a proof found by search (the reward) -> its path -> self_play_triples -> training_items
    -> co_train. The actor's probability of the proof's tactic rises over 20 steps, and falls when a
    different proof was found; the co-training loss falls on the fixed set."""
    tok = rir.load_tokenizer(tiny_model_dir)
    theorem = THEOREMS["search_and_le"]
    a = args(batch_size=1, micro_batch_size=1, warmup_steps=0, learning_rate=1e-2)
    with stand_in() as v:
        proofs = {
            "omega": ["constructor", "omega", "omega"],
            "exact": ["constructor", "exact Nat.lt_trans h₁ h₀", "exact Nat.le_of_lt h₀"],
        }
        triples = {k: proof_triples(v, theorem, p) for k, p in proofs.items()}
    left = triples["omega"][1]  # s = the two goals after constructor, s* = the right goal alone

    def logp_omega(
        policy,
    ) -> float:  # the tactic's tokens (not the end of sequence, which every tactic shares)
        prompt = rir.ACTOR_PROMPT.format(state=left.state, target=left.target)
        ids = tok("omega", add_special_tokens=False).input_ids
        with torch.no_grad():
            lp, mask, _ = rir.token_logprobs(
                policy, [rir.Sample("omega", rir.encode_prompt(tok, prompt), ids, [], "")]
            )
        return float((lp * mask).sum())

    moved, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores are several times slower
    for found in ("omega", "exact"):
        torch.manual_seed(0)
        policy = rir.load_model(tiny_model_dir, CPU, gradient_checkpointing=False)
        optimizer = torch.optim.AdamW(policy.parameters(), a.learning_rate, weight_decay=0.0)
        before = logp_omega(policy)
        found_steps = [proved_along(result(found, True, 1.0, 3), triples[found])]
        data = rir.self_play_triples(found_steps, set(), a)  # (triple, weight, source)
        items = rir.training_items(
            [d for d in data if d[0].state == left.state], tok, a
        )  # its second step
        stats = rir.co_train(policy, optimizer, items, 20, a, CPU, random.Random(0))
        moved[found] = (before, logp_omega(policy), stats)
        print(
            f"found {found}: log p(omega) {before:.2f} -> {moved[found][1]:.2f}, "
            f"loss {stats['losses/loss_first']:.2f} -> {stats['losses/loss_last']:.2f}"
        )
    torch.set_num_threads(threads)
    (b1, a1, s1), (b2, a2, s2) = moved["omega"], moved["exact"]
    assert b1 == b2 and b1 < -10  # about uniform over the vocabulary
    assert a1 > b1 + 8.0  # learned: e^8 times more likely
    assert a2 < b2 - 2.0  # another proof learned: omega loses mass
    for s in (s1, s2):
        assert s["losses/loss_last"] < 0.5 * s["losses/loss_first"]


# ---- end to end (slow): subprocess runs with the stand-in REPL ----
def rir_command(
    run_dir: pathlib.Path, *flags, accept="hash:0.3", lean=True, torchrun=0
) -> tuple[list, dict]:
    """The command line and environment that run rir.py against the stand-in REPL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAN_", "SGS_", "KIMINA"))}
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    if lean:
        env["LEAN_REPL_CMD"] = f"{FAKE_REPL} --accept {accept}"
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
        "rir.py",
        "--output-dir",
        str(run_dir.parent),
        "--run-name",
        run_dir.name,
        "--backend",
        "hf",
        "--lean-workers",
        "1",
        *flags,
    ], env


def run_rir(run_dir: pathlib.Path, *flags, timeout=600, **kw):
    """Run rir.py in a subprocess against the stand-in REPL; returns the CompletedProcess."""
    cmd, env = rir_command(run_dir, *flags, **kw)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def metrics_of(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def searches_of(run_dir: pathlib.Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "searches.jsonl").read_text().splitlines()]
    return [
        (r["step"], r["phase"], r["id"], r["proved"], r["proof"], r["expansions"], r["nodes"])
        for r in rows
    ]


def weights_of(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(pathlib.Path(path) / "model.safetensors"))


SMALL = [
    "--num-problems",
    "3",
    "--eval-limit",
    "3",
    "--max-expansions",
    "2",
    "--train-steps",
    "3",
    "--selfplay-train-steps",
    "2",
    "--learning-rate",
    "1e-3",
]


@pytest.mark.slow
def test_end_to_end(
    rir_reference, tiny_model_dir
):  # conftest.py: the CPU default with SMALL, uninterrupted
    reference_run = rir_reference.run_dir
    rows = metrics_of(reference_run)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["losses/steps"] == 3 and rows[1]["losses/steps"] == 2
    assert (
        rows[0]["selfplay/proved"] > 0 and rows[0]["selfplay/new_triples"] > 0
    )  # the hash rule proves some
    assert rows[1]["charts/triples"] == 18 + rows[0]["selfplay/new_triples"]
    assert "eval/search/planner_time_proved" in rows[1] and "time/eval" in rows[1]
    assert len(searches_of(reference_run)) == 6
    evals = [
        r
        for r in map(json.loads, (reference_run / "searches.jsonl").read_text().splitlines())
        if r["phase"] == "eval"
    ]  # pass@1 is the share of the benchmark's searches that proved within the budget
    assert rows[1]["eval/search/theorems"] == len(evals) == 3 and {r["id"] for r in evals} == {
        p.id for p in load_problems(str(REPO / "data" / "minif2f.jsonl"), 3, split="test")
    }
    assert (
        rows[1]["eval/search/pass@1"]
        == sum(r["proved"] for r in evals) / 3
        == rows[1]["eval/search/proved"] / 3
    )
    assert all(r["proved"] == (r["proof"] is not None and r["seconds"] <= 300.0) for r in evals)
    cdf = (reference_run / "search_time_cdf.csv").read_text().splitlines()
    assert cdf[0] == "seconds,proved,share" and len(cdf) == 1 + rows[1]["eval/search/proved"]
    trained, base = (
        weights_of(reference_run / "checkpoints" / "iter_000002" / "policy"),
        weights_of(tiny_model_dir),
    )
    assert any(not torch.equal(base[k], trained[k]) for k in base if k in trained)
    state = torch.load(
        reference_run / "checkpoints" / "iter_000002" / "state.pt", weights_only=False
    )["state"]
    assert len(state["selfplay_triples"]) == rows[0]["selfplay/new_triples"]  # D_1 = D_0 + these
    assert all(type(t) is tuple for t in state["selfplay_triples"])  # state.pt loads without rir.py


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [["--no-planner"], ["--search", "mcts", "--joint-format", "--loss-reduction", "sequence"]],
)
def test_baseline_and_variants_run(tiny_model_dir, tmp_path, flags):
    run_dir = tmp_path / "variant"
    done = run_rir(run_dir, "--model", tiny_model_dir, *SMALL, "--iterations", "1", *flags)
    assert done.returncode == 0, done.stderr[-4000:]
    [row] = metrics_of(run_dir)
    assert row["eval/search/expansions"] > 0 and "selfplay/pass@1" not in row
    config = json.loads((run_dir / "config.json").read_text())
    if "--no-planner" in flags:  # only the actor's term, its token mean: the loss is the tactic NLL
        assert (
            row["eval/search/planner_seconds"] == 0.0
            and row["losses/goal_nll"] == 0.0
            and row["eval/search/actor_seconds"] > 0
        )
        assert (
            row["losses/loss"] == pytest.approx(row["losses/tactic_nll"], rel=1e-5)
            and config["search"] == "bfs"
        )
    else:
        # one joint sequence per triple (role 0), its summed NLL over N triples: many tokens' NLL
        # per triple
        assert (
            row["eval/search/planner_seconds"] > 0
            and row["losses/tactic_nll"] == 0.0
            and row["losses/goal_nll"] > 0
        )
        assert row["losses/loss"] > 10 * row["losses/goal_nll"] and config["search"] == "mcts"


@pytest.mark.slow
def test_evaluation_only_from_a_checkpoint(rir_reference, tmp_path):
    """--iterations 0: the given model (a checkpoint's policy directory) is evaluated, nothing is
    trained."""
    run_dir = tmp_path / "eval"
    done = run_rir(
        run_dir,
        "--model",
        str(rir_reference.run_dir / "checkpoints" / "iter_000002" / "policy"),
        *SMALL,
        "--iterations",
        "0",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "lean_verify: 1 REPL(s) on each of the node's 1 rank(s)" in done.stdout
    [row] = metrics_of(run_dir)
    assert (
        row["step"] == 0
        and "eval/search/pass@1" in row
        and not any(k.startswith(("losses/", "selfplay/")) for k in row)
    )
    assert {step for step, phase, *_ in searches_of(run_dir)} == {0} and not (
        run_dir / "checkpoints"
    ).exists()


@pytest.mark.slow
def test_random_output_with_known_tactics_only(tiny_model_dir, tmp_path):
    """With the stand-in's tactic table (the CPU default's REPL), a random model proves nothing:
    every edge fails."""
    run_dir = tmp_path / "noise"
    done = run_rir(
        run_dir,
        "--model",
        tiny_model_dir,
        *SMALL,
        "--iterations",
        "1",
        "--eval-limit",
        "2",
        accept="known",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    [row] = metrics_of(run_dir)
    assert row["eval/search/pass@1"] == 0.0 and row["eval/search/failed_edge_share"] == 1.0
    assert (
        done.stdout.count("No theorem proved within the budget in the run's") == 1
    )  # the run says so, once, at the end


@pytest.mark.slow
def test_cpu_default_runs_on_the_embedded_model(tmp_path):
    if not (pathlib.Path(rir.resolve_model(rir.EMBEDDED_MODEL)) / "config.json").exists():
        pytest.skip("the embedded model is not converted (bash setup.sh)")
    run_dir = tmp_path / "embedded"
    done = run_rir(
        run_dir,
        "--iterations",
        "1",
        "--train-steps",
        "1",
        "--eval-limit",
        "1",
        "--max-expansions",
        "1",
        accept="known",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "No CUDA" in done.stdout and "smollm2" in done.stdout
    [row] = metrics_of(run_dir)
    assert row["losses/steps"] == 1 and row["eval/search/expansions"] == 1


# ---- the loop learns (slow) ---- rir's own main() as pure expert iteration (an empty D_0, so each
# co-training is on self-play proofs alone) from a small primed model, one planner target and one
# tactic a search, so a search proves iff the one tactic it samples passes the stand-in's rule, and
# selfplay/pass@1 is the share of theorems whose sampled tactic does.
LOOP_FLAGS = [
    "--selfplay-dataset",
    "data/minif2f.jsonl",
    "--selfplay-split",
    "valid",
    "--num-problems",
    "48",
    "--iterations",
    "4",
    "--num-sampled-goals",
    "1",
    "--num-sampled-tactics",
    "1",
    "--max-expansions",
    "1",
    "--goal-max-new-tokens",
    "4",
    "--tactic-max-new-tokens",
    "6",
    "--max-state-tokens",
    "32",
    "--selfplay-train-steps",
    "8",
    "--learning-rate",
    "3e-3",
    "--batch-size",
    "8",
    "--micro-batch-size",
    "8",
    "--warmup-steps",
    "0",
    "--lr-schedule",
    "constant",
    "--eval-limit",
    "1",
]
PRIMER_TACTICS = ["omega"] * 3 + ["simp"] * 3 + ["linarith"] * 2 + ["norm_num"] * 2


@pytest.fixture(scope="module")
def primed_model(tiny_model_dir, tmp_path_factory):
    """The tiny model after an offline co-training (rir.co_train, 100 steps) on one-step proofs of
    48 other miniF2F theorems (valid 48-95; the loop searches 0-47): the planner's target "no
    goals", the actor's tactic one of omega, simp, linarith, norm_num (3:3:2:2). It samples tactics
    at moderate rates, as a prover does after D_0."""
    a = args(
        max_state_tokens=32,
        goal_max_new_tokens=4,
        tactic_max_new_tokens=6,
        batch_size=8,
        micro_batch_size=8,
        learning_rate=1e-2,
        warmup_steps=0,
        lr_schedule="constant",
        train_steps=100,
    )
    with stand_in() as v:
        others = load_problems(str(REPO / "data" / "minif2f.jsonl"), 96, split="valid")[48:]
        states = v.start_proofs([(p.header, p.statement) for p in others])
    triples = [rir.Triple(s.pretty, t, rir.NO_GOALS) for s, t in zip(states, PRIMER_TACTICS * 5)]
    tok, threads = rir.load_tokenizer(tiny_model_dir), torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = rir.load_model(tiny_model_dir, CPU, gradient_checkpointing=False)
    optimizer = torch.optim.AdamW(policy.parameters(), a.learning_rate, weight_decay=0.0)
    stats = rir.co_train(
        policy,
        optimizer,
        rir.training_items([(t, (1.0, 1.0), None) for t in triples], tok, a),
        a.train_steps,
        a,
        CPU,
        random.Random(0),
    )
    torch.set_num_threads(threads)
    first, last = stats["losses/loss_first"], stats["losses/loss_last"]
    print(f"primed: co-training loss {first:.2f} -> {last:.2f}")
    out = tmp_path_factory.mktemp("rir_primed")
    policy.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def first_search_tactics(model_dir: str, a) -> collections.Counter:
    """The tactic each theorem's first self-play search samples (None: a malformed planner target or
    tactic): rir.search with main's sampling keys and sizes, on a stand-in that accepts every
    well-formed tactic (--accept all), so each search's proof is the one tactic it sampled."""
    tok, threads = rir.load_tokenizer(model_dir), torch.get_num_threads()
    torch.set_num_threads(1)
    policy = rir.load_model(model_dir, CPU, train=False)
    sampler = rir.Sampler(model_dir, policy, tok, CPU, "hf", a.max_model_len)
    problems = load_problems(str(REPO / a.selfplay_dataset), a.num_problems, split=a.selfplay_split)
    with stand_in("--accept", "all") as v:
        results = rir.search(sampler, v, problems, f"{a.seed}/0/selfplay", a, CPU)
    torch.set_num_threads(threads)
    return collections.Counter(r.proof[0] if r.proved else None for r in results)


@pytest.mark.slow
def test_the_loop_learns_what_the_rule_accepts(primed_model, tmp_path):
    """main() end to end (search, replay into triples, co-training, the sampler's next search)
    raises the share of theorems the rule accepts, and not when the rule is inverted. The rule is
    chosen from what the model samples at iteration 0 (printed): a tactic it samples at a moderate
    rate, accepted alone (--accept tactic:^t$); the inverted rule (not:tactic:^t$) accepts every
    other well-formed tactic. Under it a search proves iff its tactic is well-formed and not t, so 1
    - its pass@1 bounds t's share from above: that bound must fall."""
    import concurrent.futures
    import re

    import tyro

    (tmp_path / "empty.jsonl").write_text(
        ""
    )  # no traced triples: every co-training learns the self-play proofs
    flags = ["--model", primed_model, "--dataset", str(tmp_path / "empty.jsonl"), *LOOP_FLAGS]
    a = tyro.cli(official_args(rir), args=flags)
    emitted = first_search_tactics(primed_model, a)
    n = sum(emitted.values())
    print(
        f"iteration 0 samples ({n} theorems):",
        ", ".join(f"{t!r} {c / n:.2f}" for t, c in emitted.most_common()),
    )
    tactic = next(
        t for t, c in emitted.most_common() if t and 0.2 <= c / n <= 0.6
    )  # a moderate base rate
    rule, base = f"tactic:^{re.escape(tactic)}$", emitted[tactic] / n
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two runs side by side: a core each
        done = dict(
            zip(
                ("normal", "inverted"),
                pool.map(
                    lambda r: run_rir(tmp_path / r[0], *flags, accept=r[1]),
                    [("normal", rule), ("inverted", f"not:{rule}")],
                ),
            )
        )
    curves = {}
    for name, proc in done.items():
        assert proc.returncode == 0, proc.stderr[-4000:]
        curves[name] = [
            r["selfplay/pass@1"] for r in metrics_of(tmp_path / name) if "selfplay/pass@1" in r
        ]
    normal, inverted = curves["normal"], curves["inverted"]
    print(
        f"rule {rule} (base rate {base:.2f}); selfplay/pass@1 by iteration: normal {normal}, "
        f"inverted {inverted} "
        f"(so {tactic!r}'s share at most {[round(1 - p, 3) for p in inverted]})"
    )
    assert len(normal) == len(inverted) == 3
    assert normal[0] == pytest.approx(
        base
    )  # the rule sees what was printed: the same samples at iteration 0
    assert (
        normal[-1] >= normal[0] + 0.3
    )  # learned: the accepted tactic's share rises by 0.3 or more
    assert (
        1 - inverted[-1] <= base - 0.15
    )  # inverted: its share falls (an upper bound on it falls below the base)


# ---- rules by hand, the shared search ----
def test_puct_score_and_simulation_value_by_hand():
    # visited: Q = W / N = 1 / 2 = 0.5 (not 2), U = 1 * 0.5 * sqrt(4) / (1 + 2) = 1/3
    assert rir.puct_score(1.0, 2, 0.5, 3.0, 4, 1.0) == pytest.approx(0.5 + 1 / 3)
    # unvisited: Q = the parent's mean 3 / 4, U = 2 * 0.25 * sqrt(4) / 1 = 1
    assert rir.puct_score(0.0, 0, 0.25, 3.0, 4, 2.0) == pytest.approx(0.75 + 1.0)
    dead = rir.Node(TacticState(1, ["⊢ a"]), expanded=True, dead=True)
    live = rir.Node(TacticState(1, ["⊢ b"]), expanded=True)
    assert rir.simulation_value(dead, 0.5) == 0.0 and rir.simulation_value(live, 0.7) == 0.7


def test_the_weight_scales_each_sequence_of_l_co():
    """co_training_loss multiplies each sequence's summed log-prob by its Example's weight: the
    default weight 1 is the unweighted loss; weights (2, 1, 0) give -(2 * -3 / 2 + -0.5 / 4)."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [-3.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    roles = torch.tensor([0, 1, 1])
    ones = rir.co_training_loss(logp, mask, roles, [2, 4], weights=torch.ones(3))
    assert ones.item() == pytest.approx(rir.co_training_loss(logp, mask, roles, [2, 4]).item())
    weighted = rir.co_training_loss(logp, mask, roles, [2, 4], weights=torch.tensor([2.0, 1, 0]))
    assert weighted.item() == pytest.approx(3.0 + 0.125)
    found = result("a", True, 1.0, 1)
    step = rir.Triple("⊢ A", "win", rir.NO_GOALS)
    found = proved_along(found, [step])
    known = set()
    data = rir.self_play_triples([found, result("b", False, 1.0, 1)], known, args())
    assert data == [(step, (1.0, 1.0), found)] and known == {step}
    # a triple already in D_t (a human one, an earlier proof's) is not added again
    assert rir.self_play_triples([found], known, args()) == []


def test_self_play_rules_one_function_each():
    """trains_on: a proof within the budget; unseen_steps: the path's steps not in D_t, added to
    it once, with their index; self_play_weight: (1, 1)."""
    found = result("a", True, 1.0, 1)
    overrun = result("b", False, 1.0, 1)
    assert rir.trains_on(found, args()) and not rir.trains_on(overrun, args())
    first = rir.Triple("⊢ A", "intro", "⊢ B")
    second = rir.Triple("⊢ B", "win", rir.NO_GOALS)
    found = proved_along(found, [first, second])
    known = {first}
    assert rir.unseen_steps(found, known) == [(1, second)] and known == {first, second}
    assert rir.unseen_steps(found, known) == []
    assert rir.self_play_weight(found, 1, args()) == (1.0, 1.0)


def test_loss_reductions_by_hand():
    """token_mean divides each role by its tokens in the batch; sequence both by the triples."""
    assert rir.token_mean_denominators([7, 3], 4) == [7, 3]
    assert rir.sequence_denominators([7, 3], 4) == [4, 4]
    assert rir.loss_reduction_rule(args(loss_reduction="sequence")) is rir.sequence_denominators


@pytest.mark.parametrize(
    "flag, table", [("search", "NODE_CHOICES"), ("loss_reduction", "LOSS_REDUCTIONS")]
)
def test_a_choice_without_its_entry_stops_at_start(flag, table):
    """A Literal value a fork added without its table entry stops in check_choices, naming the
    table to add it to."""
    option = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{option} new: add its entry to {table}"):
        rir.check_choices(args(**{flag: "new"}))
    rir.check_choices(args())


def test_proposed_edges_rank_and_fail():
    """The planner's samples become target Edges ranked by log p(s* | s), a duplicate keeping
    its best; the actor's carry their plan's target; a malformed sample is a failed edge last."""
    samples = [
        rir.Sample("⊢ B", [], [1], [-2.0], "stop"),
        rir.Sample("⊢ <a>C</a>", [], [1, 2], [-0.5, -0.5], "stop"),
        rir.Sample("⊢ B", [], [1], [-0.5], "stop"),
        rir.Sample("", [], [], [], "stop"),
    ]
    plans = rir.proposed_edges(samples)
    assert plans == [
        rir.Edge(None, 0.0, 0, "⊢ B", -0.5),
        rir.Edge(None, 0.0, 0, "⊢ C", -1.0),
        rir.Edge(None, 0.0, 0),
    ]
    tactics = rir.proposed_edges(samples[:2], plans[0])
    assert tactics == [
        rir.Edge("⊢ C", -1.0, 2, "⊢ B", -0.5),
        rir.Edge("⊢ B", -2.0, 1, "⊢ B", -0.5),
    ]


def test_the_shared_search_runs_in_lockstep(monkeypatch):
    """One planner call a round for every live theorem, one actor call per target index, one
    apply_tactics call for the i-th tactic of every theorem (2 theorems, 2 rounds)."""
    calls = []
    real = rir.sample

    def counting(sampler, prompts, **kw):
        calls.append((kw["desc"], len(prompts)))
        return real(sampler, prompts, **kw)

    monkeypatch.setattr(rir, "sample", counting)
    other = Problem("u", "", "theorem u : A := by")
    lean = EndlessLean()
    sampler = PromptSampler(WholeText(), any_prompt)
    a = args(max_expansions=2, num_sampled_goals=1, num_sampled_tactics=2)
    results = rir.best_first_search(sampler, lean, [THEOREM, other], "k", a)
    assert calls == [("plan", 2), ("act", 2)] * 2 and [r.expansions for r in results] == [2, 2]
    assert lean.calls == [["X0", "X0"], ["X1", "X1"]] * 2
    # EndlessLean's two tactics reach the same goals: one new state an expansion, one merge
    assert [(r.nodes, r.merged) for r in results] == [(3, 2), (3, 2)]
