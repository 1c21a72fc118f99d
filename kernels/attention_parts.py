"""What the Triton attention kernels share (paged_attention_triton, paged_decode_packed):
their dot, and the decode kernels' cut of a row's context into split-K slices."""

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


@triton.jit
def decode_slice(
    qsl_ptr, seq_lens_ptr, row, split, min_split_keys, num_splits, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):  # fmt: skip
    """A decode program's row and slice: (q_start, seq_len, split_len, key_start, key_end,
    skip). Rows with several queries belong to the prefill kernel. Splits past the context
    write nothing and do not count in: the merging program derives the number of valid
    splits from seq_len (`valid_splits`). Split 0 always runs, so an empty pad row still
    gets its zeros."""
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.load(qsl_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    split_len = row_split_len(seq_len, min_split_keys, num_splits, BLOCK_N)
    key_start = split * split_len
    skip = q_len != 1
    if not SINGLE_SPLIT:
        skip = skip | ((key_start >= seq_len) & (split > 0))
    key_end = tl.minimum(key_start + split_len, seq_len)
    return q_start, seq_len, split_len, key_start, key_end, skip


@triton.jit
def valid_splits(seq_len, split_len, num_splits):
    """How many of a row's slices run (and count in before the merge): at least one."""
    return tl.maximum(tl.minimum((seq_len + split_len - 1) // split_len, num_splits), 1)
