"""Resolve the user's engine arguments ("auto" included) into a frozen `EngineConfig`.

This is where the model directory is found (or a GGUF converted), the transformers
config read, dtype/device/max_model_len chosen and the runner selected. Nothing
downstream sees an "auto".
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pdserve.json_arg import json_object
from pdserve.runner.classify import classifier_spec, is_classifier
from pdserve.runner.config import (
    LOAD_FORMATS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdserve.runner.hf_overrides import apply_hf_overrides, parse_hf_overrides
from pdserve.runner.hybrid import is_hybrid
from pdserve.runner.model_source import resolve_model_dir, resolve_tokenizer_dir
from pdserve.runner.models.fp8_weights import check_quantization, quantized_source
from pdserve.runner.models.text_only import text_view
from pdserve.runner.runner_select import select_runner
from pdserve.runner.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: str, hf_config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)} (got {dtype!r})")
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and not the oracle's dtype
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    cfg = _DTYPES.get(str(cfg).removeprefix("torch.")) if cfg is not None else None
    return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16


def _read_config(path: Path, trust_remote_code: bool) -> Any:
    """The checkpoint's transformers config; a config class the checkpoint ships needs
    `trust_remote_code` (vLLM's `--trust-remote-code`), and the refusal says so."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise ValueError(
                f"{path}'s config is a class the checkpoint ships (its own Python): pass "
                "trust_remote_code=True (--trust-remote-code) to let it run"
            ) from exc
        raise


def resolve_engine_config(
    model: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    runner: str = "auto",
    seed: int = 0,
    num_gpu_blocks: int | None = None,
    num_gpu_blocks_override: int | None = None,  # vLLM's name for num_gpu_blocks
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    async_scheduling: bool | None = None,
    enforce_eager: bool = False,
    cuda_graph_sizes: list[int] | None = None,
    decode_attention: str = "auto",
    cuda_graph_scope: str = "step",
    scheduling_policy: str = "fcfs",
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    hf_overrides: dict | str | None = None,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
    quantized_weights: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "float32",
    speculative_config: dict | str | None = None,
) -> EngineConfig:
    if num_gpu_blocks is not None and num_gpu_blocks_override is not None:
        raise ValueError("give num_gpu_blocks or num_gpu_blocks_override, not both")
    if num_gpu_blocks is None:
        num_gpu_blocks = num_gpu_blocks_override

    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)} (got {load_format!r})"
        )
    path, name = resolve_model_dir(model, revision, download_dir, weights=load_format != "dummy")
    tokenizer_dir = (
        None if tokenizer is None else str(resolve_tokenizer_dir(tokenizer, download_dir))
    )
    checkpoint_config = apply_hf_overrides(
        _read_config(path, trust_remote_code), parse_hf_overrides(hf_overrides)
    )
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev, checkpoint_config)
    # A multimodal checkpoint's language model runs as a text model (text_only.py).
    hf_config, text_only_of = text_view(checkpoint_config)
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or None
    if max_model_len is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        max_model_len = limit
    elif limit is not None and max_model_len > limit:
        raise ValueError(
            f"max_model_len ({max_model_len}) must be <= the model's "
            f"max_position_embeddings ({limit})"
        )
    check_quantization(quantization, hf_config)  # vLLM's argument: the checkpoint's or none
    runner_name = select_runner(runner, hf_config)
    # vLLM's online FP8: a 16-bit checkpoint's projections quantized as they load
    quantize_at_load = "fp8" if quantization == "fp8" and not quantized_source(hf_config) else None
    if quantize_at_load and runner_name != "mrv2":
        raise ValueError(
            f"quantization='fp8' on a 16-bit checkpoint quantizes its weights at load in the "
            f"mrv2 runner only (this model runs on the {runner_name} runner)"
        )
    if kv_cache_dtype != "auto" and runner_name != "mrv2":
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} needs the mrv2 runner (the {runner_name} "
            "runner keeps transformers' own cache)"
        )
    classifier = None
    if is_classifier(hf_config):
        tokenizer = (
            load_tokenizer(tokenizer_dir or path, trust_remote_code)
            if getattr(hf_config, "classifier_from_token", None)
            else None
        )
        classifier = classifier_spec(hf_config, tokenizer)
    on_cuda = dev.startswith("cuda")
    speculative = _speculative(speculative_config, hf_config)
    if async_scheduling is None:
        # with drafts too: a step with drafts is waited for where it launches (engine.py)
        async_scheduling = on_cuda
    graphs: tuple[int, ...] = ()
    if on_cuda and runner_name == "mrv2" and not enforce_eager:
        from pdserve.runner.mrv2.cuda_graphs import capture_sizes

        # with drafts, a decode step's rows are its drafted positions too (up to 1 + k a
        # request), run as decode rows (runner/mrv2/model_runner.py)
        rows = max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative else 0))
        graphs = capture_sizes(cuda_graph_sizes, rows, max_num_batched_tokens)
    return EngineConfig(
        model=ModelConfig(
            path=str(path),
            hf_config=hf_config,
            dtype=torch_dtype,
            max_model_len=max_model_len,
            source=name if model is None else str(model),
            text_only_of=text_only_of,
            classifier=classifier,
            trust_remote_code=trust_remote_code,
            tokenizer=tokenizer_dir,
            load_format=load_format,
            quantized_weights=quantized_weights,
            quantize_at_load=quantize_at_load,
        ),
        cache=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_blocks=num_gpu_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            mamba_cache_dtype=mamba_cache_dtype,
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
            cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=scheduling_policy,
        ),
        runner=RunnerConfig(
            runner=runner_name,
            device=dev,
            seed=seed,
            async_scheduling=async_scheduling,
            cuda_graph_sizes=graphs,
            decode_attention=decode_attention,
            cuda_graph_scope=cuda_graph_scope,
        ),
        lora=LoRAConfig(enable_lora, max_loras, max_lora_rank),
        speculative=speculative,
    )


def _speculative(value: dict | str | None, hf_config: Any) -> SpeculativeConfig | None:
    """vLLM's `speculative_config` (a dict, or its JSON as `--speculative-config` gives it);
    EngineConfig refuses it beside another runner or async scheduling."""
    if value is None:
        return None
    config = SpeculativeConfig.from_dict(json_object("speculative_config", value))
    if is_hybrid(hf_config):
        raise ValueError(
            "speculative decoding is not built for hybrid Mamba models: a rejected draft "
            "would leave its tokens in the recurrent state, which cannot step back"
        )
    return config
