"""SGS: Self-Guided Self-Play for Lean 4 theorem proving.

Paper: Bailey, Wen, Dong, Hashimoto, Ma, "Scaling Self-Play with Self-Guidance",
arXiv 2604.20209 (2026). Official code: github.com/LukeBailey181/sgs (read at 64d2de4;
this file copies none of it).

Method. One base model (DeepSeek-Prover-V2-7B) plays three roles (§3):
- the Solver writes whole Lean 4 proofs;
- the Conjecturer (trained, with its own weights) writes a conjecture, a simpler related
  statement, for each seed (select_seeds: each target the Solver never solved);
- the Guide, a frozen copy fine-tuned to grade conjectures, scores a conjecture's relevance
  to its target, its redundant premises and its tangled conclusion: R_guide (Eq. 3,
  guide_rewards).
Terms. The targets D: D_3k, about 3.3k hard Lean 4 problems (--dataset). k: the Solver's
attempts at each problem (--proofs-per-problem, 8). s: a problem's solve rate, the share of
its k attempts that Lean accepted (solve_rate). M: a role's longest completion, in tokens
(--max-new-tokens for the Solver); a completion in the last 20% of M is penalised
(overlong_penalty, §4.1, after DAPO, arXiv 2503.14476). p70: the 70th percentile of the
conjectures' solve rates inside (0, 1) (--conjecture-band, select_conjectures). A band:
a (low, high) pair of solve rates that a rule keeps, each end's inclusion stated in its
flag and its predicate (in_reinforce_half_band, in_cispo_band, in_conjecture_band).

Each iteration (Algorithm 1), under the same numbers in main:
  1. Conjecture (conjecture): conjectures_per_target conjectures for each seed (select_seeds).
  2. Solve (attempt_proofs): k Solver attempts at every target and every conjecture,
     each checked by Lean.
  3. The Solver's training set (solver_examples), by --solver-objective (SOLVER_OBJECTIVES;
     the paper's three):
     REINFORCE½ (§3.2), REINFORCE on the correct proofs of problems with 0 < s <= 1/2
     (--reinforce-half-band, reinforce_half_examples); CISPO (App. G.3, after MiniMax-M1),
     a policy gradient with clipped, stopped importance weights on group-normalised
     advantages (cispo_examples); or EI, expert iteration (App. G.4), training on the
     stored proofs of the last iterations (expert_iteration_examples).
  4. The Conjecturer's training set: the conjectures the Solver proved sometimes, but no
     more often than p70 (--conjecture-band, select_conjectures); the Guide's R_guide of
     each (review); their reward from R_guide and s (conjecturer_examples).
  5. Update (update): one epoch for each role that trains, with its objective's batch
     loss: REINFORCE a weighted_nll_loss (reinforce_batch_loss), CISPO its cispo_loss
     (cispo_batch_loss).
The metric (Fig. 1, solve_metrics): the cumulative share of targets ever solved, against
the number of generations (the Conjecturer's statements and the Solver's proofs sampled so
far; the Guide's reviews are not counted).
Where the paper is silent or differs, this file follows the official code, but for the deviations
below.

Sources (official code at 64d2de4), where each rule of this file was read: the prompts
(CONJECTURER_PROMPT*, GUIDE_PROMPT) from sgs/utils/prompts.py (get_deepseek_prover_v2_*,
get_guide_prompt); parse_guide_scores and guide_rewards from llm_judge_guide.py
(extract_guide_*_score, sub_scores_to_review, LLMJudgeGuide.review); the training sets
(proof_examples, cispo_examples, select_conjectures, conjecturer_examples) from
step1_data_gen.py and step2_train.py (prepare_prover_train_data,
prepare_conjecturer_train_data); the losses (reinforce_batch_loss, cispo_batch_loss) from
custom_trainers.py (WeightedTrainer.compute_loss, GroupedImportanceSampledWeightedTrainer);
the roles and defaults from scripts/*.py.

Records: lean_verify's Problem(id, header, statement), a statement to prove; the infrastructure
block's Sample(text, prompt_ids, token_ids, logprobs, finish_reason), one completion as the sampler
drew it, and Dist(rank, world_size, local_world_size, device, is_main, objects), this process among
torchrun's; this file's Conjecture, Attempt and Example, under "data", and Roles (roles_in_play).

Run (needs Lean: `bash setup.sh --lean`). Without CUDA, Args' defaults are CPU_DEFAULTS (a loop
sized for a laptop, on SmolLM2-135M and data/lean_smoke.jsonl; the run prints them), so
`python sgs.py` and `main(Args())` run it alike and a value given keeps it. Under
`torchrun --nproc_per_node 8` on 8xH200, the paper's sizes. Experiment map: README.md.
Roles not in play (roles_in_play: --no-conjecturer, --freeze-conjecturer, --no-guide) are
not loaded, prompted or trained, and their metrics are absent from metrics.jsonl (not 0).

Deliberate deviations from the official code:
  1. Generation and verification are not pipelined; sampling is seeded by position; a (problem,
     proof) is checked once.
  2. The try penalty (§4.1) looks for the `try` tactic outside comments (uses_try); the
     official code for the substring "try".
  3. Lean timeout 200 s (paper); the official default is 500 s.
  4. A conjecture is the theorem alone (lean_verify.extract_conjecture), deduplicated
     ignoring spaces and newlines (STP's rule; the official SGS code: the exact string).
  5. solver/entropy is -mean log pi(y_t) over the sampled tokens; the paper's is from the
     top-10 log-probabilities.
  6. CISPO attempts of advantage 0 are left out of the batch (their tokens still count in
     the group's).
  7. The expert-iteration objective is the solver-only baseline of App. G.4 and is refused
     with a Conjecturer.
  8. One sampler serves the three roles (their weights are loaded in turn).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
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
    load_problems,
    strip_comments,
    theorem_conclusion,
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
    """Lean REPL processes on each node, divided among its ranks (default: lean_verify's share of
    the machine)"""
    lean_timeout: float = 200.0
    """Lean's wall-clock limit per proof, in seconds"""
    conjecturer_model: str | None = None
    """the Conjecturer's initial weights, trained separately from the Solver's (§3);
    default: --model"""
    guide_model: str = "LukeBailey181Pub/dspv2_guide"
    """the frozen Guide: DeepSeek-Prover-V2-7B fine-tuned to write the score tags (§4.1);
    --model's architecture"""

    # data
    dataset: str = "LukeBailey181Pub/D_3k"
    """target set D: a Hugging Face dataset with rows (id, header, theorem), or a .jsonl file
    (miniF2F fields)"""
    num_problems: int | None = None
    """use only the first N problems of --dataset (default all)"""

    # algorithm
    iterations: int = 500
    """self-play iterations to run (the official scripts stop at 500; the paper reports
    about 200)"""
    proofs_per_problem: int = 8
    """k: Solver attempts per target and per conjecture (§4.1)"""
    conjectures_per_target: int = 1
    """conjectures sampled per seed (select_seeds; Table 1)"""
    # App. C: temperature 1 and top-p 1 for every role, Adam betas (0.9, 0.95), gradient
    # clipping 1.0, constant lr
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
    reinforce_half_band: tuple[float, float] = (0.0, 0.5)
    """REINFORCE½ trains on problems with low < s <= high: low excluded, high included
    (reinforce_half_examples, in_reinforce_half_band)"""
    cispo_band: tuple[float, float] = (0.0, 1.0)
    """CISPO trains on the groups of problems with low < s < high: both ends excluded
    (cispo_examples, in_cispo_band)"""
    conjecture_band: tuple[float, float] = (0.0, 1.0)
    """a conjecture can be rewarded at low < s < high, both ends excluded; p70 is a percentile
    of these rates (select_conjectures, in_conjecture_band)"""
    conjecture_percentile: float = 0.7
    """the percentile of p70, the Conjecturer's selection; 0: the lowest rate, 1: the highest
    (select_conjectures)"""
    max_stored_proofs: int = 16
    """verified proofs kept per solved target"""
    overlong_buffer: float = 0.2
    """the last fraction of M where a rollout's reward falls to -1 (overlong_penalty)"""
    penalize_try: bool = True
    """reward 0 for Solver proofs that use the try tactic (§4.1, uses_try)"""
    solver_objective: Literal["reinforce_half", "cispo", "expert_iteration"] = "reinforce_half"
    """Solver update: REINFORCE½ (§3.2), CISPO (App. G.3, Eq. 5) or expert iteration
    (App. G.4) (solver_examples)"""
    learning_rate: float | None = None
    """Solver learning rate; default: the --solver-objective's entry in SOLVER_OBJECTIVES
    (the official scripts': 3e-6, 1e-6 with CISPO)"""
    batch_size: int | None = None
    """sequences per optimizer step, both roles; default: the --solver-objective's entry in
    SOLVER_OBJECTIVES (the official scripts': 32, 64 with CISPO or EI)"""
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
    """Conjecturer learning rate; default --learning-rate (the official scripts train both
    roles at one rate)"""
    conjecturer_normalization: Literal["min_max", "none"] = "min_max"
    """the Conjecturer's weights from its rewards R_i: min_max_normalize (official) or
    raw_rewards (none: the raw R_i) (conjecturer_examples, CONJECTURER_NORMALIZATIONS)"""
    sequence_mean_loss: bool = False
    """REINFORCE loss of Eq. 4, each sequence's mean; default, official: the batch's token sum
    over its token count (update)"""
    cispo_clip_low: float = 0.0
    """CISPO: lower bound of the token importance weight, 1 - eps_low with eps_low = 1
    (App. G.3)"""
    cispo_clip_high: float = 4.0
    """CISPO: upper bound of the token importance weight, 1 + eps_high with eps_high = 3
    (App. G.3)"""
    ei_window: int = 3
    """expert iteration: train on stored proofs found in the last this many iterations
    (App. G.4)"""

    # ablations
    no_guide: bool = False
    """drop the Guide: R_guide = 1 for every conjecture (main's step 4, before
    conjecturer_reward; Table 1, No Guide)"""
    no_conjecturer: bool = False
    """solver-only baseline: no conjectures (Table 1, REINFORCE½ / CISPO / EI)"""
    freeze_conjecturer: bool = False
    """the Conjecturer keeps its initial weights (Table 1, Frozen Conjecturer)"""
    no_problem_conditioning: bool = False
    """the Conjecturer prompt omits the target (Table 1, No Problem Conditioning)"""

    # evaluation
    max_generations: int | None = None
    """stop once this many generations were sampled (the paper's x-axis); default: run all
    iterations"""


# An iteration on a CPU in about five minutes (SmolLM2-135M: 32 attempts of <= 128 tokens
# ~70 s, a training step ~30 s).
CPU_DEFAULTS = dict(
    model="embedded:smollm2",
    guide_model="embedded:smollm2",
    max_model_len=1536,
    micro_batch_size=4,
    dataset="data/lean_smoke.jsonl",
    num_problems=8,
    iterations=2,
    proofs_per_problem=4,
    batch_size=8,
    max_new_tokens=128,
    conjecturer_max_new_tokens=128,
    guide_max_new_tokens=128,
)


def resolve(args: Args) -> Args:
    """Stops the run at start on flags that cannot run together (expert iteration with a
    Conjecturer); fills the flags left unset (None) with the official scripts' values;
    returns args: the learning rate and batch size from the objective's entry in
    SOLVER_OBJECTIVES. main calls it first, before anything loads, then check_choices."""
    if args.solver_objective == "expert_iteration" and not args.no_conjecturer:
        baseline = "expert iteration is the solver-only baseline of App. G.4"
        sys.exit(f"sgs.py: {baseline}; add --no-conjecturer")
    objective = solver_objective(args)
    if args.learning_rate is None:
        args.learning_rate = objective.learning_rate
    if args.conjecturer_learning_rate is None:
        args.conjecturer_learning_rate = args.learning_rate
    if args.batch_size is None:
        args.batch_size = objective.batch_size
    return args


class Roles(NamedTuple):
    """The roles in play (roles_in_play); the Solver always plays."""

    use_conjecturer: bool  # conjectures are written and attempted (not --no-conjecturer)
    train_conjecturer: bool  # the Conjecturer trains (not --freeze-conjecturer)
    use_guide: bool  # the Guide reviews the selected conjectures (not --no-guide)


def roles_in_play(args: Args) -> Roles:
    """The roles the flags leave in play. The Guide only shapes the Conjecturer's reward,
    so it plays only when the Conjecturer trains. load_models loads only these, and main
    runs only their steps (1, 4) and logs only their metrics."""
    use_conjecturer = not args.no_conjecturer
    train_conjecturer = use_conjecturer and not args.freeze_conjecturer
    use_guide = train_conjecturer and not args.no_guide
    return Roles(
        use_conjecturer=use_conjecturer,
        train_conjecturer=train_conjecturer,
        use_guide=use_guide,
    )


# ---- prompts ----
# Single user turns in the chat template, no system prompt (official). The Solver's:
# DeepSeek-Prover-V2's non-CoT.
SOLVER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}{statement}\n```"
# The Conjecturer's keep the official layout (the target in a lean4 block, then the
# request) in our words; its starting extraction rate (51.5%, §4.1) was measured on that
# layout.
CONJECTURER_PROMPT = """Here is a Lean 4 problem statement:
```lean4
{statement}
```
Please write a Lean 4 theorem that is a lemma for the statement above, or a related theorem, \
and that helps to prove it: a proof of the statement above should be able to use it. It should \
be simpler to prove than the target statement. It must NOT be the target statement itself, and \
NOT the target made equivalent by renaming its variables or premises.
Write the theorem as a syntactically correct Lean 4 theorem statement between ```lean4 and ``` \
tags. The last thing you write should be this statement WITHOUT a proof: put 'sorry' where the \
proof would go."""
# Ablation "no problem conditioning" (Table 1; the official prompt without grounding).
CONJECTURER_PROMPT_UNCONDITIONED = """Please write a Lean 4 theorem statement. The theorem \
should be non-trivial, but not too hard to prove. Pick an area of mathematics at random for \
it, such as algebra, number theory, combinatorics, geometry, calculus or logic. The theorem \
should be interesting and mathematically meaningful, not merely a very easy identity or a \
restatement of a definition.
Write the theorem as a syntactically correct Lean 4 theorem statement between ```lean4 and ``` \
tags. The last thing you write should be this statement WITHOUT a proof: just put `sorry` for \
the proof."""
# The Guide (LukeBailey181Pub/dspv2_guide) was fine-tuned on the official prompt (App.
# E.3); ours keeps its lean4 blocks, rubrics (order, scales), empty score tags
# and example (placeholder scores: they'd be copied).
GUIDE_PROMPT = """You are an expert in mathematics. Here is a seed Lean 4 problem statement:

```lean4
{seed_theorem}
```

Here is a lemma, or a related lemma, that is meant to be useful for proving the statement \
above. It can be useful either as a lemma that directly helps to prove the statement above, or \
as a related lemma whose proof plausibly needs similar techniques.

```lean4
{conjecture}
```

Please rate how relevant the lemma is to the seed problem on a scale from 0 to 5, where 0 \
means "not related at all" and 5 means "very useful for proving the target statement". If the \
lemma is trivial, give it a low score.

Score the lemma with this rubric:
- 0: The lemma is not related at all to the seed problem and is trivial to prove. OR the lemma \
is the seed problem itself (also when it is equivalent up to renaming premises and variables).
- 1: The lemma is not related at all to the seed problem.
- 2: The lemma is related to the seed problem only in being about a similar area of \
mathematics; it does not directly help to prove the seed problem.
- 3: The lemma is related to the seed problem and might help to prove it.
- 4: The lemma directly helps to solve the seed problem: once the lemma is proved, the seed \
problem is easier.
- 5: The lemma is very useful for solving the seed problem: solving the lemma removes most of \
the difficulty of the seed problem.

Next decide whether the premises are redundant. Rate this 0 or 1:

- 0: No premise is redundant.
- 1: Some premises are redundant: the conclusion can be proved without them.

Next decide whether the conclusion is too complex. Rate this from 0 to 4:

- 0: The conclusion has minimal complexity: one atomic statement (for example an equality, an \
inequality or a property), as clear as possible and easy to apply to other problems.
- 1: The conclusion has low complexity: a few related parts (for example 2-3 conjunctions) \
that form one coherent statement, each part tied to the others and to the premises, so it is \
still easy to apply.
- 2: The conclusion has moderate complexity: disjunctions between closely related \
alternatives, or several conjunctions (3-4) all on the same theme. Its structure is clear, but \
applying it takes some thought.
- 3: The conclusion has high complexity: several unrelated disjunctive clauses (2-3 \
disjunctions), or deeply nested logical operators that hide the main claim. Its parts concern \
somewhat different aspects, weakly connected to each other or to the premises, so it is hard \
to see when and how to apply it.
- 4: The conclusion has very high complexity: a disjunction of many (3 or more) mostly \
unrelated clauses, or a deeply nested logical structure that is hard to read. Its parts \
concern entirely different mathematical objects or properties, so it could hardly be applied \
meaningfully to other problems. It reads like several lemmas packed into one.

When you have reasoned about all of this, write the scores between the tags:

1) Relevance score: <begin_relevance_score> <end_relevance_score>
2) Redundancy score: <begin_redundancy_score> <end_redundancy_score>
3) Conclusion complexity score: <begin_conclusion_complexity_score> \
<end_conclusion_complexity_score>



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
GUIDE_SCORES = ("relevance", "redundancy", "conclusion_complexity")  # the score tags' names


def solver_prompt(tokenizer, problem: Problem, args: Args) -> str:
    """The Solver's prompt for a problem: SOLVER_PROMPT as a chat turn (chat_prompt)."""
    text = SOLVER_PROMPT.format(header=problem.header, statement=problem.statement)
    return chat_prompt(tokenizer, text)


# ---- data ----
# Problem(id, header, statement) is lean_verify's Lean 4 task (load_problems reads the usual
# datasets' rows).


class Conjecture(NamedTuple):
    """A conjectured statement: a Problem's fields, then where it came from."""

    id: str
    header: str
    statement: str
    seed: Problem  # the target it was conjectured for (its statement: seed.statement)
    sample: Sample  # its generation: the Conjecturer's training sequence


class Attempt(NamedTuple):
    """One sampled whole proof and Lean's verdict on it."""

    sample: Sample
    proof: str | None  # the tactics after ':= by' when Lean accepted them, else None
    status: str  # Lean's status ("valid", "error", ...), or "no_code" for no proof to check
    correct: bool  # Lean accepted the proof
    seconds: float = 0.0  # Lean's time on the proof


class Example(NamedTuple):
    """A training sequence: its Sample, its weight, and the record it came from."""

    sample: Sample  # the prompt and target tokens
    weight: float  # the number the loss multiplies: a reward, an advantage, a label
    source: object = None  # the record it was made from (an Attempt, a Conjecture, ...)
    # method-specific fields may follow, each with a default
    group_tokens: float = 0.0  # CISPO: the tokens of the sample's group
    group: int = -1  # its group's index, batched whole by optimizer_batches (CISPO); -1: none


def example_length(example: Example) -> int:
    """An Example's prompt and target tokens (micro_batches' sort key)."""
    return len(example.sample.prompt_ids) + len(example.sample.token_ids)


def compact(sample: Sample) -> Sample:
    """The sample with its lists as arrays: 4 bytes a token, not ~36 in a list (D_3k gives
    ~26k attempts an iteration)."""
    return sample._replace(
        prompt_ids=array("i", sample.prompt_ids),
        token_ids=array("i", sample.token_ids),
        logprobs=array("f", sample.logprobs),
    )


def statement_key(statement: str) -> str:
    """A statement as duplicates are found: without spaces and newlines (STP's rule)."""
    return statement.replace(" ", "").replace("\n", "")


def parse_guide_scores(completion: str) -> dict[str, float] | None:
    """The Guide's three scores in a completion, as the official parser: each score is the
    text between the last begin tag and the last end tag, as a float (no range check); None
    if one is missing or not a number. review's guide_rewards reads them."""
    scores = {}
    for name in GUIDE_SCORES:
        begin = f"<begin_{name}_score>"
        end = f"<end_{name}_score>"
        # ValueError: a tag is missing, the text is not a number, or the last end tag is
        # before the last begin tag
        try:
            start = completion.rindex(begin) + len(begin)
            scores[name] = float(completion[start : completion.rindex(end)])
        except ValueError:
            return None
    return scores


# ---- rewards ----
def solve_rate(attempts: list[Attempt]) -> float:
    """A problem's solve rate s: the share of its attempts that Lean accepted (0 for no
    attempts: unsolved). main's rates {id: s} feed every band of steps 3 and 4."""
    if not attempts:
        return 0.0
    return sum(a.correct for a in attempts) / len(attempts)


def in_reinforce_half_band(s: float, args: Args) -> bool:
    """REINFORCE½'s band (§3.2): whether a problem solved at rate s trains the Solver:
    low < s <= high, (low, high) = --reinforce-half-band, low excluded, high included
    (official 0 < s <= 1/2: solved at least once, at most half the time). Edges: s = 0
    (unsolved) is in only when low < 0; s exactly high is in; low >= high admits nothing."""
    low, high = args.reinforce_half_band
    return low < s <= high


def in_cispo_band(s: float, args: Args) -> bool:
    """CISPO's band (App. G.3): whether a problem solved at rate s has its group trained:
    low < s < high, (low, high) = --cispo-band, both ends excluded (official 0 < s < 1: a group
    with both rewards). Edges: s = 0 is in only when low < 0; s exactly high (1 with the
    default) is out; low >= high admits nothing."""
    low, high = args.cispo_band
    return low < s < high


def in_conjecture_band(s: float, args: Args) -> bool:
    """Step 4's band (§3.2): whether a conjecture solved at rate s can be selected:
    low < s < high, (low, high) = --conjecture-band, both ends excluded (official 0 < s < 1:
    neither unsolved nor always solved). Edges: s = 0 is in only when low < 0; s exactly high
    is out; low >= high admits nothing."""
    low, high = args.conjecture_band
    return low < s < high


def guide_rewards(reviews: list[dict[str, float] | None]) -> list[float]:
    """R_guide of each review (Eq. 3, as official): 0 if the conclusion's complexity is 3 or
    4, else max(0, relevance + (2 - complexity) + (1 - redundancy)). A failed parse (None)
    gets the mean of the others, or 0 when every parse failed (official); [] for []."""
    values = []
    for r in reviews:
        if r is None:
            values.append(None)
            continue
        complexity = r["conclusion_complexity"]
        if complexity in (3, 4):
            values.append(0.0)
            continue
        score = r["relevance"] + (2.0 - complexity) + (1.0 - r["redundancy"])
        values.append(max(0.0, score))
    parsed = [v for v in values if v is not None]
    fill = sum(parsed) / len(parsed) if parsed else 0.0
    return [fill if v is None else v for v in values]


def overlong_penalty(length: int, max_tokens: int, buffer: float = 0.2) -> float:
    """§4.1 (DAPO's soft overlong punishment): 0 up to (1 - buffer) M tokens, then linearly
    down to -1 at M = max_tokens."""
    start = max_tokens * (1.0 - buffer)
    if length <= start:
        return 0.0
    return max(-1.0, -(length - start) / (max_tokens * buffer))


def uses_try(proof: str | None) -> bool:
    """Whether the proof calls the `try` tactic outside comments (§4.1; deviation 2: the
    official code looks for the substring "try")."""
    text = proof or ""
    code, _ = strip_comments(text)
    if code is None:  # a comment left open: Lean rejects such a proof anyway
        code = text
    return re.search(r"(?<![\w.'])try(?![\w'])", code) is not None


def solver_reward(attempt: Attempt, args: Args) -> float:
    """The Solver's reward of an Attempt (§3.2, §4.1): 1 if Lean accepted its proof, 0 if not
    or if it uses_try (--penalize-try); the overlong_penalty of its tokens instead where that
    is below 0. Every objective's weights come from it; a reward term reads the Attempt (its
    Sample's tokens, its proof, Lean's seconds)."""
    n_tokens = len(attempt.sample.token_ids)
    penalty = overlong_penalty(n_tokens, args.max_new_tokens, args.overlong_buffer)
    if penalty < 0:
        return penalty
    if attempt.correct and not (args.penalize_try and uses_try(attempt.proof)):
        return 1.0
    return 0.0


def cispo_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """CISPO's group-normalised advantage (App. G.3) of each of a problem's k attempts:
    (r - mean) / (population std + eps). Rewards all equal (one attempt among them): every
    advantage 0; no rewards: []. cispo_examples weights its attempts with them."""
    if not rewards:
        return []
    r = np.asarray(rewards, dtype=np.float64)
    if r.max() == r.min():  # exactly 0: equal floats can have a std of 1e-17
        return [0.0] * len(rewards)
    return ((r - r.mean()) / (r.std() + eps)).tolist()


# ---- losses ----
def weighted_nll_loss(logp, mask, weights, denominator, sequence_mean=False):
    """-(1/denominator) sum_i w_i sum_t log pi(y_it): the negative log-likelihood of each sequence,
    weighted; with sequence_mean, each sequence's mean over its tokens instead of its sum.
    logp, mask: [B, T]; weights: [B]; denominator: a number the caller chooses."""
    per_sequence = (logp * mask).sum(1)  # [B]
    if sequence_mean:
        per_sequence = per_sequence / mask.sum(1).clamp(min=1)
    return -(weights * per_sequence).sum() / denominator


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    group_tokens: torch.Tensor,
    n_groups: int,
    clip_low: float = 0.0,
    clip_high: float = 4.0,
) -> torch.Tensor:
    """Eq. 5: -(1/G) sum_groups (1/sum_j |y_j|) sum_i sum_t sg(clip(r_it)) A_i log pi(y_it),
    with r_it = pi / pi_old (pi_old: the sampler's) and sg the stop-gradient.
    logp, old_logp, mask: [B, T]; advantages A, group_tokens (sample i's group's sum_j |y_j|):
    [B]; G = n_groups = batch_size / k, also in a last, smaller batch (official)."""
    ratio = torch.exp(logp.detach() - old_logp).clamp(clip_low, clip_high)  # [B, T]
    per_sequence = (ratio * logp * mask).sum(1)  # [B]
    per_group_token = per_sequence * advantages / group_tokens  # [B]
    return -per_group_token.sum() / n_groups


def solver_batch_loss(
    policy, micro: list[Example], batch: list[Example], args: Args
) -> tuple[torch.Tensor, dict[str, float]]:
    """The Solver's loss on a micro-batch of an optimizer batch: the forward (token_logprobs,
    renormalised over the sampler's top-p nucleus where the objective's entry says
    `nucleus`), then its objective's batch_loss (--solver-objective: SOLVER_OBJECTIVES); and
    its stats (none), which update logs as losses/solver_<name> (a micro-batch's part of the
    batch's value: train_step sums them). A Solver loss term under every objective goes
    here, its coefficient read from args (token_logprobs gives the entropy with
    with_entropy=True, detached unless entropy_grad=True). update calls it for the Solver."""
    objective = solver_objective(args)
    top_p = 1.0
    if objective.nucleus:
        top_p = args.top_p
    samples = [e.sample for e in micro]
    logp, mask, _ = token_logprobs(policy, samples, temperature=args.temperature, top_p=top_p)
    loss = objective.batch_loss(logp, mask, micro, batch, args)  # logp, mask: [B, T]
    return loss, {}


def conjecturer_batch_loss(
    policy, micro: list[Example], batch: list[Example], args: Args
) -> tuple[torch.Tensor, dict[str, float]]:
    """The Conjecturer's loss on a micro-batch: the forward (token_logprobs), then REINFORCE
    (official: reinforce_batch_loss); and its stats (none), logged as
    losses/conjecturer_<name>. A Conjecturer loss term goes here. update calls it for the
    Conjecturer."""
    samples = [e.sample for e in micro]
    logp, mask, _ = token_logprobs(policy, samples, temperature=args.temperature, top_p=1.0)
    loss = reinforce_batch_loss(logp, mask, micro, batch, args)  # logp, mask: [B, T]
    return loss, {}


def groups_per_batch(args: Args) -> int:
    """G, the whole groups of k attempts in an optimizer batch: batch_size / k, at least 1
    (official: CISPO's batches hold whole groups)."""
    return max(1, args.batch_size // args.proofs_per_problem)


def reinforce_batch_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    micro: list[Example],
    batch: list[Example],
    args: Args,
) -> torch.Tensor:
    """REINFORCE (§3.2) on a micro-batch of an optimizer batch, from its forward (logp, mask:
    [B, T]): the weighted_nll_loss of its examples, weights their Example.weight, over the
    whole batch's denominator: its completion tokens (official) or, with
    --sequence-mean-loss, its sequences (Eq. 4). conjecturer_batch_loss calls it, and
    solver_batch_loss under an objective whose entry names it."""
    if args.sequence_mean_loss:  # Eq. 4: the batch's sequences
        denominator = len(batch)
    else:  # official: the batch's completion tokens
        denominator = sum(len(e.sample.token_ids) for e in batch)
    weights = logp.new_tensor([e.weight for e in micro])  # [B]
    return weighted_nll_loss(
        logp,
        mask,
        weights,
        denominator=denominator,
        sequence_mean=args.sequence_mean_loss,
    )


def cispo_batch_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    micro: list[Example],
    batch: list[Example],
    args: Args,
) -> torch.Tensor:
    """CISPO (App. G.3) on a micro-batch of an optimizer batch, from its forward (logp, mask:
    [B, T], renormalised over the sampler's top-p nucleus: the importance ratio compares with
    the sampler's log-probs; its entry's `nucleus`): the cispo_loss of its examples,
    advantages their Example.weight, pi_old the sampler's log-probs, G = groups_per_batch
    (official: also in a last, smaller batch; `batch` is not read). solver_batch_loss calls
    it under --solver-objective cispo."""
    samples = [e.sample for e in micro]
    rows = []
    for s in samples:  # pi_old, the sampler's log-probs, padded as logp
        old = logp.new_tensor(s.logprobs)
        padding = (0, logp.shape[1] - len(s.logprobs))
        rows.append(torch.nn.functional.pad(old, padding))
    old_logp = torch.stack(rows)  # [B, T]
    advantages = logp.new_tensor([e.weight for e in micro])  # [B]
    group_tokens = logp.new_tensor([e.group_tokens for e in micro])  # [B]
    return cispo_loss(
        logp,
        old_logp,
        mask,
        advantages=advantages,
        group_tokens=group_tokens,
        n_groups=groups_per_batch(args),
        clip_low=args.cispo_clip_low,
        clip_high=args.cispo_clip_high,
    )


# ---- phases ----
def is_disjunctive(conclusion: str) -> bool:
    """Whether a statement's conclusion (theorem_conclusion) holds a disjunction (Fig. 2's
    drift): an or, written either way."""
    return "∨" in conclusion or "\\/" in conclusion


def select_seeds(
    targets: list[Problem],
    proofs: dict[str, list[dict]],
    rates: dict[str, float],
    args: Args,
) -> list[Problem]:
    """Step 1's seeds (Alg. 1): the targets the Solver never solved, no stored proof
    (store_target_proofs), in the targets' order. rates: the last iteration's solve rates
    {id: s} (state's, {} before the first; unread by the official rule). A wider or narrower
    seed rule is this function."""
    seeds = []
    for t in targets:
        if not proofs[t.id]:
            seeds.append(t)
    return seeds


def conjecture(
    sampler,
    tokenizer,
    seeds: list[Problem],
    targets: list[Problem],
    iteration: int,
    args: Args,
    dist: Dist,
) -> tuple[list[Conjecture], dict[str, float]]:
    """Step 1 (only with a Conjecturer: roles_in_play): takes select_seeds' targets (the
    seeds) and all targets; samples conjectures_per_target statements for each seed with
    the Conjecturer's weights, parsed (deviation 4: no header lines, a conjecture inherits
    its target's), and kept once by statement_key, none equal to a target. Returns the
    Conjectures, each with its Sample (step 2 attempts them; step 4 selects, rewards and
    trains on them), and the conjecturer/ stats (outputs: every sample drawn, parsed or not;
    main adds it to the generations)."""
    prompts = []
    for seed in seeds:
        if args.no_problem_conditioning:
            text = CONJECTURER_PROMPT_UNCONDITIONED
        else:
            text = CONJECTURER_PROMPT.format(statement=seed.statement)
        prompts.append(chat_prompt(tokenizer, text))

    # sample
    rows = sample(
        sampler,
        prompts,
        n=args.conjectures_per_target,
        key=f"{args.seed}/{iteration}/conjecture",
        dist=dist,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.conjecturer_max_new_tokens,
        desc="conjecture",
    )
    # parse: a new statement ending in ':= by', or None
    found = []  # (the seed, the new statement, its Sample)
    outputs = 0
    for seed, row in zip(seeds, rows):
        for s in row:
            outputs += 1
            statement = extract_conjecture(s.text)
            if statement is not None:
                found.append((seed, statement, s))

    # keep the new ones
    seen = {statement_key(t.statement) for t in targets}
    conjectures = []
    for seed, statement, s in found:
        duplicate_key = statement_key(statement)
        if duplicate_key not in seen:
            seen.add(duplicate_key)
            made = Conjecture(
                id=f"it{iteration}_c{len(conjectures)}",
                header=seed.header,
                statement=statement,
                seed=seed,
                sample=compact(s),
            )
            conjectures.append(made)

    # Fig. 2's drift: conclusions grow into disjunctions
    conclusions = [theorem_conclusion(c.statement) for c in conjectures]
    if not conclusions:
        conclusions = [""]
    disjunctive = [is_disjunctive(c) for c in conclusions]
    stats = {
        "conjecturer/outputs": outputs,
        "conjecturer/extraction_rate": len(found) / max(outputs, 1),
        "conjecturer/new_conjectures": len(conjectures),
        "conjecturer/disjunctive_share": np.mean(disjunctive),
        "conjecturer/conclusion_chars": np.mean([len(c) for c in conclusions]),
    }
    return conjectures, stats


def select_problems(
    targets: list[Problem],
    conjectures: list[Conjecture],
    proofs: dict[str, list[dict]],
    rates: dict[str, float],
    args: Args,
) -> list[Problem]:
    """Step 2's problems (Alg. 1): every target, then this iteration's conjectures; under
    expert iteration (App. G.4) only the targets with fewer than max_stored_proofs stored
    proofs (store_target_proofs). rates: the last iteration's solve rates {id: s} (state's,
    {} before the first; each iteration's replace the last's; unread by the official rule). A
    wider or narrower choice of what the Solver attempts is this function."""
    problems = list(targets)
    if args.solver_objective == "expert_iteration":
        problems = []
        for t in targets:
            if len(proofs[t.id]) < args.max_stored_proofs:
                problems.append(t)
    return problems + conjectures


def attempt_proofs(
    sampler, verifier, tokenizer, problems: list[Problem], n: int, key: str, args: Args, dist: Dist
) -> dict[str, list[Attempt]]:
    """Step 2, solving, with the Solver's weights. Takes the problems (targets and conjectures)
    and n; returns {problem id: [Attempt]}, n a problem, the same on every rank:
    store_target_proofs, solve_rate (the bands of steps 3, 4), solver_examples and solve_metrics
    read it. Each proof is checked by Lean against the original statement on the rank that
    sampled it (only the verdicts cross ranks). Each distinct (problem, proof) is checked once;
    a sample without a proof is a "no_code" failure."""
    prompts = [solver_prompt(tokenizer, p, args) for p in problems]

    # sample: this rank's share, {problem index: its row of Samples}
    shard = sample_shard(
        sampler,
        prompts,
        n=n,
        key=key,
        dist=dist,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
    )
    indices = sorted(shard)
    mine = [problems[i] for i in indices]

    # verify: the proof in the sample's one ```lean4 block (a failed sample, abort or error,
    # has none), then Lean
    proofs = []  # a row per problem of mine
    for i in indices:
        row = []
        for s in shard[i]:
            proof = None
            if s.finish_reason in ("stop", "length"):
                proof = extract_proof(s.text, whole_block=True)
            row.append(proof)
        proofs.append(row)
    # a row per problem: a LeanResult (valid, status, time, ...), or None where there is no proof
    verdicts = verifier.verify_attempts(mine, proofs)

    # score: an Attempt per sample, with its Sample (compact), with its proof only when correct
    checked = {}
    for i, proof_row, verdict_row in zip(indices, proofs, verdicts):
        row = []
        for s, proof, verdict in zip(shard[i], proof_row, verdict_row):
            if verdict is None:
                row.append(Attempt(sample=compact(s), proof=None, status="no_code", correct=False))
                continue
            kept = proof if verdict.valid else None
            attempt = Attempt(
                sample=compact(s),
                proof=kept,
                status=verdict.status,
                correct=verdict.valid,
                seconds=verdict.time,
            )
            row.append(attempt)
        checked[i] = row
    rows = gather_shard(checked, dist)
    return {p.id: row for p, row in zip(problems, rows)}


def store_target_proofs(
    proofs: dict[str, list[dict]], attempts: dict[str, list[Attempt]], iteration: int, cap: int
) -> None:
    """Step 2's bookkeeping: stores in proofs {target id: [proof dict]} up to `cap` distinct
    verified proofs of each target, each dict the proof, its iteration, its tokens and
    Lean's seconds on it (official; the seconds are ours; a target with one is solved); none of
    a conjecture (it has no entry in proofs). Read by step 1 (select_seeds), EI's examples,
    solve_metrics and the checkpoint."""
    for pid, row in attempts.items():
        if pid not in proofs:
            continue
        stored = proofs[pid]
        for a in row:
            if not a.correct or len(stored) >= cap:
                continue
            if any(p["proof"] == a.proof for p in stored):
                continue
            stored.append(
                {
                    "proof": a.proof,
                    "iteration": iteration,
                    "seconds": a.seconds,
                    "prompt_ids": a.sample.prompt_ids,
                    "token_ids": a.sample.token_ids,
                    "text": a.sample.text,
                }
            )


def record_outcomes(outcomes: collections.Counter, attempts: dict[str, list[Attempt]]) -> None:
    """Counts each attempt's verdict into outcomes: Lean's status, or cut_off for a
    completion that reached --max-new-tokens before its ```lean4 block closed; the run's
    last line (nothing_learned) reads them."""
    for row in attempts.values():
        for a in row:
            verdict = a.status
            if a.status == "no_code" and a.sample.finish_reason == "length":
                verdict = "cut_off"
            outcomes[verdict] += 1


def proof_examples(
    found: list[tuple[Attempt, object]], args: Args, rng: random.Random
) -> list[Example]:
    """REINFORCE½'s and EI's examples, shuffled. Takes (attempt, source) of each correct
    proof, source the record it came from; returns an Example of each, weight its
    solver_reward, source kept. With
    --penalize-try, a proof that uses_try is dropped, overlong or not (official). update
    trains the Solver on them."""
    examples = []
    for attempt, source in found:
        if args.penalize_try and uses_try(attempt.proof):
            continue
        weight = solver_reward(attempt, args)
        examples.append(Example(sample=attempt.sample, weight=weight, source=source))
    rng.shuffle(examples)
    return examples


def reinforce_half_examples(
    problems: list[Problem],
    attempts: dict[str, list[Attempt]],
    rates: dict[str, float],
    proofs: dict[str, list[dict]],
    iteration: int,
    args: Args,
    rng: random.Random,
) -> list[Example]:
    """REINFORCE½ (§3.2): the correct attempts at the problems whose solve rate s is in
    --reinforce-half-band (default 0 < s <= 1/2: in_reinforce_half_band, high included), as
    proof_examples, each Example's source its Attempt; incorrect attempts teach nothing
    (official). No problem in the band (or none attempted): []. proofs and iteration are
    not read (every objective takes the same arguments: SOLVER_OBJECTIVES)."""
    found = []
    for p in problems:
        if not in_reinforce_half_band(rates[p.id], args):
            continue
        for a in attempts[p.id]:
            if a.correct:
                found.append((a, a))
    return proof_examples(found, args, rng)


def cispo_examples(
    problems: list[Problem],
    attempts: dict[str, list[Attempt]],
    rates: dict[str, float],
    proofs: dict[str, list[dict]],
    iteration: int,
    args: Args,
    rng: random.Random,
) -> list[Example]:
    """CISPO (App. G.3): all k attempts at the problems whose solve rate s is in
    --cispo-band (default 0 < s < 1: in_cispo_band, both ends excluded), weighted by the
    cispo_advantages of their solver_reward, in whole groups (one a problem, Example.group
    its index) in a shuffled order; each Example's source its Attempt, group_tokens its
    group's completion tokens. A group whose rewards are all 0 (no solver_reward paid) is
    skipped (official); an attempt of advantage 0
    (all of a group whose rewards are equal) is left out, its tokens still count in its
    group's (deviation 6). proofs and iteration are not read (SOLVER_OBJECTIVES)."""
    groups = []
    for p in problems:
        row = attempts[p.id]
        rewards = []
        for a in row:
            rewards.append(solver_reward(a, args))
        if not (in_cispo_band(rates[p.id], args) and any(rewards)):
            continue
        tokens = float(sum(len(a.sample.token_ids) for a in row))
        groups.append((row, cispo_advantages(rewards), tokens))
    rng.shuffle(groups)
    examples = []
    for group, (row, advantages, tokens) in enumerate(groups):
        for a, advantage in zip(row, advantages):
            if advantage == 0:
                continue
            example = Example(
                sample=a.sample,
                weight=advantage,
                source=a,
                group_tokens=tokens,
                group=group,
            )
            examples.append(example)
    return examples


def expert_iteration_examples(
    problems: list[Problem],
    attempts: dict[str, list[Attempt]],
    rates: dict[str, float],
    proofs: dict[str, list[dict]],
    iteration: int,
    args: Args,
    rng: random.Random,
) -> list[Example]:
    """Expert iteration (App. G.4): the stored target proofs (store_target_proofs) found in the
    last ei_window iterations (iteration - ei_window < found <= iteration; ei_window <= 0:
    none), as proof_examples (an Attempt rebuilt from each), each Example's source its
    stored proof's dict. problems, attempts and rates are not read (SOLVER_OBJECTIVES)."""
    found = []
    for stored in proofs.values():
        for p in stored:
            if p["iteration"] > iteration - args.ei_window:
                s = Sample(
                    text=p["text"],
                    prompt_ids=p["prompt_ids"],
                    token_ids=p["token_ids"],
                    logprobs=[],
                    finish_reason="stop",
                )
                attempt = Attempt(s, p["proof"], "valid", correct=True, seconds=p["seconds"])
                found.append((attempt, p))
    return proof_examples(found, args, rng)


class Objective(NamedTuple):
    """A --solver-objective: its training-set rule (step 3), its batch loss (step 5, update,
    through solver_batch_loss), the learning rate and batch size resolve gives it when
    --learning-rate and --batch-size are left unset (App. C's, per objective), and whether its
    forward renormalises over the sampler's top-p nucleus."""

    examples: object  # (problems, attempts, rates, proofs=, iteration=, args=, rng=) -> [Example]
    # (logp, mask, micro, batch, args) -> the micro-batch's part of the loss, from
    # solver_batch_loss's forward (logp, mask: [B, T])
    batch_loss: object
    learning_rate: float
    batch_size: int
    nucleus: bool = False  # the forward renormalises over the sampler's top-p (a ratio to it)


# --solver-objective's choices: a new one is its functions above and an entry here
SOLVER_OBJECTIVES = {
    "reinforce_half": Objective(
        reinforce_half_examples, reinforce_batch_loss, learning_rate=3e-6, batch_size=32
    ),
    "cispo": Objective(
        cispo_examples, cispo_batch_loss, learning_rate=1e-6, batch_size=64, nucleus=True
    ),
    "expert_iteration": Objective(
        expert_iteration_examples, reinforce_batch_loss, learning_rate=3e-6, batch_size=64
    ),
}


def solver_objective(args: Args) -> Objective:
    """--solver-objective's Objective, from SOLVER_OBJECTIVES: the one dispatch of the
    Solver's objective. resolve and check_choices call it at start, so an objective without
    its entry stops the run there (ValueError, naming what to add); solver_examples and main
    (the Solver's update) read it."""
    objective = args.solver_objective
    if objective not in SOLVER_OBJECTIVES:
        raise ValueError(
            f"--solver-objective {objective}: add its entry to SOLVER_OBJECTIVES (an "
            "Objective: its solver_examples rule, e.g. reinforce_half_examples, its batch "
            "loss, its learning rate and batch size)"
        )
    return SOLVER_OBJECTIVES[objective]


def solver_examples(
    problems: list[Problem],
    attempts: dict[str, list[Attempt]],
    rates: dict[str, float],
    proofs: dict[str, list[dict]],
    iteration: int,
    args: Args,
    rng: random.Random,
) -> list[Example]:
    """Step 3: the Solver's training set for --solver-objective (solver_objective's rule).
    Takes step 2's problems, their attempts and solve rates {id: s}, the stored proofs
    {target id: [proof dict]} and the iteration; returns the Examples, each with its
    weight and source, that step 5's update trains the Solver on ([]: no update)."""
    rule = solver_objective(args).examples
    return rule(
        problems,
        attempts,
        rates,
        proofs=proofs,
        iteration=iteration,
        args=args,
        rng=rng,
    )


def review(
    sampler,
    tokenizer,
    conjectures: list[Conjecture],
    iteration: int,
    args: Args,
    dist: Dist,
) -> tuple[list[float], dict[str, float]]:
    """Step 4, the Guide (only when it plays: roles_in_play): takes the selected
    conjectures; samples one review of each conjecture against its seed, the target it was
    conjectured for (§3.1), and scores it R_guide (guide_rewards). Returns R_guide in the
    conjectures' order, which conjecturer_examples reads, and the guide/ metrics; ([], {})
    for no conjecture."""
    if not conjectures:
        return [], {}
    prompts = []
    for c in conjectures:
        text = GUIDE_PROMPT.format(seed_theorem=c.seed.statement, conjecture=c.statement)
        prompts.append(chat_prompt(tokenizer, text))
    rows = sample(
        sampler,
        prompts,
        n=1,
        key=f"{args.seed}/{iteration}/guide",
        dist=dist,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.guide_max_new_tokens,
    )
    reviews = [parse_guide_scores(row[0].text) for row in rows]
    r_guide = guide_rewards(reviews)
    parsed = [r for r in reviews if r is not None]
    stats = {
        "guide/parse_failure_rate": 1 - len(parsed) / len(reviews),
        "guide/r_guide_mean": np.mean(r_guide),
        "guide/r_guide_zero_share": r_guide.count(0) / len(r_guide),
    }
    quartiles = np.percentile(r_guide, [25, 50, 75]).tolist()
    for name, value in zip(("q25", "median", "q75"), quartiles):
        stats[f"guide/r_guide_{name}"] = value
    if parsed:
        for name in GUIDE_SCORES:
            stats[f"guide/{name}_mean"] = np.mean([r[name] for r in parsed])
    return r_guide, stats


def select_conjectures(
    conjectures: list[Conjecture], rates: dict[str, float], args: Args
) -> tuple[list[Conjecture], dict[str, float]]:
    """Step 4, the selection (§3.2): takes this iteration's conjectures and their solve
    rates; keeps those in --conjecture-band (default 0 < s < 1: in_conjecture_band,
    both ends excluded) with s <= p70 (ties at p70 kept), p70 = sorted(in band)[int(q n)], n the
    rates in the band, q = --conjecture-percentile (official; q <= 0: the lowest, q >= 1:
    the highest). No rate in the band: none selected, p70 logged as the band's low end.
    Returns the selected (review and conjecturer_examples read them) and the metrics."""
    band = args.conjecture_band
    inside = []
    for c in conjectures:
        if in_conjecture_band(rates[c.id], args):
            inside.append(rates[c.id])
    inside.sort()
    p70 = band[0]
    if inside:
        index = int(args.conjecture_percentile * len(inside))
        index = min(max(index, 0), len(inside) - 1)
        p70 = inside[index]
    selected = []
    for c in conjectures:
        if in_conjecture_band(rates[c.id], args) and rates[c.id] <= p70:
            selected.append(c)
    stats = {"conjecturer/p70": p70, "conjecturer/selected": len(selected)}
    return selected, stats


def conjecturer_reward(conjecture: Conjecture, rate: float, guide: float, args: Args) -> float:
    """A selected conjecture's reward (Alg. 1, §3.2): R = R_guide (1 - s), s its solve rate,
    R_guide the Guide's score (review; 1 without the Guide). A reward term reads the
    Conjecture (its statement, its seed's statement conjecture.seed.statement, its Sample's
    tokens). conjecturer_examples then normalises the selected conjectures' R
    (--conjecturer-normalization; official min-max: a term that shifts or scales every R
    alike cancels there, and a lone selected conjecture weighs 1 whatever its R)."""
    return guide * (1.0 - rate)


def min_max_normalize(rewards: list[float]) -> list[float]:
    """The Conjecturer's weights (official): w_i = (R_i - min R) / (max R - min R) over the
    selected conjectures; 1 for all when max R = min R (one conjecture included); [] for []."""
    low = min(rewards, default=0.0)
    high = max(rewards, default=0.0)
    weights = []
    for reward in rewards:
        weight = 1.0
        if high > low:
            weight = (reward - low) / (high - low)
        weights.append(weight)
    return weights


def raw_rewards(rewards: list[float]) -> list[float]:
    """The Conjecturer's weights without a normalisation (an ablation): w_i = R_i."""
    return list(rewards)


# --conjecturer-normalization's choices: a new one is its function above and an entry here
CONJECTURER_NORMALIZATIONS = {"min_max": min_max_normalize, "none": raw_rewards}


def conjecturer_normalization(args: Args):
    """The function of --conjecturer-normalization, from CONJECTURER_NORMALIZATIONS: the
    selected conjectures' rewards [R_i] -> their weights [w_i]. check_choices calls it at
    start; conjecturer_examples reads it, then replaces an overlong conjecture's weight by
    its overlong penalty, in [-1, 0] (official: below every min-max weight, which are in
    [0, 1]; a normalisation onto another scale decides how an overlong one compares)."""
    name = args.conjecturer_normalization
    if name not in CONJECTURER_NORMALIZATIONS:
        raise ValueError(
            f"--conjecturer-normalization {name}: add its entry to CONJECTURER_NORMALIZATIONS "
            "(a function of the rewards [R_i] returning the weights [w_i], as min_max_normalize)"
        )
    return CONJECTURER_NORMALIZATIONS[name]


def conjecturer_examples(
    selected: list[Conjecture],
    rates: dict[str, float],
    r_guide: list[float],
    args: Args,
    rng: random.Random,
) -> list[Example]:
    """Step 4, the reward (Alg. 1, §3.2), shuffled: takes the selected conjectures, their
    solve rates and R_guide (review's, or 1 each without the Guide); conjecture i gets its
    conjecturer_reward R_i, normalised over them by --conjecturer-normalization
    (conjecturer_normalization; official: min_max_normalize); an overlong one gets the
    overlong_penalty (M = --conjecturer-max-new-tokens) instead (§4.1; official: DAPO's
    length penalty, after the normalisation). As official, the whole generation is the
    target and weight 0 stays in (its tokens count). Returns an Example of each (source its
    Conjecture; [] for none), which update trains the Conjecturer on."""
    rewards = []
    for c, guide in zip(selected, r_guide):
        rewards.append(conjecturer_reward(c, rates[c.id], guide, args))
    normalize = conjecturer_normalization(args)
    weights = normalize(rewards)
    examples = []
    for c, weight in zip(selected, weights):
        n_tokens = len(c.sample.token_ids)
        max_tokens = args.conjecturer_max_new_tokens
        penalty = overlong_penalty(n_tokens, max_tokens, args.overlong_buffer)
        if penalty < 0:
            weight = penalty
        examples.append(Example(sample=c.sample, weight=weight, source=c))
    rng.shuffle(examples)
    return examples


def optimizer_batches(examples: list[Example], args: Args) -> list[list[Example]]:
    """update's optimizer batches, in order: batch_size examples each; examples that carry
    a group (group >= 0, CISPO's) go in whole groups instead, groups_per_batch groups a
    batch (official). A batch left empty (its groups' attempts all of advantage 0) is
    dropped; no examples: []."""
    if not examples:
        return []
    batches = []
    if examples[0].group >= 0:
        per_batch = groups_per_batch(args)
        last_group = max(e.group for e in examples)
        for first in range(0, last_group + 1, per_batch):
            end = first + per_batch
            batch = [e for e in examples if first <= e.group < end]
            if batch:
                batches.append(batch)
        return batches
    for first in range(0, len(examples), args.batch_size):
        batches.append(examples[first : first + args.batch_size])
    return batches


def update(
    policy,
    optimizer,
    examples: list[Example],
    lr: float,
    batch_loss,
    args: Args,
    dist: Dist,
) -> dict[str, float]:
    """Step 5: one epoch of a role's policy over its examples (solver_examples' or
    conjecturer_examples'), from a fresh Adam state and a fresh learning-rate schedule
    (official: a new trainer each iteration), in optimizer_batches; batch_loss(policy, micro,
    batch, args) -> (loss, stats) is the role's loss of a micro-batch over its whole batch
    (solver_batch_loss, conjecturer_batch_loss). Returns the losses/ metrics: steps, and the
    mean over the steps of loss, grad_norm and every stat batch_loss returns (the caller
    skips a role with no examples)."""
    optimizer.state.clear()
    stats = []
    batches = optimizer_batches(examples, args)
    for optimizer_step, batch in enumerate(batches):

        def loss_fn(micro: list[Example]) -> tuple[torch.Tensor, dict]:
            return batch_loss(policy, micro, batch, args)

        lr_now = lr_at(
            step=optimizer_step,
            total=len(batches),
            peak=lr,
            warmup=args.warmup_steps,
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
    metrics = {"steps": len(stats)}
    for name in stats[0]:  # loss, grad_norm and every stat batch_loss returns
        metrics[name] = float(np.mean([s[name] for s in stats]))
    return metrics


# ---- evaluation ----
def solve_metrics(
    targets: list[Problem],
    proofs: dict[str, list[dict]],
    attempts: dict[str, list[Attempt]],
    generations: int,
    k: int,
    conjectures: list[Conjecture],
) -> dict[str, float]:
    """The metrics main logs each iteration, from the stored proofs and step 2's attempts:
    the paper's metric, the cumulative solve rate (Fig. 1: the share of targets ever
    proved) against generations; this iteration's pass@k over the targets attempted
    (Fig. 3; absent when none was, as EI may leave), the Solver's entropy (Fig. 7,
    deviation 5; absent without a sampled token), Lean's verdicts as shares, the mean solve
    rate of this iteration's conjectures (those attempted; absent with none)."""
    tried = [attempts[t.id] for t in targets if t.id in attempts]
    every = []
    for row in attempts.values():
        every.extend(row)
    logprobs = [a.sample.logprobs for a in every]
    if not logprobs:
        logprobs = [np.zeros(0)]
    logps = np.concatenate(logprobs)
    statuses = [a.status for a in every]
    conjecture_rates = [solve_rate(attempts[c.id]) for c in conjectures if c.id in attempts]
    proved = sum(bool(proofs[t.id]) for t in targets)
    metrics = {
        "charts/cumulative_solve_rate": proved / len(targets),
        "charts/generations": generations,
        "charts/targets_attempted": len(tried),
    }
    if tried:
        pass_rates = [pass_at_k(k, sum(a.correct for a in row), k) for row in tried]
        metrics[f"charts/pass@{k}"] = float(np.mean(pass_rates))
    if logps.size:
        metrics["solver/entropy"] = -float(logps.mean())
    for status in sorted(set(statuses)):
        metrics[f"lean/{status}_share"] = statuses.count(status) / len(statuses)
    if conjecture_rates:
        metrics["conjecturer/solve_rate_mean"] = float(np.mean(conjecture_rates))
    return metrics


def nothing_learned(outcomes: collections.Counter, trained: int, args: Args) -> str | None:
    """The run's last line, printed after the loop, when the Solver had no training example
    (the CPU default on the embedded model): why, from the verdicts in outcomes; None when
    it trained (or attempted nothing)."""
    if trained or not outcomes:
        return None
    n = sum(outcomes.values())
    accepted = outcomes["valid"]
    why = f"no proof accepted in {n} attempts"
    if accepted:
        why = (
            f"{accepted} of {n} attempts accepted, none a {args.solver_objective} example "
            "(its rule, solver_objective's, kept none: e.g. solve rates out of its band, or `try`)"
        )
    shares = ", ".join(f"{k} {v / n:.0%}" for k, v in outcomes.most_common())
    return (
        f"{os.path.basename(__file__)}: no Solver update in this run: {why}: {shares}"
        " (no_code: not one closed ```lean4 block with the theorem; cut_off: at"
        f" --max-new-tokens {args.max_new_tokens}). tests/test_sgs.py's loop learning test"
        " shows the loop learning where proofs are accepted."
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


def check_choices(args: Args) -> None:
    """Stop the run at start, not deep in the loop, on flag values that cannot run: a value (a
    Literal a fork extended) without its table entry (each lookup runs once and raises a
    ValueError naming what to add), a value outside its range, flags that cannot run together.
    A new flag's range check goes here. main calls it before start_run.
    Its tables: SOLVER_OBJECTIVES, CONJECTURER_NORMALIZATIONS. (--lr-schedule stops in
    start_run.)"""
    solver_objective(args)
    conjecturer_normalization(args)


def load_models(args: Args, dist: Dist) -> tuple[dict, object, tuple]:
    """The roles' models (deviation 8), loaded only for the roles in play (roles_in_play):
    returns `models`, {role: (model, optimizer)} of the roles that train (the Solver, and
    the Conjecturer unless frozen: update and the checkpoints read it), the tokenizer
    (--model's, every role's), and (Solver, Conjecturer, Guide), None for a role not in
    play (the Guide is frozen); main syncs the sampler to each in its step."""
    tokenizer = load_tokenizer(args.model)
    roles = roles_in_play(args)
    checkpointing = args.gradient_checkpointing
    solver = load_model(args.model, dist, gradient_checkpointing=checkpointing)
    conjecturer = None
    if roles.use_conjecturer:
        conjecturer = load_model(
            args.conjecturer_model or args.model,
            dist,
            train=roles.train_conjecturer,
            gradient_checkpointing=checkpointing,
        )
    guide = None
    if roles.use_guide:
        guide = load_model(args.guide_model, dist, train=False)
    adamw = functools.partial(torch.optim.AdamW, betas=args.adam_betas, weight_decay=0.0)
    models = {"solver": (solver, adamw(solver.parameters(), args.learning_rate))}
    if roles.train_conjecturer:
        optimizer = adamw(conjecturer.parameters(), args.conjecturer_learning_rate)
        models["conjecturer"] = (conjecturer, optimizer)
    return models, tokenizer, (solver, conjecturer, guide)


def start_sampler(solver, tokenizer, args: Args, dist: Dist) -> Sampler:
    """The sampler of every role (deviation 8), with the Solver's weights for now; main
    syncs it to a role's weights before the role samples (steps 1, 2, 4)."""
    return Sampler(
        args.model,
        solver,
        tokenizer,
        dist=dist,
        backend=args.backend,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        sleep=args.vllm_sleep,
        seed=args.seed,
    )


def main(args: Args) -> None:
    args = resolve(args)  # stops on flags that cannot run; fills the official defaults
    check_choices(args)  # flag values that cannot run stop here, at start
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS)
    roles = roles_in_play(args)  # a role not in play is not loaded, run or logged
    verifier = start_lean(args, dist)
    targets = load_problems(args.dataset, args.num_problems)  # D
    models, tokenizer, (solver, conjecturer, guide) = load_models(args, dist)
    # the run's state: the proofs stored for each target (solved: at least one), the
    # generations so far, the last iteration's solve rates
    start = 0
    state = {"proofs": {t.id: [] for t in targets}, "generations": 0, "rates": {}}
    if args.resume:
        found = load_checkpoint(run_dir, weights_only(models), dist)
        if found is not None:
            start, state = found
    sampler = start_sampler(solver, tokenizer, args=args, dist=dist)
    proofs = state["proofs"]
    k = args.proofs_per_problem
    outcomes = collections.Counter()  # this run's verdicts
    trained = 0  # this run's Solver examples

    for iteration in range(start, args.iterations):
        step = iteration + 1  # iterations done: the metrics' step, the checkpoint's number
        metrics = {}
        rng = random.Random(f"{args.seed}/{iteration}")  # the same on every rank: the same batches

        # 1. Conjecture: statements for each seed (select_seeds)
        conjectures = []
        if roles.use_conjecturer:
            with logger.timer("conjecture"):
                seeds = select_seeds(targets, proofs, state["rates"], args)
                sampler.sync_weights(conjecturer)
                conjectures, stats = conjecture(
                    sampler,
                    tokenizer,
                    seeds,
                    targets=targets,
                    iteration=iteration,
                    args=args,
                    dist=dist,
                )
                state["generations"] += stats["conjecturer/outputs"]
                metrics.update(stats)

        # 2. Solve: k attempts at each problem (select_problems)
        with logger.timer("solve"):
            problems = select_problems(targets, conjectures, proofs, state["rates"], args)
            sampler.sync_weights(solver)
            key = f"{args.seed}/{iteration}/solve"
            attempts = attempt_proofs(
                sampler, verifier, tokenizer, problems=problems, n=k, key=key, args=args, dist=dist
            )
            state["generations"] += len(problems) * k
            store_target_proofs(proofs, attempts, iteration, cap=args.max_stored_proofs)
            rates = {pid: solve_rate(row) for pid, row in attempts.items()}  # s
            state["rates"] = rates
        record_outcomes(outcomes, attempts)

        # 3. The Solver's training set: --solver-objective's rule (SOLVER_OBJECTIVES)
        solver_set = solver_examples(
            problems, attempts, rates, proofs=proofs, iteration=iteration, args=args, rng=rng
        )
        trained += len(solver_set)

        # 4. The Conjecturer's training set: selection, the Guide's review, the reward
        conjecturer_set = []
        if roles.train_conjecturer and conjectures:
            with logger.timer("guide"):
                selected, selection_stats = select_conjectures(conjectures, rates, args)
                r_guide = [1.0] * len(selected)  # --no-guide
                if roles.use_guide and selected:
                    sampler.sync_weights(guide)
                    r_guide, stats = review(
                        sampler,
                        tokenizer,
                        selected,
                        iteration=iteration,
                        args=args,
                        dist=dist,
                    )
                    metrics.update(stats)
                conjecturer_set = conjecturer_examples(selected, rates, r_guide, args=args, rng=rng)
                metrics.update(selection_stats)

        # 5. Update the Solver and the Conjecturer
        with logger.timer("update"):
            sampler.sleep()
            # (role, its examples, its lr, its batch loss)
            training_sets = [
                ("solver", solver_set, args.learning_rate, solver_batch_loss),
                (
                    "conjecturer",
                    conjecturer_set,
                    args.conjecturer_learning_rate,
                    conjecturer_batch_loss,
                ),
            ]
            for role, examples, lr, batch_loss in training_sets:
                if not examples:
                    continue
                policy, optimizer = models[role]
                stats = update(
                    policy,
                    optimizer,
                    examples,
                    lr=lr,
                    batch_loss=batch_loss,
                    args=args,
                    dist=dist,
                )
                for name, value in stats.items():
                    metrics[f"losses/{role}_{name}"] = value

        # Log the metric (solve_metrics) and save a checkpoint
        metrics["data/solver_examples"] = len(solver_set)
        if roles.train_conjecturer:  # absent, not 0, for a Conjecturer that does not train
            metrics["data/conjecturer_examples"] = len(conjecturer_set)
        generations = state["generations"]
        stats = solve_metrics(
            targets,
            proofs,
            attempts,
            generations=generations,
            k=k,
            conjectures=conjectures,
        )
        metrics.update(stats)
        logger.log(metrics, step=step)
        done = args.max_generations is not None and generations >= args.max_generations
        if step % args.save_every == 0 or step == args.iterations or done:
            to_save = weights_only(models)
            save_checkpoint(
                run_dir, iteration=step, models=to_save, tokenizer=tokenizer, state=state, dist=dist
            )
        if done:
            break
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
