"""Activations quantized to float8_e4m3fn as they arrive (W8A8: the FP8 GEMM of
kernels/fp8_gemm.py multiplies these codes by FP8 weights on the tensor cores).

`quantize_fp8(x, group)`: each row of x [M, K] (group 0), or each run of `group` inputs of
a row (group 128, the 1 x 128 activation blocks of DeepSeek-style block-scaled weights),
gets the scale `amax / 448` (448 is float8_e4m3fn's largest finite value; at least the
smallest normal float32, so an all-zero run's reciprocal is finite) and its codes are the
correctly rounded `x * (1 / scale)`, clamped to +-448 (saturating where a rounded
reciprocal lifts the largest value a hair past it). Returns (codes [M, K], scales):
[M, 1] float32 per row, or [M, K / group] float32 stored M-major (stride (1, M)), the
layout cuBLAS's 1 x 128 recipe reads.

Device path: one Triton program per row (its K inputs in one pass when they fit a
register tile, or in two: the amax, then the codes). The torch spec `quantize_fp8_ref`
is also the CPU path; both do the same IEEE float32 operations, so they agree exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
TINY = 1.1754943508222875e-38  # the smallest normal float32: the scales' floor
MAX_BLOCK = 8192  # inputs a program holds at once


def quantize_fp8_ref(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    g = k if group == 0 else group
    runs = x.float().reshape(m, k // g, g)
    scale = (runs.abs().amax(dim=-1) / FP8_MAX).clamp(min=TINY)  # [M, K / g]
    inv = 1.0 / scale
    codes = (runs * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if group == 0:
        return codes.reshape(m, k), scale
    return codes.reshape(m, k), scale.t().contiguous().t()


@triton.jit
def round_e4m3(y):
    """float32 y in [-448, 448] rounded to the nearest float8_e4m3fn value (ties to even),
    still float32: the cast that follows is then exact. Done in integer and float32
    arithmetic because Triton's interpreter rounds its own fp32 -> fp8 casts wrongly (a
    mantissa that rounds up past 1.111b loses its carry: 31.01 became 16); on a GPU this
    equals the hardware's round-to-nearest conversion."""
    bits = y.to(tl.int32, bitcast=True)
    # normal results (|y| >= 2^-6): keep 3 mantissa bits, ties to even
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal results: multiples of 2^-9, rounded by adding 1.5 * 2^14 (ulp 2^-9)
    a = tl.abs(y)
    sub = (a + 24576.0) - 24576.0
    sub = tl.where(bits < 0, -sub, sub)  # the sign of y, -0.0 included
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _quantize_fp8_kernel(
    x_ptr,  # [M, K], unit stride on K
    codes_ptr,  # [M, K] float8_e4m3fn out
    scale_ptr,  # [M, G] float32 out, element (m, g) at m * stride_sm + g * stride_sg
    k,
    stride_xm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,  # inputs a scale covers (a power of 2, or K's padded size)
    BLOCK: tl.constexpr,  # inputs a pass covers: a multiple of GROUP
    ONE_PASS: tl.constexpr,  # BLOCK covers K
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    out_row = codes_ptr + row * k
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < k, other=0.0).to(tl.float32)
        runs = tl.reshape(tl.abs(x), (BLOCK // GROUP, GROUP))
        scale = tl.maximum(tl.max(runs, axis=1) / 448.0, 1.1754943508222875e-38)
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        y = tl.reshape(x, (BLOCK // GROUP, GROUP)) * inv[:, None]
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(tl.reshape(out_row + offs, (BLOCK // GROUP, GROUP)), round_e4m3(y).to(tl.float8e4nv),
                 mask=tl.reshape(offs < k, (BLOCK // GROUP, GROUP)))  # fmt: skip
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < k)
    else:  # one scale a row (GROUP is K's padded size): the amax, then the codes
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, k, BLOCK):
            x = tl.load(x_row + start + offs, mask=start + offs < k, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.1754943508222875e-38)
        inv = tl.math.div_rn(1.0, scale)
        for start in range(0, k, BLOCK):
            x = tl.load(x_row + start + offs, mask=start + offs < k, other=0.0)
            y = tl.minimum(tl.maximum(x.to(tl.float32) * inv, -448.0), 448.0)
            tl.store(out_row + start + offs, round_e4m3(y).to(tl.float8e4nv), mask=start + offs < k)
        tl.store(scale_ptr + row * stride_sm, scale)


def quantize_fp8(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `quantize_fp8_ref`: the Triton kernel on CUDA, the spec elsewhere.
    `group`: 0 (a scale a row) or a power of two dividing K (a scale a run)."""
    if not x.is_cuda:
        return quantize_fp8_ref(x, group)
    return quantize_fp8_triton(x, group)


def quantize_fp8_triton(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch (any device Triton runs on: CUDA, or the interpreter's CPU)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with unit stride on K"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    m, k = x.shape
    assert group == 0 or (group & (group - 1) == 0 and k % group == 0), (
        f"group {group} must be 0 or a power of two dividing K={k}"
    )
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if group == 0:
        scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        one_pass = k <= MAX_BLOCK
        block = triton.next_power_of_2(k) if one_pass else MAX_BLOCK // 2
        group_c = block
    else:
        scales = torch.empty(k // group, m, dtype=torch.float32, device=x.device).t()
        one_pass = True
        block = triton.next_power_of_2(k)
        group_c = group
        assert block <= 4 * MAX_BLOCK, f"K={k} is past the grouped kernel's one pass"
    if m:
        _quantize_fp8_kernel[(m,)](
            x, codes, scales, k, x.stride(0), scales.stride(0), scales.stride(1),
            GROUP=group_c, BLOCK=block, ONE_PASS=one_pass, num_warps=min(16, max(4, block // 2048)),
        )  # fmt: skip
    return codes, scales
