"""Parity of the linear on an FP8 checkpoint's kept weights (`kernels/int_linear.py` with
`fp8`: 8-bit codes that are float8_e4m3fn bytes, value * scale of the input's group) with
its spec and with an independent reference.

The weights are random float8_e4m3fn values (every finite byte may occur, subnormals and
negative zero included), their bytes viewed as int32 words as the loader keeps them
(runner/models/fp8_weights.py), scales one per (output, group of inputs). Reference: the
float8 values decoded by torch's own conversion, times the scale, rounded to x's dtype
(what the kernel's tile holds), in float64; the bound is tests/test_int_linear.py's. A
byte read from the wrong field, a misplaced group or a code taken as an integer errs by
O(|ref|).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_int_linear import DEVICE, check

from pdserve.kernels.int_linear import (
    DEQUANT_ROWS,
    choose_config,
    dequantize_int,
    dequantize_int_triton,
    int_linear,
    int_linear_ref,
    int_linear_triton,
)
from pdserve.kernels.workspace import KernelWorkspace


def fp8_bytes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[N, K] uint8: random float8_e4m3fn bytes, NaN (0x7F / 0xFF) left out."""
    b = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int64)
    return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)


def words_of(b: torch.Tensor) -> torch.Tensor:
    """[N, K] bytes -> int32 [N, ceil(K / 4)] words, the lowest byte first (padded)."""
    n, k = b.shape
    padded = torch.zeros(n, -(-k // 4) * 4, dtype=torch.uint8)
    padded[:, :k] = b
    return padded.view(torch.int32)


def make(m, n, k, group_size, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    b = fp8_bytes(n, k, gen)
    scales = torch.rand(n, groups, generator=gen) / (k**0.5 * 64) + 1e-4
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias_t = torch.randn(n, generator=gen).to(dtype) if bias else None
    group = torch.arange(k) // size
    w = (b.view(torch.float8_e4m3fn).float() * scales[:, group]).to(dtype)
    zeros = torch.zeros(n, groups, dtype=torch.uint8)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, words_of(b), scales, zeros, bias_t)]
    return dev, w, size


CASES = [
    # (M, N, K, group_size, bias): one row and many (past a 64-row tile); N off the tiles;
    # K off the words (K=42: the last word half full) and off the tile; block scales of
    # 128 inputs (DeepSeek / Qwen3 FP8), one scale a row (compressed-tensors' channel and
    # tensor scales), and groups that tiles span (24).
    (1, 24, 256, 128, True),
    (5, 100, 200, -1, False),
    (32, 64, 42, -1, True),
    (70, 40, 96, 32, True),
    (3, 64, 72, 24, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,group_size,bias", CASES)
def test_kernel_matches_the_dequantized_linear(m, n, k, group_size, bias, dtype):
    (x, words, scales, zeros, b), w, size = make(m, n, k, group_size, dtype, bias)
    y = int_linear_triton(x, words, scales, zeros, 8, size, b, fp8=True)
    check(y, x, w, b, dtype)


def test_the_spec_decodes_the_bytes_as_float8():
    """dequantize_int with fp8 is torch's float8_e4m3fn decoding times the scale, exactly;
    the same words read as integer codes (no fp8) would be far off."""
    (x, words, scales, zeros, b), w, size = make(4, 40, 44, 16, torch.float32, True)
    got = dequantize_int(words.cpu(), scales.cpu(), zeros.cpu(), 8, 44, size, fp8=True)
    torch.testing.assert_close(got, w, rtol=0, atol=0)
    as_ints = dequantize_int(words.cpu(), scales.cpu(), zeros.cpu(), 8, 44, size)
    assert (as_ints - w).abs().max() > 0.5 * w.abs().max()
    y = int_linear_ref(x.cpu(), words.cpu(), scales.cpu(), zeros.cpu(), 8, size, b.cpu(), True)
    check(y, x, w, b, torch.float32)


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_and_the_per_weight_scale_form(dtype, split):
    """K split over programs (merged by the last arriver) and tiles that span groups (a
    scale a weight): the same bound, the same bits twice."""
    for m, n, k, group_size, bias in (CASES[0], CASES[4]):
        (x, words, scales, zeros, b), w, size = make(m, n, k, group_size, dtype, bias)
        cfg = replace(choose_config(m, n, size, scales.shape[1]), block_k=16, split_k=split)
        ws = KernelWorkspace()
        y = int_linear_triton(x, words, scales, zeros, 8, size, b, cfg, ws, fp8=True)
        check(y, x, w, b, dtype)
        again = int_linear_triton(x, words, scales, zeros, 8, size, b, cfg, ws, fp8=True)
        assert torch.equal(y, again)
        wide = replace(cfg, block_k=64, split_k=1)  # 64 inputs: across groups of 24
        check(int_linear_triton(x, words, scales, zeros, 8, size, b, wide, fp8=True),
              x, w, b, dtype)  # fmt: skip


@pytest.mark.parametrize("group_size", [128, -1, 24])
def test_dequantize_kernel_and_long_batches(group_size):
    """The long-batch path's dequantize kernel equals the spec bit for bit; past
    DEQUANT_ROWS rows int_linear takes it (on the CPU: the spec)."""
    (_, words, scales, zeros, _), w, size = make(2, 40, 200, group_size, torch.float32, False)
    got = dequantize_int_triton(words, scales, zeros, 8, 200, size, torch.float32, fp8=True)
    torch.testing.assert_close(got.cpu(), w, rtol=0, atol=0)
    m = DEQUANT_ROWS + 3
    (x, words, scales, zeros, b), w, size = make(m, 48, 64, group_size, torch.bfloat16, True)
    check(int_linear(x, words, scales, zeros, 8, size, b, fp8=True), x, w, b, torch.bfloat16)
