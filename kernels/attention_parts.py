"""What the Triton attention kernels share (paged_prefill, paged_decode_split,
paged_decode_packed, paged_decode_flat): their tile config and its choice by dtype and
head dim, their dot, the first key a query sees (full, sliding-window or chunked
attention), one key tile's online-softmax step over a paged cache, and the decode
kernels' cut of a row's context into split-K slices, and the merge of those slices'
partial outputs.

Every kernel takes the attention's span as one `WINDOW` constexpr, as kernels/attention.py
documents `window`: 0 full causal attention, > 0 a sliding window of WINDOW keys, < 0
chunked attention in blocks of -WINDOW positions (Llama 4's local layers)."""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import torch
import triton
import triton.language as tl

C = TypeVar("C")


@triton.jit
def first_visible_key(pos, WINDOW: tl.constexpr):
    """The first key a query at position `pos` sees (>= 0): 0; `pos - WINDOW + 1` for a
    sliding window; the start of its chunk, `pos - pos % -WINDOW`, for chunked attention.
    Non-decreasing in `pos`, so the first query of a tile bounds all of its keys."""
    first = pos * 0
    if WINDOW > 0:
        first = pos - WINDOW + 1
    if WINDOW < 0:
        first = pos - pos % (-WINDOW)
    return tl.maximum(first, 0)


class TileConfig(NamedTuple):
    block_m: int  # queries per program (prefill); unused by decode
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int


def tile_for(dtype: torch.dtype, d_pad: int, narrow: C, wide: C) -> C:
    """`narrow` for 16-bit inputs of (padded) head dim <= 128; `wide` otherwise (fp32, where
    tiles are twice the bytes, or head dim 256): the wide configs take fewer keys a tile."""
    return narrow if dtype in (torch.bfloat16, torch.float16) and d_pad <= 128 else wide


@triton.jit
def attention_dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # acc + a @ b, accumulated inside the MMA (no separate add over the [M, D] tile).
    # UPCAST_DOT: Triton's interpreter multiplies bf16 tiles as their raw uint16 bits; fp32
    # operands give what the tensor cores give (bf16 products are exact in fp32).
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


# A global a @jit function reads must be a tl.constexpr instance (the GPU compiler refuses
# a plain float or an annotation; the interpreter took either)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def softcap_scores(s, qk_scale, SOFTCAP: tl.constexpr):
    """Raw scores -> the raw scores whose `* qk_scale` is `SOFTCAP * tanh(s * scale /
    SOFTCAP)` in the log2 domain (Gemma 2's attention logit softcapping), so the online
    softmax after it runs unchanged. tanh(t) = 1 - 2 / (exp(2t) + 1) saturates to +-1
    where exp overflows or underflows."""
    t = s * (qk_scale / (SOFTCAP * LOG2E))
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)
    return tanh * (SOFTCAP * LOG2E / qk_scale)


@triton.jit
def softmax_start(sinks_ptr, heads, mask, HAS_SINKS: tl.constexpr):
    """The online softmax's initial (m_i, l_i) for rows of query heads `heads`: no key
    seen (-inf, 0), or with attention sinks (gpt-oss: a learned logit per query head in the
    softmax's denominator, none in its numerator) the sink's own term, m = sink (log2
    domain), l = 1. `mask`: the rows that take the sink (real heads; for split-K decode
    only the first slice, so the merge counts it once)."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask, other=float("-inf")).to(tl.float32)
        m_i = sink * LOG2E
        l_i = tl.where(mask, 1.0, 0.0)
    else:
        m_i = tl.where(mask, float("-inf"), float("-inf"))
        l_i = tl.where(mask, 0.0, 0.0)
    return m_i, l_i


@triton.jit
def attend_tile(
    acc,  # [M, D_PAD] fp32 running numerator
    m_i,  # [M] fp32 running max (log2 domain), -inf before any visible key
    l_i,  # [M] fp32 running denominator
    q,  # [M, D_PAD] queries, pre-loaded
    q_pos,  # [M] int32 context position of each query (causal limit, inclusive)
    kv_ptr,
    bt_row_ptr,  # this row's block-table row
    kv_head_off,  # kv head * stride_ch
    n0,  # first key of the tile
    key_end,  # keys >= key_end are outside the context
    offs_n,
    offs_d,
    d_mask,
    stride_cb,
    stride_ckv,
    stride_ct,
    qk_scale,  # softmax scale * log2(e)
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every query
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,  # != 0 with CAUSAL: query p sees keys first_visible_key(p)..p
    SOFTCAP: tl.constexpr,  # > 0: scores become SOFTCAP * tanh(score * scale / SOFTCAP)
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    keys = n0 + offs_n
    if MASKED:
        k_valid = keys < key_end
        if CAUSAL and WINDOW != 0:
            # Keys below the first query's window or chunk are no query's: not even loaded
            # (a stale block there may hold NaN, and 0 * NaN would reach P @ V).
            k_valid = k_valid & (keys >= first_visible_key(tl.min(q_pos, 0), WINDOW))
        blk = tl.load(bt_row_ptr + keys // BLOCK_SIZE, mask=k_valid, other=0)
        kv_mask = k_valid[:, None] & d_mask[None, :]
    else:
        blk = tl.load(bt_row_ptr + keys // BLOCK_SIZE)
        kv_mask = d_mask[None, :]
    # int64: num_blocks * 2 * block_size * Hkv * D passes 2^31 on a large cache.
    tok_off = blk.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_ct + kv_head_off
    k_ptrs = kv_ptr + tok_off[:, None] + offs_d[None, :]
    # other=0 for keys past the context: the null block may hold NaN, and 0 * NaN would
    # leak into the P @ V dot even where P is 0.
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    # Raw scores; the scale is applied inside max() and fused into exp2's argument (one FMA
    # per score, as qk_scale > 0 keeps the argmax).
    s = attention_dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST_DOT)
    if SOFTCAP > 0:
        s = softcap_scores(s, qk_scale, SOFTCAP)
    if MASKED:
        visible = k_valid[None, :]
        if CAUSAL:  # k_valid already holds the first query's window
            visible = visible & (keys[None, :] <= q_pos[:, None])
            if WINDOW != 0:
                visible = visible & (keys[None, :] >= first_visible_key(q_pos[:, None], WINDOW))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        # A query that has seen no visible key keeps m = -inf; subtract 0 instead so its
        # exp2 gives 0, not NaN (-inf - -inf).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0).to(q.dtype)
    acc = attention_dot(p.to(q.dtype), v, acc * alpha[:, None], DOT_PRECISION, UPCAST_DOT)
    return acc, m_new, l_i


@triton.jit
def row_split_len(seq_len, min_split_keys, num_splits, BLOCK_N: tl.constexpr):
    # Each row cuts its own context (not the batch's longest) into up to num_splits slices
    # of whole BLOCK_N tiles, none under min_split_keys: the grid is fixed by host ints
    # (a CUDA graph replays it at any context length) while the work spreads evenly.
    row_splits = tl.maximum(
        tl.minimum(num_splits, (seq_len + min_split_keys - 1) // min_split_keys), 1
    )
    per_split = (seq_len + row_splits - 1) // row_splits
    return tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N


@triton.jit
def decode_slice(
    qsl_ptr, seq_lens_ptr, row, split, min_split_keys, num_splits, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """A decode program's row and slice: (q_start, span, split_len, key_start, key_end,
    skip). The row's query sees its last `span` keys: all `seq_len` of them, or the last
    WINDOW (> 0, sliding-window attention), or those of its chunk (WINDOW < 0), and those
    are what the slices cut, so no key below them is read. Rows with several queries belong to the prefill kernel.
    Splits past the span write nothing and do not count in: the merging program derives
    the number of valid splits from the span (`valid_splits`). Split 0 always runs, so an
    empty pad row still gets its zeros."""
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    first_key = first_visible_key(seq_len - 1, WINDOW)  # the query is the newest token
    span = seq_len - first_key
    split_len = row_split_len(span, min_split_keys, num_splits, BLOCK_N)
    key_start = first_key + split * split_len
    skip = q_len != 1
    if not SINGLE_SPLIT:
        skip = skip | ((key_start >= seq_len) & (split > 0))
    key_end = tl.minimum(key_start + split_len, seq_len)
    return q_start, span, split_len, key_start, key_end, skip


@triton.jit
def row_run(
    slots_ptr, qsl_ptr, seq_lens_ptr, row, num_rows, q_start, seq_len, ROW_RUN: tl.constexpr,
    RUN_PAD: tl.constexpr,
):  # fmt: skip
    """Speculative decoding's drafted positions are decode rows of their own, in a run: the
    same request slot, consecutive tokens and consecutive lengths (runner/mrv2/
    model_runner.py). -> how many rows from `row` on its program serves: 0 when `row`
    continues the row before it, else 1 + the rows after it that continue it, at most
    ROW_RUN (the runner never drafts more). RUN_PAD >= ROW_RUN + 1: the row before too."""
    offs = tl.arange(0, RUN_PAD) - 1
    rows = row + offs
    ok = (rows >= 0) & (rows < num_rows) & (offs < ROW_RUN)
    slots = tl.load(slots_ptr + rows, mask=ok, other=-1)
    toks = tl.load(qsl_ptr + rows, mask=ok, other=-1)
    lens = tl.load(seq_lens_ptr + rows, mask=ok, other=-1)
    slot = tl.load(slots_ptr + row)
    same = ok & (slots == slot) & (toks == q_start + offs) & (lens == seq_len + offs)
    continues = tl.sum(tl.where(same & (offs == -1), 1, 0), 0) > 0
    run = tl.min(tl.where(same | (offs < 1), ROW_RUN, offs), 0)
    return tl.where(continues, 0, run)


@triton.jit
def valid_splits(span, split_len, num_splits):
    """How many of a row's slices of its `span` keys run (and count in before the merge):
    at least one."""
    return tl.maximum(tl.minimum((span + split_len - 1) // split_len, num_splits), 1)


@triton.jit
def merge_splits(
    part_o_ptr,
    part_lse_ptr,
    base,  # [GROUP_PAD] first partial of each head
    num_valid,
    out_ptr,
    q_start,
    heads,
    offs_d,
    mask,
    g_mask,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    # Online merge by log2-sum-exp. An empty row's single split has lse = -inf: subtract 0
    # instead of -inf so its weight is exp2(-inf) = 0, not NaN, and it writes zeros.
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for s in range(num_valid):
        lse = tl.load(
            part_lse_ptr + base + s, mask=g_mask, other=float("-inf"), cache_modifier=".cg"
        )
        o = tl.load(
            part_o_ptr + (base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        acc = acc * alpha[:, None] + o * w[:, None]
        den = den * alpha + w
        m = m_new
    res = acc / tl.where(den > 0, den, 1.0)[:, None]
    o_ptrs = (
        out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    )
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)
