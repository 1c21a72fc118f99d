"""The CUDA MLP block (kernels/mlp_block_cuda.py) on a Hopper GPU: parity with its spec,
repeatability, graph replay and the grow-only counters.

Tolerance: the kernel rounds where the spec rounds (each projection, each residual sum,
silu and its product) and differs only in fp32 summation order, which can flip one
rounding per step; three roundings stand between the inputs and the new stream, so 4 units
of the dtype's last place (2^-6 relative in bf16, 2^-8 in fp16) bound the difference. A
wrong tile, row, split share or scale errs by O(1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kernels.mlp_block_cuda import config_for, mlp_block_cuda, mlp_block_ref
from pdserve.kernels.row_squares import SQ_ROWS
from pdserve.kernels.sm_count import num_sms
from pdserve.kernels.workspace import KernelWorkspace

DEV = torch.device("cuda")
EPS = 1e-6
SHAPES = [(1024, 2048, 3072), (576, 576, 1536)]  # Qwen3-0.6B, SmolLM2-135M: H, KO, I
TOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-8}


def _inputs(rows, shape, dtype, seed=0):
    hidden, attn_width, inter = shape
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=DEV) * scale).to(dtype)

    return (
        rand(rows, attn_width),
        rand(rows, hidden),
        rand(hidden, attn_width, scale=attn_width**-0.5),
        rand(2 * inter, hidden, scale=hidden**-0.5),
        rand(hidden, inter, scale=inter**-0.5),
    )


def _config(args):
    cfg = config_for(args[0], *args[2:], num_sms(DEV))
    assert cfg is not None, "the H200 runs these shapes through the CUDA block"
    return cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_matches_spec(rows, shape, dtype):
    """Guards the tiling (each o/down share, the gate/up halves, rows past the batch) and
    the epilogues (residual, row scale, SiLU-and-mul, squares)."""
    args = _inputs(rows, shape, dtype)
    cfg = _config(args)
    ws = KernelWorkspace()
    got, sq = mlp_block_cuda(*args, EPS, ws, cfg)
    want, _ = mlp_block_ref(*args, EPS)
    tol = TOL[dtype]
    err = (got.float() - want.float()).abs() - tol * (want.float().abs() + 1)
    assert err.max().item() <= 0, f"off by {err.max().item():.3g} beyond the bound"
    # The squares are those of the stream the kernel wrote (fp32 sums in another order).
    parts = sq.buf[: sq.parts * SQ_ROWS].view(sq.parts, SQ_ROWS)[:, :rows].sum(0)
    torch.testing.assert_close(parts, (got.float() ** 2).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("multicast", [False, True])
@pytest.mark.parametrize("rows", [3, 32])
def test_cluster_form_is_bitwise_the_same(rows, multicast):
    """The cluster form exchanges the o / down partials in distributed shared memory and
    sums them in the same (split, K half) order: a stale or misaddressed peer read shows."""
    args = _inputs(rows, SHAPES[0], torch.bfloat16)
    cfg = _config(args)
    ws = KernelWorkspace()
    n = cfg.sq_parts * SQ_ROWS
    plain_cfg = dataclasses.replace(cfg, cluster=False, gu_multicast=False)
    plain, plain_sq = mlp_block_cuda(*args, EPS, ws, plain_cfg)
    plain_sq = plain_sq.buf[:n].clone()  # the next launch writes the same squares buffer
    clustered, sq = mlp_block_cuda(
        *args, EPS, ws, dataclasses.replace(cfg, cluster=True, gu_multicast=multicast)
    )
    assert torch.equal(plain, clustered)
    assert torch.equal(plain_sq, sq.buf[:n])


def test_repeatable_and_counters_grow_by_launch():
    """Two launches agree bitwise (split order fixed); each counter grows by its fixed
    count a launch (grid arrivals on the two phase counters, splits on the tile ones), which
    is what every waiter's target assumes (the unclustered form: clusters sync in hardware)."""
    args = _inputs(32, SHAPES[0], torch.bfloat16)
    cfg = dataclasses.replace(_config(args), cluster=False, gu_multicast=False)
    ws = KernelWorkspace()
    first = mlp_block_cuda(*args, EPS, ws, cfg)[0].clone()
    for _ in range(2):
        again = mlp_block_cuda(*args, EPS, ws, cfg)[0]
        assert torch.equal(first, again)
    counters = ws.epoch_counters("mlp_block", cfg.counters, first.device)[: cfg.counters].cpu()
    launches = 3
    o, gu = cfg.o_tiles, cfg.gu_tiles
    assert counters[:2].tolist() == [launches * cfg.grid] * 2
    assert counters[2 : 2 + o].tolist() == [launches * cfg.o_splits] * o
    unsplit = cfg.gu_splits == 1  # an unsplit gate/up tile has no one to wait for
    assert (
        counters[2 + o : 2 + o + gu].tolist() == [0 if unsplit else launches * cfg.gu_splits] * gu
    )
    assert counters[2 + o + gu :].tolist() == [launches * cfg.d_splits] * o


def test_graph_replay_reads_new_inputs():
    """A captured launch reads its inputs at replay (fixed addresses) and its counters keep
    working across replays."""
    args = _inputs(8, SHAPES[0], torch.bfloat16)
    cfg = _config(args)
    ws = KernelWorkspace()
    mlp_block_cuda(*args, EPS, ws, cfg)  # sizes the workspace before capture
    static = [a.clone() for a in args]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = mlp_block_cuda(*static, EPS, ws, cfg)
    for seed in (1, 2):
        fresh = _inputs(8, SHAPES[0], torch.bfloat16, seed=seed)
        for dst, src in zip(static[:2], fresh[:2], strict=True):
            dst.copy_(src)
        graph.replay()
        eager, _ = mlp_block_cuda(*static, EPS, ws, cfg)
        assert torch.equal(out, eager)
