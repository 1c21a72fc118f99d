"""gpt-oss's experts in the MoE kernels: biases on both projections and the clamped gate
((up + 1) * gate * sigmoid(1.702 * gate), gate clamped above at 7, up to +-7), and its
router (the k largest logits, softmaxed among themselves).

The reference is checked against the definition written token by token in float64 (as
transformers' GptOssExperts computes it); the Triton grouped GEMMs against the reference
with `test_moe_kernels`' tolerances. Inputs are scaled so that some gates pass the clamp
limit (a missing clamp changes those outputs by far more than the tolerance).
"""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import DTYPES, SIZES, assert_moe_close, make
from test_triton_index_kernels import DEVICE

from pdserve.kernels.expert_act import ExpertAct
from pdserve.kernels.moe import moe_experts, moe_experts_ref, route_top_k
from pdserve.kernels.moe_triton import moe_experts_triton

OAI = ExpertAct("swiglu_oai", alpha=1.702, limit=7.0)


def _biased(shape, dtype, seed=0):
    tokens, hidden, inter, experts, picks = shape
    x, wgu, wd, ids, weights = make(*shape, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = (x.float() * 6).to(dtype)  # gate/up of several units: some pass the clamp at 7
    b_gu = torch.randn(experts, 2 * inter, generator=g).to(DEVICE, dtype)
    b_d = torch.randn(experts, hidden, generator=g).to(DEVICE, dtype)
    return x, wgu, wd, ids, weights, b_gu, b_d


def _definition(x, wgu, wd, ids, weights, b_gu, b_d):
    """transformers' GptOssExperts in float64, one token and pick at a time."""
    inter = wd.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = wgu[e].double() @ x[t].double() + b_gu[e].double()
            gate = gate_up[:inter].clamp(max=7.0)
            up = gate_up[inter:].clamp(-7.0, 7.0)
            h = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            out[t] += float(weights[t, j]) * (wd[e].double() @ h + b_d[e].double())
    return out


def test_reference_matches_the_definition():
    args = [t.cpu() for t in _biased((9, 24, 20, 5, 3), torch.float32, seed=3)]
    gate_up = torch.stack([args[1][e] @ args[0].T for e in range(5)])
    assert float(gate_up.max()) > 7.0, "the test must reach the clamp"
    got = moe_experts_ref(*args[:5], args[5], args[6], OAI)
    want = _definition(*args)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SIZES)
def test_triton_matches_reference(shape, dtype):
    x, wgu, wd, ids, weights, b_gu, b_d = _biased(shape, dtype, seed=shape[0])
    got = moe_experts_triton(x, wgu, wd, ids, weights, b_gate_up=b_gu, b_down=b_d, act=OAI)
    want = moe_experts_ref(x, wgu, wd, ids, weights, b_gu, b_d, OAI)
    assert_moe_close(got, want, dtype)


def test_public_function_dispatches_by_device():
    args = [t.cpu() for t in _biased((5, 32, 24, 4, 2), torch.float32)]
    assert torch.equal(moe_experts(*args[:5], args[5], args[6], OAI),
                       moe_experts_ref(*args[:5], args[5], args[6], OAI))  # fmt: skip


def test_router_softmaxes_the_top_k_logits():
    """transformers' GptOssTopKRouter: the k largest logits, then a softmax over them."""
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0], [0.0, 3.0, 2.5, 1.0]])
    weights, ids = route_top_k(logits, 2, renormalize=False, softmax_after=True)
    top, top_ids = torch.topk(logits, 2)
    assert torch.equal(ids, top_ids)
    assert torch.allclose(weights, torch.softmax(top, -1))
