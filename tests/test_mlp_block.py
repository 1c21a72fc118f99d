"""The persistent o / gate-up / down launch (kernels/mlp_block.py) against the three
skinny-linear launches it replaces (their parity with F.linear: test_skinny_linear.py,
test_norm_fold.py).

Each phase runs `skinny_tile` with the chain's configs, so the residual stream it returns
and the row squares it leaves for the next layer must be bitwise the chain's: a phase
that starts before its inputs are complete, a tile run twice or skipped, or a split merged
by the wrong program changes bits. Here the phases run as three launches (on CPU through
Triton's interpreter); on CUDA also as one launch with grid barriers, repeated (the barrier counter
keeps growing) and replayed from a CUDA graph (test_gpu_mlp_block.py).
"""

from __future__ import annotations

import pytest
import torch
from test_skinny_linear import DEVICE, make

from pdserve.kernels.mlp_block import MlpBlockConfig, mlp_block
from pdserve.kernels.row_squares import SQ_ROWS, ScaleRows
from pdserve.kernels.skinny_linear import skinny_linear_add_residual, skinny_linear_triton
from pdserve.kernels.workspace import KernelWorkspace

EPS = 1e-6
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
CASES = [
    # (M, hidden, attn dim, intermediate, biases): sizes off every tile; o split-K over a
    # 2,048-wide input with down unsplit, and down split over 2,048 with o unsplit.
    (1, 96, 160, 144, True),
    (5, 100, 300, 200, False),
    (3, 64, 2048, 80, False),
    (7, 40, 128, 2048, True),
]


def _layer(m, hidden, attn_dim, inter, dtype, bias, seed):
    attn, wo, bo = make(m, hidden, attn_dim, dtype, bias, seed=seed)
    r, wgu, bgu = make(m, 2 * inter, hidden, dtype, bias, seed=seed + 1)
    _, wd, bd = make(1, hidden, inter, dtype, bias, seed=seed + 2)
    return attn, r, (wo, bo), (wgu, bgu), (wd, bd)


def _chain(attn, r, o, gu, down):
    ws = KernelWorkspace()
    r1, sq = skinny_linear_add_residual(attn, *o, r, ws)
    act = skinny_linear_triton(r1, *gu, ws, silu_mul_output=True, scale_rows=ScaleRows(sq, EPS))
    r2, sq2 = skinny_linear_add_residual(act, *down, r1, ws)
    return r2, sq2.buf[: sq2.parts * SQ_ROWS].clone()


def _squares(sq):
    return sq.buf[: sq.parts * SQ_ROWS]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,hidden,attn_dim,inter,bias", CASES)
def test_block_is_bitwise_the_chain(dtype, m, hidden, attn_dim, inter, bias):
    attn, r, o, gu, down = _layer(m, hidden, attn_dim, inter, dtype, bias, seed=3)
    want_r, want_sq = _chain(attn, r, o, gu, down)
    assert not torch.equal(want_r, r)
    for block_n in (64, 32, 16):
        cfg = MlpBlockConfig(block_n_gate_up=block_n)
        got_r, got_sq = mlp_block(attn, r, o, gu, down, EPS, KernelWorkspace(), cfg, phases=True)
        if block_n == 64 or DEVICE == "cuda":
            # The chain's gate/up tile; on the GPU any tile (an output's K order is the same).
            assert torch.equal(got_r, want_r), f"residual differs at block_n {block_n}"
            assert torch.equal(_squares(got_sq), want_sq), f"squares differ at block_n {block_n}"
        else:  # numpy's matmul may sum a narrower tile in another order: last bits only
            torch.testing.assert_close(got_r, want_r, rtol=2**-9, atol=2**-9)
