"""W8A8 FP8 linear layers for long batches: `y = x @ W.T + b` where W is float8_e4m3fn with
its scales and x is quantized to float8 as it arrives (kernels/fp8_quant.py), so the
product runs on the FP8 tensor cores (torch._scaled_mm: CUTLASS / cuBLASLt) at twice the
16-bit rate, reading the weight's bytes once as they are (no dequantized copy).

Two recipes, named by the weight's scales (what vLLM runs for the same checkpoints):
- ROW: one scale an output (compressed-tensors FP8 "channel" or "tensor" weights, and
  16-bit checkpoints quantized at load by `--quantization fp8`), the activations one
  scale a row (dynamic per token).
- BLOCK: one scale a 128 x 128 weight block (DeepSeek-style `weight_block_size`), the
  activations one scale per 128 inputs of a row.

`fp8_linear_ref` is the spec and the CPU path: both operands quantized as the device
path quantizes them, dequantized to float32, multiplied in float32, rounded to x's dtype,
then the bias added in that dtype (the device path's rounding points: _scaled_mm writes
the product, an add follows). The device path equals it up to the float32 summation
order (the tensor cores' FP8 products are exact in their accumulator).

Where it runs: runner/models/packed_linear.py's kept FP8 projections past DEQUANT_ROWS
rows (kernels/int_linear.py's decode-size path keeps activations 16-bit: at a few rows a
linear is bound by its weight bytes, which the FP8 codes already halve).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.fp8_quant import quantize_fp8_ref, quantize_fp8_triton

ROW, BLOCK = "row", "block"
BLOCK_SIZE = 128  # the BLOCK recipe's weight blocks (and activation runs)
M_MULTIPLE = 4  # cuBLASLt's FP8 kernels want the row count a multiple of 4


def w8a8_recipe(
    weight_scale: torch.Tensor, n: int, k: int, group_size: int, dtype: torch.dtype
) -> str | None:
    """The recipe a kept FP8 weight's scales allow (PackedLinear's [N, G] float32 `scales`,
    groups of `group_size` inputs), or None (the weight dequantizes past DEQUANT_ROWS, as
    before): ROW for one scale a row; BLOCK for 128-input groups whose scales repeat over
    aligned runs of 128 rows. Both need 16-aligned shapes and a bf16 output (the
    row-scaled FP8 kernels write bf16 only)."""
    if dtype != torch.bfloat16 or n % 16 or k % 16:
        return None
    if weight_scale.shape[1] == 1:
        return ROW
    if group_size != BLOCK_SIZE or n % BLOCK_SIZE or k % BLOCK_SIZE:
        return None
    blocks = weight_scale[::BLOCK_SIZE]
    return BLOCK if torch.equal(blocks.repeat_interleave(BLOCK_SIZE, 0), weight_scale) else None


def block_scales(weight_scale: torch.Tensor, recipe: str) -> torch.Tensor:
    """The weight's scales as _scaled_mm reads them for `recipe`: [1, N] for ROW, the
    [N / 128, K / 128] blocks (one row of each 128-row run) for BLOCK."""
    if recipe == ROW:
        return weight_scale.reshape(1, -1).float().contiguous()
    return weight_scale[::BLOCK_SIZE].float().contiguous()


def _dequantized_weight(weight: torch.Tensor, scale_b: torch.Tensor, recipe: str) -> torch.Tensor:
    w = weight.float()
    if recipe == ROW:
        return w * scale_b.reshape(-1, 1)
    s = scale_b.repeat_interleave(BLOCK_SIZE, 0).repeat_interleave(BLOCK_SIZE, 1)
    return w * s


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None,
    recipe: str,
) -> torch.Tensor:  # fmt: skip
    """The spec. x [..., K] 16-bit; weight [N, K] float8_e4m3fn; scale_b as `block_scales`."""
    flat = x.reshape(-1, x.shape[-1])
    group = 0 if recipe == ROW else BLOCK_SIZE
    codes, scale_a = quantize_fp8_ref(flat, group)
    m, k = flat.shape
    g = k if recipe == ROW else BLOCK_SIZE
    xd = (codes.float().reshape(m, k // g, g) * scale_a.reshape(m, k // g, 1)).reshape(m, k)
    y = F.linear(xd, _dequantized_weight(weight, scale_b, recipe)).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], -1)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None,
    recipe: str,
) -> torch.Tensor:  # fmt: skip
    """`fp8_linear_ref` on CUDA through torch._scaled_mm (the spec elsewhere)."""
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, weight.dtype
    assert recipe in (ROW, BLOCK), recipe
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, scale_b, bias, recipe)
    return fp8_linear_scaled_mm(x, weight, scale_b, bias, recipe)


def fp8_linear_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None,
    recipe: str,
) -> torch.Tensor:  # fmt: skip
    """The device path on any device Triton and _scaled_mm run on (CUDA; on the CPU,
    under Triton's interpreter, the ROW recipe: torch's CPU _scaled_mm has no blocks)."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if m % M_MULTIPLE:
        flat = F.pad(flat, (0, 0, 0, -m % M_MULTIPLE))
    elif flat.stride(1) != 1:
        flat = flat.contiguous()
    codes, scale_a = quantize_fp8_triton(flat, 0 if recipe == ROW else BLOCK_SIZE)
    # ROW: scale_b [1, N]; BLOCK: the [N / 128, K / 128] blocks, transposed as the [K, N]
    # operand's
    y = torch._scaled_mm(codes, weight.t(), scale_a=scale_a,
                         scale_b=scale_b if recipe == ROW else scale_b.t(),
                         out_dtype=x.dtype)  # fmt: skip
    if bias is not None:
        y = y + bias
    return y[:m].reshape(*x.shape[:-1], -1)
