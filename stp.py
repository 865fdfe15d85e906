"""STP: the Self-play Theorem Prover, iterative conjecturing and proving in Lean 4.

Paper: Dong, Ma, "Beyond Limited Data: Self-play LLM Theorem Provers with Iterative Conjecturing and Proving",
arXiv 2502.00212 (ICML 2025). Official code: github.com/kfdong/STP (read at 2b5fe8b; this file copies none of it).

Method. One base model (DeepSeek-Prover-V1.5-SFT) plays two roles: the prover writes whole Lean 4 proofs; the
conjecturer reads a proved statement, its proof and a Mathlib lemma it used (<lemma>, <easy theorem>) and writes a
harder one (<hard theorem>). The statements: LeanWorkbook. Each iteration (the paper's word: round; Stage 2):
  1. seeds: the proofs of dataset statements proved at a rate above 0.35, each with a lemma it invokes;
  2. conjecture: new statements from the seeds, deduplicated;
  3. prove: 64 samples (iteration 0) or 32 for every unproved statement, every conjecture and a few proved ones;
  4. the conjecturer learns from barely provable conjectures (solve rate 0 < s < 1/4) minus the least elegant of
     each lemma group, re-weighted toward the unproved statements (embedding matching, weight at most 4);
  5. the prover learns from the last 3 iterations' correct proofs of statements with s <= 1/2, weighted by
     exp(-0.001 length - 0.01 verification seconds) / #correct proofs; one weighted-SFT epoch on both sets.
Stage 3 (--final-retrain) re-trains DeepSeek-Prover-V1.5-SFT on the mathlib SFT data and the proofs of all rounds.
The metric: pass@k on miniF2F and ProofNet, up to 3200 samples per problem.
Where the paper is silent or differs, this file follows the official code, but for the deviations below.

Run (needs Lean: `bash setup.sh --lean`): without CUDA this file runs a loop scaled down by CPU_DEFAULTS (SmolLM2-135M,
data/lean_smoke.jsonl); under `torchrun --nproc_per_node 8` on 8xH200, the paper's sizes. Experiment map: README.md.

Deliberate deviations from the official code:
  1. Generation and verification are not pipelined; sampling is seeded by position; a (problem, proof) is checked once.
  2. Lean 4.15 and the upstream REPL (lean_verify), not Lean 4.9 and DeepSeek's fork.
  3. No Stage 1 (SFT on kfdong/STP_Lean_SFT, which teaches the conjecturing format): pass its checkpoint as --model.
  4. The lemmas a proof invokes come from a static scan (lean_verify.invoked_lemmas), not from DeepSeek's REPL fork.
  5. The conjecturer trains on the prompt it samples from (the official generation prompt lacks its header lines).
  6. A seed proof draws the empty lemma afresh each round (official: once drawn, in every later round).
  7. With no unproved statement left to match, every conjecture keeps weight 1 (official: weight 0, none is kept).
  8. A batch is min(batch_size, #examples) sequences; the prover's target is proof, fence, EOS (official: proof, EOS).
  9. ProofNet statements ending in ':=' get ':= by': the verifier checks tactic proofs.
  10. The statements: internlm/Lean-Workbook's train split or any .jsonl, not STP's unreleased lean_workbook_dedup.json.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import gc
import importlib.util
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

from lean_verify import (LeanNotInstalled, LeanVerifier, Problem, extract_conjecture, extract_proof, invoked_lemmas,
                         load_problems, read_rows)


# The miniF2F text STP was evaluated on (its own file, MIT, fetched at run time; its ProofNet is data/proofnet.jsonl's).
STP_MINIF2F = ("https://raw.githubusercontent.com/kfdong/STP/2b5fe8b6dbc51afae00cba0a06e253270d7f04d4/"
               "assets/data/test/miniF2F_lean.json")


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
    model: str = "deepseek-ai/DeepSeek-Prover-V1.5-SFT"
    """the policy: a Hugging Face id, a local path, or embedded:smollm2 (the CPU default)"""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """sampler: vLLM when CUDA and vllm are present (auto), else transformers"""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of GPU memory (it sleeps while the policy trains)"""
    vllm_sleep: bool = True
    """put vLLM to sleep during training (level 2) and wake it with fresh weights"""
    max_model_len: int = 1024  # official vLLM max_model_len
    """longest prompt + completion, in tokens"""
    gradient_checkpointing: bool = True
    """activation checkpointing in training"""
    lean_workers: int | None = None
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of the machine)"""
    lean_timeout: float = 200.0
    """Lean's wall-clock limit per proof, in seconds"""

    # data
    dataset: str = "internlm/Lean-Workbook"
    """statements to prove (LeanWorkbook): a Hugging Face dataset or a .jsonl, with formal_statement (and header)"""
    num_problems: int | None = None
    """use only the first N problems of --dataset (default all)"""

    # algorithm
    iterations: int = 12
    """self-play iterations to run (the paper's word: rounds; run_RL_steps.sh's TOTAL_ROUNDS); 0: evaluate --model"""
    samples_first_round: int = 64
    """proofs sampled per statement in iteration 0"""
    samples_per_round: int = 32
    """proofs sampled per statement in later iterations"""
    generation_folds: int = 5
    """with vLLM a rank generates its share of the proofs in this many calls (official NR_FOLD, pipelined)"""
    temperature: float = 1.0
    """sampling temperature of every role"""
    top_p: float = 1.0
    """nucleus sampling"""
    max_new_tokens: int = 1024
    """longest proof or conjecture, in tokens"""
    max_prompt_tokens: int = 1024
    """prompts are cut to their last this many tokens"""
    solve_rate_max: float = 0.5
    """the prover learns from proofs of statements with solve rate <= this over the replay buffer"""
    conjecture_band: float = 0.25
    """the conjecturer learns from conjectures with solve rate in (0, this)"""
    seed_threshold: float = 0.35
    """seeds: dataset statements proved with a solve rate above this in some iteration"""
    empty_lemma_prob: float = 0.5
    """probability that a seed proof is also paired with the empty lemma (no shared lemma)"""
    lemma_use_cap: float = 0.1
    """one lemma is shared by at most this fraction of #statements seeds"""
    max_conjecture_multiplier: int = 8
    """conjectures per seed: max(1, min(3 #statements / #seeds, this))"""
    proved_keep_prob: float = 0.05
    """a proved statement is re-proved with this probability (or while its solve rate is below seed_threshold)"""
    replay_rounds: int = 3
    """iterations of proofs in the replay buffer"""
    length_penalty: float = 0.001
    """prover weight exp(-length_penalty * characters - time_penalty * seconds) / #correct"""
    time_penalty: float = 0.01
    """per second of Lean verification"""
    elegance_quantile: float = 0.2
    """drop the conjectures whose proof/statement length ratio is below sorted(group)[int(this * size)]"""
    matching_cap: float = 4.0
    """distribution matching: a conjecture's weight stops growing at this value"""
    embedding_max_tokens: int = 512
    """statements are embedded from their first this many tokens"""
    learning_rate: float = 5e-5
    """learning rate of each iteration's weighted SFT (run_RL_steps.sh)"""
    batch_size: int = 2048
    """sequences per optimizer step"""
    micro_batch_size: int = 4
    """sequences per forward/backward pass on each rank"""
    warmup_steps: int = 5
    """linear warm-up steps from 0"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """learning-rate schedule after the warm-up (lr_at)"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas"""
    adam_eps: float = 1e-5
    """Adam epsilon"""
    min_train_steps: int = 5
    """optimizer steps per iteration: max(#examples // batch_size, this)"""
    max_train_tokens: int = 2048
    """training sequences (prompt + target) are cut to this many tokens"""

    # Stage 3
    final_retrain: bool = False
    """Stage 3 after the iterations: re-train --final-model on the SFT data and the correct proofs of every round"""
    final_model: str = "deepseek-ai/DeepSeek-Prover-V1.5-SFT"
    """Stage 3 re-trains this model (run_RL_train.sh); it must share --model's architecture and tokenizer"""
    final_sft_dataset: str = "kfdong/STP_Lean_SFT"
    """Stage 3 also trains on its rows (prompt, target[, weight]) but LeanWorkbook's (mathlib.json); '' for none"""
    final_learning_rate: float = 1e-4
    """Stage 3 learning rate (run_RL_train.sh)"""
    final_solve_rate_max: float = 0.25
    """Stage 3 keeps the proofs of a round whose statement's solve rate in it is <= this (dataset statements: all)"""
    final_max_proofs: int = 16
    """Stage 3 and expert iteration: distinct proofs kept per statement"""
    final_min_train_steps: int = 10
    """Stage 3 and expert iteration: optimizer steps max(#examples // batch_size, this)"""

    # ablations
    expert_iteration: bool = False
    """baseline: sample only unproved statements (64 each), re-train the base model on all correct proofs every round"""
    pure_sampling: bool = False
    """baseline: sample only unproved statements (64 each) with the base model, no training"""

    # evaluation
    eval_datasets: tuple[str, ...] = (STP_MINIF2F, "data/proofnet.jsonl")
    """benchmarks (.json/.jsonl, local or URL, with formal_statement, split[, name, header]); logged by file name"""
    eval_split: str = "test"
    """which split of each benchmark"""
    eval_samples: int = 3200
    """samples per benchmark problem"""
    eval_budgets: tuple[int, ...] = (1, 32, 128, 640, 3200)
    """k of the reported pass@k"""
    eval_limit: int | None = None
    """use only the first N problems of each benchmark"""
    eval_every: int = 0
    """evaluate every this many iterations and after the last (0: only after the last)"""


# An iteration on a CPU in about five minutes (SmolLM2-135M: 64 proofs of <= 96 tokens ~100 s, a training step ~30 s);
# fewer than 5 samples per statement would leave the band 0 < p < 1/4 empty. It evaluates on the built-in text.
CPU_DEFAULTS = dict(model="embedded:smollm2", final_model="embedded:smollm2", dataset="data/lean_smoke.jsonl",
                    num_problems=8, iterations=2, samples_first_round=8, samples_per_round=8, max_new_tokens=96,
                    max_prompt_tokens=512, embedding_max_tokens=128, batch_size=8, min_train_steps=1,
                    final_min_train_steps=1, warmup_steps=0, final_sft_dataset="data/stp_mathlib_sft.jsonl",
                    eval_datasets=("data/minif2f.jsonl", "data/proofnet.jsonl"), eval_samples=4,
                    eval_budgets=(1, 2, 4), eval_limit=4)


# ---- prompts ----
# Raw completion prompts, no chat template: DeepSeek-Prover-V1.5's non-CoT format; the prover closes the fence, the
# conjecturer continues after <hard theorem> with a new statement and </hard theorem>.
PROVER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}{statement}"
CONJECTURER_PROMPT = ("Complete the following Lean 4 code:\n\n```lean4\n{header}"
                      "<lemma>\n{lemma}\n<easy theorem>\n{seed}\n<hard theorem>")
END_THM = "</hard theorem>"
BANNED = ("<lemma>", "<easy theorem>", "<hard theorem>")  # prompt markers a conjecture may not hold
EMPTY_LEMMA = "theorem true: True"


def truncate_left(tokenizer, text: str, max_tokens: int) -> str:
    """The text cut to its last max_tokens tokens (official: the tokenizer with truncation_side='left')."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[-max_tokens:])


def prover_prompt(tokenizer, problem: Problem, args: Args) -> str:
    text = PROVER_PROMPT.format(header=problem.header, statement=problem.statement)
    return truncate_left(tokenizer, text, args.max_prompt_tokens)


def conjecturer_prompt(tokenizer, header: str, lemma: str, easy_theorem: str, args: Args) -> str:
    """A shared lemma, by name (deviation 4) or the trivial theorem for none, and a proved statement with its proof."""
    lemma = f"theorem {lemma}" if lemma else EMPTY_LEMMA
    return truncate_left(tokenizer, CONJECTURER_PROMPT.format(header=header, lemma=lemma, seed=easy_theorem),
                         args.max_prompt_tokens)


# ---- data ----
# Problem(id, header, statement): a Lean 4 task of lean_verify (load_problems reads the usual datasets' rows). A
# conjecture also keeps its prompt's <easy theorem> and lemma ('' for none).
Conjecture = collections.namedtuple("Conjecture", Problem._fields + ("easy_theorem", "lemma"))
# A whole-proof attempt: its Sample (or None), the tactics after ':= by' (or None), Lean's status, verdict and seconds.
Attempt = collections.namedtuple("Attempt", "sample proof status correct seconds", defaults=(0.0,))
# A training sequence: a Sample (prompt and target tokens) and its weight.
Example = collections.namedtuple("Example", "sample weight")


def text_example(tokenizer, prompt: str, target: str, weight: float, args: Args) -> Example:
    """The prompt's tokens, then the target's and end of sequence, cut to max_train_tokens."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example(Sample(target, prompt_ids, target_ids[: max(1, args.max_train_tokens - len(prompt_ids))], [],
                          "stop"), weight)


# ---- rewards ----
def solve_rate(attempts: list[Attempt]) -> float:
    """A problem's solve rate s: the share of its attempts that Lean accepted."""
    return sum(a.correct for a in attempts) / len(attempts) if attempts else 0.0


def best_rate(history: dict, pid: str) -> float:
    """A statement's solve rate in its best iteration (official succ_rates)."""
    return max((c / n for n, c in history.get(pid, {}).values() if n), default=0.0)


def proof_weight(proof_chars: int, verify_seconds: float, n_correct: int, args: Args) -> float:
    """A correct proof's weight exp(-0.001 length - 0.01 Lean seconds) / #correct proofs of its statement."""
    return math.exp(-args.length_penalty * proof_chars - args.time_penalty * verify_seconds) / n_correct


def elegance_filter(groups: list, ratios: list[float], quantile: float = 0.2) -> list[bool]:
    """Official filter_by_ratio: drop a ratio below its group's sorted(ratios)[int(size * quantile)] (size >= 2)."""
    group = {g: sorted(r for x, r in zip(groups, ratios) if x == g) for g in set(groups)}
    return [len(group[g]) < 2 or r >= group[g][int(len(group[g]) * quantile)] for g, r in zip(groups, ratios)]


def matching_weights(P: torch.Tensor, Q: torch.Tensor, cap: float = 4.0, rng: random.Random | None = None
                     ) -> list[float]:
    """Each unproved statement Q[q], in random order, gives N/M to its nearest conjecture P[j] below `cap`."""
    n, m = len(P), len(Q)
    if n == 0 or m == 0:
        return [1.0] * n  # deviation 7
    sim, weights, full, order = (P @ Q.T).float(), [0.0] * n, torch.zeros(n, dtype=torch.bool), list(range(m))
    (rng or random.Random(0)).shuffle(order)
    for q in order:
        if bool(full.all()):
            break
        j = int(sim[:, q].masked_fill(full, float("-inf")).argmax())
        weights[j] += n / m
        full[j] = weights[j] >= cap
    return weights


# ---- losses ----
def weighted_sft_loss(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, weighted_tokens: float
                      ) -> torch.Tensor:
    """Weighted SFT (official: Levanter): -sum_i w_i sum_t log pi(y_it) / sum_i w_i |y_i| of the batch."""
    return -(weights[:, None] * logp * mask).sum() / weighted_tokens


# ---- phases ----
def select_seeds(statements: list[Problem], proofs: dict, history: dict, args: Args, rng: random.Random
                 ) -> list[tuple[Problem, str, str]]:
    """Official Sampler_base.select: the proofs of statements with a best solve rate above 0.35, shuffled, each with
    its invoked lemmas and (p = 1/2) the empty one; a lemma in at most 10% of #statements seeds; #statements at most."""
    candidates = [(s, p["proof"]) for s in statements if best_rate(history, s.id) > args.seed_threshold
                  for p in proofs.get(s.id, [])]
    rng.shuffle(candidates)  # official: then sorted by conjecture level, 0 for every dataset statement
    uses, pairs, seeds = collections.Counter(), set(), []
    for statement, proof in candidates:
        empty = [""] if rng.random() < args.empty_lemma_prob else []  # drawn afresh each round (deviation 6)
        for lemma in invoked_lemmas(proof, statement.statement) + empty:
            if uses[lemma] < args.lemma_use_cap * len(statements) and (statement.id, lemma) not in pairs:
                pairs.add((statement.id, lemma))
                uses[lemma] += 1
                seeds.append((statement, proof, lemma))
    return seeds[: len(statements)]


def conjecture(sampler, tokenizer, seeds: list[tuple[Problem, str, str]], statements: list[Problem], problems: dict,
               iteration: int, args: Args, dist: Dist, rng: random.Random) -> tuple[list[Conjecture], dict]:
    """max(1, min(3 #statements / #seeds, 8)) samples per seed, parsed, shuffled, deduplicated against the dataset and
    each other, at most #statements. A statement conjectured before keeps its id (official lemma_id)."""
    if not seeds:
        return [], {"conjecturer/seeds": 0, "conjecturer/outputs": 0}
    multiplier = max(1, min(3 * len(statements) // len(seeds), args.max_conjecture_multiplier))
    prompts = [conjecturer_prompt(tokenizer, s.header, lemma, s.statement + proof, args) for s, proof, lemma in seeds]
    outputs = sample(sampler, prompts, multiplier, f"{args.seed}/{iteration}/conjecture", dist,
                     lambda _, rows: [[extract_conjecture(s.text, END_THM, s.finish_reason, BANNED) for s in row]
                                      for row in rows], temperature=args.temperature, top_p=args.top_p,
                     max_new_tokens=args.max_new_tokens, stop=[END_THM], desc="conjecture", logprobs=False)
    found = [(seed, x) for seed, row in zip(seeds, outputs) for x in row if x is not None]
    rng.shuffle(found)
    seen = {(s.header, s.statement.replace(" ", "").replace("\n", "")) for s in statements}  # official: no spaces
    ids, new = {p.statement: k for k, p in problems.items()}, []
    for (seed, proof, lemma), statement in found:
        if (key := (seed.header, statement.replace(" ", "").replace("\n", ""))) not in seen:
            seen.add(key)
            new.append(((seed, proof, lemma), statement))
    if len(new) > len(statements):
        rng.shuffle(new)
    conjectures = [Conjecture(ids.get(x, f"r{iteration}_c{i}"), seed.header, x, seed.statement + proof, lemma)
                   for i, ((seed, proof, lemma), x) in enumerate(new[: len(statements)])]
    n_out = sum(len(row) for row in outputs)
    return conjectures, {"conjecturer/outputs": n_out, "conjecturer/extraction_rate": len(found) / max(n_out, 1),
                         "conjecturer/new_conjectures": len(conjectures),
                         "conjecturer/seeds": len(seeds), "conjecturer/multiplier": multiplier,
                         "conjecturer/with_lemma_share": float(np.mean([bool(c.lemma) for c in conjectures] or [0.0]))}


def select_targets(statements: list[Problem], conjectures: list[Conjecture], proofs: dict, history: dict,
                   seeded: bool, args: Args, rng: random.Random) -> list[Problem]:
    """Official Sampler_base.select: unproved statements and conjectures, proved statements with a best solve rate
    below 0.35 or drawn (p = 0.05); all statements when there is no seed; the baselines' (Sampler_naive): unproved."""
    unproved = [s for s in statements if not proofs.get(s.id)]
    if args.expert_iteration or args.pure_sampling:
        return unproved
    if not seeded:
        return statements
    return unproved + [c for c in conjectures if not proofs.get(c.id)] + [
        s for s in statements if proofs.get(s.id) and (rng.random() < args.proved_keep_prob
                                                       or best_rate(history, s.id) < args.seed_threshold)]


def attempt_proofs(sampler, verifier, tokenizer, problems: list[Problem], n: int, key: str, args: Args, dist: Dist
                   ) -> dict[str, list[Attempt]]:
    """n whole proofs per problem (vLLM: a rank's share in generation_folds calls, official NR_FOLD). Each distinct
    (problem, proof) pair is checked once by Lean, on the rank that sampled it, against the original statement."""
    prompts = [prover_prompt(tokenizer, p, args) for p in problems]

    def check(start: int, rows: list[list[Sample]]) -> list[list[Attempt]]:  # a failed sample has nothing to check
        proofs = [[extract_proof(s.text) if s.finish_reason in ("stop", "length") else None
                   for s in row] for row in rows]
        verdicts = verifier.verify_attempts(problems[start : start + len(rows)], proofs)
        found = [[(v.status, v.valid, v.time) if v else ("no_code", False) for v in row] for row in verdicts]
        # 3200 samples per benchmark problem: an attempt keeps no Sample, and a proof only when it is correct
        return [[Attempt(None, x if v[1] else None, *v) for x, v in zip(*r)] for r in zip(proofs, found)]

    rows = sample(sampler, prompts, n, key, dist, check, temperature=args.temperature, top_p=args.top_p,
                  max_new_tokens=args.max_new_tokens, stop=["\n```"], logprobs=False, calls=args.generation_folds)
    return {p.id: row for p, row in zip(problems, rows)}


def record_proofs(history: dict, proofs: dict, attempts: dict[str, list[Attempt]], iteration: int) -> None:
    """Each statement's (samples, correct) per iteration, and per iteration its distinct correct proofs with their Lean
    time (official: a round's verified samples; a proof found again in a later round is a new entry)."""
    for pid, row in attempts.items():
        history.setdefault(pid, {})[iteration] = (len(row), sum(a.correct for a in row))
        found = {a.proof: a.seconds for a in row if a.correct}
        proofs.setdefault(pid, []).extend({"proof": x, "iteration": iteration, "seconds": t} for x, t in found.items())


def prover_examples(problems: dict, history: dict, proofs: dict, iteration: int, args: Args, tokenizer
                    ) -> list[Example]:
    """The prover's data (official RL_step2_train): the correct proofs of the last 3 iterations of statements with
    solve rate in (0, 1/2] over them; one example a proof (its newest Lean time), #correct counting each iteration's."""
    examples = []
    for pid, rounds in history.items():
        window = [v for r, v in rounds.items() if iteration - args.replay_rounds < r <= iteration]  # (samples, correct)
        n, c = sum(v[0] for v in window), sum(v[1] for v in window)
        if n == 0 or c == 0 or c / n > args.solve_rate_max:
            continue
        recent = [p for p in proofs.get(pid, []) if iteration - args.replay_rounds < p["iteration"] <= iteration]
        newest = {p["proof"]: p for p in sorted(recent, key=lambda p: p["iteration"])}
        prompt = prover_prompt(tokenizer, problems[pid], args)
        examples += [text_example(tokenizer, prompt, p["proof"] + "\n```",
                                  proof_weight(len(p["proof"]), p["seconds"], len(recent), args), args)
                     for p in newest.values()]
    return examples


@torch.no_grad()
def embed(policy, tokenizer, texts: list[str], args: Args, dist: Dist) -> torch.Tensor:
    """Sentence embeddings (official): normalised mean of the last hidden states; the same on every rank."""
    training, mine = policy.training, []
    policy.eval()
    for batch, real in micro_batches(texts, args.micro_batch_size, dist):  # as many forwards on every rank (FSDP2)
        enc = tokenizer(batch, return_tensors="pt", padding=True, truncation=True,
                        max_length=args.embedding_max_tokens).to(dist.device)
        hidden = policy(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True,
                        use_cache=False).hidden_states[-1].float()
        mask = enc["attention_mask"][..., None]
        mine += list(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).cpu()) if real else []
    policy.train(training)
    parts = all_gather_objects(mine, dist)  # rank r embedded texts r, r + world size, ...
    rows = [parts[i % dist.world_size][i // dist.world_size] for i in range(len(texts))]
    return torch.stack(rows) if rows else torch.zeros(0, 1)


def conjecturer_examples(conjectures: list[Conjecture], attempts: dict, proofs: dict, unproved: list[Problem],
                         iteration: int, policy, tokenizer, args: Args, dist: Dist, rng: random.Random
                         ) -> tuple[list[Example], dict]:
    """The conjecturer's data (official Sampler_base.get_conjecture_examples): conjectures with 0 < s < 1/4, with
    their lemma if a proof of this iteration invokes it, but the least elegant (elegance_filter), matching_weights."""
    band = [c for c in conjectures if 0.0 < solve_rate(attempts.get(c.id, [])) < args.conjecture_band]
    invoking = [c for c in band if c.lemma and any(c.lemma in invoked_lemmas(p["proof"], c.statement)
                                                   for p in proofs[c.id] if p["iteration"] == iteration)]
    others = [c for c in band if c not in invoking]
    rng.shuffle(others)
    kept = [(c, c.lemma) for c in invoking] + [(c, "") for c in others[: max(20 * len(invoking), 4096)]]
    ratios = [min(len(p["proof"]) for p in proofs[c.id] if p["iteration"] > iteration - args.replay_rounds)
              / len(c.statement) for c, _ in kept]
    elegant = elegance_filter([lemma for _, lemma in kept], ratios, args.elegance_quantile)
    kept = [k for k, ok in zip(kept, elegant) if ok]
    P = embed(policy, tokenizer, [c.statement for c, _ in kept], args, dist)
    Q = embed(policy, tokenizer, [s.statement for s in unproved], args, dist)
    examples = [text_example(tokenizer, conjecturer_prompt(tokenizer, c.header, lemma, c.easy_theorem, args),
                             "\n" + c.statement + "\n" + END_THM, w, args)
                for (c, lemma), w in zip(kept, matching_weights(P, Q, args.matching_cap, rng)) if w > 0]
    return examples, {"conjecturer/in_band": len(band), "conjecturer/invoking_lemma": len(invoking),
                      "conjecturer/elegant": len(kept), "conjecturer/matched": len(examples)}


def final_examples(problems: dict, history: dict, proofs: dict, originals: set, sft: list[dict], args: Args,
                   tokenizer, rng: random.Random) -> list[Example]:
    """Official RL_step3_final_model: the SFT rows but LeanWorkbook's (mathlib.json), then each iteration's proofs of
    statements with s <= 1/4 in it (dataset statements: all), shuffled, distinct, <= 16 a statement, not SFT's."""
    sft = [r for r in sft if "lean_workbook" not in r["prompt"]]
    examples = [text_example(tokenizer, r["prompt"], r["target"], r.get("weight", 1.0), args) for r in sft]
    found = [(pid, p) for pid, entries in proofs.items() for p in entries if pid in originals
             or history[pid][p["iteration"]][1] / history[pid][p["iteration"]][0] <= args.final_solve_rate_max]
    rng.shuffle(found)
    seen, count = {(r["prompt"], r["target"]) for r in sft}, collections.Counter()
    prompts = {pid: prover_prompt(tokenizer, problems[pid], args) for pid, _ in found}
    for pid, p in found:
        if (prompts[pid], p["proof"]) not in seen and count[pid] < args.final_max_proofs:
            seen.add((prompts[pid], p["proof"]))
            count[pid] += 1
            examples.append(text_example(tokenizer, prompts[pid], p["proof"] + "\n```",
                                         math.exp(-args.length_penalty * len(p["proof"])), args))
    return examples


def update(policy, optimizer, examples: list[Example], lr: float, min_steps: int, args: Args, dist: Dist,
           rng: random.Random) -> dict[str, float]:
    """max(#examples // batch_size, min_steps) steps on passes over the shuffled examples, from a fresh Adam state
    (official: a Levanter run per iteration), a linear warm-up capped at steps - 1, then lr_schedule."""
    optimizer.state.clear()
    size = min(args.batch_size, len(examples))  # a small set is not repeated inside a step (deviation 8)
    steps = max(len(examples) // size, min_steps)
    warmup = min(steps - 1, args.warmup_steps)  # Levanter's: it reaches the peak one step before lr_at's, so both +1
    stream = [e for _ in range(-(-steps * size // len(examples))) for e in rng.sample(examples, len(examples))]
    batches = [stream[i * size : (i + 1) * size] for i in range(steps)]
    stats = []
    for step, batch in enumerate(batches):
        weighted_tokens = sum(e.weight * len(e.sample.token_ids) for e in batch)  # weighted SFT's denominator

        def loss_fn(micro: list[Example]) -> tuple[torch.Tensor, dict]:
            logp, mask, _ = token_logprobs(policy, [e.sample for e in micro])
            return weighted_sft_loss(logp, mask, logp.new_tensor([e.weight for e in micro]), weighted_tokens), {}

        stats.append(train_step(policy, optimizer, batch, loss_fn, args.micro_batch_size, args.max_grad_norm, dist,
                                length=lambda e: len(e.sample.prompt_ids) + len(e.sample.token_ids),
                                lr=lr_at(step + 1, steps + 1, lr, warmup + 1, args.lr_schedule)))
    return {"loss": float(np.mean([s["loss"] for s in stats])), "steps": len(stats),
            "grad_norm": float(np.mean([s["grad_norm"] for s in stats]))}


def retrain_from_base(sampler, base: str, examples: list[Example], lr: float, args: Args, dist: Dist,
                      rng: random.Random) -> tuple[dict, torch.nn.Module, dict]:
    """Stage 3 (and each expert-iteration round): a fresh copy of `base` trained on final_examples."""
    sampler.sleep()
    gc.collect()  # free the old policy (the caller dropped it) before the base model loads
    policy = load_model(base, dist, gradient_checkpointing=args.gradient_checkpointing)
    optimizer = torch.optim.AdamW(policy.parameters(), lr, betas=args.adam_betas, eps=args.adam_eps, weight_decay=0.0)
    stats = update(policy, optimizer, examples, lr, args.final_min_train_steps, args, dist, rng) if examples else {}
    sampler.sync_weights(policy)
    return {"policy": (policy, optimizer)}, policy, {**stats, "examples": len(examples)}


# ---- evaluation ----
def solve_metrics(statements: list[Problem], targets: list[Problem], conjectures: list[Conjecture],
                  attempts: dict[str, list[Attempt]], proofs: dict, generations: int) -> dict[str, float]:
    """The share of dataset statements proved so far against generations; this iteration's solve rates; verdicts."""
    proved, statuses = sum(bool(proofs.get(s.id)) for s in statements), [a.status for r in attempts.values() for a in r]
    rates = [solve_rate(attempts[c.id]) for c in conjectures if c.id in attempts]  # not those proved before
    return {"charts/cumulative_solve_rate": proved / len(statements), "charts/proved": proved,
            "charts/generations": generations, "charts/targets": len(targets),
            "charts/round_solve_rate": float(np.mean([solve_rate(attempts[t.id]) for t in targets] or [0.0])),
            **{f"lean/{s}_share": statuses.count(s) / len(statuses) for s in sorted(set(statuses))},
            **({"conjecturer/solve_rate_mean": float(np.mean(rates))} if rates else {})}


def chunked_pass_at_k(correct: np.ndarray, k: int) -> tuple[float, float | None]:
    """STP's estimator: mean (and std, >= 4 chunks) over n // k chunks of the share of problems solved."""
    solved = [correct[:, j * k : (j + 1) * k].any(axis=1).mean() for j in range(correct.shape[1] // k)]
    return (float(np.mean(solved)) if solved else float("nan")), (float(np.std(solved)) if len(solved) >= 4 else None)


def evaluate(sampler, verifier, tokenizer, benchmarks: dict[str, list[Problem]], step: int, args: Args, dist: Dist
             ) -> dict[str, float]:
    """pass@k on each benchmark from eval_samples samples per problem (STP: 3200): unbiased, and chunked."""
    metrics = {}
    for name, problems in [(name, problems) for name, problems in benchmarks.items() if problems]:
        attempts = attempt_proofs(sampler, verifier, tokenizer, problems, args.eval_samples,
                                  f"{args.seed}/{step}/eval/{name}", args, dist)
        correct = np.array([[a.correct for a in attempts[p.id]] for p in problems], dtype=bool)
        for k in [k for k in args.eval_budgets if k <= args.eval_samples]:
            metrics[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(len(r), int(r.sum()), k) for r in correct]))
            metrics[f"eval/{name}/pass@{k}_chunked_mean"], std = chunked_pass_at_k(correct, k)
            if std is not None:
                metrics[f"eval/{name}/pass@{k}_chunked_std"] = std
    return metrics


def nothing_learned(outcomes: collections.Counter, args: Args) -> str:
    """A run's last line when the prover had no training example (the CPU default on the embedded model): why."""
    n, accepted = sum(outcomes.values()), outcomes["valid"]
    why = (f"{accepted} of {n} attempts accepted, none at a statement proved at a rate in (0, {args.solve_rate_max}]"
           if accepted else f"no proof accepted in {n} attempts")
    return (f"{os.path.basename(__file__)}: no prover update in this run: {why}: "
            + ", ".join(f"{k} {v / n:.0%}" for k, v in outcomes.most_common()) + " (no_code: an empty proof; error: "
            f"Lean rejected it, or it was cut off at --max-new-tokens {args.max_new_tokens}). tests/test_stp.py's loop "
            "learning test shows the loop learning where proofs are accepted.")


# ---- main ----
def weights_only(models: dict) -> dict:  # every update starts from a fresh Adam state: checkpoints keep no moments
    return {name: (model, None) for name, (model, _) in models.items()}


def main(args: Args) -> None:
    if args.expert_iteration and args.pure_sampling:
        sys.exit("stp.py: --expert-iteration and --pure-sampling are two different baselines; pick one")
    baseline = args.expert_iteration or args.pure_sampling
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS, sys.argv[1:])
    try:  # stop at once, before any model is loaded, when there is no Lean
        workers = max(1, args.lean_workers // dist.local_world_size) if args.lean_workers else None  # this rank's
        verifier = LeanVerifier(backend="auto", timeout=args.lean_timeout, workers=workers)
    except LeanNotInstalled as e:
        sys.exit(f"{os.path.basename(__file__)} checks every proof with Lean 4 and Mathlib, and found none: {e}")
    if dist.is_main:
        print(f"lean_verify: {verifier.workers} REPL(s) on each of the node's {dist.local_world_size} rank(s)")
    statements = load_problems(args.dataset, args.num_problems)
    benchmarks = {f"{os.path.splitext(os.path.basename(path))[0]}_{args.eval_split}":
                  load_problems(path, args.eval_limit, split=args.eval_split) for path in args.eval_datasets}

    # one policy plays both roles; it is trained unless it is the pure-sampling baseline
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, dist, not args.pure_sampling, args.gradient_checkpointing)
    adamw = functools.partial(torch.optim.AdamW, betas=args.adam_betas, eps=args.adam_eps, weight_decay=0.0)
    models = {} if args.pure_sampling else {"policy": (policy, adamw(policy.parameters(), args.learning_rate))}
    # run state: each statement's (samples, correct) per iteration and distinct correct proofs, the conjectures (dicts:
    # state.pt loads without this file) and the number of generations
    start, state = 0, {"history": {}, "proofs": {}, "conjectures": {}, "generations": 0}
    if args.resume and (found := load_checkpoint(run_dir, weights_only(models), dist)) is not None:
        start, state = found
    sampler = Sampler(args.model, policy, tokenizer, dist, args.backend, args.max_model_len,
                      args.gpu_memory_utilization, args.vllm_sleep, seed=args.seed)
    history, proofs, originals = state["history"], state["proofs"], {s.id for s in statements}
    problems = {s.id: s for s in statements} | {k: Conjecture(**v) for k, v in state["conjectures"].items()}

    metrics, outcomes, trained = {}, collections.Counter(), 0  # this run's verdicts and prover examples
    for iteration in range(start, args.iterations):
        metrics, rng = {}, random.Random(f"{args.seed}/{iteration}")  # the same on every rank: the same batches

        # 1-2. Seeds and conjectures from the proofs found so far (none in the baselines)
        seeds, conjectures = [], []
        if not baseline:
            with logger.timer("conjecture"):
                seeds = select_seeds(statements, proofs, history, args, rng)
                conjectures, stats = conjecture(sampler, tokenizer, seeds, statements, problems, iteration, args,
                                                dist, rng)
                problems.update({c.id: c for c in conjectures})
                state["conjectures"].update({c.id: c._asdict() for c in conjectures})
                state["generations"] += stats["conjecturer/outputs"]
                metrics.update(stats)

        # 3. Prove: 64 samples per target in iteration 0 (and in the baselines), 32 later
        with logger.timer("prove"):
            targets = select_targets(statements, conjectures, proofs, history, bool(seeds), args, rng)
            n = args.samples_first_round if iteration == 0 or baseline else args.samples_per_round
            attempts = attempt_proofs(sampler, verifier, tokenizer, targets, n, f"{args.seed}/{iteration}/prove",
                                      args, dist)
            state["generations"] += len(targets) * n
            record_proofs(history, proofs, attempts, iteration)
            outcomes.update(a.status for row in attempts.values() for a in row)

        if args.expert_iteration:  # 4-5 of the baseline: re-train the base model on the proofs of every iteration
            with logger.timer("update"):
                models, policy = {}, None
                examples = final_examples(problems, history, proofs, originals, [], args, tokenizer, rng)
                trained += len(examples)
                models, policy, stats = retrain_from_base(sampler, args.model, examples, args.learning_rate, args, dist,
                                                          rng)
                metrics.update({f"losses/{k}": v for k, v in stats.items()})
        elif not args.pure_sampling:  # 4-5. Train: one weighted-SFT pass on the prover's and the conjecturer's data
            with logger.timer("data"):
                sampler.sleep()
                unproved = [s for s in statements if not proofs.get(s.id)]
                conjecturer_set, stats = conjecturer_examples(conjectures, attempts, proofs, unproved, iteration,
                                                              policy, tokenizer, args, dist, rng)
                prover_set = prover_examples(problems, history, proofs, iteration, args, tokenizer)
                trained += len(prover_set)
                metrics.update({**stats, "data/prover_examples": len(prover_set),
                                "data/conjecturer_examples": len(conjecturer_set)})
            with logger.timer("update"):
                examples = prover_set + conjecturer_set
                stats = update(*models["policy"], examples, args.learning_rate, args.min_train_steps, args, dist,
                               rng) if examples else {}
                metrics.update({f"losses/{k}": v for k, v in stats.items()})
                sampler.sync_weights(policy)

        metrics.update(solve_metrics(statements, targets, conjectures, attempts, proofs, state["generations"]))
        if args.eval_every and (iteration + 1) % args.eval_every == 0 and iteration + 1 < args.iterations:
            with logger.timer("eval"):
                metrics.update(evaluate(sampler, verifier, tokenizer, benchmarks, iteration + 1, args, dist))
        if iteration + 1 < args.iterations:  # the last iteration's line also holds Stage 3 and the final evaluation
            logger.log(metrics, step=iteration + 1)
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.iterations:
            save_checkpoint(run_dir, iteration + 1, weights_only(models), tokenizer, state, dist)

    if args.final_retrain and not baseline and not state.get("stage3"):  # Stage 3: re-train the base model
        with logger.timer("final_retrain"):
            models, policy, rng = {}, None, random.Random(f"{args.seed}/final")
            sft = read_rows(args.final_sft_dataset) if args.final_sft_dataset else []
            examples = final_examples(problems, history, proofs, originals, sft, args, tokenizer, rng)
            models, policy, stats = retrain_from_base(sampler, args.final_model, examples, args.final_learning_rate,
                                                      args, dist, rng)
            metrics.update({f"losses/final_{k}": v for k, v in stats.items()})
            state["stage3"] = True  # a resumed run evaluates this model instead of training it again
            save_checkpoint(run_dir, args.iterations, weights_only(models), tokenizer, state, dist)
    with logger.timer("eval"):
        metrics.update(evaluate(sampler, verifier, tokenizer, benchmarks, args.iterations, args, dist))
    logger.log(metrics, step=args.iterations)
    if dist.is_main and outcomes and not trained and not args.pure_sampling:
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
