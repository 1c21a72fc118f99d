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
def test_silu_mul_output(dtype, bias):
    """Guards the fused activation: the weight is [gate | up] (2N rows), each program pairs
    the gate and up rows of the same features, adds each half's bias, and applies
    kernels/activation.py's rounding points to the rounded projections. The reference is
    silu_and_mul of the separately computed, rounded [gate | up] projection."""
    m, n, k = 7, 40, 320
    x, w, b = make(m, 2 * n, k, dtype, bias, seed=3)
    cfg = sl.SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=2)
    y = sl.skinny_linear_triton(x, w, b, KernelWorkspace(), silu_mul_output=True, config=cfg)
    gate_up = sl.skinny_linear_triton(x, w, b, KernelWorkspace(), config=cfg)
    assert y.shape == (m, n)
    # Same tiles, same sums: the projections match bitwise, so only the activation may
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


# bf16 on CUDA only, as for SILU_DTYPES: the interpreter truncates the kernel's bf16 casts
# where torch's CPU ops round.
FUSED_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,split,bias", CASES)
def test_add_residual_is_the_separate_add_bitwise(m, n, k, split, bias, dtype):
    """Guards the o projection's epilogue (`linear_add_residual`): the sum must be the
    unfused kernel's output plus the residual, bitwise (same tiles and merge, then torch's
    one rounding of the add), and each tile's per-row sum of squares must add up to the
    rows' sums of squares, which the next norm divides into its variance (a tile left out
    or counted twice errs by a whole tile's share)."""
    x, w, b = make(m, n, k, dtype, bias, seed=7)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    cfg = sl.SkinnyConfig(block_n=32, block_k=64, split_k=split, num_warps=4, num_stages=2)
    ws = KernelWorkspace()
    s, squares = sl.linear_add_residual(x, w, b, res, ws, config=cfg)
    assert torch.equal(s, sl.skinny_linear_triton(x, w, b, ws, config=cfg) + res)
    assert squares.tiles == -(-n // 32) and squares.m_pad == max(16, 1 << (m - 1).bit_length())
    parts = squares.partials[: squares.tiles * squares.m_pad].view(squares.tiles, -1)
    want = s.double().pow(2).sum(1).cpu()
    # fp32 sums of n squares: at most n * 2^-24 of the sum each way.
    torch.testing.assert_close(parts[:, :m].sum(0).double().cpu(), want, rtol=n * 2.0**-23, atol=0)


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("m,k,split", [(1, 260, 2), (5, 300, 1), (32, 512, 4)])
def test_input_norm_matches_rms_norm_then_linear(m, k, split, silu, dtype):
    """Guards the norm applied on load (`InputNorm`): y must be the linear (and SiLU-and-mul)
    of rms_norm(x) with kernels/norm.py's rounding points, the variance from the producer's
    per-tile sums (made here by torch over 32-column tiles, the last one short). The bound
    is `check`'s plus the normalised input's own rounding, twice (the kernel's variance is
    summed in another order, so a value may round the other way); a missing or misplaced
    norm (wrong row, wrong weight slice, variance over the padded width) errs by O(|ref|)."""
    from pdserve.kernels.norm import rms_norm_ref

    n, eps = 48, 1e-6
    split = 1 if silu else split  # SiLU-and-mul outputs are not split
    x, w, b = make(m, 2 * n if silu else n, k, dtype, False, seed=9)
    nw = (torch.rand(k, generator=torch.Generator().manual_seed(10)) + 0.5).to(dtype).to(DEVICE)
    tiles, m_pad = -(-k // 32), max(16, 1 << (m - 1).bit_length())
    parts = torch.zeros(tiles, m_pad)
    xf = x.float().cpu()
    for t in range(tiles):
        parts[t, :m] = xf[:, 32 * t : 32 * t + 32].pow(2).sum(1)
    norm = sl.InputNorm(nw, eps, sl.RowSquares(parts.flatten().to(DEVICE), tiles, m_pad))
    cfg = sl.SkinnyConfig(block_n=16, block_k=64, split_k=split, num_warps=4, num_stages=2)
    ws = KernelWorkspace()
    y = sl.skinny_linear_triton(x, w, b, ws, silu_mul_output=silu, config=cfg, norm=norm)
    h = rms_norm_ref(x, nw, eps)
    if not silu:
        hd, wd = h.double().cpu(), w.double().cpu()
        ref = hd @ wd.T
        scale = hd.abs() @ wd.abs().T
        slack = (2 * ROUNDING[dtype] + 2.0**-12) * scale
        bound = ROUNDING[dtype] * ref.abs() + slack + 1e-30
        assert ((y.double().cpu() - ref).abs() <= bound).all()
    else:
        # Against the unfused kernels: the projections may differ by the input's rounding.
        want = sl.skinny_linear_triton(h, w, b, ws, silu_mul_output=True, config=cfg)
        scale = (h.double().abs() @ w.double().abs().T).cpu()
        gate_scale = torch.maximum(scale[:, :n], scale[:, n:])
        tol = 4 * (2 * ROUNDING[dtype] + 2.0**-12) * gate_scale * (1 + want.double().abs().cpu())
        assert ((y.double() - want.double()).abs().cpu() <= tol + 1e-6).all()


def test_fused_paths_refuse_what_they_cannot_take():
    """Bad input to the fused paths fails with a message: a residual of the wrong shape,
    a residual on a SiLU-and-mul output, squares of another batch's rows."""
    x, w, b = make(8, 40, 64, torch.float32, False)
    ws = KernelWorkspace()
    with pytest.raises(AssertionError, match="residual is"):
        sl.linear_add_residual(x, w, b, torch.zeros(8, 41, device=DEVICE), ws)
    with pytest.raises(AssertionError, match="plain outputs"):
        sl._launch(
            x, torch.cat([w, w]), None, ws, True, None, None, torch.zeros(8, 40, device=DEVICE)
        )
    squares = sl.RowSquares(torch.zeros(64, device=DEVICE), 2, 32)
    with pytest.raises(AssertionError, match="these rows"):
        sl.skinny_linear_triton(
            x, w, None, ws, norm=sl.InputNorm(torch.ones(64, device=DEVICE), 1e-6, squares)
        )
