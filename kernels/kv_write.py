"""Triton KV-cache write: scatter each token's K and V into its cache slot.

The device path of `attention.write_kv`; `attention.write_kv_ref` is the spec. Cache
layout per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`. One program per
token moves its `[Hkv, D]` K and V tiles (8 x 128 bf16 = 2 KB each for Qwen3-0.6B); a pad
token (slot -1) loads and stores nothing. The grid is the slot mapping's length, so the
launch never reads the device and can be captured in a CUDA graph.

What this module does not know: which tokens are pads (the slot mapping says so) or
anything about blocks beyond `slot // block_size`.

An FP8 cache (kernels/fp8_kv.py) stores `K / k_scale` and `V / v_scale` as their float8
bytes, through a uint8 view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_kv import cache_value, inverse_scale, store_target


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    cache_block_stride,
    cache_kv_stride,
    cache_offset_stride,
    cache_head_stride,
    block_size,
    num_heads,
    head_dim,
    k_inv_scale,
    v_inv_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # 0: the cache's own dtype; else kv_cache_ptr is its bytes
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # Pad tokens (slot -1) see zero heads: no load, no store. (A bool scalar & a bool
    # tensor would do the same, but Triton's interpreter turns that mask into int64.)
    live_heads = tl.where(slot >= 0, num_heads, 0)
    mask = (heads[:, None] < live_heads) & (dims[None, :] < head_dim)
    key_offs = t * key_token_stride + heads[:, None] * key_head_stride + dims[None, :]
    value_offs = t * value_token_stride + heads[:, None] * value_head_stride + dims[None, :]
    k = tl.load(key_ptr + key_offs, mask=mask)
    v = tl.load(value_ptr + value_offs, mask=mask)
    # int64 throughout: num_blocks * block_size * Hkv * D passes 2^31 on a large cache
    # (65k blocks of 16 x 8 x 128 already do).
    block = slot // block_size
    offset = slot % block_size
    slot_base = block * cache_block_stride + offset * cache_offset_stride
    cache_offs = slot_base + heads[:, None] * cache_head_stride + dims[None, :]
    cache_dtype = kv_cache_ptr.dtype.element_ty
    k = cache_value(k, k_inv_scale, cache_dtype, FP8_MANTISSA)
    v = cache_value(v, v_inv_scale, cache_dtype, FP8_MANTISSA)
    tl.store(kv_cache_ptr + cache_offs, k, mask=mask)
    tl.store(kv_cache_ptr + cache_kv_stride + cache_offs, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], updated in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
) -> None:
    assert key.dim() == 3 and key.shape == value.shape, "key and value are both [T, Hkv, D]"
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, (
        f"a layer's cache is [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}"
    )
    assert key.shape[1:] == kv_cache.shape[3:], (
        f"key/value heads/dim {tuple(key.shape[1:])} must match the cache's {tuple(kv_cache.shape[3:])}"
    )
    num_tokens = slot_mapping.numel()
    assert key.shape[0] >= num_tokens, "key/value hold at least one row per slot-mapping entry"
    assert slot_mapping.dim() == 1 and slot_mapping.is_contiguous(), "slot_mapping is 1-D"
    assert slot_mapping.dtype in (torch.int32, torch.int64), "slot_mapping must be int32/int64"
    # Rows may be strided views (K/V split out of the fused QKV projection), but each
    # head's D values must be contiguous for vectorised loads/stores.
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value head_dim must be contiguous"
    assert kv_cache.stride(4) == 1, "the cache's head_dim must be contiguous"
    if num_tokens == 0:
        return
    _, _, block_size, num_heads, head_dim = kv_cache.shape
    block_h = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(head_dim)
    # 4 warps cover a 1024-element tile (8 heads x 128) with 8 bf16 (16 B) per thread.
    num_warps = 4 if block_h * block_d <= 2048 else 8
    target, fp8_mantissa = store_target(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        target,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_size,
        num_heads,
        head_dim,
        inverse_scale(scales[0]),
        inverse_scale(scales[1]),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        FP8_MANTISSA=fp8_mantissa,
        num_warps=num_warps,
    )
