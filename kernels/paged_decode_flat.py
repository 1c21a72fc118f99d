"""Unsplit decode attention with one program per SM walking several (row, kv head) pairs.

The per-head kernel (kernels/paged_decode_split.py) runs one program per (row, kv head)
pair, and each program starts its K/V pipeline cold. (This kernel was written believing its
5-stage tile took one program per SM, so that a 32-row step ran in two waves; compiled for
sm_90 it takes 72 KB and 214 registers, three programs an SM: one wave.) Here the grid is
at most one program per SM.
Each program takes the pairs `pid, pid + P, ...` and walks all their key tiles in one
loop, so the pipeline keeps loading across a pair boundary: the next pair's first tiles
are in flight while the last one's finish.

The loop's position is a pure function of its index. Each program's pairs (at most
MAX_PAIRS) are a small vector, and their tile counts a cumulative sum, so a tile's pair
and key offset are found from the index alone. No state is carried from one iteration
to the next but the running softmax (`acc`, `m_i`, `l_i`), which is reset at a pair's
first tile. The pair's output is stored at its last tile. A pair has at least one tile,
so a pad row (`seq_len == 0`) still gets its zeros; rows with several queries belong to
the prefill kernel and get no tiles.

What this module does not know: splits (it serves unsplit grids only), and which batch
shapes it wins at. `paged_attention_triton` sends it the unsplit grids when asked for the
"flat" decode kernel. The per-head kernel stays the default until the flat one is
measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import attend_tile, first_visible_key, softmax_start

# Pairs one program may take: 4 x 132 SMs covers 64 rows of 8 kv heads.
MAX_PAIRS = 4


@triton.jit(do_not_specialize=["num_pairs"])
def _decode_flat_kernel(
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    bt_ptr,  # [R_pad, max_blocks] int32
    qsl_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R_pad] int32
    out_ptr,  # [T, Hq, D]
    sinks_ptr,  # [Hq] float32 attention sinks (HAS_SINKS)
    qk_scale,
    num_pairs,  # R * Hkv
    num_kv_heads,
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
    MAX_PAIRS: tl.constexpr,
    WINDOW: tl.constexpr,  # > 0: sliding-window attention over the last WINDOW keys
    SOFTCAP: tl.constexpr,  # > 0: attention logit softcapping (Gemma 2)
    HAS_SINKS: tl.constexpr,  # a sink logit per query head in the denominator (gpt-oss)
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.arange(0, MAX_PAIRS)
    pairs = pid + slot * tl.num_programs(0)
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // num_kv_heads, 0)
    q_starts = tl.load(qsl_ptr + rows, mask=valid, other=0)
    q_lens = tl.load(qsl_ptr + rows + 1, mask=valid, other=0) - q_starts
    seq_lens = tl.load(seq_lens_ptr + rows, mask=valid, other=0)
    # A pair's keys are [first_keys, seq_lens): all of them, the last WINDOW, or its chunk's.
    first_keys = first_visible_key(seq_lens - 1, WINDOW)
    spans = seq_lens - first_keys
    tiles = tl.where(valid & (q_lens == 1), tl.maximum((spans + BLOCK_N - 1) // BLOCK_N, 1), 0)
    ends = tl.cumsum(tiles, 0)  # a pair's tiles are [ends - tiles, ends)
    starts = ends - tiles

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    mask = g_mask[:, None] & d_mask[None, :]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for t in range(0, tl.sum(tiles, 0)):
        # This tile's pair: the one whose tile range holds t (empty ranges hold nothing).
        here = (starts <= t) & (t < ends)
        pair = tl.sum(tl.where(here, pairs, 0), 0)
        q_start = tl.sum(tl.where(here, q_starts, 0), 0)
        seq_len = tl.sum(tl.where(here, seq_lens, 0), 0)
        first_key = tl.sum(tl.where(here, first_keys, 0), 0)
        first = tl.sum(tl.where(here, starts, 0), 0)
        last = tl.sum(tl.where(here, ends, 0), 0) - 1
        row = pair // num_kv_heads
        kv_head = pair - row * num_kv_heads
        heads = kv_head * GROUP + offs_g
        # Reloaded per tile (a few hundred bytes, cached) rather than carried: the loop
        # keeps no per-pair state but the running softmax.
        q_ptrs = (
            q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
            + offs_d[None, :]
        )  # fmt: skip
        q = tl.load(q_ptrs, mask=mask, other=0.0)
        # A pair's first tile restarts the softmax. Resetting m_i alone would do (the
        # rescale factor exp2(m_i - m) is then 0); all three are reset, so nothing of the
        # last pair's state reaches the next.
        is_first = first == t
        m_start, l_start = softmax_start(sinks_ptr, heads, g_mask, HAS_SINKS)
        acc = tl.where(is_first, 0.0, acc)
        m_i = tl.where(is_first, m_start, m_i)
        l_i = tl.where(is_first, l_start, l_i)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, offs_g, kv_ptr, bt_ptr + row.to(tl.int64) * stride_bt,
            kv_head * stride_ch, first_key + (t - first) * BLOCK_N, seq_len, offs_n, offs_d,
            d_mask, stride_cb, stride_ckv, stride_ct, qk_scale, BLOCK_SIZE, True, False, 0, SOFTCAP,
            DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
        # l_i == 0 only for an empty context (a pad row): zeros.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = (
            out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
            + offs_d[None, :]
        )  # fmt: skip
        # As a [D_PAD] vector, not a scalar: the interpreter refuses a store mask made from
        # a scalar comparison (its dtype comes out wrong); compiled, it costs nothing.
        at_last = (offs_d * 0 + last) == t
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask & at_last[None, :])


def flat_programs(num_pairs: int, num_sms: int) -> int | None:
    """Programs for `num_pairs` pairs, at most one per SM and each with the same number
    of pairs where it can; None when a program would need more than MAX_PAIRS."""
    per_program = triton.cdiv(num_pairs, max(1, num_sms))
    if per_program > MAX_PAIRS:
        return None
    return triton.cdiv(num_pairs, per_program)


def decode_flat(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    qk_scale: float,  # softmax scale * log2(e)
    out: torch.Tensor,  # [T, Hq, D]
    num_programs: int,  # from `flat_programs`
    tile: tuple[int, int, int],  # (keys per tile, warps, stages)
    dot_precision: str,
    upcast: bool,
    window: int = 0,  # kernels/attention.py's: > 0 sliding, < 0 chunked
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score * scale / softcap)
    sinks: torch.Tensor | None = None,  # [Hq] float32 attention sinks
) -> None:
    """The decode rows of `paged_attention_triton`'s batch, unsplit, by the flat kernel.
    The caller has checked the shapes."""
    num_rows = query_start_loc.numel() - 1
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_pairs = num_rows * num_kv_heads
    assert triton.cdiv(num_pairs, num_programs) <= MAX_PAIRS, "too few programs"
    group = num_q_heads // num_kv_heads
    block_n, num_warps, num_stages = tile
    _decode_flat_kernel[(num_programs,)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out,
        q if sinks is None else sinks, qk_scale, num_pairs,
        num_kv_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *kv_cache.stride()[:4], GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_N=block_n, MAX_PAIRS=MAX_PAIRS, WINDOW=window, SOFTCAP=softcap, HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision,
        UPCAST_DOT=upcast, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
