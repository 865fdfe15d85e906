"""RiR: Reasoning in Reasoning, a goal planner and a goal-driven actor for hierarchical proof search in Lean 4.

Paper: Ziyu Ye et al., "Reasoning in Reasoning" (its text was not readable here: the method, its loss, Algorithm 1,
Tables 1-2 and Figures 2-3 as Z. Ye's talk "Learning to Reason and Align via Self-Play", Dec 2024, presents them).
Official code: github.com/ZIYU-DEEP/Reasoning-in-Reasoning (read at c5976f2), built on ReProver (github.com/lean-dojo/
ReProver, read at fd6d99c); this file copies none of it.

Method. Flat provers sample a tactic y ~ pi(. | s) for the proof state s. RiR splits the step in two policies: the
PLANNER pi_h(s* | s) proposes the next proof state s* (the state after the tactic, "no goals" when it closes the proof),
the ACTOR pi_l(y | s, s*) a tactic that reaches it, both in the official text formats ([CURRENT GOAL] / [TARGET GOAL] /
[PROOFSTEP]; tactics name premises as <a>full name</a>, marks removed from what is sampled). Each iteration:
  1. co-train (offline SFT) on traced (s, y*, s*) triples D_t: L_co = -1/N sum [log p(s* | s) + log p(y* | s, s*)];
  2. search: best-first (official) or MCTS (ours) over Lean's tactic mode; an expansion pops the best open node, the
     planner proposes targets, for each in turn the actor samples tactics and Lean runs them, until the first proof;
     a new node's priority is its parent's + log p(y | s, s*) + log p(s* | s);
  3. self-play (ours, expert iteration): proofs found on the self-play theorems are replayed through Lean into new
     triples, D_{t+1} = D_t + these; not in the last iteration, after which the benchmark is searched.
Metrics (metrics.jsonl, step = iterations done): eval/pass@1 under the budget (Tables 1-2); Figure 2's split of the
proved searches' time, eval/{planner,actor,env}_time_proved (each role's sampling, Lean's tactic runs); Figure 3's
eval/search_time_proved and <run>/search_time_cdf.csv; selfplay/*, losses/*, time/*; searches to <run>/searches.jsonl.

Run. Without CUDA, `python <this file>` runs a loop scaled down by CPU_DEFAULTS and prints what it scaled; `torchrun
--nproc_per_node 8 <this file>` runs the full sizes; `--iterations 0` evaluates the given model. Both need Lean:
`bash setup.sh --lean`, or for a CPU smoke run the stand-in REPL, LEAN_REPL_CMD="python tests/fake_lean_repl.py",
which follows the tactic table of data/lean_tactics.jsonl. Experiment map: README.md.
Data: LeanDojo Benchmark 4's random split (the authors' Hugging Face upload, or train.json of zenodo.org/records/
10929138 as utils/download_data.py fetches it); the theorems are miniF2F's (valid for self-play, test for evaluation).

Deliberate deviations:
  1. Lean through lean_verify's REPL tactic mode, not LeanDojo: states merge by goals, a found proof is checked whole.
  2. One decoder LM for both roles, Qwen2.5-0.5B at lr 2e-5 (official: two ByT5-small models, at lr 8e-4 and 7e-4).
  3. Sampling at temperature 1, deduplicated, ranked by summed log-probs, not beam search (length_penalty 0).
  4. The flat baseline's prompt marks where the tactic starts (official: the bare state, an encoder's input).
  5. Equal budgets for RiR and the flat baseline, read before each sampling call and tactic (official: each expansion).
  6. LeanDojo Benchmark 4's test theorems need LeanDojo's Dojo: it is the co-training data, miniF2F the theorems.
  7. MCTS is ours (no code was released): PUCT, prior from the planner x actor probability; no value net, no rollouts.
  8. Self-play iterations are ours (expert iteration), continuing the weights and optimizer.
  9. The default loss is each role's token mean over the batch (official: per T5); --loss-reduction sequence: L_co.
 10. --joint-format: the actor sees s*; the official joint search samples y from s alone (s* only in the priority).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import csv
import heapq
import importlib.util
import itertools
import json
import math
import os
import pathlib
import random
import shutil
import sys
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import tyro
import wandb
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TemperatureLogitsWarper, TopPLogitsWarper

from lean_verify import LeanNotInstalled, LeanVerifier, Problem, Triple, load_problems, load_triples


@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed> unless --run-name)"""
    seed: int = 3407  # official
    """seed of the run (each rank adds its rank)"""
    output_dir: str = "runs"
    """where run directories go"""
    run_name: str | None = None
    """run directory name; default <exp_name>__<seed>"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "selfplay"
    """the wandb project"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    save_every: int = 1
    """save a checkpoint every this many iterations (and after the last)"""
    resume: bool = False
    """continue from the latest checkpoint in the run directory"""

    # model and backends
    model: str = "Qwen/Qwen2.5-0.5B"
    """planner and actor, one LM: a Hugging Face id, a local path, or embedded:smollm2 (the CPU default)"""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """sampler: vLLM when CUDA and vllm are present (auto), else transformers"""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of GPU memory (it sleeps while the policy trains)"""
    vllm_sleep: bool = True
    """put vLLM to sleep during training (level 2) and wake it with fresh weights"""
    max_model_len: int = 4096
    """longest prompt + completion, in tokens"""
    gradient_checkpointing: bool = True
    """activation checkpointing in training"""

    # data
    dataset: str = "cat-searcher/leandojo-benchmark-4-random"
    """traced tactics: LeanDojo Benchmark 4 (random split) on the Hugging Face hub, its train.json, or a .jsonl"""
    num_triples: int | None = None
    """use only the first N triples"""
    selfplay_dataset: str = "data/minif2f.jsonl"
    """the problems searched in self-play: a Hugging Face dataset, a .jsonl or a .json (lean_verify.load_problems)"""
    selfplay_split: str | None = "valid"
    """which split of --selfplay-dataset (None: all rows)"""
    num_problems: int | None = None
    """use only the first N problems of --selfplay-dataset (default all)"""

    # algorithm
    iterations: int = 2  # 2 (ours): one self-play iteration, then co-training again and the evaluation
    """iterations to run (the paper's word: rounds); 1: the official offline run; 0: evaluate the given model"""
    train_steps: int = 40000
    """co-training steps of the first iteration (the released actor checkpoint: step 40000)"""
    selfplay_train_steps: int = 4000
    """co-training steps of each later iteration (ours)"""

    # search
    search: Literal["bfs", "mcts"] = "bfs"
    """best-first search (official) or MCTS (the talk's Table 2; ours)"""
    num_sampled_goals: int = 5
    """target states the planner proposes per expansion (official num_sampled_goals)"""
    num_sampled_tactics: int = 64
    """tactics the actor proposes per target state, or per expansion without planner (official num_sampled_tactics)"""
    max_expansions: int | None = None  # official RiR's (ReProver's N allows N + 1); an RiR expansion samples more
    """expansions per theorem (None: only the clock limits a search)"""
    search_timeout: float = 600.0  # official --timeout (its logged comparison gave RiR 3200 s, ReProver 600 s)
    """seconds per theorem (the search's budget, read before each tactic)"""
    temperature: float = 1.0
    """sampling temperature of planner and actor"""
    top_p: float = 1.0
    """nucleus sampling"""
    goal_max_new_tokens: int = 768
    """longest target state the planner writes (official max_oup_seq_len 2300 bytes)"""
    tactic_max_new_tokens: int = 128  # official max_oup_seq_len 512 bytes
    """longest tactic"""
    lean_timeout: float = 60.0
    """Lean's wall-clock limit per tactic, in seconds (a timeout is a failed edge)"""
    lean_workers: int | None = None
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of the machine)"""
    c_puct: float = 1.0
    """MCTS: exploration constant of PUCT"""
    leaf_value: float = 0.5
    """MCTS: value an open leaf backs up (no value network; a dead end backs up 0)"""

    # co-training (L_co; official goal_driven_tactic_8gpu.yaml)
    batch_size: int = 32  # official: 64 planner, 32 actor sequences
    """triples per optimizer step (each gives a planner and an actor sequence)"""
    loss_reduction: Literal["token_mean", "sequence"] = "token_mean"
    """token_mean: each role's loss is its token mean (official T5 loss); sequence: L_co as written"""
    max_state_tokens: int = 768
    """states (s and s*) are cut to their first this many tokens (official: 2300 bytes)"""
    learning_rate: float = 2e-5  # AdamW, no weight decay
    """peak learning rate"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"  # official common.py, over each co-training
    """learning-rate schedule after the warm-up (lr_at)"""
    warmup_steps: int = 4000  # of the first iteration; each later one warms up for the same share of its steps
    """linear warm-up steps from 0"""
    micro_batch_size: int = 8
    """triples per forward/backward on each rank"""
    max_grad_norm: float = 1.0  # official gradient_clip_val
    """gradient clipping"""

    # ablations
    planner: bool = True
    """the goal planner (--no-planner: the flat ReProver baseline, the same LM as a plain tactic generator)"""
    joint_format: bool = False
    """one sequence per triple, [CURRENT GOAL] s -> [TARGET GOAL] s* [PROOFSTEP] y (official gen_type joint)"""

    # evaluation
    eval_dataset: str = "data/minif2f.jsonl"
    """benchmark (lean_verify.load_problems: miniF2F's name, split, header, formal_statement)"""
    eval_split: str | None = "test"
    """which split of the benchmark (None: all rows)"""
    eval_limit: int | None = None
    """use only the first N benchmark problems"""
    eval_every: int = 0  # the talk evaluates the trained model
    """evaluate every this many iterations and after the last (0: only after the last)"""


# Without CUDA the full sizes would take weeks; these run an iteration on 2 cores in minutes (SmolLM2-135M samples
# ~60 tokens/s in a batch of 8; an expansion with 2 targets x 4 tactics takes ~10 s, a co-training step ~10 s). The
# benchmark stays miniF2F-test (its first 5): the built-in theorems are the training data (D_0 holds their proofs).
CPU_DEFAULTS = dict(model="embedded:smollm2", dataset="data/rir_triples.jsonl", selfplay_split="builtin",
                    selfplay_dataset="data/rir_theorems.jsonl", eval_limit=5, num_sampled_goals=2,
                    num_sampled_tactics=8, max_expansions=4, search_timeout=300.0, lean_timeout=10.0, train_steps=8,
                    selfplay_train_steps=2, warmup_steps=0, learning_rate=3e-4, batch_size=8, micro_batch_size=4,
                    max_state_tokens=128, goal_max_new_tokens=64, tactic_max_new_tokens=24, max_model_len=1024)


# ---- prompts ----
# The official text formats (common.format_input, generator/datamodule.collate), raw completion prompts. The planner
# continues PLANNER_PROMPT with s*; the actor continues ACTOR_PROMPT with y; the joint format trains one sequence
# JOINT_PROMPT -> JOINT_TARGET, whose prefixes are the two prompts at search time.
PLANNER_PROMPT = "[CURRENT GOAL]\n{state}\n[TARGET GOAL]\n"
ACTOR_PROMPT = "[CURRENT GOAL]\n{state}\n[TARGET GOAL]\n{target}\n[PROOFSTEP]\n"
JOINT_PROMPT = "[CURRENT GOAL]\n{state}\n"
JOINT_TARGET = "[TARGET GOAL]\n{target}\n[PROOFSTEP]\n{tactic}\n"
FLAT_PROMPT = "[CURRENT GOAL]\n{state}\n[PROOFSTEP]\n"  # deviation 4: a decoder needs a marker where the tactic starts
GOAL_STOP = "\n[PROOFSTEP]"  # where a target state ends in the joint format
NO_GOALS = "no goals"  # LeanDojo's state after the tactic that closes the proof: the planner's target for it


# ---- data ----
# A theorem is lean_verify's Problem(id, header, statement), as load_problems reads them from a dataset (miniF2F's
# fields). A traced tactic (s, y*, s*) is lean_verify's Triple(state, tactic, target), as load_triples reads them
# from LeanDojo's rows (official datamodule._load_data, common.format_state).
def clip(tokenizer, text: str, max_tokens: int) -> str:
    """The text cut to its first max_tokens tokens (the official tokenizer truncates inputs at their end), at the start
    of the first token it drops: a prefix of the text, and a character split over two tokens goes whole."""
    tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return text if len(tokens.input_ids) <= max_tokens else text[: tokens.offset_mapping[max_tokens][0]]


# ---- rewards ----
# RiR has no reward model: the policy's own log-probabilities rank the search; these are its arithmetic.
def child_priority(parent_priority: float, logp_goal: float, logp_tactic: float) -> float:
    """Best-first priority of a new node (official prover_rir _run_tactic): the parent's cumulative log-probability
    plus log p(y | s, s*) + log p(s* | s); the flat baseline has log p(s* | s) = 0 (ReProver)."""
    return parent_priority + logp_tactic + logp_goal


def puct_score(value: float, visits: int, prior: float, parent_value: float, parent_visits: int, c_puct: float
               ) -> float:
    """MCTS selection (ours): Q + c_puct P sqrt(N_parent) / (1 + N), Q of an unvisited child its parent's mean value."""
    q = value / visits if visits else parent_value / max(parent_visits, 1)
    return q + c_puct * prior * math.sqrt(parent_visits) / (1 + visits)


def edge_priors(log_masses: list[float]) -> list[float]:
    """MCTS priors of a node's children: the softmax of the log probability mass of the edges that reached each child
    (log p(s* | s) + log p(y | s, s*), summed over the edges to the same child)."""
    top = max(log_masses, default=0.0)
    weights = [math.exp(m - top) for m in log_masses]
    return [w / sum(weights) for w in weights]


def search_time_cdf(times: list[float], total: int) -> list[tuple[float, int, float]]:
    """Figure 3: each proved theorem's search time t (sorted), the theorems proved within t, their share of `total`."""
    return [(t, k, k / total) for k, t in enumerate(sorted(times), 1)]


# ---- losses ----
def co_training_loss(logp: torch.Tensor, mask: torch.Tensor, roles: torch.Tensor, denominators: list[float]
                     ) -> torch.Tensor:
    """L_co = -[log p(s* | s) + log p(y* | s, s*)]: logp, mask [B, T] are the output tokens' log-probs of B sequences,
    roles [B] says which term each is (0: the planner's s*, or a joint sequence; 1: the actor's y*). Each term is its
    sequences' summed token log-probs divided by its denominator: the role's token count over the whole batch (the
    official T5 token mean) or the number of triples N (L_co as written). Micro-batches add up to the batch's loss."""
    seq = (logp * mask).sum(1)
    return -sum(seq[roles == r].sum() / d for r, d in enumerate(denominators) if d > 0)


# ---- phases ----
# A search's record: the fields every search of the family has (coprover.py, rir.py), then the method's own fields:
# whether the proof came within the budget, the official "Search Statistics" (seconds per role), the overshoot.
# A proposal: target s* (None without the planner), tactic y (None if malformed: a failed edge), their log-probs.
SearchResult = collections.namedtuple("SearchResult", "id proof seconds expansions nodes edges failed_edges "
                                                      "proved planner_seconds actor_seconds env_seconds overshoot")
Edge = collections.namedtuple("Edge", "target tactic logp_goal logp_tactic")


@dataclass(eq=False)
class Node:  # a proof state of the search (states with the same goals are one node)
    state: object  # lean_verify.TacticState
    priority: float = 0.0  # BFS: the path's summed log p(y | s, s*) + log p(s* | s)
    prior: float = 1.0  # MCTS: P of the edge from the parent that found this state
    visits: int = 0  # MCTS: N, simulations through this node
    value: float = 0.0  # MCTS: W, the sum of their backed-up values
    children: list = field(default_factory=list)  # the new states its expansion found
    expanded: bool = False
    dead: bool = False  # expanded and no live child: nothing left to search below it


def ranked(samples: list[Sample]) -> tuple[list[tuple[str, float]], int]:
    """Distinct non-empty completions without premise marks (official remove_marks), highest summed log-prob first (as
    the official beam search scores them), and how many were malformed (empty, or a failed vLLM request)."""
    best, malformed = {}, 0
    for s in samples:
        text = s.text.replace("<a>", "").replace("</a>", "").strip()
        if s.finish_reason not in ("stop", "length") or not text:
            malformed += 1
        else:
            best[text] = max(best.get(text, -math.inf), float(sum(s.logprobs)))
    return sorted(best.items(), key=lambda kv: -kv[1]), malformed


def propose(sampler, tokenizer, state: str, key: str, args: Args, seconds: collections.Counter, clock=time.monotonic):
    """Plan, then act, for one node in the official order (_step): targets s* ~ pi_h(. | s), then the tactics
    y ~ pi_l(. | s, s*) of one target at a time (flat: y ~ pi(. | s)), sampled only when the search asks for that
    target's first edge. Yields edges, each target's by log-prob and its malformed samples last (failed edges), the
    planner's malformed ones at the end; adds each sampling call's seconds to seconds["planner"] or seconds["actor"]."""
    state, targets, failed_plans = clip(tokenizer, state, args.max_state_tokens), [(None, 0.0)], 0
    params = dict(temperature=args.temperature, top_p=args.top_p)
    if args.planner:
        start = clock()
        [goals] = sample(sampler, [PLANNER_PROMPT.format(state=state)], args.num_sampled_goals, f"{key}/planner",
                         max_new_tokens=args.goal_max_new_tokens, stop=[GOAL_STOP] if args.joint_format else None,
                         desc="plan", **params)  # s* alone ends at end-of-sequence (HF's stop strings: ~1 s a call)
        targets, failed_plans = ranked(goals)
        seconds["planner"] += clock() - start
    for i, (target, logp_goal) in enumerate(targets):
        start = clock()
        prompt = (ACTOR_PROMPT.format(state=state, target=clip(tokenizer, target, args.max_state_tokens))
                  if args.planner else FLAT_PROMPT.format(state=state))
        [samples] = sample(sampler, [prompt], args.num_sampled_tactics, f"{key}/actor/{i}",
                           max_new_tokens=args.tactic_max_new_tokens, desc="act", **params)
        tactics, malformed = ranked(samples)
        seconds["actor"] += clock() - start
        yield from [Edge(target, y, logp_goal, logp) for y, logp in tactics]
        yield from [Edge(target, None, logp_goal, 0.0)] * malformed
    yield from [Edge(None, None, 0.0, 0.0)] * failed_plans


def expand(node: Node, edges, verifier, nodes: dict, counts: collections.Counter, deadline: float = math.inf,
           clock=time.monotonic):
    """One expansion (official _step): the edges' tactics run on the node's state one at a time, in their order, until
    one proves the theorem or the deadline passes (read before an edge is drawn, which may sample, and before its
    tactic runs); a new open state becomes a child (child_priority), a known one merges; errors, timeouts and malformed
    proposals are failed edges. `nodes` gets every distinct outcome (official: error and finished nodes count too);
    `counts` the edges, failed edges and Lean's seconds (tactics only). Returns the proof or None."""
    tried, mass, edges = {}, {}, iter(edges)
    while clock() <= deadline and (e := next(edges, None)) is not None and clock() <= deadline:
        if e.tactic and e.tactic not in tried:  # a tactic proposed under two targets runs once
            start = clock()
            tried[e.tactic] = verifier.apply_tactic(node.state, e.tactic)
            counts["env"] += clock() - start
        child = tried.get(e.tactic)
        counts["edges"] += 1
        if child is not None and child.status != "open":  # LeanDojo's ErrorNode / ProofFinishedNode of a response
            nodes.setdefault((child.status, child.error or tuple(child.tactics)), None)
        if child is not None and child.solved and verifier.check_tactic_path(child).valid:
            node.expanded = True
            return child
        if child is None or child.status != "open":
            counts["failed_edges"] += 1
        elif child.key in mass:  # another edge to a child of this expansion: its prior mass grows
            mass[child.key] = np.logaddexp(mass[child.key], e.logp_goal + e.logp_tactic)
        elif child.key not in nodes:  # MCTS: the first parent to find a state owns its visits and value
            nodes[child.key] = Node(child, child_priority(node.priority, e.logp_goal, e.logp_tactic))
            node.children.append(nodes[child.key])
            mass[child.key] = e.logp_goal + e.logp_tactic
    for child, prior in zip(node.children, edge_priors([mass[c.state.key] for c in node.children])):
        child.prior = prior
    node.expanded, node.dead = True, not node.children
    return None


def select(root: Node, c_puct: float) -> list[Node]:
    """MCTS selection (ours): the path from the root by the live child of best PUCT score, down to a leaf."""
    path = [root]
    while path[-1].expanded:
        parent = path[-1]
        path.append(max((c for c in parent.children if not c.dead), key=lambda c: puct_score(
            c.value, c.visits, c.prior, parent.value, parent.visits, c_puct)))
    return path


def backup(path: list[Node], value: float) -> None:
    """MCTS backup (ours): the path's nodes count the visit and add the leaf's value; all children dead: dead."""
    for node in path:
        node.visits, node.value = node.visits + 1, node.value + value
    for node in reversed(path[:-1]):
        node.dead = all(c.dead for c in node.children)


def prove(problem: Problem, plan_and_act, verifier, args: Args, clock=time.monotonic) -> SearchResult:
    """Search one theorem (official BestFirstSearchProver.search; MCTS ours, a simulation an expansion) until a proof,
    an exhausted tree or the budget: search_timeout seconds of sampling and Lean alike, with or without planner, read
    before each expansion, sampling call and tactic (deviation 5; official: Dojo's hard timeout at budget + 60 s), so a
    search overshoots by one tactic or one draw's sampling at most; as officially, a proof past the budget fails.
    `plan_and_act(state_text, expansion, seconds)` yields the node's edges (adding its sampling time to seconds)."""
    root = Node(verifier.start_proof(problem.header, problem.statement))
    nodes, frontier, tie, counts = {root.state.key: root}, [(0.0, 0, root)], itertools.count(1), collections.Counter()
    proof, expansions, start = None, 0, clock()
    while (root.state.status == "open" and proof is None and clock() - start <= args.search_timeout
           and (args.max_expansions is None or expansions < args.max_expansions)):
        if args.search == "bfs" and not frontier or args.search == "mcts" and root.dead:
            break
        path = [heapq.heappop(frontier)[2]] if args.search == "bfs" else select(root, args.c_puct)
        proof = expand(path[-1], plan_and_act(path[-1].state.pretty, expansions, counts), verifier, nodes, counts,
                       start + args.search_timeout, clock)
        expansions += 1
        if args.search == "bfs":
            for child in path[-1].children:
                heapq.heappush(frontier, (-child.priority, next(tie), child))
        else:
            backup(path, 0.0 if path[-1].dead else args.leaf_value)
    seconds = clock() - start  # no free_states: a REPL restart re-imports Mathlib; the pool's bounds recycle REPLs
    return SearchResult(problem.id, proof and proof.tactics, seconds, expansions, len(nodes), counts["edges"],
                        counts["failed_edges"], proof is not None and seconds <= args.search_timeout,
                        counts["planner"], counts["actor"], counts["env"], max(0.0, seconds - args.search_timeout))


def search(sampler, verifier, problems: list[Problem], key: str, args: Args, dist: Dist) -> list[SearchResult]:
    """Step 2 on every rank's share of `problems`, one theorem at a time (official: 3-4 Ray provers per GPU), pass@1."""
    def run(mine: list[Problem]) -> list[SearchResult]:
        return [prove(p, lambda state, k, seconds, p=p: propose(sampler, sampler.tokenizer, state, f"{key}/{p.id}/{k}",
                                                                args, seconds), verifier, args) for p in mine]

    return map_sharded(run, problems, dist)


def replay_proofs(verifier, problems: list[Problem], results: list[SearchResult], dist: Dist) -> list[Triple]:
    """Self-play (ours, expert iteration): each proof found is replayed tactic by tactic through Lean, and its steps
    become (s, y, s') triples (s' = 'no goals' for the last, no premise marks), as LeanDojo traces a human proof."""
    def run(mine: list[tuple[Problem, list[str]]]) -> list[list[Triple]]:  # a path that no longer replays: nothing
        roots = verifier.start_proofs([(p.header, p.statement) for p, _ in mine])
        return [[Triple(s.pretty, after.tactics[-1], after.pretty or NO_GOALS) for s, after in zip(states, states[1:])]
                if states else [] for states in verifier.replay(roots, [proof for _, proof in mine])]

    proved = [(p, r.proof) for p, r in zip(problems, results) if r.proved]
    return [triple for steps in map_sharded(run, proved, dist) for triple in steps]


def training_items(triples: list[Triple], tokenizer, args: Args) -> list[list[tuple[Sample, int]]]:
    """Each triple (s, y*, s*) as the sequences of L_co, (Sample, role) pairs ending in end-of-sequence: PLANNER_PROMPT
    -> s* (role 0) and ACTOR_PROMPT -> y* (role 1) (official collate: gen_type goal, goal_driven_tactic); one JOINT
    sequence (role 0) with --joint-format; FLAT_PROMPT -> y* (role 1) without planner."""
    def sequence(prompt: str, target: str, limit: int, role: int) -> tuple[Sample, int]:
        ids = tokenizer(target, add_special_tokens=False).input_ids[:limit] + [tokenizer.eos_token_id]
        return Sample(target, encode_prompt(tokenizer, prompt), ids, [], "stop"), role

    items = []
    for s, y, g in triples:
        s, g = clip(tokenizer, s, args.max_state_tokens), clip(tokenizer, g, args.max_state_tokens)
        if not args.planner:
            items.append([sequence(FLAT_PROMPT.format(state=s), y, args.tactic_max_new_tokens, 1)])
        elif args.joint_format:
            items.append([sequence(JOINT_PROMPT.format(state=s), JOINT_TARGET.format(target=g, tactic=y),
                                   args.goal_max_new_tokens + args.tactic_max_new_tokens, 0)])
        else:
            items.append([sequence(PLANNER_PROMPT.format(state=s), g, args.goal_max_new_tokens, 0),
                          sequence(ACTOR_PROMPT.format(state=s, target=g), y, args.tactic_max_new_tokens, 1)])
    return items


def co_train(policy, optimizer, items: list, steps: int, args: Args, dist: Dist, rng: random.Random) -> dict:
    """Offline goal-driven co-training (official generator/main.py fit, one model here): `steps` AdamW steps on
    batch_size triples drawn epoch by epoch, each minimising L_co over its batch (each rank its share); the learning
    rate of get_cosine_schedule_with_warmup over the `steps` (official: over 500k, stopped at ~40k): every co-training
    warms up, then decays (a later iteration for the first's share of its steps, ours)."""
    stream, history, size = [], [], min(args.batch_size, len(items))
    warmup = min(args.warmup_steps, args.warmup_steps * steps // max(args.train_steps, 1))
    for step in range(steps):
        while len(stream) < size:
            stream += rng.sample(items, len(items))
        batch, stream = stream[:size], stream[size:]
        tokens = [sum(len(s.token_ids) for item in batch for s, r in item if r == role) for role in (0, 1)]
        denominators = tokens if args.loss_reduction == "token_mean" else [len(batch)] * 2

        def loss_fn(micro: list) -> tuple[torch.Tensor, dict]:  # the batch's L_co; the roles' summed NLL to log
            pairs = [x for item in micro for x in item]
            logp, mask, _ = token_logprobs(policy, [s for s, _ in pairs])
            roles, nll = torch.tensor([r for _, r in pairs], device=logp.device), -(logp.detach() * mask).sum(1)
            return co_training_loss(logp, mask, roles, denominators), {
                "goal": nll[roles == 0].sum().item(), "tactic": nll[roles == 1].sum().item()}

        lr = lr_at(step, steps, args.learning_rate, warmup, args.lr_schedule)
        stats = train_step(policy, optimizer, batch, loss_fn, args.micro_batch_size, args.max_grad_norm, dist,
                           length=lambda item: sum(len(s.prompt_ids) + len(s.token_ids) for s, _ in item), lr=lr)
        history.append({"loss": stats["loss"], "goal_nll": stats["goal"] / max(tokens[0], 1),
                        "tactic_nll": stats["tactic"] / max(tokens[1], 1), "grad_norm": stats["grad_norm"]})
    return {f"losses/{k}": float(np.mean([h[k] for h in history])) for k in history[0]} | {
        "losses/loss_first": history[0]["loss"], "losses/loss_last": history[-1]["loss"],
        "losses/steps": float(steps), "losses/learning_rate_last": lr}


# ---- evaluation ----
def search_metrics(results: list[SearchResult], prefix: str, seconds: float) -> dict[str, float]:
    """Search efficiency: the theorems proved (count, share, per expansion and per second of the phase's wall time
    `seconds`), the expansions and nodes per proof, the proofs' length, the share of failed edges, the seconds searches
    ran past the budget; the method's own (the talk's): pass@1 under the budget (Tables 1-2), the planner, actor and
    environment seconds and the search time of the proved theorems (Figures 2-3; mean and median as official logs)."""
    proved = [r for r in results if r.proved]
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
    expansions = sum(r.expansions for r in results)
    return {f"{prefix}/theorems": float(len(results)), f"{prefix}/proved": float(len(proved)),
            f"{prefix}/pass@1": len(proved) / max(len(results), 1),
            f"{prefix}/proofs_per_expansion": len(proved) / max(expansions, 1),
            f"{prefix}/proofs_per_second": len(proved) / seconds if seconds else 0.0,
            f"{prefix}/expansions_per_proof": mean([r.expansions for r in proved]),
            f"{prefix}/nodes_per_proof": mean([r.nodes for r in proved]),
            f"{prefix}/proof_length": mean([len(r.proof) for r in proved]),
            f"{prefix}/expansions": float(expansions),
            f"{prefix}/failed_edge_share": sum(r.failed_edges for r in results) / max(sum(r.edges for r in results), 1),
            f"{prefix}/search_time_proved": mean([r.seconds for r in proved]),
            f"{prefix}/search_time_proved_median": float(np.median([r.seconds for r in proved])) if proved else 0.0,
            **{f"{prefix}/{k}_time_proved": mean([getattr(r, f"{k}_seconds") for r in proved])
               for k in ("planner", "actor", "env")},
            **{f"{prefix}/{k}_seconds": float(sum(getattr(r, f"{k}_seconds") for r in results))
               for k in ("planner", "actor", "env")},
            f"{prefix}/overshoot_max": max((r.overshoot for r in results), default=0.0),
            f"{prefix}/overshoot_mean": mean([r.overshoot for r in results])}


def write_searches(run_dir: pathlib.Path, results: list[SearchResult], phase: str, step: int, dist: Dist) -> None:
    """Every search to <run>/searches.jsonl, with the step (iterations done) its metrics are logged at."""
    if dist.is_main:
        with open(run_dir / "searches.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, "phase": phase, **r._asdict()}) + "\n" for r in results)


def evaluate(sampler, verifier, problems: list[Problem], key: str, run_dir: pathlib.Path, step: int, args: Args,
             dist: Dist) -> dict[str, float]:
    """Tables 1-2 and Figures 2-3: one search per benchmark theorem under the budget; every search to searches.jsonl,
    Figure 3's CDF to <run>/search_time_cdf.csv."""
    start = time.monotonic()
    results = search(sampler, verifier, problems, key, args, dist)
    write_searches(run_dir, results, "eval", step, dist)
    if dist.is_main:
        with open(run_dir / "search_time_cdf.csv", "w", newline="") as f:
            csv.writer(f).writerows([("seconds", "proved", "share")] + search_time_cdf(
                [r.seconds for r in results if r.proved], len(results)))
    return search_metrics(results, "eval", time.monotonic() - start)


def nothing_learned(run_dir: pathlib.Path) -> str | None:
    """A run's last line when none of its searches (searches.jsonl) proved a theorem (the CPU default on the embedded
    model): what its tactics did; None when one did."""
    path = run_dir / "searches.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not rows or any(r["proved"] for r in rows):
        return None
    edges, failed, expansions = (sum(r[k] for r in rows) for k in ("edges", "failed_edges", "expansions"))
    return (f"No theorem proved in the run's {len(rows)} searches ({expansions} expansions): of the {edges} tactics "
            f"tried, {failed} failed in Lean or were malformed, {edges - failed} left goals open. The loop ran; "
            "tests/test_rir.py::test_the_loop_learns_what_the_rule_accepts shows it learn.")


# ---- main ----
def main(args: Args) -> None:
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS, sys.argv[1:])
    try:  # stop at once, before any model is loaded, when there is no Lean REPL (the search needs its tactic mode)
        workers = max(1, args.lean_workers // dist.local_world_size) if args.lean_workers else None
        verifier = LeanVerifier(backend="repl", timeout=args.lean_timeout, workers=workers)
    except LeanNotInstalled as e:  # the Lean stand-in follows data/lean_tactics.jsonl's tactic table
        name = os.path.basename(__file__)
        sys.exit(f"{name} searches proofs in Lean 4's tactic mode and found no Lean REPL: {e} For a CPU smoke run "
                 f"without Lean, the stand-in REPL: LEAN_REPL_CMD='python tests/fake_lean_repl.py' python {name}")
    if dist.is_main:
        print(f"lean_verify: {verifier.workers} REPL(s) on each of the node's {dist.local_world_size} rank(s)")
    problems = load_problems(args.selfplay_dataset, args.num_problems, split=args.selfplay_split)
    benchmark = load_problems(args.eval_dataset, args.eval_limit, split=args.eval_split)
    triples = load_triples(args.dataset, args.num_triples)  # D_0: the traced triples

    # the model (method: one LM plays planner and actor by prompt; the official code trains two ByT5 models)
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    models = {"policy": (policy, torch.optim.AdamW(policy.parameters(), args.learning_rate, weight_decay=0.0))}
    # run state: the triples self-play added to D_0 (plain tuples: state.pt loads without rir.py), the proofs found
    start, state = 0, {"selfplay_triples": [], "proved": {}}
    if args.resume and (found := load_checkpoint(run_dir, models, dist)) is not None:
        start, state = found
    sampler = Sampler(args.model, policy, tokenizer, dist, args.backend, args.max_model_len,
                      args.gpu_memory_utilization, args.vllm_sleep, seed=args.seed)

    for iteration in range(start, args.iterations):
        data = triples + [Triple(*t) for t in state["selfplay_triples"]]  # D_t
        metrics, rng = {"charts/triples": float(len(data))}, random.Random(f"{args.seed}/{iteration}")

        # 1. Co-train the planner and the actor on D_t (L_co)
        if (steps := args.train_steps if iteration == 0 else args.selfplay_train_steps) and data:
            with logger.timer("co_train"):
                sampler.sleep()
                metrics |= co_train(*models["policy"], training_items(data, tokenizer, args), steps, args, dist, rng)
                sampler.sync_weights(policy)

        # 2-3. Self-play (ours): search the problems, replay the proofs into D_{t+1}; not in the last iteration
        if iteration + 1 < args.iterations:
            with logger.timer("selfplay_search"):
                results = search(sampler, verifier, problems, f"{args.seed}/{iteration}/selfplay", args, dist)
            with logger.timer("replay"):
                known = set(data)
                new = list(dict.fromkeys(t for t in replay_proofs(verifier, problems, results, dist) if t not in known))
                state["selfplay_triples"] += [tuple(t) for t in new]
                state["proved"] |= {r.id: r.proof for r in results if r.proved}
            metrics |= search_metrics(results, "selfplay", logger.times["time/selfplay_search"]) | {
                "selfplay/new_triples": float(len(new)), "charts/proved_ever": float(len(state["proved"]))}
            write_searches(run_dir, results, "selfplay", iteration + 1, dist)

        # 4. Evaluate: pass@1 under the budget (after the last iteration by default)
        if args.eval_every and (iteration + 1) % args.eval_every == 0 or iteration + 1 == args.iterations:
            with logger.timer("eval"):
                metrics |= evaluate(sampler, verifier, benchmark, f"{args.seed}/{iteration}/eval", run_dir,
                                    iteration + 1, args, dist)
        logger.log(metrics, step=iteration + 1)
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.iterations:
            save_checkpoint(run_dir, iteration + 1, models, tokenizer, state, dist)
    if start >= args.iterations:  # nothing to train (--iterations 0, or a finished run): evaluate the model as given
        logger.log(evaluate(sampler, verifier, benchmark, f"{args.seed}/eval", run_dir, args.iterations, args, dist),
                   step=args.iterations)
    if dist.is_main and (line := nothing_learned(run_dir)):
        print(line)
    verifier.close()


# ---- infrastructure (identical in every algorithm file) ----
EMBEDDED_MODEL = "embedded:smollm2"  # SmolLM2-135M-Instruct: setup.sh converts the GGUF from PyPI into CACHE_DIR
CACHE_DIR = pathlib.Path(os.environ.get("SELFPLAY_CACHE", pathlib.Path.home() / ".cache" / "selfplay"))
Dist = collections.namedtuple("Dist", "rank world_size local_world_size device is_main objects", defaults=[None])


def setup_distributed(seed: int, timeout_minutes: float = 60, objects_timeout_days: float = 7) -> Dist:
    """torchrun: a process per GPU (NCCL) or CPU share (gloo); objects gather on gloo (after hours of work: days)."""
    names = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE".split()  # as torchrun sets them; else one process
    rank, local_rank, world, local = (int(os.environ.get(k, "WORLD" in k)) for k in names)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else None
    if world > 1 and not tdist.is_initialized():
        tdist.init_process_group("gloo" if device.type == "cpu" else "nccl", timeout=timedelta(minutes=timeout_minutes))
        atexit.register(tdist.destroy_process_group)
    objects = tdist.new_group(backend="gloo", timeout=timedelta(days=objects_timeout_days)) if world > 1 else None
    random.seed(seed + rank), np.random.seed(seed + rank), torch.manual_seed(seed + rank)  # ranks sample differently
    return Dist(rank, world, local, device, rank == 0, objects)


def start_run(args, cpu_defaults: dict, argv: list[str]) -> tuple[Dist, pathlib.Path, Logger]:
    """The processes; without CUDA, cpu_defaults replace the sizes but for flags in argv (printed); a run's logger."""
    dist = setup_distributed(args.seed)
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}  # --x, --x=v, --no-x
    scaled = {} if torch.cuda.is_available() else {k: v for k, v in cpu_defaults.items()
                                                    if {k, f"no_{k}"}.isdisjoint(given) and getattr(args, k) != v}
    if dist.is_main and scaled:
        print("No CUDA: the default sizes are scaled down for a CPU (a flag you pass keeps its value):",
              *(f"  {k}: {getattr(args, k)} -> {v}" for k, v in scaled.items()), sep="\n")
    vars(args).update(scaled)
    run_dir = pathlib.Path(args.output_dir) / (args.run_name or f"{args.exp_name}__{args.seed}")
    return dist, run_dir, Logger(run_dir, vars(args), dist, args.track, args.wandb_project_name, args.wandb_entity)


def all_gather_objects(obj, dist: Dist) -> list:  # every rank's obj, in rank order
    out = [obj] * dist.world_size
    tdist.all_gather_object(out, obj, group=dist.objects) if dist.world_size > 1 else None
    return out


def map_sharded(fn, items: list, dist: Dist) -> list:  # fn on this rank's share, one result an item; all, in order
    parts = all_gather_objects(list(fn(items[dist.rank :: dist.world_size])), dist)
    return [parts[i % dist.world_size][i // dist.world_size] for i in range(len(items))]


def micro_batches(items: list, size: int, dist: Dist, length=None) -> list[tuple[list, bool]]:
    """This rank's share sorted by `length`, as (batch, real); as many on every rank (FSDP2 gathers in forwards)."""
    mine = sorted(items[dist.rank :: dist.world_size], key=length) if length else items[dist.rank :: dist.world_size]
    count = -(-(-(-len(items) // dist.world_size)) // size)  # ceil(ceil(items / ranks) / size)
    return [(b, True) if b else (items[:1], False) for b in (mine[i * size : (i + 1) * size] for i in range(count))]


def resolve_model(name: str) -> str:
    return str(CACHE_DIR / "smollm2-135m-instruct") if name == EMBEDDED_MODEL else name


def load_tokenizer(name: str):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name), padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def load_model(name: str, dist: Dist, train: bool = True, gradient_checkpointing: bool = True) -> torch.nn.Module:
    """Trained: fp32 weights, bf16 compute on GPUs; frozen: bf16 on GPUs. torchrun: only rank 0 reads, all shard."""
    cuda, path = dist.device.type == "cuda", resolve_model(name)
    dtype = torch.bfloat16 if cuda and not train else torch.float32
    with torch.device("meta") if dist.rank else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype) if dist.rank else \
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.train(train).requires_grad_(train)
    model.activation_checkpointing_enable({"use_reentrant": False}) if train and gradient_checkpointing else None
    if dist.world_size > 1:
        full = model.state_dict() if dist.rank == 0 else {}
        blocks = [m for m in model.modules() if type(m).__name__ in set(model._no_split_modules or [])]
        assert blocks, f"no decoder blocks found in {type(model).__name__}: FSDP2 would gather the whole model at once"
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if cuda and train else MixedPrecisionPolicy()
        for module in blocks + [model]:  # the root too: a forward without backward must not leave it unsharded
            fully_shard(module, mp_policy=mp, reshard_after_forward=True)
        model.to_empty(device=dist.device) if dist.rank else model.to(dist.device)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for buffer in model.buffers():  # not in the state dict (rotary frequencies): rank 0's, computed at load
            tdist.broadcast(buffer, src=0)
    return model.to(dist.device)


def full_state_dict_items(policy: torch.nn.Module, dtype=None):  # one full tensor at a time; a collective
    for name, tensor in policy.state_dict().items():
        tensor = tensor.to(dtype) if dtype else tensor
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def chat_prompt(tokenizer, user: str) -> str:  # one user turn, no system prompt
    return tokenizer.apply_chat_template([dict(role="user", content=user)], tokenize=False, add_generation_prompt=True)


def encode_prompt(tok, text: str) -> list[int]:  # BOS added unless the chat template put it there
    return tok(text, add_special_tokens=not (tok.bos_token and text.startswith(tok.bos_token))).input_ids


Sample = collections.namedtuple("Sample", "text prompt_ids token_ids logprobs finish_reason")  # logprobs: as drawn


class Sampler:
    """With the weights last given to sync_weights: vLLM 0.25.1, an engine per rank asleep in training; or HF. A
    Sample's finish_reason is stop, length, or vLLM's abort or error: a failed sample, whose text is empty."""

    def __init__(self, model_name, policy, tokenizer, dist: Dist, backend="auto", max_model_len=4096,
                 gpu_memory_utilization=0.5, sleep=True, batch_size=8, seed=0, dtype="bfloat16"):
        self.tokenizer, self.dist, self.max_model_len, self.batch_size = tokenizer, dist, max_model_len, batch_size
        self.model, self.llm, self.asleep, self.dtype = None, None, False, getattr(torch, dtype)
        self.sleep_enabled = sleep and torch.cuda.is_available()
        if backend == "vllm" or (backend == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm")):
            self.vllm = importlib.import_module("vllm")
            os.environ |= {**dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost",
                                  MASTER_PORT="29500"), **os.environ}  # as torchrun sets them
            if not torch.cuda.is_available():  # CPU: no oneDNN repacking of the weights, so load_weights works in place
                importlib.import_module("vllm._custom_ops")._supports_onednn = False  # not loaded by `import vllm`
            rng = rng_state()
            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free now
            self.llm = self.vllm.LLM(resolve_model(model_name), seed=seed + dist.rank, max_model_len=max_model_len,
                                distributed_executor_backend="external_launcher", dtype=dtype,
                                gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled,
                                logprobs_mode="processed_logprobs")  # log-probs after temperature and top-p
            rng_state(rng)  # LLM() reseeds the global RNGs with the engine seed
            self.sleep()
        elif dist.world_size > 1:  # ranks generate apart: a whole copy each (bf16 on GPUs), synced tensor by tensor
            self.model = AutoModelForCausalLM.from_pretrained(resolve_model(model_name), dtype=torch.float32 if
                                                              dist.device.type == "cpu" else self.dtype)
        self.sync_weights(policy)  # the policy may come from a checkpoint, not from model_name

    def sleep(self):  # free the GPU for training: level 2 drops weights and KV cache; sync_weights brings new ones
        if self.llm and self.sleep_enabled and not self.asleep:
            self.asleep = self.llm.sleep(level=2) or True

    def sync_weights(self, policy):
        if self.llm:  # wake the weights, load the policy's tensors, wake the KV cache, drop prefixes of old weights
            if self.asleep:
                torch.cuda.empty_cache()  # vLLM wakes outside PyTorch's allocator: free what training cached
                self.llm.wake_up(tags=["weights"])
            model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
            [model.load_weights([item]) for item in full_state_dict_items(policy, self.dtype)]  # a tensor at a time
            if self.asleep:
                self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
            self.llm.reset_prefix_cache()
        elif self.dist.world_size > 1:
            own = self.model.to(self.dist.device).state_dict()
            [own[name].copy_(tensor) for name, tensor in full_state_dict_items(policy, self.model.dtype)]
        else:
            self.model = policy

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc="", logprobs=True):
        tok, ids = self.tokenizer, [encode_prompt(self.tokenizer, p)[-self.max_model_len + 1 :] for p in prompts]
        if self.llm and ids:
            assert not self.asleep, "vLLM slept at level 2: call sync_weights(policy) first"
            params = [self.vllm.SamplingParams(n=n, temperature=temperature, top_p=top_p, stop=stop,
                                               max_tokens=max(1, min(max_new_tokens, self.max_model_len - len(p))),
                                               logprobs=0 if logprobs else None) for p in ids]  # 0: the sampled token's
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=self.dist.is_main)
            return [[Sample(c.text if str(c.finish_reason) in ("stop", "length") else "", p, list(c.token_ids),
                            [x[t].logprob for x, t in zip(c.logprobs or [], c.token_ids)], str(c.finish_reason))
                     for c in out.outputs] for p, out in zip(ids, outputs)]
        jobs, results, model, training = [p for p in ids for _ in range(n)], [], self.model, self.model.training
        eos = model.generation_config.eos_token_id  # the model's stop ids too (Gemma-2: <eos> and <end_of_turn>)
        stops = sorted({tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
        for start in tqdm(range(0, len(jobs), self.batch_size), desc=desc, disable=not self.dist.is_main, leave=False):
            batch = tok.pad({"input_ids": jobs[start : start + self.batch_size]}, return_tensors="pt").to(model.device)
            width, held, steps = batch.input_ids.shape[1], [], []  # held: the last step's processed log-probs

            def keep(input_ids, scores):  # a logits processor after HF's temperature and top-p: one step's scores
                steps.append(held.pop().gather(1, input_ids[:, -1:])) if held else None  # the token drawn from them
                return held.append(scores.log_softmax(-1)) or scores
            warp = [TemperatureLogitsWarper(temperature)] if temperature > 0 and temperature != 1 else []  # HF's own
            warp += [TopPLogitsWarper(top_p)] if temperature > 0 and top_p < 1 else []  # warpers, given so keep runs last
            out = model.eval().generate(**batch, do_sample=temperature > 0, temperature=1.0, top_k=0, top_p=1.0,
                                        stop_strings=stop or None, tokenizer=tok, max_new_tokens=max(1, min(
                                        max_new_tokens, self.max_model_len - width)), pad_token_id=tok.pad_token_id,
                                        eos_token_id=stops, logits_processor=warp + [keep] * logprobs)
            logp = torch.cat(steps + [held.pop().gather(1, out[:, -1:])], 1).tolist() if logprobs else [[]] * len(out)
            for row, tokens in enumerate(out[:, width:].tolist()):
                while tokens and tokens[-1] == tok.pad_token_id and tokens[-1] not in stops:  # after a stop string
                    tokens.pop()
                end = next((k + 1 for k, t in enumerate(tokens) if t in stops), len(tokens))  # a stop id is kept
                text = tok.decode(tokens[:end], skip_special_tokens=True)
                cut = min([text.find(s) for s in stop or [] if s in text], default=-1)  # dropped, as vLLM does
                reason = "stop" if cut >= 0 or tokens and tokens[end - 1] in stops else "length"
                results.append(Sample(text[:cut] if cut >= 0 else text, jobs[start + row], tokens[:end],
                                      logp[row][:end], reason))
        model.train(training)
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]


def sample(sampler, prompts: list[str], n: int, key: str | list[str], dist: Dist | None = None, then=None,
           calls: int = 1, **params) -> list:
    """n Samples a prompt by the rule that makes any number of ranks (and a resume) draw the same: transformers takes
    chunks of its batch seeded by crc32(f"{key}/{start}") (key: the call's name and seed; a list: a seed per prompt),
    vLLM a rank's share in `calls` calls. dist: shared over ranks; None: this rank. then(start, rows): what to keep."""
    ranks, keys = dist.world_size if dist else 1, key if isinstance(key, list) else None
    size = -(-len(prompts) // (ranks * calls)) if sampler.llm else 1 if keys else max(1, sampler.batch_size // n)

    def run(chunks: list[tuple[int, list[str]]]) -> list[list]:
        out = []
        for start, part in chunks:
            torch.manual_seed(zlib.crc32((keys[start] if keys else f"{key}/{start}").encode()))
            rows = sampler.generate(part, n=n, **params)
            out.append(then(start, rows) if then else rows)
        return out

    chunks = [(i, prompts[i : i + size]) for i in range(0, len(prompts), max(size, 1))]
    return [row for part in (map_sharded(run, chunks, dist) if dist else run(chunks)) for row in part]


def token_logprobs(policy, samples: list[Sample], temperature=1.0, top_p=1.0, with_entropy=False, entropy_grad=False,
                   chunk=512):
    """(logp, mask, entropy or None), [B, T], at the sampling temperature and top-p (renormalised as the samplers do).
    The head runs in the forward (FSDP2 holds it whole), `chunk` completion positions at a time, again in backward."""
    P, T = max(len(s.prompt_ids) for s in samples), max(max(len(s.token_ids) for s in samples), 1)
    ids = torch.stack([torch.nn.functional.pad(torch.tensor(s.prompt_ids + s.token_ids), (P - len(s.prompt_ids), T -
                       len(s.token_ids)), value=-1) for s in samples]).to(next(policy.parameters()).device)
    mask, ids, head = (ids >= 0).float(), ids.clamp(min=0), policy.get_output_embeddings()
    cap = getattr(policy.config.get_text_config(), "final_logit_softcapping", None)  # Gemma-2's

    def logprob(h, target):  # one chunk in fp32: the target's log-prob (and the entropy)
        z = head(h).float()
        z = (cap * torch.tanh(z / cap) if cap else z).div_(temperature) if cap or temperature != 1 else z
        if top_p < 1:  # drop what HF's and vLLM's top-p drop (ascending cumulative sum <= 1 - p), never the target
            sorted_z, order = z.sort(-1)
            tail = sorted_z.softmax(-1).cumsum(-1) <= 1 - top_p
            z = z.masked_fill(tail.scatter(-1, order, tail).scatter(-1, target[:, None], False), -1e30)  # vocab order
        logp = -torch.nn.functional.cross_entropy(z, target, reduction="none")  # its backward is one fused kernel
        return (logp, z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)) if with_entropy else (logp, logp)

    def head_in_forward(module, args, kwargs, out):  # before FSDP2's post-forward hook reshards the head
        h = out.hidden_states[-1][:, P - 1 : P + T - 1].flatten(0, 1)  # the last one is after the final norm
        parts = [torch.utils.checkpoint.checkpoint(logprob, x, t, use_reentrant=False)
                 for x, t in zip(h.split(chunk), ids[:, P:].flatten().split(chunk))]
        out.logits, out.hidden_states = torch.stack([torch.cat(x).view(len(samples), T) for x in zip(*parts)], -1), None
        return out

    hook = policy.register_forward_hook(head_in_forward, with_kwargs=True, prepend=True)
    try:  # the model's own head gets no position
        out = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0).long(),
                     use_cache=False, output_hidden_states=True, logits_to_keep=ids[0, :0]).logits
    finally:
        hook.remove()
    logp, ent, mask = out[..., 0], out[..., 1], mask[:, P:]
    return logp * mask, mask, ((ent if entropy_grad else ent.detach()) * mask if with_entropy else None)


def train_step(model, optimizer, batch: list, loss_fn, micro_batch_size: int, max_grad_norm: float, dist: Dist,
               length=None, lr: float | None = None) -> dict[str, float]:
    """One optimizer step, each rank on its share. loss_fn(micro) -> (loss, stats): the loss over the whole batch's
    denominator; FSDP2 averages over ranks, so backward scales it by the world size. Returns summed stats, grad_norm."""
    for group in optimizer.param_groups if lr is not None else []:
        group["lr"] = lr
    sums = collections.Counter()
    for micro, real in micro_batches(batch, micro_batch_size, dist, length):
        loss, stats = loss_fn(micro)
        (loss * (dist.world_size if real else 0.0)).backward()
        sums.update({"loss": loss.item(), **stats} if real else {})  # update adds (negative sums too)
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts, norm = all_gather_objects(dict(sums), dist), norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return {**{k: sum(p.get(k, 0.0) for p in parts) for k in sorted(set().union(*parts))}, "grad_norm": float(norm)}


def lr_at(step: int, total: int, peak: float, warmup: int = 0, schedule: str = "constant") -> float:
    """Step `step`'s lr in transformers' schedules (HF Trainer, TRL, Lightning): warm-up from 0, then constant/decay."""
    progress = (step - warmup) / max(1, total - warmup)
    decay = {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[schedule]
    return peak * (step / warmup if step < warmup else max(0.0, decay))


def pass_at_k(n: int, c: int, k: int) -> float:  # unbiased, c of n correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)
    return 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def rng_state(state: tuple | None = None) -> tuple:  # Python's, NumPy's, torch's, CUDA's; set first when given
    if state is not None:
        random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
        torch.cuda.set_rng_state_all(state[3]) if state[3] else None
    cuda = torch.cuda.is_available() and torch.cuda.get_rng_state_all()
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def save_checkpoint(run_dir, iteration: int, models: dict, tokenizer, state: dict, dist: Dist, keep: int = 2):
    """iter_XXXXXX/ after XXXXXX iterations: DCP shards (an optimizer if given), HF copies (bf16 on GPUs), state.pt."""
    root, export = pathlib.Path(run_dir) / "checkpoints", torch.bfloat16 if dist.device.type == "cuda" else None
    final, tmp = root / f"iter_{iteration:06d}", root / f".tmp_iter_{iteration:06d}"
    tmp.mkdir(parents=True, exist_ok=True)  # what a crashed save left there is overwritten
    rngs = all_gather_objects(rng_state(), dist)
    for name, (policy, optimizer) in models.items():
        state_dicts = dict(zip(("model", "optim"), get_state_dict(policy, optimizer or ())))  # None: rebuilt each time
        dcp.save(state_dicts, checkpoint_id=tmp / f"{name}.dcp")
        weights = {k: v.cpu() for k, v in full_state_dict_items(policy, export) if dist.is_main}
        if dist.is_main:
            policy.config.dtype = export or policy.config.dtype
            policy.save_pretrained(tmp / name, state_dict=weights)
            tokenizer.save_pretrained(tmp / name)
    if dist.is_main:
        torch.save({"iteration": iteration, "state": state, "rng": rngs}, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # so the newest iter_* directory is always whole
        [shutil.rmtree(old) for old in sorted(root.glob("iter_*"))[:-keep]]
    all_gather_objects(None, dist)


def load_checkpoint(run_dir, models: dict, dist: Dist):
    """Restore the newest checkpoint (rank 0's pick) into `models`, strictly, and the RNGs: (iterations done, state)."""
    path = all_gather_objects(max((pathlib.Path(run_dir) / "checkpoints").glob("iter_*"), default=None), dist)[0]
    if path is None:
        return None
    for name, (policy, optimizer) in models.items():
        loaded = dict(zip(("model", "optim"), get_state_dict(policy, optimizer or ())))
        dcp.load(loaded, checkpoint_id=path / f"{name}.dcp")
        set_state_dict(policy, optimizer or (), model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    saved = torch.load(path / "state.pt", weights_only=False)
    rng_state(saved["rng"][dist.rank % len(saved["rng"])])  # exact when resumed with the same world size
    print(f"resuming {run_dir} after iteration {saved['iteration']}") if dist.is_main else None
    return saved["iteration"], saved["state"]


class Logger:
    """CleanRL-style metrics to metrics.jsonl, the console and (--track) wandb on rank 0; `with logger.timer(phase)`."""

    def __init__(self, run_dir, config: dict, dist: Dist, track=False, project="selfplay", entity=None):
        self.run_dir, self.main, self.times = pathlib.Path(run_dir), dist.is_main, collections.Counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.main:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.wandb = track and self.main and wandb.init(project=project, entity=entity, config=config,
                                                        name=self.run_dir.name, dir=run_dir)  # it finishes at exit

    @contextlib.contextmanager
    def timer(self, phase: str):
        start = time.perf_counter()
        yield
        self.times[f"time/{phase}"] += time.perf_counter() - start

    def log(self, metrics: dict, step: int) -> None:
        metrics, self.times = {**metrics, **self.times}, collections.Counter()
        if self.main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
            tqdm.write(f"[{step}] " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)))
            self.wandb and self.wandb.log(metrics, step=step)


# ---- end of infrastructure ----


if __name__ == "__main__":
    main(tyro.cli(Args))
