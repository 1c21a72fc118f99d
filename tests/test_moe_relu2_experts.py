"""NemotronH's experts in the MoE kernels: no gate, relu(up)^2, the first projection the up
rows alone (`[E, I, H]`), with and without biases.

The reference is checked against the definition written token by token in float64 (as
transformers' NemotronHExperts computes it); the Triton grouped GEMMs against the
reference with `test_moe_kernels`' tolerances. About half the up values are negative, so
a missing relu (a square of them) or a SwiGLU read of the rows is off by O(scale).
"""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import DTYPES, SIZES, assert_moe_close, make
from test_triton_index_kernels import DEVICE

from pdserve.kernels.expert_act import RELU2
from pdserve.kernels.moe import moe_experts, moe_experts_ref
from pdserve.kernels.moe_triton import moe_experts_triton


def _ungated(shape, dtype, seed=0, bias=False):
    """`make`'s inputs with the first projection cut to the up rows (its second half)."""
    tokens, hidden, inter, experts, picks = shape
    x, wgu, wd, ids, weights = make(*shape, dtype, seed=seed)
    up = wgu[:, inter:].contiguous()
    if not bias:
        return x, up, wd, ids, weights, None, None
    g = torch.Generator().manual_seed(seed + 100)
    b_up = torch.randn(experts, inter, generator=g).to(DEVICE, dtype)
    b_d = torch.randn(experts, hidden, generator=g).to(DEVICE, dtype)
    return x, up, wd, ids, weights, b_up, b_d


def _definition(x, w_up, wd, ids, weights, b_up=None, b_d=None):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            u = w_up[e].double() @ x[t].double()
            if b_up is not None:
                u = u + b_up[e].double()
            y = wd[e].double() @ torch.relu(u).square()
            if b_d is not None:
                y = y + b_d[e].double()
            out[t] += float(weights[t, j]) * y
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_the_definition(bias):
    args = [None if t is None else t.cpu() for t in _ungated((9, 24, 20, 5, 3), torch.float32,
                                                            seed=3, bias=bias)]  # fmt: skip
    up = torch.stack([args[1][e] @ args[0].T for e in range(5)])
    assert float((up < 0).float().mean()) > 0.3, "the test must reach the relu"
    got = moe_experts_ref(*args[:5], args[5], args[6], RELU2)
    want = _definition(*args)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SIZES)
def test_triton_matches_reference(shape, dtype):
    x, w_up, wd, ids, weights, _, _ = _ungated(shape, dtype, seed=shape[0])
    got = moe_experts_triton(x, w_up, wd, ids, weights, act=RELU2)
    want = moe_experts_ref(x, w_up, wd, ids, weights, act=RELU2)
    assert_moe_close(got, want, dtype)


def test_triton_with_biases_matches_reference():
    x, w_up, wd, ids, weights, b_up, b_d = _ungated((7, 80, 72, 8, 3), torch.float32, 4, True)
    got = moe_experts_triton(x, w_up, wd, ids, weights, b_gate_up=b_up, b_down=b_d, act=RELU2)
    assert_moe_close(got, moe_experts_ref(x, w_up, wd, ids, weights, b_up, b_d, RELU2),
                     torch.float32)  # fmt: skip


def test_public_function_dispatches_and_checks_the_shapes():
    args = [t.cpu() for t in _ungated((5, 32, 24, 4, 2), torch.float32)[:5]]
    assert torch.equal(moe_experts(*args, act=RELU2), moe_experts_ref(*args, act=RELU2))
    gated_shapes = make(5, 32, 24, 4, 2, torch.float32)
    with pytest.raises(AssertionError, match="down weights"):
        moe_experts_ref(*(t.cpu() for t in gated_shapes), act=RELU2)
