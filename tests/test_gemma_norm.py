"""Gemma's RMSNorm in 16-bit models: `1 + w` is kept in float32 (runner/models/gemma.py
keeps its norm weights float32), and a float32 weight on 16-bit inputs makes the norm
kernels take the product in float32 and round once (kernels/norm.py), as transformers'
Gemma RMSNorm does. In bf16, `1 + w` itself would lose every |w| under 2^-8.

The reference is checked bit for bit against transformers' Gemma3RMSNorm; the Triton
kernels (the norm, the fused add-norm, and q/k norms inside prepare_qkv) against the
reference with `test_triton_layer_kernels`' tolerances.
"""

from __future__ import annotations

import pytest
import torch
from test_qkv_prep import _close_after_norm, _inputs, _run
from test_triton_index_kernels import DEVICE, ON_CUDA, _gen
from test_triton_layer_kernels import _assert_close

from pdserve.kernels.norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from pdserve.kernels.qkv_prep import prepare_qkv_ref, prepare_qkv_triton

HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def _weight(d: int, seed: int) -> torch.Tensor:
    """`1 + w` in float32 with w small (|w| ~ 1e-3, below bf16's resolution at 1)."""
    return 1 + 1e-3 * torch.randn(d, generator=_gen(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_is_transformers_gemma_norm(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x = (3 * torch.randn(5, 96, generator=_gen(1))).to(dtype)
    one_plus_w = _weight(96, 2)
    hf = Gemma3RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(one_plus_w - 1)
    got = rms_norm_ref(x, one_plus_w, 1e-6)
    assert got.dtype == dtype
    assert torch.equal(got, hf(x))
    # what a 16-bit `1 + w` would give instead: visibly different
    assert not torch.equal(got, rms_norm_ref(x, one_plus_w.to(dtype), 1e-6))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_triton_norms_match_the_reference(dtype):
    x = (3 * torch.randn(9, 96, generator=_gen(3))).to(dtype).to(DEVICE)
    r = torch.randn(9, 96, generator=_gen(4)).to(dtype).to(DEVICE)
    w = _weight(96, 5).to(DEVICE)
    _assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    out, res = fused_add_rms_norm_triton(x, r, w, 1e-6)
    out_ref, res_ref = fused_add_rms_norm_ref(x, r, w, 1e-6)
    _assert_close(out, out_ref)
    assert torch.equal(res, res_ref)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_prepare_qkv_with_float32_norm_weights(dtype):
    """Gemma 3's q/k norms inside the fused attention-input kernel."""
    inp = _inputs(7, 4, 2, 32, dtype, seed=11)
    inp["q_norm_weight"] = _weight(32, 6).to(DEVICE)
    inp["k_norm_weight"] = _weight(32, 7).to(DEVICE)
    q_ref, cache_ref = _run(prepare_qkv_ref, inp)
    q, cache = _run(prepare_qkv_triton, inp)
    assert q.dtype == dtype
    _close_after_norm(q, q_ref)
    _close_after_norm(cache, cache_ref)
