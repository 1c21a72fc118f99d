"""Rotary position embedding, NeoX style (rotate_half), from a precomputed cos/sin table.

`cos_sin_cache` is `[max_positions, rotary_dim]`: the first half holds cos, the second
sin, of `position * inv_freq` (already multiplied by any attention scaling the RoPE
variant defines). The table is built by `runner.models.rope`, which knows the variants.

Device path: one Triton program per token rotates all its q and k heads (16 + 8 heads x
128 for Qwen3-0.6B), reading the token's cos/sin row once. It writes fresh outputs and
never the inputs, which may be strided views of the fused QKV projection. Math is float32
with the reference's rounding points (cos/sin cast to the input dtype, each product and
the sum rounded to it) and FP fusion off, so results are bit-identical to the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32: cos half | sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).unsqueeze(1).to(q.dtype)
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@triton.jit
def _rotate_heads(
    src_ptr,  # this token's first head
    dst_ptr,
    src_head_stride,
    num_heads,
    half,
    cos,  # [BLOCK_HALF] float32, already rounded through the input dtype
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (cols < half)[None, :]
    src = src_ptr + heads[:, None] * src_head_stride + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    c = cos[None, :]
    s = sin[None, :]
    # rotate_half(x) = [-x2, x1]: out = [x1 c - x2 s, x2 c + x1 s], each product and each
    # sum rounded to the input dtype as torch does.
    out1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    out2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    dst = dst_ptr + heads[:, None] * (2 * half) + cols[None, :]
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + half, out2.to(dtype), mask=mask)


@triton.jit
def _apply_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_cache_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cos_sin_stride,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    row = cos_sin_cache_ptr + pos * cos_sin_stride
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(row + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + half + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
    head_dim = 2 * half
    _rotate_heads(
        q_ptr + t * q_token_stride,
        q_out_ptr + t * num_q_heads * head_dim,
        q_head_stride,
        num_q_heads,
        half,
        cos,
        sin,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + t * k_token_stride,
        k_out_ptr + t * num_k_heads * head_dim,
        k_head_stride,
        num_k_heads,
        half,
        cos,
        sin,
        BLOCK_HK,
        BLOCK_HALF,
    )


def apply_rope_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32: cos half | sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    assert q.dim() == 3 and k.dim() == 3, "q is [T, Hq, D] and k is [T, Hk, D]"
    assert q.shape[0] == k.shape[0] == positions.numel(), "one position per token"
    assert q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[1], "rope covers the full head dim"
    assert q.shape[-1] % 2 == 0, f"head_dim must be even, got {q.shape[-1]}"
    assert q.dtype == k.dtype and q.dtype.is_floating_point, "q and k share a float dtype"
    assert q.stride(2) == 1 and k.stride(2) == 1, "each head's D values must be contiguous"
    assert positions.dim() == 1 and positions.is_contiguous(), "positions is contiguous [T]"
    assert positions.dtype in (torch.int32, torch.int64), "positions must be int32/int64"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1, (
        "cos_sin_cache is [max_positions, D] with contiguous rows"
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_hq = triton.next_power_of_2(num_q_heads)
    block_hk = triton.next_power_of_2(num_k_heads)
    block_half = triton.next_power_of_2(half)
    # 16 q heads x 64 = 1024 elements per half-tile: 4 warps, 8 values per thread.
    num_warps = 4 if block_hq * block_half <= 2048 else 8
    _apply_rope_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        num_k_heads,
        half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        num_warps=num_warps,
        # LLVM narrows the float32 ops to bf16/fp16 ones (legal: a product of two bf16 is
        # exact in fp32), and FP fusion would then contract `x1*c - x2*s` into one fma,
        # skipping the product's rounding: 1.8% of bf16 outputs one ulp off the reference
        # (seen on an H200 with triton 3.6). Without fusion every op rounds as torch's do.
        enable_fp_fusion=False,
    )
    return q_out, k_out


def apply_rope(q, k, positions, cos_sin_cache):
    assert q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[1], "rope covers the full head dim"
    if q.is_cuda:
        return apply_rope_triton(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)
