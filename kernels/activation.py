"""Gated activations: SiLU-and-mul (SwiGLU) and GELU(tanh)-and-mul (GeGLU: Gemma's
`gelu_pytorch_tanh`). Input is the fused [gate | up] projection.

Device path: a Triton kernel over (row, column block). It is elementwise, so unlike the
norms a program need not hold a whole row: a 1024-wide column block keeps the tile the
same size for intermediate 3072 (Qwen3-0.6B, 3 blocks) and 14336 (14 blocks). Math is
float32 with the reference's rounding points (silu rounded to the input dtype, then the
product), so low-precision results match `F.silu(gate) * up` and
`F.gelu(gate, approximate="tanh") * up`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


# read by a @jit function: a tl.constexpr instance (the GPU compiler refuses a plain float)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _gated_act_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    inter,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,  # False: silu
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptr = x_ptr + row * x_row_stride + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + inter, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GELU_TANH:
        # 0.5 x (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3) is x * sigmoid(2y):
        # the same value without 1 + tanh's cancellation for negative x; exp overflowing
        # to inf gives -0, as silu does.
        inner = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = (gate / (1.0 + tl.exp(-2.0 * inner))).to(dtype).to(tl.float32)
    else:
        # torch's silu: x / (1 + exp(-x)) in fp32, rounded to the input dtype; exp(-x) = inf
        # for x < -88 gives -0, as in torch.
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _gated_act_triton(x, gelu_tanh=False)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _gated_act_triton(x, gelu_tanh=True)


def _gated_act_triton(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
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
    _gated_act_kernel[grid](
        x2, out, x2.stride(0), inter, BLOCK=block, GELU_TANH=gelu_tanh, num_warps=4
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0, "input is [..., 2 * intermediate]"
    if x.is_cuda:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0, "input is [..., 2 * intermediate]"
    if x.is_cuda:
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)
