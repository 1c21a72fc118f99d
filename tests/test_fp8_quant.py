"""The per-token / per-group FP8 activation quantization (kernels/fp8_quant.py) against
its torch spec, bit for bit: both do the same IEEE float32 operations and the same
round-to-nearest-even conversion, so any difference is a defect. On CPU the kernel runs
under Triton's interpreter (TRITON_INTERPRET=1, set by conftest).

The spec is also checked against first principles: every code decodes to within half a
float8 step of x / scale, the row's (run's) largest magnitude maps to +-448, and an
all-zero row gives zero codes and a finite reciprocal."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_quant import (
    FP8_MAX,
    quantize_fp8_ref,
    quantize_fp8_triton,
    round_e4m3,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spanning six decades, one of them all zeros, one with a single outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
    if m > 2:
        x[1] = 0
        x[2, k // 3] = 1e4
    return x.to(dtype)


@pytest.mark.parametrize(
    "m, k, group, dtype",
    [
        (1, 16, 0, torch.bfloat16),
        (3, 96, 0, torch.bfloat16),
        (2, 17, 0, torch.float16),  # K not a power of two, nor a multiple of 16
        (5, 256, 128, torch.float32),
        (4, 384, 128, torch.bfloat16),  # 3 groups: padded to 4 in the kernel
        (3, 9000, 0, torch.float32),  # past one pass: the two-pass form
        (6, 80, 16, torch.float16),
    ],
)
def test_quantize_fp8_kernel_equals_its_spec(m, k, group, dtype):
    x = rows(m, k, dtype).to(DEVICE)
    codes, scales = quantize_fp8_triton(x, group)
    want_codes, want_scales = quantize_fp8_ref(x.cpu(), group)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (m, k)
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)
    if group:  # M-major, as cuBLAS's 1 x 128 recipe reads it
        assert scales.shape == (m, k // group) and scales.stride() == (1, m)
    else:
        assert scales.shape == (m, 1)


@pytest.mark.parametrize("group", [0, 32])
def test_quantize_fp8_ref_from_first_principles(group):
    m, k = 5, 64
    x = rows(m, k, torch.float32, seed=1)
    codes, scales = quantize_fp8_ref(x, group)
    g = k if group == 0 else group
    s = scales.reshape(m, k // g) if group == 0 else scales
    runs = x.reshape(m, k // g, g)
    scaled = runs / s[..., None]
    decoded = codes.float().reshape(m, k // g, g)
    # half a step of the float8 grid at each value (3 mantissa bits; 2^-9 below 2^-6)
    step = torch.where(scaled.abs() < 2**-6, torch.tensor(2.0**-9),
                       2.0 ** (torch.floor(torch.log2(scaled.abs().clamp(min=2**-6))) - 3))  # fmt: skip
    assert ((decoded - scaled).abs() <= step / 2 * (1 + 1e-6)).all()
    peak = runs.abs().amax(dim=-1)
    live = peak > 0
    assert torch.equal(decoded.abs().amax(dim=-1)[live], torch.full_like(peak[live], FP8_MAX))
    assert (decoded.reshape(m, k)[1] == 0).all() and torch.isfinite(1 / s[1]).all()


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, round_e4m3(y).to(tl.float8e4nv), mask=offs < n)


def test_round_e4m3_is_torchs_conversion_on_a_sweep():
    """Ties, the subnormal range, signed zeros and each binade's top (where a carry moves
    into the exponent), against torch's float8_e4m3fn cast."""
    grid = torch.arange(-448.0, 448.0 + 1e-3, 1 / 32)  # every tie of the upper binades
    fine = torch.linspace(-0.03, 0.03, 20001)  # subnormals and the lowest normals
    edges = torch.tensor([-0.0, 0.0, 2**-10, -(2**-10), 3 * 2**-11, 2**-6 * (1 - 2**-5),
                          31.01, 15.99, 447.9, -447.9, 240.0, 248.0])  # fmt: skip
    y = torch.cat([grid, fine, edges]).contiguous().to(DEVICE)
    out = torch.empty(y.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    _round_kernel[(triton.cdiv(y.numel(), 4096),)](y, out, y.numel(), BLOCK=4096)
    want = y.cpu().to(torch.float8_e4m3fn)
    assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8))


def test_quantize_fp8_refuses_a_group_that_does_not_divide_k():
    with pytest.raises(AssertionError, match="power of two dividing K"):
        quantize_fp8_triton(torch.zeros(2, 96), 64)
