"""STP: the Self-play Theorem Prover, iterative conjecturing and proving in Lean 4.

Paper: Dong, Ma, "Beyond Limited Data: Self-play LLM Theorem Provers with Iterative Conjecturing
and Proving", arXiv 2502.00212 (ICML 2025). Official code: github.com/kfdong/STP (read at 2b5fe8b;
this file copies none of it).

Method. One base model (DeepSeek-Prover-V1.5-SFT) plays two roles. The prover writes whole Lean 4
proofs. The conjecturer reads a proved statement with its proof (<easy theorem>) and a Mathlib
lemma that proof invokes (<lemma>), and writes a new, harder statement (<hard theorem>). The
statements to prove: LeanWorkbook. A statement's solve rate s is the share of its sampled proofs
that Lean accepts (solve_rate). Stage 2, self-play, runs --iterations iterations (the paper's word:
rounds); each iteration:
  1. seeds (select_seeds): the proofs of dataset statements whose best solve rate is above the seed
     threshold (--seed-threshold, 0.35), a seed for each (proof, lemma it invokes) pair;
  2. conjecture (conjecture): new statements sampled from the seeds, without duplicates
     (statement_key);
  3. prove (select_problems, attempt_proofs): this iteration's problems (the unproved statements,
     the new conjectures and a few proved statements) get 64 sampled proofs each in iteration 0,
     32 later, each checked by Lean; record_solve_counts and record_proofs keep the results. With
     vLLM a rank generates its share in --generation-folds calls (the official folds: there,
     each fold is verified while the next one generates);
  4. the conjecturer's data (conjecturer_examples): the conjectures attempted this iteration
     whose solve rate is in the band (in_conjecture_band; official: barely provable) that
     keeps_conjecture keeps (official: all), minus the least elegant ones (keep_elegant,
     --elegance-filter), weighted toward the unproved
     statements (matching_weights);
  5. the prover's data (prover_examples): the correct proofs in the replay window (the official
     replay buffer: the last --replay-rounds iterations, 3) of the problems, statements and
     conjectures alike, still hard in it (in_prover_band, --prover-band), each weighted by
     proof_weight;
  6. update (update): weighted SFT (supervised fine-tuning, each sequence's log-likelihood
     weighted: weighted_nll_loss) on both sets, max(#examples // batch, a minimum) steps, from a
     fresh Adam state.
Stage 3 (--final-retrain; final_examples, retrain_from_base) re-trains the base model on the SFT
data of mathlib statements (--final-sft-dataset) and the proofs of every round. Two baselines run
the same loop: expert iteration (EI, --expert-iteration: step 3 on the unproved statements, then a
Stage 3 re-training of the base model every iteration) and pure sampling (--pure-sampling: step 3
only, no training). The metric (evaluate): pass@k, the share of problems proved by one of k
samples, on miniF2F and ProofNet, from up to 3200 samples per problem, by the unbiased estimator
(pass_at_k) and by STP's chunks (chunked_pass_at_k).
Where the paper is silent or differs, this file follows the official code, but for the deviations
below.

Sources. The official code (RL/) each part follows: select_seeds, conjecture and select_problems,
RL_utils.Sampler_base.select (the baselines: Sampler_naive); attempt_proofs, RL_step1_generate
(NR_FOLD folds); best_rate, its succ_rates; conjecturer_examples,
Sampler_base.get_conjecture_examples; elegance_filter, filter_by_ratio; matching_weights,
wasserstein_matching; prover_examples and proof_weight, RL_step2_train; final_examples,
RL_step3_final_model; update, Levanter's weighted_lm (RL_base.yaml); the defaults,
run_RL_steps.sh (TOTAL_ROUNDS, the learning rate) and run_RL_train.sh (Stage 3); Stage 3's SFT
rows, the mathlib.json of prepare_datasets.py.

Records: lean_verify's Problem(id, header, statement), a statement to prove; the infrastructure
block's Sample(text, prompt_ids, token_ids, logprobs, finish_reason), one completion as the sampler
drew it, and Dist(rank, world_size, local_world_size, device, is_main, objects), this process among
torchrun's; this file's Seed, Conjecture, Attempt, Candidate and Example, under "data".

Run (needs Lean: `bash setup.sh --lean`). Without CUDA, Args' defaults are CPU_DEFAULTS (a loop
sized for a laptop, on SmolLM2-135M and data/lean_smoke.jsonl; the run prints them), so
`python stp.py` and `main(Args())` run it alike and a value given keeps it. Under
`torchrun --nproc_per_node 8` on 8xH200, the paper's sizes. Experiment map: README.md.

Deliberate deviations from the official code:
  1. Generation and verification are not pipelined; sampling is seeded by position; a (problem,
     proof) is checked once.
  2. Lean 4.15 and the upstream REPL (lean_verify), not Lean 4.9 and DeepSeek's fork.
  3. No Stage 1 (SFT on kfdong/STP_Lean_SFT, which teaches the conjecturing format): pass its
     checkpoint as --model.
  4. The lemmas a proof invokes come from a static scan (lean_verify.invoked_lemmas), not from
     DeepSeek's REPL fork.
  5. The conjecturer trains on the prompt it samples from (the official generation prompt lacks its
     header lines).
  6. A seed proof draws the empty lemma afresh each round (official: once drawn, in every later
     round).
  7. With no unproved statement left to match, every conjecture keeps weight 1 (official: weight 0,
     none is kept).
  8. A batch is min(batch_size, #examples) sequences; the prover's target is proof, fence, EOS
     (official: proof, EOS).
  9. ProofNet statements ending in ':=' get ':= by': the verifier checks tactic proofs.
  10. The statements: internlm/Lean-Workbook's train split or any .jsonl, not STP's unreleased
     lean_workbook_dedup.json.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import gc
import importlib.util
import inspect
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
    extract_conjecture,
    extract_proof,
    invoked_lemmas,
    load_problems,
    read_rows,
)

# The miniF2F text STP was evaluated on (its own file, MIT, fetched at run time; its ProofNet is
# data/proofnet.jsonl's).
STP_MINIF2F = (
    "https://raw.githubusercontent.com/kfdong/STP/2b5fe8b6dbc51afae00cba0a06e253270d7f04d4/"
    "assets/data/test/miniF2F_lean.json"
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
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of
    the machine)"""
    lean_timeout: float = 200.0
    """Lean's wall-clock limit per proof, in seconds"""

    # data
    dataset: str = "internlm/Lean-Workbook"
    """statements to prove (LeanWorkbook): a Hugging Face dataset or a .jsonl, with
    formal_statement (and header)"""
    num_problems: int | None = None
    """use only the first N problems of --dataset (default all)"""

    # algorithm
    iterations: int = 12
    """self-play iterations to run (the paper's word: rounds; the official total rounds); 0:
    evaluate --model"""
    samples_first_round: int = 64
    """proofs sampled per statement in iteration 0"""
    samples_per_round: int = 32
    """proofs sampled per statement in later iterations"""
    generation_folds: int = 5
    """with vLLM a rank generates its share of the proofs in this many calls (the official
    folds, pipelined)"""
    temperature: float = 1.0
    """sampling temperature of every role"""
    top_p: float = 1.0
    """nucleus sampling"""
    max_new_tokens: int = 1024
    """longest proof or conjecture, in tokens"""
    max_prompt_tokens: int = 1024
    """prompts are cut to their last this many tokens"""
    prover_band: tuple[float, float] = (0.0, 0.5)
    """(low, high), low excluded, high included: a statement's proofs train the prover while its
    solve rate over the replay window is low < s <= high (in_prover_band; official (0, 0.5])"""
    conjecture_band: tuple[float, float] = (0.0, 0.25)
    """(low, high), both ends excluded: the conjecturer learns from conjectures solved at
    low < s < high this iteration (in_conjecture_band); a low below 0 admits s = 0"""
    seed_threshold: float = 0.35
    """select_seeds: seeds come from dataset statements with a best solve rate above this"""
    empty_lemma_prob: float = 0.5
    """probability that a seed proof is also paired with the empty lemma (no shared lemma)"""
    lemma_use_cap: float = 0.1
    """one lemma is shared by at most ceil(this fraction x #statements) seeds (select_seeds)"""
    max_conjecture_multiplier: int = 8
    """the most conjectures sampled per seed (conjecture)"""
    proved_keep_prob: float = 0.05
    """select_problems: a proved statement is proved again with this probability (or while its best
    solve rate is below seed_threshold)"""
    replay_rounds: int = 3
    """iterations of proofs in the replay window"""
    length_penalty: float = 0.001
    """per character of a proof, in proof_weight (and in Stage 3's weight, final_examples)"""
    time_penalty: float = 0.01
    """per second of Lean verification, in proof_weight"""
    elegance_filter: bool = True
    """step 4 drops the least elegant conjectures (keep_elegant); off: every one choose_lemmas
    keeps goes on to matching_weights"""
    elegance_quantile: float = 0.2
    """elegance_filter's quantile: the share of each lemma group below its cutoff"""
    matching_features: Literal["policy_mean_hidden"] = "policy_mean_hidden"
    """what distribution matching compares conjectures and unproved statements by: the policy's
    normalised mean last hidden state (embed, official) (matching_features, MATCHING_FEATURES)"""
    matching_cap: float = 4.0
    """distribution matching (matching_weights): a conjecture's weight stops growing at this
    value"""
    embedding_max_tokens: int = 512
    """--matching-features policy_mean_hidden embeds a statement's first this many tokens"""
    learning_rate: float = 5e-5
    """learning rate of each iteration's weighted SFT (official)"""
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
    """the fewest optimizer steps of an iteration's update"""
    max_train_tokens: int = 2048
    """training sequences (prompt + target) are cut to this many tokens"""

    # Stage 3
    final_retrain: bool = False
    """Stage 3 after the iterations: re-train --final-model on the SFT data and the correct proofs
    of every round"""
    final_model: str = "deepseek-ai/DeepSeek-Prover-V1.5-SFT"
    """Stage 3 re-trains this model (official); it must share --model's architecture and
    tokenizer"""
    final_sft_dataset: str = "kfdong/STP_Lean_SFT"
    """Stage 3 also trains on its rows (prompt, target[, weight]) but LeanWorkbook's (the
    official mathlib part); '' for none"""
    final_learning_rate: float = 1e-4
    """Stage 3 learning rate (official)"""
    final_solve_rate_max: float = 0.25
    """Stage 3 keeps the proofs of a round whose statement's solve rate in it is <= this (dataset
    statements: all)"""
    final_max_proofs: int = 16
    """Stage 3 and expert iteration: distinct proofs kept per statement"""
    final_min_train_steps: int = 10
    """Stage 3 and expert iteration: the fewest optimizer steps of update"""

    # ablations
    expert_iteration: bool = False
    """baseline: sample only unproved statements (64 each), re-train the base model on all correct
    proofs every round"""
    pure_sampling: bool = False
    """baseline: sample only unproved statements (64 each) with the base model, no training"""

    # evaluation
    eval_datasets: tuple[str, ...] = (STP_MINIF2F, "data/proofnet.jsonl")
    """benchmarks (.json/.jsonl, local or URL, with formal_statement, split[, name, header]); logged
    by file name"""
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


# An iteration on a CPU in about five minutes (SmolLM2-135M: 64 proofs of <= 96 tokens ~100 s, a
# training step ~30 s); fewer than 5 samples per statement would leave the official band
# 0 < s < 1/4 empty.
# It evaluates on the built-in text.
CPU_DEFAULTS = dict(
    model="embedded:smollm2",
    final_model="embedded:smollm2",
    dataset="data/lean_smoke.jsonl",
    num_problems=8,
    iterations=2,
    samples_first_round=8,
    samples_per_round=8,
    max_new_tokens=96,
    max_prompt_tokens=512,
    embedding_max_tokens=128,
    batch_size=8,
    min_train_steps=1,
    final_min_train_steps=1,
    warmup_steps=0,
    final_sft_dataset="data/stp_mathlib_sft.jsonl",
    eval_datasets=("data/minif2f.jsonl", "data/proofnet.jsonl"),
    eval_samples=4,
    eval_budgets=(1, 2, 4),
    eval_limit=4,
)


# ---- prompts ----
# Raw completion prompts, no chat template: DeepSeek-Prover-V1.5's non-CoT format. The prover
# closes the fence; the conjecturer continues after <hard theorem> with a new statement and
# </hard theorem>.
PROVER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}{statement}"
CONJECTURER_PROMPT = (
    "Complete the following Lean 4 code:\n\n```lean4\n{header}"
    "<lemma>\n{lemma}\n<easy theorem>\n{seed}\n<hard theorem>"
)
END_THM = "</hard theorem>"
BANNED = ("<lemma>", "<easy theorem>", "<hard theorem>")  # prompt markers a conjecture may not hold
EMPTY_LEMMA = "theorem true: True"


def truncate_left(tokenizer, text: str, max_tokens: int) -> str:
    """The text cut to its last max_tokens tokens (official: the tokenizer with
    truncation_side='left'). A text of max_tokens tokens or fewer comes back as it is, not
    decoded again (a decode need not give back the text it encoded)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[-max_tokens:])


def prover_prompt(tokenizer, problem: Problem, args: Args) -> str:
    """The prover's prompt for a problem: PROVER_PROMPT cut on the left to max_prompt_tokens
    (truncate_left)."""
    text = PROVER_PROMPT.format(header=problem.header, statement=problem.statement)
    return truncate_left(tokenizer, text, args.max_prompt_tokens)


def conjecturer_prompt(tokenizer, header: str, lemma: str, easy_theorem: str, args: Args) -> str:
    """A shared lemma, by name (deviation 4) or the trivial theorem for none, and a proved
    statement with its proof (the easy theorem)."""
    lemma_line = EMPTY_LEMMA
    if lemma:
        lemma_line = f"theorem {lemma}"
    text = CONJECTURER_PROMPT.format(header=header, lemma=lemma_line, seed=easy_theorem)
    return truncate_left(tokenizer, text, args.max_prompt_tokens)


# ---- data ----
# Problem(id, header, statement) is lean_verify's Lean 4 task (load_problems reads the usual
# datasets' rows).


class Seed(NamedTuple):
    """A conjecturer's input: a proved dataset statement, one of its proofs, and a lemma."""

    problem: Problem
    proof: str  # the tactics after ':= by'
    lemma: str  # a Mathlib lemma the proof invokes, or "" for the empty lemma


class Conjecture(NamedTuple):
    """A conjectured statement: a Problem's fields, then the Seed it was conjectured from (its
    statement, proof and lemma: what a filter or reward term comparing a conjecture with its
    seed reads). state.pt keeps it as stored_conjecture's plain dict."""

    id: str
    header: str
    statement: str
    seed: Seed


def easy_theorem(seed: Seed) -> str:
    """The conjecturer prompt's easy theorem: the seed's statement and proof."""
    return seed.problem.statement + seed.proof


def stored_conjecture(conjecture: Conjecture) -> dict:
    """A Conjecture as state.pt keeps it, plain values only (state.pt loads without stp.py)."""
    seed = conjecture.seed
    return {
        "id": conjecture.id,
        "header": conjecture.header,
        "statement": conjecture.statement,
        "seed": {"problem": seed.problem._asdict(), "proof": seed.proof, "lemma": seed.lemma},
    }


def restored_conjecture(fields: dict) -> Conjecture:
    """A stored_conjecture back as the Conjecture, its Seed rebuilt."""
    seed_fields = fields["seed"]
    problem = Problem(**seed_fields["problem"])
    seed = Seed(problem, seed_fields["proof"], seed_fields["lemma"])
    return Conjecture(fields["id"], fields["header"], fields["statement"], seed)


class Attempt(NamedTuple):
    """One sampled whole proof and Lean's verdict on it."""

    sample: Sample | None  # always None here: 3200 samples per benchmark problem keep no tokens
    proof: str | None  # the tactics after ':= by' when Lean accepted them, else None
    status: str  # Lean's status ("valid", "error", ...), or "no_code" for an empty proof
    correct: bool  # Lean accepted the proof
    seconds: float = 0.0  # Lean's time on the proof


class Candidate(NamedTuple):
    """A conjecture in step 4's band (in_conjecture_band), on its way to the conjecturer's data."""

    conjecture: Conjecture
    lemma: str  # its own; after choose_lemmas the one its prompt shows ("" for none)
    rate: float  # its solve rate s this iteration


class Example(NamedTuple):
    """A training sequence: its Sample, its weight, and the record it came from."""

    sample: Sample  # the prompt and target tokens
    weight: float  # the number the loss multiplies: a reward, an advantage, a label
    source: object = None  # the record it was made from (a Candidate, an Attempt, a record, ...)
    # method-specific fields may follow, each with a default


def example_length(example: Example) -> int:
    """An Example's prompt and target tokens (micro_batches' sort key)."""
    return len(example.sample.prompt_ids) + len(example.sample.token_ids)


def text_example(
    tokenizer, prompt: str, target: str, weight: float, args: Args, source: object = None
) -> Example:
    """The prompt's tokens, then the target's and end of sequence, cut to max_train_tokens (the
    target keeps at least one token); the Example keeps weight and source."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    target_ids = target_ids + [tokenizer.eos_token_id]
    room = max(1, args.max_train_tokens - len(prompt_ids))
    sample = Sample(target, prompt_ids, target_ids[:room], [], "stop")
    return Example(sample, weight, source=source)


def statement_key(statement: str) -> str:
    """A statement as duplicates are found: without spaces and newlines (STP's rule)."""
    return statement.replace(" ", "").replace("\n", "")


# ---- rewards ----
def solve_rate(attempts: list[Attempt]) -> float:
    """A problem's solve rate s: the share of its attempts that Lean accepted; 0 for no
    attempt (step 4 skips a conjecture not attempted rather than read this 0)."""
    if not attempts:
        return 0.0
    return sum(a.correct for a in attempts) / len(attempts)


def best_rate(history: dict, pid: str) -> float:
    """A statement's solve rate in its best iteration (official); history[pid] maps an
    iteration to (samples, correct); 0 for a statement never attempted."""
    rates = [correct / samples for samples, correct in history.get(pid, {}).values() if samples]
    return max(rates, default=0.0)


def proof_weight(entry: dict, args: Args) -> float:
    """A correct proof's weight in the prover's data (official):
    exp(-length_penalty * characters - time_penalty * Lean seconds) / n_correct, n_correct the
    correct proofs of its statement in the replay window counted with repeats (a proof found in
    two iterations counts twice; n_correct >= 1: the proof itself is one). entry: the proof's
    record (prover_examples: "proof", "seconds", and its statement's window counts "samples",
    "correct" and "n_correct"); a term reads it there."""
    penalty = args.length_penalty * len(entry["proof"]) + args.time_penalty * entry["seconds"]
    return math.exp(-penalty) / entry["n_correct"]


def final_weight(entry: dict, args: Args) -> float:
    """A proof's weight in Stage 3's data and each expert-iteration round's (final_examples;
    official): exp(-length_penalty * characters), no time term, no division by the proofs of its
    statement (unlike proof_weight, which Stage 3 does not read: a term for both goes in both).
    entry: the proof's record ("proof", "seconds", "iteration", "id", and its statement's
    "samples" and "correct" in that iteration); a term reads it there."""
    return math.exp(-args.length_penalty * len(entry["proof"]))


def in_conjecture_band(s: float, args: Args) -> bool:
    """Step 4's band: whether a conjecture solved at rate s this iteration trains the
    conjecturer: low < s < high, (low, high) = conjecture_band, both ends excluded (official
    0 < s < 1/4: proved at least once, and barely). Edges: s exactly low or exactly high is
    out; s = 0 (no proof) is in only when low < 0; low >= high admits nothing."""
    low, high = args.conjecture_band
    return low < s < high


def in_prover_band(s: float, args: Args) -> bool:
    """Step 5's band: whether a statement solved at rate s over the replay window (its correct
    proofs over its samples there) trains the prover: low < s <= high, (low, high) =
    prover_band, low excluded, high included (official (0, 1/2]: the hard statements, proved
    at least once). Edges: s exactly high is in, exactly low out; s = 0 (no proof) is in only
    when low < 0, as in sgs's bands (it has no proof to train on); low >= high admits
    nothing."""
    low, high = args.prover_band
    return low < s <= high


def elegance_ratio(candidate: Candidate, proofs: dict, iteration: int, args: Args) -> float:
    """A conjecture's shortest proof in the replay window (its last replay_rounds iterations)
    over its statement, in characters. With no proof there (s = 0, which a band with low < 0
    admits), inf: the most elegant, kept by elegance_filter. A statement of no characters
    counts as one."""
    conjecture = candidate.conjecture
    window = iteration - args.replay_rounds
    lengths = []
    for entry in proofs.get(conjecture.id, []):
        if entry["iteration"] > window:
            lengths.append(len(entry["proof"]))
    if not lengths:
        return math.inf
    return min(lengths) / max(len(conjecture.statement), 1)


def elegance_filter(groups: list, ratios: list[float], quantile: float = 0.2) -> list[bool]:
    """Which conjectures to keep (official): within each group (the shared lemma), drop a ratio
    below the cutoff sorted(group's ratios)[int(size * quantile)]; ties at the cutoff are kept,
    a group of one is kept whole, an empty list gives []. A ratio of inf (no proof:
    elegance_ratio) is at or above every cutoff, so kept; it can raise its group's cutoff."""
    by_group = collections.defaultdict(list)
    for group, ratio in zip(groups, ratios):
        by_group[group].append(ratio)
    for members in by_group.values():
        members.sort()
    keep = []
    for group, ratio in zip(groups, ratios):
        members = by_group[group]
        cutoff = members[int(len(members) * quantile)]
        keep.append(len(members) < 2 or ratio >= cutoff)
    return keep


def matching_weights(
    P: torch.Tensor, Q: torch.Tensor, cap: float = 4.0, rng: random.Random | None = None
) -> list[float]:
    """Distribution matching (official): the weight of each of the N conjectures, P [N, d] their
    normalised features (--matching-features), toward the M unproved statements, Q [M, d].
    Each unproved statement, in random order, adds N/M to its most similar conjecture whose
    weight is still below `cap`; the weights sum to N while some conjecture is below the cap."""
    n = len(P)
    m = len(Q)
    if n == 0 or m == 0:
        return [1.0] * n  # deviation 7
    similarity = (P @ Q.T).float()  # [N, M]
    weights = [0.0] * n
    full = torch.zeros(n, dtype=torch.bool)  # the conjectures at the cap
    order = list(range(m))
    if rng is None:
        rng = random.Random(0)
    rng.shuffle(order)
    for q in order:
        if bool(full.all()):
            break
        scores = similarity[:, q].masked_fill(full, float("-inf"))  # [N]
        j = int(scores.argmax())
        weights[j] += n / m
        full[j] = weights[j] >= cap
    return weights


# ---- losses ----
def weighted_nll_loss(logp, mask, weights, denominator, sequence_mean=False):
    """-(1/denominator) sum_i w_i sum_t log pi(y_it): the negative log-likelihood of each sequence,
    weighted; with sequence_mean, each sequence's mean over its tokens instead of its sum.
    logp, mask: [B, T]; weights: [B]; denominator: a number the caller chooses."""
    per_sequence = (logp * mask).sum(1)  # [B]
    if sequence_mean:
        per_sequence = per_sequence / mask.sum(1).clamp(min=1)
    return -(weights * per_sequence).sum() / denominator


# ---- phases ----
def select_seeds(
    statements: list[Problem], proofs: dict, history: dict, rng: random.Random, args: Args
) -> list[Seed]:
    """Step 1, the seeds (official). Takes the dataset, the proofs recorded so far
    (record_proofs) and the solve counts (record_solve_counts); returns Seeds for conjecture.
    The rule: the proofs of dataset statements whose best_rate is above seed_threshold
    (strictly; none before any proof), shuffled, each paired with the lemmas it invokes and,
    with probability empty_lemma_prob, the empty lemma; each (statement, lemma) once, each
    lemma (the empty one too) in at most ceil(lemma_use_cap * #statements) seeds (a seed is
    taken while its lemma has fewer than the product: 1 at the CPU sizes, 8 x 0.1), #statements
    seeds at most."""
    candidates = []  # (problem, proof)
    for problem in statements:
        if best_rate(history, problem.id) > args.seed_threshold:
            for entry in proofs.get(problem.id, []):
                candidates.append((problem, entry["proof"]))
    # official: then sorted by conjecture level, 0 for every dataset statement
    rng.shuffle(candidates)
    cap = args.lemma_use_cap * len(statements)
    uses = collections.Counter()  # seeds per lemma
    pairs = set()  # (problem id, lemma) already seeded
    seeds = []
    for problem, proof in candidates:
        with_empty = rng.random() < args.empty_lemma_prob  # drawn afresh each round (deviation 6)
        lemmas = invoked_lemmas(proof, problem.statement)
        if with_empty:
            lemmas = lemmas + [""]
        for lemma in lemmas:
            pair = (problem.id, lemma)
            if uses[lemma] < cap and pair not in pairs:
                pairs.add(pair)
                uses[lemma] += 1
                seeds.append(Seed(problem, proof, lemma))
    return seeds[: len(statements)]


def conjecture(
    sampler,
    tokenizer,
    seeds: list[Seed],
    statements: list[Problem],
    problem_by_id: dict,
    iteration: int,
    rng: random.Random,
    args: Args,
    dist: Dist,
) -> tuple[list[Conjecture], dict[str, float]]:
    """Step 2, conjecturing (official). Takes select_seeds' Seeds, the dataset and every
    problem so far by id; returns the new Conjectures (select_problems makes them step 3's
    problems, conjecturer_examples reads them) and the conjecturer/ stats (outputs: every
    sample drawn, parsed or not; main adds it to the generations). The rule: max(1,
    min(3 #statements // #seeds, max_conjecture_multiplier)) samples per seed, parsed,
    shuffled, without duplicates of the dataset or of each other (statement_key, with the
    header), shuffled again and cut to #statements when there are more. A statement
    conjectured before (the same header and statement_key) keeps its id (official: the same
    text). No seed: no conjecture."""
    if not seeds:
        return [], {"conjecturer/seeds": 0, "conjecturer/outputs": 0}
    multiplier = 3 * len(statements) // len(seeds)
    multiplier = max(1, min(multiplier, args.max_conjecture_multiplier))
    prompts = []
    for seed in seeds:
        prompt = conjecturer_prompt(
            tokenizer, seed.problem.header, seed.lemma, easy_theorem=easy_theorem(seed), args=args
        )
        prompts.append(prompt)

    # sample
    rows = sample(
        sampler,
        prompts,
        n=multiplier,
        key=f"{args.seed}/{iteration}/conjecture",
        dist=dist,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop=[END_THM],
        desc="conjecture",
        logprobs=False,
    )
    # parse: a new statement ending in ':= by', or None
    found = []  # (the Seed, the new statement)
    outputs = 0
    for seed, row in zip(seeds, rows):
        for s in row:
            outputs += 1
            statement = extract_conjecture(s.text, END_THM, s.finish_reason, BANNED)
            if statement is not None:
                found.append((seed, statement))
    rng.shuffle(found)

    # keep the new ones
    seen = {(s.header, statement_key(s.statement)) for s in statements}
    known_ids = {}  # (header, statement_key) of a statement conjectured before -> its id
    for pid, known in problem_by_id.items():
        known_ids[(known.header, statement_key(known.statement))] = pid
    new = []
    for seed, statement in found:
        duplicate_key = (seed.problem.header, statement_key(statement))
        if duplicate_key not in seen:
            seen.add(duplicate_key)
            new.append((seed, statement))
    if len(new) > len(statements):
        rng.shuffle(new)
    conjectures = []
    for i, (seed, statement) in enumerate(new[: len(statements)]):
        header = seed.problem.header
        pid = known_ids.get((header, statement_key(statement)), f"r{iteration}_c{i}")
        made = Conjecture(id=pid, header=header, statement=statement, seed=seed)
        conjectures.append(made)

    with_lemma = [bool(c.seed.lemma) for c in conjectures]
    stats = {
        "conjecturer/outputs": outputs,
        "conjecturer/extraction_rate": len(found) / max(outputs, 1),
        "conjecturer/new_conjectures": len(conjectures),
        "conjecturer/seeds": len(seeds),
        "conjecturer/multiplier": multiplier,
        "conjecturer/with_lemma_share": float(np.mean(with_lemma or [0.0])),
    }
    return conjectures, stats


def select_problems(
    statements: list[Problem],
    conjectures: list[Conjecture],
    proofs: dict,
    history: dict,
    seeded: bool,
    rng: random.Random,
    args: Args,
) -> list[Problem]:
    """Step 3's problems (official). Takes the dataset, conjecture's new Conjectures, the
    proofs and solve counts so far; returns the problems attempt_proofs samples this iteration.
    The rule: the unproved statements, the unproved conjectures (a conjecture proved before is
    not attempted again, so step 4 skips it), and each proved statement drawn with probability
    proved_keep_prob or with a best_rate below seed_threshold; every statement when nothing
    was seeded; in the baselines (official), the unproved statements alone."""
    unproved = [s for s in statements if not proofs.get(s.id)]
    if args.expert_iteration or args.pure_sampling:
        return unproved
    if not seeded:
        return statements
    new = [c for c in conjectures if not proofs.get(c.id)]
    again = []  # proved statements to prove again
    for problem in statements:
        if not proofs.get(problem.id):
            continue
        drawn = rng.random() < args.proved_keep_prob
        if drawn or best_rate(history, problem.id) < args.seed_threshold:
            again.append(problem)
    return unproved + new + again


def attempt_proofs(
    sampler, verifier, tokenizer, problems: list[Problem], n: int, key: str, args: Args, dist: Dist
) -> dict[str, list[Attempt]]:
    """Step 3, proving (and evaluate's sampling). Takes the problems and n; returns {problem
    id: [Attempt]}, n a problem, the same on every rank: record_solve_counts, record_proofs,
    conjecturer_examples and solve_metrics read it. Each proof is checked by Lean against the
    original statement on the rank that sampled it (only the verdicts cross ranks); with vLLM
    a rank samples its share in generation_folds calls (the official folds). Each distinct
    (problem, proof) is checked once; a sample without a proof is a "no_code" failure."""
    prompts = [prover_prompt(tokenizer, p, args) for p in problems]

    # sample: this rank's share, {problem index: its row of Samples}
    shard = sample_shard(
        sampler,
        prompts,
        n=n,
        key=key,
        dist=dist,
        calls=args.generation_folds,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop=["\n```"],
        logprobs=False,
    )
    indices = sorted(shard)
    mine = [problems[i] for i in indices]

    # verify: the tactics after ':= by' (a failed sample, abort or error, has none), then Lean
    proofs = []  # a row per problem of mine
    for i in indices:
        row = []
        for s in shard[i]:
            proof = None
            if s.finish_reason in ("stop", "length"):
                proof = extract_proof(s.text)
            row.append(proof)
        proofs.append(row)
    # a row per problem: a LeanResult (valid, status, time, ...), or None where there is no proof
    verdicts = verifier.verify_attempts(mine, proofs)

    # score: an Attempt per sample, without its Sample, with its proof only when correct
    checked = {}
    for i, proof_row, verdict_row in zip(indices, proofs, verdicts):
        row = []
        for proof, verdict in zip(proof_row, verdict_row):
            if verdict is None:
                row.append(Attempt(sample=None, proof=None, status="no_code", correct=False))
                continue
            kept = proof if verdict.valid else None
            attempt = Attempt(
                sample=None,
                proof=kept,
                status=verdict.status,
                correct=verdict.valid,
                seconds=verdict.time,
            )
            row.append(attempt)
        checked[i] = row
    rows = gather_shard(checked, dist)
    return {p.id: row for p, row in zip(problems, rows)}


def record_solve_counts(history: dict, attempts: dict[str, list[Attempt]], iteration: int) -> None:
    """Step 3's record of rates: history[id][iteration] = (samples, correct) for each problem
    attempted (a problem not attempted gets no entry for the iteration). best_rate
    (select_seeds, select_problems), prover_examples and final_examples read it."""
    for pid, row in attempts.items():
        correct = sum(a.correct for a in row)
        history.setdefault(pid, {})[iteration] = (len(row), correct)


def record_proofs(proofs: dict, attempts: dict[str, list[Attempt]], iteration: int) -> None:
    """Step 3's record of proofs: appends to proofs[id] each distinct correct proof of this
    iteration, as {"proof", "iteration", "seconds" (its Lean time)} (official: a round's
    verified samples; a proof found again in a later round is a new entry); an attempted
    problem with no correct proof gets an empty list. Steps 1, 3 (select_problems), 4, 5,
    Stage 3 and solve_metrics read it."""
    for pid, row in attempts.items():
        found = {}  # proof -> Lean seconds
        for a in row:
            if a.correct:
                found[a.proof] = a.seconds
        entries = proofs.setdefault(pid, [])
        for proof, seconds in found.items():
            entries.append({"proof": proof, "iteration": iteration, "seconds": seconds})


def record_outcomes(outcomes: collections.Counter, attempts: dict[str, list[Attempt]]) -> None:
    """Counts each attempt's verdict into outcomes: Lean's status (a proof cut off at
    --max-new-tokens is Lean's error: an Attempt keeps no Sample here); the run's last line
    (nothing_learned) reads them."""
    for row in attempts.values():
        for a in row:
            outcomes[a.status] += 1


@torch.no_grad()
def embed(policy, tokenizer, texts: list[str], args: Args, dist: Dist) -> torch.Tensor:
    """Sentence embeddings (official), [len(texts), hidden]: the normalised mean of the last hidden
    states over each text's first embedding_max_tokens tokens; the same on every rank; [0, 1]
    for no text. --matching-features policy_mean_hidden: conjecturer_examples passes them to
    matching_weights."""
    was_training = policy.training
    policy.eval()
    mine = []  # this rank's texts: rank, rank + world size, ...
    # as many forwards on every rank (FSDP2)
    for batch, real in micro_batches(texts, args.micro_batch_size, dist):
        encoded = tokenizer(
            batch,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=args.embedding_max_tokens,
        ).to(dist.device)
        output = policy(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            output_hidden_states=True,
            use_cache=False,
        )
        if not real:
            continue
        hidden = output.hidden_states[-1].float()  # [B, T, hidden]
        mask = encoded["attention_mask"][..., None]  # [B, T, 1]
        mean = (hidden * mask).sum(1) / mask.sum(1)  # [B, hidden]
        mine.extend(torch.nn.functional.normalize(mean, dim=-1).cpu())
    policy.train(was_training)
    parts = all_gather_objects(mine, dist)
    rows = []
    for i in range(len(texts)):
        rows.append(parts[i % dist.world_size][i // dist.world_size])
    if not rows:
        return torch.zeros(0, 1)
    return torch.stack(rows)


# --matching-features' choices: a new one is its function above and an entry here
MATCHING_FEATURES = {"policy_mean_hidden": embed}
"""Each entry: (policy, tokenizer, texts, args, dist) -> [len(texts), d], a row a text, each
normalised (matching_weights' similarity is their dot product); no row for no text. A feature
must be the same on every rank (every rank matches alone and must pick the same weights): no
Python hash() (salted per process), no rank-local randomness."""


def matching_features(args: Args):
    """The feature function of --matching-features, from MATCHING_FEATURES. check_choices calls
    it at start, where an entry that cannot take (policy, tokenizer, texts, args, dist) stops
    the run (it needs the model, so it is not run there); conjecturer_examples reads it."""
    name = args.matching_features
    shape = "(policy, tokenizer, texts, args, dist) -> normalised rows [len(texts), d], as embed"
    if name not in MATCHING_FEATURES:
        raise ValueError(
            f"--matching-features {name}: add its entry to MATCHING_FEATURES ({shape})"
        )
    features = MATCHING_FEATURES[name]
    try:
        # as conjecturer_examples calls it
        inspect.signature(features).bind(None, None, [], args=args, dist=None)
    except TypeError as error:
        message = f"--matching-features {name}: its function must be {shape}: {error}"
        raise ValueError(message) from error
    return features


def conjectures_in_band(
    conjectures: list[Conjecture], attempts: dict[str, list[Attempt]], args: Args
) -> list[Candidate]:
    """Step 4's first part. Takes this iteration's conjectures and attempts (attempt_proofs);
    returns a Candidate (its own lemma, its solve rate s) for each conjecture attempted this
    iteration whose s is in_conjecture_band. A conjecture not attempted this iteration (one
    conjectured again under an earlier id, proved before, so not a problem of step 3) has no
    rate this iteration: it is skipped, not rated s = 0. choose_lemmas reads the list."""
    band = []
    for c in conjectures:
        if not attempts.get(c.id):  # not attempted (or no sample): no rate, not s = 0
            continue
        rate = solve_rate(attempts[c.id])
        if in_conjecture_band(rate, args):
            band.append(Candidate(c, c.seed.lemma, rate))
    return band


def invokes_lemma(conjecture: Conjecture, proofs: dict, iteration: int) -> bool:
    """Whether a proof of the conjecture found this iteration invokes its lemma (a static scan,
    deviation 4); False for the empty lemma and for a conjecture with no proof (s = 0, which a
    band with low < 0 admits)."""
    if not conjecture.seed.lemma:
        return False
    for entry in proofs.get(conjecture.id, []):
        if entry["iteration"] != iteration:
            continue
        if conjecture.seed.lemma in invoked_lemmas(entry["proof"], conjecture.statement):
            return True
    return False


def keeps_conjecture(candidate: Candidate, proofs: dict, iteration: int, args: Args) -> bool:
    """Step 4's own filter of an in-band conjecture, before choose_lemmas: official: every one
    is kept. A filter that reads the conjecture (its statement, its Seed), its rate or its
    proofs this iteration (proofs[id], entries of `iteration`) is this function."""
    return True


def choose_lemmas(
    band: list[Candidate], proofs: dict, iteration: int, rng: random.Random, args: Args
) -> list[Candidate]:
    """Step 4's second part: the lemma each prompt shows. Takes conjectures_in_band's list;
    returns first those whose lemma a proof of this iteration invokes (invokes_lemma), keeping
    it, then at most max(20 #invoking, 4096) of the others, drawn at random, with the empty
    lemma (""). A conjecture with no proof (s = 0, in a band with low < 0) is always one of
    the others, so at scale such conjectures share that random cap with the proved ones.
    keep_elegant, else matching, reads the list."""
    invoking = []
    others = []
    for candidate in band:
        if invokes_lemma(candidate.conjecture, proofs, iteration):
            invoking.append(candidate)
        else:
            others.append(candidate._replace(lemma=""))
    rng.shuffle(others)
    return invoking + others[: max(20 * len(invoking), 4096)]


def keep_elegant(
    candidates: list[Candidate], proofs: dict, iteration: int, args: Args
) -> list[Candidate]:
    """Step 4's third part (--elegance-filter): the candidates elegance_filter keeps, grouped by
    the lemma their prompt shows, by elegance_ratio with elegance_quantile; order kept.
    Matching reads the list."""
    ratios = []
    for candidate in candidates:
        ratios.append(elegance_ratio(candidate, proofs, iteration, args))
    lemmas = [candidate.lemma for candidate in candidates]
    keep = elegance_filter(lemmas, ratios, args.elegance_quantile)
    return [c for c, ok in zip(candidates, keep) if ok]


def conjecturer_examples(
    policy,
    tokenizer,
    conjectures: list[Conjecture],
    attempts: dict[str, list[Attempt]],
    proofs: dict,
    unproved: list[Problem],
    iteration: int,
    rng: random.Random,
    args: Args,
    dist: Dist,
) -> tuple[list[Example], dict]:
    """Step 4, the conjecturer's data. Takes this iteration's conjectures and attempts, the
    proofs recorded so far (record_proofs) and the unproved dataset statements; returns the
    Examples and the conjecturer/ stats, counted after each part of the rule: in_band
    (conjectures_in_band), kept (keeps_conjecture), invoking_lemma (choose_lemmas' lemmas a
    proof invokes), elegant (after keep_elegant with --elegance-filter; every chosen one
    without it), matched (weight above 0). The rule then: matching_weights of the survivors
    toward the unproved statements, compared by --matching-features (matching_features; the
    official features run the policy forward, so the sampler sleeps first), weight 0 dropped.
    An Example: the conjecturer's prompt with the chosen lemma, the target the statement and
    </hard theorem>, the weight the matching weight, the source its Candidate. Step 6
    (update) trains on them with prover_examples'."""
    band = conjectures_in_band(conjectures, attempts, args)
    kept = []
    for candidate in band:
        if keeps_conjecture(candidate, proofs, iteration, args):
            kept.append(candidate)
    kept_count = len(kept)
    kept = choose_lemmas(kept, proofs, iteration, rng, args)
    invoking = [c for c in kept if c.lemma]
    if args.elegance_filter:
        kept = keep_elegant(kept, proofs, iteration, args)

    features = matching_features(args)
    statements = [c.conjecture.statement for c in kept]
    P = features(policy, tokenizer, statements, args=args, dist=dist)
    Q = features(policy, tokenizer, [s.statement for s in unproved], args=args, dist=dist)
    weights = matching_weights(P, Q, args.matching_cap, rng=rng)
    examples = []
    for candidate, weight in zip(kept, weights):
        if weight <= 0:
            continue
        c = candidate.conjecture
        prompt = conjecturer_prompt(
            tokenizer, c.header, candidate.lemma, easy_theorem=easy_theorem(c.seed), args=args
        )
        target = "\n" + c.statement + "\n" + END_THM
        example = text_example(
            tokenizer, prompt, target, weight=weight, args=args, source=candidate
        )
        examples.append(example)
    stats = {
        "conjecturer/in_band": len(band),
        "conjecturer/kept": kept_count,
        "conjecturer/invoking_lemma": len(invoking),
        "conjecturer/elegant": len(kept),
        "conjecturer/matched": len(examples),
    }
    return examples, stats


def prover_examples(
    tokenizer, problem_by_id: dict, history: dict, proofs: dict, iteration: int, args: Args
) -> list[Example]:
    """Step 5, the prover's data (official). Takes every problem by id, the solve counts
    (record_solve_counts) and the proofs (record_proofs); returns Examples that step 6 (update)
    trains on with conjecturer_examples'. The rule: the correct proofs in the replay window
    (iterations iteration - replay_rounds + 1 .. iteration) of each statement whose samples and
    correct ones over the window give a solve rate in_prover_band (a statement with no sample
    in the window has no rate: it is skipped, not rated s = 0);
    one Example a distinct proof (its newest entry's Lean seconds), weighted by proof_weight
    (weight 0 dropped, as conjecturer_examples').
    The target: the proof, the closing fence, EOS; the source: the proof's entry with its
    statement's "id" and window counts ("samples", "correct", and "n_correct": its entries in
    the window, a proof found in two iterations counting twice)."""
    first = iteration - args.replay_rounds  # the window: first < round <= iteration
    examples = []
    for pid, rounds in history.items():
        samples = 0
        correct = 0
        for round_, (round_samples, round_correct) in rounds.items():
            if first < round_ <= iteration:
                samples += round_samples
                correct += round_correct
        if samples == 0:  # no sample in the window: no rate, not s = 0
            continue
        s = correct / samples
        if not in_prover_band(s, args):
            continue
        recent = [p for p in proofs.get(pid, []) if first < p["iteration"] <= iteration]
        newest = {}  # each distinct proof's newest entry
        for entry in sorted(recent, key=lambda p: p["iteration"]):
            newest[entry["proof"]] = entry
        prompt = prover_prompt(tokenizer, problem_by_id[pid], args)
        for entry in newest.values():
            source = dict(entry, id=pid, samples=samples, correct=correct, n_correct=len(recent))
            weight = proof_weight(source, args)
            if weight <= 0:  # no signal (a weight term can reach 0): not an example
                continue
            target = entry["proof"] + "\n```"
            example = text_example(
                tokenizer, prompt, target, weight=weight, args=args, source=source
            )
            examples.append(example)
    return examples


def final_examples(
    tokenizer,
    problem_by_id: dict,
    history: dict,
    proofs: dict,
    originals: set,
    sft: list[dict],
    rng: random.Random,
    args: Args,
) -> list[Example]:
    """Stage 3's data (official), also each expert-iteration round's. Takes every problem by
    id, the solve counts, the proofs of every round, the dataset's ids (originals) and the SFT
    rows; returns Examples for retrain_from_base. The rule: the SFT rows but LeanWorkbook's
    (the official mathlib part), each with its weight (1 without one), its source the row; then
    each round's proofs of dataset statements and of conjectures whose solve rate in that round
    is <= final_solve_rate_max, shuffled, not already an SFT pair, distinct, at most
    final_max_proofs a statement, each weighted by final_weight, the source the proof's entry
    with its statement's "id"."""
    sft = [r for r in sft if "lean_workbook" not in r["prompt"]]
    examples = []
    for r in sft:
        weight = r.get("weight", 1.0)
        example = text_example(
            tokenizer, r["prompt"], r["target"], weight=weight, args=args, source=r
        )
        examples.append(example)
    found = []  # (statement id, proof entry)
    for pid, entries in proofs.items():
        for entry in entries:
            keep = pid in originals
            if not keep:
                samples, correct = history[pid][entry["iteration"]]
                keep = correct / samples <= args.final_solve_rate_max
            if keep:
                found.append((pid, entry))
    rng.shuffle(found)
    seen = {(r["prompt"], r["target"]) for r in sft}
    count = collections.Counter()  # proofs kept per statement
    prompts = {pid: prover_prompt(tokenizer, problem_by_id[pid], args) for pid, _ in found}
    for pid, entry in found:
        pair = (prompts[pid], entry["proof"])
        if pair in seen or count[pid] >= args.final_max_proofs:
            continue
        seen.add(pair)
        count[pid] += 1
        samples, correct = history[pid][entry["iteration"]]
        source = dict(entry, id=pid, samples=samples, correct=correct)
        weight = final_weight(source, args)
        target = entry["proof"] + "\n```"
        example = text_example(
            tokenizer, prompts[pid], target, weight=weight, args=args, source=source
        )
        examples.append(example)
    return examples


def sft_batch_loss(
    policy, micro: list[Example], weighted_tokens: float, args: Args
) -> tuple[torch.Tensor, dict[str, float]]:
    """STP's weighted SFT on a micro-batch of an optimizer batch: the weighted_nll_loss of its
    Examples, weights their Example.weight, over the batch's weighted tokens sum_i w_i |y_i|;
    and the stats update averages over its steps (none). update calls it. A loss term goes
    here, its coefficient read from args (token_logprobs gives the entropy with
    with_entropy=True, detached unless entropy_grad=True); a stat it returns is a
    micro-batch's part of the batch's value."""
    logp, mask, _ = token_logprobs(policy, [e.sample for e in micro])  # [B, T] each
    weights = logp.new_tensor([e.weight for e in micro])  # [B]
    loss = weighted_nll_loss(logp, mask, weights, denominator=weighted_tokens)
    return loss, {}


def update(
    policy,
    optimizer,
    examples: list[Example],
    lr: float,
    min_steps: int,
    rng: random.Random,
    args: Args,
    dist: Dist,
) -> dict[str, float]:
    """Step 6, weighted SFT (the official code trains a run per iteration). Takes the policy,
    its optimizer and a non-empty list of Examples (prover_examples + conjecturer_examples, or
    final_examples); trains the policy in place and returns its losses/ stats (steps, and the
    means of loss, grad_norm and every stat sft_batch_loss returns); the sampler then syncs
    the new weights. The rule: max(#examples // batch,
    min_steps) optimizer steps on passes over the shuffled examples, a batch being
    min(batch_size, #examples) sequences (deviation 8), from a fresh Adam state; a linear
    warm-up of min(steps - 1, warmup_steps) steps, then lr_schedule. The loss:
    sft_batch_loss, over sum_i w_i |y_i| of the batch (STP's weighted SFT); a batch whose
    weights are all 0 is skipped and not counted in losses/steps."""
    optimizer.state.clear()
    size = min(args.batch_size, len(examples))  # a small set is not repeated inside a step
    steps = max(len(examples) // size, min_steps)
    # the official warm-up reaches the peak one step before lr_at's: both get + 1 below
    warmup = min(steps - 1, args.warmup_steps)
    passes = math.ceil(steps * size / len(examples))
    stream = []
    for _ in range(passes):
        stream.extend(rng.sample(examples, len(examples)))
    batches = [stream[i * size : (i + 1) * size] for i in range(steps)]
    stats = []
    for optimizer_step, batch in enumerate(batches):
        # STP's weighted SFT: weighted_nll_loss over sum_i w_i |y_i|, the batch's weighted tokens
        weighted_tokens = sum(e.weight * len(e.sample.token_ids) for e in batch)
        if weighted_tokens <= 0:  # every weight 0: no signal (and 0 / 0 below)
            continue

        def loss_fn(micro: list[Example]) -> tuple[torch.Tensor, dict]:
            return sft_batch_loss(policy, micro, weighted_tokens=weighted_tokens, args=args)

        lr_now = lr_at(
            step=optimizer_step + 1,
            total=steps + 1,
            peak=lr,
            warmup=warmup + 1,
            schedule=args.lr_schedule,
        )
        step_stats = train_step(
            policy,
            optimizer,
            batch,
            loss_fn=loss_fn,
            micro_batch_size=args.micro_batch_size,
            max_grad_norm=args.max_grad_norm,
            dist=dist,
            length=example_length,
            lr=lr_now,
        )
        stats.append(step_stats)
    if not stats:  # every batch weighed 0
        return {"steps": 0}
    metrics = {"steps": len(stats)}
    for name in stats[0]:  # loss, grad_norm and every stat sft_batch_loss returns
        metrics[name] = float(np.mean([s[name] for s in stats]))
    return metrics


def retrain_from_base(
    sampler,
    base: str,
    examples: list[Example],
    lr: float,
    rng: random.Random,
    args: Args,
    dist: Dist,
) -> tuple[dict, torch.nn.Module, dict]:
    """Stage 3 (and each expert-iteration round): a fresh copy of `base` trained by update on
    examples (final_examples; none: no training); returns the models to save, the new policy
    (the sampler serves it from then on), and update's stats with "examples"."""
    sampler.sleep()
    gc.collect()  # free the old policy (the caller dropped it) before the base model loads
    policy = load_model(base, dist, gradient_checkpointing=args.gradient_checkpointing)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr, betas=args.adam_betas, eps=args.adam_eps, weight_decay=0.0
    )
    stats = {}
    if examples:
        min_steps = args.final_min_train_steps
        stats = update(
            policy, optimizer, examples, lr=lr, min_steps=min_steps, rng=rng, args=args, dist=dist
        )
    sampler.sync_weights(policy)
    stats["examples"] = len(examples)
    return {"policy": (policy, optimizer)}, policy, stats


# ---- evaluation ----
def solve_metrics(
    statements: list[Problem],
    proofs: dict[str, list[dict]],
    attempts: dict[str, list[Attempt]],
    generations: int,
    problems: list[Problem],
    conjectures: list[Conjecture],
) -> dict[str, float]:
    """The iteration's charts/, lean/ and conjecturer/ metrics, logged by main: the share of
    dataset statements proved so far against the generations so far; this iteration's problems
    (charts/problems: statements and conjectures) and their mean solve rate; the verdicts'
    shares; the mean solve rate of this iteration's conjectures (those attempted: not those
    proved before; absent with none)."""
    proved = sum(bool(proofs.get(s.id)) for s in statements)
    statuses = []
    for row in attempts.values():
        statuses.extend(a.status for a in row)
    conjecture_rates = [solve_rate(attempts[c.id]) for c in conjectures if c.id in attempts]
    problem_rates = [solve_rate(attempts[p.id]) for p in problems]
    metrics = {
        "charts/cumulative_solve_rate": proved / len(statements),
        "charts/proved": proved,
        "charts/generations": generations,
        "charts/problems": len(problems),
        "charts/round_solve_rate": float(np.mean(problem_rates or [0.0])),
    }
    for status in sorted(set(statuses)):
        metrics[f"lean/{status}_share"] = statuses.count(status) / len(statuses)
    if conjecture_rates:
        metrics["conjecturer/solve_rate_mean"] = float(np.mean(conjecture_rates))
    return metrics


def chunked_pass_at_k(correct: np.ndarray, k: int) -> tuple[float, float | None]:
    """STP's estimator on correct, [problems, samples]: the samples are cut into n // k chunks of
    k; the mean over the chunks (and their std, from 4 chunks on) of the share of problems solved
    in a chunk."""
    solved = []
    for j in range(correct.shape[1] // k):
        chunk = correct[:, j * k : (j + 1) * k]  # [problems, k]
        solved.append(chunk.any(axis=1).mean())
    mean = float(np.mean(solved)) if solved else float("nan")
    std = float(np.std(solved)) if len(solved) >= 4 else None
    return mean, std


def evaluate(
    sampler,
    verifier,
    tokenizer,
    benchmarks: dict[str, list[Problem]],
    step: int,
    args: Args,
    dist: Dist,
) -> dict[str, float]:
    """The paper's metric. Takes the benchmarks; returns {"eval/<benchmark>/pass@k": value, and
    the chunked mean (and std)}, logged by main after the last iteration (and every eval_every).
    The rule: eval_samples samples per problem (STP: 3200) by attempt_proofs, a proof counting
    when Lean accepts it within lean_timeout; pass@k for each k <= eval_samples of eval_budgets,
    by the unbiased estimator (pass_at_k) and by chunks (chunked_pass_at_k); an empty benchmark
    is left out."""
    metrics = {}
    for name, problems in benchmarks.items():
        if not problems:
            continue
        n = args.eval_samples
        key = f"{args.seed}/{step}/eval/{name}"
        attempts = attempt_proofs(
            sampler, verifier, tokenizer, problems=problems, n=n, key=key, args=args, dist=dist
        )
        rows = []
        for p in problems:
            rows.append([a.correct for a in attempts[p.id]])
        correct = np.array(rows, dtype=bool)  # [problems, samples]
        for k in args.eval_budgets:
            if k > args.eval_samples:
                continue
            unbiased = [pass_at_k(len(r), int(r.sum()), k) for r in correct]
            metrics[f"eval/{name}/pass@{k}"] = float(np.mean(unbiased))
            mean, std = chunked_pass_at_k(correct, k)
            metrics[f"eval/{name}/pass@{k}_chunked_mean"] = mean
            if std is not None:
                metrics[f"eval/{name}/pass@{k}_chunked_std"] = std
    return metrics


def nothing_learned(outcomes: collections.Counter, trained: int, args: Args) -> str | None:
    """The run's last line when the prover had no training example (the CPU default on the
    embedded model), saying why; None when it had some, when nothing was attempted, and in the
    pure-sampling baseline (which trains nothing by design)."""
    if trained or not outcomes or args.pure_sampling:
        return None
    n = sum(outcomes.values())
    accepted = outcomes["valid"]
    why = f"no proof accepted in {n} attempts"
    if accepted:
        why = f"{accepted} of {n} attempts accepted, none at a statement in_prover_band admits"
    shares = ", ".join(f"{k} {v / n:.0%}" for k, v in outcomes.most_common())
    return (
        f"{os.path.basename(__file__)}: no prover update in this run: {why}: {shares} "
        "(no_code: an empty proof; error: Lean rejected it, or it was cut off at --max-new-tokens "
        f"{args.max_new_tokens}). tests/test_stp.py's loop learning test shows the loop learning "
        "where proofs are accepted."
    )


# ---- main ----
def weights_only(models: dict) -> dict:
    """{name: (model, None)}, the models without their optimizers: every update starts from a
    fresh Adam state, so checkpoints keep no moments."""
    return {name: (model, None) for name, (model, _) in models.items()}


def start_lean(args: Args, dist: Dist) -> LeanVerifier:
    """This rank's Lean REPLs, its share of the node's --lean-workers, which attempt_proofs
    checks with; without Lean the run stops here, before any model is loaded."""
    workers = None  # lean_verify's share of the machine
    if args.lean_workers:
        workers = max(1, args.lean_workers // dist.local_world_size)
    try:
        verifier = LeanVerifier(backend="auto", timeout=args.lean_timeout, workers=workers)
    except LeanNotInstalled as e:
        name = os.path.basename(__file__)
        sys.exit(f"{name} checks every proof with Lean 4 and Mathlib, and found none: {e}")
    if dist.is_main:
        ranks = dist.local_world_size
        print(f"lean_verify: {verifier.workers} REPL(s) on each of the node's {ranks} rank(s)")
    return verifier


def load_benchmarks(args: Args) -> dict[str, list[Problem]]:
    """Each of --eval-datasets, named after its file and the split."""
    benchmarks = {}
    for path in args.eval_datasets:
        name = os.path.splitext(os.path.basename(path))[0]
        problems = load_problems(path, args.eval_limit, split=args.eval_split)
        benchmarks[f"{name}_{args.eval_split}"] = problems
    return benchmarks


def check_choices(args: Args) -> None:
    """Stop the run at start, not deep in the loop, on flag values that cannot run: a value (a
    Literal a fork extended) without its table entry (each lookup runs once and raises a
    ValueError naming what to add), a value outside its range, flags that cannot run together.
    A new flag's range check goes here. main calls it before start_run.
    Its tables: MATCHING_FEATURES (an entry that cannot take the features' arguments stops
    too). (--lr-schedule stops in start_run.)"""
    if args.expert_iteration and args.pure_sampling:
        sys.exit(
            "stp.py: --expert-iteration and --pure-sampling are two different baselines; pick one"
        )
    matching_features(args)
    if not 0.0 <= args.elegance_quantile < 1.0:
        raise ValueError(
            f"--elegance-quantile {args.elegance_quantile}: a share of a lemma group, in [0, 1)"
        )


def load_models(args: Args, dist: Dist) -> tuple[dict, object, torch.nn.Module]:
    """The policy (it plays both roles): returns `models`, {"policy": (policy, optimizer)}, the
    models update trains and a checkpoint saves (none in the pure-sampling baseline, which
    trains nothing), the tokenizer, and the policy (the sampler serves it)."""
    tokenizer = load_tokenizer(args.model)
    train = not args.pure_sampling
    policy = load_model(args.model, dist, train, gradient_checkpointing=args.gradient_checkpointing)
    models = {}
    if train:
        optimizer = torch.optim.AdamW(
            policy.parameters(),
            args.learning_rate,
            betas=args.adam_betas,
            eps=args.adam_eps,
            weight_decay=0.0,
        )
        models["policy"] = (policy, optimizer)
    return models, tokenizer, policy


def start_sampler(policy, tokenizer, args: Args, dist: Dist) -> Sampler:
    """The sampler of both roles, with the policy's weights as they are now (resumed); main
    syncs it after each update."""
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
    baseline = args.expert_iteration or args.pure_sampling
    verifier = start_lean(args, dist)
    statements = load_problems(args.dataset, args.num_problems)  # the dataset
    benchmarks = load_benchmarks(args)
    models, tokenizer, policy = load_models(args, dist)
    # the run's state: history[id][iteration] = (samples, correct); proofs[id] = [{"proof",
    # "iteration", "seconds"}]; conjectures[id] = a Conjecture's fields; generations: samples
    # drawn (plain dicts and numbers: state.pt loads without this file)
    start = 0
    state = {"history": {}, "proofs": {}, "conjectures": {}, "generations": 0}
    if args.resume:
        found = load_checkpoint(run_dir, weights_only(models), dist)
        if found is not None:
            start, state = found
    sampler = start_sampler(policy, tokenizer, args=args, dist=dist)
    history = state["history"]
    proofs = state["proofs"]
    originals = {s.id for s in statements}
    problem_by_id = {s.id: s for s in statements}
    for pid, fields in state["conjectures"].items():
        problem_by_id[pid] = restored_conjecture(fields)

    metrics = {}
    outcomes = collections.Counter()  # this run's verdicts
    trained = 0  # this run's prover training examples (Stage 3's and expert iteration's too)
    for iteration in range(start, args.iterations):
        step = iteration + 1  # iterations done: the metrics' step, the checkpoint's number
        metrics = {}
        rng = random.Random(f"{args.seed}/{iteration}")  # the same on every rank: the same batches

        # 1. Seeds and 2. conjectures, from the proofs found so far (none in the baselines)
        seeds = []
        conjectures = []
        if not baseline:
            with logger.timer("conjecture"):
                seeds = select_seeds(statements, proofs, history, rng=rng, args=args)
                conjectures, stats = conjecture(
                    sampler,
                    tokenizer,
                    seeds,
                    statements=statements,
                    problem_by_id=problem_by_id,
                    iteration=iteration,
                    rng=rng,
                    args=args,
                    dist=dist,
                )
                for c in conjectures:
                    problem_by_id[c.id] = c
                    state["conjectures"][c.id] = stored_conjecture(c)
                state["generations"] += stats["conjecturer/outputs"]
                metrics.update(stats)

        # 3. Prove: samples_first_round proofs per problem in iteration 0 (and in the baselines)
        with logger.timer("prove"):
            seeded = bool(seeds)
            problems = select_problems(
                statements, conjectures, proofs, history=history, seeded=seeded, rng=rng, args=args
            )
            n = args.samples_first_round if iteration == 0 or baseline else args.samples_per_round
            key = f"{args.seed}/{iteration}/prove"
            attempts = attempt_proofs(
                sampler, verifier, tokenizer, problems=problems, n=n, key=key, args=args, dist=dist
            )
            state["generations"] += len(problems) * n
            record_solve_counts(history, attempts, iteration)
            record_proofs(proofs, attempts, iteration)
        record_outcomes(outcomes, attempts)

        if args.expert_iteration:
            # 4-6 of the EI baseline: re-train the base model on the proofs of every iteration
            with logger.timer("update"):
                models = {}
                policy = None  # dropped before the base model loads
                sft = []  # the proofs alone
                examples = final_examples(
                    tokenizer,
                    problem_by_id,
                    history,
                    proofs=proofs,
                    originals=originals,
                    sft=sft,
                    rng=rng,
                    args=args,
                )
                trained += len(examples)
                base = args.model
                lr = args.learning_rate
                models, policy, stats = retrain_from_base(
                    sampler, base, examples, lr=lr, rng=rng, args=args, dist=dist
                )
                for name, value in stats.items():
                    metrics[f"losses/{name}"] = value
        elif not args.pure_sampling:
            with logger.timer("data"):
                sampler.sleep()
                # 4. The conjecturer's data: the conjectures in the band, matched to the unproved
                unproved = [s for s in statements if not proofs.get(s.id)]
                conjecturer_set, stats = conjecturer_examples(
                    policy,
                    tokenizer,
                    conjectures,
                    attempts=attempts,
                    proofs=proofs,
                    unproved=unproved,
                    iteration=iteration,
                    rng=rng,
                    args=args,
                    dist=dist,
                )
                # 5. The prover's data: the replay window's proofs of statements still hard
                prover_set = prover_examples(
                    tokenizer, problem_by_id, history, proofs=proofs, iteration=iteration, args=args
                )
                trained += len(prover_set)
                metrics.update(stats)
                metrics["data/prover_examples"] = len(prover_set)
                metrics["data/conjecturer_examples"] = len(conjecturer_set)

            # 6. Update: weighted SFT on both sets (update)
            with logger.timer("update"):
                examples = prover_set + conjecturer_set
                stats = {}
                if examples:
                    policy, optimizer = models["policy"]
                    lr = args.learning_rate
                    min_steps = args.min_train_steps
                    stats = update(
                        policy,
                        optimizer,
                        examples,
                        lr=lr,
                        min_steps=min_steps,
                        rng=rng,
                        args=args,
                        dist=dist,
                    )
                for name, value in stats.items():
                    metrics[f"losses/{name}"] = value
                sampler.sync_weights(policy)

        generations = state["generations"]
        stats = solve_metrics(
            statements,
            proofs,
            attempts,
            generations=generations,
            problems=problems,
            conjectures=conjectures,
        )
        metrics.update(stats)
        last = step == args.iterations
        if args.eval_every and step % args.eval_every == 0 and not last:
            with logger.timer("eval"):
                metrics.update(
                    evaluate(
                        sampler,
                        verifier,
                        tokenizer,
                        benchmarks=benchmarks,
                        step=step,
                        args=args,
                        dist=dist,
                    )
                )
        if not last:  # the last iteration's line also holds Stage 3 and the final evaluation
            logger.log(metrics, step=step)
        if step % args.save_every == 0 or last:
            to_save = weights_only(models)
            save_checkpoint(
                run_dir, iteration=step, models=to_save, tokenizer=tokenizer, state=state, dist=dist
            )

    # Stage 3: re-train the base model on the SFT data and the proofs of every round
    if args.final_retrain and not baseline and not state.get("stage3"):
        with logger.timer("final_retrain"):
            models = {}
            policy = None  # dropped before the base model loads
            rng = random.Random(f"{args.seed}/final")
            sft = read_rows(args.final_sft_dataset) if args.final_sft_dataset else []
            examples = final_examples(
                tokenizer,
                problem_by_id,
                history,
                proofs=proofs,
                originals=originals,
                sft=sft,
                rng=rng,
                args=args,
            )
            base = args.final_model
            lr = args.final_learning_rate
            models, policy, stats = retrain_from_base(
                sampler, base, examples, lr=lr, rng=rng, args=args, dist=dist
            )
            for name, value in stats.items():
                metrics[f"losses/final_{name}"] = value
            # a resumed run evaluates this model instead of training it again
            state["stage3"] = True
            step = args.iterations
            to_save = weights_only(models)
            save_checkpoint(
                run_dir, iteration=step, models=to_save, tokenizer=tokenizer, state=state, dist=dist
            )

    # Evaluation: pass@k on the benchmarks, after the last iteration (and Stage 3)
    with logger.timer("eval"):
        step = args.iterations
        metrics.update(
            evaluate(
                sampler, verifier, tokenizer, benchmarks=benchmarks, step=step, args=args, dist=dist
            )
        )
    logger.log(metrics, step=args.iterations)
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
