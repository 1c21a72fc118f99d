"""The experts through torch's grouped GEMM (kernels/moe_grouped.py) against the reference
(kernels/moe.py `moe_experts_ref`), with test_moe_kernels.py's tolerances: the same
rounding points, so in 16 bits only float32 sums landing across a rounding boundary differ
(a few ulps of the scale, on few elements); in float32 the summation order (1e-5 of the
scale). A slot sorted to the wrong expert, a run offset off by one, a weight applied to the
wrong slot or the up rows taken as the gate's are off by O(scale). On a GPU `moe_experts`
takes it for long runs an expert (test_gpu_moe.py), and the CUDA cases run Mixtral's
expert size."""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import assert_moe_close, make
from test_triton_index_kernels import ON_CUDA

from pdserve.kernels.expert_act import SILU, ExpertAct
from pdserve.kernels.moe import moe_experts_ref
from pdserve.kernels.moe_grouped import (
    GROUPED_MIN_INTERMEDIATE,
    GROUPED_MIN_RUN,
    grouped_applies,
    moe_experts_grouped,
)
from pdserve.kernels.moe_grouped import long_runs as runs_long

# (tokens, hidden, intermediate, experts, picks): runs of 1 to 80 slots, an expert unused
SHAPES = [(1, 24, 40, 5, 2), (7, 80, 72, 8, 3), (120, 48, 40, 3, 2), (40, 32, 24, 6, 1)]
if ON_CUDA:
    SHAPES.append((2048, 4096, 14336, 8, 2))  # Mixtral's experts, 512 slots an expert


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_matches_the_reference(shape, dtype):
    x, wgu, wd, ids, weights = make(*shape, dtype, seed=shape[0])
    got = moe_experts_grouped(x, wgu, wd, ids, weights)
    want = moe_experts_ref(x, wgu, wd, ids, weights)
    assert got.shape == want.shape and got.dtype == dtype
    assert_moe_close(got, want, dtype)


def test_which_calls_take_it():
    """Long runs an expert of plain bf16 SwiGLU experts on a GPU; never biases, gpt-oss's
    clamped gate, ungated experts, other dtypes or the CPU (whose path is the reference)."""
    device = "cuda" if ON_CUDA else "cpu"
    x = torch.zeros(4, 8, dtype=torch.bfloat16, device=device)
    big = GROUPED_MIN_INTERMEDIATE
    w = torch.zeros(8, 2 * big, 8, dtype=torch.bfloat16, device=device)
    long_runs = GROUPED_MIN_RUN * 8
    assert grouped_applies(x, w, long_runs, None, SILU) == ON_CUDA
    assert not grouped_applies(x, w, long_runs - 1, None, SILU)
    assert not grouped_applies(x, w, long_runs, torch.zeros(8, 16), SILU)
    assert not grouped_applies(x, w, long_runs, None, ExpertAct("swiglu_oai", 1.702, 7.0))
    assert not grouped_applies(x.float(), w.float(), long_runs, None, SILU)
    assert not grouped_applies(x, w[:, 2:-2], long_runs, None, SILU)  # smaller experts
    # the rule itself, on any device: the mean run over all experts
    assert runs_long(GROUPED_MIN_RUN * 8, 8, big) and not runs_long(GROUPED_MIN_RUN * 8 - 1, 8, big)
    assert runs_long(GROUPED_MIN_RUN, 1, big) and not runs_long(GROUPED_MIN_RUN * 64, 128, big)
    assert not runs_long(GROUPED_MIN_RUN * 1000, 8, big - 1)
