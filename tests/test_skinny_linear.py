"""Parity of the skinny linear (`kernels/skinny_linear.py`) with its spec, `F.linear`.

On CPU the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set by conftest)
at small sizes; on the H200 the same tests run on CUDA, and test_gpu_kernels.py adds the
Qwen3-0.6B decoder's shapes and a CUDA-graph replay.

Tolerance: the reference is float64 on the same (rounded) inputs. The kernel multiplies
exactly (16-bit products are exact in fp32) and sums in fp32, so its error is the fp32
summation error, at most K * 2^-24 * sum|x w| (bound used: 2^-12 * sum|x w|, K <= 4096),
plus one rounding of the output to its dtype: 2^-8 |ref| in bf16 (2^-7 under the
interpreter, which truncates), 2^-11 in fp16, none in fp32. A wrong tile offset, a split counted twice or a dropped bias errs by O(|ref|).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import skinny_linear as sl
from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.workspace import KernelWorkspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Output rounding: half an ulp; but Triton's interpreter (numpy has no bf16) converts
# fp32 -> bf16 by truncation toward zero, a whole ulp (seen: |y| <= |ref| on every output).
BF16_ROUNDING = 2.0**-8 if DEVICE == "cuda" else 2.0**-7
ROUNDING = {torch.float32: 0.0, torch.bfloat16: BF16_ROUNDING, torch.float16: 2.0**-11}


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    xd, wd = x.double().cpu(), w.double().cpu()
    ref = xd @ wd.T + (0.0 if b is None else b.double().cpu())
    scale = xd.abs() @ wd.abs().T
    err = (y.double().cpu() - ref).abs()
    bound = ROUNDING[y.dtype] * ref.abs() + 2.0**-12 * scale + 1e-30
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert (err <= bound).all(), f"max excess {float((err - bound).max()):.3g} over the bound"


def make(m, n, k, dtype, bias, seed=0, x_cols=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, x_cols or k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


CASES = [
    # (M, N, K, split, bias): N and K off the tiles, one row and many, K slices with a
    # short last one (split 2 over K=260 -> 192 + 68), and the model's K=1024 in 4 slices.
    (1, 33, 260, 2, True),
    (5, 70, 300, 1, False),
    (32, 64, 512, 4, False),
    (64, 100, 1024, 4, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,split,bias", CASES)
def test_matches_linear(m, n, k, split, bias, dtype):
    """Guards the tiles and the split-K merge: every (row, feature) summed over all of K
    once, the bias added once, rows past M and features past N left out."""
    x, w, b = make(m, n, k, dtype, bias)
    cfg = sl.SkinnyConfig(block_n=32, block_k=64, split_k=split, num_warps=4, num_stages=2)
    check(sl.skinny_linear_triton(x, w, b, KernelWorkspace(), config=cfg), x, w, b)


# bf16 on CUDA only: the interpreter's truncating bf16 casts put the rounded projections
# and silu one ulp off torch's (as test_triton_layer_kernels notes); fp16 rounds the same.
SILU_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", SILU_DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split", [1, 3])
def test_silu_mul_output(dtype, bias, split):
    """Guards the fused activation: the weight is [gate | up] (2N rows), each program pairs
    the gate and up rows of the same features, adds each half's bias, and applies
    kernels/activation.py's rounding points to the rounded projections. The reference is
    silu_and_mul of the separately computed, rounded [gate | up] projection. Split over K
    (3 slices, the last one short), the last arriver must merge the up partials as well as
    the gate ones: a missing or misplaced up block is off by O(1)."""
    m, n, k = 7, 40, 320
    x, w, b = make(m, 2 * n, k, dtype, bias, seed=3)
    cfg = sl.SkinnyConfig(block_n=16, block_k=64, split_k=split, num_warps=4, num_stages=2)
    y = sl.skinny_linear_triton(x, w, b, KernelWorkspace(), silu_mul_output=True, config=cfg)
    gate_up = sl.skinny_linear_triton(x, w, b, KernelWorkspace(), config=cfg)
    assert y.shape == (m, n)
    # Same tiles and splits, same sums: the projections match bitwise, so only the activation may
    # differ: one rounding of the product in 16 bits; in fp32 the two exp implementations
    # (numpy's here, torch's in the reference) differ by a few ulp (2^-23 each).
    rtol = max(ROUNDING[dtype], 2.0**-20)
    torch.testing.assert_close(y, silu_and_mul_ref(gate_up), rtol=rtol, atol=1e-6)
    check(gate_up, x, w, b)


def test_split_k_is_repeatable_and_leaves_counters_at_zero():
    """Guards the last-arriver merge: the partials are summed in split order whoever
    arrives last (bitwise the same on every call), and each tile's arrival counter is back
    at zero afterwards, as the next layer and every CUDA graph replay reuse it."""
    ws = KernelWorkspace()
    x, w, b = make(32, 96, 1024, torch.bfloat16, False, seed=5)
    cfg = sl.SkinnyConfig(block_n=32, block_k=128, split_k=4, num_warps=4, num_stages=2)
    first = sl.skinny_linear_triton(x, w, b, ws, config=cfg)
    for _ in range(2):
        assert torch.equal(sl.skinny_linear_triton(x, w, b, ws, config=cfg), first)
    counters = ws.counters("skinny_linear", 3, x.device)
    assert int(counters.abs().sum()) == 0, counters
    check(first, x, w, b)


def test_choose_config_splits_narrow_outputs_only():
    """Guards the tile choice measured on the H200: the narrow o/down projections (1024
    outputs, 32 tiles) split K four ways to occupy the 132 SMs; a wide output does not."""
    assert sl.choose_config(1024, 2048).split_k == 4
    assert sl.choose_config(1024, 3072).split_k == 4
    assert sl.choose_config(6144, 1024).split_k == 1
    assert sl.choose_config(1024, 256).split_k == 1  # slices keep >= 4 steps of 128
    # fp32 tiles: 2 stages (4 of the gate/up tile passed the H200's shared memory)
    assert sl.choose_config(3072, 1024, True, elem_bytes=4).num_stages == 2
    assert sl.choose_config(3072, 1024, True).num_stages == 4


def test_linear_dispatch_and_errors():
    """Guards the dispatcher: off the GPU (or for fp32, many rows, wide outputs) `linear` is
    exactly F.linear (then silu_and_mul with silu_mul_output); bad shapes fail with a message."""
    x, w, b = make(8, 40, 64, torch.float32, True)
    ws = KernelWorkspace()
    if DEVICE == "cpu":
        assert torch.equal(sl.linear(x, w, b, ws), F.linear(x, w, b))
        assert torch.equal(sl.linear(x, w, b, ws, True), silu_and_mul_ref(F.linear(x, w, b)))
    big, _, _ = make(sl.MAX_ROWS + 1, 40, 64, torch.bfloat16, False)
    with pytest.raises(AssertionError, match="1..64 rows"):
        sl.skinny_linear_triton(big, w.bfloat16(), None, ws)
    with pytest.raises(AssertionError, match="features"):
        sl.skinny_linear_triton(x[:, :63], w, None, ws)


def test_workspace_keeps_outgrown_buffers_alive():
    """Guards CUDA graphs against a workspace that grows after capture: a graph holds the
    address of the buffer it was captured with, so when an eager step needs a larger one
    the old buffer must stay allocated (freed, its memory would be reused by other tensors
    and every replay would count into them)."""
    import gc
    import weakref

    ws = KernelWorkspace()
    small = ws.counters("decode_attention", 8, torch.device("cpu"))
    gone = weakref.ref(small)
    del small
    big = ws.counters("decode_attention", 64, torch.device("cpu"))
    assert big.numel() == 64 and int(big.abs().sum()) == 0
    gc.collect()
    assert gone() is not None, "an outgrown buffer was freed"
    assert ws.counters("decode_attention", 10, torch.device("cpu")) is big  # fits: no growth
