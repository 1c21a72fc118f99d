"""SiLU-and-mul: the SwiGLU gate. Input is the fused [gate | up] projection.

Device path: a Triton kernel over (row, column block). It is elementwise, so unlike the
norms a program need not hold a whole row: a 1024-wide column block keeps the tile the
same size for intermediate 3072 (Qwen3-0.6B, 3 blocks) and 14336 (14 blocks). Math is
float32 with the reference's rounding points (silu rounded to the input dtype, then the
product), so low-precision results match `F.silu(gate) * up`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptr = x_ptr + row * x_row_stride + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + inter, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # torch's silu: x / (1 + exp(-x)) in fp32, rounded to the input dtype; exp(-x) = inf
    # for x < -88 gives -0, as in torch.
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() >= 1 and x.shape[-1] % 2 == 0, "input is [..., 2 * intermediate]"
    assert x.dtype.is_floating_point, f"x must be floating point, got {x.dtype}"
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])  # a view unless the leading dims cannot be merged
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    # 4 warps x 32 lanes x 8 = 1024: 16 B bf16 vectors per thread.
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0, "input is [..., 2 * intermediate]"
    if x.is_cuda:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
