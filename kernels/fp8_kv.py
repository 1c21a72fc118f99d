"""FP8 KV cache values (`--kv-cache-dtype fp8`): how a K or V value becomes a cache byte.

A layer's K (or V) is stored as `value / scale`, saturated to the format's largest finite
value and rounded to nearest even; attention reads it back as `byte * scale`. The scales
are per layer and per K / V: a checkpoint's `k_scale` / `v_scale` where it has them,
else 1.0 (vLLM's default). Attention kernels load FP8 caches natively and convert to the
query's dtype; the scales never reach them (runner/models/llama.py folds the K scale into
the softmax scale and applies the V scale to the output).

`quantize_ref` is the spec (torch's own cast). The Triton writers store `fp8_code`: the
same rounding, done in integer arithmetic on the float32 bits into a uint8 view of the
cache, so the GPU and Triton's interpreter (whose float8 casts round ties away, flush
subnormals and saturate at 256) write the bytes torch does.

What this module does not know: which layers share a scale, or where scales come from.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8Format:
    mantissa_bits: int
    max_finite: float


FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(3, 448.0),
    torch.float8_e5m2: Fp8Format(2, 57344.0),
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FORMATS


def inverse_scale(scale: float) -> float:
    """1 / scale as the float32 both writers multiply by (the Triton kernels take float
    arguments as float32; the reference multiplies by the same rounded number)."""
    assert scale > 0, f"an FP8 KV scale is positive (got {scale})"
    return struct.unpack("f", struct.pack("f", 1.0 / scale))[0]


def quantize_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` (as `x * inverse_scale(scale)` in float32), saturated, in `dtype`."""
    fmax = FORMATS[dtype].max_finite
    return (x.float() * inverse_scale(scale)).clamp(-fmax, fmax).to(dtype)


def store_target(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a Triton writer stores into, and its FP8 constexpr: a uint8 view and the
    format's mantissa bits for an FP8 cache, else the cache itself and 0."""
    if not is_fp8(cache.dtype):
        return cache, 0
    return cache.view(torch.uint8), FORMATS[cache.dtype].mantissa_bits


@triton.jit
def fp8_code(x, MANTISSA_BITS: tl.constexpr):
    """float32 -> the uint8 of its float8 (e4m3fn for 3 mantissa bits, e5m2 for 2): round
    to nearest even at the value's binade (or the subnormal step below the smallest
    normal), saturate at the largest finite value. NaN inputs are not expected."""
    if MANTISSA_BITS == 3:
        BIAS: tl.constexpr = 7
        MIN_EXP: tl.constexpr = -6
        SMALLEST_NORMAL: tl.constexpr = 0.015625  # 2^-6
        FMAX: tl.constexpr = 448.0
    else:
        BIAS: tl.constexpr = 15
        MIN_EXP: tl.constexpr = -14
        SMALLEST_NORMAL: tl.constexpr = 6.103515625e-05  # 2^-14
        FMAX: tl.constexpr = 57344.0
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1  # negative zero keeps its sign
    a = tl.minimum(tl.abs(x), FMAX)
    exp = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    step = exp - MANTISSA_BITS  # the format's spacing at `a` is 2^step
    up = ((127 - step) << 23).to(tl.float32, bitcast=True)
    down = ((127 + step) << 23).to(tl.float32, bitcast=True)
    # a * 2^-step < 2^(MANTISSA_BITS + 1) is exact; adding 2^23 rounds it to an integer,
    # ties to even (float32 addition)
    steps = (a * up + 8388608.0) - 8388608.0
    rounded = steps * down
    bits = rounded.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - 127 + BIAS) << MANTISSA_BITS) | (
        (bits >> (23 - MANTISSA_BITS)) & ((1 << MANTISSA_BITS) - 1)
    )
    # Below the smallest normal the steps count the subnormal's mantissa (its exponent
    # field is 0); a value that rounds up to the smallest normal takes the normal code.
    code = tl.where(rounded >= SMALLEST_NORMAL, normal, steps.to(tl.int32))
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def cache_value(x, inv_scale, dtype: tl.constexpr, FP8_MANTISSA: tl.constexpr):
    """What a writer stores for `x`: its uint8 FP8 code of `x * inv_scale`, or `x` in the
    cache's `dtype` (FP8_MANTISSA 0). One return after the branch: the GPU compiler goes on
    past a return inside a constexpr `if` and then refuses the second return's other type
    (the interpreter does not)."""
    if FP8_MANTISSA == 0:
        value = x.to(dtype)
    else:
        value = fp8_code(x.to(tl.float32) * inv_scale, FP8_MANTISSA)
    return value
