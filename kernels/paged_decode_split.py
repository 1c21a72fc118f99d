"""Triton split-K decode attention over the paged KV cache, a program per KV head.

`_decode_split_kernel`, grid `(R, Hkv, num_splits)`, serves the rows of
`paged_attention_triton`'s batch with exactly one query. A program owns one KV head of
one row and one contiguous slice of its context; it reads each K/V tile once for all
`Hq / Hkv` query heads of the group (decode is bound by KV bytes, so GQA must not
multiply them) and writes a normalised partial output plus its log2-sum-exp to a
workspace, or straight to `out` when there is one split. With splits, the last program
of a (row, kv head) to finish merges them by their lse (an arrival counter in
kernels/workspace.py); that replaced a separate reduce kernel, whose launch cost ~3.3 us
a layer at 32 rows (profile_step_32: 0.092 of 1.65 ms a step).

`split_plan` sizes the grid from host ints only, so a launch never syncs with the device
and can be captured in a CUDA graph. `max_seq_len` only bounds the number of splits (a
CUDA graph captures it as the model's limit); each row cuts its own context into that
many slices at most, so a short row in a long-limit graph still spreads its keys over all
its programs. Pad rows (`seq_len == 0`) get zeros; rows with several queries are the
prefill kernel's (kernels/paged_prefill.py) and are left untouched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import (
    TileConfig,
    attend_tile,
    decode_slice,
    merge_splits,
    row_run,
    softmax_start,
    tile_for,
    valid_splits,
)
from pdserve.kernels.workspace import KernelWorkspace, arrives_last

# Decode: one program per (row, kv head, split) streams 64 keys x 128 dims x 2 B = 16 KiB of
# K and as much V per loop step through cp.async. Measured on the H200 over 28 distinct
# caches as a decode graph replays them (benchmarks/decode_attention_bench.py --sweep-per-head
# and --sweep-long, results/decode_attention_sweep_*.jsonl):
# - Splits lose once the batch has ~256 (row, kv head) programs: at 32 rows one slice per
#   row beat 2-16 slices at every context from 256 to 4,096 tokens, at 64-512 rows too.
#   Split programs past a short row's context still cost a launch slot each: a 32-row
#   graph bounded at 4,096 tokens with 3 splits ran 21.4 us a layer at 384 tokens where
#   the unsplit kernel took 16.7.
# - The unsplit kernel at <= 256 programs runs best with 2 warps and 5 stages: 12.7 / 16.7 /
#   20.6 / 125 us a layer at 32 rows of 256 / 384 / 512 / 4,096 tokens (4.3 TB/s at 4,096),
#   against 16.5 / 19.2 / 23.1 us with the earlier 4-warp, 3-stage tile and 256-key slices
#   (128 at 4,096 tokens with that tile's best split). With more programs (64-512 rows), or
#   with splits, 3 stages win; at 256-512 rows K/V stream at ~3.9 TB/s.
# - What the tiles compile to (Triton 3.6, sm_90; benchmarks/sm90_resources.py): the block-id
#   load feeds the K/V loads, so the pipeline splits its stages between them. 5 stages give
#   the K and V tiles 2 buffers each (72 KB of shared memory, 214 registers at 2 warps: 3
#   programs fit an SM, so 256 programs run in one wave), 3 stages 1 buffer (39 KB).
_DECODE_16BIT = TileConfig(block_m=0, block_n=64, num_warps=4, num_stages=3)
_DECODE_16BIT_FEW = TileConfig(block_m=0, block_n=64, num_warps=2, num_stages=5)
_DECODE_WIDE = TileConfig(block_m=0, block_n=32, num_warps=4, num_stages=2)  # fp32, D 256
FEW_DECODE_PAIRS = 256  # unsplit grids of up to this many pairs take the 5-stage tile

# Split-K only for batches of fewer (row, kv head) pairs than _TARGET_DECODE_PROGRAMS: 8 rows
# of 1,024 / 4,096 tokens ran best at 4 / 8 slices (256 / 512 programs): 15.2 / 39.8 us a
# layer against 23.1 / 78.7 unsplit. No slice under 256 keys.
_TARGET_DECODE_PROGRAMS = 256
MIN_SPLIT_KEYS = 256
_MAX_SPLITS = 64


def decode_tiles(dtype: torch.dtype, d_pad: int, num_pairs: int, num_splits: int) -> TileConfig:
    """The decode tile for `num_pairs` (row, kv head) pairs cut into `num_splits` slices:
    the 5-stage tile only for an unsplit grid of few programs (with splits it lost)."""
    few = num_splits == 1 and num_pairs <= FEW_DECODE_PAIRS
    return tile_for(dtype, d_pad, _DECODE_16BIT_FEW if few else _DECODE_16BIT, _DECODE_WIDE)


def decode_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per (row, kv head): enough programs to fill the GPU, no slice under
    MIN_SPLIT_KEYS keys."""
    wanted = triton.cdiv(_TARGET_DECODE_PROGRAMS, max(1, num_rows * num_kv_heads))
    useful = triton.cdiv(max(1, max_seq_len), MIN_SPLIT_KEYS)
    return max(1, min(wanted, useful, _MAX_SPLITS))


class SplitPlan(NamedTuple):
    num_splits: int  # slices per (row, kv head): the grid's third axis
    tile: TileConfig
    min_keys: int  # a row's context is cut into slices of at least this many keys


def split_plan(
    dtype: torch.dtype,
    d_pad: int,
    num_rows: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_splits: int | None,  # None: decode_num_splits
) -> SplitPlan:
    """The grid and tile of a decode launch. Each row sizes its own slices in-kernel; an
    explicit num_splits (tests, sweeps) may cut contexts down to one tile per slice, the
    heuristic never under MIN_SPLIT_KEYS."""
    explicit = num_splits is not None
    if num_splits is None:
        num_splits = decode_num_splits(num_rows, num_kv_heads, max_seq_len)
    cfg = decode_tiles(dtype, d_pad, num_rows * num_kv_heads, num_splits)
    min_keys = cfg.block_n if explicit else max(MIN_SPLIT_KEYS, cfg.block_n)
    num_splits = max(1, min(num_splits, triton.cdiv(max(1, max_seq_len), min_keys)))
    return SplitPlan(num_splits, cfg, min_keys)


# Counts that vary from step to step (eager mixed steps) are not specialised on: each new
# value class (== 1, % 16) would compile a variant mid-serving, ~1 s each on a cold cache.
@triton.jit(do_not_specialize=["min_split_keys", "num_splits", "num_rows"])
def _decode_split_kernel(
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    bt_ptr,  # [R_pad, max_blocks] int32
    qsl_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R_pad] int32
    out_ptr,  # [T, Hq, D]: written only when SINGLE_SPLIT
    part_o_ptr,  # [R, Hq, num_splits, D] fp32 workspace
    part_lse_ptr,  # [R, Hq, num_splits] fp32 workspace, log2 domain
    count_ptr,  # [R * Hkv] int32 arrival counters, zero between launches
    sinks_ptr,  # [Hq] float32 attention sinks (HAS_SINKS)
    slots_ptr,  # [R_pad] int32 each row's request slot (ROW_RUN > 1)
    qk_scale,
    min_split_keys,  # a row's context is cut into slices of at least this many keys
    num_splits,
    num_rows,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    GROUP: tl.constexpr,  # Hq // Hkv
    GROUP_PAD: tl.constexpr,  # the q tile's rows, GROUP x ROW_RUN padded: >= 16 (tl.dot's M)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,  # > 0: sliding-window attention over the last WINDOW keys
    SOFTCAP: tl.constexpr,  # > 0: attention logit softcapping (Gemma 2)
    HAS_SINKS: tl.constexpr,  # a sink logit per query head, counted by split 0 (gpt-oss)
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    ROW_RUN: tl.constexpr,  # > 1: a program serves a run of up to this many drafted rows
    RUN_PAD: tl.constexpr,  # >= ROW_RUN + 1 (the row before too), a power of two
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start, span, split_len, key_start, key_end, skip = decode_slice(
        qsl_ptr, seq_lens_ptr, row, split, min_split_keys, num_splits, BLOCK_N, SINGLE_SPLIT,
        WINDOW,
    )  # fmt: skip
    if skip:
        return

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    if ROW_RUN > 1:
        # The q tile's rows are (query of the run, head of the group): the run's queries
        # share the row's block table, so its K/V tiles are read once for all of them.
        run = row_run(slots_ptr, qsl_ptr, seq_lens_ptr, row, num_rows, q_start, key_end,
                      ROW_RUN, RUN_PAD)  # fmt: skip
        if run == 0:
            return  # a later row of a run: its first row's program serves it
        query = offs_g // GROUP
        heads = kv_head * GROUP + offs_g % GROUP
        g_mask = query < run
        tok = (q_start.to(tl.int64) + query)[:, None]  # one token a row
        q_pos = key_end - 1 + query  # each query sees the keys up to its own position
        key_end = key_end + run - 1
    else:
        g_mask = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        tok = q_start.to(tl.int64)
        q_pos = offs_g
    q_ptrs = q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # (a vector comparison: the interpreter refuses a mask built from a scalar one)
    first_split = (offs_g * 0 + split) == 0
    m_i, l_i = softmax_start(sinks_ptr, heads, g_mask & first_split, HAS_SINKS)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt
    for n0 in range(key_start, key_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, kv_head * stride_ch, n0, key_end,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, True, ROW_RUN > 1, 0, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip

    # l_i == 0 only for an empty context (pad row, single split): write zeros.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    # A row whose context fits one slice (most rows when num_splits is the graph's bound for
    # the model's longest context) writes its output as with one split: no partial, no
    # counter, no merge.
    if SINGLE_SPLIT:
        num_valid = 1
    else:
        num_valid = valid_splits(span, split_len, num_splits)
    if num_valid == 1:
        o_ptrs = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = (row.to(tl.int64) * num_q_heads + heads) * num_splits  # [GROUP_PAD]
        tl.store(part_o_ptr + (base + split)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + base + split, m_i + tl.log2(l_i), mask=g_mask)
        # The last to arrive merges (kernels/workspace.py), reading the partials from L2
        # (.cg) in split order whoever came last.
        last, counter = arrives_last(count_ptr, row * tl.num_programs(1) + kv_head, num_valid)
        if last:
            merge_splits(
                part_o_ptr, part_lse_ptr, base, num_valid, out_ptr, q_start, heads, offs_d,
                mask, g_mask, stride_ot, stride_oh, HEAD_DIM, GROUP_PAD, D_PAD,
            )  # fmt: skip
            tl.store(counter, 0)


def decode_split(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    qk_scale: float,  # softmax scale * log2(e)
    out: torch.Tensor,  # [T, Hq, D]
    plan: SplitPlan,  # from `split_plan`
    workspace: KernelWorkspace | None,  # the model's; None: counters for this call
    dot_precision: str,
    upcast: bool,
    window: int = 0,  # kernels/attention.py's: > 0 sliding, < 0 chunked
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score * scale / softcap)
    sinks: torch.Tensor | None = None,  # [Hq] float32 attention sinks
    row_slots: torch.Tensor | None = None,  # [R_pad] int32 request slots, with max_run > 1
    max_run: int = 1,  # > 1 (unsplit plans only): a program serves a run of drafted rows
) -> None:
    """The decode rows (and one-query pad rows) of `paged_attention_triton`'s batch by the
    per-head kernel. The caller has checked the shapes.

    With `max_run` > 1 (speculative decoding's k + 1), rows that continue the row before
    them (`row_run`: its slot, its next token, its next length) are served by that row's
    program, whose q tile holds every query of the run: each K/V tile is read once for the
    run, not once a drafted row, and each query sees the keys up to its own position. A
    query's result is the one it gets alone: its fully masked tiles leave its sums as they
    were, and its q tile rows and their reductions are its own."""
    num_rows = query_start_loc.numel() - 1
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_splits, cfg = plan.num_splits, plan.tile
    single = num_splits == 1
    if single:
        part_o = part_lse = counters = out  # unused
    else:
        # The model's workspace keeps zeroed counters across calls and graph replays;
        # without one, zeroed counters for this call (a memset, captured with it).
        num_counters = num_rows * num_kv_heads
        if workspace is not None:
            counters = workspace.counters("decode_attention", num_counters, q.device)
        else:
            counters = torch.zeros(num_counters, dtype=torch.int32, device=q.device)
        part_o = torch.empty(
            (num_rows, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_rows, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
    group = num_q_heads // num_kv_heads
    assert max_run == 1 or (single and window == 0 and sinks is None and row_slots is not None
                            and row_slots.dtype == torch.int32 and row_slots.numel() >= num_rows), (
        "row runs: an unsplit plan, full attention, no sinks, int32 slots for every row"
    )  # fmt: skip
    _decode_split_kernel[(num_rows, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out, part_o, part_lse, counters,
        q if sinks is None else sinks, seq_lens if row_slots is None else row_slots, qk_scale,
        plan.min_keys, num_splits, num_rows, num_q_heads, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), *kv_cache.stride()[:4],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group * max_run)), HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_N=cfg.block_n, SINGLE_SPLIT=single, WINDOW=window, SOFTCAP=softcap, HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision, UPCAST_DOT=upcast, ROW_RUN=max_run,
        RUN_PAD=triton.next_power_of_2(max_run + 1), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
