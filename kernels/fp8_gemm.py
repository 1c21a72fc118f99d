"""W8A8 FP8 linear layers: `y = x @ W.T + b` where W is float8_e4m3fn with one scale an
output channel and x is quantized to float8 as it arrives, one scale a row
(kernels/fp8_quant.py), so the product runs on the FP8 tensor cores (torch._scaled_mm
with row-wise scales) reading the weight's bytes as they are. What vLLM runs for
"channel" / "tensor" FP8 weights with dynamic per-token activations on Hopper, and for
16-bit checkpoints served with `--quantization fp8`.

Measured on an H100 (benchmarks/fp8_gemm_bench.py, Llama-3-8B's four GEMMs, each in a CUDA
graph over 4 distinct weights, fp8_gemm_bench_llama3_8b_h100_288c280.json): the four
together take 140 us at 32 rows with the quantization (the GEMMs alone 122) against
170 for cuBLAS on bf16 weights and 176 for the weight-only FP8 tiles of
kernels/int_linear.py (680 at 128 rows); at 2,048 rows 803 against 1,183 for bf16. So
wherever the recipe applies it runs at every batch size, and a row's result does not
depend on its step's size.

Block-scaled weights (DeepSeek-style 128 x 128 `weight_block_size`) do not take this
path: torch 2.11's _scaled_mm refused every layout of 1 x 128 / 128 x 128 scales tried
on the H100 ("Invalid scaling configuration"), so they keep the weight-only tiles.

`fp8_linear_ref` is the spec and the CPU path: both operands dequantized to float32 as
the device path quantizes them, multiplied in float32, rounded to x's dtype, then the
bias added in that dtype (the device path's rounding points: _scaled_mm writes the
product, an add follows). The device path equals it up to the float32 summation order
(the tensor cores' FP8 products are exact in their accumulator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.fp8_quant import quantize_fp8_ref, quantize_fp8_triton

M_MULTIPLE = 4  # the FP8 GEMMs want the row count a multiple of 4


def w8a8_applies(weight_scale: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a kept FP8 weight (PackedLinear's [N, G] float32 `scales`) runs as W8A8: one
    scale a row, 16-aligned shapes and a bf16 model (the row-scaled FP8 GEMM writes bf16
    only)."""
    return dtype == torch.bfloat16 and weight_scale.shape[1] == 1 and n % 16 == 0 and k % 16 == 0


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The spec. x [..., K] 16-bit; weight [N, K] float8_e4m3fn; scale_b [1, N] float32."""
    flat = x.reshape(-1, x.shape[-1])
    codes, scale_a = quantize_fp8_ref(flat)
    w = weight.float() * scale_b.reshape(-1, 1)
    y = F.linear(codes.float() * scale_a, w).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], -1)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`fp8_linear_ref` on CUDA through torch._scaled_mm (the spec elsewhere)."""
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, weight.dtype
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, scale_b, bias)
    return fp8_linear_scaled_mm(x, weight, scale_b, bias)


def fp8_linear_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The device path on any device Triton and _scaled_mm run on (CUDA; the CPU, with the
    quantizer under Triton's interpreter)."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if m % M_MULTIPLE:
        flat = F.pad(flat, (0, 0, 0, -m % M_MULTIPLE))
    elif flat.stride(1) != 1:
        flat = flat.contiguous()
    codes, scale_a = quantize_fp8_triton(flat)
    y = torch._scaled_mm(codes, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y[:m].reshape(*x.shape[:-1], -1)
