"""Parity of the packed-integer linear (`kernels/int_linear.py`) with its spec.

On CPU the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set by conftest)
at small sizes; on a GPU the same tests run on CUDA.

The weights are random codes, zero points and scales in the kernel's layout, packed here
by a loop over words (independent of the spec's unpacking). Reference: float64 on the
weight dequantized by a loop over groups and rounded to x's dtype (what the kernel's tile
holds). Tolerance as tests/test_skinny_linear.py: fp32 summation error (2^-12 sum|x w|)
plus one rounding of the output to its dtype; Triton's interpreter converts fp32 to bf16
by truncation, so there the tile's weights are off by up to an ulp (2^-7 sum|x w|). A
code read from the wrong field, a misplaced group or a zero point left out errs by
O(|ref|).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kernels.int_linear import (
    DEQUANT_ROWS,
    choose_config,
    dequantize_int,
    dequantize_int_triton,
    fields_apply,
    int_linear,
    int_linear_ref,
    int_linear_triton,
)
from pdserve.kernels.workspace import KernelWorkspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ROUNDING = 2.0**-8 if DEVICE == "cuda" else 2.0**-7
ROUNDING = {torch.float32: 0.0, torch.bfloat16: BF16_ROUNDING, torch.float16: 2.0**-11}
# The reference's weights are rounded to x's dtype. The kernel's are too, or (4-bit codes in
# 16-bit tiles of one group, IntLinearConfig.scale_after) exact (code - zero) with the
# scale applied after the dot: half an ulp of each weight either way (2^-9 bf16, 2^-12
# fp16), bounded with a factor 2; under the interpreter bf16 rounding truncates (2^-7).
TILE_ERROR = {torch.bfloat16: 2.0**-8 if DEVICE == "cuda" else 2.0**-7, torch.float16: 2.0**-11}


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] codes -> int32 [N, ceil(K * bits / 32)], field i of word j = code j*p + i."""
    n, k = codes.shape
    p = 32 // bits
    words = torch.zeros(n, -(-k // p), dtype=torch.int64)
    for j in range(words.shape[1]):
        for i in range(p):
            if j * p + i < k:
                words[:, j] |= codes[:, j * p + i].to(torch.int64) << (bits * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def reference_weight(codes, scales, zeros, group_size: int) -> torch.Tensor:
    w = torch.empty(codes.shape, dtype=torch.float32)
    for k in range(codes.shape[1]):
        g = k // group_size
        w[:, k] = (codes[:, k] - zeros[:, g].to(torch.int64)).float() * scales[:, g]
    return w


def make(m, n, k, bits, group_size, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(torch.uint8)
    scales = torch.rand(n, groups, generator=gen) / (k**0.5 * (1 << bits)) + 1e-3
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    w = reference_weight(codes, scales, zeros, size).to(dtype)
    dev = [
        t.to(DEVICE) if t is not None else None
        for t in (x, pack_words(codes, bits), scales, zeros, b)
    ]
    return dev, w, size


def check(y, x, w, b, dtype):
    xd, wd = x.double().cpu(), w.double()
    ref = xd @ wd.T + (0.0 if b is None else b.double().cpu())
    scale = xd.abs() @ wd.abs().T
    err = (y.double().cpu() - ref).abs()
    bound = ROUNDING[dtype] * ref.abs() + (2.0**-12 + TILE_ERROR.get(dtype, 0.0)) * scale + 1e-30
    assert y.shape == ref.shape and y.dtype == dtype
    assert (err <= bound).all(), f"max excess {float((err - bound).max()):.3g} over the bound"


CASES = [
    # (M, N, K, bits, group_size, bias): one row and many (past a 64-row tile), N off the
    # 64-output tile, K off the words (K=44: the last word half full) and off the tile;
    # groups a tile holds whole (16/32/128, one group), and 24 (tiles span groups).
    (1, 24, 64, 4, 16, True),
    (5, 100, 200, 4, 32, False),
    (32, 64, 44, 4, -1, True),
    (70, 40, 96, 8, 32, True),
    (3, 64, 72, 4, 24, False),
    (17, 33, 256, 8, 128, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,bits,group_size,bias", CASES)
def test_kernel_matches_the_dequantized_linear(m, n, k, bits, group_size, bias, dtype):
    (x, qweight, scales, zeros, b), w, size = make(m, n, k, bits, group_size, dtype, bias)
    y = int_linear_triton(x, qweight, scales, zeros, bits, size, b)
    check(y, x, w, b, dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_spec_dequantizes_as_the_group_loop(bits):
    (x, qweight, scales, zeros, b), w, size = make(4, 40, 44, bits, 16, torch.float32, True)
    got = dequantize_int(qweight.cpu(), scales.cpu(), zeros.cpu(), bits, 44, size)
    torch.testing.assert_close(got, w, rtol=0, atol=0)
    y = int_linear_ref(x.cpu(), qweight.cpu(), scales.cpu(), zeros.cpu(), bits, size, b.cpu())
    check(y, x, w, b, torch.float32)


def test_strided_rows_and_no_rows():
    (x, qweight, scales, zeros, _), w, size = make(6, 64, 64, 4, 32, torch.float32, False)
    wide = torch.zeros(6, 80, device=DEVICE)
    wide[:, :64] = x
    y = int_linear_triton(wide[:, :64], qweight, scales, zeros, 4, size, None)
    check(y, x, w, None, torch.float32)
    empty = int_linear_triton(x[:0], qweight, scales, zeros, 4, size, None)
    assert empty.shape == (0, 64)


@pytest.mark.parametrize("m,n,k,bits,group_size,bias", [CASES[1], CASES[2], CASES[4], CASES[5]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_other_tile_forms_match_too(m, n, k, bits, group_size, bias, dtype):
    """The sweep's other forms: each word loaded once per code it holds; each weight
    dequantized before the dot (not the scale after it); the zero point subtracted from
    each weight (not from the dot product); a dot a field of the words (`fields`), with
    the scale after the dot and without."""
    (x, qweight, scales, zeros, b), w, size = make(m, n, k, bits, group_size, dtype, bias)
    groups = scales.shape[1]
    # fields: tiles of 128 inputs (16 words of 4-bit codes, 32 of 8-bit), within one group
    # (-1, 128) or across groups (32, 24: a scale a weight)
    fields = {"fields": True, "block_k": 128}
    assert fields_apply(128, bits)
    forms = ({"words_once": False}, {"scale_after": False}, {"zero_after": False}, fields,
             {**fields, "scale_after": False})  # fmt: skip
    for form in forms:
        cfg = replace(choose_config(m, n, size, groups), **form)
        check(int_linear_triton(x, qweight, scales, zeros, bits, size, b, cfg), x, w, b, dtype)


@pytest.mark.parametrize("m,n,k,bits,group_size,bias", [CASES[1], CASES[3], CASES[4], CASES[5]])
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_matches_and_repeats(m, n, k, bits, group_size, bias, dtype, split):
    """K split over programs (3: slices of unequal length, the last one short), merged by
    the last arriver in split order: the same bound, the same bits on a second call, and the
    counters back at zero. Without a workspace the config's split is ignored."""
    (x, qweight, scales, zeros, b), w, size = make(m, n, k, bits, group_size, dtype, bias)
    cfg = replace(choose_config(m, n, size, scales.shape[1]), block_k=16, split_k=split)
    ws = KernelWorkspace()
    y = int_linear_triton(x, qweight, scales, zeros, bits, size, b, cfg, ws)
    check(y, x, w, b, dtype)
    assert torch.equal(y, int_linear_triton(x, qweight, scales, zeros, bits, size, b, cfg, ws))
    assert not ws.counters("int_linear", 1, x.device).any()
    alone = int_linear_triton(x, qweight, scales, zeros, bits, size, b, cfg)
    check(alone, x, w, b, dtype)


def test_choose_config_splits_decode_batches():
    """The sweep's picks on Llama-3-8B (o, down, qkv: 8 slices; gate/up: 4); long batches,
    short K and no K given stay unsplit."""
    for n, k, split in ((4096, 4096, 8), (4096, 14336, 8), (6144, 4096, 8), (28672, 4096, 4)):
        assert choose_config(32, n, 128, k // 128, k).split_k == split
    assert choose_config(65, 4096, 128, 32, 4096).split_k == 1
    short = choose_config(1, 4096, 128, 4, 512)  # slices keep >= 512 inputs
    assert (short.split_k, short.block_n, short.block_k) == (1, 32, 128)  # unsplit tiles
    assert choose_config(1, 4096, 128, 32).split_k == 1


@pytest.mark.parametrize("bits,group_size", [(4, 16), (8, -1), (4, 24)])
def test_dequantize_kernel_matches_the_spec(bits, group_size):
    (_, qweight, scales, zeros, _), w, size = make(
        2, 40, 200, bits, group_size, torch.float32, False
    )
    got = dequantize_int_triton(qweight, scales, zeros, bits, 200, size, torch.float32)
    torch.testing.assert_close(got.cpu(), w.float(), rtol=0, atol=0)


def test_long_batches_take_the_dequantized_weight():
    """Past DEQUANT_ROWS rows (CUDA) the weight is dequantized by its kernel and cuBLAS
    multiplies: the same bound (on the CPU this is the spec)."""
    m = DEQUANT_ROWS + 76
    (x, qweight, scales, zeros, b), w, size = make(m, 48, 64, 4, 32, torch.bfloat16, True)
    check(int_linear(x, qweight, scales, zeros, 4, size, b), x, w, b, torch.bfloat16)
