"""eva: Evolving Alignment via Asymmetric Self-Play (a creator evolves prompts, a solver learns).

Paper: Ye, Agarwal, Liu, Joshi, Velury, Le, Tan, Liu, "Evolving Alignment via Asymmetric
Self-Play: Scalable Preference Fine-Tuning Beyond Static Human Prompts", arXiv 2411.00062 (v3:
"Scalable Reinforcement Post-Training Beyond Static Human Prompts"; ICML 2025: "Reward-Guided
Prompt Evolving in Reinforcement Learning for LLMs"). Official code: github.com/ZIYU-DEEP/eva
(read at d605e6f; this file copies none of it), built on TRL (Hugging Face's trainers) and
distilabel's EvolInstruct (WizardLM's recipe: an LLM rewrites a prompt by one of a few fixed
instructions, a "mutation").

Method. RLHF (training a policy on a reward model's scores of its responses) on a fixed prompt
set stops where the prompts stop being informative. eva makes it an asymmetric game played by
ONE policy pi_theta (theta_t: its weights after round t): the CREATOR finds the prompts the
SOLVER can still learn from and evolves new ones like them; the SOLVER learns from its own best
and worst responses to them, scored by a frozen reward model r(x, y) (x a prompt, y a response).
X_t is the prompt set of round t (X_0: human prompts). A prompt's informativeness info(x) comes
from the rewards of the solver's N responses to it: eva's default, A*_min, is a proxy of the
solver's regret on x (how far its responses fall short of the best one it can give); A*_avg,
A*_dts and the ablations of Table 2 are the other rows of `informativeness`. Each round t
(Algorithm 1; a plain round, the baseline round or --new-human-prompts, trains on a human split
and runs steps 1, 6 and 7 only):
  1. solve:     N = 6 responses by theta_{t-1} to each prompt of X_{t-1} (temperature 0.7,
                top-p 0.9), each scored by r (`solve`);
  2. estimate:  info(x) of each prompt from its N rewards (`informativeness`);
  3. sample:    the informative subset, 25% of the prompts, drawn by info (`sample_subset`);
  4. evolve:    each sampled prompt grows a chain of 4 mutations, each of the last kept prompt,
                written by the policy itself (`evolve`, MUTATIONS): X_t is every kept prompt of
                the chains, 25% x 4 = |X_{t-1}| when none is dropped;
  5. solve X_t: N responses to each evolved prompt, scored; 20% of X_{t-1}'s groups mixed with
                80% of X_t's (`mix`);
  6. optimise:  a preference pair of each group, its best and worst responses
                (`training_items`), and one preference-optimisation run from theta_{t-1}, with
                theta_{t-1} as the reference (`update`; the loss: `item_losses`);
  7. evaluate:  the reward model's win rate of theta_t over theta_{t-1} on held-out prompts
                (`evaluate`; step 0 logs theta_0's held-out reward).
The losses (--loss; Table 1), on a pair's chosen response y_w and rejected y_l: DPO (direct
preference optimisation), IPO (identity preference optimisation), RPO (DPO plus the chosen
response's negative log-likelihood, NLL), SPPO (self-play preference optimisation, on win
probabilities), SimPO (simple preference optimisation, no reference), ORPO (odds-ratio
preference optimisation, no reference); v3's online RLOO (REINFORCE with a leave-one-out
baseline) trains on every response instead of pairs. Each is one function of the losses
section, picked by `item_losses`. The reference log-probs come from the policy before its
update (no second copy is held). Metrics: creator/*, charts/*, losses/*
(first and last step), eval/*; every evolution, kept or dropped, in <run>/evolutions.jsonl.
Records: the block's Sample(text, prompt_ids, token_ids, logprobs, finish_reason), one sampled
response, and Dist(rank, world_size, local_world_size, device, is_main, objects), this process
among torchrun's; this file's Group, Pair and Example (defined before the phases).

Run. Without CUDA, Args' defaults are CPU_DEFAULTS (a loop sized for a laptop; the run prints
them), so `python <this file>` and `main(Args())` run it alike and a value given keeps it; there
the embedded SmolLM2-135M is policy, creator and judge on data/chat_prompts.jsonl, a round in
minutes. `torchrun --nproc_per_node 8 eva.py` runs the paper's sizes on 8xH200 (gemma-2-9b-it,
ArmoRM-8B, UltraFeedback's prompts as Snorkel's split of them; `--evolver-url
https://api.openai.com/v1` for the paper's GPT-4 creator, its key in $OPENAI_API_KEY).
Experiment map and the paper's benchmarks (on <run>/checkpoints/iter_XXXXXX/policy): README.md.

Each loss's flags left unset take its official run's values (`resolve`; eva released no SimPO,
ORPO or RLOO run; [RECON]: reconstructed, not in the official code); a loss without a row takes
DPO's, and the run prints which:
  loss   beta   lr    epochs optim   schedule max_length prompt source
  dpo    0.05   5e-7  2      adamw   cosine   2048       1024   scripts/gemma-2-9b-it-dpo,
                                                                recipes/iterative-dpo
  ipo    0.6    5e-7  1      adamw   cosine   2048       1024   scripts/gemma-2-9b-it-ipo
  rpo    0.1    5e-7  2      adamw   cosine   2048       1024   scripts/gemma-2-9b-it-rpo-split-by-6
  sppo   0.001  5e-7  9      rmsprop linear   1024       512    scripts/gemma-9b, recipes/default
  simpo  10     8e-7  1      adamw   cosine   2048       1800   SimPO's gemma-2-9b-it recipe
                                                                (princeton-nlp/SimPO)
  orpo   0.1    5e-7  2      adamw   cosine   2048       1024   ORPO's lambda (ORPO paper, TRL);
                                                                the rest as dpo
  rloo   -      1e-6  1      adamw   cosine   2048       1024   [RECON] TRL RLOOConfig's lr, one
                                                                on-policy pass

Sources (the official files each part follows): load_prompts: src/snippets/shuffle_ds.py; solve:
src/generate.py (sampling) and src/reward_hf.py (scoring; its columns reward_gap, reward_maxmean,
reward_dts, reward_var, reward_mean are informativeness's a_min, a_avg, a_dts, var, avg;
preference_pair); sampling_weights and sample_informative: src/evolve_prompt.py's
adaptive_sample; evolve: src/evolve_prompt.py over distilabel's EvolInstruct; mix:
src/snippets/combine_ds.py; cut_to_length: eva/trainer.py's tokenize_row; the losses:
eva/trainer.py (IPO's "FIX for IPO", RPO's NLL divided by length); win_probability: SPPO's
compute_prob.py; the baseline round: scripts/gemma-2-9b-it-dpo/iterate.sh (ITER=0); the eva
round: its evolve-1.sh.

Deviations (where the paper is silent this file follows the official code):
  1. Empty, failed, marker-leaking, unchanged or duplicate evolutions are dropped (the official
     code keeps them all).
  2. The creator is the policy unless --evolver-url (official: gpt-4-0125-preview); EvolInstruct's
     templates reworded.
  3. A prompt whose N rewards all agree gives no pair (official: chosen = rejected); the 20/80 mix
     counts it still.
  4. The reward model scores one conversation per forward (official: six padded ones, no
     attention mask).
  5. No reward_loo metric (always 0 officially); inv_* metrics are the negated value, whose
     min-max weights are the official 1 - normalised (stratified: a value on a bin's edge falls
     in the bin above); equal values weigh uniformly.
  6. Continual rounds evolve the last evolved set (Algorithm 1); the official scripts ran one eva
     round per split.
  7. SPPO's win probabilities come from the reward model's scores (Bradley-Terry:
     sigmoid(r_i - r_j)), not from PairRM, a pairwise ranking model (official SPPO).
  8. RLOO (v3 only, not in the official code) [RECON]: leave-one-out baselines, a clipped
     sequence ratio, no KL.
  9. Sampling is seeded per chunk of prompts, so runs agree on any number of ranks and after a
     resume.
 10. The held-out reward-model win rate is this file's addition; the paper's benchmarks are in
     README.md.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import pathlib
import random
import shutil
import time
import urllib.request
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
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
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)


@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed> unless
    --run-name)"""
    seed: int = 42
    """seed of the run (each rank adds its rank) (official)"""
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
    model: str = "google/gemma-2-9b-it"
    """policy (solver and creator): a Hugging Face id, a local path, or embedded:smollm2 (the CPU
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
    reward_model: str = "RLHFlow/ArmoRM-Llama3-8B-v0.1"
    """r(x, y): a HF classifier, or (--reward-kind judge) an LM"""
    reward_kind: Literal["classifier", "judge"] = "classifier"
    """classifier: the model's scalar score (classifier_scores); judge: its expected 1-9 rating
    (judge_scores); reward_rule picks them"""
    trust_remote_code: bool = True
    """let the reward model run its own modelling code (ArmoRM needs it)"""

    # data
    dataset: str = "snorkelai/Snorkel-Mistral-PairRM-DPO-Dataset"
    """UltraFeedback prompts (the official split: its 3 train iterations, shuffled with seed
    8964), or a .jsonl"""
    num_splits: int = 6
    """the prompts are cut into this many parts, one per plain-DPO round (official: 6, ~10k each)"""
    num_prompts: int | None = None
    """use only the first N prompts of each part"""
    heldout_size: int = 500
    """held-out prompts for the win-rate evaluation (the test iterations, split the same way)"""

    # creator
    evolve: bool = True
    """evolve the informative subset (--no-evolve: train on the subset itself, Table 4's blue
    rows)"""
    info_metric: Literal[
        "a_min", "a_avg", "a_dts", "var", "avg", "inv_avg", "inv_a_min", "uniform"
    ] = "a_min"
    """informativeness of a prompt from its rewards (informativeness, INFO_METRICS; Tables 2-3):
    a_min is eva's default"""
    sampling: Literal["weighted", "greedy", "stratified"] = "weighted"
    """subset: weighted without replacement (eva-sample), the top ones (eva-greedy), or weighted
    within quantile bins (sample_informative, SAMPLINGS)"""
    evolve_fraction: float = 0.25
    """share of the prompts sampled into the informative subset, in [0, 1] (official SAMPLE_FRAC);
    how a --sampling draw counts it: its function's docstring (SAMPLINGS); a draw of none
    prints a line (sample_subset)"""
    stratified_bins: int = 10
    """quantile bins of --sampling stratified (stratified_draw)"""
    num_evolutions: int = 4
    """length of each seed's mutation chain (official NUM_EVOLUTIONS)"""
    evolve_temperature: float = 0.88
    """creator sampling temperature (official EVOLVE_TEMPERATURE)"""
    evolve_max_new_tokens: int = 666
    """longest evolved prompt, in tokens (official MAX_PROMPT_LENGTH)"""
    evolver_url: str | None = None
    """evolve with an OpenAI-compatible endpoint (e.g. https://api.openai.com/v1)"""
    evolver_model: str = "gpt-4-0125-preview"
    """the endpoint's model (official GEN_MODEL_NAME)"""
    evolver_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the endpoint's key"""
    evolver_workers: int = 5
    """concurrent endpoint requests per rank (official: 5 processes)"""
    evolver_timeout: float = 120.0
    """seconds per endpoint request (3 tries)"""

    # solver
    iterations: int = 2
    """rounds to run: a plain-DPO round first (unless --no-baseline-round), then eva's; 0:
    evaluate the given model"""
    batch_size: int = 64
    """pairs per optimizer step (official: 1 per device x 8 accumulation x 8 GPUs)"""
    learning_rate: float | None = None
    """peak learning rate; default the loss's official value"""
    lr_schedule: Literal["constant", "linear", "cosine"] | None = None
    """learning-rate schedule after the warm-up (lr_at); default the loss's official one"""
    warmup_steps: int | None = None
    """linear warm-up steps from 0 (default: --warmup-ratio's share of the steps)"""
    warmup_ratio: float = 0.1
    """share of the steps of linear warm-up"""
    baseline_round: bool = True
    """round 1: the official plain iterative-DPO round on the first human split (splits[0]; the
    official ITER=0); the first eva round then evolves that split's prompts"""
    new_human_prompts: bool = False
    """baseline: plain rounds on new human splits (Table 1, '+ new human prompts')"""
    n_samples: int = 6
    """responses per prompt (official N_PAIRS)"""
    temperature: float = 0.7
    """solver sampling temperature"""
    top_p: float = 0.9
    """solver nucleus sampling"""
    max_new_tokens: int = 2048
    """longest response, in tokens"""
    old_pair_ratio: float = 0.2
    """share of the old prompts' groups in the training mix, in [0, 1] (mix; official
    RATIO_BASE)"""
    new_pair_ratio: float = 0.8
    """share of the evolved prompts' groups, in [0, 1] (mix; official RATIO_EVOL)"""
    loss: Literal["dpo", "ipo", "rpo", "sppo", "simpo", "orpo", "rloo"] = "dpo"
    """preference loss (Table 1 and the official scripts; item_losses), or the v3 online RLOO; a
    loss without a row in OFFICIAL takes DPO's official values, and the run prints which
    (resolve)"""
    beta: float | None = None
    """beta of the loss (SPPO: 1/eta; ORPO: lambda); default the loss's official value (eva.py's
    docstring table)"""
    rpo_alpha: float = 1.0
    """RPO: weight of the chosen response's NLL"""
    rpo_penalize_length_nll: bool = True
    """RPO: the chosen mean token NLL divided again by its token count (official); --no-...: the
    RPO paper's"""
    simpo_gamma_beta_ratio: float = 0.5
    """SimPO: target margin gamma / beta"""
    rloo_clip: float = 0.2
    """RLOO: clip of the sequence-level probability ratio"""
    epochs: int | None = None
    """epochs over the round's pairs; default the loss's official number"""
    optim: Literal["adamw", "rmsprop"] | None = None
    """optimizer, fresh every round; default the loss's official one (adamw_torch; SPPO:
    rmsprop)"""
    micro_batch_size: int = 1
    """pairs per forward/backward pass on each rank"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    max_length: int | None = None
    """training: longest prompt + response, in tokens; default the loss's official value"""
    max_prompt_length: int | None = None
    """training: an over-long pair's prompt is cut to its last this many tokens; default the
    loss's official value"""


# Without CUDA the paper's sizes would take weeks. One eva round (8 prompts x 6 responses, 2 seeds
# x 4 evolutions, 6 more responses each, 4 DPO steps, 6 held-out prompts): ~4 min of CPU time
# (21 min wall at a load of 10 on 2 cores).
CPU_DEFAULTS = dict(
    model="embedded:smollm2",
    reward_model="embedded:smollm2",
    reward_kind="judge",
    dataset="data/chat_prompts.jsonl",
    num_prompts=8,
    heldout_size=6,
    iterations=1,
    baseline_round=False,
    max_new_tokens=40,
    evolve_max_new_tokens=64,
    max_model_len=1024,
    learning_rate=1e-5,
    batch_size=4,
    micro_batch_size=2,
    max_length=384,
    max_prompt_length=256,
)

# The official runs' values (the docstring's table) for the flags a loss leaves unset (None):
# DPO's row, then each loss's own entries. A loss without a row takes DPO's, and resolve says so.
OFFICIAL = {
    "dpo": dict(
        beta=0.05,
        learning_rate=5e-7,
        epochs=2,
        optim="adamw",
        lr_schedule="cosine",
        max_length=2048,
        max_prompt_length=1024,
    ),
    "ipo": dict(beta=0.6, epochs=1),
    "rpo": dict(beta=0.1),
    "orpo": dict(beta=0.1),
    "sppo": dict(
        beta=1e-3,
        epochs=9,
        optim="rmsprop",
        lr_schedule="linear",
        max_length=1024,
        max_prompt_length=512,
    ),
    "simpo": dict(beta=10.0, learning_rate=8e-7, epochs=1, max_prompt_length=1800),
    "rloo": dict(beta=None, learning_rate=1e-6, epochs=1),
}


def borrowed_from_dpo(args: Args) -> dict:
    """The values resolve gives --loss from DPO's row of OFFICIAL because OFFICIAL has no row
    for the loss (a fork's new loss): each flag of DPO's row left unset (None), with DPO's
    value; {} for a loss with its own row, or with every such flag given."""
    if args.loss in OFFICIAL:
        return {}
    borrowed = {}
    for name, value in OFFICIAL["dpo"].items():
        if getattr(args, name) is None:
            borrowed[name] = value
    return borrowed


def resolve(args: Args) -> Args:
    """Each flag of OFFICIAL left unset (None) takes its official value for --loss: DPO's row,
    then the loss's own. A loss that OFFICIAL has no row for takes DPO's values, and resolve
    prints which (borrowed_from_dpo), once, on torchrun's rank 0 (it runs before start_run).
    Returns args."""
    borrowed = borrowed_from_dpo(args)
    if borrowed and os.environ.get("RANK", "0") == "0":
        values = ", ".join(f"--{name.replace('_', '-')} {v}" for name, v in borrowed.items())
        print(
            f"eva.py: --loss {args.loss} has no row in OFFICIAL, so it takes DPO's official "
            f"{values} (pass these flags, or add its row to OFFICIAL)"
        )
    official = dict(OFFICIAL["dpo"])
    official.update(OFFICIAL.get(args.loss, {}))
    for name, value in official.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def check_choices(args: Args) -> None:
    """Stop the run at start, not deep in the loop, on flag values that cannot run: a value (a
    Literal a fork extended) without its table entry (each lookup runs once and raises a
    ValueError naming what to add), a value outside its range, flags that cannot run together.
    A new flag's range check goes here. main calls it before start_run.
    Its dispatches: each function that dispatches on a flag (informativeness,
    sample_informative, reward_rule, item_losses, new_optimizer) runs once on a made-up
    example. (--lr-schedule stops in start_run.)"""
    shares = {
        "evolve-fraction": args.evolve_fraction,
        "old-pair-ratio": args.old_pair_ratio,
        "new-pair-ratio": args.new_pair_ratio,
    }
    for flag, share in shares.items():
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"--{flag} {share}: a share of a set, in [0, 1]")
    informativeness([0.0, 1.0], args)
    sample_informative(
        values=[0.0, 1.0],
        weights=np.array([0.5, 0.5]),
        rng=np.random.default_rng(0),
        args=args,
    )
    reward_rule(args.reward_kind)
    k = 1 if args.loss in ROLLOUT_LOSSES else 2  # sequences an item: a rollout's 1, a pair's 2
    logp = torch.zeros(k, 1)  # [k, B], B = 1
    tokens = torch.ones(k, 1)
    numbers = torch.full((k, 1), 0.5)
    item_losses(args.loss, logp, logp, tokens, numbers, args)
    new_optimizer(torch.nn.Linear(1, 1), args)


# ---- prompts ----
# The creator's mutations, our words after distilabel's EvolInstruct templates (WizardLM;
# deviation 2): an in-depth REWRITE wrapper (a harder version of the prompt) with one method
# clause, and an in-breadth CREATE one (a new prompt on a rarer topic of the same domain); one
# user turn each; the reply follows "Prompt#:".
REWRITE_PROMPT = """You are rewriting a prompt for a chat assistant. Make the #Given Prompt# \
somewhat harder, so that even strong AI assistants have to work for a good answer, while a \
person can still read it and reply sensibly.
How to make it harder: <METHOD>
Keep every non-text part of the #Given Prompt# (tables, code, quoted input) and keep its input. \
Stay brief: add no more than 10 to 20 words.
Do not write '#Given Prompt#', '#Rewritten Prompt#', 'given prompt' or 'rewritten prompt' in \
your answer.
#Given Prompt#:
<PROMPT>
#Rewritten Prompt#:
"""
CREATE_PROMPT = """You are writing a new prompt for a chat assistant. Take inspiration from the \
#Given Prompt# and write a brand-new prompt in the same domain but on a rarer topic, about as \
long and as hard. A person must be able to read it and reply sensibly.
Do not write '#Given Prompt#', '#New Prompt#', 'given prompt' or 'new prompt' in your answer.
#Given Prompt#:
<PROMPT>
#New Prompt#:
"""
# four in-depth rewrites and one in-breadth creation (draw_mutations)
MUTATIONS = {
    "constraints": REWRITE_PROMPT.replace(
        "<METHOD>", "add one more constraint or requirement to it."
    ),
    "deepening": REWRITE_PROMPT.replace(
        "<METHOD>", "if it asks about some issue, widen and deepen that inquiry."
    ),
    "concretizing": REWRITE_PROMPT.replace(
        "<METHOD>", "replace general concepts with more specific ones."
    ),
    "reasoning": REWRITE_PROMPT.replace(
        "<METHOD>",
        "if a few simple thoughts would answer it, make it ask explicitly for reasoning in "
        "several steps.",
    ),
    "breadth": CREATE_PROMPT,
}
# the templates' own markers: a reply that holds one failed
MARKERS = ("#given prompt#", "#rewritten prompt#", "#new prompt#")

# The LLM judge (--reward-kind judge, the CPU default): the reward is the expected digit under
# its next-token probabilities of "1".."9", not a parsed reply (score_responses).
JUDGE_PROMPT = """Rate the assistant's reply to the user's request: is it helpful, correct, \
complete and clearly written? Answer with a single digit from 1 (useless) to 9 (excellent).

[User request]
{prompt}

[Assistant reply]
{response}

Rating (1-9):"""


# ---- data ----
def load_prompts(args: Args) -> tuple[list[list[str]], list[str]]:
    """(the training prompts in num_splits parts, the held-out prompts). UltraFeedback as the
    official shuffle_ds.py makes it: Snorkel's train_iteration_{1,2,3} (and test_iteration_*)
    concatenated, shuffled with seed 8964, cut in 6; held out: the first heldout_size of test
    part 1. A .jsonl (data/chat_prompts.jsonl, written for this project): rows {"prompt",
    "split": "train" | "heldout"}."""
    if args.dataset.endswith(".jsonl"):
        lines = pathlib.Path(args.dataset).read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        train = [row["prompt"] for row in rows if row.get("split", "train") == "train"]
        test = [row["prompt"] for row in rows if row.get("split", "train") == "heldout"]
        random.Random(8964).shuffle(train)
    else:
        from datasets import concatenate_datasets, load_dataset

        raw = load_dataset(args.dataset)
        shuffled = {}
        for split in ("train", "test"):
            iterations = [raw[f"{split}_iteration_{i}"] for i in (1, 2, 3)]
            prompts = concatenate_datasets(iterations).shuffle(seed=8964)["prompt"]
            shuffled[split] = list(prompts)
        train = shuffled["train"]
        test = shuffled["test"][: len(shuffled["test"]) // args.num_splits]
    size = len(train) // args.num_splits
    parts = []
    for i in range(args.num_splits):
        end = (i + 1) * size
        if i == args.num_splits - 1:
            end = None  # the last part takes the rest, as the official split
        parts.append(train[i * size : end][: args.num_prompts])
    return parts, test[: args.heldout_size]


# ---- rewards ----
def load_classifier(name: str, dtype: torch.dtype, args: Args) -> torch.nn.Module:
    """--reward-kind classifier's model: a sequence classifier (ArmoRM runs its own modelling
    code: --trust-remote-code)."""
    return AutoModelForSequenceClassification.from_pretrained(
        name, dtype=dtype, trust_remote_code=args.trust_remote_code
    )


def load_judge(name: str, dtype: torch.dtype, args: Args) -> torch.nn.Module:
    """--reward-kind judge's model: a causal LM that rates a reply (JUDGE_PROMPT)."""
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)


def classifier_scores(
    model, tokenizer, prompt: str, responses: list[str], args: Args
) -> list[float]:
    """The classifier's reward of each response, one conversation per forward (deviation 4): its
    scalar score (ArmoRM's `score`, the gated sum of its objectives; else its first logit)."""
    scores = []
    for response in responses:
        chat = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": response},
        ]
        encoded = tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)
        output = model(input_ids=encoded["input_ids"].to(model.device))
        score = getattr(output, "score", None)
        if score is None:
            score = output.logits[:, 0]
        scores.append(float(score.float()))
    return scores


def judge_scores(model, tokenizer, prompt: str, responses: list[str], args: Args) -> list[float]:
    """The judge's reward of each response: the expected rating sum_d d p(d) / sum_d p(d) under
    its next-token probabilities p(d) of the digits d = 1..9 after JUDGE_PROMPT, in [1, 9]."""
    digits = []  # the token ids of "1".."9"
    for d in range(1, 10):
        digits.append(tokenizer.encode(str(d), add_special_tokens=False)[-1])
    scores = []
    for response in responses:
        judge_prompt = JUDGE_PROMPT.format(prompt=prompt, response=response)
        ids = encode_prompt(tokenizer, chat_prompt(tokenizer, judge_prompt))
        ids = torch.tensor([ids], device=model.device)
        logits = model(input_ids=ids).logits[0, -1, digits]  # [9]
        p = logits.float().softmax(-1)
        ratings = torch.arange(1, 10, device=p.device)
        scores.append(float((p * ratings).sum()))
    return scores


class RewardKind(NamedTuple):
    """How a --reward-kind value builds r(x, y) and scores with it."""

    load: object  # (name, dtype, args) -> the model (load_reward_model)
    score: object  # (model, tokenizer, prompt, responses, args) -> a reward each (score_responses)


# --reward-kind's choices: a new one is its two functions above and an entry here
REWARD_KINDS = {
    "classifier": RewardKind(load_classifier, classifier_scores),
    "judge": RewardKind(load_judge, judge_scores),
}


def reward_rule(kind: str) -> RewardKind:
    """--reward-kind's RewardKind, from REWARD_KINDS: the one place that dispatches on it."""
    if kind not in REWARD_KINDS:
        raise ValueError(
            f"--reward-kind {kind}: add its entry to REWARD_KINDS (a RewardKind of its load and "
            "score functions, e.g. load_judge, judge_scores)"
        )
    return REWARD_KINDS[kind]


def load_reward_model(args: Args, dist: Dist) -> tuple:
    """r(x, y), frozen, as (model, tokenizer), built by --reward-kind's loader (reward_rule): a
    full bf16 copy on every GPU (ArmoRM-8B: 16 GB of an H200's 141; no FSDP, so ranks score their
    shares independently). solve and heldout_rewards score with it."""
    load = reward_rule(args.reward_kind).load
    name = resolve_model(args.reward_model)
    dtype = torch.float32
    if dist.device.type == "cuda":
        dtype = torch.bfloat16
    model = load(name, dtype, args)
    model = model.to(dist.device).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(name)


@torch.no_grad()
def score_responses(
    reward_model: tuple, prompt: str, responses: list[str], args: Args
) -> list[float]:
    """r(x, y) of each response to the prompt, a float each, by --reward-kind's scorer
    (reward_rule: classifier_scores, judge_scores), which reads its parameters from args; no
    responses, no rewards."""
    score = reward_rule(args.reward_kind).score
    model, tokenizer = reward_model
    return score(model, tokenizer, prompt, responses, args)


def solver_reward(score: float, sample: Sample, args: Args) -> float:
    """A response's training reward (Algorithm 1's 'annotate rewards'): the reward model's
    score r(x, y) itself (official). solve puts it on its Group, where informativeness, the
    pairs and the rollouts read it; the held-out win rate reads the score. A reward term
    reads the response's Sample (its tokens, its finish reason)."""
    return score


# --info-metric's rows (Tables 2-3), each (r, args) -> info, a function of a prompt's N rewards r,
# sorted, N >= 1, reading any parameter of its own from args; official src/reward_hf.py's columns
# reward_gap, reward_maxmean, reward_dts, reward_var, reward_mean.
def reward_gap(r: list[float], args: Args) -> float:
    """a_min: max r - min r, A*_min, the minimax-regret proxy (eva's default); one response: 0."""
    return r[-1] - r[0]


def reward_maxmean(r: list[float], args: Args) -> float:
    """a_avg: max r - mean r, A*_avg; one response: 0."""
    return r[-1] - float(np.mean(r))


def reward_dts(r: list[float], args: Args) -> float:
    """a_dts: max r - the second highest r, A*_dts, dueling (a tie at the top: 0; one response:
    0, it has no second)."""
    runner_up = r[-2] if len(r) > 1 else r[-1]
    return r[-1] - runner_up


def reward_var(r: list[float], args: Args) -> float:
    """var: the variance of r; one response: 0."""
    return float(np.var(r))


def reward_mean(r: list[float], args: Args) -> float:
    """avg: the mean of r."""
    return float(np.mean(r))


def negated_reward_mean(r: list[float], args: Args) -> float:
    """inv_avg: -mean r, favouring the prompts avg ranks lowest (deviation 5)."""
    return -reward_mean(r, args)


def negated_reward_gap(r: list[float], args: Args) -> float:
    """inv_a_min: -(max r - min r), favouring the prompts a_min ranks lowest (deviation 5)."""
    return -reward_gap(r, args)


def same_info(r: list[float], args: Args) -> float:
    """uniform: 1 for every prompt (no preference)."""
    return 1.0


# --info-metric's choices: a new one is its function above and an entry here
INFO_METRICS = {
    "a_min": reward_gap,
    "a_avg": reward_maxmean,
    "a_dts": reward_dts,
    "var": reward_var,
    "avg": reward_mean,
    "inv_avg": negated_reward_mean,
    "inv_a_min": negated_reward_gap,
    "uniform": same_info,
}


def informativeness(rewards: list[float], args: Args) -> float:
    """info(x) from the rewards of x's N responses by --info-metric's row of INFO_METRICS, the
    one place that dispatches on it; a higher value draws x more often (sampling_weights). No
    responses: 0 for every row (a run's groups all have N = --n-samples responses, so all or
    none are empty). main computes it a prompt (step 2); sample_subset (step 3) draws by it,
    and creator/info_mean logs its mean."""
    metric = args.info_metric
    if metric not in INFO_METRICS:
        raise ValueError(
            f"--info-metric {metric}: add its entry to INFO_METRICS (its function (a prompt's "
            "sorted rewards, args) -> info, e.g. reward_gap; higher: drawn more often)"
        )
    if not rewards:
        return 0.0
    return INFO_METRICS[metric](sorted(rewards), args)


def sampling_weights(values: list[float]) -> np.ndarray:
    """The official sampling weights: min-max normalise the values over the prompt set and divide
    by their sum, so the least informative prompt gets weight 0 (an inv_* metric's negated value
    gives the official 1 - normalised). Edges: all values equal (one prompt included): uniform
    (the official normalisation divides by 0); no prompts: an empty array. values: [P] (P
    prompts); returns [P], summing to 1; sample_subset hands them to --sampling's draw with
    the values (the official draws use them; a draw may use the values alone)."""
    v = np.asarray(values, dtype=float)
    if len(v) == 0:
        return v
    if v.max() == v.min():
        return np.full(len(v), 1.0 / len(v))
    v = (v - v.min()) / (v.max() - v.min())
    return v / v.sum()


def draw_without_replacement(weights: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """k indices of weights, drawn one after another with probabilities weights (the official
    pandas df.sample); when fewer than k weights are positive, every positive one and then a
    uniform draw among the zero weights (where pandas raises); k is capped at len(weights), and
    k <= 0 draws nothing."""
    positive = np.flatnonzero(weights > 0)
    k = min(k, len(weights))
    if k <= 0:
        return []
    if len(positive) >= k:
        p = weights / weights.sum()
        return rng.choice(len(weights), size=k, replace=False, p=p).tolist()
    zeros = rng.permutation(np.flatnonzero(weights <= 0))
    return positive.tolist() + zeros[: k - len(positive)].tolist()


# --sampling's draws, each (values, weights, rng, args) -> the chosen indices, on P prompts
# (P >= 1): values, weights [P] (informativeness, sampling_weights); a draw reads its own
# parameters (--evolve-fraction, --stratified-bins, a fork's new flag) from args.
def weighted_draw(
    values: list[float], weights: np.ndarray, rng: np.random.Generator, args: Args
) -> list[int]:
    """weighted (eva-sample): int(f * P) drawn without replacement with probabilities weights
    (draw_without_replacement), f = --evolve-fraction."""
    k = int(len(weights) * args.evolve_fraction)
    return draw_without_replacement(weights, k, rng)


def greedy_draw(
    values: list[float], weights: np.ndarray, rng: np.random.Generator, args: Args
) -> list[int]:
    """greedy (Table 4's eva-greedy): the int(f * P) highest weights, f = --evolve-fraction, the
    lower index first among equal ones."""
    by_weight = sorted(range(len(weights)), key=lambda i: -weights[i])
    return by_weight[: int(len(weights) * args.evolve_fraction)]


def stratified_draw(
    values: list[float], weights: np.ndarray, rng: np.random.Generator, args: Args
) -> list[int]:
    """stratified: round(f * size) drawn by weight (draw_without_replacement) in each of
    --stratified-bins quantile bins of the values, f = --evolve-fraction (pd.qcut's bins
    (e_i, e_i+1], the lowest closed, duplicate edges dropped). A bin's round can be 0, so small
    bins draw none: 8 prompts in 10 bins at f = 0.25 draw no prompt (round(0.25) = 0)."""
    bins = args.stratified_bins
    edges = np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)))
    # bins (e_i, e_i+1], the lowest closed
    strata = np.searchsorted(edges[1:-1], values, side="left")
    chosen = []
    for stratum in np.unique(strata):
        members = np.flatnonzero(strata == stratum)
        k = round(args.evolve_fraction * len(members))
        for j in draw_without_replacement(weights[members], k, rng):
            chosen.append(int(members[j]))
    return chosen


# --sampling's choices: a new one is its function above and an entry here
SAMPLINGS = {
    "weighted": weighted_draw,
    "greedy": greedy_draw,
    "stratified": stratified_draw,
}


def sample_informative(
    values: list[float], weights: np.ndarray, rng: np.random.Generator, args: Args
) -> list[int]:
    """The sorted indices of the informative subset of the P prompts, drawn by --sampling's entry
    of SAMPLINGS, the one place that dispatches on it (how many it takes: the entry's
    docstring); no prompts: none. values, weights: [P]. sample_subset's result, the seeds step 4
    evolves."""
    if args.sampling not in SAMPLINGS:
        raise ValueError(
            f"--sampling {args.sampling}: add its entry to SAMPLINGS (its draw of the subset's "
            "indices from (values, weights, rng, args), e.g. weighted_draw)"
        )
    weights = np.asarray(weights, dtype=float)
    if len(weights) == 0:
        return []
    draw = SAMPLINGS[args.sampling]
    return sorted(draw(values, weights, rng, args))


def sample_subset(info: list[float], iteration: int, args: Args) -> list[int]:
    """Step 3, the creator's 'sample subset'. Takes each prompt's info (informativeness, step 2);
    returns the sorted indices of the informative subset, drawn by --sampling's draw
    (sample_informative, SAMPLINGS; each draw says how many it takes), which is handed the
    values and their sampling_weights, seeded by the round (the same on every rank and after
    a resume). Step 4 evolves these prompts (--no-evolve:
    trains on them); creator/subset logs their number. A draw of none from a non-empty set
    (small bins, a small fraction) prints a line on rank 0: that round evolves nothing."""
    weights = sampling_weights(info)
    seed = zlib.crc32(f"{args.seed}/{iteration}".encode())
    chosen = sample_informative(
        values=info, weights=weights, rng=np.random.default_rng(seed), args=args
    )
    if info and not chosen and os.environ.get("RANK", "0") == "0":
        print(
            f"eva.py: iteration {iteration}: --sampling {args.sampling} at --evolve-fraction "
            f"{args.evolve_fraction} drew none of the {len(info)} prompts (creator/subset 0), "
            "so no prompt evolves this round (its draw's docstring says how many it takes)"
        )
    return chosen


def group_teaches(group: Group, args: Args) -> bool:
    """Whether a group can teach: its rewards are not all equal. False for one response or none
    (deviation 3: training_items skips such a group)."""
    return len(set(group.rewards)) > 1


def preference_pair(group: Group, args: Args) -> tuple[int, int]:
    """(chosen, rejected): the indices in the group of the highest and the lowest reward
    (official: argmax, argmin). Ties: the first index of each (np.argmax); all rewards equal:
    (0, 0), the official chosen = rejected, which training_items never asks for
    (group_teaches). A group of N >= 1 responses."""
    return int(np.argmax(group.rewards)), int(np.argmin(group.rewards))


def win_probability(rewards: list[float], i: int) -> float:
    """SPPO's P(y_i beats the policy): the mean over all N responses j (itself: 1/2) of
    sigmoid(r_i - r_j), Bradley-Terry on the rewards (official SPPO), in (0, 1); one response:
    1/2. sigmoid(d) = (1 + tanh(d / 2)) / 2, which no reward gap overflows."""
    wins = []
    for r in rewards:
        wins.append(0.5 * (1.0 + math.tanh((rewards[i] - r) / 2.0)))
    return float(np.mean(wins))


def rloo_advantage(reward: float, rewards: list[float]) -> float:
    """REINFORCE leave-one-out: a response's reward minus the mean reward of the other N - 1
    responses of its prompt (rewards, its own included). One response: 0 (no other to compare
    with). A rollout Example's weight (training_items)."""
    others = len(rewards) - 1
    if others == 0:
        return 0.0
    return reward - (sum(rewards) - reward) / others


def win_rate(rewards: list[float], reference: list[float]) -> float:
    """The share of prompts where the new policy's response outscores the reference policy's; a
    tie counts 1/2. rewards, reference: one a prompt, the same prompts in the same order (else
    ValueError); no prompts: nan (nothing compared; win_rate_note says nothing)."""
    wins = []
    for new, old in zip(rewards, reference, strict=True):
        if new > old:
            wins.append(1.0)
        elif new == old:
            wins.append(0.5)
        else:
            wins.append(0.0)
    if not wins:
        return float("nan")
    return float(np.mean(wins))


# ---- losses ----
# On sequence log-probs, each [B] (B pairs): pi_w, pi_l under the policy, ref_w, ref_l under the
# round's reference (the policy as the round started); _w is the chosen response, _l the rejected.
def dpo_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (official loss_type sigmoid): -log sigmoid(beta h), with the margin
    h = (pi_w - ref_w) - (pi_l - ref_l). h: [B]; returns [B]."""
    return -F.logsigmoid(beta * h)


def ipo_loss(h_mean: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO: (h - 1/(2 beta))^2, with h on per-token mean log-probs (the official trainer's 'FIX
    for IPO'). h_mean: [B]; returns [B]."""
    return (h_mean - 1.0 / (2.0 * beta)) ** 2


def rpo_loss(h: torch.Tensor, nll_chosen: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
    """RPO: DPO plus alpha times the chosen response's NLL (its mean token NLL; officially divided
    again by its length, item_losses). h, nll_chosen: [B]; returns [B]."""
    return dpo_loss(h, beta) + alpha * nll_chosen


def sppo_loss(
    logratio_w: torch.Tensor,
    logratio_l: torch.Tensor,
    p_w: torch.Tensor,
    p_l: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """SPPO (eta = 1/beta): each response's log-ratio log pi - log ref regressed on
    (P(win) - 1/2) / beta, averaged over the two. All [B] (p_*: win_probability); returns [B]."""
    target_w = (p_w - 0.5) / beta
    target_l = (p_l - 0.5) / beta
    return ((logratio_w - target_w) ** 2 + (logratio_l - target_l) ** 2) / 2


def simpo_loss(
    mean_w: torch.Tensor, mean_l: torch.Tensor, beta: float, gamma_beta_ratio: float
) -> torch.Tensor:
    """SimPO: -log sigmoid(beta (mean_w - mean_l - gamma/beta)) on per-token mean log-probs; no
    reference. mean_w, mean_l: [B]; returns [B]."""
    return -F.logsigmoid(beta * (mean_w - mean_l - gamma_beta_ratio))


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of the mean token probability p = exp(mean_logp): log p - log(1 - p), with
    log(1 - e^m) = log(-expm1(m)), stable for m < 0."""
    return mean_logp - torch.log(-torch.expm1(mean_logp.clamp(max=-1e-6)))


def orpo_loss(mean_w: torch.Tensor, mean_l: torch.Tensor, lam: float) -> torch.Tensor:
    """ORPO: the chosen mean token NLL minus lambda log sigmoid(log odds_w - log odds_l) (log_odds);
    no reference. mean_w, mean_l: [B]; returns [B]."""
    nll_w = -mean_w
    odds_ratio = F.logsigmoid(log_odds(mean_w) - log_odds(mean_l))
    return nll_w - lam * odds_ratio


def rloo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, args: Args
) -> torch.Tensor:
    """RLOO [RECON]: -min(rho A, clip(rho, 1 - eps, 1 + eps) A), eps = --rloo-clip, with the
    sequence ratio rho = pi / pi_old and A the rloo_advantage; at rho = 1, REINFORCE. All [B];
    returns [B]."""
    clip = args.rloo_clip
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantages
    return -torch.min(unclipped, clipped)


# --loss's choices that train on every response (an Example each, weighted by its advantage)
# instead of on a Pair a group: a new one is its function above, (logp, old_logp, advantages,
# args) -> [B], and an entry here (item_losses calls it; training_items and distribution read
# the table to build its items)
ROLLOUT_LOSSES = {"rloo": rloo_loss}


def item_losses(
    loss: str, pi: torch.Tensor, ref: torch.Tensor, n: torch.Tensor, w: torch.Tensor, args: Args
) -> torch.Tensor:
    """The per-item loss of `loss`, [B]: the one place that dispatches on --loss. pi, ref, n, w:
    [k, B], k sequences an item: a pair's (k = 2, row 0 the chosen, row 1 the rejected) or a
    rollout's (k = 1, ROLLOUT_LOSSES): sequence log-probs under the policy and the reference,
    token counts (at least 1), and each sequence's number from its item (sequences): a pair's
    win probabilities, a rollout's weight (its advantage). A new pair loss adds its function
    above and its line here; a new rollout loss, its function and its entry in ROLLOUT_LOSSES
    (and either, if it has official values, its row in OFFICIAL). micro_batch_loss averages it
    over the batch."""
    logratio = pi - ref  # [k, B]: log pi - log ref
    h = logratio[0] - logratio[-1]  # [B]: DPO's margin (a rollout's: 0)
    token_mean = pi / n  # [k, B]: per-token mean log-probs
    if loss == "dpo":
        return dpo_loss(h, args.beta)
    if loss == "ipo":
        h_mean = logratio[0] / n[0] - logratio[-1] / n[-1]
        return ipo_loss(h_mean, args.beta)
    if loss == "rpo":
        nll_chosen = -token_mean[0]
        if args.rpo_penalize_length_nll:
            nll_chosen = nll_chosen / n[0]  # as the official trainer
        return rpo_loss(h, nll_chosen, args.beta, args.rpo_alpha)
    if loss == "sppo":
        return sppo_loss(logratio[0], logratio[-1], w[0], w[-1], args.beta)
    if loss == "simpo":
        return simpo_loss(token_mean[0], token_mean[-1], args.beta, args.simpo_gamma_beta_ratio)
    if loss == "orpo":
        return orpo_loss(token_mean[0], token_mean[-1], args.beta)
    if loss in ROLLOUT_LOSSES:
        rollout_loss = ROLLOUT_LOSSES[loss]
        return rollout_loss(pi[0], ref[0], w[0], args)
    raise ValueError(
        f"--loss {loss}: add its line to item_losses (a pair loss, e.g. dpo_loss, on pi, ref, "
        "n, w) or its entry to ROLLOUT_LOSSES (a loss on every response, e.g. rloo_loss); its "
        "row in OFFICIAL, else resolve gives it DPO's official values)"
    )


# ---- records ----
class Group(NamedTuple):
    """A prompt, the solver's N responses to it, their training rewards (solver_reward) and the
    reward model's scores r(x, y) (solve): what the creator's steps 2-3 and training_items
    read."""

    prompt: str
    samples: list[Sample]
    rewards: list[float]  # solver_reward of each response
    scores: list[float] | None = None  # the reward model's r(x, y) of each response


class Pair(NamedTuple):
    """A group's preference pair (preference_pair), cut to length (cut_to_length), with the Group
    it came from: a training item of the pair losses."""

    chosen: Sample  # the highest-rewarded response
    rejected: Sample  # the lowest-rewarded one
    source: Group  # the group whose rewards ranked them
    indices: tuple[int, int]  # chosen's and rejected's index in source (preference_pair)
    rewards: tuple[float, float]  # chosen's and rejected's solver_reward
    win_probs: tuple[float, float]  # their win_probability in the group (SPPO's)


class Example(NamedTuple):
    """A training sequence: its Sample, its weight, and the record it came from."""

    sample: Sample  # the prompt and target tokens
    weight: float  # the number the loss multiplies: a reward, an advantage, a label
    source: object = None  # the record it was made from (a Group, ...)


def example_length(example: Example) -> int:
    """An Example's prompt and target tokens (micro_batches' sort key)."""
    return len(example.sample.prompt_ids) + len(example.sample.token_ids)


# ---- phases ----
def solve(
    sampler,
    tokenizer,
    reward_model: tuple,
    prompts: list[str],
    n: int,
    key: str,
    args: Args,
    dist: Dist,
) -> list[Group]:
    """Steps 1 and 5, Algorithm 1's 'self-generate responses' and 'annotate rewards'. Takes
    prompts; samples n responses to each (one user turn, the solver's temperature and top-p, as
    officially) and scores them with the reward model (score_responses) on the rank that sampled
    them (only the rewards cross ranks), each score made a solver_reward. Returns a Group a
    prompt, in the prompts' order: the creator's informativeness (step 2) and training_items
    (step 6) read them."""
    chats = [chat_prompt(tokenizer, prompt) for prompt in prompts]
    # this rank's share: {prompt index: the prompt's n Samples}
    shard = sample_shard(
        sampler=sampler,
        prompts=chats,
        n=n,
        key=key,
        dist=dist,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        logprobs=False,  # the losses take their own log-probs
    )
    groups = {}
    for i in sorted(shard):
        responses = [sample.text for sample in shard[i]]
        scores = score_responses(reward_model, prompts[i], responses, args)
        rewards = []
        for score, sample in zip(scores, shard[i]):
            rewards.append(solver_reward(score, sample, args))
        groups[i] = Group(prompts[i], shard[i], rewards, scores)
    return gather_shard(groups, dist)


def ask_endpoint(prompt: str, args: Args) -> tuple[str, str]:
    """(text, finish reason) of one chat completion from --evolver-url, in 3 tries; a failed
    request is (the error, "error"), which read_evolution drops as failed."""
    body = {
        "model": args.evolver_model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": args.evolve_temperature,
        "max_tokens": args.evolve_max_new_tokens,
    }
    data = json.dumps(body).encode()
    api_key = os.environ.get(args.evolver_key_env)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    url = args.evolver_url.rstrip("/") + "/chat/completions"
    for attempt in range(3):
        try:
            request = urllib.request.Request(url, data, headers)
            with urllib.request.urlopen(request, timeout=args.evolver_timeout) as response:
                choice = json.load(response)["choices"][0]
            text = choice["message"]["content"] or ""
            finish_reason = choice.get("finish_reason") or "stop"
            return text, finish_reason
        except Exception as e:  # rate limits, timeouts, malformed replies: try again, then give up
            error = f"{type(e).__name__}: {e}"
            time.sleep(2**attempt)
    return error, "error"


def ask_endpoint_all(prompts: list[str], args: Args) -> list[tuple[str, str]]:
    """ask_endpoint for each prompt, --evolver-workers requests at a time."""
    ask = functools.partial(ask_endpoint, args=args)
    with concurrent.futures.ThreadPoolExecutor(args.evolver_workers) as pool:
        return list(pool.map(ask, prompts))


def ask_creator(
    sampler, tokenizer, prompts: list[str], key: str, args: Args, dist: Dist
) -> list[tuple[str, str]]:
    """The creator's reply (text, finish reason) to each mutation prompt, the one place that
    picks the creator: --evolver-url's endpoint when given (each rank asks for its share; nothing
    else is built for it), else the policy itself through the sampler. evolve reads them."""
    if args.evolver_url:
        ask = functools.partial(ask_endpoint_all, args=args)
        return map_sharded(ask, prompts, dist)
    chats = [chat_prompt(tokenizer, prompt) for prompt in prompts]
    rows = sample(
        sampler=sampler,
        prompts=chats,
        n=1,
        key=key,
        dist=dist,
        temperature=args.evolve_temperature,
        max_new_tokens=args.evolve_max_new_tokens,
        logprobs=False,
    )
    return [(row[0].text, row[0].finish_reason) for row in rows]


def normalise(text: str) -> str:
    """Lower case, whitespace collapsed: the key of the unchanged and duplicate checks."""
    return " ".join(text.lower().split())


def read_evolution(
    text: str, finish_reason: str, parent: str, seen: set[str], args: Args
) -> tuple[str | None, str]:
    """(the evolved prompt or None, the reason): distilabel keeps the text after the last
    "Prompt#:"; we drop a failed or empty reply, one holding the templates' MARKERS, and one
    repeating its parent or a known prompt (deviation 1); a truncated one stays, marked. A
    changed filter reads its flag from args. evolve keeps the prompt (if any) and records the
    reason (record_evolutions)."""
    new = text.split("Prompt#:")[-1].strip().strip('"').strip()
    if finish_reason in ("abort", "error"):
        return None, "failed"
    if not new:
        return None, "empty"
    if any(marker in new.lower() for marker in MARKERS):
        return None, "marker"
    if normalise(new) == normalise(parent):
        return None, "unchanged"
    if normalise(new) in seen:
        return None, "duplicate"
    if finish_reason == "length":
        return new, "truncated"
    return new, ""


def draw_mutations(chains: list[str], rng: random.Random, args: Args) -> list[str]:
    """The name of each chain's next mutation (MUTATIONS), drawn uniformly with the round's rng
    (distilabel's np.random.choice). chains: each seed's last kept prompt (not read by the
    uniform draw). evolve applies them."""
    names = []
    for _ in chains:
        names.append(rng.choice(list(MUTATIONS)))
    return names


def evolve(
    sampler,
    tokenizer,
    seeds: list[str],
    known: list[str],
    iteration: int,
    args: Args,
    dist: Dist,
) -> tuple[list[str], list[dict]]:
    """Step 4, the creator's 'self-evolve prompts' (official: distilabel's EvolInstruct with
    store_evolutions). Takes the seeds (the informative subset's prompts) and the known prompts;
    grows a chain of num_evolutions MUTATIONS per seed, each drawn by draw_mutations and applied
    to the seed's last kept prompt, a reply kept or dropped by read_evolution. Returns (the new
    prompts, X_t: every kept prompt of every chain, the intermediate ones included, which step 5
    solves and the next round starts from; a record of every evolution, with its place in the
    chain as "evolution", which record_evolutions writes)."""
    # the same draws on every rank and after a resume
    rng = random.Random(f"{args.seed}/{iteration}/mutations")
    chains = list(seeds)  # each seed's last kept prompt
    seen = {normalise(prompt) for prompt in known}
    evolved, records = [], []
    for evolution in range(args.num_evolutions):  # the chains' evolution-th mutation
        names = draw_mutations(chains, rng, args)
        asks = []
        for name, chain in zip(names, chains):
            asks.append(MUTATIONS[name].replace("<PROMPT>", chain))
        replies = ask_creator(
            sampler=sampler,
            tokenizer=tokenizer,
            prompts=asks,
            key=f"{args.seed}/{iteration}/evolve/{evolution}",
            args=args,
            dist=dist,
        )
        for i, (text, finish_reason) in enumerate(replies):
            new, reason = read_evolution(text, finish_reason, chains[i], seen, args)
            record = {
                "round": iteration,
                "seed": i,
                "evolution": evolution,
                "mutation": names[i],
                "parent": chains[i],
                "reply": text,
                "finish_reason": finish_reason,
                "kept": new is not None,
                "reason": reason,
            }
            records.append(record)
            if new is not None:
                chains[i] = new
                seen.add(normalise(new))
                evolved.append(new)
    return evolved, records


def record_evolutions(records: list[dict], run_dir: pathlib.Path, dist: Dist) -> dict[str, float]:
    """Append evolve's records to <run>/evolutions.jsonl (main rank); returns the number of
    evolutions of each reason (read_evolution's) as creator/<reason>, logged with the round's
    metrics: creator/kept (kept whole), creator/truncated (kept, its reply cut at
    --evolve-max-new-tokens), or the reason it was dropped (creator/failed, empty, marker,
    unchanged, duplicate); a reason no evolution had is not logged."""
    if dist.is_main:
        with open(run_dir / "evolutions.jsonl", "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    reasons = collections.Counter(record["reason"] or "kept" for record in records)
    stats = {}
    for reason, count in reasons.items():
        stats[f"creator/{reason}"] = float(count)
    return stats


def mix(old: list, new: list, rng: random.Random, args: Args) -> list:
    """Step 5's mix (as officially): int(old_pair_ratio |old|) of the old groups and
    int(new_pair_ratio |new|) of the new, each drawn without replacement, then shuffled together.
    Edges: an empty list or a share of 0 gives none of it; a share of 1, all of it (the shares
    are in [0, 1]: check_choices). Returns the groups step 6 (training_items) trains on."""
    old_share = rng.sample(old, int(len(old) * args.old_pair_ratio))
    new_share = rng.sample(new, int(len(new) * args.new_pair_ratio))
    both = old_share + new_share
    rng.shuffle(both)
    return both


def cut_to_length(samples: list[Sample], args: Args) -> list[Sample]:
    """The samples of one prompt cut as the official trainer's tokenizer does: only when the
    prompt + the longest response exceed max_length, the prompt to its last max_prompt_length
    tokens; then, if still too long, the responses to max_length - max_prompt_length. Their
    logprobs are dropped (the losses take their own)."""
    prompt = samples[0].prompt_ids
    longest = max(len(sample.token_ids) for sample in samples)
    if len(prompt) + longest > args.max_length:
        prompt = prompt[-args.max_prompt_length :]
    cut = None
    if len(prompt) + longest > args.max_length:
        cut = args.max_length - args.max_prompt_length
    fitted = []
    for sample in samples:
        tokens = sample.token_ids[:cut]
        fitted.append(sample._replace(prompt_ids=prompt, token_ids=tokens, logprobs=[]))
    return fitted


def group_pair(group: Group, args: Args) -> Pair:
    """The group's Pair: its preference_pair's responses, cut together (cut_to_length), with
    their indices, rewards and win probabilities in the group (win_probability)."""
    chosen, rejected = preference_pair(group, args)
    samples = [group.samples[chosen], group.samples[rejected]]
    fitted = cut_to_length(samples, args)
    return Pair(
        chosen=fitted[0],
        rejected=fitted[1],
        source=group,
        indices=(chosen, rejected),
        rewards=(group.rewards[chosen], group.rewards[rejected]),
        win_probs=(
            win_probability(group.rewards, chosen),
            win_probability(group.rewards, rejected),
        ),
    )


def group_rollouts(group: Group, args: Args) -> list[Example]:
    """Each response of the group as an Example (RLOO's rollouts): cut alone (cut_to_length),
    weighted by its rloo_advantage in the group, its source the group."""
    examples = []
    for sample, reward in zip(group.samples, group.rewards):
        [fitted] = cut_to_length([sample], args)
        advantage = rloo_advantage(reward, group.rewards)
        examples.append(Example(fitted, advantage, source=group))
    return examples


def training_items(groups: list[Group], args: Args) -> list[Pair | Example]:
    """Step 6's training set. Takes the round's groups (mix's, or the split's); a group whose
    rewards all agree teaches nothing and is skipped (group_teaches; deviation 3). Returns a
    Pair of each other group (group_pair), or, for a loss of ROLLOUT_LOSSES, its responses as
    Examples (group_rollouts); no groups, no items. update trains on them; chart_metrics counts
    them."""
    items = []
    for group in groups:
        if not group_teaches(group, args):
            continue
        if args.loss in ROLLOUT_LOSSES:
            items.extend(group_rollouts(group, args))
        else:
            items.append(group_pair(group, args))
    return items


def sequences(item: Pair | Example) -> tuple[list[Sample], list[float]]:
    """An item's sequences and each one's number for the loss (item_losses' w): a pair's chosen
    and rejected with their win probabilities, a rollout's one with its weight."""
    if isinstance(item, Pair):
        return [item.chosen, item.rejected], list(item.win_probs)
    return [item.sample], [item.weight]


def distribution(args: Args) -> tuple[float, float]:
    """(temperature, top-p) of the log-probs the loss takes: the sampler's for ROLLOUT_LOSSES
    (RLOO's ratio is of the distribution sampled from; TRL: the temperature alone), 1 and 1 for
    pairs (TRL's DPO)."""
    if args.loss in ROLLOUT_LOSSES:
        return args.temperature, args.top_p
    return 1.0, 1.0


def sample_length(entry: tuple[int, Sample]) -> int:
    """An (index, sample)'s tokens, prompt and response (micro_batches sorts by it)."""
    _, sample = entry
    return len(sample.prompt_ids) + len(sample.token_ids)


@torch.no_grad()
def sequence_logprobs(policy, samples: list[Sample], args: Args, dist: Dist) -> list[float]:
    """log pi(y | x) of each sample, summed over its tokens (in the distribution()), each rank
    on its share; micro-batches of 2 micro_batch_size (a pair's two sequences each). update
    takes the reference log-probs with it."""
    temperature, top_p = distribution(args)
    batches = micro_batches(
        items=list(enumerate(samples)),
        size=2 * args.micro_batch_size,
        dist=dist,
        length=sample_length,
    )
    logps = {}
    for batch, real in batches:
        batch_samples = [sample for _, sample in batch]
        logp, mask, _ = token_logprobs(policy, batch_samples, temperature, top_p)  # [B, T]
        if not real:
            continue  # a padding micro-batch, run for FSDP2's collectives only
        sums = (logp * mask).sum(1).tolist()
        for (index, _), value in zip(batch, sums):
            logps[index] = value
    return gather_shard(logps, dist)


def micro_batch_loss(
    policy, items: list[tuple], size: int, args: Args
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro-batch of (item, its reference log-probs): its part of the loss's mean over `size`
    items (item_losses; one forward, every chosen then every rejected, as TRL's concatenated
    forward), and of the stats: the margin beta h, the accuracy (h > 0) and the log-probs for
    pairs; the ratio rho for rollouts. update's train_step calls it."""
    k = len(sequences(items[0][0])[0])  # sequences an item: 2 a pair, 1 a rollout
    batch = []
    for j in range(k):
        for item, _ in items:
            batch.append(sequences(item)[0][j])
    temperature, top_p = distribution(args)
    logp, mask, _ = token_logprobs(policy, batch, temperature, top_p)  # [k B, T]
    pi = (logp * mask).sum(1).view(k, -1)  # [k, B]: log pi(y | x)
    n = mask.sum(1).clamp(min=1).view(k, -1)  # [k, B]: tokens
    ref = pi.new_tensor([refs for _, refs in items]).T  # [k, B]
    w = pi.new_tensor([sequences(item)[1] for item, _ in items]).T  # [k, B]
    losses = item_losses(args.loss, pi, ref, n, w, args)
    if isinstance(items[0][0], Example):
        ratio = torch.exp(pi[0] - ref[0]).detach()
        return losses.sum() / size, {"ratio": ratio.sum().item() / size}
    h = ((pi[0] - ref[0]) - (pi[1] - ref[1])).detach()  # [B]
    stats = {
        "margin": args.beta * h.sum().item() / size,
        "accuracy": (h > 0).sum().item() / size,
        "logp_chosen": pi[0].sum().item() / size,
        "logp_rejected": pi[1].sum().item() / size,
    }
    return losses.sum() / size, stats


def item_length(entry: tuple) -> int:
    """An (item, reference log-probs)'s longest sequence, prompt and target tokens (micro_batches
    sorts by it): a rollout's example_length, a pair's longer response's."""
    item, _ = entry
    if isinstance(item, Example):
        return example_length(item)
    lengths = []
    for sample in sequences(item)[0]:
        lengths.append(len(sample.prompt_ids) + len(sample.token_ids))
    return max(lengths)


def update(
    policy, optimizer, items: list, rng: random.Random, args: Args, dist: Dist
) -> dict[str, float]:
    """Step 6, the solver's 'preference optimization', as one fresh trainer run (the official
    pipeline starts its trainer anew each round). Takes training_items' Pairs or Examples; takes
    reference log-probs of every sequence under the policy as it starts, clears the optimizer
    state, then runs `epochs` passes over the shuffled items in batches of batch_size
    (micro_batch_loss), warm-up then --lr-schedule (lr_at); each rank on its share. Returns the
    losses/* metrics (means over the steps, the first and last loss and margin, the step count);
    no epochs (or no items): no step, {"losses/steps": 0}; main calls it only with items, so a
    round without items logs no losses/*. The policy it leaves is theta_t, which step 7
    evaluates."""
    per_epoch = math.ceil(len(items) / args.batch_size)
    total = args.epochs * per_epoch
    if total == 0:
        return {"losses/steps": 0.0}
    all_sequences = []
    for item in items:
        all_sequences.extend(sequences(item)[0])
    refs = sequence_logprobs(policy, all_sequences, args, dist)
    with_refs = []  # (item, its sequences' reference log-probs)
    offset = 0
    for item in items:
        count = len(sequences(item)[0])
        with_refs.append((item, refs[offset : offset + count]))
        offset += count
    optimizer.state.clear()
    warmup = args.warmup_steps
    if warmup is None:
        warmup = math.ceil(total * args.warmup_ratio)
    stats = []
    for optimizer_step in range(total):
        if optimizer_step % per_epoch == 0:  # an epoch starts: a new order
            order = rng.sample(with_refs, len(with_refs))
        start = (optimizer_step % per_epoch) * args.batch_size
        batch = order[start : start + args.batch_size]

        def batch_loss(micro: list) -> tuple[torch.Tensor, dict[str, float]]:
            return micro_batch_loss(policy, micro, size=len(batch), args=args)

        lr = lr_at(
            step=optimizer_step,
            total=total,
            peak=args.learning_rate,
            warmup=warmup,
            schedule=args.lr_schedule,
        )
        step_stats = train_step(
            model=policy,
            optimizer=optimizer,
            batch=batch,
            loss_fn=batch_loss,
            micro_batch_size=args.micro_batch_size,
            max_grad_norm=args.max_grad_norm,
            dist=dist,
            length=item_length,
            lr=lr,
        )
        stats.append(step_stats)
    metrics = {}
    for name in stats[0]:
        metrics[f"losses/{name}"] = float(np.mean([s[name] for s in stats]))
    for name in ("loss", "margin"):  # where the round's training started and ended
        if name in stats[0]:
            metrics[f"losses/{name}_first"] = stats[0][name]
            metrics[f"losses/{name}_last"] = stats[-1][name]
    metrics["losses/steps"] = float(total)
    return metrics


def mean(values: list) -> float:
    """The mean of values; 0 for none (the charts' and creator's means of an empty set)."""
    if not values:
        return 0.0
    return float(np.mean(values))


def all_rewards(groups: list[Group]) -> list[float]:
    """Every response's reward, group after group."""
    rewards = []
    for group in groups:
        rewards.extend(group.rewards)
    return rewards


def chart_metrics(
    prompts: list[str], groups: list[Group], train_groups: list[Group], items: list, eva_round: bool
) -> dict[str, float]:
    """The round's charts/*: its prompts X_{t-1}, their responses and training rewards (groups),
    what it trained on (train_groups, items) and rm_margin, the pairs' mean reward-model margin
    r(x, y_w) - r(x, y_l) (the source Group's scores of the chosen and rejected, not their
    solver_reward); a mean of nothing (no groups, no pairs) is 0 (mean)."""
    lengths = []
    for group in groups:
        for sample in group.samples:
            lengths.append(len(sample.token_ids))
    margins = []
    for item in items:
        if isinstance(item, Pair):
            chosen, rejected = item.indices
            scores = item.source.scores
            margins.append(scores[chosen] - scores[rejected])
    return {
        "charts/prompts": float(len(prompts)),
        "charts/eva_round": float(eva_round),
        "charts/reward_mean": mean(all_rewards(groups)),
        "charts/train_groups": float(len(train_groups)),
        "charts/train_items": float(len(items)),
        "charts/rm_margin": mean(margins),
        "charts/generated_tokens": float(sum(lengths)),
        "charts/response_tokens": mean(lengths),
    }


def creator_metrics(info: list[float], chosen: list[int], evolved: list[str]) -> dict[str, float]:
    """The creator's part of creator/*: the mean informativeness of all prompts and of the
    subset (chosen), each 0 for none (mean), the subset's size, and the evolved prompts kept."""
    chosen_info = [info[i] for i in chosen]
    return {
        "creator/info_mean": mean(info),
        "creator/subset": float(len(chosen)),
        "creator/subset_info_mean": mean(chosen_info),
        "creator/evolved": float(len(evolved)),
    }


# ---- evaluation ----
def heldout_rewards(
    sampler, tokenizer, reward_model: tuple, heldout: list[str], key: str, args: Args, dist: Dist
) -> list[float]:
    """Step 7's (and step 0's) measurement: the policy's reward on each held-out prompt, one
    response each, sampled and scored as the solver's (solve), the reward model's score r(x, y)
    (not a training reward term). evaluate compares it with the reference's; it becomes the
    next round's reference."""
    groups = solve(
        sampler=sampler,
        tokenizer=tokenizer,
        reward_model=reward_model,
        prompts=heldout,
        n=1,
        key=key,
        args=args,
        dist=dist,
    )
    return [group.scores[0] for group in groups]


def evaluate(rewards: list[float], reference: list[float]) -> dict[str, float]:
    """Step 7's eval/*: the reward model's win rate (win_rate) of the policy over the one before
    its update, from their held-out rewards (heldout_rewards, one a prompt), and the two mean
    rewards; no held-out prompts: nan each (nothing measured)."""
    if not rewards:
        return {
            "eval/win_rate": float("nan"),
            "eval/reward": float("nan"),
            "eval/reference_reward": float("nan"),
        }
    return {
        "eval/win_rate": win_rate(rewards, reference),
        "eval/reward": float(np.mean(rewards)),
        "eval/reference_reward": float(np.mean(reference)),
    }


def win_rate_note(win_rate: float | None, heldout_size: int) -> str | None:
    """The run's last line when its last win rate is within two standard errors of chance (one
    response a prompt: the standard error of a win rate of 0.5 over n prompts is 0.5 / sqrt(n));
    None when no round ran, no prompt was compared (nan) or the win rate is further from 0.5."""
    if win_rate is None or math.isnan(win_rate):
        return None
    near_chance = abs(win_rate - 0.5) <= heldout_size**-0.5
    if not near_chance:
        return None
    return (
        f"eva.py: the last win rate, {win_rate:.2f} on {heldout_size} held-out prompts, is within "
        "two standard errors of chance (0.5): too few prompts (one response each, the reference's "
        "drawn with another seed) to show the update; tests/test_eva.py's loop learning test "
        "shows the loop learning"
    )


def nothing_learned(outcomes: collections.Counter, trained: int, args: Args) -> str | None:
    """The run's last line, printed after the loop, when no round had an item to train on:
    why, from outcomes (the training groups of the run, "groups"); None when one trained (or
    no round ran)."""
    if trained or not outcomes["groups"]:
        return None
    return (
        f"eva.py: no update in this run: none of {outcomes['groups']} training groups taught "
        "(group_teaches left every one out; official: a group teaches when the training "
        f"rewards, solver_reward, of its {args.n_samples} responses are not all equal)"
    )


# ---- main ----
def weights_only(models: dict) -> dict:
    """The models without their optimizers: every update starts from a fresh optimizer state, so
    checkpoints keep no moments."""
    return {name: (model, None) for name, (model, _) in models.items()}


def new_optimizer(policy, args: Args) -> torch.optim.Optimizer:
    """--optim for the policy, no weight decay (the official runs' adamw_torch; SPPO: rmsprop)."""
    if args.optim == "adamw":
        return torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    if args.optim == "rmsprop":
        return torch.optim.RMSprop(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    raise ValueError(f"--optim {args.optim}: new_optimizer knows adamw and rmsprop; add it there")


def load_models(args: Args, dist: Dist) -> tuple[dict, object, tuple]:
    """(models, tokenizer, reward model): one policy plays both roles, creator and solver, by its
    prompt, models = {"policy": (policy, optimizer)}; the reward model (load_reward_model) is
    frozen, and loaded before vLLM starts (start_sampler), which sizes its cache from the memory
    left."""
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    optimizer = new_optimizer(policy, args)
    models = {"policy": (policy, optimizer)}
    reward_model = load_reward_model(args, dist)
    return models, tokenizer, reward_model


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
    # the loss's official values, before the CPU scaling (which a flag you pass overrides)
    resolve(args)
    check_choices(args)  # flag values that cannot run stop here, at start
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS)
    splits, heldout = load_prompts(args)
    models, tokenizer, reward_model = load_models(args, dist)
    policy, optimizer = models["policy"]
    # the run's state: the round's prompts X_{t-1} (X_0: the first split), and the held-out
    # rewards of the reference policy theta_{t-1}
    start = 0
    state = {"prompts": splits[0], "reference_rewards": None}
    if args.resume:
        found = load_checkpoint(run_dir, weights_only(models), dist)
        if found is not None:
            start, state = found
    sampler = start_sampler(policy, tokenizer, args=args, dist=dist)
    # what solve and heldout_rewards sample and score with
    services = dict(sampler=sampler, tokenizer=tokenizer, reward_model=reward_model)
    if state["reference_rewards"] is None:  # step 0: theta_0's, the first round's reference
        key = f"{args.seed}/reference"
        rewards = heldout_rewards(**services, heldout=heldout, key=key, args=args, dist=dist)
        state["reference_rewards"] = rewards
        logger.log({"eval/reward": float(np.mean(rewards))}, step=0)

    last_win_rate = None
    outcomes = collections.Counter()  # this run's training groups ("groups")
    trained = 0  # this run's training items
    for iteration in range(start, args.iterations):
        step = iteration + 1  # iterations done
        metrics = {}
        rng = random.Random(f"{args.seed}/{iteration}")  # the same on every rank and after a resume
        # a plain round (the baseline round, --new-human-prompts) runs steps 1, 6 and 7 on a split
        eva_round = not (args.baseline_round and iteration == 0) and not args.new_human_prompts
        prompts = state["prompts"]
        if not eva_round:
            prompts = splits[min(iteration, len(splits) - 1)]

        # 1. solve X_{t-1}: N responses of theta_{t-1} to each prompt, scored by the reward model
        with logger.timer("solve"):
            key = f"{args.seed}/{iteration}/solve"
            groups = solve(
                **services, prompts=prompts, n=args.n_samples, key=key, args=args, dist=dist
            )
        train_groups = groups
        if eva_round:
            with logger.timer("creator"):
                # 2. estimate each prompt's informativeness from its N rewards
                info = [informativeness(group.rewards, args) for group in groups]
                # 3. sample the informative subset by info
                chosen = sample_subset(info, iteration, args)
                subset = [groups[i] for i in chosen]
                # 4. evolve the subset's prompts into X_t
                evolved = []
                if args.evolve:
                    evolved, records = evolve(
                        sampler=sampler,
                        tokenizer=tokenizer,
                        seeds=[group.prompt for group in subset],
                        known=prompts,
                        iteration=iteration,
                        args=args,
                        dist=dist,
                    )
                    metrics.update(record_evolutions(records, run_dir, dist))
            metrics.update(creator_metrics(info, chosen, evolved))
            if not args.evolve:
                train_groups = subset  # --no-evolve: the subset itself (Table 4's blue rows)

            # 5. solve X_t, then mix 20% of X_{t-1}'s groups with 80% of X_t's (no prompt evolved:
            # X_{t-1}'s groups alone, and the next round starts from X_{t-1} again)
            if evolved:
                with logger.timer("solve"):
                    key = f"{args.seed}/{iteration}/solve_evolved"
                    new_groups = solve(
                        **services, prompts=evolved, n=args.n_samples, key=key, args=args, dist=dist
                    )
                train_groups = mix(groups, new_groups, rng=rng, args=args)
                evolved_mean = float(np.mean(all_rewards(new_groups)))
                metrics["charts/evolved_reward_mean"] = evolved_mean
                state["prompts"] = evolved  # X_t: the next round's prompts (Algorithm 1)

        # 6. the --loss update from theta_{t-1} (a loss with a reference: theta_{t-1})
        with logger.timer("update"):
            items = training_items(train_groups, args)
            outcomes["groups"] += len(train_groups)
            trained += len(items)
            sampler.sleep()
            if items:
                stats = update(
                    policy=policy, optimizer=optimizer, items=items, rng=rng, args=args, dist=dist
                )
                metrics.update(stats)
            sampler.sync_weights(policy)

        # 7. evaluate theta_t against theta_{t-1} on the held-out prompts
        with logger.timer("eval"):
            key = f"{args.seed}/{iteration}/eval"
            rewards = heldout_rewards(**services, heldout=heldout, key=key, args=args, dist=dist)
            stats = evaluate(rewards, state["reference_rewards"])
            state["reference_rewards"] = rewards  # theta_t: the next round's reference
        metrics.update(stats)
        last_win_rate = stats["eval/win_rate"]
        charts = chart_metrics(
            prompts=prompts,
            groups=groups,
            train_groups=train_groups,
            items=items,
            eva_round=eva_round,
        )
        metrics.update(charts)
        logger.log(metrics, step=step)
        last = step == args.iterations
        if step % args.save_every == 0 or last:
            saved = weights_only(models)  # no optimizer moments (every update starts afresh)
            save_checkpoint(
                run_dir, iteration=step, models=saved, tokenizer=tokenizer, state=state, dist=dist
            )
    note = win_rate_note(last_win_rate, len(heldout))
    if dist.is_main and note:
        print(note)
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
