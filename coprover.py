"""CoProver: a GRPO prover co-trained with a value model that guides best-first proof search, in Lean 4.

Source: the CoProver code release (github.com/kanav9063/CoProver at afcc317, README "Co-Training Proof Generation and
Search Heuristics"; no paper, no results; "Proprietary" licence: nothing copied), a scaffold around slime, SGLang,
kimina-lean-server and ReProver whose pieces are not wired together; here the method its README describes, end to end.

Method. The PROVER (DeepSeek-Prover-V2-7B) writes whole proofs and, asked for one step, tactics; the VALUE MODEL
(Llama-3.2-1B, a scalar head on the last token) estimates V(s) = gamma^d, d the steps from proof state s to QED. Each
iteration (the README's round):
  1. search: best-first over Lean's tactic mode, priority alpha * exp(mean token log-prob of the path) + (1 - alpha) V
     (without a value model, ReProver's: the path's cumulative log-prob);
  2. labels: gamma^d on the states of each proof found (by search or a verified whole proof), 0 on expanded states off
     every proof path and on the roots of failed whole proofs;
  3. value: regression (MSE) on the labels of ALL iterations;
  4. prover: GRPO on whole proofs (reward 1 iff Lean accepts, DAPO clip-higher, no KL) on the "frontier" statements;
  5. eval: pass@1/8/32 on miniF2F-test, and search efficiency with and without V.
Metrics (metrics.jsonl, step = iterations done): search/*, value/*, losses/*, charts/*, lean/*, eval/*, time/*.

Run. Without CUDA, `python <this file>` runs a loop scaled down by CPU_DEFAULTS and prints what it scaled; `torchrun
--nproc_per_node 8 <this file>` runs the full sizes; `--iterations 0` evaluates the given model. Both need Lean:
`bash setup.sh --lean`, or for a CPU smoke run the stand-in REPL, LEAN_REPL_CMD="python tests/fake_lean_repl.py",
which follows the tactic table of data/lean_tactics.jsonl. Experiment map: README.md.

Deliberate deviations:
  1. Lean through lean_verify's REPL tactic mode, not LeanDojo: states merge by goals, a found proof is checked whole.
  2. Priority exp(mean token log-prob of the path), in (0, 1] like V, not value_guided_search.py's cumulative log-prob.
  3. The search runs (no official script calls it); K distinct sampled tactics, not beam; log-prob only before any V.
  4. Labels per state, from search and GRPO's rollouts (official: own samples' roots, 0.95^lines or 0; --value-labels).
  5. The reward is lean_verify's verdict, not kimina's (warnings allowed): lean_reward.py fails warnings, pays timeouts.
  6. The frontier counts proofs Lean accepts (filter_dataset.py: kimina non-responses); bounds 1..6 of 8 (its code: 7).
  7. V is value_model.py's scalar head trained by regression (the official scripts fine-tune the LM to print V as text).
  8. 100 GRPO steps per iteration (num_rollout 500 / 5 rounds); pi_old: the sampler's log-probs (slime recomputes them).
  9. Search theorems are the training statements, in the whole-proof prompt (official: LeanDojo's, "[GOAL] ...").
 10. No value_reward.py format bonus, as train_step_grpo.sh (lean_reward.compute_reward).
 11. Evaluation: 32 samples (co_train.py: 8) under Lean's 60 s (evaluate.py: 120 s); no PutnamBench (--eval-dataset).
 12. --no-co-training trains V in the first iteration only; the README's "independent training" is not offered.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
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
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np
import safetensors.torch
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

from lean_verify import (LeanNotInstalled, LeanVerifier, Problem, extract_last_block, load_problems, proof_from_tactics,
                         proof_tactics)


@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed> unless --run-name)"""
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
    """the value model's LM (any causal LM; a coprover checkpoint's value/ directory brings its head too)"""
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
    """the problems to train on: a Hugging Face dataset, a .jsonl or a .json (lean_verify.load_problems)"""
    num_problems: int | None = None
    """use only the first N problems of --dataset (default all)"""

    # algorithm
    iterations: int = 5  # configs/co_training.yaml
    """iterations to run (the README's word: rounds); 0: no training, evaluate the given model"""
    search_theorems_per_round: int = 5000
    """theorems searched each iteration (co_training.yaml num_theorems_per_round)"""

    # search (co_train.py, value_guided_search.py)
    num_sampled_tactics: int = 32
    """K: tactics sampled per expansion (official num_sampled_tactics; duplicates run once)"""
    max_expansions: int | None = 128
    """expansions per theorem (None: only the clock limits a search)"""
    search_timeout: float = 300.0  # co_train.py
    """seconds per theorem (the search's budget, read before each tactic)"""
    search_temperature: float = 0.8
    """tactic sampling temperature (the official collector's)"""
    tactic_max_new_tokens: int = 256  # lean_generate.py
    """longest tactic"""
    lean_timeout: float = 60.0
    """Lean's wall-clock limit per whole proof and per tactic, in seconds (lean_reward.py)"""
    lean_workers: int | None = None
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of the machine)"""
    alpha: float = 0.3
    """priority = alpha * normalised log-prob + (1 - alpha) * V(s) (value_guided_search.py)"""
    search_batch: int | None = None
    """theorems searched in lockstep on each rank (default: the rank's REPL pool size)"""

    # value model (configs/value_model_sft.yaml, train_value_slime.sh)
    gamma: float = 0.95
    """value label gamma^d, d = steps left to QED"""
    value_labels: Literal["state", "root"] = "state"
    """label every state of a proof (README) or only the root (the official collector)"""
    positive_oversample: int = 3
    """positive labels are repeated this many times (co_training.yaml oversample_positive)"""
    value_epochs: int = 3
    """epochs over all labels so far, each iteration"""
    value_batch_size: int = 64
    """states per optimizer step"""
    value_max_length: int = 512
    """a state's prompt keeps its last this many tokens (train_value_model.py)"""
    freeze_value_backbone: bool = False
    """train only the head (value_model.py's default; the official SFT scripts train the whole LM)"""
    value_learning_rate: float = 2e-5
    """peak learning rate of the value model"""
    value_lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"  # over each iteration's value training
    """learning-rate schedule after the warm-up (lr_at)"""
    value_warmup_steps: int = 10
    """linear warm-up steps from 0"""
    value_micro_batch_size: int = 8
    """states per forward/backward on each rank (and per scoring batch in search)"""

    # prover GRPO (train_step_grpo.sh, configs/generator_grpo.yaml)
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
    eps_clip: float = 0.2
    """PPO clip below 1"""
    eps_clip_high: float = 0.28
    """PPO clip above 1 (DAPO clip-higher)"""
    grpo_minibatches: int = 1
    """optimizer steps per rollout batch (global_batch_size 512 = one)"""
    frontier_filter: bool = True
    """keep the training statements with frontier_min..frontier_max of 8 samples proved (filter_dataset.py)"""
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
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # over all rollout batches of the run
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
    """guide the search with the value model (--no-value-model: log-prob-only best-first search, no value model)"""
    co_training: bool = True
    """train the value model every iteration (--no-co-training: only in the first; the prover trains alone after it)"""

    # evaluation
    eval_dataset: str = "data/minif2f.jsonl"
    """benchmark (lean_verify.load_problems: miniF2F's name, split, header, formal_statement)"""
    eval_split: str | None = "test"
    """which split of the benchmark (None: all rows)"""
    eval_limit: int | None = None
    """use only the first N benchmark problems"""
    eval_every: int = 1  # co_train.py phase 4
    """evaluate every this many iterations and after the last (0: only after the last)"""
    eval_samples: int = 32
    """whole-proof samples per benchmark problem"""
    eval_budgets: tuple[int, ...] = (1, 8, 32)
    """k of the reported pass@k"""
    eval_temperature: float = 0.8
    """evaluation sampling temperature (evaluate.py)"""
    eval_search_limit: int | None = None
    """benchmark problems searched with and without the value model (default all; 0: none)"""


# Without CUDA the full sizes would take weeks; these run an iteration on 2 cores in minutes (SmolLM2-135M samples
# ~60 tokens/s in a batch of 8; a training step on 8 x 384 tokens takes ~30 s). The value model trains its head only:
# a trained backbone's gradients and AdamW moments (1.6 GB in fp32) would take the run past a laptop's 4 GB.
CPU_DEFAULTS = dict(model="embedded:smollm2", value_backbone="embedded:smollm2", dataset="data/lean_tactics.jsonl",
                    iterations=2, search_theorems_per_round=5, num_sampled_tactics=4, max_expansions=3,
                    tactic_max_new_tokens=24, freeze_value_backbone=True, value_epochs=1, value_batch_size=16,
                    value_micro_batch_size=8, value_max_length=256, grpo_steps_per_round=1, prompts_per_step=4,
                    samples_per_prompt=4, max_new_tokens=64, learning_rate=1e-5, frontier_filter=False,
                    max_model_len=1024, eval_limit=2, eval_samples=4, eval_budgets=(1, 2, 4), eval_search_limit=2)


# ---- prompts ----
# The prover's whole-proof prompt: DeepSeek-Prover-V2's non-CoT format as the official data prep writes it (a raw
# completion, no chat template); the answer is a new ```lean4 block with the whole theorem.
PROVER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}{statement}\n```\n"
# Search asks the same prover for one step: its answer block prefilled with the tactics so far and the goals in a
# comment (DeepSeek-Prover-V1.5's tactic-state comments); the tactic is the next line. The prompt ends at the newline,
# on a token boundary of DeepSeek's training text (one ending in "\n  " ends on an indentation token it rarely saw).
TACTIC_PROMPT = PROVER_PROMPT + "```lean4\n{header}{proof}\n  /- tactic state:\n{goals}\n  -/\n"
# The value model reads a proof state in this frame; its head reads the hidden state of the last token.
VALUE_PROMPT = "Lean 4 proof state:\n{state}\n\nHow close is this state to a finished proof?"


# ---- data ----
# A theorem is lean_verify's Problem(id, header, statement), as load_problems reads them from a dataset (miniF2F's
# fields; Kimina-Prover-Promptset's formal_statement, whose text before the declaration is its header).
def rollout_prompts(problems: list[Problem], step: int, size: int, seed: int) -> list[Problem]:
    """The statements of GRPO rollout `step` (slime --rollout-shuffle): epochs, each in its own seeded order."""
    n = len(problems)
    order = functools.cache(lambda epoch: random.Random(f"{seed}/epoch{epoch}").sample(range(n), n))
    return [problems[order(j // n)[j % n]] for j in range(step * size, (step + 1) * size)]


# ---- rewards ----
def proof_reward(result) -> float:
    """The prover's reward (lean_reward.py): 1 iff Lean accepts the whole proof; a timeout fails (deviation 5)."""
    return 1.0 if result.valid and result.status == "valid" else 0.0


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO's advantage (slime, grpo_std_normalization): (r - mean) / (std + eps) over a prompt's samples, the std with
    Bessel's correction (torch's default). All-equal rewards give 0: no gradient (no dynamic sampling)."""
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / ((r.std(ddof=1) if len(r) > 1 else 0.0) + eps)).tolist()


def value_labels(expanded: list, proof_paths: list[list], gamma: float) -> dict:
    """The value model's targets (README "gamma^d scoring"): a state on a proof path (the states before its tactics,
    root first) with d tactics left gets gamma^d (the nearest QED when on several), every other expanded state 0."""
    labels = {k: 0.0 for k in expanded}
    for path in proof_paths:
        for i, k in enumerate(path):
            labels[k] = max(labels.get(k, 0.0), gamma ** (len(path) - i))
    return labels


def priority(logprob: float, tokens: int, value: float, alpha: float) -> float:
    """A node's priority (value_guided_search.py, normalised: deviation 2), both terms in [0, 1]: alpha times the
    geometric-mean probability of the tactic tokens on its path, exp(logprob / tokens), + (1 - alpha) * V(s)."""
    return alpha * math.exp(logprob / max(tokens, 1)) + (1 - alpha) * value


# ---- losses ----
def clip_higher_loss(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                     n_tokens: int, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO's token-level clipped objective (slime compute_policy_loss, --calculate-per-token-loss, no KL), and the
    tokens the clip held back: -sum_{i,t} min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i) / n_tokens, r_it =
    pi(y_it) / pi_old(y_it); logp, old_logp, mask [B, T], advantages [B]; n_tokens: the optimizer batch's, all ranks."""
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = ratio * advantages[:, None], ratio.clamp(1 - eps_low, 1 + eps_high) * advantages[:, None]
    return -(torch.minimum(unclipped, clipped) * mask).sum() / n_tokens, ((clipped < unclipped).float() * mask).sum()


def value_loss(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The value model's regression loss: squared errors of V(s) against the labels, summed (the caller averages)."""
    return ((values - labels) ** 2).sum()


# ---- phases ----
# A search's record: the fields every search of the family has (coprover.py, rir.py), then the method's own fields:
# merged states, the labelled states of step 2. A whole-proof attempt: its Sample, the code Lean accepted (else None),
# Lean's status ("no_code": nothing to check), whether Lean accepted it (the reward), seconds.
SearchResult = collections.namedtuple("SearchResult", "id proof seconds expansions nodes edges failed_edges "
                                                      "merged labels")
Attempt = collections.namedtuple("Attempt", "sample proof status correct seconds", defaults=(0.0,))


@dataclass(eq=False)
class Node:  # a proof state of the search (states with the same goals are one node)
    state: object  # lean_verify.TacticState
    parent: str | None = None  # the key of the node whose expansion found this state
    logprob: float = 0.0  # the summed log-prob of the tactics on its path (deviation 2)
    tokens: int = 0  # and their number of tokens


def best_first_search(sampler, verifier, problems: list[Problem], score, key: str, args: Args) -> list[SearchResult]:
    """Step 1 on `problems` in lockstep (ReProver's loop): each step pops every live theorem's best node, samples K
    tactics for each (one generate call), applies the distinct ones in turn (the i-th of every theorem in one
    apply_tactics call) until the theorem is proved or its budget spent, scores the new states with V (`score`; None:
    ReProver's cumulative log-prob) and pushes them; known goals merge. A theorem is charged the calls it waits for,
    its tactics and kernel checks (budget read before each tactic; ReProver's: between expansions). A sample that is
    not one finished line, a tactic Lean rejects and a solved path the kernel rejects are failed edges."""
    tie = itertools.count(1)
    trees = [dict(problem=p, nodes={r.key: Node(r)}, queue=[(0.0, 0, r.key)] if r.status == "open" else [],
                  expanded=[], proof=None, counts=collections.Counter(), seconds=0.0, tactics=[])
             for p, r in zip(problems, verifier.start_proofs([(p.header, p.statement) for p in problems]))]
    going = lambda t: t["proof"] is None and t["seconds"] < args.search_timeout  # noqa: E731
    while live := [t for t in trees if t["queue"] and going(t) and (args.max_expansions is None or
                                                                       len(t["expanded"]) < args.max_expansions)]:
        prompts, start = [], time.monotonic()
        for t in live:
            t["expanded"].append(heapq.heappop(t["queue"])[2])
            p, state = t["problem"], t["nodes"][t["expanded"][-1]].state
            goals = "\n".join("  " + line for line in state.pretty.split("\n"))  # a comment in the answer block
            prompts.append(TACTIC_PROMPT.format(header=p.header, statement=p.statement, goals=goals,
                                                proof=proof_from_tactics(p.statement, state.tactics).rstrip()))
        # a key per prompt: a node's tactics are the same whichever theorems share its lockstep batch and rank
        rows = sample(sampler, prompts, args.num_sampled_tactics, [f"{key}/{t['problem'].id}/{len(t['expanded'])}"
                      for t in live], stop=["\n"], temperature=args.search_temperature,
                      max_new_tokens=args.tactic_max_new_tokens)
        elapsed = time.monotonic() - start  # every theorem of the call waited for it
        for t, row in zip(live, rows):
            distinct, t["seconds"] = {}, t["seconds"] + elapsed
            for s in row:  # truncated, aborted and empty samples are failed edges
                if s.finish_reason != "stop" or not s.text.strip():
                    t["counts"].update(edges=1, failed_edges=1)
                else:
                    distinct.setdefault(s.text.strip(), (float(sum(s.logprobs)), len(s.token_ids)))
            t["tactics"] = list(distinct.items())
        new = []
        for i in itertools.count():  # the i-th tactic of every theorem not yet proved and within its budget
            if not (todo := [t for t in live if i < len(t["tactics"]) and going(t)]):
                break
            for t, child in zip(todo, verifier.apply_tactics([(t["nodes"][t["expanded"][-1]].state, t["tactics"][i][0])
                                                              for t in todo])):
                start, k, (lp, n) = time.monotonic(), t["expanded"][-1], t["tactics"][i][1]
                t["counts"]["edges"] += 1
                if child.status == "solved" and verifier.check_tactic_path(child).valid:
                    t["proof"] = (child.tactics, k)
                elif child.status != "open":
                    t["counts"]["failed_edges"] += 1
                elif child.key in t["nodes"]:
                    t["counts"]["merged"] += 1
                else:
                    parent = t["nodes"][k]
                    new.append((t, Node(child, k, parent.logprob + lp, parent.tokens + n)))
                    t["nodes"][child.key] = new[-1][1]
                t["seconds"] += child.time + time.monotonic() - start  # the tactic and its kernel check
        start = time.monotonic()
        values = score([node.state.pretty for _, node in new]) if score and new else [0.0] * len(new)
        for t in {id(t): t for t, _ in new}.values():  # the V call, for the theorems it scored
            t["seconds"] += time.monotonic() - start
        for (t, node), v in zip(new, values):
            rank = priority(node.logprob, node.tokens, v, args.alpha) if score else node.logprob
            heapq.heappush(t["queue"], (-rank, next(tie), node.state.key))
    results = []
    for t in trees:  # step 2 for the search: the states of the proof path, root first, and every expanded state
        nodes, path, k = t["nodes"], [], t["proof"][1] if t["proof"] else None
        while k is not None:
            path, k = [k] + path, nodes[k].parent
        labels = value_labels(t["expanded"], [path] if t["proof"] else [], args.gamma)
        results.append(SearchResult(t["problem"].id, t["proof"] and t["proof"][0], t["seconds"], len(t["expanded"]),
                                    len(nodes), *(t["counts"][c] for c in ("edges", "failed_edges", "merged")),
                                    [(nodes[k].state.pretty, v) for k, v in labels.items()
                                     if args.value_labels == "state" or nodes[k].parent is None]))
    return results


def search(sampler, verifier, problems: list[Problem], score, key: str, args: Args, dist: Dist) -> list[SearchResult]:
    """Step 1 on every rank's share of `problems`, search_batch theorems at a time in lockstep (default: one per REPL of
    the rank's pool); then the REPLs holding the batch's proof states are restarted (a REPL never frees one)."""
    def run(mine: list[Problem]) -> list[SearchResult]:
        size, results = args.search_batch or verifier.workers, []
        for i in range(0, len(mine), size):
            results += best_first_search(sampler, verifier, mine[i : i + size], score, key, args)
            verifier.free_states()
        return results

    return map_sharded(run, problems, dist)


def attempt_proofs(sampler, verifier, problems: list[Problem], n: int, temperature: float, key: str, args: Args,
                   dist: Dist) -> list[list[Attempt]]:
    """Whole proofs (GRPO's rollouts, the frontier filter's and the evaluation's samples): n per statement, shared out
    over the ranks, a statement seeded by its key; Lean checks them on the sampling rank, a (statement, code) once."""
    def check(start: int, rows: list[list[Sample]]) -> list[list[Attempt]]:
        mine = problems[start : start + len(rows)]
        codes = [[extract_last_block(s.text, p.statement) for s in row] for p, row in zip(mine, rows)]  # failed: ""
        return [[Attempt(s, None, "no_code", False) if v is None else Attempt(s, c if proof_reward(v) else None,
                 v.status, proof_reward(v) > 0, v.time) for s, c, v in zip(*cols)]
                for cols in zip(rows, codes, verifier.verify_attempts(mine, codes, whole=True))]

    prompts = [PROVER_PROMPT.format(header=p.header, statement=p.statement) for p in problems]
    return sample(sampler, prompts, n, [f"{key}/{p.id}" for p in problems], dist, then=check, temperature=temperature,
                  max_new_tokens=args.max_new_tokens)


def frontier_filter(sampler, verifier, problems: list[Problem], args: Args, dist: Dist) -> list[str]:
    """Data prep (filter_dataset.py): the ids of the statements with frontier_min..frontier_max of frontier_samples
    whole proofs proved (deviation 6)."""
    attempts = attempt_proofs(sampler, verifier, problems, args.frontier_samples, args.frontier_temperature,
                              f"{args.seed}/frontier", args, dist)
    return [p.id for p, row in zip(problems, attempts)
            if args.frontier_min <= sum(a.correct for a in row) <= args.frontier_max]


def whole_proof_labels(verifier, problems: list[Problem], attempts: list[list[Attempt]], args: Args, dist: Dist
                       ) -> list[tuple[str, float]]:
    """Step 2 for whole proofs: a failed attempt labels its theorem's root 0 (the official collector's rule); a proof of
    n top-level tactics labels the root gamma^n (term mode: n = 1, the collector's floor) and, with per-state labels, is
    replayed, its i-th state labelled gamma^(n - i); a replay not ending solved (it uses its own lemma): root only."""
    def run(mine: list[tuple[Problem, list[Attempt]]]) -> list[list[tuple[str, float]]]:
        out, replays = [], []
        for (p, row), root in zip(mine, verifier.start_proofs([(p.header, p.statement) for p, _ in mine])):
            proofs = [proof_tactics(a.proof, p.statement) for a in row if a.correct] if root.status == "open" else []
            out.append([(root.pretty, 0.0) for a in row if not a.correct and root.status == "open"] +
                       [(root.pretty, args.gamma ** max(len(tactics), 1)) for tactics in proofs])
            replays += [(out[-1], root, t) for t in proofs if args.value_labels == "state" and len(t) > 1]
        for (labels, _, _), states in zip(replays, verifier.replay(*[[r[i] for r in replays] for i in (1, 2)])):
            if states and states[-1].status == "solved":
                found = value_labels([], [[s.key for s in states[:-1]]], args.gamma)
                labels += [(s.pretty, found[s.key]) for s in states[1:-1]]
        return out

    return [label for part in map_sharded(run, list(zip(problems, attempts)), dist) for label in part]


def load_value_model(name: str, dist: Dist, args: Args, train: bool = True) -> torch.nn.Module:
    """The value model (value_model.py): a causal LM, loaded and sharded as the prover, with `value_head` on its final
    hidden state (so that FSDP2, checkpoints and the HF directory carry it): Linear(h, h/2) - GELU - Linear(h/2, 1) in
    fp32, from seed 0 (the same on every rank and run), or the value_head.* tensors of a directory this file wrote."""
    model = load_model(name, dist, train, gradient_checkpointing=args.gradient_checkpointing)
    model.requires_grad_(train and not args.freeze_value_backbone)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        h = model.config.hidden_size
        model.value_head = torch.nn.Sequential(torch.nn.Linear(h, h // 2), torch.nn.GELU(), torch.nn.Linear(h // 2, 1))
    saved = {k.removeprefix("value_head."): v for f in pathlib.Path(resolve_model(name)).glob("*.safetensors")
             for k, v in safetensors.torch.load_file(f).items() if k.startswith("value_head.")}
    model.value_head.load_state_dict(saved, strict=bool(saved))  # nothing saved: the seed-0 head
    model.value_head.trained = bool(saved)
    model.value_head.to(dist.device)
    if dist.world_size > 1:
        fully_shard(model.value_head)  # fp32, outside the backbone's bf16 mixed precision
    return model


def value_scorer(value_model, tokenizer, args: Args, dist: Dist):
    """V for the search, `score(state texts) -> values` (no grad, eval mode, in micro-batches); under torchrun a full
    copy per rank, since each rank searches alone, filled a gathered tensor at a time (never the whole fp32 model)."""
    model = value_model
    if dist.world_size > 1:  # a collective
        model = load_value_model(args.value_backbone, Dist(0, 1, 1, dist.device, True), args, train=False)
        own = model.state_dict()
        [own[name].copy_(tensor) for name, tensor in full_state_dict_items(value_model)]  # fp32, each into its dtype

    @torch.no_grad()
    def score(texts: list[str]) -> list[float]:
        training, size = model.training, args.value_micro_batch_size
        values = [v for i in range(0, len(texts), size)
                  for v in value_forward(model.eval(), tokenizer, texts[i : i + size], args).tolist()]
        model.train(training)
        return values

    return score


def value_forward(model, tokenizer, texts: list[str], args: Args) -> torch.Tensor:
    """V(s) of a batch of states (value_model.py): the final hidden state of each left-padded prompt's last token (its
    last value_max_length tokens) through the head in fp32 and a sigmoid; positions count real tokens only."""
    enc = tokenizer([VALUE_PROMPT.format(state=t) for t in texts], return_tensors="pt", padding=True,
                    truncation=True, max_length=args.value_max_length).to(next(model.parameters()).device)
    mask = enc["attention_mask"]
    out = model(input_ids=enc["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return torch.sigmoid(model.value_head(out.hidden_states[-1][:, -1].float())).squeeze(-1)


def train_value(value_model, optimizer, tokenizer, labels: list[tuple[str, float]], args: Args, dist: Dist,
                rng: random.Random) -> dict[str, float]:
    """Step 3 (value_model_sft.yaml, prepare_value_data.py): value_epochs shuffled epochs over the labels so far, each
    positive positive_oversample times; the mean squared error of V(s); the HF trainer's schedule over these steps."""
    data = [x for x in labels for _ in range(args.positive_oversample if x[1] > 0 else 1)]
    per_epoch = -(-len(data) // args.value_batch_size)
    total, stats = args.value_epochs * per_epoch, []
    for step in range(total):
        if step % per_epoch == 0:
            order = rng.sample(data, len(data))
        batch = order[(step % per_epoch) * args.value_batch_size : (step % per_epoch + 1) * args.value_batch_size]

        def loss_fn(micro: list[tuple[str, float]]) -> tuple[torch.Tensor, dict]:  # the batch's mean squared error
            values = value_forward(value_model, tokenizer, [text for text, _ in micro], args)
            return value_loss(values, values.new_tensor([label for _, label in micro])) / len(batch), {}

        lr = lr_at(step, total, args.value_learning_rate, args.value_warmup_steps, args.value_lr_schedule)
        stats.append(train_step(value_model, optimizer, batch, loss_fn, args.value_micro_batch_size, args.max_grad_norm,
                                dist, length=lambda x: len(x[0]), lr=lr))
    return {"losses/value_loss_first_epoch": float(np.mean([s["loss"] for s in stats[:per_epoch]])),
            "losses/value_loss": float(np.mean([s["loss"] for s in stats[-per_epoch:]])),
            "losses/value_grad_norm": float(np.mean([s["grad_norm"] for s in stats])),
            "value/steps": float(total), "value/examples": float(len(data))} if data else {}


def grpo_update(policy, optimizer, groups: list[list[Attempt]], args: Args, dist: Dist, lr: float | None = None
                ) -> dict[str, float]:
    """Step 4, GRPO on one rollout batch (train_step_grpo.sh, no KL, no entropy bonus): grpo_minibatches optimizer
    steps; a sample with advantage 0 adds no gradient and is not run, but its tokens count in the denominator."""
    items = [(a.sample, adv) for row in groups for a, adv in zip(row, group_advantages([a.correct for a in row]))]
    size, stats = -(-len(items) // args.grpo_minibatches), []
    for minibatch in [items[i : i + size] for i in range(0, len(items), size)]:
        n_tokens = sum(len(s.token_ids) for s, _ in minibatch)

        def loss_fn(micro: list[tuple[Sample, float]]) -> tuple[torch.Tensor, dict]:
            logp, mask, _ = token_logprobs(policy, [s for s, _ in micro], args.temperature)
            pad = torch.nn.functional.pad  # pi_old: the sampler's log-probs, padded as logp
            old = torch.stack([pad(logp.new_tensor(s.logprobs), (0, len(logp[0]) - len(s.logprobs))) for s, _ in micro])
            loss, held = clip_higher_loss(logp, old, mask, logp.new_tensor([adv for _, adv in micro]), n_tokens,
                                          args.eps_clip, args.eps_clip_high)
            return loss, {"clipfrac": held.item() / n_tokens}

        if train := [(s, adv) for s, adv in minibatch if abs(adv) > 1e-8 and s.token_ids]:
            stats.append(train_step(policy, optimizer, train, loss_fn, args.micro_batch_size, args.max_grad_norm, dist,
                                    length=lambda x: len(x[0].prompt_ids) + len(x[0].token_ids), lr=lr))
    return {f"losses/grpo_{k}": float(np.mean([s[k] for s in stats])) for k in ("loss", "clipfrac", "grad_norm")} | {
        "losses/grpo_steps": float(len(stats))} if stats else {}


# ---- evaluation ----
def search_metrics(results: list[SearchResult], prefix: str, seconds: float, budget: float) -> dict[str, float]:
    """Search efficiency: the theorems proved (count, share, per expansion and per second of search), the expansions and
    nodes per proof, the proofs' length, the share of failed edges, the seconds searches ran past the budget; the
    method's own: merged states. `seconds`: the phase's wall time (lockstep searches overlap); `budget`: the limit."""
    proved = [r for r in results if r.proof is not None]
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
    expansions = sum(r.expansions for r in results)
    return {f"{prefix}/theorems": float(len(results)), f"{prefix}/proved": float(len(proved)),
            f"{prefix}/proved_share": len(proved) / max(len(results), 1),
            f"{prefix}/proofs_per_expansion": len(proved) / max(expansions, 1),
            f"{prefix}/proofs_per_second": len(proved) / seconds if seconds else 0.0,
            f"{prefix}/expansions_per_proof": mean([r.expansions for r in proved]),
            f"{prefix}/nodes_per_proof": mean([r.nodes for r in proved]),
            f"{prefix}/proof_length": mean([len(r.proof) for r in proved]),
            f"{prefix}/expansions": float(expansions),
            f"{prefix}/failed_edge_share": sum(r.failed_edges for r in results) / max(sum(r.edges for r in results), 1),
            f"{prefix}/overshoot_max": max([r.seconds - budget for r in results] + [0.0]),
            f"{prefix}/overshoot_mean": mean([max(r.seconds - budget, 0.0) for r in results]),
            f"{prefix}/merged_states": float(sum(r.merged for r in results))}


def evaluate(sampler, verifier, problems: list[Problem], score, key: str, args: Args, dist: Dist) -> dict[str, float]:
    """Step 5 (evaluate.py): pass@k (unbiased) from eval_samples whole proofs per problem at eval_temperature; search
    efficiency on the first eval_search_limit problems, value-guided (with a value model) and log-prob only."""
    attempts = attempt_proofs(sampler, verifier, problems, args.eval_samples, args.eval_temperature, key, args, dist)
    correct = [(len(row), sum(a.correct for a in row)) for row in attempts]
    metrics = {f"eval/pass@{k}": float(np.mean([pass_at_k(n, c, k) for n, c in correct]))
               for k in args.eval_budgets if k <= args.eval_samples}
    subset = problems[: args.eval_search_limit] if args.eval_search_limit is not None else problems
    for name, fn in [("value", score), ("logprob", None)][0 if score else 1 :] if subset else []:
        start = time.monotonic()
        results = search(sampler, verifier, subset, fn, f"{key}/{name}", args, dist)
        metrics |= search_metrics(results, f"eval/search_{name}", time.monotonic() - start, args.search_timeout)
    return metrics


def nothing_learned(outcomes: collections.Counter, args: Args) -> str:
    """A run's last line when no GRPO rollout was rewarded (the CPU default on the embedded model): why."""
    why = {"no_code": "no closed ```lean4 block", "error": "Lean error", "sorry": "sorry", "timeout": "Lean timeout"}
    verdicts = ", ".join(f"{count}/{sum(outcomes.values())} {why.get(s, s)}" for s, count in outcomes.most_common())
    return (f"coprover.py: every GRPO reward was 0 ({verdicts}): {args.model} wrote no proof Lean accepts, so no "
            "group's rewards differed and the prover was never updated; tests/test_coprover.py::"
            "test_loop_learns_what_the_stand_in_rewards shows this loop learning, on a model primed to write proofs")


# ---- main ----
class Tokenizers(dict):  # save_checkpoint writes a tokenizer into every model's directory: here each model's own
    def save_pretrained(self, path) -> None:
        self[pathlib.Path(path).name].save_pretrained(path)


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
    problems = load_problems(args.dataset, args.num_problems)
    benchmark = load_problems(args.eval_dataset, args.eval_limit, split=args.eval_split)

    # the models (method: the prover, trained by GRPO and sampled; the value model, trained by regression)
    tokenizer, value_tokenizer = load_tokenizer(args.model), load_tokenizer(args.value_backbone)
    value_tokenizer.truncation_side = "left"  # a long state keeps the end of its prompt, where the head reads
    adamw = functools.partial(torch.optim.AdamW, betas=args.adam_betas, weight_decay=args.weight_decay)
    policy = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    models = {"prover": (policy, adamw(policy.parameters(), args.learning_rate))}
    if args.value_model:
        value_model = load_value_model(args.value_backbone, dist, args)
        models["value"] = (value_model, adamw([p for p in value_model.parameters() if p.requires_grad],
                                              args.value_learning_rate))
    # run state: the labelled states of all iterations, the GRPO rollout counter, the frontier, value trainings done
    start, state = 0, {"labels": [], "grpo_step": 0, "frontier": None, "value_rounds": 0}
    if args.resume and (found := load_checkpoint(run_dir, models, dist)) is not None:
        start, state = found
    sampler = Sampler(args.model, policy, tokenizer, dist, args.backend, args.max_model_len,
                      args.gpu_memory_utilization, args.vllm_sleep, seed=args.seed)
    score = value_scorer(value_model, value_tokenizer, args, dist) if args.value_model else None  # V for the search
    if args.frontier_filter and state["frontier"] is None and start < args.iterations:  # data prep (filter_dataset.py)
        with logger.timer("frontier"):
            state["frontier"] = frontier_filter(sampler, verifier, problems, args, dist)
    frontier = None if state["frontier"] is None else set(state["frontier"])
    if not (train_set := [p for p in problems if frontier is None or p.id in frontier]) and start < args.iterations:
        sys.exit(f"coprover.py: no training statement left (frontier: {args.frontier_min}..{args.frontier_max} of "
                 f"{args.frontier_samples} proved); --no-frontier-filter trains on all of them")

    outcomes, rewarded = collections.Counter(), 0  # this run's GRPO rollouts by Lean's verdict, and those rewarded
    for iteration in range(start, args.iterations):
        metrics, rng = {"charts/train_statements": float(len(train_set))}, random.Random(f"{args.seed}/{iteration}")

        # 1. Search: value-guided best-first search (log-prob only until a value model has been trained)
        with logger.timer("search"):
            guided = args.value_model and state["value_rounds"] > 0
            theorems = rng.sample(train_set, min(args.search_theorems_per_round, len(train_set)))
            results = search(sampler, verifier, theorems, score if guided else None, f"{args.seed}/{iteration}/search",
                             args, dist)
        metrics |= search_metrics(results, "search", logger.times["time/search"], args.search_timeout) | {
            "search/value_guided": float(guided)}  # proofs per second of the phase's wall time

        # 2. Labels: gamma^d on every state of a found proof, 0 off them (the whole proofs' labels come with step 4)
        state["labels"] += (new_labels := [label for r in results for label in r.labels])

        # 3. The value model: regression on all labels so far (--no-co-training: only once)
        if args.value_model and (args.co_training or state["value_rounds"] == 0) and state["labels"]:
            with logger.timer("value"):
                sampler.sleep()
                metrics |= train_value(*models["value"], value_tokenizer, state["labels"], args, dist,
                                       random.Random(f"{args.seed}/{iteration}/value"))
                score = value_scorer(value_model, value_tokenizer, args, dist)
                state["value_rounds"] += 1

        # 4. The prover: GRPO on whole proofs; their verified proofs are replayed for labels
        with logger.timer("grpo"):
            stats, attempts = [], []
            sampler.sync_weights(policy)  # wakes vLLM (asleep since the value update) with the prover's weights
            for _ in range(args.grpo_steps_per_round):
                batch = rollout_prompts(train_set, state["grpo_step"], args.prompts_per_step, args.seed)
                groups = attempt_proofs(sampler, verifier, batch, args.samples_per_prompt, args.temperature,
                                        f"{args.seed}/grpo{state['grpo_step']}", args, dist)
                labels = whole_proof_labels(verifier, batch, groups, args, dist)
                state["labels"], new_labels = state["labels"] + labels, new_labels + labels
                sampler.sleep()
                lr = lr_at(state["grpo_step"], args.iterations * args.grpo_steps_per_round, args.learning_rate,
                           args.warmup_steps, args.lr_schedule)
                stats.append(grpo_update(*models["prover"], groups, args, dist, lr))
                sampler.sync_weights(policy)
                state["grpo_step"], attempts = state["grpo_step"] + 1, attempts + [a for row in groups for a in row]
            statuses = [a.status for a in attempts]
            outcomes, rewarded = outcomes + collections.Counter(statuses), rewarded + sum(a.correct for a in attempts)
            metrics |= {k: float(np.mean([s[k] for s in stats if k in s])) for k in set().union(*stats)} | {
                "charts/reward_mean": float(np.mean([a.correct for a in attempts] or [0.0])),
                "charts/grpo_steps": float(len(stats)),
                "charts/grpo_tokens": float(sum(len(a.sample.token_ids) for a in attempts)),
                **{f"lean/{s}_share": statuses.count(s) / len(statuses) for s in sorted(set(statuses))}}
        metrics |= {"value/new_labels": float(len(new_labels)), "value/labels": float(len(state["labels"])),
                    "value/new_positive_share": float(np.mean([y > 0 for _, y in new_labels] or [0.0])),
                    "value/new_label_mean": float(np.mean([y for _, y in new_labels] or [0.0]))}

        # 5. Evaluate: pass@k on the benchmark, search efficiency with and without the value model
        if args.eval_every and (iteration + 1) % args.eval_every == 0 or iteration + 1 == args.iterations:
            with logger.timer("eval"):
                metrics |= evaluate(sampler, verifier, benchmark, score if state["value_rounds"] else None,
                                    f"{args.seed}/{iteration}/eval", args, dist)
        logger.log(metrics, step=iteration + 1)
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.iterations:
            save_checkpoint(run_dir, iteration + 1, models, Tokenizers(prover=tokenizer, value=value_tokenizer), state,
                            dist)
    if start >= args.iterations:  # nothing to train (--iterations 0, or a finished run): evaluate the model as given
        if score and not state["value_rounds"] and not value_model.value_head.trained:  # a seed-0 head guides nothing
            score = None
            print(f"coprover.py: {args.value_backbone} has no trained value head (a coprover checkpoint's value/ has): "
                  "the evaluation searches by log-prob only") if dist.is_main else None
        logger.log(evaluate(sampler, verifier, benchmark, score, f"{args.seed}/eval", args, dist), step=args.iterations)
    if dist.is_main and outcomes and not rewarded:  # what a run that never rewarded a proof shows (issue 21.5)
        print(nothing_learned(outcomes, args))
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
