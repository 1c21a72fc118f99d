"""The W8A8 FP8 linear (kernels/fp8_gemm.py): its spec against independent references,
its device path (Triton quantization + torch._scaled_mm) against the spec, and which
recipe a kept FP8 weight's scales allow.

- The spec against torch's own _scaled_mm (ROW) and against a loop over 128 x 128 blocks
  (BLOCK), each on operands quantized by the spec's own quantizer: the same float32
  products, summed in another order, then rounded to bf16; bound: one bf16 rounding of
  the output (2^-8 relative) plus a float32 summation term.
- The device path against the spec with the same bound. On the CPU this runs the ROW
  recipe (Triton's interpreter for the quantization, torch's CPU _scaled_mm), on a GPU
  both recipes.
A weight scale applied to the wrong axis, an activation scale per the wrong run or a
dropped bias errs by O(|y|).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_gemm import (
    BLOCK,
    BLOCK_SIZE,
    ROW,
    block_scales,
    fp8_linear,
    fp8_linear_ref,
    fp8_linear_scaled_mm,
    w8a8_recipe,
)
from pdserve.kernels.fp8_quant import quantize_fp8_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weights(n: int, k: int, recipe: str, seed: int = 0):
    """float8 weight [N, K], PackedLinear-style scales [N, G] and _scaled_mm's scale_b."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if recipe == ROW:
        scales = torch.rand(n, 1, generator=gen) / (k**0.5 * 50) + 1e-4
    else:
        blocks = torch.rand(n // BLOCK_SIZE, k // BLOCK_SIZE, generator=gen) / (k**0.5 * 50)
        scales = (blocks + 1e-4).repeat_interleave(BLOCK_SIZE, 0)
    return w, scales, block_scales(scales, recipe)


def bound(y_ref: torch.Tensor, k: int) -> torch.Tensor:
    """One bf16 rounding of |y| and a float32 summation term over K products."""
    return y_ref.abs() * 2**-8 + y_ref.abs().max() * k * 2**-22


@pytest.mark.parametrize("m, n, k, bias", [(5, 64, 96, False), (130, 48, 256, True)])
def test_spec_row_recipe_equals_torchs_scaled_mm(m, n, k, bias):
    w, _, scale_b = weights(n, k, ROW)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    codes, scale_a = quantize_fp8_ref(x, 0)
    want = torch._scaled_mm(codes, w.t(), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=torch.float32)  # fmt: skip
    got = fp8_linear_ref(x, w, scale_b, b, ROW)
    expect = want.bfloat16() + b if bias else want.bfloat16()
    # the bias's add rounds once more: up to a bf16 step of the sum
    extra = (want.abs() + b.float().abs()) * 2**-8 if bias else 0
    assert ((got.float() - expect.float()).abs() <= bound(want, k) * 2 + extra).all()


def test_spec_block_recipe_equals_a_loop_over_blocks():
    m, n, k = 7, 256, 384
    w, _, scale_b = weights(n, k, BLOCK)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    codes, scale_a = quantize_fp8_ref(x, BLOCK_SIZE)
    want = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(k // BLOCK_SIZE):
        cols = slice(kb * BLOCK_SIZE, (kb + 1) * BLOCK_SIZE)
        xa = codes[:, cols].double() * scale_a[:, kb : kb + 1].double()
        for nb in range(n // BLOCK_SIZE):
            rows = slice(nb * BLOCK_SIZE, (nb + 1) * BLOCK_SIZE)
            want[:, rows] += (xa @ w[rows, cols].double().t()) * scale_b[nb, kb].double()
    got = fp8_linear_ref(x, w, scale_b, None, BLOCK)
    assert ((got.double() - want).abs() <= bound(want, k)).all()


# The device path: ROW wherever _scaled_mm takes row scales (the CPU too), BLOCK on a GPU.
PATHS = [(ROW, 3, 64, 128), (ROW, 200, 384, 256)]
if DEVICE == "cuda":
    PATHS += [(BLOCK, 3, 256, 384), (BLOCK, 258, 512, 1024)]


@pytest.mark.parametrize("recipe, m, n, k", PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_device_path_equals_the_spec(recipe, m, n, k, bias):
    w, _, scale_b = weights(n, k, recipe, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, m, k, generator=gen).bfloat16()  # a leading dim, M not a multiple of 4
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    want = fp8_linear_ref(x, w, scale_b, b, recipe)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, w, scale_b, b)]
    got = fp8_linear_scaled_mm(*dev, recipe).cpu()
    assert got.shape == (2, m, n) and got.dtype == torch.bfloat16
    y32 = want.float() - (b.float() if bias else 0)
    extra = want.float().abs() * 2**-8 if bias else 0  # the bias's add rounds once more
    assert ((got.float() - want.float()).abs() <= bound(y32, k) * 2 + extra).all()
    if DEVICE == "cuda":  # the dispatch takes the device path there
        assert torch.equal(fp8_linear(*dev, recipe).cpu(), got)
    else:
        assert torch.equal(fp8_linear(*dev, recipe), want)


def test_recipe_from_the_scales():
    n, k = 256, 384
    _, row, _ = weights(n, k, ROW)
    _, blocks, _ = weights(n, k, BLOCK)
    assert w8a8_recipe(row, n, k, k, torch.bfloat16) == ROW
    assert w8a8_recipe(blocks, n, k, BLOCK_SIZE, torch.bfloat16) == BLOCK
    assert w8a8_recipe(row, n, k, k, torch.float16) is None  # row-scaled FP8 writes bf16
    assert w8a8_recipe(row, n, 100, 100, torch.bfloat16) is None  # K not 16-aligned
    shifted = blocks.clone()
    shifted[:64] = shifted[200]  # shards stacked off the 128-row grid: not block scales
    assert w8a8_recipe(shifted, n, k, BLOCK_SIZE, torch.bfloat16) is None
    assert w8a8_recipe(blocks[:, :2], n, k, 256, torch.bfloat16) is None  # not 128 x 128
