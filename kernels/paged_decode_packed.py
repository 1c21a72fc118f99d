"""Decode attention with a row's heads (all, or a group) in one program: keys are
(token, kv head) pairs.

`paged_attention_triton`'s other decode kernel (kernels/paged_decode_split.py) gives
each (row, kv head, split) a program, which reads its head's 256 B of each token (a
16-token block holds a token's heads side by side: K of one block is [16, Hkv, D]
contiguous), so the eight programs of a row read interleaved slivers of the same pages.
At 32 rows that kernel read K/V at ~2.1-2.8 TB/s of the H200's 4.28
(profile_step_32_cdd5afb: 16.2 us a layer at ~260 tokens of context).

Here a program owns one row, one slice of its context and a group of `heads` adjacent kv
heads (all of them by default; `PackedConfig.heads`). Its key tile is TOKENS consecutive
tokens times the group's H heads, `[TOKENS * H, D]`, which in the cache's layout is one
contiguous run (a token's heads, then the next token's) whenever the tile stays inside a
block and H is all heads, and runs of H * D elements otherwise. The score tile is the
group's query heads against all of those keys, and a query head sees only the keys of its
own kv head (a block-diagonal mask, `q_head // group == key's kv head`): masked scores
are -inf, so P . V with the full key tile sums exactly the keys of each query's head. The
dots do H times the useful multiply-adds; decode at these sizes is bound by the K/V bytes,
not by the tensor cores, and the per-head kernel pads its 2-head group to a 16-row tile
anyway. Fewer heads a program means more programs a row (`Hkv / H`), so fewer splits fill
the GPU.

Split-K over the context, as the other kernel: each row cuts its own context into up to
`num_splits` slices of whole tiles (host ints fix the grid; a CUDA graph replays it at any
context), writes a normalised partial `[Hq, D]` and its log2-sum-exp per slice, and the
last slice of the row to finish (an arrival counter per row, zero between launches) merges
them in split order. The merge loads all slices at once (`[SPLITS_PAD, Hq, D_CHUNK]`
chunks), so its L2 round trips do not grow with the split count.

What this module does not know: which rows are real (pad rows, seq_len 0, get zeros; rows
with more than one query are the prefill kernel's and are skipped).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import (
    attention_dot,
    decode_slice,
    softcap_scores,
    softmax_start,
    valid_splits,
)
from pdserve.kernels.workspace import KernelWorkspace, arrives_last


class PackedConfig(NamedTuple):
    keys: int  # keys per tile: max(1, keys // Hkv) tokens of all Hkv heads
    min_split_tokens: int  # no slice shorter than this
    target_programs: int  # splits aim for this many programs
    num_warps: int
    num_stages: int
    heads: int = 0  # kv heads a program covers (a divisor of Hkv); 0: all of them


# A first guess, not yet tuned: benchmarks/decode_attention_bench.py --sweep times the
# alternatives at 32 rows on the H200 (64 keys x 128 dims x 2 B = 16 KiB of K and as much V
# a stage, 3 stages: two programs per SM).
DEFAULT_CONFIG = PackedConfig(
    keys=64, min_split_tokens=32, target_programs=264, num_warps=4, num_stages=3
)
MAX_SPLITS = 16  # the merge loads every slice at once: SPLITS_PAD is fixed, no recompiles


def heads_per_program(num_kv_heads: int, cfg: PackedConfig = DEFAULT_CONFIG) -> int:
    """The kv heads one program covers: `cfg.heads`, or all of them when it is 0."""
    heads = cfg.heads or num_kv_heads
    if num_kv_heads % heads:
        raise ValueError(f"PackedConfig.heads={cfg.heads} does not divide {num_kv_heads} kv heads")
    return heads


def tile_tokens(num_kv_heads: int, cfg: PackedConfig = DEFAULT_CONFIG) -> int:
    return max(1, cfg.keys // heads_per_program(num_kv_heads, cfg))


def packed_num_splits(
    num_rows: int, num_kv_heads: int, max_seq_len: int, cfg: PackedConfig = DEFAULT_CONFIG
) -> int:
    """Slices per row: enough programs to fill the GPU, no slice under min_split_tokens."""
    groups = num_kv_heads // heads_per_program(num_kv_heads, cfg)
    wanted = triton.cdiv(cfg.target_programs, max(1, num_rows * groups))
    min_tokens = max(cfg.min_split_tokens, tile_tokens(num_kv_heads, cfg))
    useful = triton.cdiv(max(1, max_seq_len), min_tokens)
    return max(1, min(wanted, useful, MAX_SPLITS))


@triton.jit(do_not_specialize=["min_split_tokens", "num_splits"])
def _decode_packed_kernel(
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    bt_ptr,  # [R_pad, max_blocks] int32
    qsl_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R_pad] int32
    out_ptr,  # [T, Hq, D]
    part_o_ptr,  # [R, num_splits, Hq, D] fp32 workspace
    part_lse_ptr,  # [R, num_splits, Hq] fp32 workspace, log2 domain
    count_ptr,  # [R, Hkv / HEADS] int32 arrival counters, zero between launches
    sinks_ptr,  # [Hq] float32 attention sinks (HAS_SINKS)
    qk_scale,
    min_split_tokens,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS: tl.constexpr,  # kv heads a program covers: program_id(2) picks which
    HQ_PAD: tl.constexpr,  # >= max(16, HEADS * group): tl.dot's smallest M
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    D_CHUNK: tl.constexpr,  # merge: D columns per load of all slices
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per key tile
    KEYS_PAD: tl.constexpr,  # next power of two >= max(16, TOKENS * HEADS)
    SPLITS_PAD: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,  # > 0: sliding-window attention over the last WINDOW keys
    SOFTCAP: tl.constexpr,  # > 0: attention logit softcapping (Gemma 2)
    HAS_SINKS: tl.constexpr,  # a sink logit per query head, counted by split 0 (gpt-oss)
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    hg = tl.program_id(2)  # the head group
    q_start, span, split_len, key_start, key_end, skip = decode_slice(
        qsl_ptr, seq_lens_ptr, row, split, min_split_tokens, num_splits, TOKENS, SINGLE_SPLIT,
        WINDOW,
    )  # fmt: skip
    if skip:
        return

    GROUP: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    QH: tl.constexpr = HEADS * GROUP  # query heads a program covers
    q_head0 = hg * QH
    offs_h = tl.arange(0, HQ_PAD)  # query heads of the group, from q_head0
    offs_d = tl.arange(0, D_PAD)
    offs_j = tl.arange(0, KEYS_PAD)
    h_mask = offs_h < QH
    d_mask = offs_d < HEAD_DIM
    j_tok = offs_j // HEADS
    j_head = offs_j % HEADS
    # Loop invariants: which keys each query head sees, and the keys' offsets in a block.
    own_head = (offs_h // GROUP)[:, None] == j_head[None, :]  # [HQ_PAD, KEYS_PAD]
    j_real = offs_j < TOKENS * HEADS
    head_off = (hg * HEADS + j_head).to(tl.int64) * stride_ch

    q_ptrs = (
        q_ptr
        + q_start.to(tl.int64) * stride_qt
        + (q_head0 + offs_h)[:, None] * stride_qh
        + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    first_split = (offs_h * 0 + split) == 0  # a vector: the interpreter wants one
    m_i, l_i = softmax_start(sinks_ptr, q_head0 + offs_h, h_mask & first_split, HAS_SINKS)
    acc = tl.zeros([HQ_PAD, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt
    for n0 in range(key_start, key_end, TOKENS):
        toks = n0 + j_tok
        valid = j_real & (toks < key_end)
        blk = tl.load(bt_row_ptr + toks // BLOCK_SIZE, mask=valid, other=0)
        off = blk.to(tl.int64) * stride_cb + (toks % BLOCK_SIZE) * stride_ct + head_off
        k_ptrs = kv_ptr + off[:, None] + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        # other=0: the null block may hold NaN, and 0 * NaN would leak into P . V.
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        s = attention_dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST_DOT)  # [HQ_PAD, KEYS_PAD]
        if SOFTCAP > 0:
            s = softcap_scores(s, qk_scale, SOFTCAP)
        s = tl.where(own_head & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * qk_scale - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0).to(q.dtype)
        acc = attention_dot(p.to(q.dtype), v, acc * alpha[:, None], DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    # l_i == 0 only for an empty context (pad row, single split) and pad heads: zeros.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = h_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        o_ptrs = (
            out_ptr + q_start.to(tl.int64) * stride_ot + (q_head0 + offs_h)[:, None] * stride_oh
        )
        tl.store(o_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = (row.to(tl.int64) * num_splits + split) * NUM_Q_HEADS + q_head0
        tl.store(part_o_ptr + (base + offs_h)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + base + offs_h, m_i + tl.log2(l_i), mask=h_mask)
        num_valid = valid_splits(span, split_len, num_splits)
        last, counter = arrives_last(count_ptr, row * (NUM_KV_HEADS // HEADS) + hg, num_valid)
        if last:  # kernels/workspace.py
            _merge(
                part_o_ptr, part_lse_ptr, row.to(tl.int64) * num_splits, num_valid, out_ptr,
                q_start, q_head0, stride_ot, stride_oh, NUM_Q_HEADS, QH, HQ_PAD, HEAD_DIM,
                D_CHUNK, SPLITS_PAD,
            )  # fmt: skip
            tl.store(counter, 0)


@triton.jit
def _merge(
    part_o_ptr,
    part_lse_ptr,
    first,  # row * num_splits: the row's first slice
    num_valid,
    out_ptr,
    q_start,
    q_head0,  # the group's first query head
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    QH: tl.constexpr,  # query heads of the group
    HQ_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_CHUNK: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # Log2-sum-exp weights of every slice at once. An empty row's single slice has
    # lse = -inf: subtract 0 instead so its weight is 0, not NaN, and it writes zeros.
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_h = tl.arange(0, HQ_PAD)
    sh_mask = (offs_s < num_valid)[:, None] & (offs_h < QH)[None, :]
    sh = (first + offs_s)[:, None] * NUM_Q_HEADS + q_head0 + offs_h[None, :]  # [SPLITS, HQ]
    lse = tl.load(part_lse_ptr + sh, mask=sh_mask, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[None, :])  # [SPLITS_PAD, HQ_PAD], 0 for missing slices
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    w = w / den[None, :]
    o_base = out_ptr + q_start.to(tl.int64) * stride_ot + (q_head0 + offs_h)[:, None] * stride_oh
    for d0 in tl.static_range(0, HEAD_DIM, D_CHUNK):
        offs_d = d0 + tl.arange(0, D_CHUNK)
        d_mask = offs_d < HEAD_DIM
        parts = tl.load(
            part_o_ptr + sh[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=sh_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        res = tl.sum(parts * w[:, :, None], 0)  # [HQ_PAD, D_CHUNK], slices summed in order
        tl.store(
            o_base + offs_d[None, :], res.to(out_ptr.dtype.element_ty),
            mask=(offs_h < QH)[:, None] & d_mask[None, :],
        )  # fmt: skip


def decode_packed(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    qk_scale: float,  # softmax scale * log2(e)
    out: torch.Tensor,
    max_seq_len: int,
    num_splits: int | None,
    workspace: KernelWorkspace | None,
    dot_precision: str,
    upcast: bool,
    cfg: PackedConfig = DEFAULT_CONFIG,
    window: int = 0,  # kernels/attention.py's: > 0 sliding, < 0 chunked
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score * scale / softcap)
    sinks: torch.Tensor | None = None,  # [Hq] float32 attention sinks
) -> None:
    """Launch the packed decode kernel over every row (argument checks: the caller's)."""
    num_rows = query_start_loc.numel() - 1
    _, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    heads = heads_per_program(num_kv_heads, cfg)
    groups = num_kv_heads // heads
    tokens = tile_tokens(num_kv_heads, cfg)
    # An explicit num_splits (tests, sweeps) may cut contexts down to one tile per slice.
    min_tokens = tokens if num_splits is not None else max(cfg.min_split_tokens, tokens)
    if num_splits is None:
        num_splits = packed_num_splits(num_rows, num_kv_heads, max_seq_len, cfg)
    num_splits = max(1, min(num_splits, MAX_SPLITS, triton.cdiv(max(1, max_seq_len), min_tokens)))
    single = num_splits == 1
    hq_pad = max(16, triton.next_power_of_2(heads * (num_q_heads // num_kv_heads)))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    splits_pad = triton.next_power_of_2(MAX_SPLITS)
    # The merge's [SPLITS_PAD, HQ_PAD, D_CHUNK] fp32 loads stay at 4,096 values (32 a thread).
    d_chunk = max(1, min(d_pad, 4096 // (splits_pad * hq_pad)))
    if single:
        part_o = part_lse = counters = out  # unused
    else:
        if workspace is not None:
            counters = workspace.counters("decode_packed", num_rows * groups, q.device)
        else:
            counters = torch.zeros(num_rows * groups, dtype=torch.int32, device=q.device)
        part_o = torch.empty(
            (num_rows, num_splits, num_q_heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_rows, num_splits, num_q_heads), dtype=torch.float32, device=q.device
        )
    _decode_packed_kernel[(num_rows, num_splits, groups)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out, part_o, part_lse, counters,
        q if sinks is None else sinks, qk_scale, min_tokens, num_splits, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3), NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads, HEADS=heads, HQ_PAD=hq_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        D_CHUNK=d_chunk, BLOCK_SIZE=block_size, TOKENS=tokens,
        KEYS_PAD=max(16, triton.next_power_of_2(tokens * heads)), SPLITS_PAD=splits_pad,
        SINGLE_SPLIT=single, WINDOW=window, SOFTCAP=softcap, HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision, UPCAST_DOT=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
