"""The fused qkv projection + attention-input preparation (kernels/qkv_linear.py) against
its spec, `qkv_linear_ref` (scaled_linear_ref, then prepare_qkv_ref without a scale).

Inputs and weights hold small integers times powers of two, so every product and every
partial sum is exact in float32: the kernel's split-K order and F.linear's give the same
fp32 product, and what is compared is the epilogue (row scale, bias, rounding, the
per-head norm, RoPE, the q store and the cache writes), with test_qkv_prep's tolerance
for the norm's sum of squares. Without CUDA the kernel runs under Triton's interpreter at
small awkward sizes (head dims 24 and 80, whose halves are not powers of two; 3 q heads
over 1 kv head); with CUDA also at the Qwen3-0.6B shape in bf16.
"""

from __future__ import annotations

import pytest
import torch
from test_norm_fold import _squares
from test_qkv_prep import _close_after_norm, _inputs
from test_triton_index_kernels import DEVICE, ON_CUDA

from pdserve.kernels.qkv_linear import qkv_linear_ref, qkv_linear_triton
from pdserve.kernels.row_squares import ScaleRows
from pdserve.kernels.workspace import KernelWorkspace

SMALL = [(1, 2, 1, 24, 64), (7, 3, 1, 80, 192), (33, 4, 2, 128, 256)]  # T, Hq, Hkv, D, K
CASES = SMALL + ([(32, 16, 8, 128, 1024), (64, 16, 8, 128, 1024)] if ON_CUDA else [])
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def _exact(shape, g, scale):
    """Integers in [-4, 4] times `scale`: exact products and sums in fp32 (and exact in
    16 bits as stored)."""
    return torch.randint(-4, 5, shape, generator=g).float() * scale


def _case(t, hq, hkv, d, k, dtype, seed, with_norm=True, bias=False, short_slots=False):
    inp = _inputs(t, hq, hkv, d, dtype, seed, with_norm=with_norm, short_slots=short_slots)
    del inp["qkv"]
    g = torch.Generator().manual_seed(seed + 1)
    width = (hq + 2 * hkv) * d
    x = _exact((t, k), g, 0.25).to(dtype).to(DEVICE)
    w = _exact((width, k), g, 2.0**-5).to(dtype).to(DEVICE)
    b = (_exact((width,), g, 2.0**-3).to(dtype).to(DEVICE)) if bias else None
    scale = ScaleRows(_squares(3, t, k, seed=seed + 2), eps=1e-6)
    return dict(inp, x=x, weight=w, bias=b, scale=scale)


def _run(fn, case, **kw):
    case = dict(case, kv_cache=case["kv_cache"].clone())
    return fn(**case, **kw), case["kv_cache"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CASES, ids=str)
@pytest.mark.parametrize("split", [1, 2, 4])
def test_qkv_linear_matches_ref(shape, dtype, split):
    """Guards a head's halves taken from the wrong weight rows, the row scale or the bias
    missing or applied after the rounding, q/k/v heads told apart wrongly (v normed or
    rotated, k not), the split partials summed twice or for the wrong head, rows past the
    batch or pads (slot -1) written, and cos/sin taken at the wrong row's position."""
    case = _case(*shape, dtype, seed=sum(shape) + split, bias=split == 2)
    q_ref, cache_ref = _run(qkv_linear_ref, case)
    q, cache = _run(qkv_linear_triton, case, workspace=KernelWorkspace(), split_k=split)
    _close_after_norm(q, q_ref)
    _close_after_norm(cache, cache_ref)
    assert not torch.equal(cache_ref, case["kv_cache"]), "the case writes the cache"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_qkv_linear_without_norm_short_slots_and_counters(dtype):
    """Llama-style heads (no q/k norm), a slot mapping shorter than the rows (the rest write
    nothing), and the split's arrival counters left at zero for the next call."""
    ws = KernelWorkspace()
    case = _case(7, 3, 1, 80, 192, dtype, seed=3, with_norm=False, short_slots=True)
    for _ in range(2):
        q_ref, cache_ref = _run(qkv_linear_ref, case)
        q, cache = _run(qkv_linear_triton, case, workspace=ws, split_k=2)
        _close_after_norm(q, q_ref)
        _close_after_norm(cache, cache_ref)
        assert int(ws.counters("qkv_linear", 5, q.device)[:5].abs().sum()) == 0
