"""Triton paged attention: split-K decode and varlen causal prefill over the paged KV cache.

`paged_attention_triton` has the signature of `attention.paged_attention_ref` (the spec)
plus an optional `num_splits` and the model's `workspace`. It launches at most two
kernels, each on a grid sized from host ints only (shapes, `max_query_len`,
`max_seq_len`), so a call never syncs with the device and can be captured in a CUDA graph:

- `_decode_split_kernel`, grid `(R, Hkv, num_splits)`: rows with exactly one query. A
  program owns one KV head of one row and one contiguous slice of its context; it reads
  each K/V tile once for all `Hq / Hkv` query heads of the group (decode is bound by KV
  bytes, so GQA must not multiply them) and writes a normalised partial output plus its
  log2-sum-exp to a workspace, or straight to `out` when there is one split. With splits,
  the last program of a (row, kv head) to finish merges them by their lse (an arrival
  counter in kernels/workspace.py); that replaced a separate reduce kernel, whose launch
  cost ~3.3 us a layer at 32 rows (profile_step_32: 0.092 of 1.65 ms a step).
- `_prefill_kernel`, grid `(Hq, T // BLOCK_M + R)`: rows with two or more queries (prefill
  chunks, with or without a cached prefix). Each program finds its (row, query tile) from
  `query_start_loc`, then runs flash attention over one query head and BLOCK_M queries,
  walking the row's key tiles through its block table up to the causal limit; tiles
  entirely below the diagonal skip all masking.

Asked for the "flat" decode kernel, an unsplit decode grid runs kernels/paged_decode_flat.py
instead of `_decode_split_kernel`: at most one program per SM, each walking the key tiles
of several (row, kv head) pairs in one loop.

A mixed step (`max_query_len > 1`) launches both paths; each kernel exits at once on the
rows that belong to the other, so no host-side split of the batch is needed.

What this module does not know: which rows are real. Pad rows (`seq_len == 0`) get zeros;
rows with no queries are left untouched. `max_seq_len` only bounds the number of decode
splits (a CUDA graph captures it as the model's limit); each row cuts its own context into
that many slices at most, so a short row in a long-limit graph still spreads its keys over
all its programs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import attend_tile, decode_slice, merge_splits, valid_splits
from pdserve.kernels.paged_decode_flat import decode_flat, flat_programs
from pdserve.kernels.paged_decode_packed import DEFAULT_CONFIG as PACKED_16BIT
from pdserve.kernels.paged_decode_packed import PackedConfig, decode_packed
from pdserve.kernels.sm_count import num_sms as _num_sms  # tests set it to size a flat grid
from pdserve.kernels.workspace import KernelWorkspace

LOG2E = 1.4426950408889634


class TileConfig(NamedTuple):
    block_m: int  # queries per program (prefill); unused by decode
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int


# Prefill, 16-bit, head dim <= 128: one Hopper warpgroup (4 warps) per 64-query tile, wgmma's
# natural M; 3 stages of a 64-key K and V tile (2 x 16 KiB at D=128) beside Q (16 KiB) leave
# room for two programs per SM. Measured on the H200 (triton 3.6, 8 x 2048 causal prompts):
# 307 TFLOP/s, tied with 128x128 over 8 warps (316) and ahead of it on one prompt and on
# chunks after a prefix; 128x64/8 warps gave 279, BLOCK_N=128 with 4 warps 210. A 64-query
# tile also wastes less on short chunks. The K/V gather through the block table costs ~10%
# (a contiguous-cache variant of the same loop ran at 325-352).
_PREFILL_16BIT = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
# head dim 256 (or fp32, where the tiles are twice the bytes and IEEE dots use no tensor
# cores): halve the key tile to stay inside registers and shared memory.
_PREFILL_WIDE = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
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


# The packed decode kernel (kernels/paged_decode_packed.py) for fp32 or head dim 256: half
# the keys per tile, two stages.
PACKED_WIDE = PackedConfig(
    keys=32, min_split_tokens=32, target_programs=264, num_warps=4, num_stages=2
)
# Batches with fewer (row, kv head) pairs than this take the packed kernel. 0: measured on
# the H200 (decode_attention_bench.py, results/decode_attention_56e7efb.jsonl) it is slower
# than the per-head kernel at 32-256 rows (27.0 against 16.5 us a layer at 32 rows of 256
# tokens, 148.5 against 103.9 at 256 rows of 384), ahead only at 512 rows of 256 (129.7
# against 138.4), with its tile config still the unswept first guess.
PACKED_BELOW_PAIRS = 0


def choose_decode_kernel(num_rows: int, num_kv_heads: int) -> str:
    """The packed kernel for batches of fewer (row, kv head) pairs than PACKED_BELOW_PAIRS."""
    return "packed" if num_rows * num_kv_heads < PACKED_BELOW_PAIRS else "per_head"


def _tiles(dtype: torch.dtype, d_pad: int, narrow: TileConfig, wide: TileConfig) -> TileConfig:
    return narrow if dtype in (torch.bfloat16, torch.float16) and d_pad <= 128 else wide


def decode_tiles(dtype: torch.dtype, d_pad: int, num_pairs: int, num_splits: int) -> TileConfig:
    """The decode tile for `num_pairs` (row, kv head) pairs cut into `num_splits` slices:
    the 5-stage tile only for an unsplit grid of few programs (with splits it lost)."""
    few = num_splits == 1 and num_pairs <= FEW_DECODE_PAIRS
    return _tiles(dtype, d_pad, _DECODE_16BIT_FEW if few else _DECODE_16BIT, _DECODE_WIDE)


def decode_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per (row, kv head): enough programs to fill the GPU, no slice under
    MIN_SPLIT_KEYS keys."""
    wanted = triton.cdiv(_TARGET_DECODE_PROGRAMS, max(1, num_rows * num_kv_heads))
    useful = triton.cdiv(max(1, max_seq_len), MIN_SPLIT_KEYS)
    return max(1, min(wanted, useful, _MAX_SPLITS))


# Counts that vary from step to step (eager mixed steps) are not specialised on: each new
# value class (== 1, % 16) would compile a variant mid-serving, ~1 s each on a cold cache.
@triton.jit(do_not_specialize=["min_split_keys", "num_splits"])
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
    qk_scale,
    min_split_keys,  # a row's context is cut into slices of at least this many keys
    num_splits,
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
    GROUP_PAD: tl.constexpr,  # >= 16: tl.dot's smallest M
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start, seq_len, split_len, key_start, key_end, skip = decode_slice(
        qsl_ptr, seq_lens_ptr, row, split, min_split_keys, num_splits, BLOCK_N, SINGLE_SPLIT
    )
    if skip:
        return

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt
    for n0 in range(key_start, key_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, offs_g, kv_ptr, bt_row_ptr, kv_head * stride_ch, n0, key_end,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, True, False, DOT_PRECISION, UPCAST_DOT,
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
        num_valid = valid_splits(seq_len, split_len, num_splits)
    if num_valid == 1:
        o_ptrs = (
            out_ptr
            + q_start.to(tl.int64) * stride_ot
            + heads[:, None] * stride_oh
            + offs_d[None, :]
        )
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = (row.to(tl.int64) * num_q_heads + heads) * num_splits  # [GROUP_PAD]
        tl.store(part_o_ptr + (base + split)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        tl.store(part_lse_ptr + base + split, m_i + tl.log2(l_i), mask=g_mask)
        # Last arriver merges (kernels/workspace.py): every thread's partial is stored
        # before one thread counts the program in; acq_rel publishes them, and the merge
        # reads them from L2 (.cg), in split order whoever came last.
        tl.debug_barrier()
        counter = count_ptr + row * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_valid - 1:
            merge_splits(
                part_o_ptr, part_lse_ptr, base, num_valid, out_ptr, q_start, heads, offs_d,
                mask, g_mask, stride_ot, stride_oh, HEAD_DIM, GROUP_PAD, D_PAD,
            )  # fmt: skip
            tl.store(counter, 0)


@triton.jit(do_not_specialize=["num_rows", "num_slots"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    bt_ptr,  # [R_pad, max_blocks] int32
    qsl_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R_pad] int32
    out_ptr,  # [T, Hq, D]
    qk_scale,
    num_rows,
    num_slots,  # T // BLOCK_M + R
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows scanned per step of the slot -> row search
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    head = tl.program_id(0)  # fastest: the heads of one tile run together and share K/V in L2
    # Row r owns tile slots [qsl[r] // BLOCK_M + r, qsl[r + 1] // BLOCK_M + r + 1): at least
    # cdiv(q_len, BLOCK_M) of them, and T // BLOCK_M + R slots in all, so the grid follows
    # the token count, not R * cdiv(max_query_len, BLOCK_M): a 2048-token prompt among 255
    # decode rows takes 291 slots, not 32 x 256 = 8,192 mostly idle programs. Slots run in
    # reverse so the last, longest tiles of a row start first.
    slot = num_slots - 1 - tl.program_id(1)
    row = slot * 0
    for r0 in range(0, num_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        next_end = tl.load(qsl_ptr + r + 1, mask=r < num_rows, other=1 << 30)
        row += tl.sum((next_end // BLOCK_M + r + 1 <= slot).to(tl.int32), 0)
    if row >= num_rows:  # slots past the last row (padded tokens)
        return
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    m_start = (slot - q_start // BLOCK_M - row) * BLOCK_M
    # One-query rows (decode, pad) are the decode kernel's.
    if (m_start >= q_len) | (q_len == 1):
        return
    seq_len = tl.load(seq_lens_ptr + row)
    prefix = seq_len - q_len  # keys cached before this chunk

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    tok = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt
    kv_head_off = (head // GROUP) * stride_ch
    # Keys [0, prefix + m_start] are visible to every query of the tile: whole tiles there
    # need no mask. The rest, up to the last query's position, is masked causally.
    full_end = tl.maximum(prefix + m_start + 1, 0) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(prefix + tl.minimum(m_start + BLOCK_M, q_len), seq_len)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, kv_head_off, n0, seq_len,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, False, True, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    for n0 in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, kv_head_off, n0, seq_len,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, True, True, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip

    # l_i == 0 only when the row's context is empty or shorter than its queries (bad input).
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] out
    max_query_len: int,
    max_seq_len: int,
    *,
    num_splits: int | None = None,  # decode splits per (row, kv head); None = heuristic
    workspace: KernelWorkspace | None = None,  # the model's; None: counters for this call
    decode_kernel: str | None = None,  # per_head | packed | flat; None: choose_decode_kernel
) -> None:
    """`paged_attention_ref` on the GPU (or Triton's interpreter); see the module docstring."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, two, block_size, num_kv_heads, cache_dim = kv_cache.shape
    num_rows = query_start_loc.numel() - 1
    assert two == 2 and cache_dim == head_dim, "cache is [num_blocks, 2, block_size, Hkv, D]"
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert out.shape == q.shape and out.stride(-1) == 1 and q.stride(-1) == 1, (
        "q and out are [T, Hq, D] with unit stride on D"
    )
    assert kv_cache.is_contiguous(), "the cache is one contiguous tensor per layer"
    assert q.dtype.is_floating_point and kv_cache.dtype == q.dtype, (
        f"q and the cache share a float dtype (got {q.dtype}, {kv_cache.dtype})"
    )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc)):
        assert t.dtype == torch.int32 and t.stride(-1) == 1, f"{name} is int32, unit stride"
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), "seq_lens is int32"
    assert scale > 0, "softmax scale must be positive (the kernels take max before scaling)"
    assert seq_lens.numel() >= num_rows and block_tables.shape[0] >= num_rows, (
        "seq_lens and block_tables hold a row for every query row"
    )
    if num_tokens == 0 or num_rows <= 0 or max_query_len <= 0:
        return

    d_pad = max(16, triton.next_power_of_2(head_dim))
    group = num_q_heads // num_kv_heads
    qk_scale = scale * LOG2E
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    # CPU tensors only reach here under TRITON_INTERPRET=1 (see attention_dot).
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16
    common = dict(
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        DOT_PRECISION=dot_precision,
        UPCAST_DOT=upcast,
    )

    if max_query_len > 1:
        cfg = _tiles(q.dtype, d_pad, _PREFILL_16BIT, _PREFILL_WIDE)
        num_slots = num_tokens // cfg.block_m + num_rows
        assert num_slots <= 65535, "query tiles ride on a grid axis limited to 65535"
        _prefill_kernel[(num_q_heads, num_slots)](
            q, kv_cache, block_tables, query_start_loc, seq_lens, out, qk_scale, num_rows,
            num_slots, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0),
            *cache_strides, GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=128,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip

    # Decode rows (and one-query pad rows), also inside a mixed step.
    kernel = decode_kernel or choose_decode_kernel(num_rows, num_kv_heads)
    if kernel == "packed":
        packed_cfg = _tiles(q.dtype, d_pad, PACKED_16BIT, PACKED_WIDE)
        decode_packed(
            q, kv_cache, block_tables, query_start_loc, seq_lens, qk_scale, out, max_seq_len,
            num_splits, workspace, dot_precision, upcast, packed_cfg,
        )  # fmt: skip
        return
    assert kernel in ("per_head", "flat"), f"unknown decode kernel {kernel!r}"
    # Each row sizes its own slices in-kernel; an explicit num_splits (tests, sweeps) may cut
    # contexts down to one tile per slice, the heuristic never under MIN_SPLIT_KEYS.
    explicit = num_splits is not None
    if num_splits is None:
        num_splits = decode_num_splits(num_rows, num_kv_heads, max_seq_len)
    cfg = decode_tiles(q.dtype, d_pad, num_rows * num_kv_heads, num_splits)
    min_keys = cfg.block_n if explicit else max(MIN_SPLIT_KEYS, cfg.block_n)
    num_splits = max(1, min(num_splits, triton.cdiv(max(1, max_seq_len), min_keys)))
    single = num_splits == 1
    # The flat kernel serves unsplit grids of at most MAX_PAIRS pairs a program; otherwise
    # the per-head kernel runs, as asked for "per_head".
    programs = None
    if kernel == "flat" and single:
        programs = flat_programs(num_rows * num_kv_heads, _num_sms(q.device))
    if programs is not None:
        decode_flat(
            q, kv_cache, block_tables, query_start_loc, seq_lens, qk_scale, out, programs,
            (cfg.block_n, cfg.num_warps, cfg.num_stages), dot_precision, upcast,
        )  # fmt: skip
        return
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
    _decode_split_kernel[(num_rows, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out, part_o, part_lse, counters,
        qk_scale, min_keys, num_splits, num_q_heads, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), *cache_strides, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
        SINGLE_SPLIT=single, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
    )  # fmt: skip
