"""Attention sinks (gpt-oss: a learned logit per query head that joins each softmax's
denominator and adds nothing to its output) in the paged attention spec and every Triton
kernel, alone and with gpt-oss's alternating 128-key sliding window.

The spec is checked against plain float64 matmuls; the kernels against the spec on the
NaN-poisoned caches of `test_paged_attention_triton` (tolerances: its `check`). Sinks of
+-3 around scores of a few units take a visible share of each softmax
(`test_sinks_change_the_answer`); split-K decode must count a head's sink once, however
many slices its row is cut into.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention_triton import (
    DECODE,
    LONG_DECODE,
    LONG_PROMPT,
    MIXED,
    PAD,
    check,
    check_ref_against_dense,
    make_batch,
    run_kernel,
)


def _sinks(hq: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(hq, generator=torch.Generator().manual_seed(seed))


def _batch(window=0, dtype=torch.float32, hq=6, hk=3, d=20, sinks=True):
    batch = make_batch([*MIXED, LONG_PROMPT], hq, hk, d, 16, dtype=dtype, window=window)
    batch.sinks = _sinks(hq) if sinks else None
    return batch


@pytest.mark.parametrize("window", [0, 9])
def test_ref_matches_dense_matmul(window):
    check_ref_against_dense(_batch(window=window))


def test_sinks_change_the_answer():
    assert (_batch().run_ref() - _batch(sinks=False).run_ref()).abs().max() > 0.05


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("kernel", ["per_head", "packed", "flat"])
def test_kernels_match_the_spec(kernel, window, monkeypatch):
    batch = _batch(window=window)
    check(batch, run_kernel(batch, kernel, monkeypatch))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("kernel", ["per_head", "packed"])
def test_split_decode_counts_each_sink_once(kernel, num_splits):
    batch = make_batch([LONG_DECODE, DECODE, PAD, LONG_DECODE], 4, 2, 36, 16)
    batch.sinks = _sinks(4, seed=1)
    check(batch, batch.run_triton(decode_kernel=kernel, num_splits=num_splits))


def test_16bit():
    batch = _batch(dtype=torch.bfloat16, hq=16, hk=8, d=64, window=40)
    check(batch, batch.run_triton())
