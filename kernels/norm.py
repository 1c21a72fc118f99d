"""RMSNorm, alone and with the residual add fused in front of it; and Cohere's LayerNorm
(no bias), which is RMSNorm over the row less its mean.

The reference follows transformers' Llama RMSNorm operation for operation (square and
mean in float32, scale by rsqrt, cast back, multiply by the weight), so that CPU float32
results are bit-identical to the transformers oracle. A float32 weight on 16-bit inputs is
Gemma's norm (its `1 + w` kept in float32, runner/models/gemma.py): the product is taken
in float32 and rounded once, to the input's dtype, as transformers' Gemma RMSNorm does.
Cohere's LayerNorm (`layer_norm_ref`) follows transformers' CohereLayerNorm the same way:
mean and variance in float32, the weight's product in float32, rounded once.

Device path: one Triton kernel for both, with the residual add behind a constexpr. Each
program normalises BLOCK_ROWS rows held whole in registers (BLOCK_D >= hidden, one
reduction, no second pass over memory), in float32, rounding at the points the reference
rounds: the sum `x + residual` and the normalised value to the input dtype, the product
with the weight to the output dtype. The LayerNorm is the same kernel with the row's mean
taken away first (a constexpr) and the normalised value left unrounded; its weight may be
`[H, D]`, one row per head of a `[T, H, D]` input (Command R+'s q/k norms). Rows may be a strided `[T, H, D]` view (q/k norm on
the fused QKV projection's output) as long as each row's D values are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def gemma_style(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A float32 weight on 16-bit inputs: the product in float32, rounded once to x's dtype."""
    return weight.dtype == torch.float32 and x.dtype != torch.float32


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    if gemma_style(x, weight):
        return (xf * weight).to(dtype)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the normed input and the new residual."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm: no bias, float32 throughout, rounded once to x's dtype."""
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def fused_add_layer_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer_norm(x + residual), x + residual)."""
    summed = x + residual
    return layer_norm_ref(summed, weight, eps), summed


# num_rows is the step's token count: not specialised on, or each new value class
# (== 1, % 16) would compile a variant mid-serving.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_outer_stride,
    x_inner_stride,
    residual_outer_stride,
    residual_inner_stride,
    num_rows,
    inner,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_NORMED: tl.constexpr,  # False: Gemma's float32 product, rounded once
    CENTER: tl.constexpr,  # the row's mean taken away first: Cohere's LayerNorm
    WEIGHT_PER_INNER: tl.constexpr,  # weight [inner, D]: row i takes row i % inner
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Row i of the [outer, inner, D] input lives at (i // inner, i % inner).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    outer = rows // inner
    within = rows % inner
    x_offs = (outer * x_outer_stride + within * x_inner_stride)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    in_dtype = x_ptr.dtype.element_ty
    # Outputs are fresh contiguous [num_rows, D] tensors.
    out_offs = rows[:, None] * dim + cols[None, :]
    if HAS_RESIDUAL:
        r_offs = (outer * residual_outer_stride + within * residual_inner_stride)[:, None]
        res = tl.load(residual_ptr + r_offs + cols[None, :], mask=mask, other=0.0)
        # The sum of two bf16/fp16 values is exact in fp32, so one rounding matches torch's.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(in_dtype)
        tl.store(residual_out_ptr + out_offs, x, mask=mask)
    xf = x.to(tl.float32)
    # Masked lanes hold 0 and add nothing; divide by the true dim, not BLOCK_D.
    if CENTER:
        mean = tl.sum(xf, axis=1) / dim
        xf = tl.where(mask, xf - mean[:, None], 0.0)  # masked lanes stay out of the sum
    variance = tl.sum(xf * xf, axis=1) / dim
    normed = xf * tl.rsqrt(variance + eps)[:, None]
    if ROUND_NORMED:
        normed = normed.to(in_dtype).to(tl.float32)
    # A product of two bf16/fp16 values is exact in fp32: rounding it once to the output
    # dtype gives torch's correctly rounded product in that dtype.
    if WEIGHT_PER_INNER:
        w = tl.load(weight_ptr + (within * dim)[:, None] + cols[None, :], mask=mask, other=0.0)
        out = normed * w.to(tl.float32)
    else:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
        out = normed * w.to(tl.float32)[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [outer, inner, D] with contiguous D (a view when strides allow, else a copy)."""
    d = x.shape[-1]
    x3 = x.reshape(-1, x.shape[-2], d) if x.dim() >= 3 else x.reshape(-1, 1, d)
    return x3 if x3.stride(2) == 1 else x3.contiguous()


def _launch_rms_norm(x, residual, weight, eps, out, residual_out, center=False) -> None:
    if x.numel() == 0:
        return
    x3 = _rows_view(x)
    r3 = _rows_view(residual) if residual is not None else x3
    num_rows, dim = x3.shape[0] * x3.shape[1], x3.shape[2]
    block_d = triton.next_power_of_2(dim)
    # ~1024 elements per program: one row of hidden 1024, 8 rows of a 128-wide q/k head.
    block_rows = max(1, 1024 // block_d)
    tile = block_rows * block_d
    # 4 warps x 32 lanes x 8 elements = 1024 (16 B bf16 vectors); wider rows get more warps
    # so each thread holds <= 16 fp32 values per operand.
    num_warps = min(16, max(4, tile // 1024))
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x3,
        r3,
        weight,
        out,
        residual_out if residual_out is not None else out,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        num_rows,
        x3.shape[1],
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        ROUND_NORMED=not (center or gemma_style(x, weight)),
        CENTER=center,
        WEIGHT_PER_INNER=weight.dim() == 2,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() >= 1 and weight.dim() == 1, "x is [..., D] and weight is [D]"
    assert x.shape[-1] == weight.shape[0], "weight has one scale per feature"
    assert weight.is_contiguous(), "weight must be contiguous"
    assert x.dtype.is_floating_point and weight.dtype.is_floating_point, (
        f"x ({x.dtype}) and weight ({weight.dtype}) must be floating point"
    )


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The reference's: x's for Gemma's norm, else the promotion of `weight * normed`."""
    return x.dtype if gemma_style(x, weight) else torch.promote_types(x.dtype, weight.dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_norm_args(x, weight)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the normed input and the new residual."""
    return _fused_add(x, residual, weight, eps, _out_dtype(x, weight), center=False)


def _fused_add(x, residual, weight, eps, out_dtype, center: bool):
    _check_norm_args(x, weight)
    assert x.shape == residual.shape, "residual and input have the same shape"
    assert x.dtype == residual.dtype, f"x ({x.dtype}) and residual ({residual.dtype}) differ"
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, residual_out, center)
    return out, residual_out


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight` [D], or [H, D] for x [..., H, D] (one row per head)."""
    if weight.dim() == 2:
        assert x.dim() >= 3 and x.shape[-2:] == weight.shape, "weight [H, D] for x [..., H, D]"
        _check_norm_args(x, weight[0])
        assert weight.is_contiguous(), "weight must be contiguous"
    else:
        _check_norm_args(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None, center=True)
    return out


def fused_add_layer_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer_norm(x + residual), x + residual)."""
    return _fused_add(x, residual, weight, eps, x.dtype, center=True)


def rms_norm(x, weight, eps: float):
    assert x.shape[-1] == weight.shape[0], "weight has one scale per feature"
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float):
    assert x.shape == residual.shape, "residual and input have the same shape"
    if x.is_cuda:
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def layer_norm(x, weight, eps: float):
    assert x.shape[-1] == weight.shape[-1], "weight has one scale per feature"
    if x.is_cuda:
        return layer_norm_triton(x, weight, eps)
    return layer_norm_ref(x, weight, eps)


def fused_add_layer_norm(x, residual, weight, eps: float):
    assert x.shape == residual.shape, "residual and input have the same shape"
    if x.is_cuda:
        return fused_add_layer_norm_triton(x, residual, weight, eps)
    return fused_add_layer_norm_ref(x, residual, weight, eps)
