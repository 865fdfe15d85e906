"""CoProver: a GRPO prover co-trained with a value model that guides best-first search in Lean 4.

Source: the CoProver code release (github.com/kanav9063/CoProver at afcc317, README "Co-Training
Proof Generation and Search Heuristics"; no paper, no results; "Proprietary" licence: nothing
copied). The release is a scaffold whose pieces are not wired together: slime (THUDM's RL trainer:
Megatron for training, SGLang for sampling), kimina-lean-server (Lean 4 checks over HTTP) and
ReProver (LeanDojo's tactic prover and its search; LeanDojo drives Lean's tactic mode from
Python). Here: the method its README describes, end to end.

Method. The PROVER (DeepSeek-Prover-V2-7B) writes whole proofs and, asked for one step, tactics.
The VALUE MODEL (Llama-3.2-1B, a scalar head on the last token) estimates V(s): how close the
proof state s is to QED, in (0, 1). Best-first search keeps a queue of the proof states found so
far and expands the best one: the prover proposes K tactics for it, Lean applies each, the new
states join the queue. The value model's labels (its regression targets) fall with the number of
tactics from a state to QED, by a discount gamma < 1 a tactic (`value_label`). GRPO (Group
Relative Policy Optimization, DeepSeekMath) samples a group of whole proofs per statement and
rates each by its reward against its group's (`grpo_advantages`), with no critic. Each iteration
(the README's round):
  1. search: best-first search over Lean's tactic mode (`best_first_search`), each state ranked by
     `priority` (--priority's rule of the path's tactic log-prob and V; without V, ReProver's);
  2. labels: `value_labels` on the states of each proof found (by the search, or a whole proof of
     step 4 Lean accepted, replayed by `whole_proof_labels`), 0 on expanded states off every proof
     path and on the roots of failed whole proofs;
  3. value: regression of V (`value_loss_rule`) on the labels of ALL iterations (`update_value`):
     this iteration's search labels, and the labels made in step 4 of the earlier iterations
     (those of this iteration's step 4 reach V in the next step 3 that runs: with co-training,
     the next iteration's; otherwise they are only logged and checkpointed);
  4. prover: GRPO on whole proofs (`grpo_round`; `grpo_examples`, its batch filter `in_batch`;
     `update`, which runs what `adds_gradient` keeps): reward `proof_reward`, no KL penalty, DAPO's
     clip-higher (`clip_higher_loss`: PPO's clip of the ratio pi / pi_old, pi_old the policy
     that sampled, wider above 1 than below) on the "frontier" statements: those the prover
     proves sometimes but not always (`frontier_filter`, once before the first iteration);
  5. eval: pass@1/8/32 on miniF2F-test, and search efficiency with and without V (`evaluate`).
pass@k: the chance that one of k samples is a proof (`pass_at_k`); a search is one sample, so
search/pass@1 is the share of the searched theorems proved.
Metrics (metrics.jsonl, step = iterations done): search/*, value/*, losses/*, charts/*, lean/*,
eval/*, time/*.
Records: lean_verify's Problem(id, header, statement), a theorem; TacticState, a proof state
(goals, status, the tactics from the root; key: its goals); Triple(state, tactic, target), a
proof step (the state before the tactic, the tactic, the state after it). The infrastructure
block at the end defines Sample(text, prompt_ids, token_ids, logprobs, finish_reason), one
completion as the sampler drew it, and Dist(rank, world_size, local_world_size, device,
is_main, objects), where this process stands among torchrun's.

Run. Without CUDA, Args' defaults are CPU_DEFAULTS (a loop sized for a laptop; the run prints
them), so `python <this file>` and `main(Args())` run it alike and a value given keeps it;
`torchrun --nproc_per_node 8 <this file>` runs the full sizes; `--iterations 0` evaluates
the given model. Both need Lean: `bash setup.sh --lean`, or for a CPU smoke run the stand-in REPL,
LEAN_REPL_CMD="python tests/fake_lean_repl.py", which follows the tactic table of
data/lean_tactics.jsonl. Experiment map: README.md.

Sources (the official files the code's "official" refers to): the search, value_guided_search.py
(priority), co_train.py (search budget, evaluation cadence) and lean_generate.py (tactic length);
the value model, value_model.py (head, loss), train_value_model.py, prepare_value_data.py,
configs/value_model_sft.yaml and train_value_slime.sh (training, truncation, schedule); the
prover, train_step_grpo.sh and configs/generator_grpo.yaml (GRPO), lean_reward.py (reward);
configs/co_training.yaml (iterations, theorems per round, oversampling); filter_dataset.py
(frontier); evaluate.py (evaluation).

Deliberate deviations:
  1. Lean through lean_verify's REPL tactic mode, not LeanDojo: states merge by goals, a found
     proof is checked whole.
  2. Priority exp(mean token log-prob of the path), in (0, 1] like V, not
     value_guided_search.py's cumulative log-prob.
  3. Searches run in lockstep, --search-batch theorems per rank (default one per REPL): one
     sampling call for every live theorem's node (vLLM's throughput needs batched calls); each
     theorem is charged the model calls it waits for, its own tactics and kernel checks
     (--search-batch 1: its wall clock). The search runs (no official script calls it); K
     distinct sampled tactics, not beam; log-prob only before any V.
  4. Labels per state, from search and GRPO's rollouts (official: own samples' roots, 0.95^lines
     or 0; --value-labels).
  5. The reward is lean_verify's verdict, not kimina's (warnings allowed): lean_reward.py fails
     warnings, pays timeouts.
  6. The frontier counts proofs Lean accepts (filter_dataset.py: kimina non-responses); bounds
     1..6 of 8 (its code: 7).
  7. V is value_model.py's scalar head trained by regression (the official scripts fine-tune the
     LM to print V as text).
  8. 100 GRPO steps per iteration (num_rollout 500 / 5 rounds); pi_old: the sampler's log-probs
     (slime recomputes them).
  9. Search theorems are the training statements, in the whole-proof prompt (official: LeanDojo's,
     "[GOAL] ...").
 10. No value_reward.py format bonus, as train_step_grpo.sh (lean_reward.compute_reward).
 11. Evaluation: 32 samples (co_train.py: 8) under Lean's 60 s (evaluate.py: 120 s); no
     PutnamBench (--eval-dataset).
 12. --no-co-training trains V in the first iteration only; the README's "independent training" is
     not offered.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
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
import safetensors.torch
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
    extract_last_block,
    load_problems,
    proof_from_tactics,
    proof_tactics,
)


@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed> unless
    --run-name)"""
    seed: int = 1
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
    model: str = "deepseek-ai/DeepSeek-Prover-V2-7B"
    """the prover: a Hugging Face id, a local path, or embedded:smollm2 (the CPU default)"""
    value_backbone: str = "meta-llama/Llama-3.2-1B"
    """the value model's LM (any causal LM; a coprover checkpoint's value/ directory brings its
    head too)"""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """sampler: vLLM when CUDA and vllm are present (auto), else transformers"""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of GPU memory (it sleeps while the policy trains)"""
    vllm_sleep: bool = True
    """put vLLM to sleep during training (level 2) and wake it with fresh weights"""
    max_model_len: int = 8192
    """longest prompt + completion, in tokens"""
    gradient_checkpointing: bool = True
    """activation checkpointing in training"""

    # data
    dataset: str = "AI-MO/Kimina-Prover-Promptset"  # prepare_minif2f.py
    """the problems to train on: a Hugging Face dataset, a .jsonl or a .json
    (lean_verify.load_problems)"""
    num_problems: int | None = None
    """use only the first N problems of --dataset (default all)"""

    # algorithm
    iterations: int = 5  # official
    """iterations to run (the README's word: rounds); 0: no training, evaluate the given model"""
    search_theorems_per_round: int = 5000
    """theorems searched each iteration (official num_theorems_per_round)"""

    # search (official)
    num_sampled_tactics: int = 32
    """K: tactics sampled per expansion (official num_sampled_tactics; duplicates run once)"""
    max_expansions: int | None = 128
    """expansions per theorem (None: only the clock limits a search)"""
    search_timeout: float = 300.0  # official
    """seconds per theorem (the search's budget, read before each tactic)"""
    search_temperature: float = 0.8
    """tactic sampling temperature (the official collector's)"""
    tactic_max_new_tokens: int = 256  # official
    """longest tactic"""
    lean_timeout: float = 60.0
    """Lean's wall-clock limit per whole proof and per tactic, in seconds (official)"""
    lean_workers: int | None = None
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of
    the machine)"""
    search_batch: int | None = None
    """theorems searched in lockstep on each rank (`search`; default: the rank's REPL pool size;
    1: one theorem at a time, charged its wall clock)"""
    alpha: float = 0.3
    """the weight of the path's log-prob against V(s), in [0, 1], in --priority's rule
    (weighted_priority: official)"""
    priority: Literal["weighted"] = "weighted"
    """how a node's path log-prob and V(s) rank it in the search (priority_rule, from
    PRIORITIES: weighted_priority, the official mix normalised: deviation 2)"""

    # value model (official)
    gamma: float = 0.95
    """the discount of the value labels (`value_label`)"""
    value_labels: Literal["state", "root"] = "state"
    """which states of a proof get labels besides the root: every state (README) or none (the
    official collector); value_label_rule, from VALUE_LABELS"""
    value_loss: Literal["squared_error"] = "squared_error"
    """the value model's regression loss (value_loss_rule, from VALUE_LOSSES)"""
    positive_oversample: int = 3
    """positive labels are repeated this many times (official oversample_positive)"""
    value_epochs: int = 3
    """epochs over all labels so far, each iteration"""
    value_batch_size: int = 64
    """states per optimizer step"""
    value_max_length: int = 512
    """a state's prompt keeps its last this many tokens (official)"""
    freeze_value_backbone: bool = False
    """train only the head (off by default: the whole LM trains, as the official SFT scripts
    train it)"""
    value_learning_rate: float = 2e-5
    """peak learning rate of the value model"""
    # over each iteration's value training
    value_lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """learning-rate schedule after the warm-up (lr_at)"""
    value_warmup_steps: int = 10
    """linear warm-up steps from 0"""
    value_micro_batch_size: int = 8
    """states per forward/backward on each rank (and per scoring batch in search)"""

    # prover GRPO (official)
    grpo_steps_per_round: int = 100
    """rollout batches per iteration (num_rollout 500 over 5 rounds)"""
    prompts_per_step: int = 64
    """prompts per rollout batch (rollout_batch_size)"""
    samples_per_prompt: int = 8
    """samples per prompt (n_samples_per_prompt)"""
    temperature: float = 1.0
    """rollout temperature"""
    max_new_tokens: int = 4096
    """rollout_max_response_len"""
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    """the advantage estimator of a group's rewards (advantage_estimator, from ADVANTAGES: official
    grpo_advantages)"""
    eps_clip: float = 0.2
    """PPO clip below 1 (`clip_higher_loss`)"""
    eps_clip_high: float = 0.28
    """PPO clip above 1 (DAPO clip-higher, `clip_higher_loss`)"""
    grpo_minibatches: int = 1
    """optimizer steps per rollout batch (global_batch_size 512 = one)"""
    frontier_filter: bool = True
    """keep the training statements with frontier_min..frontier_max of 8 samples proved
    (`frontier_filter`, official)"""
    frontier_samples: int = 8
    """samples per statement in the filter"""
    frontier_temperature: float = 0.8
    """the filter's sampling temperature"""
    frontier_min: int = 1
    """fewest passes kept"""
    frontier_max: int = 6
    """most passes kept"""
    learning_rate: float = 1e-6
    """peak learning rate"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # over all rollout batches
    """learning-rate schedule after the warm-up (lr_at)"""
    warmup_steps: int = 0  # rollout batches
    """linear warm-up steps from 0"""
    weight_decay: float = 0.01
    """AdamW weight decay (both models)"""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas (both models)"""
    micro_batch_size: int = 4
    """sequences per forward/backward on each rank"""
    max_grad_norm: float = 1.0  # both models
    """gradient clipping"""

    # ablations
    value_model: bool = True
    """guide the search with the value model (--no-value-model: log-prob-only best-first search,
    no value model)"""
    co_training: bool = True
    """train the value model every iteration (--no-co-training: only in the first iteration that
    has labels; the prover trains alone after it)"""

    # evaluation
    eval_dataset: str = "data/minif2f.jsonl"
    """benchmark (lean_verify.load_problems: miniF2F's name, split, header, formal_statement)"""
    eval_split: str | None = "test"
    """which split of the benchmark (None: all rows)"""
    eval_limit: int | None = None
    """use only the first N benchmark problems"""
    eval_every: int = 1  # official phase 4
    """evaluate every this many iterations and after the last (0: only after the last)"""
    eval_samples: int = 32
    """whole-proof samples per benchmark problem"""
    eval_budgets: tuple[int, ...] = (1, 8, 32)
    """k of the reported pass@k"""
    eval_temperature: float = 0.8
    """evaluation sampling temperature (official)"""
    eval_search_limit: int | None = None
    """benchmark problems searched with and without the value model (default all; 0: none)"""


# Without CUDA the full sizes would take weeks; these run an iteration on 2 cores in minutes
# (SmolLM2-135M samples ~60 tokens/s in a batch of 8; a training step on 8 x 384 tokens takes
# ~30 s). The value model trains its head only: a trained backbone's gradients and AdamW moments
# (1.6 GB in fp32) would take the run past a laptop's 4 GB.
CPU_DEFAULTS = dict(
    model="embedded:smollm2",
    value_backbone="embedded:smollm2",
    dataset="data/lean_tactics.jsonl",
    iterations=2,
    search_theorems_per_round=5,
    num_sampled_tactics=4,
    max_expansions=3,
    tactic_max_new_tokens=24,
    freeze_value_backbone=True,
    value_epochs=1,
    value_batch_size=16,
    value_micro_batch_size=8,
    value_max_length=256,
    grpo_steps_per_round=1,
    prompts_per_step=4,
    samples_per_prompt=4,
    max_new_tokens=64,
    learning_rate=1e-5,
    frontier_filter=False,
    max_model_len=1024,
    eval_limit=2,
    eval_samples=4,
    eval_budgets=(1, 2, 4),
    eval_search_limit=2,
)


# ---- prompts ----
# The prover's whole-proof prompt: DeepSeek-Prover-V2's non-CoT format as the official data prep
# writes it (a raw completion, no chat template); the answer is a new ```lean4 block with the
# whole theorem.
PROVER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}{statement}\n```\n"
# Search asks the same prover for one step: its answer block prefilled with the tactics so far and
# the goals in a comment (DeepSeek-Prover-V1.5's tactic-state comments); the tactic is the next
# line. The prompt ends at the newline, on a token boundary of DeepSeek's training text (one
# ending in "\n  " ends on an indentation token it rarely saw).
TACTIC_PROMPT = PROVER_PROMPT + "```lean4\n{header}{proof}\n  /- tactic state:\n{goals}\n  -/\n"
# The value model reads a proof state in this frame; its head reads the hidden state of the last
# token.
VALUE_PROMPT = "Lean 4 proof state:\n{state}\n\nHow close is this state to a finished proof?"
# LeanDojo's state after the tactic that closes the proof (a proof path's last Triple)
NO_GOALS = "no goals"


# ---- data ----
# A theorem is lean_verify's Problem(id, header, statement), as load_problems reads them from a
# dataset (miniF2F's fields; Kimina-Prover-Promptset's formal_statement, whose text before the
# declaration is its header).
def rollout_prompts(
    problems: list[Problem], batch_index: int, size: int, seed: int
) -> list[Problem]:
    """The statements of GRPO rollout batch `batch_index` (slime --rollout-shuffle): the batches run
    through epochs of the statements, each epoch in its own seeded order (so a batch that spans
    two epochs may hold a statement twice)."""
    n = len(problems)
    orders = {}  # epoch -> its order of the statements' indices
    batch = []
    for j in range(batch_index * size, (batch_index + 1) * size):
        epoch = j // n
        if epoch not in orders:
            orders[epoch] = random.Random(f"{seed}/epoch{epoch}").sample(range(n), n)
        batch.append(problems[orders[epoch][j % n]])
    return batch


# ---- rewards ----
def accepted(result) -> bool:
    """Whether Lean accepted a whole proof: valid, and a timeout fails (deviation 5). result:
    lean_verify's LeanResult(valid, status, errors, reason, time, ...)."""
    return result.valid and result.status == "valid"


def proof_reward(attempt: Attempt, args: Args) -> float:
    """GRPO's reward of a rollout (official): 1 iff Lean accepted the whole proof
    (attempt.correct), else 0. grpo_examples' advantages and charts/reward_mean read it; a
    reward term reads the Attempt (its Sample's tokens, its proof, Lean's seconds)."""
    if attempt.correct:
        return 1.0
    return 0.0


def grpo_advantages(
    rewards: list[float], args: Args | None = None, eps: float = 1e-6
) -> list[float]:
    """GRPO's advantage of each of a prompt's samples (slime, grpo_std_normalization):
        A_i = (r_i - mean(r)) / (std(r) + eps),
    the std with Bessel's correction (torch's default; 0 for a single sample). All-equal rewards
    give 0: no gradient (no dynamic sampling). args: unread (an estimator's hyper-parameters
    come from there)."""
    r = np.asarray(rewards, dtype=np.float64)
    std = 0.0
    if len(r) > 1:
        std = r.std(ddof=1)
    advantages = (r - r.mean()) / (std + eps)
    return advantages.tolist()


def dr_grpo_advantages(rewards: list[float], args: Args | None = None) -> list[float]:
    """Dr. GRPO's advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training"), the group
    mean subtracted and no division by the std:
        A_i = r_i - mean(r).
    (Its other change, no per-response length normalisation, is clip_higher_loss's token sum
    over the batch's tokens already.)"""
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()).tolist()


# --advantage's choices: a new one is its function above and an entry here
ADVANTAGES = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages}


def advantage_estimator(args: Args):
    """--advantage's estimator, `(rewards of a group, args) -> advantages`, from ADVANTAGES:
    grpo_examples reads it, check_choices calls it at start."""
    if args.advantage not in ADVANTAGES:
        raise ValueError(
            f"--advantage {args.advantage}: add its entry to ADVANTAGES (a function from a "
            "group's rewards and args to their advantages, as grpo_advantages)"
        )
    return ADVANTAGES[args.advantage]


def value_label(steps_left: int, gamma: float) -> float:
    """The value model's target for a state d = steps_left tactics before QED (README "gamma^d
    scoring"): gamma^d, so that V(s) ranks states by their distance to a proof."""
    return gamma**steps_left


def every_state(depth: int) -> bool:
    """--value-labels state (README): every state of a proof path below the root is labelled."""
    return True


def root_only(depth: int) -> bool:
    """--value-labels root (the official collector): no state below the root is labelled."""
    return False


# --value-labels' choices: a new one is its function above and an entry here
VALUE_LABELS = {"state": every_state, "root": root_only}


def value_label_rule(args: Args):
    """--value-labels' predicate, `(depth) -> bool`: whether a state `depth` tactics below the
    root (depth >= 1) gets its label; the root always does. From VALUE_LABELS: search_result and
    whole_proof_labels read it, check_choices calls it at start."""
    if args.value_labels not in VALUE_LABELS:
        raise ValueError(
            f"--value-labels {args.value_labels}: add its entry to VALUE_LABELS (a predicate "
            "on a state's depth below the root, as every_state)"
        )
    return VALUE_LABELS[args.value_labels]


def value_labels(expanded: list, proof_paths: list[list], gamma: float) -> dict:
    """The labels of a search, {state key: label}: a state on a proof path (the states before its
    tactics, root first) gets the value_label of its tactics left (the nearest QED when on
    several), every other expanded state 0."""
    labels = dict.fromkeys(expanded, 0.0)
    for path in proof_paths:
        for i, key in enumerate(path):
            label = value_label(len(path) - i, gamma)
            labels[key] = max(labels.get(key, 0.0), label)
    return labels


def weighted_priority(node: Node, value: float, args: Args) -> float:
    """--priority weighted (official value_guided_search.py, normalised: deviation 2): from the
    summed log-prob node.logprob of the node.tokens tactic tokens on its path and V(s),
        alpha * exp(logprob / tokens) + (1 - alpha) * V(s),
    both terms in [0, 1] (the first is the geometric-mean probability of the path's tokens)."""
    mean_logprob = node.logprob / max(node.tokens, 1)
    return args.alpha * math.exp(mean_logprob) + (1 - args.alpha) * value


# --priority's choices: a new one is its function above and an entry here
PRIORITIES = {"weighted": weighted_priority}


def priority_rule(args: Args):
    """--priority's rule, `(node, V(s), args) -> priority`, from PRIORITIES: priority reads it,
    check_choices calls it at start."""
    if args.priority not in PRIORITIES:
        raise ValueError(
            f"--priority {args.priority}: add its entry to PRIORITIES (a function of a Node and "
            "its V(s), as weighted_priority)"
        )
    return PRIORITIES[args.priority]


def priority(node: Node, value: float | None, args: Args) -> float:
    """A node's priority in the best-first search, the one place the search ranks a node
    (end_expansion, once V has scored it): with a value model, --priority's rule (priority_rule;
    official weighted_priority); without one (value None: --no-value-model, the search before
    V's first training, eval's log-prob search), ReProver's: the path's cumulative log-prob
    node.logprob. A rule reads the Node (its path: node_path; its Edge) and a flag."""
    if value is None:
        return node.logprob
    rule = priority_rule(args)
    return rule(node, value, args)


# ---- losses ----
def clip_higher_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    n_tokens: int,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO's token-level clipped objective (slime compute_policy_loss with
    --calculate-per-token-loss; no KL), and the number of tokens the clip held back:
        loss = -(1 / n_tokens) sum_{i,t} min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i),
        r_it = pi(y_it) / pi_old(y_it).
    Clip-higher: eps_high > eps_low lets a token's probability rise further than it may fall
    before the clip holds it. logp, old_logp, mask: [B, T]; advantages: [B]; n_tokens: the
    optimizer batch's tokens, all ranks."""
    ratio = torch.exp(logp - old_logp)  # [B, T]
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    unclipped = ratio * advantages[:, None]
    clipped = clipped_ratio * advantages[:, None]
    objective = torch.minimum(unclipped, clipped)
    loss = -(objective * mask).sum() / n_tokens
    held_back = ((clipped < unclipped).float() * mask).sum()
    return loss, held_back


def squared_error_loss(
    values: torch.Tensor, labels: torch.Tensor, args: Args | None = None
) -> torch.Tensor:
    """The value model's regression loss (official): the squared errors of V(s) against the
    labels, summed, not averaged (update_value divides by the batch's labels). values (V(s),
    after the head's sigmoid), labels: [B]. args: unread (a loss's hyper-parameters come from
    there)."""
    return ((values - labels) ** 2).sum()


# --value-loss' choices: a new one is its function above and an entry here
VALUE_LOSSES = {"squared_error": squared_error_loss}


def value_loss_rule(args: Args):
    """--value-loss' loss, `(values [B], labels [B], args) -> the loss summed over the batch`
    (not its mean: update_value divides by the batch's labels), from VALUE_LOSSES: update_value
    reads it, check_choices calls it at start."""
    if args.value_loss not in VALUE_LOSSES:
        raise ValueError(
            f"--value-loss {args.value_loss}: add its entry to VALUE_LOSSES (a function of V's "
            "values and the labels, summed over the batch, as squared_error_loss)"
        )
    return VALUE_LOSSES[args.value_loss]


def loss_metrics(history: list[dict], prefix: str = "") -> dict[str, float]:
    """An update's losses/ metrics: each stat of its optimizer steps (train_step's, summed over
    the micro-batches) averaged over the steps, as losses/<prefix><name>."""
    metrics = {}
    for name in history[0]:
        metrics[f"losses/{prefix}{name}"] = float(np.mean([h[name] for h in history]))
    return metrics


# ---- phases ----
# the roles a search charges its seconds to (SearchResult.role_seconds)
ROLES = ("prover", "value", "env")


# The search's records, the same in coprover.py and rir.py. A proof step is lean_verify's
# Triple(state, tactic, target): the state before the tactic, the tactic, the state after it.
class Edge(NamedTuple):
    """A proposed step from the node an expansion expands."""

    tactic: str | None  # None: a sample that is no tactic (a failed edge, never run)
    logprob: float  # log p(y | ...): the tactic's summed token log-probs
    tokens: int  # the tactic's tokens (0: no tactic)
    target: str | None = None  # rir's target state s* (None here)
    target_logprob: float = 0.0  # rir's log p(s* | s) (0 here)


@dataclass(eq=False)
class Node:
    """A proof state of the search (states with the same goals are one node)."""

    state: TacticState  # lean_verify's: status, goals, pretty (text), key, tactics, time
    parent: Node | None = None  # the node whose expansion found it (None: the root)
    edge: Edge | None = None  # the edge that reached it from parent
    children: list = field(default_factory=list)  # the new nodes its expansion found
    priority: float = 0.0  # its rank in the queue (`priority`)
    value: float | None = None  # V(s) (None: not scored)
    logprob: float = 0.0  # the summed log-prob of the tactics on its path (deviation 2)
    tokens: int = 0  # and their number of tokens
    expansion: int | None = None  # which expansion expanded it (None: none; labels' order)


@dataclass(eq=False)
class Tree:
    """One theorem's search, as best_first_search runs it."""

    problem: Problem
    root: Node
    nodes: dict = field(default_factory=dict)  # state key -> Node: the open states reached
    queue: list = field(default_factory=list)  # a heap of (-priority, order pushed, Node)
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


class Label(NamedTuple):
    """A value model training item (state, value, source), made by step 1's searches
    (search_result; collected in step 2, trained on in step 3 of the same iteration) and by
    step 4's whole proofs (whole_proof_labels; trained on in the next step 3 that runs)."""

    state: str  # the proof state's text
    value: float  # its target: a value_label on a proof path, 0 off every proof path
    source: object = None  # the record it came from (a SearchResult's id, an Attempt)


class SearchResult(NamedTuple):
    """A theorem's search as it ended, made by search_result: the fields every search of the
    family has (coprover.py, rir.py), then the method's own. Read after the searches: by
    search_metrics (search/* in step 1, eval/search_* in step 5), record_searches (a line of
    searches.jsonl each, every field), and, for its labels, by main's step 2."""

    id: str  # the theorem's Problem.id
    proof: list[str] | None  # the tactics of the proof found (within the budget or not), else None
    proved: bool  # a proof found within the budget
    seconds: float  # the time charged to the theorem (within_budget)
    expansions: int
    nodes: int  # distinct open proof states reached, the root included
    edges: int  # tactics tried, samples that were no tactic included
    failed_edges: int  # of which failed: Lean rejected it, the kernel its proof, or no tactic
    merged: int  # tactics that reached a known state
    role_seconds: dict  # the seconds charged to each role: prover, value, env (Lean's tactics)
    path: list  # the proof's steps, root first, as Triples ("no goals" after the last); []
    path_edges: list  # the Edge of each step of path (log-probs; rir: the planner's target)
    labels: list  # coprover's own: the Labels search_result made of the tree (value_labels);
    # step 2 adds step 1's to the run's labels (step 3 trains V on them); eval's are only recorded


class Attempt(NamedTuple):
    """One sampled whole proof and Lean's verdict on it."""

    sample: Sample
    proof: str | None  # the code Lean accepted, else None
    status: str  # Lean's status ("valid", "error", ...), or "no_code": no closed ```lean4 block
    correct: bool  # Lean accepted the proof (`accepted`; proof_reward, pass@k read it)
    seconds: float = 0.0  # Lean's time on the proof


class Example(NamedTuple):
    """A training sequence: its Sample, its weight, and the record it came from."""

    sample: Sample  # the prompt and target tokens
    weight: float  # the number the loss multiplies: a reward, an advantage, a label
    source: object = None  # the record it was made from (an Attempt, ...)


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
    expand (a state in the queue)."""
    if not within_budget(tree, args):
        return False
    if args.max_expansions is not None and tree.expansions >= args.max_expansions:
        return False
    return bool(tree.queue)


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
    """The node to expand: the queue's highest priority (the first pushed of equal ones); it is
    stamped with the expansion's number (the order of step 2's labels)."""
    _, _, node = heapq.heappop(tree.queue)
    node.expansion = tree.expansions
    return node


def start_expansion(tree: Tree, args: Args) -> None:
    """An expansion begins: pick_node's node, no edges yet."""
    tree.expanding = pick_node(tree, args)
    tree.expansions += 1
    tree.pending, tree.tried, tree.reached = [], {}, []


def best_first_search(
    sampler, verifier, problems: list[Problem], score, key: str, args: Args, clock=time.monotonic
) -> list[SearchResult]:
    """Step 1 on `problems` in lockstep (ReProver's loop, batched): each round, every theorem
    that can_expand picks its node (pick_node), the prover samples K tactics for all of them in
    one call (propose_tactics), Lean applies them (try_tactics), V scores the new states
    (`score(state texts) -> values`; None: no value model) and they join the queue by `priority`
    (end_expansion). Each theorem is charged what it waits for (within_budget). Returns a
    SearchResult a theorem, in order (search_result); step 2 reads their labels."""
    trees = start_trees(verifier, problems)
    while True:
        live = [tree for tree in trees if can_expand(tree, args)]
        if not live:
            break
        for tree in live:
            start_expansion(tree, args)
        propose_tactics(sampler, live, key=key, args=args, clock=clock)
        new = try_tactics(verifier, live, args, clock=clock)
        end_expansion(live, new, score, args, clock=clock)
    return [search_result(tree, args) for tree in trees]


def tactic_prompts(trees: list[Tree]) -> list[str]:
    """The prover's tactic prompt for the node each tree expands now: the proof so far and its
    goals as a comment in the answer block."""
    prompts = []
    for tree in trees:
        problem = tree.problem
        state = tree.expanding.state
        goals = "\n".join("  " + line for line in state.pretty.split("\n"))
        proof = proof_from_tactics(problem.statement, state.tactics).rstrip()
        prompt = TACTIC_PROMPT.format(
            header=problem.header, statement=problem.statement, goals=goals, proof=proof
        )
        prompts.append(prompt)
    return prompts


def proposed_edges(samples: list[Sample]) -> list[Edge]:
    """A node's proposed edges from its K samples: each distinct tactic once, with its first
    sample's log-prob and tokens, in sampling order; then a failed edge (tactic None, log-prob 0,
    0 tokens) for each malformed sample (not one finished line: truncated, aborted or empty), in
    sampling order."""
    failed_edge = Edge(None, 0.0, 0)
    distinct = {}  # tactic -> its Edge
    failed = []
    for completion in samples:
        tactic = completion.text.strip()
        if completion.finish_reason != "stop" or not tactic:
            failed.append(failed_edge)
            continue
        if tactic not in distinct:
            logp = float(sum(completion.logprobs))
            distinct[tactic] = Edge(tactic, logp, len(completion.token_ids))
    return list(distinct.values()) + failed


def propose_tactics(sampler, trees: list[Tree], key: str, args: Args, clock=time.monotonic):
    """The prover's K tactics for the node each tree expands, one sampling call for all trees
    (a key per node, so a node's tactics do not depend on its batch): each tree's pending Edges
    (proposed_edges). Each tree is charged the call's seconds (role "prover")."""
    keys = [f"{key}/{tree.problem.id}/{tree.expansions}" for tree in trees]
    start = clock()
    rows = sample(
        sampler,
        tactic_prompts(trees),
        n=args.num_sampled_tactics,
        key=keys,
        max_new_tokens=args.tactic_max_new_tokens,
        stop=["\n"],
        desc="prove",
        temperature=args.search_temperature,
    )
    elapsed = clock() - start  # every theorem of the call waited for it
    for tree, row in zip(trees, rows):
        tree.seconds += elapsed
        tree.role_seconds["prover"] += elapsed
        tree.pending = proposed_edges(row)


def new_node(parent: Node, edge: Edge, state: TacticState, args: Args) -> Node:
    """A state first reached by `edge` from `parent`: its path's summed log-prob and tokens
    (priority reads them once V has scored it)."""
    return Node(
        state=state,
        parent=parent,
        edge=edge,
        logprob=parent.logprob + edge.logprob,
        tokens=parent.tokens + edge.tokens,
    )


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


def end_expansion(trees: list[Tree], new: list, score, args: Args, clock=time.monotonic) -> None:
    """After the expansions of `trees` (try_tactics' `new`, their new (Tree, Node)s): V scores
    the new nodes (one call for all trees; `score` None: no value model), its seconds charged
    to each tree with a new node (role "value"); they join their trees' queues by `priority`."""
    start = clock()
    values = [None] * len(new)
    if score and new:
        values = score([node.state.pretty for _, node in new])
    elapsed = clock() - start
    for tree in trees:
        if score and tree.expanding.children:  # V scored its new nodes
            tree.seconds += elapsed
            tree.role_seconds["value"] += elapsed
    for (tree, node), value in zip(new, values):
        node.value = value
        node.priority = priority(node, value, args)
        push(tree, node)


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
    """A tree's SearchResult (`proved`: a proof, and charged seconds at most search_timeout;
    within_budget's strict < only stops a call from starting at it); its labels (step 2):
    value_labels on the proof path (root first) and every expanded state, in the order
    expanded; of the states below the root, those value_label_rule keeps."""
    proof = None
    proof_paths = []
    if tree.proof is not None:
        proof = tree.proof.state.tactics
        proof_paths.append([node.state.key for node in node_path(tree.proof)[:-1]])
    expanded = [node for node in tree.nodes.values() if node.expansion is not None]
    expanded.sort(key=lambda node: node.expansion)
    keys = [node.state.key for node in expanded]
    labelled = value_label_rule(args)
    labels = []
    for node_key, label in value_labels(keys, proof_paths, args.gamma).items():
        node = tree.nodes[node_key]
        depth = len(node_path(node)) - 1
        if depth == 0 or labelled(depth):
            labels.append(Label(node.state.pretty, label, source=tree.problem.id))
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
        labels=labels,
    )


def search_theorems(
    train_set: list[Problem], state: dict, rng: random.Random, args: Args
) -> list[Problem]:
    """Step 1's theorems: search_theorems_per_round of the training statements (all of them
    when fewer), drawn with the iteration's rng. state: the run's (its "proved": {id: proof}
    of the theorems step 1's searches proved within the budget, not step 4's whole proofs nor
    the evaluation's), where a changed rule reads what it needs."""
    size = min(args.search_theorems_per_round, len(train_set))
    return rng.sample(train_set, size)


def search(
    sampler, verifier, problems: list[Problem], score, key: str, args: Args, dist: Dist
) -> list[SearchResult]:
    """Steps 1 and 5's search: each rank its share of `problems`, search_batch theorems at a
    time in lockstep (best_first_search; default one per REPL of the rank's pool); after each
    batch the REPLs holding its proof states restart (free_states: a REPL never frees a state,
    and a restart per batch re-imports the header once per search_batch searches). Every rank
    gets all results, in order."""

    def search_share(mine: list[Problem]) -> list[SearchResult]:
        size = args.search_batch or verifier.workers
        results = []
        for i in range(0, len(mine), size):
            batch = mine[i : i + size]
            results += best_first_search(sampler, verifier, batch, score=score, key=key, args=args)
            verifier.free_states()
        return results

    return map_sharded(search_share, problems, dist)


def attempt_proofs(
    sampler,
    verifier,
    problems: list[Problem],
    n: int,
    temperature: float,
    key: str,
    args: Args,
    dist: Dist,
) -> dict[str, list[Attempt]]:
    """Whole proofs (GRPO's rollouts, the frontier filter's and the evaluation's samples): n per
    statement, {problem id: its n Attempts}, sampled over the ranks (a statement seeded by its
    key), checked by Lean on the sampling rank (a (statement, code) once: `accepted`). A
    statement listed twice (a rollout batch across two epochs) is drawn twice under its one
    key, the same samples with transformers; the last row is kept."""
    prompts = []
    keys = []
    for p in problems:
        prompts.append(PROVER_PROMPT.format(header=p.header, statement=p.statement))
        keys.append(f"{key}/{p.id}")
    # sample: this rank's share, {prompt index: n Samples}
    shard = sample_shard(
        sampler,
        prompts,
        n=n,
        key=keys,
        dist=dist,
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
    )
    indices = sorted(shard)
    # verify: the code of each sample's last ```lean4 block (None: none), checked by Lean here
    mine = [problems[i] for i in indices]
    codes = []
    for p, i in zip(mine, indices):
        codes.append([extract_last_block(s.text, p.statement) for s in shard[i]])
    verdicts = verifier.verify_attempts(mine, codes, whole=True)
    # score: the reward of each attempt; then every rank's attempts, gathered
    checked = {}
    for i, row_codes, row_verdicts in zip(indices, codes, verdicts):
        row = []
        for s, code, verdict in zip(shard[i], row_codes, row_verdicts):
            if verdict is None:
                row.append(Attempt(sample=s, proof=None, status="no_code", correct=False))
                continue
            correct = accepted(verdict)
            proof = None
            if correct:
                proof = code
            attempt = Attempt(
                sample=s,
                proof=proof,
                status=verdict.status,
                correct=correct,
                seconds=verdict.time,
            )
            row.append(attempt)
        checked[i] = row
    rows = gather_shard(checked, dist)
    return {p.id: row for p, row in zip(problems, rows)}


def frontier_filter(
    sampler, verifier, problems: list[Problem], args: Args, dist: Dist
) -> list[str]:
    """Data prep (official): the ids of the statements with frontier_min..frontier_max of
    frontier_samples whole proofs proved (deviation 6)."""
    attempts = attempt_proofs(
        sampler,
        verifier,
        problems,
        n=args.frontier_samples,
        temperature=args.frontier_temperature,
        key=f"{args.seed}/frontier",
        args=args,
        dist=dist,
    )
    kept = []
    for p in problems:
        passes = sum(a.correct for a in attempts[p.id])
        if args.frontier_min <= passes <= args.frontier_max:
            kept.append(p.id)
    return kept


def whole_proof_labels(
    verifier, problems: list[Problem], attempts: dict[str, list[Attempt]], args: Args, dist: Dist
) -> list[Label]:
    """Step 2's labelling rule, run in step 4 on its rollouts: Labels whose source is the
    Attempt. A failed attempt labels its theorem's root 0 (the official collector's rule); a
    proof of n top-level tactics labels the root value_label(n) (term mode: n = 1, the
    collector's floor) and, when value_label_rule keeps a state below the root, is replayed,
    the states on its path that the rule keeps labelled by value_labels; a replay not ending
    solved (it uses its own lemma): the root only. Returned by grpo_round; V trains on them in
    the next step 3 that runs (with co-training, the next iteration's)."""

    labelled = value_label_rule(args)

    def label_share(mine: list[tuple[Problem, list[Attempt]]]) -> list[list[Label]]:
        roots = verifier.start_proofs([(p.header, p.statement) for p, _ in mine])
        out = []  # each theorem's labels
        replays = []  # (its theorem's labels, root, tactics, Attempt) of each proof to replay
        for (problem, row), root in zip(mine, roots):
            labels = []
            out.append(labels)
            if root.status != "open":
                continue
            proofs = []
            for a in row:
                if a.correct:
                    proofs.append((proof_tactics(a.proof, problem.statement), a))
                else:
                    labels.append(Label(root.pretty, 0.0, source=a))
            for tactics, a in proofs:
                value = value_label(max(len(tactics), 1), args.gamma)
                labels.append(Label(root.pretty, value, source=a))
                inner = any(labelled(depth) for depth in range(1, len(tactics)))
                if inner:
                    replays.append((labels, root, tactics, a))
        roots = [root for _, root, _, _ in replays]
        paths = [tactics for _, _, tactics, _ in replays]
        for (labels, _, _, a), states in zip(replays, verifier.replay(roots, paths)):
            if states and states[-1].status == "solved":
                path = [s.key for s in states[:-1]]  # the states before each tactic, root first
                found = value_labels([], [path], args.gamma)
                for depth, s in enumerate(states[1:-1], 1):  # (the root has its label)
                    if labelled(depth):
                        labels.append(Label(s.pretty, found[s.key], source=a))
        return out

    pairs = [(p, attempts[p.id]) for p in problems]
    labels = []
    for part in map_sharded(label_share, pairs, dist):
        labels.extend(part)
    return labels


def load_value_model(name: str, dist: Dist, args: Args, train: bool = True) -> torch.nn.Module:
    """The value model (official): a causal LM, loaded and sharded as the prover, with
    `value_head` on its final hidden state (so that FSDP2, checkpoints and the HF directory carry
    it): Linear(h, h/2) - GELU - Linear(h/2, 1) in fp32, from seed 0 (the same on every rank and
    run), or the value_head.* tensors of a directory this file wrote."""
    model = load_model(name, dist, train, gradient_checkpointing=args.gradient_checkpointing)
    model.requires_grad_(train and not args.freeze_value_backbone)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        h = model.config.hidden_size
        model.value_head = torch.nn.Sequential(
            torch.nn.Linear(h, h // 2), torch.nn.GELU(), torch.nn.Linear(h // 2, 1)
        )
    saved = {}
    for path in pathlib.Path(resolve_model(name)).glob("*.safetensors"):
        for tensor_name, tensor in safetensors.torch.load_file(path).items():
            if tensor_name.startswith("value_head."):
                saved[tensor_name.removeprefix("value_head.")] = tensor
    model.value_head.load_state_dict(saved, strict=bool(saved))  # nothing saved: the seed-0 head
    model.value_head.trained = bool(saved)
    model.value_head.to(dist.device)
    if dist.world_size > 1:
        fully_shard(model.value_head)  # fp32, outside the backbone's bf16 mixed precision
    return model


def value_scorer(value_model, tokenizer, args: Args, dist: Dist):
    """V for the search, `score(state texts) -> values` (no grad, eval mode, in micro-batches);
    under torchrun a full copy per rank, since each rank searches alone, filled a gathered tensor
    at a time (never the whole fp32 model)."""
    model = value_model
    if dist.world_size > 1:  # a collective
        alone = Dist(rank=0, world_size=1, local_world_size=1, device=dist.device, is_main=True)
        model = load_value_model(args.value_backbone, alone, args, train=False)
        own = model.state_dict()
        for name, tensor in full_state_dict_items(value_model):  # fp32, each into its dtype
            own[name].copy_(tensor)

    @torch.no_grad()
    def score(texts: list[str]) -> list[float]:
        training = model.training
        model.eval()
        size = args.value_micro_batch_size
        values = []
        for i in range(0, len(texts), size):
            batch = texts[i : i + size]
            batch_values = value_forward(model, tokenizer, batch, args=args)
            values.extend(batch_values.tolist())
        model.train(training)
        return values

    return score


def value_forward(model, tokenizer, texts: list[str], args: Args) -> torch.Tensor:
    """V(s) of a batch of B states, [B] (official): the final hidden state of each
    left-padded prompt's last token (its last value_max_length tokens) through the head in fp32
    and a sigmoid; positions count real tokens only."""
    prompts = [VALUE_PROMPT.format(state=text) for text in texts]
    device = next(model.parameters()).device
    enc = tokenizer(
        prompts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=args.value_max_length,
    ).to(device)
    mask = enc["attention_mask"]  # [B, T]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(
        input_ids=enc["input_ids"],
        attention_mask=mask,
        position_ids=positions,
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=1,
    )
    last = out.hidden_states[-1][:, -1].float()  # [B, H]
    return torch.sigmoid(model.value_head(last)).squeeze(-1)


def label_length(label: Label) -> int:  # micro_batches' sort key: the state's length
    return len(label.state)


def update_value(
    value_model,
    optimizer,
    tokenizer,
    labels: list[Label],
    rng: random.Random,
    args: Args,
    dist: Dist,
) -> dict[str, float]:
    """Step 3 (official): regression of V on the labels so far. Each label > 0 (a state on a
    proof path) is repeated positive_oversample times; then value_epochs epochs, each in a new
    order drawn from `rng`, in batches of value_batch_size, the loss of a batch the mean of
    value_loss_rule's loss over its labels, at lr_at's rate (--value-lr-schedule, warm-up
    value_warmup_steps) over all these optimizer steps. Returns losses/value_* and value/steps,
    value/examples; {} without labels. main then rebuilds the search's `score` from V."""
    data = []
    for item in labels:
        copies = 1
        if item.value > 0:
            copies = args.positive_oversample
        for _ in range(copies):
            data.append(item)
    if not data:
        return {}
    loss = value_loss_rule(args)
    size = args.value_batch_size
    per_epoch = math.ceil(len(data) / size)
    total = args.value_epochs * per_epoch
    stats = []
    for optimizer_step in range(total):
        if optimizer_step % per_epoch == 0:  # an epoch starts: a new order
            order = rng.sample(data, len(data))
        start = (optimizer_step % per_epoch) * size
        batch = order[start : start + size]

        def loss_fn(micro: list[Label]) -> tuple[torch.Tensor, dict]:
            texts = [label.state for label in micro]
            values = value_forward(value_model, tokenizer, texts, args=args)
            targets = values.new_tensor([label.value for label in micro])
            return loss(values, targets, args) / len(batch), {}

        lr = lr_at(
            optimizer_step,
            total,
            peak=args.value_learning_rate,
            warmup=args.value_warmup_steps,
            schedule=args.value_lr_schedule,
        )
        step_stats = train_step(
            value_model,
            optimizer,
            batch,
            loss_fn=loss_fn,
            micro_batch_size=args.value_micro_batch_size,
            max_grad_norm=args.max_grad_norm,
            dist=dist,
            length=label_length,
            lr=lr,
        )
        stats.append(step_stats)
    losses = [s["loss"] for s in stats]
    return {
        "losses/value_loss_first_epoch": float(np.mean(losses[:per_epoch])),
        "losses/value_loss": float(np.mean(losses[-per_epoch:])),
        "losses/value_grad_norm": float(np.mean([s["grad_norm"] for s in stats])),
        "value/steps": float(total),
        "value/examples": float(len(data)),
    }


def in_batch(example: Example, args: Args) -> bool:
    """Step 4's batch filter: whether a rollout is in its update's batch at all (official: every
    one). It sees the rollout once its group's advantages are computed over every rollout of the
    group (as DAPO's overlong filter masks a cut-off sample's loss): example.weight is its
    advantage, example.source its Attempt (the Sample's finish_reason, the proof, Lean's
    status). A rollout left out counts nowhere in update (not in the loss's n_tokens, the
    minibatches or losses/grpo_clipfrac) nor in `trained`; charts/ and lean/ still count it."""
    return True


def adds_gradient(example: Example, args: Args) -> bool:
    """Whether update runs an in-batch GRPO sample through the policy (official): a non-zero
    advantage (all-equal rewards give 0 and no gradient; no dynamic sampling) and tokens to
    train on. A sample it skips adds no gradient, but its tokens still count in the loss's
    n_tokens (official). The ones it keeps are `trained` and losses/grpo_clipfrac's tokens. A
    loss term that trains every sample (an entropy bonus) makes this True for all of them."""
    return abs(example.weight) > 1e-8 and bool(example.sample.token_ids)


def grpo_examples(groups: list[list[Attempt]], args: Args) -> list[Example]:
    """Step 4's training set of one rollout batch, a group of Attempts per prompt: an Example a
    rollout, in order, its weight the advantage_estimator's advantage (--advantage; official
    grpo_advantages) of its group's proof_rewards, its source the Attempt; those in_batch keeps.
    update trains on them."""
    estimate = advantage_estimator(args)
    examples = []
    for row in groups:
        rewards = [proof_reward(attempt, args) for attempt in row]
        advantages = estimate(rewards, args)
        for attempt, advantage in zip(row, advantages):
            example = Example(attempt.sample, weight=advantage, source=attempt)
            if in_batch(example, args):
                examples.append(example)
    return examples


def grpo_batch_loss(
    policy, micro: list[Example], n_tokens: int, args: Args
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's loss on a micro-batch of a minibatch (official): the clip_higher_loss of its
    Examples, advantages their Example.weight, pi_old the sampler's log-probs, over the
    minibatch's n_tokens. Returns (the loss, its stats: "held_back", the tokens the clip held
    back, which update makes losses/grpo_clipfrac). update calls it. A loss term goes here,
    its coefficient read from args, and a stat it returns is logged as losses/grpo_<name> (a
    micro-batch's part of the minibatch's value: train_step sums them); token_logprobs gives
    the entropy with with_entropy=True, detached unless entropy_grad=True. A term that trains
    every sample also changes adds_gradient."""
    samples = [example.sample for example in micro]
    logp, mask, _ = token_logprobs(policy, samples, args.temperature)  # [B, T]
    old_rows = []  # pi_old: the sampler's log-probs, padded as logp
    for s in samples:
        padding = (0, logp.shape[1] - len(s.logprobs))
        old_rows.append(torch.nn.functional.pad(logp.new_tensor(s.logprobs), padding))
    old_logp = torch.stack(old_rows)  # [B, T]
    advantages = logp.new_tensor([example.weight for example in micro])  # [B]
    loss, held_back = clip_higher_loss(
        logp,
        old_logp,
        mask,
        advantages=advantages,
        n_tokens=n_tokens,
        eps_low=args.eps_clip,
        eps_high=args.eps_clip_high,
    )
    return loss, {"held_back": held_back.item()}


def update(
    policy, optimizer, examples: list[Example], lr: float | None, args: Args, dist: Dist
) -> dict[str, float]:
    """Step 4, GRPO on one rollout batch's Examples (grpo_examples; official: no KL, no entropy
    bonus; a loss term goes in grpo_batch_loss): grpo_minibatches optimizer steps over them in
    order (lr None: the optimizer's), each grpo_batch_loss over its minibatch's tokens
    (n_tokens). Of a minibatch, the Examples adds_gradient keeps run; the others (advantage 0)
    add no gradient, but their tokens count in n_tokens (official). Returns loss_metrics'
    losses/grpo_* (clipfrac: the share of the trained samples' tokens the clip held back) and
    losses/grpo_steps; {} when nothing trained."""
    if not examples:  # every rollout left out: nothing to train
        return {}
    size = math.ceil(len(examples) / args.grpo_minibatches)
    history = []
    for first in range(0, len(examples), size):
        minibatch = examples[first : first + size]
        n_tokens = sum(len(example.sample.token_ids) for example in minibatch)
        to_train = []
        for example in minibatch:
            if adds_gradient(example, args):
                to_train.append(example)
        if not to_train:
            continue
        # clipfrac's denominator: the tokens the loss trains on (held_back counts among them)
        trained_tokens = sum(len(example.sample.token_ids) for example in to_train)

        def loss_fn(micro: list[Example]) -> tuple[torch.Tensor, dict]:
            return grpo_batch_loss(policy, micro, n_tokens=n_tokens, args=args)

        step_stats = train_step(
            policy,
            optimizer,
            to_train,
            loss_fn=loss_fn,
            micro_batch_size=args.micro_batch_size,
            max_grad_norm=args.max_grad_norm,
            dist=dist,
            length=example_length,
            lr=lr,
        )
        # the clip's share of the tokens the loss trains on
        step_stats["clipfrac"] = step_stats.pop("held_back") / trained_tokens
        history.append(step_stats)
    if not history:
        return {}
    metrics = loss_metrics(history, prefix="grpo_")
    metrics["losses/grpo_steps"] = float(len(history))
    return metrics


def grpo_round(
    sampler,
    verifier,
    policy,
    optimizer,
    train_set: list[Problem],
    first_batch: int,
    args: Args,
    dist: Dist,
) -> tuple[list[dict], list[Attempt], list[Label], int]:
    """Step 4: grpo_steps_per_round GRPO steps, rollout batches first_batch on (rollout_prompts).
    First sync_weights: the sampler gets the policy's weights (a vLLM put to sleep by step 3's
    value update wakes). Each step samples and verifies whole proofs (attempt_proofs), labels
    the states of the accepted ones for the value model, and each failed attempt's root 0
    (whole_proof_labels), puts the sampler to sleep, updates the prover on the batch
    (grpo_examples, update) at lr_at(batch_index) of a schedule over all iterations x
    grpo_steps_per_round batches, and syncs the new weights into the sampler, so the next
    batch samples from them. Returns each step's update stats,
    the rollouts (every one: grpo_metrics, `outcomes`), the labels (V trains on them in the
    next step 3 that runs) and the number of rollouts the updates trained on (adds_gradient:
    `trained`)."""
    stats, attempts, labels = [], [], []
    trained = 0
    total = args.iterations * args.grpo_steps_per_round
    sampler.sync_weights(policy)
    for batch_index in range(first_batch, first_batch + args.grpo_steps_per_round):
        batch = rollout_prompts(train_set, batch_index, size=args.prompts_per_step, seed=args.seed)
        rollouts = attempt_proofs(
            sampler,
            verifier,
            batch,
            n=args.samples_per_prompt,
            temperature=args.temperature,
            key=f"{args.seed}/grpo{batch_index}",
            args=args,
            dist=dist,
        )
        labels += whole_proof_labels(verifier, batch, rollouts, args=args, dist=dist)
        sampler.sleep()
        lr = lr_at(
            batch_index,
            total,
            peak=args.learning_rate,
            warmup=args.warmup_steps,
            schedule=args.lr_schedule,
        )
        groups = [rollouts[p.id] for p in batch]  # a statement twice in the batch: its group twice
        examples = grpo_examples(groups, args)
        stats.append(update(policy, optimizer, examples, lr=lr, args=args, dist=dist))
        sampler.sync_weights(policy)
        to_train = [example for example in examples if adds_gradient(example, args)]
        trained += len(to_train)
        for row in groups:
            attempts.extend(row)
    return stats, attempts, labels, trained


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
    score,
    key: str,
    run_dir: pathlib.Path,
    step: int,
    searched: collections.Counter,
    args: Args,
    dist: Dist,
) -> dict[str, float]:
    """Step 5 (official): pass@k (unbiased, pass_at_k) from eval_samples whole proofs per
    problem at eval_temperature; search efficiency on the first eval_search_limit problems,
    value-guided (with a value model, `score`) and log-prob only, every search to
    searches.jsonl as phase eval/<guide> (record_searches). Returns eval/* metrics."""
    attempts = attempt_proofs(
        sampler,
        verifier,
        problems,
        n=args.eval_samples,
        temperature=args.eval_temperature,
        key=key,
        args=args,
        dist=dist,
    )
    counts = []  # (samples, proofs) of each problem
    for p in problems:
        row = attempts[p.id]
        counts.append((len(row), sum(a.correct for a in row)))
    metrics = {}
    for k in args.eval_budgets:
        if k <= args.eval_samples:
            metrics[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for n, c in counts]))
    subset = problems
    if args.eval_search_limit is not None:
        subset = problems[: args.eval_search_limit]
    if not subset:
        return metrics
    guides = [("logprob", None)]
    if score:
        guides.insert(0, ("value", score))
    for name, guide in guides:
        start = time.monotonic()
        results = search(
            sampler, verifier, subset, score=guide, key=f"{key}/{name}", args=args, dist=dist
        )
        seconds = time.monotonic() - start
        phase = f"eval/{name}"
        record_searches(run_dir, results, phase, step=step, searched=searched, dist=dist)
        stats = search_metrics(results, prefix=f"eval/search_{name}", seconds=seconds)
        metrics.update(stats)
    return metrics


def nothing_learned(outcomes: collections.Counter, trained: int, args: Args) -> str | None:
    """A run's last line when GRPO's updates trained on no rollout (`trained`, the rollouts
    adds_gradient kept: none had a non-zero advantage, or in_batch left those out), and why; None
    when they trained on one, or there was no rollout. outcomes: this run's rollouts by Lean's
    verdict. Lean accepted none (the CPU default on the embedded model): no group's
    proof_rewards differed (all 0, officially); else the line names both causes."""
    if trained or not outcomes:
        return None
    why = {
        "no_code": "no closed ```lean4 block",
        "error": "Lean error",
        "sorry": "sorry",
        "timeout": "Lean timeout",
    }
    total = sum(outcomes.values())
    verdicts = []
    for status, count in outcomes.most_common():
        verdicts.append(f"{count}/{total} {why.get(status, status)}")
    if outcomes["valid"]:
        return (
            f"coprover.py: GRPO trained on no rollout ({', '.join(verdicts)}): Lean accepted "
            f"{outcomes['valid']} proof(s), but in every group the proof_rewards were equal "
            "(advantage 0: adds_gradient) or in_batch left the rollouts out, so the prover was "
            "never updated"
        )
    return (
        f"coprover.py: Lean accepted no GRPO rollout ({', '.join(verdicts)}): {args.model} wrote "
        "no proof Lean accepts, so no group's proof_rewards differed and the prover was never "
        "updated; "
        "tests/test_coprover.py::test_loop_learns_what_the_stand_in_rewards shows this loop "
        "learning, on a model primed to write proofs"
    )


# ---- main ----
def check_choices(args: Args) -> None:
    """Stop the run at start, not deep in the loop, on flag values that cannot run: a value (a
    Literal a fork extended) without its table entry (each lookup runs once and raises a
    ValueError naming what to add), a value outside its range, flags that cannot run together.
    A new flag's range check goes here. main calls it before start_run.
    Its tables: ADVANTAGES, PRIORITIES, VALUE_LOSSES, VALUE_LABELS."""
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"--alpha {args.alpha}: a weight of the log-prob against V(s), in [0, 1]")
    advantage_estimator(args)
    priority_rule(args)
    value_label_rule(args)
    value_loss_rule(args)
    # lr_at raises on a schedule it does not know (start_run checks --lr-schedule)
    lr_at(step=0, total=1, peak=1.0, schedule=args.value_lr_schedule)


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


class Tokenizers(dict):  # save_checkpoint writes a tokenizer into each model's directory: its own
    def save_pretrained(self, path) -> None:
        self[pathlib.Path(path).name].save_pretrained(path)


def load_models(args: Args, dist: Dist) -> tuple[dict, Tokenizers]:
    """{"prover": (model, AdamW)}, the prover trained by GRPO and sampled, and with
    --value-model {"value": (model, AdamW)}, the value model trained by regression (its frozen
    backbone's parameters left out of its optimizer); and their tokenizers."""
    tokenizers = Tokenizers(
        prover=load_tokenizer(args.model), value=load_tokenizer(args.value_backbone)
    )
    tokenizers["value"].truncation_side = "left"  # a long state keeps the end, where the head reads
    adamw = functools.partial(
        torch.optim.AdamW, betas=args.adam_betas, weight_decay=args.weight_decay
    )
    prover = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    models = {"prover": (prover, adamw(prover.parameters(), args.learning_rate))}
    if args.value_model:
        value_model = load_value_model(args.value_backbone, dist, args)
        trainable = [p for p in value_model.parameters() if p.requires_grad]
        models["value"] = (value_model, adamw(trainable, args.value_learning_rate))
    return models, tokenizers


def start_sampler(prover, tokenizer, args: Args, dist: Dist) -> Sampler:
    """The prover's sampler (vLLM or transformers), with its weights as they are now (resumed)."""
    return Sampler(
        args.model,
        prover,
        tokenizer,
        dist=dist,
        backend=args.backend,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        sleep=args.vllm_sleep,
        seed=args.seed,
    )


def grpo_metrics(stats: list[dict], attempts: list[Attempt], args: Args) -> dict[str, float]:
    """Step 4's metrics: the updates' mean losses, and the rollouts' reward, tokens and Lean
    verdicts."""
    metrics = {}
    for name in set().union(*stats):  # a step without an update has no losses
        metrics[name] = float(np.mean([s[name] for s in stats if name in s]))
    metrics["charts/reward_mean"] = mean([proof_reward(a, args) for a in attempts])
    metrics["charts/grpo_steps"] = float(len(stats))
    metrics["charts/grpo_tokens"] = float(sum(len(a.sample.token_ids) for a in attempts))
    statuses = [a.status for a in attempts]
    for status in sorted(set(statuses)):
        metrics[f"lean/{status}_share"] = statuses.count(status) / len(statuses)
    return metrics


def label_metrics(new_labels: list[Label], labels: list) -> dict[str, float]:
    """Step 2's metrics: this iteration's labels (of searches and whole proofs), all labels."""
    new = [label.value for label in new_labels]
    return {
        "value/new_labels": float(len(new_labels)),
        "value/labels": float(len(labels)),
        "value/new_positive_share": mean([label > 0 for label in new]),
        "value/new_label_mean": mean(new),
    }


def main(args: Args) -> None:
    check_choices(args)  # flag values that cannot run stop here, at start
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS)
    verifier = start_lean(args, dist)
    problems = load_problems(args.dataset, args.num_problems)
    benchmark = load_problems(args.eval_dataset, args.eval_limit, split=args.eval_split)
    models, tokenizers = load_models(args, dist)
    prover, prover_optimizer = models["prover"]
    # the run's state: the labelled states of all iterations, the GRPO rollout batches done, the
    # frontier, the value trainings done, the proofs step 1's searches found {id: tactics}
    start = 0
    state = {"labels": [], "grpo_step": 0, "frontier": None, "value_rounds": 0, "proved": {}}
    if args.resume:
        found = load_checkpoint(run_dir, models, dist)
        if found is not None:
            start, state = found
    sampler = start_sampler(prover, tokenizers["prover"], args=args, dist=dist)
    score = None  # V for the search
    if args.value_model:
        score = value_scorer(models["value"][0], tokenizers["value"], args=args, dist=dist)

    # Before the first iteration: the frontier filter (data prep)
    if args.frontier_filter and state["frontier"] is None and start < args.iterations:
        with logger.timer("frontier"):
            frontier = frontier_filter(sampler, verifier, problems, args=args, dist=dist)
            state["frontier"] = frontier
    train_set = problems
    if state["frontier"] is not None:
        frontier = set(state["frontier"])
        train_set = [p for p in problems if p.id in frontier]
    if not train_set and start < args.iterations:
        sys.exit(
            "coprover.py: no training statement left (frontier: "
            f"{args.frontier_min}..{args.frontier_max} of {args.frontier_samples} proved); "
            "--no-frontier-filter trains on all of them"
        )

    outcomes = collections.Counter()  # this run's GRPO rollouts by Lean's verdict
    searched = collections.Counter()  # this run's searches, of every phase (record_searches)
    trained = 0  # this run's training signals: the rollouts GRPO's updates ran (grpo_round)
    for iteration in range(start, args.iterations):
        step = iteration + 1  # iterations done
        metrics = {"charts/train_statements": float(len(train_set))}
        rng = random.Random(f"{args.seed}/{iteration}")

        # 1. Search: best-first search (log-prob only until a value model has been trained)
        with logger.timer("search"):
            guided = args.value_model and state["value_rounds"] > 0
            guide = score if guided else None
            theorems = search_theorems(train_set, state, rng, args)
            key = f"{args.seed}/{iteration}/search"
            results = search(
                sampler, verifier, theorems, score=guide, key=key, args=args, dist=dist
            )
        seconds = logger.times["time/search"]  # proofs per second of the phase's wall time
        stats = search_metrics(results, prefix="search", seconds=seconds)
        metrics.update(stats)
        metrics["search/value_guided"] = float(guided)
        record_searches(run_dir, results, "search", step=step, searched=searched, dist=dist)
        for result in results:
            if result.proved:
                state["proved"][result.id] = result.proof

        # 2. Labels: collect the Labels step 1's searches made (search_result: value_labels), into
        # the run's labels as (state text, value) pairs (the whole proofs' come with step 4)
        new_labels = []
        for result in results:
            new_labels += result.labels
        state["labels"] += [tuple(label[:2]) for label in new_labels]

        # 3. The value model: regression on all labels so far (--no-co-training: only once)
        first_value_round = state["value_rounds"] == 0
        if args.value_model and (args.co_training or first_value_round) and state["labels"]:
            with logger.timer("value"):
                sampler.sleep()
                value_model, value_optimizer = models["value"]
                stats = update_value(
                    value_model,
                    value_optimizer,
                    tokenizers["value"],
                    labels=[Label(*pair) for pair in state["labels"]],
                    rng=random.Random(f"{args.seed}/{iteration}/value"),
                    args=args,
                    dist=dist,
                )
                metrics.update(stats)
                score = value_scorer(value_model, tokenizers["value"], args=args, dist=dist)
                state["value_rounds"] += 1

        # 4. The prover: GRPO on whole proofs; labels: Lean's verified proofs replayed, and
        # each failed attempt's root 0
        with logger.timer("grpo"):
            stats, attempts, labels, round_trained = grpo_round(
                sampler,
                verifier,
                prover,
                optimizer=prover_optimizer,
                train_set=train_set,
                first_batch=state["grpo_step"],
                args=args,
                dist=dist,
            )
            state["grpo_step"] += args.grpo_steps_per_round
            state["labels"] += [tuple(label[:2]) for label in labels]
            new_labels += labels
            outcomes.update(a.status for a in attempts)
            trained += round_trained
            metrics.update(grpo_metrics(stats, attempts, args))
        metrics.update(label_metrics(new_labels, state["labels"]))

        # 5. Evaluate: pass@k on the benchmark, search efficiency with and without the value model
        last = step == args.iterations
        if args.eval_every and step % args.eval_every == 0 or last:
            with logger.timer("eval"):
                value_score = score if state["value_rounds"] else None
                stats = evaluate(
                    sampler,
                    verifier,
                    benchmark,
                    score=value_score,
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
                run_dir, iteration=step, models=models, tokenizer=tokenizers, state=state, dist=dist
            )

    # --iterations 0, or a finished run: step 5 alone (evaluate), on the weights as given
    if start >= args.iterations:
        if score and not state["value_rounds"] and not models["value"][0].value_head.trained:
            score = None  # a seed-0 head guides nothing
            if dist.is_main:
                print(
                    f"coprover.py: {args.value_backbone} has no trained value head (a coprover "
                    "checkpoint's value/ has): the evaluation searches by log-prob only"
                )
        stats = evaluate(
            sampler,
            verifier,
            benchmark,
            score=score,
            key=f"{args.seed}/eval",
            run_dir=run_dir,
            step=args.iterations,
            searched=searched,
            args=args,
            dist=dist,
        )
        logger.log(stats, step=args.iterations)
    line = nothing_learned(outcomes, trained, args)
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
