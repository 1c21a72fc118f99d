"""Triton varlen causal prefill attention over the paged KV cache.

`_prefill_kernel`, grid `(Hq, T // BLOCK_M + R)`, serves the rows of
`paged_attention_triton`'s batch with two or more queries (prefill chunks, with or
without a cached prefix). Each program finds its (row, query tile) from
`query_start_loc`, then runs flash attention over one query head and BLOCK_M queries,
walking the row's key tiles through its block table up to the causal limit; tiles
entirely below the diagonal skip all masking. The grid is sized from host ints only, so
a launch never syncs with the device and can be captured in a CUDA graph.

What this module does not know: the decode rows. Rows with one query (decode, pad) are
left to the decode kernels (kernels/paged_decode_split.py and its siblings); the
program exits at once on them, so a mixed step needs no host-side split of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import (
    TileConfig,
    attend_tile,
    first_visible_key,
    softmax_start,
    tile_for,
)

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


@triton.jit(do_not_specialize=["num_rows", "num_slots"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [num_blocks, 2, block_size, Hkv, D]
    bt_ptr,  # [R_pad, max_blocks] int32
    qsl_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R_pad] int32
    out_ptr,  # [T, Hq, D]
    sinks_ptr,  # [Hq] float32 attention sinks (HAS_SINKS)
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
    WINDOW: tl.constexpr,  # > 0: query p sees keys (p - WINDOW, p] (sliding window)
    SOFTCAP: tl.constexpr,  # > 0: attention logit softcapping (Gemma 2)
    HAS_SINKS: tl.constexpr,  # a sink logit per query head in the denominator (gpt-oss)
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

    m_i, l_i = softmax_start(sinks_ptr, head + offs_m * 0, offs_m >= 0, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt
    kv_head_off = (head // GROUP) * stride_ch
    # Keys [0, prefix + m_start] are visible to every query of the tile: whole tiles there
    # need no mask. The rest, up to the last query's position, is masked causally.
    full_end = tl.maximum(prefix + m_start + 1, 0) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(prefix + tl.minimum(m_start + BLOCK_M, q_len), seq_len)
    # With a sliding window (or chunks), key tiles start at the first query's first
    # visible key; keys from the last query's first visible key on are visible to every
    # query, so the tiles below that are masked (by the window) and the tiles from there
    # to full_end are not.
    if WINDOW != 0:
        last_pos = prefix + tl.minimum(m_start + BLOCK_M, q_len) - 1
        win_lo = first_visible_key(prefix + m_start, WINDOW) // BLOCK_N * BLOCK_N
        win_all = tl.cdiv(first_visible_key(last_pos, WINDOW), BLOCK_N) * BLOCK_N
        win_all = tl.maximum(tl.minimum(win_all, full_end), win_lo)
        for n0 in range(win_lo, win_all, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, kv_head_off, n0, seq_len,
                offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
                BLOCK_SIZE, True, True, WINDOW, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
            )  # fmt: skip
    else:
        win_all = full_end * 0
    for n0 in range(win_all, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, kv_head_off, n0, seq_len,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, False, True, WINDOW, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    for n0 in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, kv_head_off, n0, seq_len,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, True, True, WINDOW, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip

    # l_i == 0 only when the row's context is empty or shorter than its queries (bad input).
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    qk_scale: float,  # softmax scale * log2(e)
    out: torch.Tensor,  # [T, Hq, D]
    dot_precision: str,
    upcast: bool,
    window: int = 0,  # kernels/attention.py's: > 0 sliding, < 0 chunked
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score * scale / softcap)
    sinks: torch.Tensor | None = None,  # [Hq] float32 attention sinks
) -> None:
    """The rows of `paged_attention_triton`'s batch with two or more queries, by the
    prefill kernel. The caller has checked the shapes."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_rows = query_start_loc.numel() - 1
    d_pad = max(16, triton.next_power_of_2(head_dim))
    cfg = tile_for(q.dtype, d_pad, _PREFILL_16BIT, _PREFILL_WIDE)
    num_slots = num_tokens // cfg.block_m + num_rows
    assert num_slots <= 65535, "query tiles ride on a grid axis limited to 65535"
    _prefill_kernel[(num_q_heads, num_slots)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out,
        q if sinks is None else sinks, qk_scale, num_rows,
        num_slots, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *kv_cache.stride()[:4], GROUP=num_q_heads // kv_cache.shape[3],
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_R=128, WINDOW=window, SOFTCAP=softcap, HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision,
        UPCAST_DOT=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
