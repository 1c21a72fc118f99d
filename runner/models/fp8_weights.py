"""FP8 checkpoints, dequantized to the model's dtype as they load; and the gate that names
any other quantization as unsupported (gpt-oss's MXFP4 experts pass it: their model
dequantizes them, runner/models/mxfp4_weights.py; so do GPTQ and AWQ checkpoints,
runner/models/packed_int_weights.py).

Two layouts are read, both float8_e4m3fn weights beside a float32 scale that multiplies
them back:
- quant_method "fp8" (Qwen3-*-FP8, DeepSeek-V3/R1, GLM-4.5-FP8): `<name>_scale_inv`, one
  scale per `weight_block_size` block (128 x 128), the last block of a row or column
  cut short;
- quant_method "compressed-tensors" with 8-bit float weights (Red Hat / Neural Magic
  FP8 exports): `<name>_scale`, one per tensor or one per output channel;
- the same with symmetric 8-bit integer weights ("int-quantized", llm-compressor's
  W8A8-INT8): int8 `<name>` and `<name>_scale` per channel or per group of inputs. Their
  dynamic int8 activations are not applied: activations stay in the model's dtype.

Dequantized, the weights take the dtype's memory (twice FP8's in bf16) and the matmuls
run as for any 16-bit model; the execution path says so (`weights=fp8->bfloat16`). Where
the loader keeps a projection's bytes instead (`--quantized-weights packed`,
runner/models/fp8_kept.py, which also runs long batches as W8A8 FP8 GEMMs),
`dequantized_weights` hands them on in PackedLinear's layout (`weights=fp8->float8_e4m3fn`). Activation scales
(`input_scale`) are dropped: activations stay in the model's dtype. KV-cache scales never reach this module: runner/models/
kv_scales.py takes them first, for `--kv-cache-dtype fp8`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.runner.models.fp8_kept import kept_parts
from pdserve.runner.models.packed_int_weights import (
    CT,
    METHOD_ALIASES,
    PACKED_METHODS,
    packed_int_format,
    packed_source,
    quantization_config,
)

FP8_DTYPES = (torch.float8_e4m3fn,)
# Weight dtypes a scale pairs with: FP8, and compressed-tensors' int8 (int8_weights_only).
SCALED_DTYPES = (*FP8_DTYPES, torch.int8)
_INT8_FORMATS = ("int-quantized", "naive-quantized")
# Tensors of an FP8 checkpoint that only an FP8 activation or KV path would use.
_DROPPED_SUFFIXES = ("input_scale",)


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "fp8" | "compressed-tensors"
    scale_suffix: str  # appended to a weight's name: its scale tensor's name
    block: tuple[int, int] | None  # (rows, cols) a scale covers; None: tensor or channel


def fp8_format(hf_config: Any) -> Fp8Format | None:
    """The config's FP8 layout, None for an unquantized model. Raises ValueError naming
    any other quantization (the caller lists it as unsupported)."""
    quant = quantization_config(hf_config)
    if quant is None:
        return None
    method = quant.get("quant_method", "?")
    if method == "mxfp4" and getattr(hf_config, "model_type", "") == "gpt_oss":
        return None  # gpt-oss's experts: runner/models/mxfp4_weights.py, at its load
    if method in PACKED_METHODS or packed_source(hf_config) is not None:
        packed_int_format(hf_config)  # raises for the packed layouts it does not read
        return None  # runner/models/packed_int_weights.py
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 format {quant.get('fmt')!r} (mrv2 reads e4m3)")
        block = quant.get("weight_block_size")
        return Fp8Format("fp8", "_scale_inv", tuple(block) if block else None)
    if method == "compressed-tensors" and (_float8_weights_only(quant) or int8_weights_only(quant)):
        return Fp8Format("compressed-tensors", "_scale", None)
    raise ValueError(
        f"quantized weights ({method}; mrv2 dequantizes fp8, gptq, awq and compressed-tensors "
        "packed integer checkpoints and gpt-oss's mxfp4)"
    )


def quantized_source(hf_config: Any) -> str | None:
    """The checkpoint's quantization as the execution path names it ("fp8", "mxfp4",
    "gptq", "awq", "w4a16" / "w8a16" for compressed-tensors' packed integers, "w8a8" for
    its int8 weights), None for 16/32-bit weights."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == CT and int8_weights_only(quant):
        return "w8a8"  # int8 weights, dequantized; the int8 activations are not applied
    return "mxfp4" if method == "mxfp4" else packed_source(hf_config) or "fp8"


def check_quantization(requested: str | None, hf_config: Any) -> None:
    """vLLM's `quantization` argument against the checkpoint: None (or the checkpoint's own
    method: "fp8", "mxfp4", "gptq" or "awq", the last two also by vLLM's Marlin names, or
    "compressed-tensors" for such a checkpoint) is what runs; anything else is refused by
    name, since other methods are not read. "fp8" on a 16-bit checkpoint is vLLM's online
    quantization (runner/models/fp8_online.py), also accepted."""
    if requested is None:
        return
    have = quantized_source(hf_config)
    quant = getattr(hf_config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if METHOD_ALIASES.get(requested, requested) == have or (requested == method == CT):
        return
    if have is None and requested == "fp8":
        return  # quantized at load (runner/models/fp8_online.py)
    raise ValueError(
        f"quantization={requested!r}: the checkpoint is "
        f"{have + ' (read as such without the argument)' if have else '16-bit'}, and pdserve "
        "reads FP8, GPTQ, AWQ, compressed-tensors (FP8 and packed integers) and MXFP4 "
        "(gpt-oss) checkpoints, and quantizes 16-bit ones to FP8 at load ('fp8'), only"
    )


def _float8_weights_only(quant: dict) -> bool:
    groups = quant.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()]
    return bool(weights) and all(
        w.get("type") == "float" and w.get("num_bits") == 8 for w in weights
    )


def int8_weights_only(quant: dict) -> bool:
    """compressed-tensors with symmetric int8 weights stored as int8 ("int-quantized")."""
    groups = list((quant.get("config_groups") or {}).values())
    stored = [quant.get("format") in _INT8_FORMATS or g.get("format") in _INT8_FORMATS
              for g in groups]  # fmt: skip
    weights = [g.get("weights") or {} for g in groups]
    return bool(weights) and all(stored) and all(
        w.get("type") == "int" and w.get("num_bits") == 8 and w.get("symmetric", True)
        and w.get("strategy") in ("channel", "group") for w in weights
    )  # fmt: skip


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float32 `weight * scale`, the scale broadcast over its block, channel or tensor.
    `weight` is [..., N, K] (a leading expert dim is allowed)."""
    w = weight.float()
    s = scale.float()
    n, k = w.shape[-2:]
    if s.numel() == 1:
        return w * s.reshape(())
    if fmt.block is not None:
        bm, bn = fmt.block
        expected = (-(-n // bm), -(-k // bn))
        if tuple(s.shape[-2:]) != expected:
            raise ValueError(
                f"block scale of shape {tuple(s.shape)} for a {tuple(w.shape)} weight "
                f"(blocks of {bm} x {bn} need {expected})"
            )
        s = s.repeat_interleave(bm, dim=-2)[..., :n, :].repeat_interleave(bn, dim=-1)[..., :k]
        return w * s
    if tuple(s.shape) == (n,):
        s = s[:, None]
    if tuple(s.shape[-2:]) == (n, 1):  # per output channel
        return w * s
    if s.dim() == w.dim() and s.shape[-2] == n and k % s.shape[-1] == 0:  # per input group
        return w * s.repeat_interleave(k // s.shape[-1], dim=-1)
    raise ValueError(f"scale of shape {tuple(s.shape)} for a {tuple(w.shape)} weight")


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    fmt: Fp8Format,
    dtype: torch.dtype,
    keep: Callable[[str], bool] = lambda prefix: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight dequantized to `dtype` and its scale
    consumed, or, where `keep(prefix)` for a weight `<prefix>.weight`, converted to
    PackedLinear's `<prefix>.qweight`, `.scales` and `.zeros` (runner/models/fp8_kept.py).
    A weight and its scale may come in either order (and from different shards): the
    first one waits for the other. Unpaired leftovers raise ValueError."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    suffix = fmt.scale_suffix

    def paired(owner: str, weight: torch.Tensor, scale: torch.Tensor):
        prefix = owner.removesuffix(".weight")
        if owner.endswith(".weight") and keep(prefix):
            for part, tensor in kept_parts(weight, scale, fmt, owner).items():
                yield f"{prefix}.{part}", tensor
        else:
            yield owner, dequantize(weight, scale, fmt).to(dtype)

    for name, tensor in weights:
        if name.endswith(_DROPPED_SUFFIXES):
            continue
        if name.endswith(suffix):
            owner = name[: -len(suffix)]
            if owner in weights_waiting:
                yield from paired(owner, weights_waiting.pop(owner), tensor)
            else:
                scales_waiting[owner] = tensor
        elif tensor.dtype in SCALED_DTYPES:
            if name in scales_waiting:
                yield from paired(name, tensor, scales_waiting.pop(name))
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        lone = sorted(weights_waiting)[:2] + sorted(f"{n}{suffix}" for n in scales_waiting)[:2]
        raise ValueError(f"fp8 checkpoint has weights without scales or scales without "
                         f"weights, e.g. {lone}")  # fmt: skip
