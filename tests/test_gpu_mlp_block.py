"""The persistent o / gate-up / down launch (kernels/mlp_block.py) on CUDA: one launch with
grid barriers, bitwise the three skinny-linear launches it replaces (test_mlp_block.py
checks its phases one launch each, on CPU too). Collected only with a GPU (conftest)."""

from __future__ import annotations

import pytest
import torch
from test_mlp_block import CASES, DTYPES, EPS, _chain, _layer, _squares

from pdserve.kernels.mlp_block import mlp_block
from pdserve.kernels.workspace import KernelWorkspace


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,hidden,attn_dim,inter,bias", CASES)
def test_one_launch_with_barriers_is_the_chain(dtype, m, hidden, attn_dim, inter, bias):
    attn, r, o, gu, down = _layer(m, hidden, attn_dim, inter, dtype, bias, seed=5)
    want_r, want_sq = _chain(attn, r, o, gu, down)
    ws = KernelWorkspace()
    for _ in range(3):  # the barrier counter grows from launch to launch
        got_r, got_sq = mlp_block(attn, r, o, gu, down, EPS, ws, phases=False)
        assert torch.equal(got_r, want_r) and torch.equal(_squares(got_sq), want_sq)
    assert (
        int(ws.barrier("mlp_block", attn.device)[0])
        == 3 * 2 * torch.cuda.get_device_properties(attn.device).multi_processor_count
    )


def test_graph_replays_of_chained_blocks():
    """Four layers chained in one captured graph, replayed on new inputs: each launch's
    barriers keep the layers apart (the shared partials, counters and squares buffer)."""
    dtype, layers = torch.bfloat16, []
    for i in range(4):
        layers.append(_layer(32, 1024, 2048, 3072, dtype, False, seed=10 + 3 * i)[2:])
    attn0, r0, *_ = _layer(32, 1024, 2048, 3072, dtype, False, seed=1)
    attn, r = attn0.clone(), r0.clone()
    ws = KernelWorkspace()

    def forward():
        x = r
        for o, gu, down in layers:
            x, sq = mlp_block(attn, x, o, gu, down, EPS, ws)
        return x, sq

    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_r, out_sq = forward()
    for seed in (2, 3):
        a, x, *_ = _layer(32, 1024, 2048, 3072, dtype, False, seed=seed)
        attn.copy_(a)
        r.copy_(x)
        graph.replay()
        want = x
        for o, gu, down in layers:
            want, want_sq = _chain(a, want, o, gu, down)
        torch.cuda.synchronize()
        assert torch.equal(out_r, want) and torch.equal(_squares(out_sq), want_sq)
