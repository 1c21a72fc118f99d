"""Decode attention with the q/k/v preparation folded in: one launch where a decode layer
ran two (kernels/qkv_prep.py, then the per-head decode kernel).

At 32 decode rows the preparation kernel was ~2.8 us of a ~45 us layer on the H200
(profile_step_32_step_0f91527), nearly all of it launch and two dependent memory round
trips; its work is tiny. Here the decode program of (row, kv head, slice) does it:

- it reads its row of the fused QKV projection (scaled by the row's RMSNorm factor and
  biased, for the folded-norm chain), and normalises and rotates its group's query heads
  exactly as `prepare_qkv` rounds them;
- the program whose slice ends at the row's newest token also prepares that token's k
  (normed, rotated) and v, attends to it from registers after the loop over the cached
  keys, and writes both into the cache slot for the steps after this one.

So the loop over the cache never reads the slot this step writes, and the cache write
waits for nothing. The cached keys' loop, the splits and their merge are the per-head
kernel's (kernels/attention_parts.py, `merge_splits`).

Rounding: q, k and v are bit-for-bit `prepare_qkv`'s except for the norm's sum of squares,
reduced over the whole head here, over two halves there (float addition in another order:
at most an ulp of the normed value, the tolerance the preparation's own tests allow). The
newest key's score and its share of the output are one more online-softmax step, where the
two-kernel path folds it into the last tile: equal up to fp32 rounding.

Rows are decode rows: row r is token r (`query_start_loc` is `arange(R + 1)`), one query
each. What this module does not know: prefill rows (the caller keeps the two kernels for
mixed steps), the packed and flat decode kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import (
    attend_tile,
    merge_splits,
    row_split_len,
    valid_splits,
)
from pdserve.kernels.paged_attention_triton import (
    LOG2E,
    MIN_SPLIT_KEYS,
    choose_decode_kernel,
    decode_num_splits,
    decode_tiles,
)
from pdserve.kernels.qkv_prep import scale_qkv_part
from pdserve.kernels.row_squares import SQ_ROWS, ScaleRows, row_scale
from pdserve.kernels.workspace import KernelWorkspace


@triton.jit
def _load_heads(row_ptr, first, h_mask, offs_d, d_mask, bias_ptr, HEAD_DIM: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """Raw [H, D_PAD] heads of a qkv row starting at columns `first`, and each value's rope
    partner (the other half's): (x, x's bias, partner, partner's bias); the bias is x
    itself without HAS_BIAS. Loads only, so that they all go out at once."""
    half: tl.constexpr = HEAD_DIM // 2
    mask = h_mask[:, None] & d_mask[None, :]
    offs = first[:, None] + offs_d[None, :]
    p_offs = first[:, None] + ((offs_d + half) % HEAD_DIM)[None, :]
    x = tl.load(row_ptr + offs, mask=mask, other=0.0)
    p = tl.load(row_ptr + p_offs, mask=mask, other=0.0)
    bx = x
    bp = p
    if HAS_BIAS:
        bx = tl.load(bias_ptr + offs, mask=mask, other=0.0)
        bp = tl.load(bias_ptr + p_offs, mask=mask, other=0.0)
    return x, bx, p, bp


@triton.jit
def _norm_rope(x, bx, p, bp, w, wp, cos, sin_signed, scale, eps, HEAD_DIM: tl.constexpr,
               HAS_NORM: tl.constexpr, SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Loaded heads (`_load_heads`) -> [H, D_PAD] float32, scaled and biased, normed
    (HAS_NORM, weights `w` and the partners' `wp`) and rotated with qkv_prep's rounding
    points: x c - p s below the half, x c + p s above (rotate_half)."""
    dtype = x.dtype
    x = scale_qkv_part(x, bx, scale, SCALE_ROWS, HAS_BIAS)
    p = scale_qkv_part(p, bp, scale, SCALE_ROWS, HAS_BIAS)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = ((x * inv).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        p = ((p * inv).to(dtype).to(tl.float32) * wp[None, :]).to(dtype).to(tl.float32)
    c = cos[None, :]
    s = sin_signed[None, :]
    rot = (x * c).to(dtype).to(tl.float32) + (p * s).to(dtype).to(tl.float32)
    return rot.to(dtype)


@triton.jit
def _norm_weights(norm_ptr, offs_d, partner, d_mask, HAS_NORM: tl.constexpr):
    """A q or k norm's weights at each value and at its rope partner, float32 (unused
    placeholders without HAS_NORM)."""
    w = offs_d.to(tl.float32)
    wp = w
    if HAS_NORM:
        w = tl.load(norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        wp = tl.load(norm_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    return w, wp


@triton.jit
def _prepare_row(row_ptr, pos, heads, g_mask, k_first, kv_one, offs_d, d_mask, bias_ptr,
                 q_norm_ptr, k_norm_ptr, cos_sin_ptr, stride_cs, sq_ptr, t, num_sq_parts,
                 sq_dim, sq_eps, eps, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 HAS_NORM: tl.constexpr, SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SQ_PARTS_PAD: tl.constexpr, SQ_STRIDE: tl.constexpr):  # fmt: skip
    """A decode row's attention inputs from its qkv row: the group's query heads
    ([GROUP_PAD, D_PAD]) and the kv head's newest k and v ([1, D_PAD]), in the row's dtype,
    exactly as `prepare_qkv` makes them. All loads go out before any is waited for."""
    half: tl.constexpr = HEAD_DIM // 2
    dtype = row_ptr.dtype.element_ty
    partner = (offs_d + half) % HEAD_DIM
    qx, qbx, qp, qbp = _load_heads(row_ptr, heads * HEAD_DIM, g_mask, offs_d, d_mask,
                                   bias_ptr, HEAD_DIM, HAS_BIAS)  # fmt: skip
    kx, kbx, kp, kbp = _load_heads(row_ptr, k_first, kv_one, offs_d, d_mask, bias_ptr,
                                   HEAD_DIM, HAS_BIAS)  # fmt: skip
    v_offs = (k_first + NUM_KV_HEADS * HEAD_DIM)[:, None] + offs_d[None, :]
    vx = tl.load(row_ptr + v_offs, mask=d_mask[None, :], other=0.0)
    vb = vx
    if HAS_BIAS:
        vb = tl.load(bias_ptr + v_offs, mask=d_mask[None, :], other=0.0)
    qw, qwp = _norm_weights(q_norm_ptr, offs_d, partner, d_mask, HAS_NORM)
    kw, kwp = _norm_weights(k_norm_ptr, offs_d, partner, d_mask, HAS_NORM)
    j = offs_d % half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + j, mask=d_mask, other=0.0)
    scale = 1.0
    if SCALE_ROWS:  # this row's RMSNorm factor: [1] -> scalar
        one = tl.arange(0, 1)
        scale = tl.sum(row_scale(sq_ptr, t + one, one < 1, num_sq_parts, sq_dim, sq_eps,
                                 SQ_PARTS_PAD, SQ_STRIDE), 0)  # fmt: skip
    cos = cos.to(dtype).to(tl.float32)
    sin = tl.where(offs_d < half, -1.0, 1.0) * sin.to(dtype).to(tl.float32)
    q = _norm_rope(qx, qbx, qp, qbp, qw, qwp, cos, sin, scale, eps, HEAD_DIM, HAS_NORM,
                   SCALE_ROWS, HAS_BIAS)  # fmt: skip
    k = _norm_rope(kx, kbx, kp, kbp, kw, kwp, cos, sin, scale, eps, HEAD_DIM, HAS_NORM,
                   SCALE_ROWS, HAS_BIAS)  # fmt: skip
    v = scale_qkv_part(vx, vb, scale, SCALE_ROWS, HAS_BIAS).to(dtype)
    return q, k, v


@triton.jit(do_not_specialize=["min_split_keys", "num_splits", "num_slots"])
def _decode_prep_attention_kernel(
    qkv_ptr,  # [R, (Hq + 2 Hkv) * D] the fused projection, row r = decode row r
    kv_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    bt_ptr,  # [R_pad, max_blocks] int32
    seq_lens_ptr,  # [R_pad] int32, the newest token included
    positions_ptr,  # [R] int64
    cos_sin_ptr,  # [max_positions, D] float32: cos half | sin half ([R, D] if COS_SIN_ROWS)
    slot_ptr,  # [num_slots] int64 cache slot of each row's newest token, -1: none
    q_norm_ptr,  # [D] (HAS_NORM)
    k_norm_ptr,
    sq_ptr,  # [num_sq_parts, SQ_STRIDE] fp32 row sums of squares (SCALE_ROWS)
    bias_ptr,  # [(Hq + 2 Hkv) * D] (HAS_BIAS: not yet added to qkv)
    out_ptr,  # [R, Hq, D]
    part_o_ptr,  # [R, Hq, num_splits, D] fp32 workspace
    part_lse_ptr,  # [R, Hq, num_splits] fp32, log2 domain
    count_ptr,  # [R * Hkv] int32 arrival counters, zero between launches
    qk_scale,
    min_split_keys,
    num_splits,
    num_slots,
    num_sq_parts,
    sq_dim,
    sq_eps,
    eps,
    stride_qkv,
    stride_cs,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    HAS_NORM: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SQ_PARTS_PAD: tl.constexpr,
    SQ_STRIDE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    Q_IN_LOOP: tl.constexpr,
    COS_SIN_ROWS: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    kv_one = tl.arange(0, 1)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    dtype = out_ptr.dtype.element_ty
    t = row.to(tl.int64)
    heads = kv_head * GROUP + offs_g
    k_first = (NUM_Q_HEADS + kv_head + kv_one) * HEAD_DIM
    row_ptr = qkv_ptr + t * stride_qkv
    # The row's length and position go out together; the loop's first K/V loads need only
    # the length.
    seq_len = tl.load(seq_lens_ptr + row)
    if COS_SIN_ROWS:  # row r's cos/sin already at row r: no round trip through its position
        pos = t
    else:
        pos = tl.load(positions_ptr + t).to(tl.int64)
    split_len = row_split_len(seq_len, min_split_keys, num_splits, BLOCK_N)
    key_start = split * split_len
    if (key_start >= seq_len) & (split > 0):  # a slice past the context (never split 0)
        return
    key_end = tl.minimum(key_start + split_len, seq_len)
    # The slice that ends at the newest token takes it from registers, not the cache.
    has_new = (key_end == seq_len) & (seq_len > 0)
    loop_end = tl.where(has_new, key_end - 1, key_end)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + t * stride_bt
    q = tl.zeros([GROUP_PAD, D_PAD], dtype)
    k = tl.zeros([1, D_PAD], dtype)
    v = tl.zeros([1, D_PAD], dtype)
    if not Q_IN_LOOP:
        q, k, v = _prepare_row(
            row_ptr, pos, heads, g_mask, k_first, kv_one < 1, offs_d, d_mask, bias_ptr,
            q_norm_ptr, k_norm_ptr, cos_sin_ptr, stride_cs, sq_ptr, t, num_sq_parts, sq_dim,
            sq_eps, eps, HEAD_DIM, NUM_KV_HEADS, HAS_NORM, SCALE_ROWS, HAS_BIAS, SQ_PARTS_PAD,
            SQ_STRIDE,
        )  # fmt: skip
    for n0 in range(key_start, loop_end, BLOCK_N):
        if Q_IN_LOOP:  # noqa: SIM102 (a constexpr test, then a runtime one)
            # Made in the loop's first step: the pipeline's first K/V loads (issued before
            # the loop) are in flight while the preparation waits for its inputs.
            if n0 == key_start:
                q, k, v = _prepare_row(
                    row_ptr, pos, heads, g_mask, k_first, kv_one < 1, offs_d, d_mask,
                    bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, stride_cs, sq_ptr, t,
                    num_sq_parts, sq_dim, sq_eps, eps, HEAD_DIM, NUM_KV_HEADS, HAS_NORM,
                    SCALE_ROWS, HAS_BIAS, SQ_PARTS_PAD, SQ_STRIDE,
                )  # fmt: skip
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, offs_g, kv_ptr, bt_row_ptr, kv_head * stride_ch, n0, loop_end,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, True, False, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    if Q_IN_LOOP:  # noqa: SIM102
        if loop_end <= key_start:  # no cached key in this slice: the loop made nothing
            q, k, v = _prepare_row(
                row_ptr, pos, heads, g_mask, k_first, kv_one < 1, offs_d, d_mask, bias_ptr,
                q_norm_ptr, k_norm_ptr, cos_sin_ptr, stride_cs, sq_ptr, t, num_sq_parts,
                sq_dim, sq_eps, eps, HEAD_DIM, NUM_KV_HEADS, HAS_NORM, SCALE_ROWS, HAS_BIAS,
                SQ_PARTS_PAD, SQ_STRIDE,
            )  # fmt: skip

    if has_new:
        # The newest token: one more online-softmax step over the k and v made above (q . k
        # in fp32 over exact 16-bit products, as the tile's dot; p rounded to the dtype
        # before it weighs v, as the tile's P @ V), then both into the cache.
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1)
        m_new = tl.maximum(m_i, s * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p.to(dtype).to(tl.float32)[:, None] * v.to(tl.float32)
        m_i = m_new
        slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            cache_dtype = kv_ptr.dtype.element_ty
            dst = (kv_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
                   + kv_head * stride_ch + offs_d[None, :])  # fmt: skip
            tl.store(dst, k.to(cache_dtype), mask=d_mask[None, :])
            tl.store(dst + stride_ckv, v.to(cache_dtype), mask=d_mask[None, :])

    # l_i == 0 only for an empty context (a pad row): zeros.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        num_valid = 1
    else:
        num_valid = valid_splits(seq_len, split_len, num_splits)
    if num_valid == 1:
        o_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(dtype), mask=mask)
    else:
        base = (t * NUM_Q_HEADS + heads) * num_splits  # [GROUP_PAD]
        tl.store(part_o_ptr + (base + split)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + base + split, m_i + tl.log2(l_i), mask=g_mask)
        # The last arriver merges, as in the per-head kernel.
        tl.debug_barrier()
        counter = count_ptr + row * NUM_KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_valid - 1:
            merge_splits(
                part_o_ptr, part_lse_ptr, base, num_valid, out_ptr, t, heads, offs_d, mask,
                g_mask, stride_ot, stride_oh, HEAD_DIM, GROUP_PAD, D_PAD,
            )  # fmt: skip
            tl.store(counter, 0)


# Where the preparation runs: in the loop's first step (True) or before the loop; and the
# warps of a program (None: the per-head kernel's tile). In the loop, 2 warps spill
# registers (Triton 3.6, sm_90: 255 registers and a 56-byte stack), 4 do not (213).
Q_IN_LOOP = False
NUM_WARPS: int | None = 4


def fused_prep_applies(
    qkv: torch.Tensor, num_kv_heads: int, head_dim: int, max_query_len: int,
    decode_kernel: str | None,
) -> bool:  # fmt: skip
    """Whether `decode_prep_attention` serves this batch: decode rows only (at most the
    folded chain's 64), the per-head decode kernel, 16-bit heads of at most 128 (the
    tiles it was measured with)."""
    kernel = decode_kernel or choose_decode_kernel(qkv.shape[0], num_kv_heads)
    return (
        max_query_len == 1
        and kernel == "per_head"
        and qkv.dtype in (torch.bfloat16, torch.float16)
        and head_dim <= 128
        and qkv.shape[0] <= SQ_ROWS
    )


def decode_prep_attention(
    qkv: torch.Tensor,  # [R, (Hq + 2 Hkv) * D]
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,  # [R] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], updated in place
    slot_mapping: torch.Tensor,  # [<= R] int64
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    scale: float,
    max_seq_len: int,
    workspace: KernelWorkspace,
    scale_rows: ScaleRows | None = None,
    bias: torch.Tensor | None = None,
    q_in_loop: bool | None = None,  # None: Q_IN_LOOP
    cos_sin_rows: bool = False,  # cos_sin_cache is [R, D]: each row's own, gathered
    num_warps: int | None = None,  # None: NUM_WARPS
) -> torch.Tensor:
    """`prepare_qkv_ref` then `paged_attention_ref` over R decode rows -> [R, Hq, D]."""
    num_rows = qkv.shape[0]
    head_dim = kv_cache.shape[-1]
    block_size = kv_cache.shape[2]
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[3] == num_kv_heads
    assert kv_cache.is_contiguous() and kv_cache.dtype == qkv.dtype
    assert qkv.dim() == 2 and qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim, (
        f"qkv is [R, (Hq + 2 Hkv) * D], got {tuple(qkv.shape)}"
    )
    assert qkv.stride(1) == 1 and head_dim % 2 == 0 and cos_sin_cache.shape[1] == head_dim
    assert not cos_sin_rows or cos_sin_cache.shape[0] >= num_rows, "one cos/sin row per row"
    assert num_q_heads % num_kv_heads == 0
    assert (q_norm_weight is None) == (k_norm_weight is None), "q and k norms come together"
    assert positions.numel() == num_rows and positions.is_contiguous()
    assert slot_mapping.dim() == 1 and slot_mapping.numel() <= num_rows
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert seq_lens.numel() >= num_rows and block_tables.shape[0] >= num_rows
    assert bias is None or (scale_rows is not None and bias.shape == qkv.shape[1:]), (
        "an unadded bias comes with scale_rows, one value per column"
    )
    assert scale_rows is None or num_rows <= SQ_ROWS
    out = torch.empty((num_rows, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_rows == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_dim))
    group = num_q_heads // num_kv_heads
    num_splits = decode_num_splits(num_rows, num_kv_heads, max_seq_len)
    cfg = decode_tiles(qkv.dtype, d_pad, num_rows * num_kv_heads, num_splits)
    num_warps = num_warps or NUM_WARPS or cfg.num_warps
    min_keys = max(MIN_SPLIT_KEYS, cfg.block_n)
    num_splits = max(1, min(num_splits, triton.cdiv(max(1, max_seq_len), min_keys)))
    single = num_splits == 1
    if single:
        part_o = part_lse = counters = out  # unused
    else:
        counters = workspace.counters("decode_attention", num_rows * num_kv_heads, qkv.device)
        part_o = torch.empty((num_rows, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                             device=qkv.device)  # fmt: skip
        part_lse = torch.empty((num_rows, num_q_heads, num_splits), dtype=torch.float32,
                               device=qkv.device)  # fmt: skip
    sq = None if scale_rows is None else scale_rows.squares
    has_norm = q_norm_weight is not None
    _decode_prep_attention_kernel[(num_rows, num_kv_heads, num_splits)](
        qkv, kv_cache, block_tables, seq_lens, positions, cos_sin_cache, slot_mapping,
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        qkv if sq is None else sq.buf, qkv if bias is None else bias, out, part_o, part_lse,
        counters, scale * LOG2E, min_keys, num_splits, slot_mapping.numel(),
        1 if sq is None else sq.parts, 1 if sq is None else sq.dim,
        0.0 if sq is None else scale_rows.eps, eps, qkv.stride(0), cos_sin_cache.stride(0),
        out.stride(0), out.stride(1), block_tables.stride(0), *kv_cache.stride()[:4],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, SINGLE_SPLIT=single, HAS_NORM=has_norm,
        SCALE_ROWS=sq is not None, HAS_BIAS=bias is not None,
        SQ_PARTS_PAD=1 if sq is None else sq.parts_pad, SQ_STRIDE=SQ_ROWS,
        DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        UPCAST_DOT=qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16,
        Q_IN_LOOP=Q_IN_LOOP if q_in_loop is None else q_in_loop, COS_SIN_ROWS=cos_sin_rows,
        num_warps=num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
