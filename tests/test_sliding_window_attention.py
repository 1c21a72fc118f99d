"""Sliding-window paged attention (Mistral v0.1, Phi-3, Qwen2 with use_sliding_window,
Gemma 2/3's local layers): query position p sees keys p - window + 1..p, transformers'
convention (`sliding_window_overlay`: kv_idx > q_idx - window). And chunked attention
(Llama 4's local layers, a negative `window`): p sees keys from the start of its block of
-window positions (`chunked_overlay`: kv_idx // chunk == q_idx // chunk) to p.

The spec (`paged_attention_ref` with `window`) is checked against plain float64 matmuls;
the Triton kernels (prefill, and every decode kernel at several split counts) against the
spec, on caches where every key below each row's first query's window holds NaN: a kernel
that loads one key no query may see returns NaN, not a small error. Tolerances are
`test_paged_attention_triton.check`'s (see its module docstring).
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention_triton import (
    CHUNK_ON_PREFIX,
    DECODE,
    DECODE_AT_1,
    FRESH_PROMPT,
    KH,
    LONG_DECODE,
    LONG_PROMPT,
    MIXED,
    PAD,
    QH,
    TWO_QUERIES,
    X,
    check,
    check_ref_against_dense,
    make_batch,
    run_kernel,
)

# 1: a token sees itself only; 3 and 17: inside one key tile; 64: one whole tile; 100*X:
# longer than most rows (the window then changes nothing there).
WINDOWS = [1, 3, 17, 64, 100 * X]
# chunks of 7 (inside a block), 16 (one block), 64 (one key tile) and 40*X positions
CHUNKS = [-7, -16, -64, -40 * X]
# every kind of decode row, and the shortest prompt to keep the batch mixed
DECODE_ROWS = [DECODE, TWO_QUERIES, DECODE_AT_1, PAD, LONG_DECODE]


@pytest.mark.parametrize("window", WINDOWS + CHUNKS)
def test_ref_matches_dense_matmul(window):
    """Guards the spec: the window's lower edge (inclusive of p - window + 1), for decode
    rows (the batched SDPA) and for chunks on a prefix and fresh prompts (one call each)."""
    check_ref_against_dense(make_batch([*MIXED, LONG_PROMPT], 6, 3, 20, 16, window=window))


def test_window_changes_the_answer():
    """Guards the tests themselves: a window shorter than the context gives a different
    output than full attention (otherwise the checks above could pass on a kernel that
    ignores the window)."""
    full = make_batch([LONG_DECODE, LONG_PROMPT], 4, 2, 24, 16)
    windowed = make_batch([LONG_DECODE, LONG_PROMPT], 4, 2, 24, 16, window=17)
    windowed.cache = full.cache  # same keys, no NaN poison: only the mask differs
    assert (full.run_ref() - windowed.run_ref()).abs().max() > 1e-2
    chunked = make_batch([LONG_DECODE, LONG_PROMPT], 4, 2, 24, 16, window=-17)
    chunked.cache = full.cache
    assert (full.run_ref() - chunked.run_ref()).abs().max() > 1e-2
    assert (windowed.run_ref() - chunked.run_ref()).abs().max() > 1e-2


@pytest.mark.parametrize("window", WINDOWS + CHUNKS)
@pytest.mark.parametrize("kernel", ["per_head", "packed", "flat"])
def test_mixed_batch_fp32(window, kernel, monkeypatch):
    """Guards every kernel with a window: prefill tiles below, across and inside the window
    edge (the masked, unmasked and causal loops), decode rows whose window starts
    mid-block, a pad row, block size 16 over shuffled blocks. The decode kernel is what the
    `kernel` cases change, so the packed and flat ones keep the decode rows and one short
    prompt (still a mixed batch) and leave the long prompts to the per-head cases: under
    the interpreter those prefill tiles took most of each case's 2-5 s."""
    rows = [*MIXED, LONG_PROMPT] if kernel == "per_head" else DECODE_ROWS
    batch = make_batch(rows, 6, 3, 20, 16, window=window)
    check(batch, run_kernel(batch, kernel, monkeypatch))


@pytest.mark.parametrize("window", [50 * X, -50 * X])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("kernel", ["per_head", "packed"])
def test_decode_splits_cut_the_window(num_splits, kernel, window):
    """Guards split-K under a window: the slices cut the window, not the context, so the
    merge counts the slices that ran (a row longer than its window merges as many as a
    row of `window` keys)."""
    rows = [LONG_DECODE, DECODE, (64 * X, 1), (65 * X, 1), DECODE_AT_1, PAD]
    batch = make_batch(rows, 4, 1, 36, 16, window=window)
    check(batch, batch.run_triton(num_splits=num_splits, decode_kernel=kernel))


@pytest.mark.parametrize("window", [7, -7])
@pytest.mark.parametrize("bs", [1, 8])
def test_block_sizes_and_two_query_rows(bs, window):
    """Guards block-table arithmetic at the window edge for blocks of 1 and 8 keys, and
    the shortest prefill rows (two queries, a chunk on a prefix)."""
    rows = [TWO_QUERIES, CHUNK_ON_PREFIX, FRESH_PROMPT, DECODE]
    batch = make_batch(rows, 4, 2, 36, bs, window=window)
    check(batch, batch.run_triton())


@pytest.mark.parametrize("window", [40, -40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_16bit(dtype, window):
    """Guards the 16-bit tile config (64-query tiles, 64-key tiles) with a window that
    starts inside a key tile."""
    batch = make_batch([*MIXED, LONG_PROMPT], QH, KH, 128, 16, dtype=dtype, window=window)
    check(batch, batch.run_triton())
