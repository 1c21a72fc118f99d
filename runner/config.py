"""Engine configuration: one frozen dataclass per concern, composed into `EngineConfig`.

Every "auto" is resolved by `runner.config_resolve.resolve_engine_config` before these
objects are built, so nothing downstream re-interprets a default. `__post_init__`
validates and states the rule that was broken. This module knows nothing about models
beyond the resolved numbers it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.runner.classify import ClassifierSpec

RUNNER_CHOICES = ("auto", "mrv2", "reference")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# How a GPTQ / AWQ / compressed-tensors checkpoint's integer weights, or an FP8 one's
# float8 bytes, run (runner/models/packed_linear.py, fp8_kept.py): "auto" dequantizes
# them at load where the 16-bit weights leave the KV cache room for one max_model_len
# request and keeps them packed where they do not (runner/models/loader.py); "packed" /
# "dequantized" choose.
QUANTIZED_WEIGHTS = ("auto", "packed", "dequantized")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def architecture_of(hf_config: Any) -> str:
    """The transformers class name a config is for; configs saved without `architectures`
    fall back to the causal-LM class registered for their model_type."""
    archs = getattr(hf_config, "architectures", None)
    if archs:
        return archs[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", ""), "<none>")


@dataclass(frozen=True)
class ModelConfig:
    """What to run: a local directory of config.json + safetensors (+ tokenizer)."""

    path: str  # resolved local directory
    hf_config: Any = field(repr=False, compare=False)  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    source: str = ""  # what the user asked for (path, .gguf file, hub id or "bundled")
    # The multimodal architecture whose language model `hf_config` describes (its weights
    # are renamed at load: runner/models/text_only.py); None for a text checkpoint.
    text_only_of: str | None = None
    # A sequence classifier's head (runner/classify.py); None for a generating or
    # embedding model.
    classifier: ClassifierSpec | None = None
    # vLLM's: the checkpoint's own Python (its config, tokenizer or, on the reference
    # runner, model class) may run; the mrv2 runner's models are always this package's
    trust_remote_code: bool = False
    # vLLM's --tokenizer: a folder holding the tokenizer, when not the model's own
    tokenizer: str | None = None
    # vLLM's --load-format: "auto" / "safetensors" read the checkpoint; "dummy" makes random
    # weights of its shapes (runner/models/dummy_weights.py), for timing without them
    load_format: str = "auto"
    # a packed integer checkpoint's weights: QUANTIZED_WEIGHTS
    quantized_weights: str = "auto"
    # vLLM's --quantization fp8 on a 16-bit checkpoint: "fp8" quantizes the projections as
    # they load (runner/models/fp8_online.py); None reads the checkpoint as it is
    quantize_at_load: str | None = None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    def __post_init__(self) -> None:
        _require(
            self.quantized_weights in QUANTIZED_WEIGHTS,
            f"quantized_weights must be one of {', '.join(QUANTIZED_WEIGHTS)} "
            f"(got {self.quantized_weights!r})",
        )
        _require(
            self.dtype in SUPPORTED_DTYPES,
            f"dtype must be one of float32, float16, bfloat16 (got {self.dtype})",
        )
        _require(
            self.quantize_at_load in (None, "fp8"),
            f"quantize_at_load must be None or 'fp8' (got {self.quantize_at_load!r})",
        )
        _require(self.max_model_len >= 1, f"max_model_len must be >= 1 (got {self.max_model_len})")
        _require(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {', '.join(LOAD_FORMATS)} (got {self.load_format!r})",
        )

    @property
    def architecture(self) -> str:
        return architecture_of(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


MAMBA_DTYPES = ("auto", "float32", "bfloat16", "float16")
# `--kv-cache-dtype` names (vLLM's) -> the paged KV cache's dtype; "auto": the model's.
# fp8 is fp8_e4m3 (kernels/fp8_kv.py says how values become bytes).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. `num_blocks` is None until the engine has sized it."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # explicit override; else sized from the memory budget
    kv_cache_memory_bytes: int | None = None  # explicit budget; else device default
    gpu_memory_utilization: float = 0.9
    # vLLM's: a hybrid Mamba model's state dtypes (runner/mrv2/mamba_state.py): the conv
    # state's ("auto": the model's dtype), and the SSM state's ("auto": the conv state's).
    # The SSM state defaults to float32 here (vLLM's default is "auto"): it accumulates over
    # the whole sequence, and 16-bit rounding compounds.
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "float32"
    # vLLM's `--kv-cache-dtype` (KV_CACHE_DTYPES): an FP8 cache takes half a 16-bit
    # cache's bytes a token
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            value = getattr(self, name)
            _require(value in MAMBA_DTYPES,
                     f"{name} must be one of {', '.join(MAMBA_DTYPES)} (got {value!r})")  # fmt: skip
        _require(self.cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                 f"(got {self.cache_dtype!r})")  # fmt: skip
        bs = self.block_size
        _require(
            bs >= 1 and (bs & (bs - 1)) == 0 and bs <= 256,
            f"block_size must be a power of two between 1 and 256 (got {bs})",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 2,
            f"num_blocks must be >= 2: block 0 is the reserved null block (got {self.num_blocks})",
        )
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be positive (got {self.kv_cache_memory_bytes})",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})",
        )

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The paged KV cache's dtype for a model run in `model_dtype`."""
        return KV_CACHE_DTYPES[self.cache_dtype] or model_dtype

    def mamba_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(conv state, SSM state) dtypes of a hybrid Mamba model run in `model_dtype`."""
        # MAMBA_DTYPES' names are torch's own
        conv = (
            model_dtype
            if self.mamba_cache_dtype == "auto"
            else getattr(torch, self.mamba_cache_dtype)
        )
        ssm = (
            conv
            if self.mamba_ssm_cache_dtype == "auto"
            else getattr(torch, self.mamba_ssm_cache_dtype)
        )
        return conv, ssm


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step, shared by every request (no prefill/decode phases)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # vLLM's `scheduling_policy`: "fcfs" (arrival order) or "priority" (each request's
    # `priority`, lower first, then arrival; preemption takes the last of that order).
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        _require(
            self.policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)} "
            f"(got {self.policy!r})",
        )
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1 (got {self.max_num_batched_tokens})",
        )
        _require(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
            f"(got {self.max_num_batched_tokens} < {self.max_model_len}), or a long prompt "
            "could never be scheduled",
        )


DECODE_ATTENTION_KERNELS = ("auto", "per_head", "packed", "flat", "per_head_prep")
CUDA_GRAPH_SCOPES = ("layers", "step")


@dataclass(frozen=True)
class RunnerConfig:
    """Which runner executes the model, on which device. `runner` is never "auto" here."""

    runner: str = "mrv2"
    device: str = "cpu"
    seed: int = 0
    # Plan step N+1 on the CPU while the device runs step N (default on CUDA).
    async_scheduling: bool = False
    # Uniform-decode batch sizes captured as FULL CUDA graphs; () = always eager.
    cuda_graph_sizes: tuple[int, ...] = ()
    # The Triton decode attention kernel: "per_head", "packed", "flat"
    # (kernels/paged_decode_split.py, paged_decode_packed.py, paged_decode_flat.py),
    # "per_head_prep" (per_head with the q/k/v preparation in the same launch where
    # kernels/qkv_attend.applies) or "auto" (by batch shape: today per_head_prep's choice).
    decode_attention: str = "auto"
    # What a decode graph holds (runner/mrv2/cuda_graphs.py): "layers" (embedding ->
    # layers) or "step" (also the input prep before them and, for steps where every row
    # takes a plain argmax, the final norm, LM head, argmax and post-update after them).
    cuda_graph_scope: str = "step"

    def __post_init__(self) -> None:
        _require(
            self.runner in ("mrv2", "reference"),
            f"resolved runner must be 'mrv2' or 'reference' (got {self.runner!r})",
        )
        _require(
            self.decode_attention in DECODE_ATTENTION_KERNELS,
            f"decode_attention must be one of {DECODE_ATTENTION_KERNELS} "
            f"(got {self.decode_attention!r})",
        )
        _require(
            self.cuda_graph_scope in CUDA_GRAPH_SCOPES,
            f"cuda_graph_scope must be one of {CUDA_GRAPH_SCOPES} (got {self.cuda_graph_scope!r})",
        )
        _require(
            all(s >= 1 for s in self.cuda_graph_sizes),
            f"cuda_graph_sizes must be positive (got {self.cuda_graph_sizes})",
        )
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be 'cpu' or 'cuda[:N]' (got {self.device!r})",
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def decode_kernel(self) -> str | None:
        """`AttentionMetadata.decode_kernel`: None lets the kernels choose by shape."""
        return None if self.decode_attention == "auto" else self.decode_attention


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA flags: adapters served beside the base weights (runner/lora/)."""

    enable_lora: bool = False
    max_loras: int = 1  # adapter slots on the device: adapters one batch can mix
    max_lora_rank: int = 16  # the largest adapter rank served

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"max_loras must be >= 1 (got {self.max_loras})")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1 (got {self.max_lora_rank})")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: draft tokens proposed on the host and verified by the
    target model in one step (runner/speculative/). "ngram": a request's last n tokens
    (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up earlier in its
    prompt and output, and what followed them is the draft."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)} "
            f"(got {self.method!r}); draft-model, EAGLE and MTP methods are not built",
        )
        _require(
            self.num_speculative_tokens >= 1,
            f"num_speculative_tokens must be >= 1 (got {self.num_speculative_tokens})",
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max (got "
            f"{self.prompt_lookup_min} and {self.prompt_lookup_max})",
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's dict (or its JSON): unknown keys are refused by name, so a typo does not
        silently run a default."""
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(d) - known)
        _require(
            not unknown,
            f"speculative_config has unknown keys {unknown} (known: {', '.join(sorted(known))})",
        )
        _require("method" in d, 'speculative_config needs a method (e.g. "ngram")')
        _require("num_speculative_tokens" in d, "speculative_config needs num_speculative_tokens")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = d.get(key, 1)
            _require(
                isinstance(v, int) and not isinstance(v, bool),
                f"speculative_config {key} must be an integer (got {v!r})",
            )
        return cls(**d)

    def describe(self) -> str:
        """How the ready log and the workers' stats name it."""
        return (
            f"{self.method}(k={self.num_speculative_tokens}, "
            f"n={self.prompt_lookup_min}..{self.prompt_lookup_max})"
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig
    lora: LoRAConfig = LoRAConfig()
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _require(
            self.scheduler.max_model_len == self.model.max_model_len,
            "scheduler.max_model_len must equal model.max_model_len "
            f"({self.scheduler.max_model_len} != {self.model.max_model_len})",
        )
        if self.speculative is not None:
            _require(
                self.runner.runner == "mrv2",
                f"speculative decoding needs the mrv2 runner (got {self.runner.runner!r})",
            )

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens a request may verify in a step (0: no speculative decoding)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @property
    def max_blocks_per_request(self) -> int:
        # +1 token: a prompt of exactly max_model_len tokens still samples one token.
        return -(-(self.model.max_model_len + 1) // self.cache.block_size)
