"""SGS: Self-Guided Self-Play for Lean 4 theorem proving.

Paper: Bailey, Wen, Dong, Hashimoto, Ma, "Scaling Self-Play with Self-Guidance", arXiv 2604.20209 (2026).
Official code: github.com/LukeBailey181/sgs (read at 64d2de4; this file copies none of it).

Method. One base model (DeepSeek-Prover-V2-7B) plays three roles (§3): the Solver writes whole Lean 4 proofs; the
Conjecturer (trained, with its own weights) writes a simpler related statement for each target it never solved; the
Guide, a frozen copy fine-tuned to grade conjectures, scores a conjecture's relevance to its target, redundant premises
and tangled conclusion (Eq. 3). The targets D: ~3.3k hard Lean 4 problems (D_3k). Each iteration (Algorithm 1):
  1. conjecture: one conjecture per never-solved target;
  2. solve: k = 8 Solver attempts at every target and every conjecture, each checked by Lean;
  3. the Solver learns from its correct proofs of problems with solve rate 0 < s <= 1/2 (REINFORCE½);
  4. the Conjecturer learns from R = R_guide * (1 - s), min-max normalised, on conjectures with 0 < s <= p70.
The metric (Fig. 1): the cumulative share of targets ever solved, against the number of generations.
Where the paper is silent or differs, this file follows the official code, but for the deviations below.

Run (needs Lean: `bash setup.sh --lean`): without CUDA this file runs a loop scaled down by CPU_DEFAULTS (SmolLM2-135M,
data/lean_smoke.jsonl); under `torchrun --nproc_per_node 8` on 8xH200, the paper's sizes. Experiment map: README.md.

Deliberate deviations from the official code:
  1. Generation and verification are not pipelined; sampling is seeded by position; a (problem, proof) is checked once.
  2. The try penalty (§4.1) looks for the `try` tactic outside comments; the official code for the substring "try".
  3. Lean timeout 200 s (paper); the official default is 500 s.
  4. A conjecture is the theorem alone (lean_verify.extract_conjecture), deduplicated up to whitespace.
  5. solver/entropy is -mean log pi(y_t) over the sampled tokens; the paper's is from the top-10 log-probabilities.
  6. CISPO attempts of advantage 0 are left out of the batch (their tokens still count in the group's).
  7. The expert-iteration objective is the solver-only baseline of App. G.4 and is refused with a Conjecturer.
  8. One sampler serves the three roles (their weights are loaded in turn).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import importlib.util
import json
import math
import os
import pathlib
import random
import re
import shutil
import sys
import time
import zlib
from array import array
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

from lean_verify import (LeanNotInstalled, LeanVerifier, Problem, extract_conjecture, extract_proof, load_problems,
                         strip_comments, theorem_conclusion)


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
    """the Solver: a Hugging Face id, a local path, or embedded:smollm2 (the CPU default)"""
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
    lean_workers: int | None = None
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of the machine)"""
    lean_timeout: float = 200.0
    """Lean's wall-clock limit per proof, in seconds"""
    conjecturer_model: str | None = None
    """the Conjecturer's initial weights, trained separately from the Solver's (§3); default: --model"""
    guide_model: str = "LukeBailey181Pub/dspv2_guide"
    """the frozen Guide: DeepSeek-Prover-V2-7B fine-tuned to write the score tags (§4.1); --model's architecture"""

    # data
    dataset: str = "LukeBailey181Pub/D_3k"
    """target set D: a Hugging Face dataset with rows (id, header, theorem), or a .jsonl file (miniF2F fields)"""
    num_problems: int | None = None
    """use only the first N problems of --dataset (default all)"""

    # algorithm
    iterations: int = 500
    """self-play iterations to run (the official scripts stop at 500; the paper reports about 200)"""
    proofs_per_problem: int = 8
    """k: Solver attempts per target and per conjecture (§4.1)"""
    conjectures_per_target: int = 1
    """conjectures sampled per never-solved target (Table 1)"""
    # App. C: temperature 1 and top-p 1 for every role, Adam betas (0.9, 0.95), gradient clipping 1.0, constant lr
    temperature: float = 1.0
    """sampling temperature of every role"""
    top_p: float = 1.0
    """nucleus sampling"""
    max_new_tokens: int = 8192
    """longest Solver completion, M in the overlong penalty (App. C)"""
    conjecturer_max_new_tokens: int = 8192
    """longest Conjecturer completion"""
    guide_max_new_tokens: int = 8192
    """longest Guide completion"""
    solve_rate_max: float = 0.5
    """REINFORCE½ trains on problems with 0 < s <= this solve rate (§3.2)"""
    conjecture_percentile: float = 0.7
    """the Conjecturer is rewarded for conjectures with 0 < s <= this percentile of the solve rates in (0, 1) (§3.2)"""
    max_stored_proofs: int = 16
    """verified proofs kept per solved target"""
    overlong_buffer: float = 0.2
    """the last fraction of M where a rollout's reward falls linearly from 0 to -1 (§4.1, after DAPO)"""
    penalize_try: bool = True
    """reward 0 for Solver proofs that use the try tactic (§4.1)"""
    solver_objective: Literal["reinforce_half", "cispo", "expert_iteration"] = "reinforce_half"
    """Solver update: REINFORCE½ (§3.2), CISPO (App. G.3, Eq. 5) or expert iteration (App. G.4)"""
    learning_rate: float | None = None
    """Solver learning rate; default as the official scripts: 3e-6, 1e-6 with CISPO"""
    batch_size: int | None = None
    """sequences per optimizer step, both roles; default as the official scripts: 32, 64 with CISPO or EI"""
    micro_batch_size: int = 1
    """sequences per forward/backward pass on each rank"""
    warmup_steps: int = 0
    """linear warm-up steps from 0"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """learning-rate schedule after the warm-up (lr_at)"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas"""
    conjecturer_learning_rate: float | None = None
    """Conjecturer learning rate; default --learning-rate (the official scripts train both roles at one rate)"""
    sequence_mean_loss: bool = False
    """REINFORCE loss of Eq. 4 (each sequence's mean); default, official: the batch's token sum / its token count"""
    cispo_clip_low: float = 0.0
    """CISPO: lower bound of the token importance weight, 1 - eps_low with eps_low = 1 (App. G.3)"""
    cispo_clip_high: float = 4.0
    """CISPO: upper bound of the token importance weight, 1 + eps_high with eps_high = 3 (App. G.3)"""
    ei_window: int = 3
    """expert iteration: train on stored proofs found in the last this many iterations (App. G.4)"""

    # ablations
    no_guide: bool = False
    """drop the Guide: the Conjecturer's reward is R_solve = 1 - s alone (Table 1, No Guide)"""
    no_conjecturer: bool = False
    """solver-only baseline: no conjectures (Table 1, REINFORCE½ / CISPO / EI)"""
    freeze_conjecturer: bool = False
    """the Conjecturer keeps its initial weights (Table 1, Frozen Conjecturer)"""
    no_problem_conditioning: bool = False
    """the Conjecturer prompt omits the target (Table 1, No Problem Conditioning)"""

    # evaluation
    max_generations: int | None = None
    """stop once this many generations were sampled (the paper's x-axis); default: run all iterations"""


# An iteration on a CPU in about five minutes (SmolLM2-135M: 32 attempts of <= 128 tokens ~70 s, a training step ~30 s).
CPU_DEFAULTS = dict(model="embedded:smollm2", guide_model="embedded:smollm2", max_model_len=1536, micro_batch_size=4,
                    dataset="data/lean_smoke.jsonl", num_problems=8, iterations=2, proofs_per_problem=4, batch_size=8,
                    max_new_tokens=128, conjecturer_max_new_tokens=128, guide_max_new_tokens=128)


def resolve(args: Args) -> tuple[bool, bool, bool]:
    """The official script's values for the flags left unset; the roles in play: (conjecturer, trained, Guide)."""
    if args.learning_rate is None:
        args.learning_rate = 1e-6 if args.solver_objective == "cispo" else 3e-6
    if args.conjecturer_learning_rate is None:
        args.conjecturer_learning_rate = args.learning_rate
    if args.batch_size is None:
        args.batch_size = 64 if args.solver_objective in ("cispo", "expert_iteration") else 32
    use_conjecturer, train_conjecturer = not args.no_conjecturer, not (args.no_conjecturer or args.freeze_conjecturer)
    return use_conjecturer, train_conjecturer, train_conjecturer and not args.no_guide  # the Guide shapes R only


# ---- prompts ----
# Single user turns in the chat template, no system prompt (official). The Solver's: DeepSeek-Prover-V2's non-CoT.
SOLVER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}{statement}\n```"
# The Conjecturer's keep the official layout (prompts.py: the target in a lean4 block, then the request) in our words;
# its starting extraction rate (51.5%, §4.1) was measured on that layout.
CONJECTURER_PROMPT = """Here is a Lean 4 problem statement:
```lean4
{statement}
```
Please write a Lean 4 theorem that is a lemma for the statement above, or a related theorem, and that helps to prove \
it: a proof of the statement above should be able to use it. It should be simpler to prove than the target \
statement. It must NOT be the target statement itself, and NOT the target made equivalent by renaming its \
variables or premises.
Write the theorem as a syntactically correct Lean 4 theorem statement between ```lean4 and ``` tags. The last \
thing you write should be this statement WITHOUT a proof: put 'sorry' where the proof would go."""
# Ablation "no problem conditioning" (Table 1, official get_deepseek_prover_v2_conjecturer_no_grounding_prompt).
CONJECTURER_PROMPT_UNCONDITIONED = """Please write a Lean 4 theorem statement. The theorem should be non-trivial, \
but not too hard to prove. Pick an area of mathematics at random for it, such as algebra, number theory, \
combinatorics, geometry, calculus or logic. The theorem should be interesting and mathematically meaningful, not \
merely a very easy identity or a restatement of a definition.
Write the theorem as a syntactically correct Lean 4 theorem statement between ```lean4 and ``` tags. The last thing \
you write should be this statement WITHOUT a proof: just put `sorry` for the proof."""
# The Guide (LukeBailey181Pub/dspv2_guide) was fine-tuned on the official prompt (App. E.3, get_guide_prompt); ours
# keeps its lean4 blocks, rubrics (order, scales), empty score tags and example (placeholder scores: they'd be copied).
GUIDE_PROMPT = """You are an expert in mathematics. Here is a seed Lean 4 problem statement:

```lean4
{seed_theorem}
```

Here is a lemma, or a related lemma, that is meant to be useful for proving the statement above. It can be useful \
either as a lemma that directly helps to prove the statement above, or as a related lemma whose proof plausibly \
needs similar techniques.

```lean4
{conjecture}
```

Please rate how relevant the lemma is to the seed problem on a scale from 0 to 5, where 0 means "not related at \
all" and 5 means "very useful for proving the target statement". If the lemma is trivial, give it a low score.

Score the lemma with this rubric:
- 0: The lemma is not related at all to the seed problem and is trivial to prove. OR the lemma is the seed problem \
itself (also when it is equivalent up to renaming premises and variables).
- 1: The lemma is not related at all to the seed problem.
- 2: The lemma is related to the seed problem only in being about a similar area of mathematics; it does not \
directly help to prove the seed problem.
- 3: The lemma is related to the seed problem and might help to prove it.
- 4: The lemma directly helps to solve the seed problem: once the lemma is proved, the seed problem is easier.
- 5: The lemma is very useful for solving the seed problem: solving the lemma removes most of the difficulty of the \
seed problem.

Next decide whether the premises are redundant. Rate this 0 or 1:

- 0: No premise is redundant.
- 1: Some premises are redundant: the conclusion can be proved without them.

Next decide whether the conclusion is too complex. Rate this from 0 to 4:

- 0: The conclusion has minimal complexity: one atomic statement (for example an equality, an inequality or a \
property), as clear as possible and easy to apply to other problems.
- 1: The conclusion has low complexity: a few related parts (for example 2-3 conjunctions) that form one coherent \
statement, each part tied to the others and to the premises, so it is still easy to apply.
- 2: The conclusion has moderate complexity: disjunctions between closely related alternatives, or several \
conjunctions (3-4) all on the same theme. Its structure is clear, but applying it takes some thought.
- 3: The conclusion has high complexity: several unrelated disjunctive clauses (2-3 disjunctions), or deeply nested \
logical operators that hide the main claim. Its parts concern somewhat different aspects, weakly connected to each \
other or to the premises, so it is hard to see when and how to apply it.
- 4: The conclusion has very high complexity: a disjunction of many (3 or more) mostly unrelated clauses, or a deeply \
nested logical structure that is hard to read. Its parts concern entirely different mathematical objects or \
properties, so it could hardly be applied meaningfully to other problems. It reads like several lemmas packed into one.

When you have reasoned about all of this, write the scores between the tags:

1) Relevance score: <begin_relevance_score> <end_relevance_score>
2) Redundancy score: <begin_redundancy_score> <end_redundancy_score>
3) Conclusion complexity score: <begin_conclusion_complexity_score> <end_conclusion_complexity_score>



Here is an example:

===========================================
INPUT SEED PROBLEM:
```lean4
theorem aime_1983_p9 (x : ℝ) (h₀ : 0 < x ∧ x < Real.pi) :
  12 ≤ (9 * (x ^ 2 * Real.sin x ^ 2) + 4) / (x * Real.sin x) := by
```

INPUT CONJECTURE:
```lean4
theorem china1993_p6 (x : ℝ) (h₀ : 0 < x ∧ x ≤ π) :
    Real.sqrt (1 + Real.sin x) + Real.sqrt (1 + Real.cos x) ≤
      Real.sqrt (9 + 2 * (Real.sin x + Real.cos x)):= by
```

YOUR OUTPUT: <... your reasoning ...>

<begin_relevance_score>
< ... your relevance score ... >
<end_relevance_score>
<begin_redundancy_score>
< ... your redundancy score ... >
<end_redundancy_score>
<begin_conclusion_complexity_score>
< ... your conclusion complexity score ... >
<end_conclusion_complexity_score>
===========================================
"""
GUIDE_SCORES = ("relevance", "redundancy", "conclusion_complexity")  # the names in the score tags


# ---- data ----
# Problem(id, header, statement): a Lean 4 task of lean_verify (load_problems reads the usual datasets' rows). A
# conjecture also keeps the target it was proposed for and its generation (the Conjecturer's training sequence).
Conjecture = collections.namedtuple("Conjecture", Problem._fields + ("seed_id", "sample"))
# A whole-proof attempt: its Sample (or None), the tactics after ':= by' (or None), Lean's status, verdict and seconds.
Attempt = collections.namedtuple("Attempt", "sample proof status correct seconds", defaults=(0.0,))
# A training sequence: a Sample, its weight (reward or advantage) and, for CISPO, its group's tokens and index.
Example = collections.namedtuple("Example", "sample weight group_tokens group", defaults=(0.0, -1))


def compact(sample: Sample) -> Sample:  # 4 bytes a token, not ~36 in a list: D_3k gives ~26k attempts an iteration
    return sample._replace(prompt_ids=array("i", sample.prompt_ids), token_ids=array("i", sample.token_ids),
                           logprobs=array("f", sample.logprobs))


def parse_guide_scores(completion: str) -> dict[str, float] | None:
    """As official extract_guide_*_score: each text between the last begin and end tags as a float (no range check)."""
    try:
        return {name: float(completion[completion.rindex(f"<begin_{name}_score>") + len(f"<begin_{name}_score>") :
                                       completion.rindex(f"<end_{name}_score>")]) for name in GUIDE_SCORES}
    except ValueError:  # a tag is missing, the text is not a number, or the last end tag is before the last begin tag
        return None


# ---- rewards ----
def solve_rate(attempts: list[Attempt]) -> float:
    """A problem's solve rate s: the share of its attempts that Lean accepted."""
    return sum(a.correct for a in attempts) / len(attempts) if attempts else 0.0


def guide_rewards(reviews: list[dict[str, float] | None]) -> list[float]:
    """Eq. 3 (official sub_scores_to_review); a failed parse gets the others' mean, or 0 (official LLMJudgeGuide)."""
    values = [None if r is None else 0.0 if r["conclusion_complexity"] in (3, 4) else
              max(0.0, r["relevance"] + (2.0 - r["conclusion_complexity"]) + (1.0 - r["redundancy"])) for r in reviews]
    parsed = [v for v in values if v is not None]
    return [(sum(parsed) / len(parsed) if parsed else 0.0) if v is None else v for v in values]


def percentile_cut(rates: list[float], q: float = 0.7) -> float:
    """The official q-th percentile of the solve rates inside (0, 1): sorted(rates)[int(q n)]; 0 when there are none."""
    inside = sorted(r for r in rates if 0.0 < r < 1.0)
    return inside[int(q * len(inside))] if inside else 0.0


def conjecturer_rewards(r_guide: list[float], rates: list[float]) -> list[float]:
    """R = R_guide * (1 - s) (Alg. 1), min-max normalised over the selected conjectures (§3.2); ones if all equal."""
    r = [g * (1.0 - s) for g, s in zip(r_guide, rates)]
    lo, hi = min(r, default=0.0), max(r, default=0.0)
    return [(v - lo) / (hi - lo) if hi > lo else 1.0 for v in r]


def overlong_penalty(length: int, max_tokens: int, buffer: float = 0.2) -> float:
    """§4.1 (DAPO's soft overlong punishment): 0 up to (1 - buffer) M tokens, then linearly down to -1 at M."""
    start = max_tokens * (1.0 - buffer)
    return 0.0 if length <= start else max(-1.0, -(length - start) / (max_tokens * buffer))


def solver_reward(correct: bool, proof: str | None, n_tokens: int, args: Args) -> float:
    """§3.2, §4.1: 1 if Lean accepts the proof, 0 with `try` (deviation 2); if overlong, the overlong penalty."""
    code = strip_comments(proof or "")[0]  # None when a comment is left open: Lean rejects such a proof anyway
    tries = args.penalize_try and re.search(r"(?<![\w.'])try(?![\w'])", proof if code is None else code)
    penalty = overlong_penalty(n_tokens, args.max_new_tokens, args.overlong_buffer)
    return penalty if penalty < 0 else 1.0 if correct and not tries else 0.0


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """CISPO's group-normalised advantage (App. G.3): (r - mean) / (population std + eps) over the k attempts."""
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + eps)).tolist()


# ---- losses ----
def reinforce_loss(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, denominator: float,
                   sequence_mean: bool = False) -> torch.Tensor:
    """As official WeightedTrainer.compute_loss: -(1/N) sum_i w_i sum_t log pi(y_it), N the optimizer batch's completion
    tokens on all ranks; sequence_mean (Eq. 4): -(1/B) sum_i w_i mean_t log pi(y_it), B its sequences. [B, T] inputs."""
    per_sequence = (logp * mask).sum(1) / (mask.sum(1).clamp(min=1) if sequence_mean else 1)
    return -(weights * per_sequence).sum() / denominator


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
               group_tokens: torch.Tensor, n_groups: int, clip_low: float = 0.0, clip_high: float = 4.0
               ) -> torch.Tensor:
    """Eq. 5: -(1/G) sum_groups (1/sum_j |y_j|) sum_i sum_t sg(clip(r_it)) A_i log pi(y_it), r_it = pi / pi_old (the
    sampler's); group_tokens[i]: sample i's group's; G = batch_size / k, also in a last, smaller batch (official)."""
    ratio = torch.exp(logp.detach() - old_logp).clamp(clip_low, clip_high)
    return -((ratio * logp * mask).sum(1) * advantages / group_tokens).sum() / n_groups


# ---- phases ----
def conjecture(sampler, tokenizer, seeds: list[Problem], targets: list[Problem], iteration: int, args: Args,
               dist: Dist) -> tuple[list[Conjecture], dict[str, float]]:
    """Alg. 1, step 1: conjectures_per_target statements per never-solved target (the seeds), parsed (deviation 4: no
    header lines, a conjecture inherits its target's), deduplicated against the targets and each other."""
    prompts = [chat_prompt(tokenizer, CONJECTURER_PROMPT_UNCONDITIONED if args.no_problem_conditioning else
                           CONJECTURER_PROMPT.format(statement=seed.statement)) for seed in seeds]
    outputs = sample(sampler, prompts, args.conjectures_per_target, f"{args.seed}/{iteration}/conjecture", dist,
                     lambda _, rows: [[(compact(s), extract_conjecture(s.text)) for s in row] for row in rows],
                     temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.conjecturer_max_new_tokens)
    found = [(seed, s, x) for seed, row in zip(seeds, outputs) for s, x in row if x is not None]
    seen, conjectures = {" ".join(t.statement.split()) for t in targets}, []  # up to whitespace (deviation 4)
    for seed, s, x in found:
        if (key := " ".join(x.split())) not in seen:
            seen.add(key)
            conjectures.append(Conjecture(f"it{iteration}_c{len(conjectures)}", seed.header, x, seed.id, s))
    conclusions = [theorem_conclusion(c.statement) for c in conjectures] or [""]  # disjunctions: Fig. 2's drift
    n_out = sum(len(row) for row in outputs)
    return conjectures, {"conjecturer/outputs": n_out, "conjecturer/extraction_rate": len(found) / max(n_out, 1),
                         "conjecturer/new_conjectures": len(conjectures),
                         "conjecturer/disjunctive_share": np.mean([("∨" in c or "\\/" in c) for c in conclusions]),
                         "conjecturer/conclusion_chars": np.mean([len(c) for c in conclusions])}


def attempt_proofs(sampler, verifier, tokenizer, problems: list[Problem], n: int, key: str, args: Args, dist: Dist
                   ) -> dict[str, list[Attempt]]:
    """n whole proofs per problem, each with its Sample (Alg. 1, step 2: the Solver trains on it). Each distinct
    (problem, proof) pair is checked once by Lean, on the rank that sampled it, against the original statement."""
    prompts = [chat_prompt(tokenizer, SOLVER_PROMPT.format(header=p.header, statement=p.statement)) for p in problems]

    def check(start: int, rows: list[list[Sample]]) -> list[list[Attempt]]:  # a failed sample has nothing to check
        proofs = [[extract_proof(s.text, whole_block=True) if s.finish_reason in ("stop", "length") else None
                   for s in row] for row in rows]
        verdicts = verifier.verify_attempts(problems[start : start + len(rows)], proofs)
        found = [[(v.status, v.valid, v.time) if v else ("no_code", False) for v in row] for row in verdicts]
        return [[Attempt(compact(s), x, *v) for s, x, v in zip(*r)] for r in zip(rows, proofs, found)]

    rows = sample(sampler, prompts, n, key, dist, check, temperature=args.temperature, top_p=args.top_p,
                  max_new_tokens=args.max_new_tokens)
    return {p.id: row for p, row in zip(problems, rows)}


def record_proofs(proofs: dict[str, list[dict]], attempts: dict[str, list[Attempt]], iteration: int, cap: int):
    """Up to `cap` distinct verified proofs per target (official; a target with one is solved), none of a conjecture."""
    for pid in [pid for pid in attempts if pid in proofs]:
        for a in attempts[pid]:
            if a.correct and a.proof not in {p["proof"] for p in proofs[pid]} and len(proofs[pid]) < cap:
                proofs[pid].append({"proof": a.proof, "iteration": iteration, "prompt_ids": a.sample.prompt_ids,
                                    "token_ids": a.sample.token_ids, "text": a.sample.text})


def solver_examples(problems: list[Problem], attempts: dict[str, list[Attempt]], rates: dict[str, float],
                    proofs: dict[str, list[dict]], iteration: int, args: Args, rng: random.Random) -> list[Example]:
    """REINFORCE½ (§3.2): correct attempts at problems with 0 < s <= 1/2, weight = reward, none using `try` (official);
    CISPO (App. G.3): all k attempts at problems with 0 < s < 1, weight = group-normalised advantage, whole groups, none
    of advantage 0 (deviation 6); expert iteration (App. G.4): stored target proofs of the last ei_window iterations."""
    rows = [(attempts[p.id], rates[p.id]) for p in problems]
    if args.solver_objective == "cispo":
        rewards = [[solver_reward(a.correct, a.proof, len(a.sample.token_ids), args) for a in row] for row, _ in rows]
        # official: a group whose rewards are all 0 (its correct proofs used `try`) is skipped
        groups = [(row, group_advantages(r), float(sum(len(a.sample.token_ids) for a in row)))
                  for (row, s), r in zip(rows, rewards) if 0 < s < 1 and any(r)]
        rng.shuffle(groups)
        return [Example(a.sample, w, tokens, g) for g, (row, adv, tokens) in enumerate(groups)
                for a, w in zip(row, adv) if w != 0]
    if args.solver_objective == "expert_iteration":
        found = [(Sample(p["text"], p["prompt_ids"], p["token_ids"], [], "stop"), p["proof"])
                 for stored in proofs.values() for p in stored if p["iteration"] > iteration - args.ei_window]
    else:  # incorrect attempts teach nothing in REINFORCE½ (official code)
        found = [(a.sample, a.proof) for row, s in rows if 0 < s <= args.solve_rate_max for a in row if a.correct]
    # weight 1 or the overlong penalty; a proof using `try` is dropped, overlong or not (official)
    examples = [Example(s, solver_reward(True, proof, len(s.token_ids), args)) for s, proof in found
                if solver_reward(True, proof, 0, args)]
    rng.shuffle(examples)
    return examples


def review(sampler, tokenizer, conjectures: list[Conjecture], targets: list[Problem], iteration: int, args: Args,
           dist: Dist) -> tuple[list[float], dict[str, float]]:
    """The Guide scores each conjecture (at least one) against its target (§3.1, Eq. 3): R_guide, one review each."""
    seed = {t.id: t.statement for t in targets}
    prompts = [chat_prompt(tokenizer, GUIDE_PROMPT.format(seed_theorem=seed[c.seed_id], conjecture=c.statement))
               for c in conjectures]
    reviews = sample(sampler, prompts, 1, f"{args.seed}/{iteration}/guide", dist,
                     lambda _, rows: [parse_guide_scores(row[0].text) for row in rows], temperature=args.temperature,
                     top_p=args.top_p, max_new_tokens=args.guide_max_new_tokens)
    r_guide, parsed = guide_rewards(reviews), [r for r in reviews if r is not None]
    quartiles = zip(("q25", "median", "q75"), np.percentile(r_guide, [25, 50, 75]).tolist())
    return r_guide, {"guide/parse_failure_rate": 1 - len(parsed) / len(reviews), "guide/r_guide_mean": np.mean(r_guide),
                     "guide/r_guide_zero_share": r_guide.count(0) / len(r_guide),
                     **{f"guide/r_guide_{name}": q for name, q in quartiles},
                     **{f"guide/{name}_mean": np.mean([r[name] for r in parsed]) for name in GUIDE_SCORES if parsed}}


def conjecturer_examples(selected: list[Conjecture], rates: dict[str, float], r_guide: list[float], args: Args,
                         rng: random.Random) -> list[Example]:
    """Weight R_guide * (1 - s), min-max normalised (§3.2), or the overlong penalty. As official
    prepare_conjecturer_train_data: the whole generation is the target; weight 0 stays (its tokens count)."""
    penalties = [overlong_penalty(len(c.sample.token_ids), args.conjecturer_max_new_tokens, args.overlong_buffer)
                 for c in selected]
    rewards = conjecturer_rewards(r_guide, [rates[c.id] for c in selected])
    examples = [Example(c.sample, p if p < 0 else w) for c, p, w in zip(selected, penalties, rewards)]
    rng.shuffle(examples)
    return examples


def update(policy, optimizer, examples: list[Example], lr: float, objective: str, args: Args, dist: Dist
           ) -> dict[str, float]:
    """One epoch from a fresh Adam state (official: a new trainer an iteration); CISPO: batch_size / k whole groups."""
    optimizer.state.clear()
    cispo, size = objective == "cispo", max(1, args.batch_size // args.proofs_per_problem)
    batches = ([[e for e in examples if g <= e.group < g + size] for g in range(0, examples[-1].group + 1, size)]
               if cispo else [examples[i : i + args.batch_size] for i in range(0, len(examples), args.batch_size)])
    stats = []
    for step, batch in enumerate(batches):
        # REINFORCE's denominator: the batch's completion tokens (official) or sequences (Eq. 4, --sequence-mean-loss)
        n = len(batch) if args.sequence_mean_loss else sum(len(e.sample.token_ids) for e in batch)

        def loss_fn(micro: list[Example]) -> tuple[torch.Tensor, dict]:
            # CISPO's importance ratio compares with the sampler's log-probs: renormalise over its top-p nucleus too
            logp, mask, _ = token_logprobs(policy, [e.sample for e in micro], args.temperature,
                                           args.top_p if cispo else 1.0)
            weights = logp.new_tensor([e.weight for e in micro])
            if not cispo:
                return reinforce_loss(logp, mask, weights, n, args.sequence_mean_loss), {}
            old = torch.stack([torch.nn.functional.pad(logp.new_tensor(e.sample.logprobs),  # pi_old, padded as logp
                                                       (0, logp.shape[1] - len(e.sample.logprobs))) for e in micro])
            return cispo_loss(logp, old, mask, weights, logp.new_tensor([e.group_tokens for e in micro]), size,
                              args.cispo_clip_low, args.cispo_clip_high), {}  # official: / groups_per_batch, fixed

        stats.append(train_step(policy, optimizer, batch, loss_fn, args.micro_batch_size, args.max_grad_norm, dist,
                                length=lambda e: len(e.sample.prompt_ids) + len(e.sample.token_ids),
                                lr=lr_at(step, len(batches), lr, args.warmup_steps, args.lr_schedule)))
    return {"loss": float(np.mean([s["loss"] for s in stats])), "steps": len(stats),
            "grad_norm": float(np.mean([s["grad_norm"] for s in stats]))}


# ---- evaluation ----
def solve_metrics(targets: list[Problem], proofs: dict[str, list[dict]], attempts: dict[str, list[Attempt]], k: int,
                  generations: int = 0) -> dict[str, float]:
    """The paper's metric, the cumulative solve rate (Fig. 1: the share of targets ever proved) against generations;
    this iteration's pass@k over the targets attempted (Fig. 3), the Solver's entropy (Fig. 7, deviation 5), Lean's."""
    tried = [attempts[t.id] for t in targets if t.id in attempts]
    rates = [solve_rate(row) for pid, row in attempts.items() if pid not in proofs]  # of the conjectures
    every = [a for row in attempts.values() for a in row]
    logps, statuses = np.concatenate([a.sample.logprobs for a in every] or [np.zeros(0)]), [a.status for a in every]
    return {"charts/cumulative_solve_rate": sum(bool(proofs[t.id]) for t in targets) / len(targets),
            "charts/generations": generations,
            f"charts/pass@{k}": float(np.mean([pass_at_k(k, sum(a.correct for a in row), k) for row in tried or [[]]])),
            "charts/targets_attempted": len(tried), "solver/entropy": -float(logps.mean()) if logps.size else 0.0,
            **{f"lean/{s}_share": statuses.count(s) / len(statuses) for s in sorted(set(statuses))},
            **({"conjecturer/solve_rate_mean": float(np.mean(rates))} if rates else {})}


def nothing_learned(outcomes: collections.Counter, args: Args) -> str:
    """A run's last line when the Solver had no training example (the CPU default on the embedded model): why."""
    n, accepted = sum(outcomes.values()), outcomes["valid"]
    why = (f"{accepted} of {n} attempts accepted, none a {args.solver_objective} example (solve rates out of its "
           "range, or `try`)" if accepted else f"no proof accepted in {n} attempts")
    return (f"{os.path.basename(__file__)}: no Solver update in this run: {why}: "
            + ", ".join(f"{k} {v / n:.0%}" for k, v in outcomes.most_common()) + " (no_code: not one closed ```lean4 "
            f"block with the theorem; cut_off: at --max-new-tokens {args.max_new_tokens}). tests/test_sgs.py's loop "
            "learning test shows the loop learning where proofs are accepted.")


# ---- main ----
def weights_only(models: dict) -> dict:  # every update starts from a fresh Adam state: checkpoints keep no moments
    return {name: (model, None) for name, (model, _) in models.items()}


def main(args: Args) -> None:
    if args.solver_objective == "expert_iteration" and not args.no_conjecturer:
        sys.exit("sgs.py: expert iteration is the solver-only baseline of App. G.4; add --no-conjecturer")
    use_conjecturer, train_conjecturer, use_guide = resolve(args)  # before the CPU scaling, which a flag overrides
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS, sys.argv[1:])
    try:  # stop at once, before any model is loaded, when there is no Lean
        workers = max(1, args.lean_workers // dist.local_world_size) if args.lean_workers else None  # this rank's
        verifier = LeanVerifier(backend="auto", timeout=args.lean_timeout, workers=workers)
    except LeanNotInstalled as e:
        sys.exit(f"{os.path.basename(__file__)} checks every proof with Lean 4 and Mathlib, and found none: {e}")
    if dist.is_main:
        print(f"lean_verify: {verifier.workers} REPL(s) on each of the node's {dist.local_world_size} rank(s)")
    targets = load_problems(args.dataset, args.num_problems)

    # the Solver and the Conjecturer: two trained copies of the base model; the Guide: a frozen one (deviation 8)
    tokenizer = load_tokenizer(args.model)
    solver = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    conjecturer = load_model(args.conjecturer_model or args.model, dist, train_conjecturer,
                             args.gradient_checkpointing) if use_conjecturer else None
    guide = load_model(args.guide_model, dist, train=False) if use_guide else None
    adamw = functools.partial(torch.optim.AdamW, betas=args.adam_betas, weight_decay=0.0)
    models = {"solver": (solver, adamw(solver.parameters(), args.learning_rate))}
    if train_conjecturer:
        models["conjecturer"] = (conjecturer, adamw(conjecturer.parameters(), args.conjecturer_learning_rate))
    # run state: the proofs stored for each target (solved = at least one) and the number of generations
    start, state = 0, {"proofs": {t.id: [] for t in targets}, "generations": 0}
    if args.resume and (found := load_checkpoint(run_dir, weights_only(models), dist)) is not None:
        start, state = found
    sampler = Sampler(args.model, solver, tokenizer, dist, args.backend, args.max_model_len,
                      args.gpu_memory_utilization, args.vllm_sleep, seed=args.seed)
    proofs, outcomes, trained = state["proofs"], collections.Counter(), 0  # this run's verdicts, Solver examples

    for iteration in range(start, args.iterations):
        metrics, rng = {}, random.Random(f"{args.seed}/{iteration}")  # the same on every rank: the same batches

        # 1. Conjecture: one statement for each target that was never solved
        conjectures = []
        if use_conjecturer:
            with logger.timer("conjecture"):
                seeds = [t for t in targets if not proofs[t.id]]
                sampler.sync_weights(conjecturer)
                conjectures, stats = conjecture(sampler, tokenizer, seeds, targets, iteration, args, dist)
                state["generations"] += stats["conjecturer/outputs"]
                metrics.update(stats)

        # 2. Solve: k attempts at every target and every conjecture (EI: at targets with fewer than 16 proofs)
        with logger.timer("solve"):
            problems = [t for t in targets if args.solver_objective != "expert_iteration"
                        or len(proofs[t.id]) < args.max_stored_proofs] + conjectures
            sampler.sync_weights(solver)
            attempts = attempt_proofs(sampler, verifier, tokenizer, problems, args.proofs_per_problem,
                                      f"{args.seed}/{iteration}/solve", args, dist)
            state["generations"] += len(problems) * args.proofs_per_problem
            record_proofs(proofs, attempts, iteration, args.max_stored_proofs)
            rates = {pid: solve_rate(row) for pid, row in attempts.items()}  # s

        # 3-4. The Solver's training set (REINFORCE½, CISPO or EI); the Conjecturer's: 0 < s <= p70, R = R_guide (1 - s)
        solver_set, conjecturer_set = solver_examples(problems, attempts, rates, proofs, iteration, args, rng), []
        outcomes.update("cut_off" if a.status == "no_code" and a.sample.finish_reason == "length" else a.status
                        for row in attempts.values() for a in row)
        trained += len(solver_set)
        if train_conjecturer and conjectures:
            with logger.timer("guide"):
                p70 = percentile_cut([rates[c.id] for c in conjectures], args.conjecture_percentile)
                selected = [c for c in conjectures if 0 < rates[c.id] <= p70]
                r_guide = [1.0] * len(selected)  # without a Guide, R = R_solve
                if use_guide and selected:
                    sampler.sync_weights(guide)
                    r_guide, stats = review(sampler, tokenizer, selected, targets, iteration, args, dist)
                    metrics.update(stats)
                conjecturer_set = conjecturer_examples(selected, rates, r_guide, args, rng)
                metrics.update({"conjecturer/p70": p70, "conjecturer/selected": len(selected)})

        # 5. Update the Solver and the Conjecturer
        with logger.timer("update"):
            sampler.sleep()
            roles = {"solver": (solver_set, args.learning_rate, args.solver_objective),
                     "conjecturer": (conjecturer_set, args.conjecturer_learning_rate, "reinforce")}
            for name, (examples, lr, objective) in roles.items():
                if examples:
                    stats = update(*models[name], examples, lr, objective, args, dist)
                    metrics.update({f"losses/{name}_{k}": v for k, v in stats.items()})

        metrics.update({"data/solver_examples": len(solver_set), "data/conjecturer_examples": len(conjecturer_set),
                        **solve_metrics(targets, proofs, attempts, args.proofs_per_problem, state["generations"])})
        logger.log(metrics, step=iteration + 1)
        done = args.max_generations is not None and state["generations"] >= args.max_generations
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.iterations or done:
            save_checkpoint(run_dir, iteration + 1, weights_only(models), tokenizer, state, dist)
        if done:
            break
    if dist.is_main and outcomes and not trained:
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
