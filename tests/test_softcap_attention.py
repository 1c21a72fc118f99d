"""Attention logit softcapping (Gemma 2: scores become cap * tanh(score * scale / cap)
before the softmax) in the paged attention spec and every Triton kernel.

The spec is checked against plain float64 matmuls; the kernels against the spec on the
NaN-poisoned caches of `test_paged_attention_triton` (tolerances: its `check`). The
queries are scaled up so that scores reach several times the cap: tanh then saturates,
and a kernel that skipped the cap, or applied it before the softmax scale, is off by far
more than any tolerance (checked by `test_softcap_changes_the_answer`).
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention_triton import (
    LONG_DECODE,
    LONG_PROMPT,
    MIXED,
    check,
    check_ref_against_dense,
    make_batch,
    run_kernel,
)

CAP = 2.0


def _batch(softcap=CAP, window=0, dtype=torch.float32, hq=6, hk=3, d=20):
    batch = make_batch([*MIXED, LONG_PROMPT], hq, hk, d, 16, dtype=dtype, window=window)
    batch.q = (batch.q.float() * 4).to(dtype)  # scores of +-10: well into tanh's tails
    batch.softcap = softcap
    return batch


@pytest.mark.parametrize("window", [0, 9])
def test_ref_matches_dense_matmul(window):
    check_ref_against_dense(_batch(window=window))


def test_softcap_changes_the_answer():
    capped, plain = _batch(), _batch(softcap=0.0)
    assert (capped.run_ref() - plain.run_ref()).abs().max() > 0.1


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("kernel", ["per_head", "packed", "flat"])
def test_kernels_match_the_spec(kernel, window, monkeypatch):
    """Prefill tiles (masked and unmasked), decode rows, a pad row, with and without a
    sliding window (Gemma 2's local layers have both)."""
    batch = _batch(window=window)
    check(batch, run_kernel(batch, kernel, monkeypatch))


@pytest.mark.parametrize("num_splits", [2, 5])
def test_decode_splits(num_splits):
    batch = make_batch([LONG_DECODE, LONG_DECODE], 4, 2, 36, 16)
    batch.q = batch.q * 4
    batch.softcap = CAP
    check(batch, batch.run_triton(num_splits=num_splits))


def test_16bit():
    batch = _batch(dtype=torch.bfloat16, hq=16, hk=8, d=128)
    check(batch, batch.run_triton())
