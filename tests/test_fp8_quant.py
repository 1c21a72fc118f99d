"""The per-token FP8 activation quantization (kernels/fp8_quant.py) against its torch
spec, bit for bit: both do the same IEEE float32 operations and the same
round-to-nearest-even conversion, so any difference is a defect. On CPU the kernel runs
under Triton's interpreter (TRITON_INTERPRET=1, set by conftest).

The spec is also checked against first principles: every code decodes to within half a
float8 step of x / scale, the row's largest magnitude maps to +-448, and an all-zero row
gives zero codes and a finite reciprocal."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_quant import FP8_MAX, quantize_fp8_ref, quantize_fp8_triton, round_e4m3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spanning six decades, one of them all zeros, one with a single outlier (most of
    its codes then fall in float8's subnormal range)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
    if m > 2:
        x[1] = 0
        x[2, k // 3] = 1e4
    return x.to(dtype)


@pytest.mark.parametrize(
    "m, k, dtype",
    [
        (1, 16, torch.bfloat16),
        (3, 96, torch.bfloat16),
        (2, 17, torch.float16),  # K not a power of two, nor a multiple of 16
        (5, 256, torch.float32),
        (7, 384, torch.bfloat16),
        (3, 9000, torch.float32),  # past one pass: the two-pass form
    ],
)
def test_quantize_fp8_kernel_equals_its_spec(m, k, dtype):
    x = rows(m, k, dtype).to(DEVICE)
    codes, scales = quantize_fp8_triton(x)
    want_codes, want_scales = quantize_fp8_ref(x.cpu())
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (m, k)
    assert scales.shape == (m, 1)
    assert torch.equal(scales.cpu(), want_scales), (scales.cpu() - want_scales).abs().max()
    bad = codes.cpu().view(torch.uint8) != want_codes.view(torch.uint8)
    assert not bad.any(), (codes.cpu().float()[bad][:6], want_codes.float()[bad][:6])


def test_quantize_fp8_ref_from_first_principles():
    m, k = 5, 64
    x = rows(m, k, torch.float32, seed=1)
    codes, scales = quantize_fp8_ref(x)
    scaled = x / scales
    decoded = codes.float()
    # half a step of the float8 grid at each value (3 mantissa bits; 2^-9 below 2^-6)
    step = torch.where(scaled.abs() < 2**-6, torch.tensor(2.0**-9),
                       2.0 ** (torch.floor(torch.log2(scaled.abs().clamp(min=2**-6))) - 3))  # fmt: skip
    assert ((decoded - scaled).abs() <= step / 2 * (1 + 1e-6)).all()
    peak = x.abs().amax(dim=-1)
    live = peak > 0
    assert torch.equal(decoded.abs().amax(dim=-1)[live], torch.full_like(peak[live], FP8_MAX))
    assert (decoded[1] == 0).all() and torch.isfinite(1 / scales[1]).all()


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, round_e4m3(y).to(tl.float8e4nv), mask=offs < n)


def test_round_e4m3_is_torchs_conversion():
    """Every tie of the upper binades, the subnormal range and below it, signed zeros, each
    binade's top (where a carry moves into the exponent) and random float32 bit patterns
    in [-448, 448], against torch's float8_e4m3fn cast."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31, (100_000,), generator=gen, dtype=torch.int64)
    rand = bits.to(torch.int32).view(torch.float32)
    rand = rand[torch.isfinite(rand) & (rand.abs() <= FP8_MAX)]
    edges = torch.tensor([-0.0, 0.0, 2**-10, -(2**-10), 3 * 2**-11, 1.5 * 2**-9, 2.5 * 2**-9,
                          1.25 * 2**-8, 2**-6 * (1 - 2**-5), 31.01, 15.99, 447.9, -448.0,
                          240.0, 248.0, 1e-40])  # fmt: skip
    y = torch.cat([torch.arange(-448.0, 448.0 + 1e-3, 1 / 32), torch.linspace(-0.03, 0.03, 20001),
                   rand, -rand, edges]).contiguous()  # fmt: skip
    out = torch.empty(y.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    _round_kernel[(triton.cdiv(y.numel(), 4096),)](y.to(DEVICE), out, y.numel(), BLOCK=4096)
    want = y.to(torch.float8_e4m3fn)
    bad = out.cpu().view(torch.uint8) != want.view(torch.uint8)
    assert not bad.any(), (y[bad][:6], out.cpu().float()[bad][:6], want.float()[bad][:6])
