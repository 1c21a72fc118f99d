"""Triton MLA: the latent write and the absorbed attention over the paged latent cache.

`paged_mla_attention_ref` and `write_latent_ref` (kernels/mla_attention.py) are the spec.
Every head of a token attends the same latent rows, so a program takes BLOCK_H heads of
BLOCK_Q queries of one row as the M side of its tiles (M = BLOCK_Q x BLOCK_H >= 16, the
smallest `tl.dot`): a decode row's 16 heads share each key tile's load, where a per-head
program would read the row's latents once a head. Scores are the latent part
`q_lat . c` plus the rotary part `q_pe . k_pe` (two dots: r + rope is not a power of two);
the values are the same `c` tile, so one load serves both products. Online softmax in
base 2, masked past each query's causal limit; a row with no context (a pad row of a
decode graph) writes zeros. Query and key bounds come from the device (query_start_loc,
seq_lens), the grid from host bounds, so a decode graph replays it for any step.

The tiles are first guesses, not yet measured on a GPU. On CPU tensors this runs only
under TRITON_INTERPRET=1, which is how the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_parts import attention_dot
from pdserve.kernels.fp8_kv import FORMATS as FP8_DTYPES
from pdserve.kernels.fp8_kv import cache_value, inverse_scale, store_target

LOG2E = 1.4426950408889634


@triton.jit
def _write_latent_kernel(
    latent_ptr,
    cache_ptr,
    slot_ptr,
    latent_stride,
    width,
    inv_scale,
    BLOCK_W: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # 0: the cache's own dtype; else cache_ptr is its bytes
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    # A pad token (slot -1) sees a zero-width row: no load, no store.
    mask = cols < tl.where(slot >= 0, width, 0)
    row = tl.load(latent_ptr + t * latent_stride + cols, mask=mask)
    target = cache_ptr + tl.maximum(slot, 0) * width + cols
    tl.store(target, cache_value(row, inv_scale, cache_ptr.dtype.element_ty, FP8_MANTISSA),
             mask=mask)  # fmt: skip


def write_latent_triton(
    latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0
):
    assert cache.dim() == 3 and cache.is_contiguous(), "a layer's cache is [blocks, bs, r + rope]"
    assert latent.dim() == 2 and latent.shape[1] == cache.shape[2] and latent.stride(1) == 1, (
        f"latent {tuple(latent.shape)} must be [T, {cache.shape[2]}] with unit stride"
    )
    assert slot_mapping.dim() == 1 and slot_mapping.is_contiguous(), "slot_mapping is 1-D"
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    width = cache.shape[2]
    target, fp8_mantissa = store_target(cache)
    _write_latent_kernel[(num_tokens,)](
        latent, target, slot_mapping, latent.stride(0), width, inverse_scale(scale),
        BLOCK_W=triton.next_power_of_2(width), FP8_MANTISSA=fp8_mantissa,
    )  # fmt: skip


@triton.jit
def _mla_attention_kernel(
    q_ptr,  # [T, H, r + rope], unit stride on the last dim
    cache_ptr,  # [num_blocks, block_size, r + rope], contiguous
    out_ptr,  # [T, H, r], unit stride on the last dim
    block_tables_ptr,  # [R_pad, max_blocks] int32
    query_start_loc_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R_pad] int32
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_heads,
    rank,
    rope,
    block_size,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    first_q = tl.program_id(1) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if first_q < q_len:
        ctx = tl.load(seq_lens_ptr + row)
        width = rank + rope
        m = tl.arange(0, BLOCK_Q * BLOCK_H)
        tok = first_q + m // BLOCK_H
        head = tl.program_id(2) * BLOCK_H + m % BLOCK_H
        live = (tok < q_len) & (head < num_heads)
        limit = ctx - q_len + tok  # each query's last visible key
        r_offs = tl.arange(0, BLOCK_R)
        p_offs = tl.arange(0, BLOCK_P)
        r_ok = r_offs < rank
        p_ok = p_offs < rope
        q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        q_lat = tl.load(
            q_ptr + q_rows[:, None] + r_offs[None, :], mask=live[:, None] & r_ok[None, :], other=0.0
        )
        q_pe = tl.load(
            q_ptr + q_rows[:, None] + rank + p_offs[None, :],
            mask=live[:, None] & p_ok[None, :], other=0.0,
        )  # fmt: skip
        m_i = tl.full((BLOCK_Q * BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_Q * BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_Q * BLOCK_H, BLOCK_R), dtype=tl.float32)
        # Keys past the tile's last query are invisible to all of it.
        key_end = tl.minimum(ctx, ctx - q_len + first_q + BLOCK_Q)
        bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
        for n0 in range(0, key_end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            k_ok = keys < key_end
            block = tl.load(bt_row + keys // block_size, mask=k_ok, other=0).to(tl.int64)
            k_rows = (block * block_size + keys % block_size) * width
            c = tl.load(
                cache_ptr + k_rows[:, None] + r_offs[None, :],
                mask=k_ok[:, None] & r_ok[None, :], other=0.0,
            ).to(q_lat.dtype)  # fmt: skip
            k_pe = tl.load(
                cache_ptr + k_rows[:, None] + rank + p_offs[None, :],
                mask=k_ok[:, None] & p_ok[None, :], other=0.0,
            ).to(q_lat.dtype)  # fmt: skip
            s = tl.zeros((BLOCK_Q * BLOCK_H, BLOCK_N), dtype=tl.float32)
            s = attention_dot(q_lat, tl.trans(c), s, DOT_PRECISION, UPCAST_DOT)
            s = attention_dot(q_pe, tl.trans(k_pe), s, DOT_PRECISION, UPCAST_DOT)
            visible = k_ok[None, :] & (keys[None, :] <= limit[:, None])
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = attention_dot(p.to(c.dtype), c, acc * alpha[:, None], DOT_PRECISION, UPCAST_DOT)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(
            out_ptr + o_rows[:, None] + r_offs[None, :],
            out.to(out_ptr.dtype.element_ty), mask=live[:, None] & r_ok[None, :],
        )  # fmt: skip


def paged_mla_attention_triton(
    q: torch.Tensor,  # [T, H, r + rope]
    cache: torch.Tensor,  # [num_blocks, block_size, r + rope]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor,  # [T, H, r] out
    max_query_len: int,  # host bound on a row's queries: sizes the grid
) -> None:
    num_tokens, num_heads, width = q.shape
    assert cache.dim() == 3 and cache.shape[2] == width and cache.is_contiguous(), (
        f"cache {tuple(cache.shape)} must be contiguous [blocks, block_size, {width}]"
    )
    assert out.shape == (num_tokens, num_heads, kv_lora_rank), (
        f"out {tuple(out.shape)} must be [T, H, r={kv_lora_rank}]"
    )
    assert q.stride(2) == 1 and out.stride(2) == 1, "q and out need unit stride on the last dim"
    assert q.dtype == out.dtype and cache.dtype in (q.dtype, *FP8_DTYPES), (
        "q and out share a dtype; the cache is in it or FP8"
    )
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert query_start_loc.dtype == torch.int32 and seq_lens.dtype == torch.int32
    num_rows = query_start_loc.numel() - 1
    if num_tokens == 0 or num_rows <= 0 or max_query_len <= 0:
        return
    rope = width - kv_lora_rank
    block_h = min(16, triton.next_power_of_2(num_heads))
    # M = BLOCK_Q x BLOCK_H: 16 for decode rows and wide latents (r = 512 keeps a [16, 512]
    # fp32 accumulator), 64 when rows carry many queries of a narrow latent.
    wide = max_query_len == 1 or kv_lora_rank > 128
    block_q = max(1, (16 if wide else 64) // block_h)
    block_n = 16 if q.dtype == torch.float32 or kv_lora_rank > 256 else 32
    grid = (num_rows, triton.cdiv(max_query_len, block_q), triton.cdiv(num_heads, block_h))
    _mla_attention_kernel[grid](
        q, cache, out, block_tables, query_start_loc, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        num_heads, kv_lora_rank, rope, cache.shape[1],
        BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        num_warps=4,
    )  # fmt: skip
