"""The q/k/v preparation and the decode attention in one launch (the `per_head_prep`
decode kernel, and `auto`'s choice where `applies`).

A decode layer runs `prepare_qkv` (split, q/k RMSNorm, RoPE, the new token's K/V into the
cache) and then the per-head decode attention (kernels/paged_decode_split.py): two
launches, the second waiting for the first's tail. Here a program of the attention's grid
`(R, Hkv)` first runs the preparation's own body (kernels/qkv_prep.py `prepare_heads`) for
its row's token and its heads only: the group's q heads and the one k / v head it attends
with. It stores q and the new K/V as the preparation does, passes a block barrier (its
stores are then visible to all of its threads) and runs the unsplit per-head attention,
which reads them back. No program depends on another's preparation: a kv head's program
writes exactly the cache slot it reads as the newest key.

Only for unsplit plans of pure decode batches (one query a row) of up to
FEW_DECODE_PAIRS (row, kv head) pairs (`applies`): a split row's slices would each need
the whole preparation first, and bigger grids measured slower fused. Under Triton's
interpreter the result is bitwise the two launches'. On a GPU the preparation's norm sums
over the attention's warps, not one, and the kernel runs with FP fusion off (the
preparation's rounding points need it), so the score scaling is a multiply and a
subtract rather than one FMA: outputs a rounding apart.

H100 (four calls): small_batch's decode step graph 1.528-1.551 ms against 1.551-1.580
with the two launches (-1.4% to -1.8%), its TPOT p50 1.547-1.572 against 1.568-1.587 ms
(results/qkv_attend_ab_h100_20ae6d6.jsonl, l2_prefetch_ab_h100_1f727ac.jsonl,
per_head_prep_ab_h100_63f2ec0.jsonl, auto_prep_ab_h100_de81bee.jsonl);
decode_heavy (4,096 pairs, before the pairs bound) 43,183 against 48,469 tok/s. Not yet
timed on an H200 (none was lent in the sessions since).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import attend_tile, decode_slice, softmax_start
from pdserve.kernels.paged_attention_triton import LOG2E, decode_span
from pdserve.kernels.paged_decode_split import FEW_DECODE_PAIRS, SplitPlan, split_plan
from pdserve.kernels.qkv_prep import prep_launch, prepare_heads
from pdserve.kernels.row_squares import ScaleRows


def _plan(dtype: torch.dtype, head_dim: int, num_rows: int, num_kv_heads: int,
          max_seq_len: int, window: int) -> SplitPlan:  # fmt: skip
    """The per-head decode plan of this batch (paged_attention_triton's)."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    span = decode_span(max_seq_len, window)
    return split_plan(dtype, d_pad, num_rows, num_kv_heads, span, None)


def applies(dtype: torch.dtype, head_dim: int, num_rows: int, num_kv_heads: int,
            max_seq_len: int, window: int) -> bool:  # fmt: skip
    """Whether the fused form serves this batch: its per-head decode plan is unsplit, and
    its grid has at most FEW_DECODE_PAIRS (row, kv head) pairs, the small batches where it
    measured faster (H100: small_batch's 256 pairs -1.3% TPOT; decode_heavy's 4,096 pairs
    lost 11% of its throughput, `per_head_prep_ab_h100_63f2ec0.jsonl`)."""
    if num_rows * num_kv_heads > FEW_DECODE_PAIRS:
        return False
    return _plan(dtype, head_dim, num_rows, num_kv_heads, max_seq_len, window).num_splits == 1


# num_slots follows the step's token count: not specialised on.
@triton.jit(do_not_specialize=["num_slots"])
def _qkv_attend_kernel(
    # prepare_heads' (qkv_prep.prep_launch)
    qkv_ptr, q_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, cos_sin_ptr, kv_store_ptr,
    slot_mapping_ptr, sq_ptr, bias_ptr, num_slots, num_sq_parts, sq_dim, sq_eps,
    qkv_token_stride, cos_sin_stride, cache_block_stride, cache_kv_stride,
    cache_offset_stride, cache_head_stride, block_size, eps, k_inv_scale, v_inv_scale,
    # the attention's (paged_decode_split's names)
    kv_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, sinks_ptr, qk_scale, stride_qt, stride_qh,
    stride_ot, stride_oh, stride_bt, stride_cb, stride_ckv, stride_ct, stride_ch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, ROUND_NORMED: tl.constexpr, SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, SQ_PARTS_PAD: tl.constexpr, SQ_STRIDE: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start, _, _, key_start, key_end, skip = decode_slice(
        qsl_ptr, seq_lens_ptr, row, 0, BLOCK_N, 1, BLOCK_N, True, WINDOW
    )
    prepare_heads(
        qkv_ptr, q_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, cos_sin_ptr, kv_store_ptr,
        slot_mapping_ptr, sq_ptr, bias_ptr, q_start.to(tl.int64), kv_head * GROUP, GROUP,
        kv_head, 1, num_slots, num_sq_parts, sq_dim, sq_eps, qkv_token_stride,
        cos_sin_stride, cache_block_stride, cache_kv_stride, cache_offset_stride,
        cache_head_stride, block_size, eps, k_inv_scale, v_inv_scale, NUM_Q_HEADS,
        NUM_KV_HEADS, HEAD_DIM, BLOCK_HQ, BLOCK_HK, BLOCK_HALF, HAS_NORM, ROUND_NORMED,
        SCALE_ROWS, HAS_BIAS, SQ_PARTS_PAD, SQ_STRIDE, FP8_MANTISSA,
    )  # fmt: skip
    # q and the new K/V were stored by other threads of this program
    tl.debug_barrier()
    if skip:
        return

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    tok = q_start.to(tl.int64)
    mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)  # fmt: skip
    m_i, l_i = softmax_start(sinks_ptr, heads, g_mask, HAS_SINKS)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt
    for n0 in range(key_start, key_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, offs_g, kv_ptr, bt_row_ptr, kv_head * stride_ch, n0, key_end,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale, BLOCK_SIZE,
            True, False, 0, SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    # l_i == 0 only for an empty context (a pad row): zeros
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)


def qkv_attend_triton(
    qkv: torch.Tensor,  # [R, (Hq + 2 Hkv) * D]: one token a row
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,  # [R] int64
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [R'] int64, -1 = skip
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32: 0, 1, ..., R
    seq_lens: torch.Tensor,  # [R_pad] int32, with the new token
    scale: float,  # the softmax scale
    max_seq_len: int,
    scale_rows: ScaleRows | None = None,
    bias: torch.Tensor | None = None,
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:
    """`paged_attention(prepare_qkv(qkv, ...), ...)` of a decode batch whose per-head plan
    is unsplit (`applies`) -> the attention output [R, Hq, D]. The softmax scale is taken
    as given (an FP8 cache's caller folds k_scale into it, as for `paged_attention`)."""
    num_rows, head_dim = qkv.shape[0], kv_cache.shape[-1]
    assert query_start_loc.numel() == num_rows + 1, "one query a row: R + 1 query starts"
    plan = _plan(qkv.dtype, head_dim, num_rows, num_kv_heads, max_seq_len, window)
    assert plan.num_splits == 1, "the fused form takes unsplit per-head plans only"
    assert num_q_heads % num_kv_heads == 0 and scale > 0 and softcap >= 0
    assert sinks is None or (sinks.shape == (num_q_heads,) and sinks.dtype == torch.float32
                             and sinks.is_contiguous())  # fmt: skip
    for t in (block_tables, query_start_loc, seq_lens):
        assert t.dtype == torch.int32 and t.stride(-1) == 1, "block tables and lengths: int32"
    assert kv_cache.is_contiguous() and seq_lens.numel() >= num_rows
    group = num_q_heads // num_kv_heads
    q = torch.empty((num_rows, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    args, consts = prep_launch(
        qkv, q, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, positions,
        cos_sin_cache, kv_cache, slot_mapping, scale_rows, bias, scales,
        triton.next_power_of_2(group), 1,
    )  # fmt: skip
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_dim))
    tile = plan.tile
    _qkv_attend_kernel[(num_rows, num_kv_heads)](
        *args, kv_cache, block_tables, query_start_loc, seq_lens, out,
        q if sinks is None else sinks, scale * LOG2E, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), *kv_cache.stride()[:4],
        **consts, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_N=tile.block_n, WINDOW=window, SOFTCAP=softcap,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        # CPU tensors only under TRITON_INTERPRET=1 (attention_parts.attention_dot)
        UPCAST_DOT=qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        # the preparation's rounding points (kernels/qkv_prep.py)
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
