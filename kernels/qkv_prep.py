"""Attention input preparation in one pass: split the fused QKV projection, apply the
per-head q/k RMSNorm (Qwen3; absent for Llama), rotate q and k, write k and v to the cache.

`prepare_qkv_ref` is the spec: it is literally the sequence the model ran before this
kernel existed (`rms_norm_ref` per head, `apply_rope_ref`, `write_kv_ref`), and it is the
CPU path. The Triton kernel does the same in one launch instead of four (q norm, k norm,
rope, KV write): one program per token reads its QKV row once, keeps each head as two
halves in registers (the halves rope pairs up; the norm's sum of squares covers both),
and writes the rotated q plus the cache slot. At 32 decode rows these four launches were
~1.5 us each of pure launch cost per layer; in an eager prefill step each is also ~30 us
of Python launch overhead on the host (H200 profile, benchmarks/profile_step.py).

Rounding follows the references point by point (float32 math; the normed value, its
product with the weight, each rope product and sum rounded to the input dtype) with FP
fusion off, so outputs are bit-identical to the spec's.

With `scale_rows` (the folded-norm decode chain, runner/models/norm_fold.py) the
projection was computed from the un-normalised residual stream: each token's q, k and v
are first multiplied by its RMSNorm factor and rounded to the dtype, as if a norm had run
before the projection (the spec scales the rows, then runs the sequence above).

An FP8 cache (kernels/fp8_kv.py) takes `k / k_scale` and `v / v_scale` as float8 bytes.

What this module does not know: the cache's block structure beyond `slot // block_size`,
or which tokens are real (slot -1 writes nothing; its q is computed and ignored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention import write_kv_ref
from pdserve.kernels.fp8_kv import cache_value, inverse_scale, is_fp8, store_target
from pdserve.kernels.norm import gemma_style, rms_norm_ref
from pdserve.kernels.rope import apply_rope_ref
from pdserve.kernels.row_squares import SQ_ROWS, ScaleRows, row_scale, row_scale_ref


def prepare_qkv_ref(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D] fused projection output
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,  # [D], with k_norm_weight, or both None
    k_norm_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32: cos half | sin half
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], updated in place
    slot_mapping: torch.Tensor,  # [T'] int64, T' <= T, -1 = skip
    scale_rows: ScaleRows | None = None,  # qkv is the projection of un-normalised rows
    bias: torch.Tensor | None = None,  # [(Hq + 2 Hkv) * D], with scale_rows: not yet added
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
) -> torch.Tensor:
    """-> q [T, Hq, D], normed and rotated; k (normed, rotated) and v land in the cache."""
    t = qkv.shape[0]
    assert bias is None or scale_rows is not None, "an unadded bias comes with scale_rows"
    if scale_rows is not None:
        scaled = qkv.float() * row_scale_ref(scale_rows, t)[:, None]
        qkv = (scaled if bias is None else scaled + bias.float()).to(qkv.dtype)
    d = kv_cache.shape[-1]
    q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = q.reshape(t, num_q_heads, d)
    k = k.reshape(t, num_kv_heads, d)
    v = v.reshape(t, num_kv_heads, d)
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    q, k = apply_rope_ref(q, k, positions, cos_sin_cache)
    write_kv_ref(k, v, kv_cache, slot_mapping, scales)
    return q


@triton.jit
def _norm_rope_halves(
    x1,  # [BLOCK_H, BLOCK_HALF] float32, first half of each head (masked lanes 0)
    x2,
    w_ptr,
    cols,
    col_mask,
    cos,  # [BLOCK_HALF] float32, already rounded through the input dtype
    sin,
    head_dim,
    eps,
    dtype: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr,  # False: Gemma's float32 product, rounded once (norm.py)
):
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / head_dim
        inv = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + head_dim // 2 + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        # weight * normed.to(dtype), rounded to the dtype (the weight's, the model's)
        x1 = x1 * inv
        x2 = x2 * inv
        if ROUND_NORMED:
            x1 = x1.to(dtype).to(tl.float32)
            x2 = x2.to(dtype).to(tl.float32)
        x1 = (x1 * w1).to(dtype).to(tl.float32)
        x2 = (x2 * w2).to(dtype).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # rotate_half(x) = [-x2, x1]; each product and each sum rounded as torch rounds them.
    out1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    out2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _load_part(row_ptr, offs, mask, bias_ptr, scale, SCALE_ROWS: tl.constexpr,
               HAS_BIAS: tl.constexpr):  # fmt: skip
    """Values `offs` of a token's qkv row in float32. With SCALE_ROWS (the projection of an
    un-normalised row) times the row's RMSNorm factor, plus the bias at the same offsets
    (HAS_BIAS: the projection ran without it), rounded once through the dtype."""
    x = tl.load(row_ptr + offs, mask=mask, other=0.0)
    if SCALE_ROWS:
        y = x.to(tl.float32) * scale
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return y.to(x.dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def prepare_heads(
    qkv_ptr, q_out_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, cos_sin_ptr, kv_cache_ptr,
    slot_mapping_ptr, sq_ptr, bias_ptr,
    t,  # the token (int64)
    q_first, q_count,  # its q heads q_first .. q_first + q_count - 1 (<= BLOCK_HQ)
    kv_first, kv_count,  # its k / v heads (<= BLOCK_HK)
    num_slots, num_sq_parts, sq_dim, sq_eps, qkv_token_stride, cos_sin_stride,
    cache_block_stride, cache_kv_stride, cache_offset_stride, cache_head_stride, block_size,
    eps, k_inv_scale, v_inv_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, ROUND_NORMED: tl.constexpr, SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SQ_PARTS_PAD: tl.constexpr, SQ_STRIDE: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # 0: the cache's own dtype; else kv_cache_ptr is its bytes
):  # fmt: skip
    """One token's q heads -> q_out, its k / v heads -> the cache slot: the kernel's body,
    shared with the decode attention that prepares its own heads (kernels/qkv_attend.py)."""
    half: tl.constexpr = HEAD_DIM // 2
    dtype = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cs_row = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(cs_row + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cs_row + half + cols, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
    row = qkv_ptr + t * qkv_token_stride
    scale = 1.0
    if SCALE_ROWS:  # this token's RMSNorm factor (one row of the squares: [1] -> scalar)
        only = tl.arange(0, 1)
        scale = tl.sum(row_scale(sq_ptr, t + only, only < 1, num_sq_parts, sq_dim, sq_eps,
                                 SQ_PARTS_PAD, SQ_STRIDE), 0)  # fmt: skip

    # q: [Hq, D] at the start of the row -> q_out[t]
    qh = q_first + tl.arange(0, BLOCK_HQ)
    q_mask = (tl.arange(0, BLOCK_HQ) < q_count)[:, None] & col_mask[None, :]
    q_offs = qh[:, None] * HEAD_DIM + cols[None, :]
    q1 = _load_part(row, q_offs, q_mask, bias_ptr, scale, SCALE_ROWS, HAS_BIAS)
    q2 = _load_part(row, q_offs + half, q_mask, bias_ptr, scale, SCALE_ROWS, HAS_BIAS)
    q1, q2 = _norm_rope_halves(
        q1, q2, q_norm_ptr, cols, col_mask, cos, sin, HEAD_DIM, eps, dtype, HAS_NORM, ROUND_NORMED
    )
    q_dst = q_out_ptr + t * (NUM_Q_HEADS * HEAD_DIM) + qh[:, None] * HEAD_DIM + cols[None, :]
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + half, q2, mask=q_mask)

    # k, v: [Hkv, D] each, after q -> the cache slot (pads and tokens past the slot
    # mapping store nothing). The loads do not wait for the slot: only the stores need it.
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
    kh = kv_first + tl.arange(0, BLOCK_HK)
    k_mask = (tl.arange(0, BLOCK_HK) < kv_count)[:, None] & col_mask[None, :]
    k_offs = (NUM_Q_HEADS + kh[:, None]) * HEAD_DIM + cols[None, :]
    k1 = _load_part(row, k_offs, k_mask, bias_ptr, scale, SCALE_ROWS, HAS_BIAS)
    k2 = _load_part(row, k_offs + half, k_mask, bias_ptr, scale, SCALE_ROWS, HAS_BIAS)
    k1, k2 = _norm_rope_halves(
        k1, k2, k_norm_ptr, cols, col_mask, cos, sin, HEAD_DIM, eps, dtype, HAS_NORM, ROUND_NORMED
    )
    v_offs = k_offs + NUM_KV_HEADS * HEAD_DIM
    v1 = _load_part(row, v_offs, k_mask, bias_ptr, scale, SCALE_ROWS, HAS_BIAS)
    v2 = _load_part(row, v_offs + half, k_mask, bias_ptr, scale, SCALE_ROWS, HAS_BIAS)
    # int64: num_blocks * block_size * Hkv * D passes 2^31 on a large cache.
    base = (slot // block_size) * cache_block_stride + (slot % block_size) * cache_offset_stride
    dst = kv_cache_ptr + base + kh[:, None] * cache_head_stride + cols[None, :]
    cache_dtype = kv_cache_ptr.dtype.element_ty
    live = tl.where(slot >= 0, kv_count, 0)
    w_mask = (tl.arange(0, BLOCK_HK) < live)[:, None] & col_mask[None, :]
    tl.store(dst, cache_value(k1, k_inv_scale, cache_dtype, FP8_MANTISSA), mask=w_mask)
    tl.store(dst + half, cache_value(k2, k_inv_scale, cache_dtype, FP8_MANTISSA), mask=w_mask)
    v1 = cache_value(v1, v_inv_scale, cache_dtype, FP8_MANTISSA)
    v2 = cache_value(v2, v_inv_scale, cache_dtype, FP8_MANTISSA)
    tl.store(dst + cache_kv_stride, v1, mask=w_mask)
    tl.store(dst + cache_kv_stride + half, v2, mask=w_mask)


# num_slots follows the step's token count: not specialised on (no variant per value class).
@triton.jit(do_not_specialize=["num_slots"])
def _prepare_qkv_kernel(
    qkv_ptr, q_out_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, cos_sin_ptr, kv_cache_ptr,
    slot_mapping_ptr,
    sq_ptr,  # [num_sq_parts, SQ_STRIDE] fp32 row sums of squares (SCALE_ROWS)
    bias_ptr,  # [(Hq + 2 Hkv) * D] the projection's bias, not yet added (SCALE_ROWS only)
    num_slots, num_sq_parts, sq_dim, sq_eps, qkv_token_stride, cos_sin_stride,
    cache_block_stride, cache_kv_stride, cache_offset_stride, cache_head_stride, block_size,
    eps, k_inv_scale, v_inv_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, ROUND_NORMED: tl.constexpr, SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SQ_PARTS_PAD: tl.constexpr, SQ_STRIDE: tl.constexpr,
    SPLIT_HEADS: tl.constexpr,  # grid (T, Hq + Hkv): one q head, or one k and v head, each
    FP8_MANTISSA: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    if SPLIT_HEADS:
        j = tl.program_id(1)
        is_q = j < NUM_Q_HEADS
        q_first, q_count = j, tl.where(is_q, 1, 0)
        kv_first, kv_count = j - NUM_Q_HEADS, tl.where(is_q, 0, 1)
    else:
        q_first, q_count = 0, NUM_Q_HEADS
        kv_first, kv_count = 0, NUM_KV_HEADS
    prepare_heads(
        qkv_ptr, q_out_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, cos_sin_ptr, kv_cache_ptr,
        slot_mapping_ptr, sq_ptr, bias_ptr, t, q_first, q_count, kv_first, kv_count,
        num_slots, num_sq_parts, sq_dim, sq_eps, qkv_token_stride, cos_sin_stride,
        cache_block_stride, cache_kv_stride, cache_offset_stride, cache_head_stride,
        block_size, eps, k_inv_scale, v_inv_scale, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
        BLOCK_HQ, BLOCK_HK, BLOCK_HALF, HAS_NORM, ROUND_NORMED, SCALE_ROWS, HAS_BIAS,
        SQ_PARTS_PAD, SQ_STRIDE, FP8_MANTISSA,
    )  # fmt: skip


SPLIT_HEADS_MAX_TOKENS = 64  # up to this many tokens a program takes one head, not a token


def prep_launch(
    qkv, q, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, positions,
    cos_sin_cache, kv_cache, slot_mapping, scale_rows: ScaleRows | None,
    bias: torch.Tensor | None, scales: tuple[float, float], block_hq: int, block_hk: int,
) -> tuple[tuple, dict]:  # fmt: skip
    """`prepare_heads`' arguments for q [T, Hq, D] (checked): (runtime values, constexprs)."""
    _check(qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, positions,
           cos_sin_cache, kv_cache, slot_mapping)  # fmt: skip
    assert scale_rows is None or qkv.shape[0] <= SQ_ROWS, (
        f"scaled rows come from a decode batch of <= {SQ_ROWS} tokens, got {qkv.shape[0]}"
    )
    assert bias is None or (scale_rows is not None and bias.shape == qkv.shape[1:]
                            and bias.is_contiguous()), "a bias comes with scale_rows, one per column"  # fmt: skip
    sq = None if scale_rows is None else scale_rows.squares
    has_norm = q_norm_weight is not None
    target, fp8_mantissa = store_target(kv_cache)
    args = (
        qkv, q, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        positions, cos_sin_cache, target, slot_mapping, qkv if sq is None else sq.buf,
        qkv if bias is None else bias,
        slot_mapping.numel(), 1 if sq is None else sq.parts, 1 if sq is None else sq.dim,
        0.0 if sq is None else scale_rows.eps, qkv.stride(0),
        cos_sin_cache.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), kv_cache.shape[2], eps, inverse_scale(scales[0]),
        inverse_scale(scales[1]),
    )  # fmt: skip
    consts = dict(
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=kv_cache.shape[-1],
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        BLOCK_HALF=triton.next_power_of_2(kv_cache.shape[-1] // 2), HAS_NORM=has_norm,
        ROUND_NORMED=not (has_norm and gemma_style(qkv, q_norm_weight)),
        SCALE_ROWS=sq is not None, HAS_BIAS=bias is not None,
        SQ_PARTS_PAD=1 if sq is None else sq.parts_pad, SQ_STRIDE=SQ_ROWS,
        FP8_MANTISSA=fp8_mantissa,
    )  # fmt: skip
    return args, consts


def prepare_qkv_triton(
    qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, positions,
    cos_sin_cache, kv_cache, slot_mapping, scale_rows: ScaleRows | None = None,
    bias: torch.Tensor | None = None, scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:  # fmt: skip
    num_tokens = qkv.shape[0]
    head_dim = kv_cache.shape[-1]
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    # A decode batch has too few tokens to fill the GPU with one program each (32 programs
    # ran ~3 us a layer at 32 rows, its loads in a chain): one program per head there.
    split = num_tokens <= SPLIT_HEADS_MAX_TOKENS
    block_hq = 1 if split else triton.next_power_of_2(num_q_heads)
    block_hk = 1 if split else triton.next_power_of_2(num_kv_heads)
    args, consts = prep_launch(
        qkv, q, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, positions,
        cos_sin_cache, kv_cache, slot_mapping, scale_rows, bias, scales, block_hq, block_hk,
    )  # fmt: skip
    if num_tokens == 0:
        return q
    grid = (num_tokens, num_q_heads + num_kv_heads if split else 1)
    half = consts["BLOCK_HALF"]
    _prepare_qkv_kernel[grid](
        *args, **consts, SPLIT_HEADS=split,
        # 16 q heads x 64 = 1024 values per half: 4 warps, 8 per thread; one head: 1 warp.
        num_warps=1 if split else 4 if block_hq * half <= 2048 else 8,
        # See rope.py: fusion would contract a rope product into an fma and skip its
        # rounding, one ulp off the reference on ~2% of bf16 outputs.
        enable_fp_fusion=False,
    )  # fmt: skip
    return q


def _check(qkv, hq, hkv, qw, kw, positions, cos_sin_cache, kv_cache, slot_mapping) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, "a layer's cache is [NB, 2, BS, Hkv, D]"
    d = kv_cache.shape[-1]
    assert kv_cache.shape[3] == hkv, f"cache has {kv_cache.shape[3]} kv heads, not {hkv}"
    assert qkv.dim() == 2 and qkv.shape[1] == (hq + 2 * hkv) * d, (
        f"qkv is [T, (Hq + 2 Hkv) * D] = [T, {(hq + 2 * hkv) * d}], got {tuple(qkv.shape)}"
    )
    assert qkv.stride(1) == 1 and kv_cache.stride(4) == 1, (
        "rows of qkv and the cache's D are contiguous"
    )
    assert d % 2 == 0 and cos_sin_cache.shape[1] == d, "rope covers the full, even head dim"
    assert (qw is None) == (kw is None), "q and k norms come together"
    assert qw is None or (
        qw.numel() == d and kw.numel() == d and qw.is_contiguous() and kw.is_contiguous()
    )
    assert positions.dim() == 1 and positions.numel() == qkv.shape[0], "one position per token"
    assert positions.is_contiguous() and cos_sin_cache.stride(1) == 1
    assert slot_mapping.dim() == 1 and slot_mapping.is_contiguous()
    assert slot_mapping.numel() <= qkv.shape[0], "at most one slot per token"
    assert qkv.dtype == kv_cache.dtype or is_fp8(kv_cache.dtype), (
        f"qkv {qkv.dtype} and cache {kv_cache.dtype} dtypes differ"
    )


def prepare_qkv(
    qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, positions,
    cos_sin_cache, kv_cache, slot_mapping, scale_rows: ScaleRows | None = None,
    bias: torch.Tensor | None = None, scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:  # fmt: skip
    fn = prepare_qkv_triton if qkv.is_cuda else prepare_qkv_ref
    return fn(qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, positions,
              cos_sin_cache, kv_cache, slot_mapping, scale_rows, bias, scales)  # fmt: skip
