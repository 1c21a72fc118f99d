"""What the Triton decode/prefill attention kernels share (paged_attention_triton,
paged_decode_packed): their dot and the per-row cut of a context into split-K slices."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attention_dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # acc + a @ b, accumulated inside the MMA (no separate add over the [M, D] tile).
    # UPCAST_DOT: Triton's interpreter multiplies bf16 tiles as their raw uint16 bits; fp32
    # operands give what the tensor cores give (bf16 products are exact in fp32).
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


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
