"""Build one of our model modules and fill it from a safetensors directory.

Parameters are created on the meta device and materialised once on the target device,
so a 0.6B model never pays for a random initialisation it would overwrite.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.runner.config import CacheConfig, ModelConfig
from pdserve.runner.models import MODEL_REGISTRY
from pdserve.runner.models.dummy_weights import dummy_weights
from pdserve.runner.models.fp8_kept import FP8_KEPT, kept_fp8_format
from pdserve.runner.models.fp8_online import (
    ONLINE_FORMAT,
    ONLINE_FP8_FORMAT,
    online_swap,
    quantized_at_load,
    source_dtype,
)
from pdserve.runner.models.fp8_weights import dequantized_weights, fp8_format, quantized_source
from pdserve.runner.models.kv_scales import KvScales
from pdserve.runner.models.norm_fold import fold_norms
from pdserve.runner.models.packed_int_weights import dequantized_packed_weights, packed_int_format
from pdserve.runner.models.packed_linear import (
    PackedLinear,
    packed_target,
    runs_packed,
    swap_packed_linears,
)
from pdserve.runner.models.text_only import language_model_weights
from pdserve.runner.mrv2.kv_cache import GPU_ACTIVATION_RESERVE_BYTES, block_bytes

logger = logging.getLogger(__name__)


def iter_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers take (on "meta" too), with the parameters
    a family keeps in float32 counted so."""
    keep = getattr(model, "keep_fp32", ())
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        size = 4 if keep and name.endswith(keep) else t.element_size()
        total += t.numel() * size
    return total


def check_weights_fit(
    model: torch.nn.Module,
    device: torch.device,
    quantized: str | None,
    memory: tuple[int, int] | None = None,  # (free, total) bytes; default: the device's
) -> None:
    """Refuses, before a byte is allocated, weights larger than the GPU's free memory: a
    worker runs on one GPU (no tensor parallelism), so a model that does not fit would
    otherwise fail mid-load with an allocator error."""
    if device.type != "cuda":
        return
    need = weight_bytes(model)
    free, total = memory or torch.cuda.mem_get_info(device)
    if need <= free:
        return
    stored = f" (its {quantized} weights are dequantized at load)" if quantized else ""
    raise ValueError(
        f"the model's weights take {need / 2**30:.1f} GiB{stored}, more than the "
        f"{free / 2**30:.1f} GiB free of this GPU's {total / 2**30:.1f} GiB: a pdserve worker "
        "runs a model on one GPU, so serve it on a GPU with more memory or a smaller model"
    )


def kv_cache_reserve(
    model: torch.nn.Module, cache: CacheConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """Bytes the KV cache of `model` (meta is enough) must at least get: the cache's explicit
    size (blocks or bytes), else one request of max_model_len tokens (what vLLM refuses to
    start without)."""
    kv_layers = getattr(model, "num_kv_layers", len(model.layers))
    per_block = block_bytes(
        kv_layers, model.kv_block_shape(cache.block_size), cache.kv_dtype(dtype)
    )
    if cache.num_blocks is not None:
        return cache.num_blocks * per_block
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    return -(-max_model_len // cache.block_size) * per_block


def weights_budget(free: int, total: int, gpu_memory_utilization: float, kv_reserve: int) -> int:
    """Bytes a model's weights may take on a GPU with `free` of `total` bytes free and still
    leave the KV cache `kv_reserve` bytes and the activations their reserve, all within
    `gpu_memory_utilization` of the GPU (as runner/mrv2/kv_cache.py sizes the cache)."""
    used = total - free
    return int(total * gpu_memory_utilization) - used - GPU_ACTIVATION_RESERVE_BYTES - kv_reserve


def load_model(
    model_config: ModelConfig, device: torch.device, fold: bool = True,
    cache: CacheConfig | None = None,
) -> torch.nn.Module:  # fmt: skip
    """`fold=False` keeps the RMSNorms as loaded (LoRA adapters read the normalised rows,
    runner/lora/slots.py). `cache` sizes what a packed checkpoint's "auto" leaves the KV
    cache (default: CacheConfig())."""
    cfg = model_config.hf_config
    cls = MODEL_REGISTRY[model_config.architecture]
    # Positions up to max_model_len inclusive: the token sampled at the last position.
    max_positions = model_config.max_model_len + 1
    if model_config.load_format == "dummy" and model_config.classifier is not None:
        raise ValueError(
            "load_format 'dummy' makes a generating model's weights, not a classifier's"
        )
    with torch.device("meta"):
        model = cls(cfg, max_positions)
        if model_config.classifier is not None:  # its score head (runner/classify.py)
            model.attach_classifier(model_config.classifier)
    model = model.to(dtype=model_config.dtype)
    dummy = model_config.load_format == "dummy"
    packed = None if dummy else packed_int_format(cfg)
    fp8 = None if dummy else fp8_format(cfg)
    online = model_config.quantize_at_load is not None  # --quantization fp8 on 16-bit
    if online:
        fp8 = ONLINE_FP8_FORMAT  # the quantized stream reads as an FP8 checkpoint's
    # what may stay packed, FP8 included (not compressed-tensors' int8 weights, "w8a8")
    keepable = ONLINE_FORMAT if online else (
        packed or kept_fp8_format(fp8, quantized_source(cfg) == "w8a8"))  # fmt: skip
    # GPTQ / AWQ / compressed-tensors linears the model runs packed, and FP8 ones kept as
    # bytes (after the dtype cast: their scales stay float32), before a byte is allocated
    # (runner/models/packed_linear.py, fp8_kept.py)
    swapped = set()
    on_gpu = device.type == "cuda"
    dequantized = budget = None
    if keepable is not None and on_gpu:
        cache = cache or CacheConfig()
        dequantized = weight_bytes(model)
        reserve = kv_cache_reserve(model, cache, model_config.dtype, model_config.max_model_len)
        budget = weights_budget(*torch.cuda.mem_get_info(device), cache.gpu_memory_utilization,
                                reserve)  # fmt: skip
    if keepable is None and model_config.quantized_weights == "packed" and not dummy:
        raise ValueError(
            "quantized_weights='packed': the checkpoint's weights are "
            f"{quantized_source(cfg) or '16-bit'}; GPTQ, AWQ, compressed-tensors packed "
            "integers and FP8 stay packed, nothing else does (drop it)"
        )
    if online:  # asked for: kept whatever the memory
        swapped = online_swap(model, model_config, fold)
    elif keepable is not None and runs_packed(
        model_config.quantized_weights, keepable, not fold, dequantized, budget
    ):
        swapped = swap_packed_linears(model, keepable)
        if not swapped and model_config.quantized_weights == "packed":
            raise ValueError(
                f"quantized_weights='packed': {model_config.architecture}'s projections do not "
                "run packed (Llama-family decoders without reworked weights do); drop it to "
                "dequantize them at load"
            )
    if keepable is not None and on_gpu and model_config.quantized_weights == "auto" and not online:
        logger.info(
            "quantized_weights auto: %s (16-bit weights %.1f GiB against %.1f GiB the "
            "weights may take beside the %.1f GiB the KV cache needs at least)",
            "packed" if swapped else "dequantized at load", dequantized / 2**30,
            budget / 2**30, reserve / 2**30,
        )  # fmt: skip
    check_weights_fit(model, device, quantized_source(cfg))
    model = model.to_empty(device=device)
    # Parameters the family keeps in float32 whatever the dtype (DeepSeek's and GLM-4's
    # router and its correction bias, as transformers keeps them): expert choice compares
    # scores whose bf16 rounding would change which experts win.
    keep = getattr(model, "keep_fp32", ())
    for name, param in model.named_parameters():
        if name.endswith(keep):
            param.data = param.data.float()
    model.init_rope()
    if dummy:  # random weights in the checkpoint's names (runner/models/dummy_weights.py)
        weights = dummy_weights(cfg, model_config.dtype, device)
    else:
        weights = iter_safetensors(model_config.path)
    if model_config.text_only_of is not None and not dummy:  # a multimodal checkpoint's LM
        weights = language_model_weights(weights)
    kv_scales = KvScales()  # an FP8 KV cache's scales, where the checkpoint has them
    weights = kv_scales.take(weights)
    if online:  # the kept projections' 16-bit weights quantized as they stream in
        weights = quantized_at_load(weights, partial(packed_target, swapped=swapped), device)
    if fp8 is not None:  # dequantized as they stream in, or kept (runner/models/fp8_kept.py)
        keep = partial(packed_target, swapped=swapped)
        weights = dequantized_weights(weights, fp8, model_config.dtype, keep)
    if packed is not None:  # GPTQ / AWQ / compressed-tensors: packed or dequantized
        keep = partial(packed_target, swapped=swapped)
        weights = dequantized_packed_weights(weights, packed, model_config.dtype, keep)
    with torch.no_grad():
        model.load_weights(weights)
    kv_scales.apply(model)
    model.weights_from = "dummy" if dummy else quantized_source(cfg)
    if online:  # the checkpoint's own dtype, then what it became
        model.weights_from = source_dtype(cfg)
    # the execution path's weights
    model.packed_bits = keepable.bits if swapped else None
    model.packed_fp8 = bool(swapped) and keepable.method == FP8_KEPT
    # kept FP8 projections that run W8A8 FP8 GEMMs (kernels/fp8_gemm.py)
    kept = [m for m in model.modules() if isinstance(m, PackedLinear)] if model.packed_fp8 else []
    model.w8a8 = sum(m.prepare_w8a8(model_config.dtype) for m in kept)  # how many
    if fold and device.type == "cuda" and model_config.dtype in (torch.bfloat16, torch.float16):
        # 16-bit decode batches on the GPU run without norm launches (norm_fold.py); fp32
        # (the parity runs against transformers) and CPU keep the weights as loaded.
        fold_norms(model)
    return model.eval()
