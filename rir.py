"""RiR: Reasoning in Reasoning, a goal planner and a goal-driven actor for hierarchical proof
search in Lean 4.

Paper: Ziyu Ye et al., "Reasoning in Reasoning" (its text was not readable here: the method, its
loss, Algorithm 1, Tables 1-2 and Figures 2-3 as Z. Ye's talk "Learning to Reason and Align via
Self-Play", Dec 2024, presents them). Official code: github.com/ZIYU-DEEP/Reasoning-in-Reasoning
(read at c5976f2), built on ReProver (github.com/lean-dojo/ReProver, read at fd6d99c), the
tactic generator of LeanDojo (a toolkit that traces Lean proofs and drives Lean interactively),
a ByT5 model, i.e. a byte-level T5 encoder-decoder; this file copies none of it.

Method. A flat prover such as ReProver (the flat baseline here, --no-planner) samples a tactic
y ~ pi(. | s) for the proof state s (the goals Lean shows). RiR splits the step in two policies,
here one LM prompted for each role:
  - the PLANNER pi_h(s* | s) proposes s*, the goal of the step: the proof state after the tactic
    ("no goals" when the tactic closes the proof);
  - the ACTOR pi_l(y | s, s*) writes a tactic that reaches s*.
Both use the official text formats ([CURRENT GOAL] / [TARGET GOAL] / [PROOFSTEP]; tactics name
premises as <a>full name</a>, marks removed from what is sampled). They learn from triples
(s, y*, s*): a traced proof step, the state, the human tactic and the state it led to. D_t is the
set of triples of iteration t; D_0 is LeanDojo Benchmark 4's traced tactics.

Algorithm (one iteration of main, whose banners carry these numbers):
  1. Co-train planner and actor on D_t (co_train; offline supervised fine-tuning): L_co, the
     planner's plus the actor's negative log-likelihood of each triple (co_training_loss).
  2. Self-play search (ours; not in the last iteration): one search of each self-play theorem
     (search, best_first_search) over Lean's tactic mode, best-first (BFS, official) or Monte
     Carlo tree search (MCTS, ours). An expansion takes an open node (BFS: the one of highest
     priority; MCTS: the leaf that select reaches by PUCT, AlphaZero's predictor + upper
     confidence bound, puct_score), the planner proposes targets s*, and for one target at a
     time the actor samples tactics that Lean runs (best_first_search, lockstep over
     --search-batch theorems), until the first proof.
  3. Self-play triples (ours, expert iteration: training on the model's own verified proofs):
     each proof found within the budget gives its path's steps (self_play_triples), weighted by
     self_play_weight; D_{t+1} = D_t + the new ones.
  4. Evaluate (evaluate; after the last iteration by default): one search of each benchmark
     theorem under the budget; pass@1 is the share of the theorems proved within it.
Metrics (metrics.jsonl, step = iterations done): eval/search/pass@1 (Tables 1-2); Figure 2's
split of the proved searches' time, eval/search/{planner,actor,env}_time_proved (each role's
sampling, Lean's tactic runs); Figure 3's eval/search/search_time_proved and
<run>/search_time_cdf.csv; selfplay/*, losses/*, time/*; every search to <run>/searches.jsonl.
Records: lean_verify's Problem(id, header, statement), a theorem; TacticState, a proof state
(goals, status, the tactics from the root; key: its goals); Triple(state, tactic, target), a
proof step (the state before the tactic, the tactic, the state after it). The infrastructure
block at the end defines Sample(text, prompt_ids, token_ids, logprobs, finish_reason), one
completion as the sampler drew it, and Dist(rank, world_size, local_world_size, device,
is_main, objects), where this process stands among torchrun's.
Here a Triple is the method's triple (s, y*, s*).

Run. Without CUDA, Args' defaults are CPU_DEFAULTS (a loop sized for a laptop; the run prints
them), so `python <this file>` and `main(Args())` run it alike and a value given keeps it;
`torchrun --nproc_per_node 8 <this file>` runs the full sizes; `--iterations 0` evaluates
the given model. Both need Lean: `bash setup.sh --lean`, or for a CPU smoke run the stand-in REPL,
LEAN_REPL_CMD="python tests/fake_lean_repl.py", which follows the tactic table of
data/lean_tactics.jsonl. Experiment map: README.md.
Data: LeanDojo Benchmark 4's random split (the authors' Hugging Face upload, or train.json of
zenodo.org/records/10929138 as utils/download_data.py fetches it); the theorems are miniF2F's
(valid for self-play, test for evaluation).

Sources (the official files the code's "official" refers to): prover_rir/proof_search.py (the
search: _step, _run_tactic, BestFirstSearchProver.search), generator/datamodule.py (_load_data,
collate) and common.py (format_input, format_state, the optimizer's schedule), generator/main.py
(fit), generator/confs/goal_driven_tactic_8gpu.yaml (co-training settings).

Deliberate deviations:
  1. Lean through lean_verify's REPL tactic mode, not LeanDojo: states merge by goals, a found
     proof is checked whole.
  2. One decoder LM for both roles, Qwen2.5-0.5B at lr 2e-5 (official: two ByT5-small models, at
     lr 8e-4 and 7e-4).
  3. Sampling at temperature 1, deduplicated, ranked by summed log-probs, not beam search
     (length_penalty 0).
  4. The flat baseline's prompt marks where the tactic starts (official: the bare state, an
     encoder's input).
  5. Equal budgets for RiR and the flat baseline, read before each sampling call and tactic
     (official: each expansion).
  6. LeanDojo Benchmark 4's test theorems need LeanDojo's Dojo (its interactive Lean
     environment): it is the co-training data, miniF2F the theorems.
  7. MCTS is ours (no code was released): PUCT, prior from the planner x actor probability; no
     value net, no rollouts.
  8. Self-play iterations are ours (expert iteration), continuing the weights and optimizer.
  9. The default loss is each role's token mean over the batch (official: per T5);
     --loss-reduction sequence: L_co.
 10. --joint-format: the actor sees s*; the official joint search samples y from s alone (s* only
     in the priority).
 11. Searches run in lockstep, --search-batch theorems per rank (default one per REPL): one
     sampling call for every live theorem's node (vLLM's throughput needs batched calls); each
     theorem is charged the model calls it waits for, its own tactics and kernel checks
     (--search-batch 1: its wall clock). nodes counts distinct open states (official: error and
     finished nodes too).
 12. A found proof's steps are the search's own states (no replay); the REPLs restart after each
     lockstep batch (free_states), as coprover.py's.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import csv
import dataclasses
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
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import tyro
import wandb
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from lean_verify import (
    LeanNotInstalled,
    LeanVerifier,
    Problem,
    TacticState,
    Triple,
    load_problems,
    load_triples,
)


@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed> unless
    --run-name)"""
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
    """planner and actor, one LM: a Hugging Face id, a local path, or embedded:smollm2 (the CPU
    default)"""
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
    """traced tactics: LeanDojo Benchmark 4 (random split) on the Hugging Face hub, its
    train.json, or a .jsonl"""
    num_triples: int | None = None
    """use only the first N triples"""
    selfplay_dataset: str = "data/minif2f.jsonl"
    """the problems searched in self-play: a Hugging Face dataset, a .jsonl or a .json
    (lean_verify.load_problems)"""
    selfplay_split: str | None = "valid"
    """which split of --selfplay-dataset (None: all rows)"""
    num_problems: int | None = None
    """use only the first N problems of --selfplay-dataset (default all)"""

    # algorithm
    # 2 (ours): one self-play iteration, then co-training again and the evaluation
    iterations: int = 2
    """iterations to run (the paper's word: rounds); 1: the official offline run; 0: evaluate the
    given model"""
    train_steps: int = 40000
    """co-training steps of the first iteration (the released actor checkpoint: step 40000)"""
    selfplay_train_steps: int = 4000
    """co-training steps of each later iteration (ours)"""

    # search
    search: Literal["bfs", "mcts"] = "bfs"
    """best-first search (official) or MCTS (the talk's Table 2; ours): pick_node's rule, from
    NODE_CHOICES"""
    num_sampled_goals: int = 5
    """target states the planner proposes per expansion (official num_sampled_goals)"""
    num_sampled_tactics: int = 64
    """tactics the actor proposes per target state, or per expansion without planner (official
    num_sampled_tactics)"""
    # official RiR's (ReProver's N allows N + 1); an RiR expansion samples more
    max_expansions: int | None = None
    """expansions per theorem (None: only the clock limits a search)"""
    # official --timeout (its logged comparison gave RiR 3200 s, ReProver 600 s)
    search_timeout: float = 600.0
    """seconds per theorem (the search's budget, read before each tactic)"""
    search_temperature: float = 1.0
    """the search's sampling temperature, of planner and actor"""
    top_p: float = 1.0
    """nucleus sampling"""
    goal_max_new_tokens: int = 768
    """longest target state the planner writes (official max_oup_seq_len 2300 bytes)"""
    tactic_max_new_tokens: int = 128  # official max_oup_seq_len 512 bytes
    """longest tactic"""
    lean_timeout: float = 60.0
    """Lean's wall-clock limit per tactic, in seconds (a timeout is a failed edge)"""
    lean_workers: int | None = None
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of
    the machine)"""
    search_batch: int | None = None
    """theorems searched in lockstep on each rank (`search`; default: the rank's REPL pool size;
    1: one theorem at a time, charged its wall clock)"""
    c_puct: float = 1.0
    """MCTS: exploration constant of PUCT (puct_score)"""
    leaf_value: float = 0.5
    """MCTS: value an open leaf backs up (simulation_value; no value network)"""

    # co-training (L_co; official)
    batch_size: int = 32  # official: 64 planner, 32 actor sequences
    """triples per optimizer step (each gives a planner and an actor sequence)"""
    loss_reduction: Literal["token_mean", "sequence"] = "token_mean"
    """token_mean: each role's loss is its token mean (official T5 loss); sequence: L_co as
    written (loss_reduction_rule, from LOSS_REDUCTIONS)"""
    max_state_tokens: int = 768
    """states (s and s*) are cut to their first this many tokens (official: 2300 bytes)"""
    learning_rate: float = 2e-5  # AdamW, no weight decay
    """peak learning rate"""
    # official, over each co-training
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """learning-rate schedule after the warm-up (lr_at)"""
    # of the first iteration; each later one warms up for the same share of its steps
    warmup_steps: int = 4000
    """linear warm-up steps from 0"""
    micro_batch_size: int = 8
    """triples per forward/backward on each rank"""
    max_grad_norm: float = 1.0  # official gradient_clip_val
    """gradient clipping"""

    # ablations
    planner: bool = True
    """the goal planner (--no-planner: the flat ReProver baseline, the same LM as a plain tactic
    generator)"""
    joint_format: bool = False
    """one sequence per triple, [CURRENT GOAL] s -> [TARGET GOAL] s* [PROOFSTEP] y (official
    gen_type joint)"""

    # evaluation
    eval_dataset: str = "data/minif2f.jsonl"
    """benchmark (lean_verify.load_problems: miniF2F's name, split, header, formal_statement)"""
    eval_split: str | None = "test"
    """which split of the benchmark (None: all rows)"""
    eval_limit: int | None = None
    """use only the first N benchmark problems"""
    eval_every: int = 0  # the talk evaluates the trained model
    """evaluate every this many iterations and after the last (0: only after the last)"""


# Without CUDA the full sizes would take weeks; these run an iteration on 2 cores in minutes
# (SmolLM2-135M samples ~60 tokens/s in a batch of 8; an expansion with 2 targets x 4 tactics
# takes ~10 s, a co-training step ~10 s). The benchmark stays miniF2F-test (its first 5): the
# built-in theorems are the training data (D_0 holds their proofs).
CPU_DEFAULTS = dict(
    model="embedded:smollm2",
    dataset="data/rir_triples.jsonl",
    selfplay_split="builtin",
    selfplay_dataset="data/rir_theorems.jsonl",
    eval_limit=5,
    num_sampled_goals=2,
    num_sampled_tactics=8,
    max_expansions=4,
    search_timeout=300.0,
    lean_timeout=10.0,
    train_steps=8,
    selfplay_train_steps=2,
    warmup_steps=0,
    learning_rate=3e-4,
    batch_size=8,
    micro_batch_size=4,
    max_state_tokens=128,
    goal_max_new_tokens=64,
    tactic_max_new_tokens=24,
    max_model_len=1024,
)


# ---- prompts ----
# The official text formats (the official format_input and collate), raw completion
# prompts. The planner continues PLANNER_PROMPT with s*; the actor continues ACTOR_PROMPT with y;
# the joint format trains one sequence JOINT_PROMPT -> JOINT_TARGET, whose prefixes are the two
# prompts at search time.
PLANNER_PROMPT = "[CURRENT GOAL]\n{state}\n[TARGET GOAL]\n"
ACTOR_PROMPT = "[CURRENT GOAL]\n{state}\n[TARGET GOAL]\n{target}\n[PROOFSTEP]\n"
JOINT_PROMPT = "[CURRENT GOAL]\n{state}\n"
JOINT_TARGET = "[TARGET GOAL]\n{target}\n[PROOFSTEP]\n{tactic}\n"
# deviation 4: a decoder needs a marker where the tactic starts
FLAT_PROMPT = "[CURRENT GOAL]\n{state}\n[PROOFSTEP]\n"
GOAL_STOP = "\n[PROOFSTEP]"  # where a target state ends in the joint format
# LeanDojo's state after the tactic that closes the proof: the planner's target for it
NO_GOALS = "no goals"


# ---- data ----
# A theorem is lean_verify's Problem(id, header, statement), as load_problems reads them from a
# dataset (miniF2F's fields). A traced tactic (s, y*, s*) is lean_verify's Triple(state, tactic,
# target), as load_triples reads them from LeanDojo's rows (the official
# _load_data and format_state).
def truncate_right(tokenizer, text: str, max_tokens: int) -> str:
    """The text cut to its first max_tokens tokens (the official tokenizer truncates inputs at
    their end), at the start of the first token it drops: a prefix of the text, and a character
    split over two tokens goes whole."""
    tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(tokens.input_ids) <= max_tokens:
        return text
    first_dropped = tokens.offset_mapping[max_tokens][0]  # (start, end) in characters
    return text[:first_dropped]


# ---- search rules ----
# RiR has no reward model: the policy's own log-probabilities rank the search. Each rule of the
# search is one function here.
def priority(node: Node, args: Args) -> float:
    """A new node's BFS priority (official _run_tactic), its path's cumulative log-probability:

        priority(node) = priority(parent) + log p(y | s, s*) + log p(s* | s),

    y and s* the tactic and the planner's target of node.edge. The flat baseline has
    log p(s* | s) = 0 (ReProver's priority). A term reads the Node (its path: node_path; its
    Edge) and a flag."""
    edge = node.edge
    return node.parent.priority + edge.logprob + edge.target_logprob


def edge_priors(log_masses: list[float]) -> list[float]:
    """MCTS priors P of a node's children (ours): the softmax of the log probability mass of the
    edges that reached each child, log p(s* | s) + log p(y | s, s*), summed over the edges to the
    same child."""
    top = max(log_masses, default=0.0)  # subtracted: no underflow for long sequences
    weights = [math.exp(mass - top) for mass in log_masses]
    total = sum(weights)
    return [weight / total for weight in weights]


def puct_score(
    value: float,
    visits: int,
    prior: float,
    parent_value: float,
    parent_visits: int,
    c_puct: float,
) -> float:
    """MCTS selection score of a child (PUCT, ours):

        Q + c_puct P sqrt(N_parent) / (1 + N)

    N its visits, P its prior (edge_priors), Q = W / N its mean backed-up value W (visits 0: its
    parent's mean value W_parent / N_parent)."""
    if visits:
        q = value / visits
    else:
        q = parent_value / max(parent_visits, 1)
    exploration = c_puct * prior * math.sqrt(parent_visits) / (1 + visits)
    return q + exploration


def simulation_value(leaf: Node, leaf_value: float) -> float:
    """MCTS value of a simulation (ours; no value network, no rollouts): 0 when the leaf it
    expanded is a dead end, else --leaf-value."""
    if leaf.dead:
        return 0.0
    return leaf_value


def search_time_cdf(times: list[float], total: int) -> list[tuple[float, int, float]]:
    """Figure 3: each proved theorem's search time t (sorted), the theorems proved within t, and
    their share of `total`."""
    rows = []
    for proved, seconds in enumerate(sorted(times), 1):
        rows.append((seconds, proved, proved / total))
    return rows


# ---- losses ----
def co_training_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    roles: torch.Tensor,
    denominators: list[float],
    weights: torch.Tensor | None = None,
    args: Args | None = None,
) -> torch.Tensor:
    """L_co, the co-training loss of planner and actor over a batch of N triples (s, y*, s*):

        L_co = -(1/N) sum_triples w [log p(s* | s) + log p(y* | s, s*)]

    w the triple's weight (each sequence's Example.weight; None: all 1, L_co as the talk writes
    it; self_play_weight gives it),
    here with a denominator per term: denominators[0] divides the planner's summed log-probs
    (its s* sequences, or the joint sequences of --joint-format), denominators[1] the actor's
    (its y* sequences); loss_reduction_rule chooses them. A term with denominator 0 (the flat
    baseline's planner) drops out. The losses of a batch's micro-batches add up to its loss.
    logp, mask: [B, T], the output tokens' log-probs of B sequences and where tokens are;
    roles: [B], each sequence's term (0: planner or joint, 1: actor); weights: [B]. args:
    unread by L_co. co_training_batch_loss calls it; a loss term goes there, beside it."""
    per_sequence = (logp * mask).sum(1)  # [B]
    if weights is not None:
        per_sequence = per_sequence * weights
    total = 0
    for role, denominator in enumerate(denominators):
        if denominator > 0:
            role_sum = per_sequence[roles == role].sum()
            total = total + role_sum / denominator
    return -total


def co_training_batch_loss(
    policy, examples: list[Example], denominators: list[float], args: Args
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro-batch's part of its batch's L_co (co_training_loss), on its training items'
    Examples (each its role, weight and sample), with the batch's denominators; and the stats
    co_train logs: "goal" and "tactic", the roles' summed unweighted NLL (co_train makes them
    per-token means). co_train calls it. A loss term goes here, its coefficient read from
    args, and any stat it returns is logged as losses/<name> (a micro-batch's part of the
    batch's value: train_step sums them); token_logprobs gives the entropy with
    with_entropy=True, detached unless entropy_grad=True."""
    logp, mask, _ = token_logprobs(policy, [example.sample for example in examples])  # [B, T]
    roles = torch.tensor([example.role for example in examples], device=logp.device)  # [B]
    weights = logp.new_tensor([example.weight for example in examples])  # [B]
    loss = co_training_loss(logp, mask, roles, denominators, weights=weights, args=args)
    nll = -(logp.detach() * mask).sum(1)  # [B]
    stats = {
        "goal": nll[roles == 0].sum().item(),
        "tactic": nll[roles == 1].sum().item(),
    }
    return loss, stats


def token_mean_denominators(role_tokens: list[int], triples: int) -> list:
    """--loss-reduction token_mean (the default, the official T5 loss; deviation 9): each term's
    output tokens in the whole batch, role_tokens, so that each role's loss is its token mean."""
    return role_tokens


def sequence_denominators(role_tokens: list[int], triples: int) -> list:
    """--loss-reduction sequence: the batch's N triples for both terms, L_co as written."""
    return [triples, triples]


# --loss-reduction's choices: a new one is its function above and an entry here
LOSS_REDUCTIONS = {"token_mean": token_mean_denominators, "sequence": sequence_denominators}


def loss_reduction_rule(args: Args):
    """--loss-reduction's rule, `(role_tokens, triples) -> co_training_loss's denominators`
    (planner's, actor's), from LOSS_REDUCTIONS: co_train reads it, check_choices calls it at
    start."""
    if args.loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"--loss-reduction {args.loss_reduction}: add its entry to LOSS_REDUCTIONS (a "
            "function of the batch's role_tokens and triples giving the two denominators, as "
            "token_mean_denominators)"
        )
    return LOSS_REDUCTIONS[args.loss_reduction]


def loss_metrics(history: list[dict], prefix: str = "") -> dict[str, float]:
    """An update's losses/ metrics: each stat of its optimizer steps (train_step's, summed over
    the micro-batches) averaged over the steps, as losses/<prefix><name>."""
    metrics = {}
    for name in history[0]:
        metrics[f"losses/{prefix}{name}"] = float(np.mean([h[name] for h in history]))
    return metrics


# ---- phases ----
# the roles a search charges its seconds to (SearchResult.role_seconds)
ROLES = ("planner", "actor", "env")


# The search's records, the same in coprover.py and rir.py. A proof step is lean_verify's
# Triple(state, tactic, target): the state before the tactic, the tactic, the state after it.
class Edge(NamedTuple):
    """A proposed step from the node an expansion expands."""

    tactic: str | None  # None: a sample that is no tactic (a failed edge, never run)
    logprob: float  # log p(y | ...): the tactic's summed token log-probs
    tokens: int  # the tactic's tokens (0: no tactic)
    target: str | None = None  # s*, the planner's target state (None: flat, no planner)
    target_logprob: float = 0.0  # log p(s* | s) (0: flat)


@dataclass(eq=False)
class Node:
    """A proof state of the search (states with the same goals are one node)."""

    state: TacticState  # lean_verify's: status, goals, pretty (text), key, tactics, time
    parent: Node | None = None  # the node whose expansion found it (None: the root)
    edge: Edge | None = None  # the edge that reached it from parent
    children: list = field(default_factory=list)  # the new nodes its expansion found
    priority: float = 0.0  # BFS: its rank in the queue (`priority`)
    prior: float = 1.0  # MCTS: P, from edge_priors
    visits: int = 0  # MCTS: N, simulations through this node
    value_sum: float = 0.0  # MCTS: W, the sum of their backed-up values
    expanded: bool = False
    dead: bool = False  # expanded and no live child: nothing left to search below it


@dataclass(eq=False)
class Tree:
    """One theorem's search, as best_first_search runs it."""

    problem: Problem
    root: Node
    nodes: dict = field(default_factory=dict)  # state key -> Node: the open states reached
    queue: list = field(default_factory=list)  # BFS: a heap of (-priority, order pushed, Node)
    pushed: int = 0  # nodes pushed so far (equal priorities: the first pushed comes first)
    expansions: int = 0
    expanding: Node | None = None  # the node this expansion expands
    pending: list = field(default_factory=list)  # this expansion's Edges, in the order run
    tried: dict = field(default_factory=dict)  # this expansion's tactic -> the state it reached
    reached: list = field(default_factory=list)  # this expansion's (Edge, Node) to open states
    proof: Node | None = None  # the solved state the kernel accepted, with its parent
    counts: collections.Counter = field(default_factory=collections.Counter)  # edges, ...
    seconds: float = 0.0  # the time charged to the theorem (its budget)
    role_seconds: collections.Counter = field(default_factory=collections.Counter)


class SearchResult(NamedTuple):
    """A theorem's search as it ended, made by search_result: the fields every search of the
    family has (coprover.py, rir.py), then the method's own. Read after the searches: by
    search_metrics (selfplay/* in step 2, eval/search/* in step 4), record_searches (a line of
    searches.jsonl each, every field), evaluate's search_time_cdf, and, for its path, by step
    3's self_play_triples (kept in the run state with each triple it gave, stored_triple)."""

    id: str  # the theorem's Problem.id
    proof: list[str] | None  # the tactics of the proof found (within the budget or not), else None
    proved: bool  # a proof found within the budget
    seconds: float  # the time charged to the theorem (within_budget)
    expansions: int
    nodes: int  # distinct open proof states reached, the root included
    edges: int  # tactics tried, samples that were no tactic included
    failed_edges: int  # of which failed: Lean rejected it, the kernel its proof, or no tactic
    merged: int  # tactics that reached a known state
    role_seconds: dict  # the seconds charged to each role: planner, actor, env (Lean's tactics)
    path: list  # the proof's steps, root first, as Triples ("no goals" after the last); []
    path_edges: list  # the Edge of each step of path (log-probs; rir: the planner's target)


class Example(NamedTuple):
    """A training sequence: its Sample, its weight, and the record it came from."""

    sample: Sample  # the prompt and target tokens
    weight: float  # the number the loss multiplies: a reward, an advantage, a label
    source: object = None  # the record it was made from (a SearchResult, a Triple, ...)
    role: int = 0  # its term of L_co: 0 the planner's (or the joint sequence), 1 the actor's


def example_length(example: Example) -> int:
    """An Example's prompt and target tokens (micro_batches' sort key)."""
    return len(example.sample.prompt_ids) + len(example.sample.token_ids)


def within_budget(tree: Tree, args: Args) -> bool:
    """Not proved yet, and time left: the theorem's charged seconds under search_timeout. Read
    before each sampling call and each tactic, so a search overshoots by its last call or tactic
    (a proof found past the budget is a proof, but not `proved`)."""
    return tree.proof is None and tree.seconds < args.search_timeout


def can_expand(tree: Tree, args: Args) -> bool:
    """Another expansion: within_budget, under max_expansions (None: no cap), and a node to
    expand (the node choice's `has_node`: BFS a state in the queue, MCTS a live root)."""
    if not within_budget(tree, args):
        return False
    if args.max_expansions is not None and tree.expansions >= args.max_expansions:
        return False
    return node_choice(args).has_node(tree)


def queue_has_node(tree: Tree) -> bool:
    """BFS: an open state waits in the queue."""
    return bool(tree.queue)


def queue_pick(tree: Tree, args: Args) -> Node:
    """BFS (official): the queue's highest priority (the first pushed of equal ones)."""
    _, _, node = heapq.heappop(tree.queue)
    return node


def queue_children(tree: Tree, leaf: Node, args: Args) -> None:
    """BFS: the expansion's new children join the queue."""
    for child in leaf.children:
        push(tree, child)


def mcts_has_node(tree: Tree) -> bool:
    """MCTS: the root is open and not dead."""
    return tree.root.state.status == "open" and not tree.root.dead


def mcts_pick(tree: Tree, args: Args) -> Node:
    """MCTS (ours): the leaf that `select` reaches from the root by puct_score."""
    return select(tree.root, args.c_puct)[-1]


def mcts_backup(tree: Tree, leaf: Node, args: Args) -> None:
    """MCTS: the simulation's value (simulation_value) backed up along the leaf's path."""
    backup(node_path(leaf), simulation_value(leaf, args.leaf_value))


class NodeChoice(NamedTuple):
    """How a --search value picks the node to expand and uses what its expansion found."""

    has_node: object  # (tree) -> bool: a node left to expand
    pick: object  # (tree, args) -> Node: pick_node's rule
    update: object  # (tree, expanded node, args) -> None: after the expansion


# --search's choices: a new one is its three functions and an entry here
NODE_CHOICES = {
    "bfs": NodeChoice(queue_has_node, queue_pick, queue_children),
    "mcts": NodeChoice(mcts_has_node, mcts_pick, mcts_backup),
}


def node_choice(args: Args) -> NodeChoice:
    """--search's NodeChoice, from NODE_CHOICES: can_expand, pick_node and end_expansion read
    it, check_choices calls it at start."""
    if args.search not in NODE_CHOICES:
        raise ValueError(
            f"--search {args.search}: add its entry to NODE_CHOICES (a NodeChoice: how it knows "
            "a node is left, picks the node to expand, and uses its expansion)"
        )
    return NODE_CHOICES[args.search]


def start_trees(verifier, problems: list[Problem]) -> list[Tree]:
    """A Tree for each theorem, its root the start of its proof (one start_proofs call); an open
    root waits in its queue, a root Lean could not start leaves nothing to expand."""
    roots = verifier.start_proofs([(p.header, p.statement) for p in problems])
    trees = []
    for problem, state in zip(problems, roots):
        root = Node(state)
        seconds = collections.Counter(dict.fromkeys(ROLES, 0.0))
        tree = Tree(problem, root, role_seconds=seconds)
        if state.status == "open":
            tree.nodes[state.key] = root
            push(tree, root)
        trees.append(tree)
    return trees


def push(tree: Tree, node: Node) -> None:
    """A node joins its tree's queue by its priority."""
    tree.pushed += 1
    heapq.heappush(tree.queue, (-node.priority, tree.pushed, node))


def pick_node(tree: Tree, args: Args) -> Node:
    """The node to expand, by the --search choice (NODE_CHOICES): BFS the queue's best, MCTS the
    leaf selection reaches."""
    return node_choice(args).pick(tree, args)


def start_expansion(tree: Tree, args: Args) -> None:
    """An expansion begins: pick_node's node, no edges yet."""
    tree.expanding = pick_node(tree, args)
    tree.expansions += 1
    tree.pending, tree.tried, tree.reached = [], {}, []


def best_first_search(
    sampler, verifier, problems: list[Problem], key: str, args: Args, clock=time.monotonic
) -> list[SearchResult]:
    """Steps 2 and 4 on `problems` in lockstep (official BestFirstSearchProver.search, batched;
    MCTS ours, a simulation an expansion): each round, every theorem that can_expand picks its
    node (pick_node); the planner proposes targets for all of them in one call
    (propose_targets); then for target i in order, the actor samples tactics for every theorem
    that has an i-th target and is still within_budget (one call, propose_tactics) and Lean runs
    them (try_tactics): one target at a time, stopping at the first proof (official _step).
    Flat (--no-planner): one actor call, no target. Then end_expansion. Each theorem is charged
    what it waits for (within_budget). Returns a SearchResult a theorem, in order
    (search_result); step 3 reads their paths."""
    trees = start_trees(verifier, problems)
    while True:
        live = [tree for tree in trees if can_expand(tree, args)]
        if not live:
            break
        for tree in live:
            start_expansion(tree, args)
        plans = propose_targets(sampler, live, key=key, args=args, clock=clock)
        for i in itertools.count():
            acting = []
            targets = []
            for tree, (plan_edges, _) in zip(live, plans):
                if i < len(plan_edges) and within_budget(tree, args):
                    acting.append(tree)
                    targets.append(plan_edges[i])
            if not acting:
                break
            propose_tactics(sampler, acting, targets, key=f"{key}/{i}", args=args, clock=clock)
            try_tactics(verifier, acting, args, clock=clock)
        # the planner's malformed samples: failed edges, after every target's
        for tree, (_, failed_plans) in zip(live, plans):
            tree.pending = failed_plans
        try_tactics(verifier, live, args, clock=clock)
        end_expansion(live, args)
    return [search_result(tree, args) for tree in trees]


def proposed_edges(samples: list[Sample], plan: Edge | None = None) -> list[Edge]:
    """A node's proposed edges from its samples: the distinct non-empty completions without
    premise marks (official remove_marks), highest summed log-prob first (as the official beam
    search scores them; a completion drawn twice keeps its best), then a failed edge (tactic None,
    log-prob 0, 0 tokens) for each malformed sample (empty, or a failed vLLM request), in
    sampling order. The planner's samples (plan None) are targets: Edge(None, 0.0, 0, s*,
    log p(s* | s)), a malformed one Edge(None, 0.0, 0). The actor's samples under `plan` (the
    planner's target Edge, or flat's) are tactics: Edge(y, log p(y | s, s*), tokens, s*,
    log p(s* | s)), a malformed one Edge(None, 0.0, 0, s*, log p(s* | s))."""
    failed_edge = Edge(None, 0.0, 0)
    if plan is not None:
        failed_edge = Edge(None, 0.0, 0, plan.target, plan.target_logprob)
    best = {}  # text: (its best summed log-prob, tokens)
    failed = []
    for completion in samples:
        text = completion.text.replace("<a>", "").replace("</a>", "").strip()
        if completion.finish_reason not in ("stop", "length") or not text:
            failed.append(failed_edge)
            continue
        logp = float(sum(completion.logprobs))
        if text not in best or logp > best[text][0]:
            best[text] = (logp, len(completion.token_ids))
    ranked = sorted(best.items(), key=lambda item: -item[1][0])
    edges = []
    for text, (logp, tokens) in ranked:
        if plan is None:
            edges.append(Edge(None, 0.0, 0, text, logp))
        else:
            edges.append(Edge(text, logp, tokens, plan.target, plan.target_logprob))
    return edges + failed


def node_text(tokenizer, tree: Tree, args: Args) -> str:
    """The state of the node a tree expands, cut to max_state_tokens (truncate_right)."""
    return truncate_right(tokenizer, tree.expanding.state.pretty, args.max_state_tokens)


def propose_targets(sampler, trees: list[Tree], key: str, args: Args, clock=time.monotonic):
    """The planner's targets s* ~ pi_h(. | s) for the node each tree expands, one sampling call
    for all trees (a key per node): for each tree, its proposed_edges split in its targets'
    Edges, ranked, and its malformed samples' failed edges. Flat: one Edge with target None and
    log-prob 0, no call.
    Each tree is charged the call's seconds (role "planner")."""
    if not args.planner:
        return [([Edge(None, 0.0, 0)], []) for _ in trees]
    tokenizer = sampler.tokenizer
    prompts = [PLANNER_PROMPT.format(state=node_text(tokenizer, tree, args)) for tree in trees]
    keys = [f"{key}/{tree.problem.id}/{tree.expansions}/planner" for tree in trees]
    # s* alone ends at end-of-sequence (HF's stop strings: ~1 s a call); the joint sequence goes
    # on after s*
    stop = None
    if args.joint_format:
        stop = [GOAL_STOP]
    start = clock()
    rows = sample(
        sampler,
        prompts,
        n=args.num_sampled_goals,
        key=keys,
        max_new_tokens=args.goal_max_new_tokens,
        stop=stop,
        desc="plan",
        temperature=args.search_temperature,
        top_p=args.top_p,
    )
    elapsed = clock() - start  # every theorem of the call waited for it
    plans = []
    for tree, row in zip(trees, rows):
        tree.seconds += elapsed
        tree.role_seconds["planner"] += elapsed
        edges = proposed_edges(row)
        plan_edges = [edge for edge in edges if edge.target is not None]
        failed = [edge for edge in edges if edge.target is None]
        plans.append((plan_edges, failed))
    return plans


def propose_tactics(
    sampler, trees: list[Tree], targets: list, key: str, args: Args, clock=time.monotonic
) -> None:
    """The actor's tactics y ~ pi_l(. | s, s*) for each tree's node and its target (`targets`:
    each tree's planner Edge; flat: y ~ pi(. | s)), one sampling call for all trees: each tree's
    pending Edges (proposed_edges: by log-prob, then a failed edge for each malformed sample).
    Each tree is charged the call's seconds (role "actor")."""
    tokenizer = sampler.tokenizer
    prompts = []
    for tree, plan in zip(trees, targets):
        state = node_text(tokenizer, tree, args)
        if args.planner:
            target_text = truncate_right(tokenizer, plan.target, args.max_state_tokens)
            prompts.append(ACTOR_PROMPT.format(state=state, target=target_text))
        else:
            prompts.append(FLAT_PROMPT.format(state=state))
    keys = [f"{key}/{tree.problem.id}/{tree.expansions}/actor" for tree in trees]
    start = clock()
    rows = sample(
        sampler,
        prompts,
        n=args.num_sampled_tactics,
        key=keys,
        max_new_tokens=args.tactic_max_new_tokens,
        desc="act",
        temperature=args.search_temperature,
        top_p=args.top_p,
    )
    elapsed = clock() - start  # every theorem of the call waited for it
    for tree, plan, row in zip(trees, targets, rows):
        tree.seconds += elapsed
        tree.role_seconds["actor"] += elapsed
        tree.pending = proposed_edges(row, plan)


def new_node(parent: Node, edge: Edge, state: TacticState, args: Args) -> Node:
    """A state first reached by `edge` from `parent` (which owns its MCTS visits and value),
    with its BFS `priority`."""
    node = Node(state=state, parent=parent, edge=edge)
    node.priority = priority(node, args)
    return node


def try_tactics(verifier, trees: list[Tree], args: Args, clock=time.monotonic) -> list:
    """Lean applies each tree's pending Edges to the node it expands, in lockstep: the i-th edge
    of every tree still within_budget in one apply_tactics call (a tactic already run in this
    expansion is not run again), until each tree's first proof or budget. Then take_edge: a
    solved state whose path the kernel accepts is the proof; a rejected tactic (or proof) is a
    failed edge; known goals merge; else a new Node (new_node). A tree is charged its own
    tactics' seconds (role "env") and kernel checks. Returns the new (Tree, Node)s."""
    new = []
    for i in itertools.count():
        todo = [tree for tree in trees if i < len(tree.pending) and within_budget(tree, args)]
        if not todo:
            break
        to_run = []
        for tree in todo:
            tactic = tree.pending[i].tactic
            if tactic is not None and tactic not in tree.tried:
                to_run.append(tree)
        steps = [(tree.expanding.state, tree.pending[i].tactic) for tree in to_run]
        states = []
        if steps:
            states = verifier.apply_tactics(steps)
        for tree, state in zip(to_run, states):
            tree.tried[tree.pending[i].tactic] = state
            tree.seconds += state.time
            tree.role_seconds["env"] += state.time
        for tree in todo:
            node = take_edge(verifier, tree, tree.pending[i], args, clock=clock)
            if node is not None:
                new.append((tree, node))
    return new


def take_edge(verifier, tree: Tree, edge: Edge, args: Args, clock=time.monotonic) -> Node | None:
    """What an edge found (try_tactics' rule), counted in tree.counts: the proof (tree.proof, a
    Node off the tree, once the kernel accepts its path: the check is charged to the theorem, to
    no role), a failed edge, a merge, or a new Node, which is returned."""
    tree.counts["edges"] += 1
    state = tree.tried.get(edge.tactic)  # None: no tactic
    if state is not None and state.status == "solved":
        start = clock()
        valid = verifier.check_tactic_path(state).valid
        tree.seconds += clock() - start
        if valid:
            tree.proof = Node(state, parent=tree.expanding, edge=edge)
            return None
    if state is None or state.status != "open":
        tree.counts["failed_edges"] += 1
        return None
    if state.key in tree.nodes:
        tree.counts["merged"] += 1
        tree.reached.append((edge, tree.nodes[state.key]))
        return None
    node = new_node(tree.expanding, edge, state, args)
    tree.nodes[state.key] = node
    tree.expanding.children.append(node)
    tree.reached.append((edge, node))
    return node


def end_expansion(trees: list[Tree], args: Args) -> None:
    """After the expansions of `trees`, each tree not proved: its new children's MCTS priors
    (edge_priors of the edges that reached each, log p(s* | s) + log p(y | s, s*)), the node
    expanded, dead without a child; then the --search choice's update (BFS: queue the children;
    MCTS: backup)."""
    for tree in trees:
        if tree.proof is not None:
            continue
        leaf = tree.expanding
        log_masses = []
        for child in leaf.children:
            masses = []
            for edge, node in tree.reached:
                if node is child:
                    masses.append(edge.target_logprob + edge.logprob)
            log_masses.append(float(np.logaddexp.reduce(masses)))
        for child, prior in zip(leaf.children, edge_priors(log_masses)):
            child.prior = prior
        leaf.expanded = True
        leaf.dead = not leaf.children
        node_choice(args).update(tree, leaf, args)


def select(root: Node, c_puct: float) -> list[Node]:
    """MCTS selection (ours): the path from the root by the live child of best puct_score, down
    to a leaf."""
    path = [root]
    while path[-1].expanded:
        parent = path[-1]
        live = [child for child in parent.children if not child.dead]
        scores = []
        for child in live:
            score = puct_score(
                value=child.value_sum,
                visits=child.visits,
                prior=child.prior,
                parent_value=parent.value_sum,
                parent_visits=parent.visits,
                c_puct=c_puct,
            )
            scores.append(score)
        best = scores.index(max(scores))  # the first of equal scores
        path.append(live[best])
    return path


def backup(path: list[Node], value: float) -> None:
    """MCTS backup (ours): each node of the path counts the visit and adds the simulation's value
    (N += 1, W += value); a node whose children are all dead is dead."""
    for node in path:
        node.visits += 1
        node.value_sum += value
    for node in reversed(path[:-1]):
        node.dead = all(child.dead for child in node.children)


def node_path(node: Node) -> list[Node]:
    """The nodes from the root to `node`, root first."""
    path = [node]
    while path[0].parent is not None:
        path.insert(0, path[0].parent)
    return path


def proof_steps(proof: Node | None) -> list[Triple]:
    """A found proof's steps, root first: Triple(state before, tactic, state after), the state
    after the last "no goals" (LeanDojo's); [] without a proof."""
    if proof is None:
        return []
    steps = []
    path = node_path(proof)
    for before, after in zip(path, path[1:]):
        target = after.state.pretty or NO_GOALS
        steps.append(Triple(before.state.pretty, after.edge.tactic, target))
    return steps


def path_edges(proof: Node | None) -> list[Edge]:
    """The Edges of a found proof's steps, root first (proof_steps' order); [] without a proof."""
    if proof is None:
        return []
    return [node.edge for node in node_path(proof)[1:]]


def search_result(tree: Tree, args: Args) -> SearchResult:
    """A tree's SearchResult: its proof (the solved state's tactics) and path (proof_steps), and
    whether the proof came within the budget (`proved`: charged seconds at most search_timeout;
    within_budget's strict < only stops a call from starting at it)."""
    proof = None
    if tree.proof is not None:
        proof = tree.proof.state.tactics
    return SearchResult(
        id=tree.problem.id,
        proof=proof,
        proved=proof is not None and tree.seconds <= args.search_timeout,
        seconds=tree.seconds,
        expansions=tree.expansions,
        nodes=len(tree.nodes),
        edges=tree.counts["edges"],
        failed_edges=tree.counts["failed_edges"],
        merged=tree.counts["merged"],
        role_seconds=dict(tree.role_seconds),
        path=proof_steps(tree.proof),
        path_edges=path_edges(tree.proof),
    )


def search(
    sampler, verifier, problems: list[Problem], key: str, args: Args, dist: Dist
) -> list[SearchResult]:
    """Steps 2 and 4's search: each rank its share of `problems`, search_batch theorems at a
    time in lockstep (best_first_search; default one per REPL of the rank's pool); after each
    batch the REPLs holding its proof states restart (free_states: a REPL never frees a state,
    and a restart per batch re-imports the header once per search_batch searches). Every rank
    gets all results, in order."""

    def search_share(mine: list[Problem]) -> list[SearchResult]:
        size = args.search_batch or verifier.workers
        results = []
        for i in range(0, len(mine), size):
            batch = mine[i : i + size]
            results += best_first_search(sampler, verifier, batch, key=key, args=args)
            verifier.free_states()
        return results

    return map_sharded(search_share, problems, dist)


def trains_on(result: SearchResult, args: Args) -> bool:
    """Step 3's filter (expert iteration): a search trains planner and actor when it found a
    proof within the budget (result.proved; a proof past it does not train)."""
    return result.proved


def unseen_steps(result: SearchResult, known: set) -> list[tuple[int, Triple]]:
    """D_t's deduplication, D_{t+1} = D_t + the new triples: each step of the search's proof
    path (index, Triple), root first, that is not in `known` (D_t's triples: a human one or an
    earlier proof's, compared as text: a human tactic keeps its premise marks, so a self-play
    step equal to it up to the marks is new); each one returned is added to `known`, so a
    triple enters D_{t+1} once."""
    unseen = []
    for index, step in enumerate(result.path):
        triple = Triple(*step)
        if triple in known:
            continue
        known.add(triple)
        unseen.append((index, triple))
    return unseen


def self_play_weight(result: SearchResult, index: int, args: Args) -> tuple[float, float]:
    """The (planner's, actor's) weights in L_co (co_training_loss) of step `index` of a
    self-play proof: result.path[index] (its triple) and result.path_edges[index] (its Edge: the
    tactic's log-prob, the planner's target s*), in the search `result` (its expansions, nodes,
    seconds). (1, 1): every step of every proof that trains_on alike, both roles (expert
    iteration). D_0's human triples weigh (1, 1) too. training_items gives the planner's
    sequence the first, the actor's the second."""
    return 1.0, 1.0


def self_play_triples(
    results: list[SearchResult], known: set, args: Args
) -> list[tuple[Triple, tuple[float, float], SearchResult]]:
    """Step 3 (ours, expert iteration): the new steps (unseen_steps, against D_t's `known`) of
    each search that trains_on, as the search reached them (result.path: the state before, the
    tactic, the state after, "no goals" after the last; no replay, no premise marks), each with
    its self_play_weight and SearchResult: (Triple, (planner's, actor's) weights, result), in
    order. A triple's s* is
    the state the tactic reached, not the target the planner proposed (that one is
    result.path_edges[index].target). A triple already in D_t keeps its weight there. main adds
    them to D_t for the next iteration's co-training."""
    triples = []
    for result in results:
        if not trains_on(result, args):
            continue
        for index, triple in unseen_steps(result, known):
            weights = self_play_weight(result, index, args)
            triples.append((triple, weights, result))
    return triples


def search_result_from_row(row: dict) -> SearchResult:
    """A SearchResult from its plain row (record_searches' searches.jsonl line, a stored_triple's
    source): its path's Triples and Edges rebuilt."""
    fields = {}
    for name in SearchResult._fields:
        fields[name] = row[name]
    fields["path"] = [Triple(*step) for step in row["path"]]
    fields["path_edges"] = [Edge(*edge) for edge in row["path_edges"]]
    return SearchResult(**fields)


def stored_triple(triple: Triple, weights: tuple[float, float], result: SearchResult) -> tuple:
    """A self-play triple of D_t as state.pt keeps it, plain values only (state.pt loads
    without rir.py): s, y*, s*, the planner's and the actor's weights, and its search as a
    plain row, so that after --resume its Examples still carry their source."""
    row = json.loads(json.dumps(result._asdict()))
    return (*triple, *weights, row)


def restored_triple(entry: tuple) -> tuple[Triple, tuple[float, float], SearchResult]:
    """A stored_triple back as D_t's (triple, (planner's, actor's) weights, source)."""
    state, tactic, target, planner_weight, actor_weight, row = entry
    triple = Triple(state, tactic, target)
    return triple, (planner_weight, actor_weight), search_result_from_row(row)


def training_items(data: list[tuple], tokenizer, args: Args) -> list[list[Example]]:
    """Each (triple (s, y*, s*), (planner's, actor's) weights, source) of D_t as the sequences
    of L_co, one item a triple, each sequence an Example(Sample ending in end-of-sequence,
    weight, source, role): PLANNER_PROMPT -> s* (role 0, the planner's weight) and ACTOR_PROMPT
    -> y* (role 1, the actor's) (official collate: gen_type goal, goal_driven_tactic); one JOINT
    sequence (role 0, the planner's weight) with --joint-format; FLAT_PROMPT -> y* (role 1, the
    actor's) without planner. co_train draws the items; co_training_loss weighs each
    sequence."""

    def sequence(prompt: str, target: str, limit: int) -> Sample:
        ids = tokenizer(target, add_special_tokens=False).input_ids[:limit]
        ids = ids + [tokenizer.eos_token_id]
        prompt_ids = encode_prompt(tokenizer, prompt)
        return Sample(target, prompt_ids, ids, [], "stop")

    goal_limit = args.goal_max_new_tokens
    tactic_limit = args.tactic_max_new_tokens
    items = []
    for (state, tactic, target), (planner_weight, actor_weight), source in data:
        state = truncate_right(tokenizer, state, args.max_state_tokens)
        target = truncate_right(tokenizer, target, args.max_state_tokens)
        if not args.planner:
            flat = sequence(FLAT_PROMPT.format(state=state), tactic, tactic_limit)
            items.append([Example(flat, actor_weight, source, role=1)])
        elif args.joint_format:
            joint_prompt = JOINT_PROMPT.format(state=state)
            joint_target = JOINT_TARGET.format(target=target, tactic=tactic)
            joint = sequence(joint_prompt, joint_target, goal_limit + tactic_limit)
            items.append([Example(joint, planner_weight, source, role=0)])
        else:
            planner_prompt = PLANNER_PROMPT.format(state=state)
            actor_prompt = ACTOR_PROMPT.format(state=state, target=target)
            planner = sequence(planner_prompt, target, goal_limit)
            actor = sequence(actor_prompt, tactic, tactic_limit)
            planner_example = Example(planner, planner_weight, source, role=0)
            actor_example = Example(actor, actor_weight, source, role=1)
            items.append([planner_example, actor_example])
    return items


def co_train(
    policy,
    optimizer,
    items: list,
    steps: int,
    args: Args,
    dist: Dist,
    rng: random.Random,
) -> dict[str, float]:
    """Step 1, offline goal-driven co-training (official fit, one model here):
    `steps` AdamW steps on batch_size triples drawn epoch by epoch, each minimising
    co_training_loss over its batch (each rank its share). The learning rate follows lr_at, as
    get_cosine_schedule_with_warmup, over the `steps` (official: over 500k, stopped at ~40k):
    every co-training warms up, then decays (a later iteration's warm-up is warmup_steps *
    steps / train_steps, ours). Returns the losses/ metrics, each optimizer step's averaged over
    the steps: loss (co_training_batch_loss's; official: the weighted L_co), goal_nll and
    tactic_nll (the planner's and the actor's unweighted NLL a token; with --joint-format
    goal_nll is the joint sequence's, with --no-planner the flat one is tactic_nll's),
    grad_norm and every other stat co_training_batch_loss returns; and loss_first, loss_last,
    steps, learning_rate_last."""
    reduction = loss_reduction_rule(args)
    size = min(args.batch_size, len(items))
    warmup = min(args.warmup_steps, args.warmup_steps * steps // max(args.train_steps, 1))

    def item_length(item: list[Example]) -> int:  # micro_batches sorts by it
        return sum(example_length(example) for example in item)

    stream = []  # the epochs' shuffled items, not yet drawn
    history = []
    for optimizer_step in range(steps):
        while len(stream) < size:
            stream += rng.sample(items, len(items))
        batch = stream[:size]
        stream = stream[size:]
        role_tokens = [0, 0]  # the planner's and the actor's output tokens in the batch
        for item in batch:
            for example in item:
                role_tokens[example.role] += len(example.sample.token_ids)
        denominators = reduction(role_tokens, len(batch))

        def loss_fn(micro: list) -> tuple[torch.Tensor, dict]:
            examples = []
            for item in micro:
                examples.extend(item)
            return co_training_batch_loss(policy, examples, denominators, args=args)

        lr = lr_at(
            optimizer_step, steps, args.learning_rate, warmup=warmup, schedule=args.lr_schedule
        )
        step_stats = train_step(
            policy,
            optimizer,
            batch,
            loss_fn=loss_fn,
            micro_batch_size=args.micro_batch_size,
            max_grad_norm=args.max_grad_norm,
            dist=dist,
            length=item_length,
            lr=lr,
        )
        # every stat co_training_batch_loss returns is logged; the NLL sums become per-token means
        goal_nll = step_stats.pop("goal") / max(role_tokens[0], 1)
        tactic_nll = step_stats.pop("tactic") / max(role_tokens[1], 1)
        history.append({**step_stats, "goal_nll": goal_nll, "tactic_nll": tactic_nll})
    metrics = loss_metrics(history)
    metrics["losses/loss_first"] = history[0]["loss"]
    metrics["losses/loss_last"] = history[-1]["loss"]
    metrics["losses/steps"] = float(steps)
    metrics["losses/learning_rate_last"] = lr
    return metrics


# ---- evaluation ----
def mean(values: list) -> float:
    """The mean of values; 0 for none."""
    if not values:
        return 0.0
    return float(np.mean(values))


def search_metrics(results: list[SearchResult], prefix: str, seconds: float) -> dict[str, float]:
    """Search efficiency of a phase's SearchResults (the same in coprover.py and rir.py):
    theorems; proved, a proof found within the budget, and pass@1, their share (one search, one
    sample); proved_overrun, proofs found past the budget (not proved); proofs per expansion and
    per second of `seconds`, the phase's wall time (lockstep searches overlap); expansions and
    nodes per proof and proof length (proved ones); expansions; merged; the share of failed
    edges; the charged seconds of the proved searches (search_time_proved, mean and median); and
    for each role of role_seconds, its seconds over all searches (<role>_seconds) and its mean
    over the proved ones (<role>_time_proved). No result: zeros, no role."""
    proved = [r for r in results if r.proved]
    overrun = [r for r in results if r.proof is not None and not r.proved]
    expansions = sum(r.expansions for r in results)
    edges = sum(r.edges for r in results)
    failed_edges = sum(r.failed_edges for r in results)
    proved_seconds = [r.seconds for r in proved]
    proofs_per_second = 0.0
    if seconds > 0:
        proofs_per_second = len(proved) / seconds
    median = 0.0
    if proved:
        median = float(np.median(proved_seconds))
    stats = {
        f"{prefix}/theorems": float(len(results)),
        f"{prefix}/proved": float(len(proved)),
        f"{prefix}/pass@1": len(proved) / max(len(results), 1),
        f"{prefix}/proved_overrun": float(len(overrun)),
        f"{prefix}/proofs_per_expansion": len(proved) / max(expansions, 1),
        f"{prefix}/proofs_per_second": proofs_per_second,
        f"{prefix}/expansions_per_proof": mean([r.expansions for r in proved]),
        f"{prefix}/nodes_per_proof": mean([r.nodes for r in proved]),
        f"{prefix}/proof_length": mean([len(r.proof) for r in proved]),
        f"{prefix}/expansions": float(expansions),
        f"{prefix}/merged": float(sum(r.merged for r in results)),
        f"{prefix}/failed_edge_share": failed_edges / max(edges, 1),
        f"{prefix}/search_time_proved": mean(proved_seconds),
        f"{prefix}/search_time_proved_median": median,
    }
    roles = sorted(set().union(*[r.role_seconds for r in results]))
    for role in roles:
        total = sum(r.role_seconds.get(role, 0.0) for r in results)
        stats[f"{prefix}/{role}_seconds"] = float(total)
        role_proved = [r.role_seconds.get(role, 0.0) for r in proved]
        stats[f"{prefix}/{role}_time_proved"] = mean(role_proved)
    return stats


def record_searches(
    run_dir: pathlib.Path,
    results: list[SearchResult],
    phase: str,
    step: int,
    searched: collections.Counter,
    dist: Dist,
) -> None:
    """Every search to <run>/searches.jsonl, with its phase and the step (iterations done) its
    metrics are logged at, and into `searched`, this run's count of searches, proved,
    expansions, edges and failed_edges (the same in coprover.py and rir.py)."""
    for result in results:
        searched["searches"] += 1
        searched["proved"] += int(result.proved)
        searched["expansions"] += result.expansions
        searched["edges"] += result.edges
        searched["failed_edges"] += result.failed_edges
    if not dist.is_main:
        return
    with open(run_dir / "searches.jsonl", "a") as f:
        for result in results:
            row = {"step": step, "phase": phase, **result._asdict()}
            f.write(json.dumps(row) + "\n")


def evaluate(
    sampler,
    verifier,
    problems: list[Problem],
    key: str,
    run_dir: pathlib.Path,
    step: int,
    searched: collections.Counter,
    args: Args,
    dist: Dist,
) -> dict[str, float]:
    """Step 4, Tables 1-2 and Figures 2-3: one search per benchmark theorem under the budget;
    every search to searches.jsonl (record_searches), Figure 3's CDF (search_time_cdf) to
    <run>/search_time_cdf.csv. Returns eval/search/* metrics (search_metrics; eval/search/pass@1
    is the share of the theorems one search proves)."""
    start = time.monotonic()
    results = search(sampler, verifier, problems, key=key, args=args, dist=dist)
    record_searches(run_dir, results, "eval", step=step, searched=searched, dist=dist)
    if dist.is_main:
        proved_seconds = [r.seconds for r in results if r.proved]
        rows = [("seconds", "proved", "share")] + search_time_cdf(proved_seconds, len(results))
        with open(run_dir / "search_time_cdf.csv", "w", newline="") as f:
            csv.writer(f).writerows(rows)
    return search_metrics(results, "eval/search", seconds=time.monotonic() - start)


def nothing_learned(searched: collections.Counter, trained: int, args: Args) -> str | None:
    """The run's last line when self-play added no triple (`trained`, this run's new triples)
    although it searched: why. None when a triple was added or nothing was searched. When
    searches proved theorems, their steps did not train (trains_on rejected them, or D_t had
    each step); else (the CPU default on the embedded model) what the tactics did. searched:
    this run's searches, as record_searches counts them; args: unused here (the signature every
    file's nothing_learned has)."""
    if searched["searches"] == 0 or trained > 0:
        return None
    searches = searched["searches"]
    proved = searched["proved"]
    if proved > 0:
        return (
            f"The run's {searches} searches proved {proved} theorem(s), but self-play added no "
            "triple to D_t (self-play searches in every iteration but the last; trains_on may "
            "have rejected every proof, or D_t had each of their steps)."
        )
    expansions = searched["expansions"]
    edges = searched["edges"]
    failed = searched["failed_edges"]
    return (
        f"No theorem proved within the budget in the run's {searches} searches ({expansions} "
        "expansions; trains_on officially trains on those only): of the "
        f"{edges} tactics tried, {failed} failed in Lean or were malformed, {edges - failed} left "
        "goals open. The loop ran; tests/test_rir.py::test_the_loop_learns_what_the_rule_accepts "
        "shows it learn."
    )


# ---- main ----
def check_choices(args: Args) -> None:
    """Stop the run at start, not deep in the loop, on flag values that cannot run: a value (a
    Literal a fork extended) without its table entry (each lookup runs once and raises a
    ValueError naming what to add), a value outside its range, flags that cannot run together.
    A new flag's range check goes here. main calls it before start_run.
    Its tables: NODE_CHOICES, LOSS_REDUCTIONS."""
    node_choice(args)
    loss_reduction_rule(args)


def start_lean(args: Args, dist: Dist) -> LeanVerifier:
    """This rank's Lean REPLs (--lean-workers on each node, divided among its ranks). Without a
    Lean REPL the run stops here, before any model is loaded (the search needs its tactic mode)."""
    workers = None
    if args.lean_workers:
        workers = max(1, args.lean_workers // dist.local_world_size)
    try:
        verifier = LeanVerifier(backend="repl", timeout=args.lean_timeout, workers=workers)
    except LeanNotInstalled as e:  # the Lean stand-in follows data/lean_tactics.jsonl's table
        name = os.path.basename(__file__)
        sys.exit(
            f"{name} searches proofs in Lean 4's tactic mode and found no Lean REPL: {e} For a "
            "CPU smoke run without Lean, the stand-in REPL: "
            f"LEAN_REPL_CMD='python tests/fake_lean_repl.py' python {name}"
        )
    if dist.is_main:
        ranks = dist.local_world_size
        print(f"lean_verify: {verifier.workers} REPL(s) on each of the node's {ranks} rank(s)")
    return verifier


def load_models(args: Args, dist: Dist) -> tuple[dict, object]:
    """{"policy": (model, AdamW without weight decay)}: one LM plays planner and actor by prompt
    (deviation 2: the official code trains two models); and its tokenizer."""
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    optimizer = torch.optim.AdamW(policy.parameters(), args.learning_rate, weight_decay=0.0)
    models = {"policy": (policy, optimizer)}
    return models, tokenizer


def start_sampler(policy, tokenizer, args: Args, dist: Dist) -> Sampler:
    """The policy's sampler (vLLM or transformers), with its weights as they are now (resumed)."""
    return Sampler(
        args.model,
        policy,
        tokenizer,
        dist=dist,
        backend=args.backend,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        sleep=args.vllm_sleep,
        seed=args.seed,
    )


def main(args: Args) -> None:
    check_choices(args)  # flag values that cannot run stop here, at start
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS)
    verifier = start_lean(args, dist)
    problems = load_problems(args.selfplay_dataset, args.num_problems, split=args.selfplay_split)
    benchmark = load_problems(args.eval_dataset, args.eval_limit, split=args.eval_split)
    triples = load_triples(args.dataset, args.num_triples)  # D_0: the traced triples

    models, tokenizer = load_models(args, dist)
    policy, optimizer = models["policy"]
    # run state: the triples self-play added to D_0 (stored_triple: plain values, so that
    # state.pt loads without rir.py), the proofs found
    start = 0
    state = {"selfplay_triples": [], "proved": {}}
    if args.resume:
        found = load_checkpoint(run_dir, models, dist)
        if found is not None:
            start, state = found
    sampler = start_sampler(policy, tokenizer, args=args, dist=dist)
    searched = collections.Counter()  # this run's searches, of every phase (record_searches)
    trained = 0  # this run's training signals: the triples self-play added to D_t

    for iteration in range(start, args.iterations):
        step = iteration + 1  # iterations done
        # D_t: (triple, (planner's, actor's) weights, source); D_0's human triples weigh 1
        data = [(triple, (1.0, 1.0), triple) for triple in triples]
        for entry in state["selfplay_triples"]:
            data.append(restored_triple(entry))
        metrics = {"charts/triples": float(len(data))}
        rng = random.Random(f"{args.seed}/{iteration}")

        # 1. Co-train the planner and the actor on D_t (co_train, L_co)
        train_steps = args.train_steps if iteration == 0 else args.selfplay_train_steps
        if train_steps and data:
            with logger.timer("co_train"):
                sampler.sleep()
                items = training_items(data, tokenizer, args)
                stats = co_train(
                    policy, optimizer, items, steps=train_steps, args=args, dist=dist, rng=rng
                )
                metrics.update(stats)
                sampler.sync_weights(policy)

        if step < args.iterations:  # self-play in every iteration but the last
            # 2. Self-play search (ours): one search of each self-play theorem
            with logger.timer("selfplay_search"):
                key = f"{args.seed}/{iteration}/selfplay"
                results = search(sampler, verifier, problems, key=key, args=args, dist=dist)

            # 3. The proofs' steps as triples (their paths, no replay): D_{t+1} = D_t + new ones
            known = {triple for triple, _, _ in data}
            new = self_play_triples(results, known, args)
            for triple, weights, result in new:
                entry = stored_triple(triple, weights, result)
                state["selfplay_triples"].append(entry)
            for result in results:
                if result.proved:
                    state["proved"][result.id] = result.proof
            trained += len(new)
            search_seconds = logger.times["time/selfplay_search"]
            metrics.update(search_metrics(results, "selfplay", seconds=search_seconds))
            metrics["selfplay/new_triples"] = float(len(new))
            metrics["charts/proved_ever"] = float(len(state["proved"]))
            record_searches(run_dir, results, "selfplay", step=step, searched=searched, dist=dist)

        # 4. Evaluate: pass@1 under the budget (after the last iteration by default)
        last = step == args.iterations
        if args.eval_every and step % args.eval_every == 0 or last:
            with logger.timer("eval"):
                stats = evaluate(
                    sampler,
                    verifier,
                    benchmark,
                    key=f"{args.seed}/{iteration}/eval",
                    run_dir=run_dir,
                    step=step,
                    searched=searched,
                    args=args,
                    dist=dist,
                )
                metrics.update(stats)
        logger.log(metrics, step=step)
        if step % args.save_every == 0 or last:
            save_checkpoint(
                run_dir, iteration=step, models=models, tokenizer=tokenizer, state=state, dist=dist
            )

    # --iterations 0, or a finished run: step 4 alone (evaluate), on the weights as given
    if start >= args.iterations:
        stats = evaluate(
            sampler,
            verifier,
            benchmark,
            key=f"{args.seed}/eval",
            run_dir=run_dir,
            step=args.iterations,
            searched=searched,
            args=args,
            dist=dist,
        )
        logger.log(stats, step=args.iterations)
    line = nothing_learned(searched, trained, args)
    if dist.is_main and line:
        print(line)
    verifier.close()


# ---- infrastructure (identical in every algorithm file) ----
# Plumbing every algorithm file does the same way: a reader learning a method can skip it.
# CONTRIBUTING.md says how to change it (in all six files at once).

EMBEDDED_MODEL = "embedded:smollm2"  # SmolLM2-135M-Instruct: setup.sh converts it into CACHE_DIR
CACHE_DIR = pathlib.Path(os.environ.get("SELFPLAY_CACHE", pathlib.Path.home() / ".cache/selfplay"))


class Dist(NamedTuple):
    """Where this process stands among torchrun's processes (one process without torchrun)."""

    rank: int
    world_size: int
    local_world_size: int  # the processes on this node
    device: torch.device
    is_main: bool  # rank 0: it logs and writes checkpoints
    objects: object = None  # the gloo group that gathers Python objects (None in one process)


def setup_distributed(seed: int, timeout_minutes=60, objects_timeout_days=7) -> Dist:
    """torchrun's processes: one per GPU (NCCL) or CPU share (gloo); without torchrun, one."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    objects = None
    if world_size > 1:
        if not tdist.is_initialized():
            backend = "gloo" if device.type == "cpu" else "nccl"
            tdist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
            atexit.register(tdist.destroy_process_group)
        # objects are gathered after hours of per-rank work (search, Lean, generation): on gloo,
        # with a timeout of days, so that the NCCL watchdog kills no rank that finished early
        objects = tdist.new_group(backend="gloo", timeout=timedelta(days=objects_timeout_days))
    random.seed(seed + rank)  # each rank draws differently
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    return Dist(rank, world_size, local_world_size, device, rank == 0, objects)


def start_run(args, cpu_defaults: dict) -> tuple[Dist, pathlib.Path, Logger]:
    """The processes, run directory and logger; without CUDA, names the CPU sizes in use."""
    dist = setup_distributed(args.seed)
    in_use = [f"{k}={v}" for k, v in cpu_defaults.items() if getattr(args, k) == v]
    if dist.is_main and in_use and not torch.cuda.is_available():
        print(f"No CUDA: the CPU_DEFAULTS sizes (a value given keeps it): {', '.join(in_use)}")
    # an --lr-schedule lr_at does not know stops the run here (None: the file's resolve() sets it)
    if args.lr_schedule is not None:
        lr_at(step=0, total=1, peak=1.0, schedule=args.lr_schedule)
    run_dir = pathlib.Path(args.output_dir) / (args.run_name or f"{args.exp_name}__{args.seed}")
    project, entity = args.wandb_project_name, args.wandb_entity
    logger = Logger(run_dir, vars(args), dist, args.track, project, entity)
    return dist, run_dir, logger


def all_gather_objects(obj, dist: Dist) -> list:
    """Every rank's obj, in rank order (a collective: every rank calls it)."""
    gathered = [obj] * dist.world_size
    if dist.world_size > 1:
        tdist.all_gather_object(gathered, obj, group=dist.objects)
    return gathered


def map_sharded(fn, items: list, dist: Dist) -> list:
    """fn over this rank's share of items (one result an item); every rank's results, in order."""
    indices = range(dist.rank, len(items), dist.world_size)
    results = fn(items[dist.rank :: dist.world_size])
    return gather_shard(dict(zip(indices, results)), dist)


def gather_shard(shard: dict, dist: Dist | None = None) -> list:
    """Every rank's {index: value} merged, as a list in index order (dist None: this one alone)."""
    parts = [shard]
    if dist is not None:
        parts = all_gather_objects(shard, dist)
    merged = {}
    for part in parts:
        merged.update(part)
    return [merged[i] for i in sorted(merged)]


def micro_batches(items: list, size: int, dist: Dist, length=None) -> list[tuple[list, bool]]:
    """This rank's share of items (sorted by `length`) in micro-batches, as (batch, real). Every
    rank gets as many (FSDP2 gathers in each forward): padding is (items[:1], False), counted 0."""
    mine = items[dist.rank :: dist.world_size]
    if length is not None:
        mine = sorted(mine, key=length)
    count = math.ceil(math.ceil(len(items) / dist.world_size) / size)
    batches = []
    for i in range(count):
        batch = mine[i * size : (i + 1) * size]
        if batch:
            batches.append((batch, True))
        else:
            batches.append((items[:1], False))
    return batches


def resolve_model(name: str) -> str:
    if name == EMBEDDED_MODEL:
        return str(CACHE_DIR / "smollm2-135m-instruct")
    return name


def load_tokenizer(name: str):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name), padding_side="left")
    if not tokenizer.pad_token:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, dist: Dist, train=True, gradient_checkpointing=True) -> torch.nn.Module:
    """A causal LM, trained in fp32 (bf16 compute on GPUs) or frozen (bf16 on GPUs). Under torchrun
    rank 0 reads the weights, every rank shards the model (FSDP2) and gets rank 0's tensors."""
    cuda = dist.device.type == "cuda"
    path = resolve_model(name)
    dtype = torch.bfloat16 if cuda and not train else torch.float32
    if dist.rank == 0:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    model.train(train)
    model.requires_grad_(train)
    if train and gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if dist.world_size == 1:
        return model.to(dist.device)
    full = model.state_dict() if dist.rank == 0 else {}
    block_names = set(model._no_split_modules or [])
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    assert blocks, f"{type(model).__name__}: no decoder blocks, FSDP2 would gather it all at once"
    precision = MixedPrecisionPolicy()
    if cuda and train:
        precision = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    # the root too: a forward without backward must not leave it unsharded
    for module in blocks + [model]:
        fully_shard(module, mp_policy=precision, reshard_after_forward=True)
    if dist.rank == 0:
        model.to(dist.device)
    else:
        model.to_empty(device=dist.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    # buffers are not in the state dict (rotary frequencies): rank 0's, computed at load
    for buffer in model.buffers():
        tdist.broadcast(buffer, src=0)
    return model.to(dist.device)


def full_state_dict_items(policy: torch.nn.Module, dtype=None):
    """(name, whole tensor) a state-dict entry at a time: a collective, every rank runs it all."""
    for name, tensor in policy.state_dict().items():
        if dtype:
            tensor = tensor.to(dtype)
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def chat_prompt(tokenizer, user: str) -> str:
    """One user turn in the chat template, no system prompt."""
    messages = [dict(role="user", content=user)]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The prompt's token ids, with a BOS unless the chat template put one in the text."""
    has_bos = bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token)
    return tokenizer(text, add_special_tokens=not has_bos).input_ids


class Sample(NamedTuple):
    """One completion of a prompt, as the sampler drew it."""

    text: str  # the decoded completion; "" for a failed sample
    prompt_ids: list[int]
    token_ids: list[int]  # the completion's tokens, a final stop id included (as vLLM keeps it)
    logprobs: list[float]  # each token's, in the distribution it was drawn from (after top-p)
    finish_reason: str  # "stop", "length", or vLLM's "abort" or "error" (a failed sample)


class DrawnLogprobs:
    """A logits processor run after HF's warpers: it holds one step's log-probabilities until the
    next step shows which token was drawn."""

    def __init__(self):
        self.held = None  # the last step's log-probabilities, [batch, vocabulary]
        self.drawn = []  # the drawn tokens' log-probabilities, [batch, 1] a step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.held is not None:  # input_ids ends with the token drawn from the held step
            self.drawn.append(self.held.gather(1, input_ids[:, -1:]))
        self.held = scores.log_softmax(-1)
        return scores

    def finish(self, output_ids: torch.Tensor) -> list[list[float]]:
        self.drawn.append(self.held.gather(1, output_ids[:, -1:]))
        return torch.cat(self.drawn, 1).tolist()


class Sampler:
    """Samples with the weights last given to sync_weights: vLLM 0.25.1 (an engine a rank, asleep
    in training) or transformers."""

    def __init__(self, model_name, policy, tokenizer, dist, backend="auto", max_model_len=4096,
                 gpu_memory_utilization=0.5, sleep=True, batch_size=8, seed=0,
                 dtype="bfloat16"):  # fmt: skip
        self.tokenizer = tokenizer
        self.dist = dist
        self.max_model_len = max_model_len
        self.batch_size = batch_size  # sequences a transformers generate call
        self.model = None  # transformers: the model that generates
        self.llm = None  # vLLM: the engine
        self.asleep = False
        self.dtype = getattr(torch, dtype)
        self.sleep_enabled = sleep and torch.cuda.is_available()
        use_vllm = backend == "vllm"
        if backend == "auto" and torch.cuda.is_available():
            use_vllm = importlib.util.find_spec("vllm") is not None
        if use_vllm:
            self.start_vllm(model_name, gpu_memory_utilization, seed, dtype)
        elif dist.world_size > 1:
            # the ranks generate apart: a whole copy each (bf16 on GPUs), synced from the shards
            path = resolve_model(model_name)
            copy_dtype = torch.float32 if dist.device.type == "cpu" else self.dtype
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=copy_dtype)
        self.sync_weights(policy)  # the policy may come from a checkpoint, not from model_name

    def start_vllm(self, model_name, gpu_memory_utilization, seed, dtype):
        self.vllm = importlib.import_module("vllm")
        # vLLM's external launcher reads torchrun's variables: without torchrun, set them
        launcher = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost")
        launcher["MASTER_PORT"] = "29500"
        for name, value in launcher.items():
            os.environ.setdefault(name, value)
        if not torch.cuda.is_available():
            # CPU: no oneDNN repacking of the weights, so that load_weights works in place
            custom_ops = importlib.import_module("vllm._custom_ops")  # not loaded by `import vllm`
            custom_ops._supports_onednn = False
        rng = rng_state()
        torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free now
        self.llm = self.vllm.LLM(
            resolve_model(model_name),
            seed=seed + self.dist.rank,
            max_model_len=self.max_model_len,
            distributed_executor_backend="external_launcher",
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.sleep_enabled,
            logprobs_mode="processed_logprobs",  # log-probs after temperature and top-p
        )
        rng_state(rng)  # LLM() reseeds the global RNGs with the engine seed
        self.sleep()

    def sleep(self):
        # free the GPU for training: level 2 drops the weights and the KV cache
        if self.llm and self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def sync_weights(self, policy):
        if self.llm:
            if self.asleep:
                torch.cuda.empty_cache()  # vLLM wakes outside PyTorch's allocator: free its cache
                self.llm.wake_up(tags=["weights"])
            engine = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
            for item in full_state_dict_items(policy, self.dtype):  # one tensor at a time
                engine.load_weights([item])
            if self.asleep:
                self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
            self.llm.reset_prefix_cache()  # the cached prefixes were computed with the old weights
        elif self.dist.world_size > 1:
            own = self.model.to(self.dist.device).state_dict()
            for name, tensor in full_state_dict_items(policy, self.model.dtype):
                own[name].copy_(tensor)
        else:
            self.model = policy

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None,
                 desc="", logprobs=True) -> list[list[Sample]]:  # fmt: skip
        """n Samples for each prompt, a row a prompt (a prompt keeps its last max_model_len - 1)."""
        ids = [encode_prompt(self.tokenizer, p)[-self.max_model_len + 1 :] for p in prompts]
        if not ids:
            return []
        params = (n, temperature, top_p, max_new_tokens, stop, logprobs)
        if self.llm:
            return self.generate_vllm(ids, *params)
        return self.generate_hf(ids, *params, desc=desc)

    def generate_vllm(self, ids, n, temperature, top_p, max_new_tokens, stop, logprobs):
        assert not self.asleep, "vLLM slept at level 2: call sync_weights(policy) first"
        requests = []
        params = []
        for prompt_ids in ids:
            requests.append({"prompt_token_ids": prompt_ids})
            room = max(1, min(max_new_tokens, self.max_model_len - len(prompt_ids)))
            drawn_logprob = 0 if logprobs else None  # 0: the drawn token's alone
            sampling = dict(n=n, temperature=temperature, top_p=top_p, stop=stop, max_tokens=room)
            params.append(self.vllm.SamplingParams(**sampling, logprobs=drawn_logprob))
        outputs = self.llm.generate(requests, params, use_tqdm=self.dist.is_main)
        rows = []
        for prompt_ids, output in zip(ids, outputs):
            row = []
            for completion in output.outputs:
                reason = str(completion.finish_reason)
                text = completion.text
                if reason not in ("stop", "length"):  # abort or error: a failed sample
                    text = ""
                steps = zip(completion.logprobs or [], completion.token_ids)
                drawn = [step[token].logprob for step, token in steps]
                row.append(Sample(text, prompt_ids, list(completion.token_ids), drawn, reason))
            rows.append(row)
        return rows

    def generate_hf(self, ids, n, temperature, top_p, max_new_tokens, stop, logprobs, desc=""):
        tokenizer = self.tokenizer
        model = self.model
        was_training = model.training
        jobs = []
        for prompt_ids in ids:
            jobs.extend([prompt_ids] * n)
        # the tokenizer's and the model's stop ids (Gemma-2 stops at <eos> and <end_of_turn>)
        eos = model.generation_config.eos_token_id
        if not isinstance(eos, list):
            eos = [eos]
        stop_ids = sorted({tokenizer.eos_token_id, *eos} - {None})
        # HF's own warpers, given here (generate's own turned off) so that DrawnLogprobs runs last
        warpers = []
        if temperature > 0 and temperature != 1:
            warpers.append(TemperatureLogitsWarper(temperature))
        if temperature > 0 and top_p < 1:
            warpers.append(TopPLogitsWarper(top_p))
        settings = dict(do_sample=temperature > 0, temperature=1.0, top_k=0, top_p=1.0)
        settings.update(stop_strings=stop or None, tokenizer=tokenizer, eos_token_id=stop_ids)
        settings.update(pad_token_id=tokenizer.pad_token_id)
        samples = []
        starts = range(0, len(jobs), self.batch_size)
        for start in tqdm(starts, desc=desc, leave=False, disable=not self.dist.is_main):
            batch_ids = jobs[start : start + self.batch_size]
            batch = tokenizer.pad({"input_ids": batch_ids}, return_tensors="pt").to(model.device)
            width = batch.input_ids.shape[1]
            recorder = DrawnLogprobs()
            processors = list(warpers)
            if logprobs:
                processors.append(recorder)
            room = max(1, min(max_new_tokens, self.max_model_len - width))
            model.eval()
            output_ids = model.generate(
                **batch, **settings, max_new_tokens=room, logits_processor=processors
            )
            batch_logprobs = [[]] * len(output_ids)
            if logprobs:
                batch_logprobs = recorder.finish(output_ids)
            for row, tokens in enumerate(output_ids[:, width:].tolist()):
                drawn = batch_logprobs[row]
                samples.append(self.hf_sample(batch_ids[row], tokens, drawn, stop_ids, stop))
        model.train(was_training)
        return [samples[i * n : (i + 1) * n] for i in range(len(ids))]

    def hf_sample(self, prompt_ids, tokens, logprobs, stop_ids, stop) -> Sample:
        """A row as vLLM returns it: no padding, up to a stop id (kept) or string (dropped)."""
        # padding after a stop string: the batch ran on
        while tokens and tokens[-1] == self.tokenizer.pad_token_id and tokens[-1] not in stop_ids:
            tokens.pop()
        end = len(tokens)
        for position, token in enumerate(tokens):
            if token in stop_ids:
                end = position + 1
                break
        text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        reason = "length"
        if tokens and tokens[end - 1] in stop_ids:
            reason = "stop"
        found = [text.find(s) for s in stop or [] if s in text]
        if found:
            text = text[: min(found)]
            reason = "stop"
        return Sample(text, prompt_ids, tokens[:end], logprobs[:end], reason)


def sample_shard(sampler, prompts: list[str], n: int, key, dist=None, calls=1, **params) -> dict:
    """This rank's {prompt index: n Samples}, the same on any number of ranks: transformers draws
    chunks of its batch seeded by crc32(f"{key}/{start}") (a list: a key a prompt), vLLM a rank's
    share in `calls` calls; the chunks go round the ranks (dist None: all here)."""
    if dist is None:
        dist = Dist(0, 1, 1, torch.device("cpu"), True)  # this process draws every chunk
    one_key_a_prompt = isinstance(key, list)
    if sampler.llm:
        size = max(1, math.ceil(len(prompts) / (dist.world_size * calls)))
    elif one_key_a_prompt:
        size = 1
    else:
        size = max(1, sampler.batch_size // n)
    shard = {}
    for start in range(0, len(prompts), size)[dist.rank :: dist.world_size]:
        seed_key = key[start] if one_key_a_prompt else f"{key}/{start}"
        torch.manual_seed(zlib.crc32(seed_key.encode()))
        rows = sampler.generate(prompts[start : start + size], n=n, **params)
        for offset, row in enumerate(rows):
            shard[start + offset] = row
    return shard


def sample(sampler, prompts: list[str], n: int, key, dist=None, calls=1, **params) -> list:
    """n Samples for each prompt, a row a prompt, every rank's share gathered (see sample_shard)."""
    shard = sample_shard(sampler, prompts, n, key, dist=dist, calls=calls, **params)
    return gather_shard(shard, dist)


def token_logprobs(policy, samples: list[Sample], temperature=1.0, top_p=1.0, with_entropy=False,
                   entropy_grad=False, chunk=512):  # fmt: skip
    """(logp, mask, entropy), [B, T]: each completion token's log-prob at the sampling temperature
    and top-p (0 at padding), and entropy (None unless with_entropy; detached, so that a loss term
    on it trains nothing, unless entropy_grad). The head runs in the forward on completion
    positions, `chunk` at a time in fp32, again in backward: no [B, T, V] logits."""
    prompt_width = max(len(s.prompt_ids) for s in samples)  # P
    width = max(max(len(s.token_ids) for s in samples), 1)  # T
    rows = []
    for s in samples:  # prompts padded on the left, completions on the right, with -1
        padding = (prompt_width - len(s.prompt_ids), width - len(s.token_ids))
        sequence = torch.tensor(s.prompt_ids + s.token_ids)
        rows.append(torch.nn.functional.pad(sequence, padding, value=-1))
    ids = torch.stack(rows).to(next(policy.parameters()).device)  # [B, P + T]
    mask = (ids >= 0).float()
    ids = ids.clamp(min=0)
    head = policy.get_output_embeddings()
    softcap = getattr(policy.config.get_text_config(), "final_logit_softcapping", None)  # Gemma-2

    def chunk_logprobs(hidden, target):
        """A chunk of positions, in fp32: the target's log-prob, and the entropy (or logp again)."""
        logits = head(hidden).float()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if softcap or temperature != 1:
            logits.div_(temperature)
        if top_p < 1:
            # drop what HF's and vLLM's top-p drop (ascending cumsum <= 1 - p), never the target
            sorted_logits, order = logits.sort(-1)
            tail = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
            dropped = tail.scatter(-1, order, tail).scatter(-1, target[:, None], False)
            logits = logits.masked_fill(dropped, -1e30)
        # cross_entropy's backward is one fused kernel
        logp = -torch.nn.functional.cross_entropy(logits, target, reduction="none")
        if not with_entropy:
            return logp, logp
        entropy = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)
        return logp, entropy

    def head_in_forward(module, hook_args, hook_kwargs, output):
        """A forward hook, before FSDP2's post-forward hook reshards the head: output.logits becomes
        [B, T, 2], each completion token's log-prob and entropy."""
        # the hidden state before a completion token predicts it (the last one is after the norm)
        hidden = output.hidden_states[-1][:, prompt_width - 1 : prompt_width + width - 1]
        targets = ids[:, prompt_width:].flatten()
        checkpoint = torch.utils.checkpoint.checkpoint
        parts = []
        for part, target in zip(hidden.flatten(0, 1).split(chunk), targets.split(chunk)):
            parts.append(checkpoint(chunk_logprobs, part, target, use_reentrant=False))
        logp = torch.cat([logp for logp, _ in parts]).view(len(samples), width)
        entropy = torch.cat([entropy for _, entropy in parts]).view(len(samples), width)
        output.logits = torch.stack([logp, entropy], -1)
        output.hidden_states = None
        return output

    hook = policy.register_forward_hook(head_in_forward, with_kwargs=True, prepend=True)
    positions = (mask.cumsum(1) - 1).clamp(min=0).long()
    no_position = ids[0, :0]  # the model's own head computes nothing
    try:
        output = policy(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                        output_hidden_states=True, logits_to_keep=no_position)  # fmt: skip
    finally:
        hook.remove()
    logp = output.logits[..., 0]
    entropy = output.logits[..., 1]
    mask = mask[:, prompt_width:]
    if not with_entropy:
        return logp * mask, mask, None
    if not entropy_grad:
        entropy = entropy.detach()
    return logp * mask, mask, entropy * mask


def train_step(model, optimizer, batch: list, loss_fn, micro_batch_size: int, max_grad_norm: float,
               dist: Dist, length=None, lr: float | None = None) -> dict[str, float]:  # fmt: skip
    """One optimizer step, each rank on its micro_batches. loss_fn(micro) -> (loss, stats), the
    loss over the whole batch's denominator; FSDP2 averages over ranks, so backward scales by the
    world size. Returns the summed "loss" and stats, and "grad_norm"."""
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    sums = collections.Counter()
    for micro, real in micro_batches(batch, micro_batch_size, dist, length):
        loss, stats = loss_fn(micro)
        scale = dist.world_size if real else 0.0  # padding runs for FSDP2's collectives only
        (loss * scale).backward()
        if real:
            sums.update({"loss": loss.item(), **stats})  # update adds (negative sums too)
    trainable = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts = all_gather_objects(dict(sums), dist)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    totals = {}
    for name in sorted(set().union(*parts)):
        totals[name] = sum(part.get(name, 0.0) for part in parts)
    totals["grad_norm"] = float(norm)
    return totals


def lr_at(step: int, total: int, peak: float, warmup=0, schedule="constant") -> float:
    """Step `step` of `total`'s learning rate in transformers' schedules (HF Trainer, TRL): linear
    warm-up from 0 over `warmup` steps, then constant, or a linear or cosine decay to 0."""
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "constant":
        decay = 1.0
    elif schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        known = "constant, linear, cosine"
        raise ValueError(f"--lr-schedule {schedule}: lr_at knows {known}; add its decay there")
    if step < warmup:
        return peak * (step / warmup)
    return peak * max(0.0, decay)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n samples, c correct (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def rng_state(state: tuple | None = None) -> tuple:
    """The RNG states of Python, NumPy, torch and CUDA (False without); set first if given."""
    if state is not None:
        python_state, numpy_state, torch_state, cuda_state = state
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_state:
            torch.cuda.set_rng_state_all(cuda_state)
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else False
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda_state


def save_checkpoint(run_dir, iteration: int, models: dict, tokenizer, state, dist: Dist, keep=2):
    """checkpoints/iter_XXXXXX/: per {name: (model, optimizer or None)} DCP shards and an HF
    directory (bf16 on GPUs); state.pt: the run's state and every rank's RNGs."""
    root = pathlib.Path(run_dir) / "checkpoints"
    export_dtype = torch.bfloat16 if dist.device.type == "cuda" else None
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp_iter_{iteration:06d}"
    tmp.mkdir(parents=True, exist_ok=True)  # what a crashed save left there is overwritten
    rngs = all_gather_objects(rng_state(), dist)
    for name, (policy, optimizer) in models.items():
        model_state, optim_state = get_state_dict(policy, optimizer or ())
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp / f"{name}.dcp")
        weights = {}
        for key, tensor in full_state_dict_items(policy, export_dtype):  # every rank gathers
            if dist.is_main:
                weights[key] = tensor.cpu()
        if dist.is_main:
            policy.config.dtype = export_dtype or policy.config.dtype
            policy.save_pretrained(tmp / name, state_dict=weights)
            tokenizer.save_pretrained(tmp / name)
    if dist.is_main:
        torch.save({"iteration": iteration, "state": state, "rng": rngs}, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # so that the newest iter_* directory is always whole
        for old in sorted(root.glob("iter_*"))[:-keep]:
            shutil.rmtree(old)
    all_gather_objects(None, dist)  # a barrier: no rank goes on before the checkpoint is whole


def load_checkpoint(run_dir, models: dict, dist: Dist):
    """Restore the newest checkpoint (rank 0's pick) into `models`, strictly, and the RNGs; returns
    (iterations done, state), or None without a checkpoint."""
    newest = max((pathlib.Path(run_dir) / "checkpoints").glob("iter_*"), default=None)
    path = all_gather_objects(newest, dist)[0]
    if path is None:
        return None
    for name, (policy, optimizer) in models.items():
        model_state, optim_state = get_state_dict(policy, optimizer or ())
        loaded = {"model": model_state, "optim": optim_state}
        dcp.load(loaded, checkpoint_id=path / f"{name}.dcp")
        set_state_dict(policy, optimizer or (), model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])  # fmt: skip
    saved = torch.load(path / "state.pt", weights_only=False)
    rng_state(saved["rng"][dist.rank % len(saved["rng"])])  # exact with the same world size
    if dist.is_main:
        print(f"resuming {run_dir} after iteration {saved['iteration']}")
    return saved["iteration"], saved["state"]


class Logger:
    """CleanRL-style metrics on rank 0: to metrics.jsonl, the console and (--track) wandb.
    `with logger.timer(phase)` adds the phase's seconds to the next log, as time/<phase>;
    logger.times holds them until log() writes and resets them (a phase's wall time so far)."""

    def __init__(self, run_dir, config, dist: Dist, track=False, project="selfplay", entity=None):
        self.run_dir = pathlib.Path(run_dir)
        self.main = dist.is_main
        self.times = collections.Counter()  # seconds per phase since the last log
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.main:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.wandb = None
        if track and self.main:  # the wandb run finishes at exit
            names = dict(project=project, entity=entity, name=self.run_dir.name)
            self.wandb = wandb.init(**names, config=config, dir=run_dir)

    @contextlib.contextmanager
    def timer(self, phase: str):
        start = time.perf_counter()
        yield
        self.times[f"time/{phase}"] += time.perf_counter() - start

    def log(self, metrics: dict, step: int) -> None:
        metrics = {**metrics, **self.times}
        self.times = collections.Counter()
        if not self.main:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
        shown = [f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)]
        tqdm.write(f"[{step}] " + " ".join(shown))
        if self.wandb:
            self.wandb.log(metrics, step=step)


def with_cpu_defaults(args_class, cpu_defaults: dict):
    """Without CUDA, a subclass of args_class named Args whose defaults are cpu_defaults: --help
    shows them, and Args(...) in Python takes them as the command line does."""
    if torch.cuda.is_available():
        return args_class
    fields = []
    for name, value in cpu_defaults.items():
        default = dataclasses.field(default=value)
        if isinstance(value, (list, dict, set)):  # mutable: each Args gets a copy of its own
            default = dataclasses.field(default_factory=value.copy)
        fields.append((name, args_class.__dataclass_fields__[name].type, default))
    cpu_class = dataclasses.make_dataclass("Args", fields, bases=(args_class,))
    cpu_class.__module__ = args_class.__module__  # pickle and tyro find it where Args was
    return cpu_class


Args = with_cpu_defaults(Args, CPU_DEFAULTS)  # without CUDA, the sizes of CPU_DEFAULTS (after Args)


# ---- end of infrastructure ----


if __name__ == "__main__":
    main(tyro.cli(Args))
