"""CUDA-only checks of the MoE experts' device path: no host sync (the async step loop
would stall every MoE layer) and a CUDA-graph replay that follows new routings written
into the captured buffers (the decode graph replays one capture for every step's picks).
conftest does not collect this module without a GPU; parity is in `test_moe_kernels.py`.
"""

from __future__ import annotations

import torch
from test_moe_kernels import make

from pdserve.kernels.moe import moe_experts, moe_experts_ref, route_top_k

SHAPE = (32, 2048, 768, 128, 8)  # a 32-row decode batch of Qwen3-30B-A3B's MoE layer


def _layer(x, router, wgu, wd):
    weights, ids = route_top_k(x @ router.T, 8, True)
    return moe_experts(x, wgu, wd, ids, weights)


def test_moe_experts_never_sync_with_the_host():
    """Guards a `.tolist()`/`nonzero()`/`bincount` slipping into the device path."""
    x, wgu, wd, _, _ = make(*SHAPE, torch.bfloat16)
    router = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    _layer(x, router, wgu, wd)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _layer(x, router, wgu, wd)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_moe_experts_replay_new_routings_in_a_cuda_graph():
    """Guards routing baked in at capture time: after capture, new rows written into the
    input buffer route to other experts, and the replay must give the reference's output
    for them."""
    x, wgu, wd, _, _ = make(*SHAPE, torch.bfloat16)
    router = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    _layer(x, router, wgu, wd)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(x, router, wgu, wd)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    weights, ids = route_top_k(x @ router.T, 8, True)
    want = moe_experts_ref(x, wgu, wd, ids, weights)
    scale = float(want.float().abs().max())
    assert float((out.float() - want.float()).abs().max()) <= 4 * scale * 2**-7


def test_long_runs_take_the_grouped_gemm_without_a_host_sync():
    """A batch with GROUPED_MIN_RUN slots an expert and more goes to torch's grouped GEMM
    (kernels/moe_grouped.py), bit for bit its result, and reads nothing back to the host."""
    from pdserve.kernels.moe_grouped import (
        GROUPED_MIN_INTERMEDIATE,
        GROUPED_MIN_RUN,
        moe_experts_grouped,
    )

    x, wgu, wd, ids, weights = make(
        2 * GROUPED_MIN_RUN, 64, GROUPED_MIN_INTERMEDIATE, 4, 2, torch.bfloat16
    )
    want = moe_experts_grouped(x, wgu, wd, ids, weights)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = moe_experts(x, wgu, wd, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
