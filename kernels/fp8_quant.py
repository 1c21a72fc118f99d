"""Activations quantized to float8_e4m3fn as they arrive (W8A8: kernels/fp8_gemm.py
multiplies these codes by FP8 weights on the tensor cores).

`quantize_fp8(x)`: each row of x [M, K] gets the scale `amax / 448` (448 is float8_e4m3fn's
largest finite value; at least the smallest normal float32, so an all-zero row's
reciprocal is finite) and its codes are `x * (1 / scale)` rounded to the nearest float8
value (ties to even), clamped to +-448 (saturating where a rounded reciprocal lifts the
largest value a hair past it). Returns (codes [M, K], scales [M, 1] float32).

Device path: one Triton program per row (its K inputs in one pass when they fit a
register tile, or in two: the amax, then the codes). The rounding is done in integer
arithmetic (`round_e4m3`), so the cast that follows is exact whatever mode the compiler
gives it, and so Triton's interpreter, whose own fp32 -> fp8 cast rounds wrongly (a
mantissa that rounds up past 1.111b loses its carry: 31.01 became 16), computes what the
GPU does. The torch spec `quantize_fp8_ref` is also the CPU path; both do the same IEEE
float32 operations (divisions correctly rounded), so they agree exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
TINY = 1.1754943508222875e-38  # the smallest normal float32: the scales' floor
MAX_BLOCK = 8192  # inputs a program holds at once


def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=TINY)  # [M, 1]
    inv = 1.0 / scale
    codes = (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


@triton.jit
def round_e4m3(y):
    """float32 y in [-448, 448] rounded to the nearest float8_e4m3fn value (ties to the even
    code), still float32, in integer arithmetic on its bits."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127  # |y|'s binade
    # float32 fraction bits below e4m3's step: 20 for normal results (3 fraction bits kept),
    # one more a binade below 2^-6, 23 in [2^-9, 2^-8) (whose step is its leading bit)
    shift = 20 + tl.minimum(tl.maximum(-6 - e, 0), 3)
    one = tl.full(bits.shape, 1, tl.int32)
    # the lower candidate's code parity: the kept bit, except in [2^-9, 2^-8) where the
    # lower candidate 2^-9 is code 1
    odd = tl.where(e == -9, 1, (bits >> shift) & 1)
    r = (bits + ((one << (shift - 1)) - 1) + odd) & -(one << shift)
    # below 2^-9: 2^-9 past half of it, else zero (the tie at 2^-10 goes to code 0)
    magnitude = bits & 0x7FFFFFFF
    tiny = tl.where(magnitude > 0x3A800000, 0x3B000000, 0)  # 2^-10, 2^-9
    r = tl.where(e < -9, (bits & -2147483648) | tiny, r)  # with y's sign, -0.0 included
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_fp8_kernel(
    x_ptr,  # [M, K], unit stride on K
    codes_ptr,  # [M, K] float8_e4m3fn out
    scale_ptr,  # [M] float32 out
    k,
    stride_xm,
    BLOCK: tl.constexpr,  # inputs a pass covers
    ONE_PASS: tl.constexpr,  # BLOCK covers K
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    out_row = codes_ptr + row * k
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < k, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        run = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, k, BLOCK):
            x = tl.load(x_row + start + offs, mask=start + offs < k, other=0.0)
            run = tl.maximum(run, tl.abs(x.to(tl.float32)))
        amax = tl.max(run, axis=0)
    # correctly rounded divisions, as torch's (Triton's `/` on fp32 is approximate)
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
    inv = tl.math.div_rn(1.0, scale)
    if ONE_PASS:
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        tl.store(out_row + offs, round_e4m3(y).to(tl.float8e4nv), mask=offs < k)
    else:
        for start in range(0, k, BLOCK):
            x = tl.load(x_row + start + offs, mask=start + offs < k, other=0.0)
            y = tl.minimum(tl.maximum(x.to(tl.float32) * inv, -448.0), 448.0)
            tl.store(out_row + start + offs, round_e4m3(y).to(tl.float8e4nv),
                     mask=start + offs < k)  # fmt: skip
    tl.store(scale_ptr + row, scale)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `quantize_fp8_ref`: the Triton kernel on CUDA, the spec elsewhere."""
    if not x.is_cuda:
        return quantize_fp8_ref(x)
    return quantize_fp8_triton(x)


def quantize_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch (any device Triton runs on: CUDA, or the interpreter's CPU)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with unit stride on K"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    one_pass = k <= MAX_BLOCK
    block = triton.next_power_of_2(k) if one_pass else MAX_BLOCK // 2
    if m:
        _quantize_fp8_kernel[(m,)](x, codes, scales, k, x.stride(0), BLOCK=block,
                                   ONE_PASS=one_pass, num_warps=max(4, block // 2048))  # fmt: skip
    return codes, scales
