"""The W8A8 FP8 linear (kernels/fp8_gemm.py): its spec against torch's own _scaled_mm, its
device path (the Triton quantizer + torch._scaled_mm) against the spec, and where it
applies.

- The spec against the product of its dequantized operands in float64 (quantized by the
  spec's own quantizer), rounded to bf16; bound: one bf16 rounding of the output (2^-8
  relative) plus a float32 summation term.
- The device path against the spec with the same bound (on the CPU: the quantizer under
  Triton's interpreter and torch's CPU _scaled_mm; on a GPU, the tensor cores).
A weight scale applied along the wrong axis, a row's activation scale taken from another
row or a dropped bias errs by O(|y|).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_gemm import (
    fp8_linear,
    fp8_linear_ref,
    fp8_linear_scaled_mm,
    w8a8_applies,
)
from pdserve.kernels.fp8_quant import quantize_fp8_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 weight [N, K] and its scales as _scaled_mm reads them, [1, N]."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, torch.rand(1, n, generator=gen) / (k**0.5 * 50) + 1e-4


def bound(y: torch.Tensor, k: int) -> torch.Tensor:
    """One bf16 rounding of |y| and a float32 summation term over K products."""
    return y.abs() * 2**-8 + y.abs().max() * k * 2**-22


@pytest.mark.parametrize("m, n, k, bias", [(5, 64, 96, False), (130, 48, 256, True)])
def test_spec_equals_a_float64_product(m, n, k, bias):
    """The spec against the dequantized operands' product in float64 (independent of
    torch's _scaled_mm, whose CPU support varies by version)."""
    w, scale_b = weights(n, k)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    codes, scale_a = quantize_fp8_ref(x)
    want = (codes.double() * scale_a.double()) @ (w.double() * scale_b.double().t()).t()
    got = fp8_linear_ref(x, w, scale_b, b)
    expect = want.bfloat16() + b if bias else want.bfloat16()
    # the bias's add rounds once more: up to a bf16 step of the sum
    extra = (want.abs() + b.double().abs()) * 2**-8 if bias else 0
    assert ((got.double() - expect.double()).abs() <= bound(want, k) * 2 + extra).all()


@pytest.mark.parametrize("m, n, k", [(3, 64, 128), (200, 384, 256), (1, 16, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_device_path_equals_the_spec(m, n, k, bias):
    w, scale_b = weights(n, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, m, k, generator=gen).bfloat16()  # a leading dim, M not a multiple of 4
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    want = fp8_linear_ref(x, w, scale_b, b)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, w, scale_b, b)]
    got = fp8_linear_scaled_mm(*dev).cpu()
    assert got.shape == (2, m, n) and got.dtype == torch.bfloat16
    y32 = want.float() - (b.float() if bias else 0)
    # The bias's add rounds once more on each side: two roundings of nearly equal sums may
    # land a whole bf16 step apart, up to 2^-7 of the larger (the H100 run at 20955e7 hit
    # this with a bound of half that).
    extra = torch.maximum(want.float().abs(), got.float().abs()) * 2**-7 if bias else 0
    assert ((got.float() - want.float()).abs() <= bound(y32, k) * 2 + extra).all()
    if DEVICE == "cuda":  # the dispatch takes the device path there
        assert torch.equal(fp8_linear(*dev).cpu(), got)
    else:
        assert torch.equal(fp8_linear(*dev), want)


def test_where_it_applies():
    row = torch.rand(256, 1)
    assert w8a8_applies(row, 256, 384, torch.bfloat16)
    assert not w8a8_applies(row, 256, 384, torch.float16)  # row-scaled FP8 writes bf16
    assert not w8a8_applies(row, 256, 100, torch.bfloat16)  # K not 16-aligned
    assert not w8a8_applies(row, 216, 384, torch.bfloat16)  # N not 16-aligned
    assert not w8a8_applies(torch.rand(256, 3), 256, 384, torch.bfloat16)  # block scales
