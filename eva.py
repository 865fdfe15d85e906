"""eva: Evolving Alignment via Asymmetric Self-Play (a creator that evolves prompts, a solver that learns from them).

Paper: Ye, Agarwal, Liu, Joshi, Velury, Le, Tan, Liu, "Evolving Alignment via Asymmetric Self-Play: Scalable Preference
Fine-Tuning Beyond Static Human Prompts", arXiv 2411.00062 (v3: "Scalable Reinforcement Post-Training Beyond Static
Human Prompts"; ICML 2025: "Reward-Guided Prompt Evolving in Reinforcement Learning for LLMs"). Official code:
github.com/ZIYU-DEEP/eva (read at d605e6f; this file copies none of it), built on TRL and distilabel's EvolInstruct.

Method. RLHF on a fixed prompt set stops where the prompts stop being informative. eva makes it an asymmetric game
played by ONE policy: the CREATOR finds the prompts the SOLVER can still learn from and evolves new ones like them;
the SOLVER learns from its own best and worst responses to them. Each round t (Algorithm 1):
  1. solver samples:   N = 6 responses per prompt of X_{t-1} (T 0.7, top-p 0.9), scored by a reward model r(x, y);
  2. estimate:         info(x) from the N rewards, a regret proxy (Table 2): A*_min = max r - min r (default),
                       A*_avg = max r - mean r, A*_dts = best - second best; ablations var, avg, 1/avg, 1/A*_min;
  3. sample subset:    25% of the prompts, without replacement, by min-max-normalised info (or greedily, stratified);
  4. evolve:           each sampled prompt grows a chain of 4 EvolInstruct mutations (4 in-depth rewrites, 1 in-breadth
                       creation, uniform; each mutates the last), by default by the policy: X_t (25% x 4 = |X_{t-1}|);
  5. solver step:      6 responses per evolved prompt, pairs (argmax r, argmin r); 20% of the old pairs and 80% of the
                       new ones; preference optimisation from the current policy with the current policy as reference.
Reference log-probs come from the policy before its update (no second copy held). Metrics: creator/*, charts/*,
losses/* (first and last step), eval/win_rate (the reward model's, of the new policy over the round's reference policy
on held-out prompts; step 0: the initial eval/reward); every evolution, kept or dropped, in <run>/evolutions.jsonl.

Run: `python eva.py` without a GPU (CPU_DEFAULTS: the embedded SmolLM2-135M is policy, creator and judge on
data/chat_prompts.jsonl; a round in minutes); `torchrun --nproc_per_node 8 eva.py` on 8xH200 (gemma-2-9b-it, ArmoRM-8B,
UltraFeedback's Snorkel split; `--evolver-url https://api.openai.com/v1` for the paper's GPT-4 creator, its key in
$OPENAI_API_KEY). Experiment map and the paper's benchmarks (on <run>/checkpoints/iter_XXXXXX/policy): README.md.

Each loss's flags left unset take its official run's values (resolve; eva released no SimPO, ORPO or RLOO run):
  loss   beta   lr    epochs optim   schedule max_length prompt source
  dpo    0.05   5e-7  2      adamw   cosine   2048       1024   scripts/gemma-2-9b-it-dpo, recipes/iterative-dpo
  ipo    0.6    5e-7  1      adamw   cosine   2048       1024   scripts/gemma-2-9b-it-ipo
  rpo    0.1    5e-7  2      adamw   cosine   2048       1024   scripts/gemma-2-9b-it-rpo-split-by-6
  sppo   0.001  5e-7  9      rmsprop linear   1024       512    scripts/gemma-9b, recipes/default
  simpo  10     8e-7  1      adamw   cosine   2048       1800   SimPO's gemma-2-9b-it recipe (princeton-nlp/SimPO)
  orpo   0.1    5e-7  2      adamw   cosine   2048       1024   ORPO's lambda (ORPO paper, TRL); the rest as dpo
  rloo   -      1e-6  1      adamw   cosine   2048       1024   [RECON] TRL RLOOConfig's lr, one on-policy pass

Deviations (where the paper is silent this file follows the official code):
  1. Empty, failed, marker-leaking, unchanged or duplicate evolutions are dropped (the official code keeps them all).
  2. The creator is the policy unless --evolver-url (official: gpt-4-0125-preview); EvolInstruct's templates reworded.
  3. A prompt whose N rewards all agree gives no pair (official: chosen = rejected); the 20/80 mix counts it still.
  4. The reward model scores one conversation per forward (official: six padded ones, no attention mask).
  5. No reward_loo metric (always 0 officially); inv_* weights are 1 - normalised; equal values weigh uniformly.
  6. Continual rounds evolve the last evolved set (Algorithm 1); the official scripts ran one eva round per split.
  7. SPPO's win probabilities come from the reward model's scores (Bradley-Terry), not from PairRM (official SPPO).
  8. RLOO (v3 only, not in the official code) [RECON]: leave-one-out baselines, a clipped sequence ratio, no KL.
  9. Sampling is seeded per chunk of prompts, so runs agree on any number of ranks and after a resume.
 10. The held-out reward-model win rate is this file's addition; the paper's benchmarks are in README.md.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
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
import urllib.request
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import tyro
import wandb
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm.auto import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          TemperatureLogitsWarper, TopPLogitsWarper)


@dataclass
class Args:
    # run and logging
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is <output_dir>/<exp_name>__<seed> unless --run-name)"""
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
    """policy (solver and creator): a Hugging Face id, a local path, or embedded:smollm2 (the CPU default)"""
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
    """classifier: the model's scalar score; judge: the expected 1-9 rating from the probabilities of the digits"""
    trust_remote_code: bool = True
    """let the reward model run its own modelling code (ArmoRM needs it)"""

    # data
    dataset: str = "snorkelai/Snorkel-Mistral-PairRM-DPO-Dataset"
    """UltraFeedback prompts (the official split: its 3 train iterations, shuffled with seed 8964), or a .jsonl"""
    num_splits: int = 6
    """the prompts are cut into this many parts, one per plain-DPO round (official: 6, ~10k each)"""
    num_prompts: int | None = None
    """use only the first N prompts of each part"""
    heldout_size: int = 500
    """held-out prompts for the win-rate evaluation (the test iterations, split the same way)"""

    # creator
    evolve: bool = True
    """evolve the informative subset (--no-evolve: train on the subset itself, Table 4's blue rows)"""
    info_metric: Literal["a_min", "a_avg", "a_dts", "var", "avg", "inv_avg", "inv_a_min", "uniform"] = "a_min"
    """informativeness of a prompt from its rewards (Tables 2-3): A*_min = max - min is eva's default"""
    sampling: Literal["weighted", "greedy", "stratified"] = "weighted"
    """subset: weighted without replacement (eva-sample), the top ones (eva-greedy), or weighted within quantile bins"""
    evolve_fraction: float = 0.25
    """share of the prompts sampled into the informative subset (official SAMPLE_FRAC)"""
    stratified_bins: int = 10
    """quantile bins of --sampling stratified"""
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
    """rounds to run: a plain-DPO round first (unless --no-baseline-round), then eva's; 0: evaluate the given model"""
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
    """round 1: the official plain iterative-DPO round on split 1 (iterate.sh, ITER=0)"""
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
    """share of the old prompts' pairs in the training mix (official RATIO_BASE)"""
    new_pair_ratio: float = 0.8
    """share of the evolved prompts' pairs (official RATIO_EVOL)"""
    loss: Literal["dpo", "ipo", "rpo", "sppo", "simpo", "orpo", "rloo"] = "dpo"
    """preference loss (Table 1 and the official scripts), or the v3 online RLOO"""
    beta: float | None = None
    """beta of the loss (SPPO: 1/eta; ORPO: lambda); default the loss's official value (eva.py's docstring table)"""
    rpo_alpha: float = 1.0
    """RPO: weight of the chosen response's NLL"""
    rpo_penalize_length_nll: bool = True
    """RPO: the chosen mean token NLL divided again by its token count (official); --no-...: the RPO paper's"""
    simpo_gamma_beta_ratio: float = 0.5
    """SimPO: target margin gamma / beta"""
    rloo_clip: float = 0.2
    """RLOO: clip of the sequence-level probability ratio"""
    epochs: int | None = None
    """epochs over the round's pairs; default the loss's official number"""
    optim: Literal["adamw", "rmsprop"] | None = None
    """optimizer, fresh every round; default the loss's official one (adamw_torch; SPPO: rmsprop)"""
    micro_batch_size: int = 1
    """pairs per forward/backward pass on each rank"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    max_length: int | None = None
    """training: longest prompt + response, in tokens; default the loss's official value"""
    max_prompt_length: int | None = None
    """training: an over-long pair's prompt is cut to its last this many tokens; default the loss's official value"""


# Without CUDA the paper's sizes would take weeks. One eva round (8 prompts x 6 responses, 2 seeds x 4 evolutions, 6
# more responses each, 4 DPO steps, 6 held-out prompts): ~4 min of CPU time (21 min wall at a load of 10 on 2 cores).
CPU_DEFAULTS = dict(model="embedded:smollm2", reward_model="embedded:smollm2", reward_kind="judge",
                    dataset="data/chat_prompts.jsonl", num_prompts=8, heldout_size=6, iterations=1,
                    baseline_round=False, max_new_tokens=40, evolve_max_new_tokens=64, max_model_len=1024,
                    learning_rate=1e-5, batch_size=4, micro_batch_size=2, max_length=384, max_prompt_length=256)

# The official runs' values (docstring table) for the flags a loss leaves unset (None): DPO's, then each loss's own.
OFFICIAL = {
    "dpo": dict(beta=0.05, learning_rate=5e-7, epochs=2, optim="adamw", lr_schedule="cosine", max_length=2048,
                max_prompt_length=1024),
    "ipo": dict(beta=0.6, epochs=1), "rpo": dict(beta=0.1), "orpo": dict(beta=0.1),
    "sppo": dict(beta=1e-3, epochs=9, optim="rmsprop", lr_schedule="linear", max_length=1024, max_prompt_length=512),
    "simpo": dict(beta=10.0, learning_rate=8e-7, epochs=1, max_prompt_length=1800),
    "rloo": dict(beta=None, learning_rate=1e-6, epochs=1)}


def resolve(args: Args) -> Args:  # each flag of OFFICIAL left unset (None) takes its official value for --loss
    vars(args).update({k: v for k, v in (OFFICIAL["dpo"] | OFFICIAL[args.loss]).items() if getattr(args, k) is None})
    return args


# ---- prompts ----
# The creator's mutations, our words after distilabel's EvolInstruct templates (WizardLM; deviation 2): an in-depth
# REWRITE wrapper with one method clause and an in-breadth CREATE one, one user turn each; the reply follows "Prompt#:".
REWRITE_PROMPT = """You are rewriting a prompt for a chat assistant. Make the #Given Prompt# somewhat harder, so that \
even strong AI assistants have to work for a good answer, while a person can still read it and reply sensibly.
How to make it harder: <METHOD>
Keep every non-text part of the #Given Prompt# (tables, code, quoted input) and keep its input. Stay brief: add no \
more than 10 to 20 words.
Do not write '#Given Prompt#', '#Rewritten Prompt#', 'given prompt' or 'rewritten prompt' in your answer.
#Given Prompt#:
<PROMPT>
#Rewritten Prompt#:
"""
CREATE_PROMPT = """You are writing a new prompt for a chat assistant. Take inspiration from the #Given Prompt# and \
write a brand-new prompt in the same domain but on a rarer topic, about as long and as hard. A person must be able to \
read it and reply sensibly.
Do not write '#Given Prompt#', '#New Prompt#', 'given prompt' or 'new prompt' in your answer.
#Given Prompt#:
<PROMPT>
#New Prompt#:
"""
MUTATIONS = {  # four in-depth rewrites and one in-breadth creation, drawn uniformly (distilabel's np.random.choice)
    "constraints": REWRITE_PROMPT.replace("<METHOD>", "add one more constraint or requirement to it."),
    "deepening": REWRITE_PROMPT.replace("<METHOD>", "if it asks about some issue, widen and deepen that inquiry."),
    "concretizing": REWRITE_PROMPT.replace("<METHOD>", "replace general concepts with more specific ones."),
    "reasoning": REWRITE_PROMPT.replace(
        "<METHOD>", "if a few simple thoughts would answer it, make it ask explicitly for reasoning in several steps."),
    "breadth": CREATE_PROMPT,
}
MARKERS = ("#given prompt#", "#rewritten prompt#", "#new prompt#")  # the templates' own: a reply holding one failed

# The LLM judge (--reward-kind judge, the CPU default): the reward is the expected digit under its next-token
# probabilities of "1".."9", not a parsed reply.
JUDGE_PROMPT = """Rate the assistant's reply to the user's request: is it helpful, correct, complete and clearly \
written? Answer with a single digit from 1 (useless) to 9 (excellent).

[User request]
{prompt}

[Assistant reply]
{response}

Rating (1-9):"""


# ---- data ----
def load_prompts(args: Args) -> tuple[list[list[str]], list[str]]:
    """(the training prompts in num_splits parts, the held-out prompts). UltraFeedback as the official shuffle_ds.py
    makes it: Snorkel's train_iteration_{1,2,3} (and test_iteration_*) concatenated, shuffled with seed 8964, cut in 6;
    held out: the first heldout_size of test part 1. A .jsonl (data/chat_prompts.jsonl, written for this project):
    rows {"prompt", "split": "train" | "heldout"}."""
    if args.dataset.endswith(".jsonl"):
        rows = [json.loads(line) for line in pathlib.Path(args.dataset).read_text().splitlines() if line.strip()]
        train, test = ([r["prompt"] for r in rows if r.get("split", "train") == s] for s in ("train", "heldout"))
        random.Random(8964).shuffle(train)
    else:
        from datasets import concatenate_datasets, load_dataset

        raw = load_dataset(args.dataset)
        train, test = (list(concatenate_datasets([raw[f"{s}_iteration_{i}"] for i in (1, 2, 3)]).shuffle(seed=8964)[
            "prompt"]) for s in ("train", "test"))
        test = test[: len(test) // args.num_splits]
    size = len(train) // args.num_splits  # the last part takes the rest, as the official split
    parts = [train[i * size : (i + 1) * size if i < args.num_splits - 1 else None] for i in range(args.num_splits)]
    return [p[: args.num_prompts] for p in parts], test[: args.heldout_size]


# ---- rewards ----
def load_reward_model(args: Args, dist: Dist) -> tuple:
    """r(x, y), frozen: a full bf16 copy on every GPU (ArmoRM-8B: 16 GB of an H200's 141; no FSDP, so ranks score
    their shares independently)."""
    name, dtype = resolve_model(args.reward_model), torch.bfloat16 if dist.device.type == "cuda" else torch.float32
    auto, extra = ((AutoModelForSequenceClassification, {"trust_remote_code": args.trust_remote_code})
                   if args.reward_kind == "classifier" else (AutoModelForCausalLM, {}))
    model = auto.from_pretrained(name, dtype=dtype, **extra)
    return model.to(dist.device).eval().requires_grad_(False), AutoTokenizer.from_pretrained(name)


@torch.no_grad()
def score_responses(reward_model: tuple, prompt: str, responses: list[str], kind: str) -> list[float]:
    """r(x, y) for each response, one conversation per forward (deviation 4): a classifier's scalar (ArmoRM: `score`),
    or a judge's expected rating sum_d d p(d) / sum_d p(d) over its next-token probabilities of the digits 1-9."""
    model, tokenizer = reward_model
    scores = []
    for response in responses:
        if kind == "classifier":
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            ids = tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
            out = model(input_ids=ids.to(model.device))
            scores.append(float((out.score if getattr(out, "score", None) is not None else out.logits[:, 0]).float()))
        else:
            judge_prompt = JUDGE_PROMPT.format(prompt=prompt, response=response)
            ids = encode_prompt(tokenizer, chat_prompt(tokenizer, judge_prompt))
            digits = [tokenizer.encode(str(d), add_special_tokens=False)[-1] for d in range(1, 10)]
            p = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1, digits].float().softmax(-1)
            scores.append(float((p * torch.arange(1, 10, device=p.device)).sum()))
    return scores


def informativeness(rewards: list[float], metric: str) -> float:
    """info(x) from the rewards of x's N responses (Tables 2-3; official columns of src/reward_hf.py). The inv_*
    metrics return the value they invert (sampling_weights inverts)."""
    r = sorted(rewards)
    return {"a_min": r[-1] - r[0],  # A*_min: best minus worst, the minimax-regret proxy (reward_gap, eva's default)
            "a_avg": r[-1] - float(np.mean(r)),  # A*_avg: best minus average (reward_maxmean)
            "a_dts": r[-1] - r[-2],  # A*_dts: best minus second best, dueling (reward_dts)
            "var": float(np.var(r)), "avg": float(np.mean(r)), "inv_avg": float(np.mean(r)),
            "inv_a_min": r[-1] - r[0], "uniform": 1.0}[metric]


def sampling_weights(values: list[float], metric: str) -> np.ndarray:
    """Official adaptive_sample: min-max normalise over the prompt set and divide by the sum (the least informative
    prompt gets weight 0); inv_*: 1 - normalised (reward_mean_inv; 1/x fails on negative rewards); uniform when all
    values agree (the official normalisation divides by 0)."""
    v = np.asarray(values, dtype=float)
    if metric == "uniform" or v.max() == v.min():
        return np.full(len(v), 1.0 / len(v))
    v = (v - v.min()) / (v.max() - v.min())
    v = 1.0 - v if metric.startswith("inv_") else v
    return v / v.sum()


def sample_informative(values: list[float], weights: np.ndarray, fraction: float, method: str,
                       rng: np.random.Generator, bins: int = 10) -> list[int]:
    """Indices of the informative subset, int(fraction * #prompts) of them: `weighted` draws without replacement with
    probabilities `weights` (pandas' df.sample); `greedy` takes the highest weights (Table 4's -greedy); `stratified`
    draws round(fraction * size) by weight in each of `bins` quantile bins of the values (pd.qcut, edges deduped)."""
    def draw(w: np.ndarray, k: int) -> list[int]:  # successive draws; then uniform among zero weights (pandas raises)
        positive, k = np.flatnonzero(w > 0), min(k, len(w))
        if k <= 0:
            return []
        if len(positive) >= k:
            return rng.choice(len(w), size=k, replace=False, p=w / w.sum()).tolist()
        return positive.tolist() + rng.permutation(np.flatnonzero(w <= 0))[: k - len(positive)].tolist()

    w = np.asarray(weights, dtype=float)
    if method == "greedy":
        return sorted(sorted(range(len(w)), key=lambda i: -w[i])[: int(len(w) * fraction)])
    if method == "weighted":
        return sorted(draw(w, int(len(w) * fraction)))
    edges = np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)))
    strata = np.searchsorted(edges[1:-1], values, side="left")  # bins (e_i, e_i+1], the lowest closed
    return sorted(int(m[j]) for s in np.unique(strata) for m in [np.flatnonzero(strata == s)]
                  for j in draw(w[m], round(fraction * len(m))))


def win_probability(rewards: list[float], i: int) -> float:
    """SPPO's P(y_i beats the policy): the mean over all N j (itself: 1/2) of sigmoid(r_i - r_j) (compute_prob.py)."""
    return float(np.mean([1.0 / (1.0 + math.exp(r - rewards[i])) for r in rewards]))


def rloo_advantage(reward: float, rewards: list[float]) -> float:
    """REINFORCE leave-one-out: a response's reward minus the mean reward of the other N - 1 responses of its prompt."""
    return reward - (sum(rewards) - reward) / (len(rewards) - 1)


def win_rate(rewards: list[float], reference: list[float]) -> float:
    """Share of prompts where the new policy's response outscores the reference policy's; a tie counts 1/2."""
    return float(np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(rewards, reference)]))


# ---- losses ----
# On sequence log-probs: pi_* under the policy, ref_* under the round's start policy (the reference), n_* token counts.
def dpo_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (official loss_type sigmoid): -log sigmoid(beta h), h = (pi_w - ref_w) - (pi_l - ref_l)."""
    return -F.logsigmoid(beta * h)


def ipo_loss(h_mean: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO: (h - 1/(2 beta))^2, on per-token mean log-probs (the official trainer's 'FIX for IPO')."""
    return (h_mean - 1.0 / (2.0 * beta)) ** 2


def rpo_loss(h: torch.Tensor, nll_chosen: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
    """RPO: DPO plus alpha times the chosen response's NLL (its mean token NLL; officially divided by its length)."""
    return dpo_loss(h, beta) + alpha * nll_chosen


def sppo_loss(logratio_w: torch.Tensor, logratio_l: torch.Tensor, p_w: torch.Tensor, p_l: torch.Tensor, beta: float):
    """SPPO (eta = 1/beta): each response's log-ratio regressed on (P(win) - 1/2) / beta, averaged over the two."""
    return ((logratio_w - (p_w - 0.5) / beta) ** 2 + (logratio_l - (p_l - 0.5) / beta) ** 2) / 2


def simpo_loss(mean_w: torch.Tensor, mean_l: torch.Tensor, beta: float, gamma_beta_ratio: float) -> torch.Tensor:
    """SimPO: -log sigmoid(beta (mean_w - mean_l - gamma/beta)) on per-token mean log-probs; no reference."""
    return -F.logsigmoid(beta * (mean_w - mean_l - gamma_beta_ratio))


def orpo_loss(mean_w: torch.Tensor, mean_l: torch.Tensor, lam: float) -> torch.Tensor:
    """ORPO: the chosen mean token NLL minus lambda log sigmoid(log odds_w - log odds_l), odds = p / (1 - p) of the
    mean token probability p = exp(mean log-prob); no reference."""
    def log_odds(m):  # log p - log(1 - p), with log(1 - e^m) = log(-expm1(m)) stable for m < 0
        return m - torch.log(-torch.expm1(m.clamp(max=-1e-6)))
    return -mean_w - lam * F.logsigmoid(log_odds(mean_w) - log_odds(mean_l))


def rloo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """RLOO [RECON]: -min(rho A, clip(rho, 1 - eps, 1 + eps) A), rho = pi / pi_old (sequence); at 1: REINFORCE."""
    rho = torch.exp(logp - old_logp)
    return -torch.min(rho * advantages, rho.clamp(1 - clip, 1 + clip) * advantages)


def pair_losses(loss: str, pi: torch.Tensor, ref: torch.Tensor, n: torch.Tensor, p: torch.Tensor, args: Args):
    """The per-pair loss of `loss`; rows 0 and 1 of pi, ref, n, p are the chosen and the rejected responses."""
    h, mean = (pi[0] - ref[0]) - (pi[1] - ref[1]), pi / n
    return {"dpo": lambda: dpo_loss(h, args.beta),
            "ipo": lambda: ipo_loss((pi[0] - ref[0]) / n[0] - (pi[1] - ref[1]) / n[1], args.beta),
            "rpo": lambda: rpo_loss(h, -mean[0] / (n[0] if args.rpo_penalize_length_nll else 1), args.beta,
                                    args.rpo_alpha),
            "sppo": lambda: sppo_loss(pi[0] - ref[0], pi[1] - ref[1], p[0], p[1], args.beta),
            "simpo": lambda: simpo_loss(mean[0], mean[1], args.beta, args.simpo_gamma_beta_ratio),
            "orpo": lambda: orpo_loss(mean[0], mean[1], args.beta)}[loss]()


# ---- phases ----
Group = collections.namedtuple("Group", "prompt samples rewards")  # a prompt, the solver's N responses, their rewards
Pair = collections.namedtuple("Pair", "samples rewards win_probs")  # (argmax, argmin) of a group's rewards
# RLOO: one response, its reward and its Group, whose rewards give the leave-one-out baseline where it trains
Rollout = collections.namedtuple("Rollout", "sample reward group")


def solve(prompts: list[str], n: int, key: str, sampler, tokenizer, reward_model, args: Args, dist: Dist) -> list:
    """Algorithm 1, 'self-generate responses' and 'annotate rewards': n responses per prompt (one user turn; official
    src/generate.py) scored by r(x, y) (src/reward_hf.py), each chunk by the rank that sampled it: Groups."""
    return sample(sampler, [chat_prompt(tokenizer, p) for p in prompts], n, key, dist, lambda start, rows: [
        Group(p, ss, score_responses(reward_model, p, [s.text for s in ss], args.reward_kind))
        for p, ss in zip(prompts[start:], rows)], temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, logprobs=False)  # the losses take their own log-probs


def ask_endpoint(prompt: str, args: Args) -> tuple[str, str]:
    """(text, finish reason) of one chat completion from --evolver-url; a failed request is ("<error>", "error")."""
    body = json.dumps({"model": args.evolver_model, "messages": [{"role": "user", "content": prompt}],
                       "temperature": args.evolve_temperature, "max_tokens": args.evolve_max_new_tokens}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {os.environ.get(args.evolver_key_env)}"}
    for attempt in range(3):
        try:
            request = urllib.request.Request(args.evolver_url.rstrip("/") + "/chat/completions", body, headers)
            with urllib.request.urlopen(request, timeout=args.evolver_timeout) as response:
                choice = json.load(response)["choices"][0]
            return choice["message"]["content"] or "", choice.get("finish_reason") or "stop"
        except Exception as e:  # rate limits, timeouts, malformed replies: try again, then give up on this prompt
            error = f"{type(e).__name__}: {e}"
            time.sleep(2**attempt)
    return error, "error"


def ask_creator(prompts: list[str], key: str, sampler, tokenizer, args: Args, dist: Dist) -> list[tuple[str, str]]:
    """The creator's reply (text, finish reason) to each mutation prompt: the policy itself, or --evolver-url."""
    if args.evolver_url:
        def call(mine):
            with concurrent.futures.ThreadPoolExecutor(args.evolver_workers) as pool:
                return list(pool.map(lambda p: ask_endpoint(p, args), mine))
        return map_sharded(call, prompts, dist)
    out = sample(sampler, [chat_prompt(tokenizer, p) for p in prompts], 1, key, dist,
                 temperature=args.evolve_temperature, max_new_tokens=args.evolve_max_new_tokens, logprobs=False)
    return [(s[0].text, s[0].finish_reason) for s in out]


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def read_evolution(text: str, finish_reason: str, parent: str, seen: set[str]) -> tuple[str | None, str]:
    """(the evolved prompt or None, the reason): distilabel keeps the text after the last "Prompt#:"; we drop an
    empty or failed reply, one holding the template's markers, repeating its parent or known (truncated ones stay)."""
    new = text.split("Prompt#:")[-1].strip().strip('"').strip()
    dropped = ("failed" if finish_reason in ("abort", "error") else "empty" if not new else
               "marker" if any(m in new.lower() for m in MARKERS) else
               "unchanged" if normalise(new) == normalise(parent) else "duplicate" if normalise(new) in seen else "")
    return (None, dropped) if dropped else (new, "truncated" if finish_reason == "length" else "")


def evolve(seeds: list[str], known: list[str], iteration: int, sampler, tokenizer, args: Args, dist: Dist) -> tuple:
    """Creator step 'self-evolve prompts' (official evolve_prompt.py: distilabel's EvolInstruct, store_evolutions): a
    chain of num_evolutions uniform MUTATIONS per seed, each of the last kept prompt. Returns (new prompts, records)."""
    rng = random.Random(f"{args.seed}/{iteration}/mutations")  # the same draws on every rank and after a resume
    chains, seen, evolved, records = list(seeds), {normalise(p) for p in known}, [], []
    for step in range(args.num_evolutions):
        names = [rng.choice(list(MUTATIONS)) for _ in chains]
        replies = ask_creator([MUTATIONS[m].replace("<PROMPT>", c) for m, c in zip(names, chains)],
                              f"{args.seed}/{iteration}/evolve/{step}", sampler, tokenizer, args, dist)
        for i, (name, (text, finish)) in enumerate(zip(names, replies)):
            new, reason = read_evolution(text, finish, chains[i], seen)
            records.append({"round": iteration, "seed": i, "step": step, "mutation": name, "parent": chains[i],
                            "reply": text, "finish_reason": finish, "kept": new is not None, "reason": reason})
            if new is not None:
                chains[i] = new
                seen.add(normalise(new))
                evolved.append(new)
    return evolved, records


def mix(old: list, new: list, args: Args, rng: random.Random) -> list:
    """Official src/snippets/combine_ds.py: int(old_pair_ratio |old|) of the old and int(new_pair_ratio |new|) of
    the new, each drawn after a shuffle, then shuffled together."""
    both = rng.sample(old, int(len(old) * args.old_pair_ratio)) + rng.sample(new, int(len(new) * args.new_pair_ratio))
    rng.shuffle(both)
    return both


def training_items(groups: list[Group], args: Args) -> list[Pair | Rollout]:
    """Pairs (argmax, argmin of the rewards; official reward_hf.py) or, for RLOO, every response as a Rollout; a
    group whose rewards all agree teaches nothing and is skipped. Cut as the official tokenize_row: only when the
    prompt + the longer response exceed max_length, the prompt to its last max_prompt_length tokens, then, if still
    too long, the responses to max_length - max_prompt_length (a rollout: alone)."""
    def fit(samples: list[Sample]) -> list[Sample]:
        prompt, longest = samples[0].prompt_ids, max(len(s.token_ids) for s in samples)
        prompt = prompt[-args.max_prompt_length :] if len(prompt) + longest > args.max_length else prompt
        cut = args.max_length - args.max_prompt_length if len(prompt) + longest > args.max_length else None
        return [s._replace(prompt_ids=prompt, token_ids=s.token_ids[:cut], logprobs=[]) for s in samples]

    items = []
    for g in [g for g in groups if max(g.rewards) > min(g.rewards)]:
        if args.loss == "rloo":
            items += [Rollout(fit([s])[0], r, g) for s, r in zip(g.samples, g.rewards)]
        else:
            w, l = int(np.argmax(g.rewards)), int(np.argmin(g.rewards))
            items.append(Pair(fit([g.samples[w], g.samples[l]]), [g.rewards[w], g.rewards[l]],
                              [win_probability(g.rewards, w), win_probability(g.rewards, l)]))
    return items


def sequences(item: Pair | Rollout) -> list[Sample]:  # a pair's chosen and rejected, or a rollout's one
    return item.samples if isinstance(item, Pair) else [item.sample]


def distribution(args: Args) -> tuple:  # log pi's (T, top-p): the sampler's for RLOO (TRL: T alone), T = 1 for pairs
    return (args.temperature, args.top_p) if args.loss == "rloo" else (1.0, 1.0)


@torch.no_grad()
def sequence_logprobs(policy, samples: list[Sample], args: Args, dist: Dist) -> list[float]:
    """log pi(y | x) of each sample, summed over its tokens (under distribution()); as many micro-batches a rank."""
    mine = []
    for batch, real in micro_batches(list(enumerate(samples)), 2 * args.micro_batch_size, dist,
                                     length=lambda x: len(x[1].prompt_ids) + len(x[1].token_ids)):
        logp, mask, _ = token_logprobs(policy, [s for _, s in batch], *distribution(args))
        mine += [(i, v) for (i, _), v in zip(batch, (logp * mask).sum(1).tolist())] if real else []
    found = dict(kv for part in all_gather_objects(mine, dist) for kv in part)
    return [found[i] for i in range(len(samples))]


def item_losses(policy, items: list[tuple], args: Args, size: int) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro-batch of (item, its reference log-probs): its part of the loss's mean over `size` items (one forward,
    every chosen then every rejected, as TRL's concatenated forward) and of the margin beta h, accuracy, log-probs."""
    k = len(sequences(items[0][0]))
    logp, mask, _ = token_logprobs(policy, [sequences(item)[j] for j in range(k) for item, _ in items],
                                   *distribution(args))
    pi, n = (logp * mask).sum(1).view(k, -1), mask.sum(1).clamp(min=1).view(k, -1)
    ref = pi.new_tensor([r for _, r in items]).T
    if args.loss == "rloo":
        advantages = pi.new_tensor([rloo_advantage(item.reward, item.group.rewards) for item, _ in items])
        losses = rloo_loss(pi[0], ref[0], advantages, args.rloo_clip)
        return losses.sum() / size, {"ratio": torch.exp(pi[0] - ref[0]).sum().item() / size}
    losses = pair_losses(args.loss, pi, ref, n, pi.new_tensor([item.win_probs for item, _ in items]).T, args)
    h = ((pi[0] - ref[0]) - (pi[1] - ref[1])).detach()
    return losses.sum() / size, {"margin": args.beta * h.sum().item() / size, "accuracy": (h > 0).sum().item() / size,
                                 "logp_chosen": pi[0].sum().item() / size, "logp_rejected": pi[1].sum().item() / size}


def update(policy, optimizer, items: list, args: Args, dist: Dist, rng: random.Random) -> dict[str, float]:
    """Solver step 'preference optimization' as one fresh trainer run (the official pipeline starts TRL anew each
    round): reference log-probs of every sequence under the policy as it starts, a fresh optimizer state, `epochs`
    passes over the shuffled items in batches of batch_size, warm-up then --lr-schedule; each rank its share."""
    refs = iter(sequence_logprobs(policy, [s for item in items for s in sequences(item)], args, dist))
    items = [(item, [next(refs) for _ in sequences(item)]) for item in items]
    optimizer.state.clear()
    per_epoch = -(-len(items) // args.batch_size)
    total, history = args.epochs * per_epoch, []
    warmup = math.ceil(total * args.warmup_ratio) if args.warmup_steps is None else args.warmup_steps
    for step in range(total):
        if step % per_epoch == 0:
            order = rng.sample(items, len(items))
        batch = order[(step % per_epoch) * args.batch_size : (step % per_epoch + 1) * args.batch_size]
        history.append(train_step(policy, optimizer, batch, lambda micro: item_losses(policy, micro, args, len(batch)),
                                  args.micro_batch_size, args.max_grad_norm, dist,
                                  length=lambda x: max(len(s.prompt_ids) + len(s.token_ids) for s in sequences(x[0])),
                                  lr=lr_at(step, total, args.learning_rate, warmup, args.lr_schedule)))
    metrics = {f"losses/{k}": float(np.mean([h[k] for h in history])) for k in history[0]}
    metrics |= {f"losses/{k}_{end}": history[i][k] for k in ("loss", "margin") if k in history[0]
                for end, i in (("first", 0), ("last", -1))}  # where the round's training started and ended
    return metrics | {"losses/steps": float(total)}


# ---- evaluation ----
def evaluate(sampler, tokenizer, reward_model, heldout: list[str], reference: list[float], key: str, args: Args,
             dist: Dist) -> tuple[dict, list]:
    """The reward model's win rate of the policy over the one before the update on held-out prompts, one response each
    as the solver samples. Returns (metrics, this policy's rewards: the next round's reference)."""
    rewards = [g.rewards[0] for g in solve(heldout, 1, key, sampler, tokenizer, reward_model, args, dist)]
    return {"eval/win_rate": win_rate(rewards, reference), "eval/reward": float(np.mean(rewards)),
            "eval/reference_reward": float(np.mean(reference))}, rewards


# ---- main ----
def weights_only(models: dict) -> dict:  # every update starts from a fresh Adam state: checkpoints keep no moments
    return {name: (model, None) for name, (model, _) in models.items()}


def main(args: Args) -> None:
    resolve(args)  # the loss's official values, before the CPU scaling (which a flag overrides)
    dist, run_dir, logger = start_run(args, CPU_DEFAULTS, sys.argv[1:])
    splits, heldout = load_prompts(args)

    # one policy plays both roles, creator and solver, by prompt; the reward model is frozen
    tokenizer = load_tokenizer(args.model)
    policy = load_model(args.model, dist, gradient_checkpointing=args.gradient_checkpointing)
    optimizer = (torch.optim.AdamW if args.optim == "adamw" else torch.optim.RMSprop)(
        policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    models = weights_only({"policy": (policy, optimizer)})
    reward_model = load_reward_model(args, dist)  # before vLLM, which sizes its cache from the memory left
    # run state: the round's prompts X_{t-1} (X_0: the first split), the reference policy's held-out rewards
    start, state = 0, {"prompts": splits[0], "reference_rewards": None}
    if args.resume and (found := load_checkpoint(run_dir, models, dist)) is not None:
        start, state = found
    sampler = Sampler(args.model, policy, tokenizer, dist, args.backend, args.max_model_len,
                      args.gpu_memory_utilization, args.vllm_sleep, seed=args.seed)
    if state["reference_rewards"] is None:  # theta_0's held-out rewards: the first round's reference
        state["reference_rewards"] = [g.rewards[0] for g in solve(heldout, 1, f"{args.seed}/reference", sampler,
                                                                  tokenizer, reward_model, args, dist)]
        logger.log({"eval/reward": float(np.mean(state["reference_rewards"]))}, step=0)

    for iteration in range(start, args.iterations):
        metrics, rng = {}, random.Random(f"{args.seed}/{iteration}")  # the same on every rank and after a resume
        eva_round = not (args.baseline_round and iteration == 0) and not args.new_human_prompts
        prompts = state["prompts"] if eva_round else splits[min(iteration, len(splits) - 1)]
        with logger.timer("solve"):  # responses of theta_{t-1} to X_{t-1}, and their rewards
            groups = solve(prompts, args.n_samples, f"{args.seed}/{iteration}/solve", sampler, tokenizer,
                           reward_model, args, dist)
        train_groups, evolved = groups, []
        if eva_round:
            with logger.timer("creator"):  # creator step: estimate informativeness, sample a subset, evolve it
                info = [informativeness(g.rewards, args.info_metric) for g in groups]
                generator = np.random.default_rng(zlib.crc32(f"{args.seed}/{iteration}".encode()))
                chosen = sample_informative(info, sampling_weights(info, args.info_metric), args.evolve_fraction,
                                            args.sampling, generator, args.stratified_bins)
                subset = [groups[i] for i in chosen]
                if args.evolve:
                    evolved, records = evolve([g.prompt for g in subset], prompts, iteration, sampler, tokenizer,
                                              args, dist)
                    if dist.is_main:
                        with open(run_dir / "evolutions.jsonl", "a") as f:
                            f.writelines(json.dumps(r) + "\n" for r in records)
                    reasons = collections.Counter(r["reason"] or "kept" for r in records)
                    metrics |= {f"creator/{k}": float(v) for k, v in reasons.items()}
            metrics |= {"creator/info_mean": float(np.mean(info)), "creator/subset": float(len(subset)),
                        "creator/subset_info_mean": float(np.mean([info[i] for i in chosen] or [0.0])),
                        "creator/evolved": float(len(evolved))}
            train_groups = groups if args.evolve else subset  # --no-evolve: the subset itself (Table 4's blue rows)
            if evolved:  # the solver on X_t, then 20% of the old groups with 80% of the new
                with logger.timer("solve"):
                    new_groups = solve(evolved, args.n_samples, f"{args.seed}/{iteration}/solve_evolved", sampler,
                                       tokenizer, reward_model, args, dist)
                train_groups = mix(groups, new_groups, args, rng)
                metrics |= {"charts/evolved_reward_mean": float(np.mean([r for g in new_groups for r in g.rewards]))}
                state["prompts"] = evolved  # X_t: the next round's prompts (Algorithm 1)

        with logger.timer("update"):  # solver step: preference optimisation from theta_{t-1}, reference theta_{t-1}
            items = training_items(train_groups, args)
            sampler.sleep()
            metrics |= update(policy, optimizer, items, args, dist, rng) if items else {}
            sampler.sync_weights(policy)
        with logger.timer("eval"):
            stats, state["reference_rewards"] = evaluate(sampler, tokenizer, reward_model, heldout,
                                                         state["reference_rewards"], f"{args.seed}/{iteration}/eval",
                                                         args, dist)
        pairs = [item for item in items if isinstance(item, Pair)]
        metrics |= stats | {
            "charts/prompts": float(len(prompts)), "charts/eva_round": float(eva_round),
            "charts/reward_mean": float(np.mean([r for g in groups for r in g.rewards])),
            "charts/train_groups": float(len(train_groups)), "charts/train_items": float(len(items)),
            "charts/rm_margin": float(np.mean([p.rewards[0] - p.rewards[1] for p in pairs] or [0.0])),
            "charts/generated_tokens": float(sum(len(s.token_ids) for g in groups for s in g.samples)),
            "charts/response_tokens": float(np.mean([len(s.token_ids) for g in groups for s in g.samples]))}
        step = iteration + 1
        logger.log(metrics, step=step)
        if step % args.save_every == 0 or step == args.iterations:
            save_checkpoint(run_dir, step, models, tokenizer, state, dist)
    if dist.is_main and start < args.iterations and abs(stats["eval/win_rate"] - 0.5) <= len(heldout) ** -0.5:
        print(f"eva.py: the last win rate, {stats['eval/win_rate']:.2f} on {len(heldout)} held-out prompts, is within "
              "two standard errors of chance (0.5): too few prompts (one response each, the reference's drawn with "
              "another seed) to show the update; tests/test_eva.py's loop learning test shows the loop learning")


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
