"""The folded decode chain's qkv projection with the attention-input preparation as its
epilogue: one launch where there were two (cuBLAS, then kernels/qkv_prep.py).

In a 32-row decode layer the qkv GEMM (8 MB of weights) took ~5.1 us and the preparation
(q/k RMSNorm, RoPE, the KV write) ~2.7 us more, nearly all of it launch and dependent
round trips (H200 step timeline, results/step_gaps_32_f82cd46_timeline.json). Here a
program owns one head's 128 output features and a slice of K, as the skinny linear
(kernels/skinny_linear.py) owns its output tiles: it streams the head's weight rows as two
halves (the dims RoPE pairs up: d and d + D/2) against the transposed input, the last of a
head's split programs to arrive sums the partials in split order, and then it has the
whole head for all rows in registers: scale each row by its RMSNorm factor, add the bias,
round; then for a q or k head the per-head RMSNorm and RoPE, and for k and v the store to
the row's cache slot. The positions, cos/sin, slots and norm weights are loaded before
the K loop: they are complete at launch.

The spec is `qkv_linear_ref`: `scaled_linear_ref` (the product in fp32, times the row's
factor, plus the bias, rounded once) followed by `prepare_qkv_ref` without a scale. It
differs from the unfused pair only in that pair's extra rounding of the raw product to
the dtype before the scale. The epilogue rounds where prepare_qkv rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.qkv_prep import _check, prepare_qkv_ref
from pdserve.kernels.row_squares import SQ_ROWS, ScaleRows, row_scale
from pdserve.kernels.skinny_linear import MAX_ROWS, _dot, scaled_linear_ref
from pdserve.kernels.workspace import KernelWorkspace


def qkv_linear_ref(
    x: torch.Tensor,  # [T, hidden] un-normalised residual stream rows
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, hidden] (norm-folded) qkv projection
    bias: torch.Tensor | None,
    scale: ScaleRows,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """-> q [T, Hq, D]; k and v land in the cache (see the module docstring)."""
    qkv = scaled_linear_ref(x, weight, bias, scale)
    return prepare_qkv_ref(qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight,
                           eps, positions, cos_sin_cache, kv_cache, slot_mapping)  # fmt: skip


@triton.jit
def _head_norm(x1, x2, w_ptr, offs_h, h_mask, head_dim, eps, dtype: tl.constexpr):
    """prepare_qkv's per-head RMSNorm on [HALF, M] halves (the head's dims on axis 0)."""
    variance = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / head_dim
    inv = tl.rsqrt(variance + eps)[None, :]
    w1 = tl.load(w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)[:, None]
    w2 = tl.load(w_ptr + head_dim // 2 + offs_h, mask=h_mask, other=0.0).to(tl.float32)[:, None]
    x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1, x2


@triton.jit
def _rope(x1, x2, cos, sin, dtype: tl.constexpr):
    """rotate_half RoPE on [HALF, M] halves, each product and sum rounded as torch does."""
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1, out2


@triton.jit(do_not_specialize=["num_rows", "num_slots"])
def _qkv_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [(Hq + 2 Hkv) * D, K]
    bias_ptr,  # [(Hq + 2 Hkv) * D] or unused
    q_out_ptr,  # [M, Hq, D]
    kv_cache_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    q_norm_ptr,
    k_norm_ptr,
    positions_ptr,  # [M] int64
    cos_sin_ptr,  # [max_positions, D] float32: cos half | sin half
    slot_mapping_ptr,  # [num_slots] int64, -1 = skip
    sq_ptr,  # [num_sq_parts, SQ_STRIDE] fp32 row sums of squares
    part_ptr,  # [SPLIT_K, 2, M_PAD, heads * HALF] fp32 workspace (SPLIT_K > 1)
    count_ptr,  # [heads] int32 arrival counters, zero between launches
    num_rows,
    num_slots,
    k,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    cos_sin_stride,
    cache_block_stride,
    cache_kv_stride,
    cache_offset_stride,
    cache_head_stride,
    block_size,
    num_sq_parts,
    sq_dim,
    sq_eps,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SQ_PARTS_PAD: tl.constexpr,
    SQ_STRIDE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    head = tl.program_id(0)
    pid_k = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    num_heads: tl.constexpr = NUM_Q_HEADS + 2 * NUM_KV_HEADS
    dtype = q_out_ptr.dtype.element_ty
    offs_h = tl.arange(0, HALF_PAD)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    h_mask = offs_h < half
    m_mask = offs_m < num_rows
    tile_mask = h_mask[:, None] & m_mask[None, :]
    rows1 = head * HEAD_DIM + offs_h  # the head's first half of weight rows
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    w1_ptrs = w_ptr + rows1[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]

    # Everything the epilogue needs but the product, loaded before the K loop.
    inv = row_scale(sq_ptr, offs_m, m_mask, num_sq_parts, sq_dim, sq_eps, SQ_PARTS_PAD,
                    SQ_STRIDE)  # fmt: skip
    if HAS_BIAS:
        b1 = tl.load(bias_ptr + rows1, mask=h_mask, other=0.0).to(tl.float32)
        b2 = tl.load(bias_ptr + rows1 + half, mask=h_mask, other=0.0).to(tl.float32)
    pos = tl.load(positions_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    cs = cos_sin_ptr + pos[None, :] * cos_sin_stride + offs_h[:, None]
    cos = tl.load(cs, mask=tile_mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cs + half, mask=tile_mask, other=0.0).to(dtype).to(tl.float32)
    slot = tl.load(slot_mapping_ptr + offs_m, mask=offs_m < num_slots, other=-1).to(tl.int64)

    acc1 = tl.zeros([HALF_PAD, M_PAD], dtype=tl.float32)
    acc2 = tl.zeros([HALF_PAD, M_PAD], dtype=tl.float32)
    for step in range(tl.cdiv(tl.minimum(k_per_split, k - k_start), BLOCK_K)):
        if EVEN_K:
            w_mask = h_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            k_mask = offs_k < k - k_start - step * BLOCK_K
            w_mask = h_mask[:, None] & k_mask[None, :]
            x_mask = m_mask[:, None] & k_mask[None, :]
        xs = tl.load(x_ptrs, mask=x_mask, other=0.0)
        w1 = tl.load(w1_ptrs, mask=w_mask, other=0.0)
        acc1 = _dot(w1, xs, acc1, IEEE_DOT)
        w2 = tl.load(w1_ptrs + half * stride_wn, mask=w_mask, other=0.0)
        acc2 = _dot(w2, xs, acc2, IEEE_DOT)
        w1_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    if SPLIT_K > 1:
        # [SPLIT_K, 2, M_PAD, heads * HALF_PAD]; the last of the head's programs to arrive
        # sums them in split order (see kernels/skinny_linear.py).
        width = num_heads * HALF_PAD
        tile = offs_m[None, :].to(tl.int64) * width + (head * HALF_PAD + offs_h)[:, None]
        base = part_ptr + pid_k * 2 * M_PAD * width + tile
        tl.store(base, acc1)
        tl.store(base + M_PAD * width, acc2)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + head, 1, sem="acq_rel")
        if arrived != SPLIT_K - 1:
            return
        acc1 = tl.zeros([HALF_PAD, M_PAD], dtype=tl.float32)
        acc2 = tl.zeros([HALF_PAD, M_PAD], dtype=tl.float32)
        for s in range(SPLIT_K):
            src = part_ptr + s * 2 * M_PAD * width + tile
            acc1 += tl.load(src, cache_modifier=".cg")
            acc2 += tl.load(src + M_PAD * width, cache_modifier=".cg")
        tl.store(count_ptr + head, 0)

    # scaled_linear_ref: times the row's factor, plus the bias, rounded once.
    x1 = acc1 * inv[None, :]
    x2 = acc2 * inv[None, :]
    if HAS_BIAS:
        x1 += b1[:, None]
        x2 += b2[:, None]
    x1 = x1.to(dtype).to(tl.float32)
    x2 = x2.to(dtype).to(tl.float32)
    cache_dtype = kv_cache_ptr.dtype.element_ty
    cache_base = (slot // block_size) * cache_block_stride + (
        slot % block_size
    ) * cache_offset_stride
    live = tile_mask & (slot >= 0)[None, :]
    if head < NUM_Q_HEADS:
        if HAS_NORM:
            x1, x2 = _head_norm(x1, x2, q_norm_ptr, offs_h, h_mask, HEAD_DIM, eps, dtype)
        x1, x2 = _rope(x1, x2, cos, sin, dtype)
        dst = (q_out_ptr + offs_m[None, :].to(tl.int64) * (NUM_Q_HEADS * HEAD_DIM)
               + head * HEAD_DIM + offs_h[:, None])  # fmt: skip
        tl.store(dst, x1.to(dtype), mask=tile_mask)
        tl.store(dst + half, x2.to(dtype), mask=tile_mask)
    elif head < NUM_Q_HEADS + NUM_KV_HEADS:
        if HAS_NORM:
            x1, x2 = _head_norm(x1, x2, k_norm_ptr, offs_h, h_mask, HEAD_DIM, eps, dtype)
        x1, x2 = _rope(x1, x2, cos, sin, dtype)
        dst = (kv_cache_ptr + cache_base[None, :]
               + (head - NUM_Q_HEADS) * cache_head_stride + offs_h[:, None])  # fmt: skip
        tl.store(dst, x1.to(cache_dtype), mask=live)
        tl.store(dst + half, x2.to(cache_dtype), mask=live)
    else:
        dst = (kv_cache_ptr + cache_kv_stride + cache_base[None, :]
               + (head - NUM_Q_HEADS - NUM_KV_HEADS) * cache_head_stride + offs_h[:, None])  # fmt: skip
        tl.store(dst, x1.to(cache_dtype), mask=live)
        tl.store(dst + half, x2.to(cache_dtype), mask=live)


def choose_split(k: int, block_k: int = 128) -> int:
    """K slices per head: 4 at the Qwen3-0.6B shape (1024 = 4 x 2 steps of 128), so that
    its 32 heads run as 128 programs; never a slice under 2 steps."""
    split = 1
    while split < 4 and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def qkv_linear_triton(
    x, weight, bias, scale: ScaleRows, num_q_heads, num_kv_heads, q_norm_weight,
    k_norm_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping,
    workspace: KernelWorkspace, split_k: int | None = None, block_k: int = 128,
    num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:  # fmt: skip
    """`qkv_linear_ref` in one launch, for a decode batch of <= MAX_ROWS rows."""
    num_rows, k = x.shape
    d = kv_cache.shape[-1]
    heads = num_q_heads + 2 * num_kv_heads
    assert 0 < num_rows <= MAX_ROWS, f"the fused qkv takes 1..{MAX_ROWS} rows, got {num_rows}"
    assert weight.shape == (heads * d, k) and x.stride(1) == 1 and weight.stride(1) == 1
    assert bias is None or (bias.shape == (heads * d,) and bias.is_contiguous())
    assert x.dtype == weight.dtype == kv_cache.dtype, "x, weight and cache share a dtype"
    q = torch.empty((num_rows, num_q_heads, d), dtype=x.dtype, device=x.device)
    # prepare_qkv's input checks, on the shape its qkv input would have had.
    _check(torch.empty((num_rows, heads * d), dtype=x.dtype, device="meta"), num_q_heads,
           num_kv_heads, q_norm_weight, k_norm_weight, positions, cos_sin_cache, kv_cache,
           slot_mapping)  # fmt: skip
    split = split_k or choose_split(k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    m_pad = max(16, triton.next_power_of_2(num_rows))
    half_pad = triton.next_power_of_2(d // 2)
    if split > 1:
        part = workspace.scratch("qkv_linear", split * 2 * max(m_pad, MAX_ROWS) * heads * half_pad,
                                 x.device)  # fmt: skip
        counters = workspace.counters("qkv_linear", heads, x.device)
    else:
        part = counters = q  # unused
    sq = scale.squares
    has_norm = q_norm_weight is not None
    _qkv_linear_kernel[(heads, split)](
        x, weight, bias if bias is not None else q, q, kv_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else q, positions,
        cos_sin_cache, slot_mapping, sq.buf, part, counters, num_rows, slot_mapping.numel(),
        k, k_per_split, x.stride(0), weight.stride(0), cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2], sq.parts, sq.dim, scale.eps, eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, HALF_PAD=half_pad,
        HAS_NORM=has_norm, HAS_BIAS=bias is not None, SQ_PARTS_PAD=sq.parts_pad,
        SQ_STRIDE=SQ_ROWS, SPLIT_K=split, EVEN_K=k % k_per_split == 0, M_PAD=m_pad,
        BLOCK_K=block_k, IEEE_DOT=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False,  # rounding as prepare_qkv's (see kernels/rope.py)
    )  # fmt: skip
    return q


def qkv_linear(
    x, weight, bias, scale: ScaleRows, num_q_heads, num_kv_heads, q_norm_weight,
    k_norm_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping,
    workspace: KernelWorkspace,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernel on CUDA, the spec elsewhere."""
    args = (x, weight, bias, scale, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight,
            eps, positions, cos_sin_cache, kv_cache, slot_mapping)  # fmt: skip
    return qkv_linear_triton(*args, workspace) if x.is_cuda else qkv_linear_ref(*args)
