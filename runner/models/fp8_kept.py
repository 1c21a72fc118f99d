"""FP8 checkpoints whose dense projections keep their float8_e4m3fn bytes on the GPU
(half of bf16's memory), run by kernels/int_linear.py with `fp8` codes: each tile decodes
the bytes to float32 and multiplies them by their scale, so the matmul's inputs are the
same values as a load that dequantizes (runner/models/fp8_weights.py), rounded to the
model's dtype, with 16-bit activations (weight-only, as vLLM's FP8 Marlin path on GPUs
without FP8 tensor cores); except that in bf16 models a projection with a scale a channel
(or one for the tensor) runs W8A8 FP8 GEMMs at every batch size instead
(kernels/fp8_gemm.py: activations quantized per token, the checkpoint's "dynamic"
scheme; PackedLinear.prepare_w8a8). Block-scaled weights keep the weight-only tiles.

When: as for packed integer checkpoints (runner/models/packed_linear.py's `runs_packed`):
`--quantized-weights packed`, or "auto" where the 16-bit weights would not leave the KV
cache room. Which projections: the same Llama-family sites (`swap_packed_linears`), the
routed experts of its MoE layers included (kernels/moe_int.py with `fp8` codes); the
rest of the model (other families, routers, embeddings) is dequantized at load.

Layout: a kept linear becomes PackedLinear's `qweight` (the bytes along K viewed as int32
words, lowest byte first, the last word zero-padded), `scales` float32 [N, G] and
`zeros` (all 0, unread by the kernel). Block scales ("fp8", `weight_block_size` [bm, bn])
repeat each block row's scales over its bm outputs, so the loader's fused q/k/v and
gate/up shards stack along N as 16-bit weights do; the group is bn inputs. Tensor and
output-channel scales (compressed-tensors) are one group a row. compressed-tensors' int8
weights ("w8a8") and per-input-group scales are dequantized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.runner.models.packed_int_weights import PackedIntFormat

if TYPE_CHECKING:  # (fp8_weights imports this module)
    from pdserve.runner.models.fp8_weights import Fp8Format

FP8_KEPT = "fp8"  # PackedIntFormat.method of a kept FP8 checkpoint


def kept_fp8_format(fmt: Fp8Format | None, int8: bool) -> PackedIntFormat | None:
    """The packed description (8-bit float8 codes, the scales' group) of an FP8 checkpoint
    whose projections may stay FP8, None for any other checkpoint (`int8`: the checkpoint's
    scaled weights are compressed-tensors' int8, quantized_source "w8a8")."""
    if fmt is None or int8:
        return None
    group = -1 if fmt.block is None else fmt.block[1]
    return PackedIntFormat(FP8_KEPT, 8, group, 0, act_order=False, symmetric=True)


def kept_parts(
    weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, name: str = "?"
) -> dict[str, torch.Tensor]:
    """One FP8 linear as PackedLinear's `qweight`, `scales` and `zeros` (module docstring).
    Raises ValueError for a scale that is neither a block's, a row's nor the tensor's."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{name}: kept FP8 weights are 2-D float8_e4m3fn (got {weight.dtype})")
    n, k = weight.shape
    s = scale.float()
    if s.numel() == 1:
        scales = s.reshape(1, 1).expand(n, 1)
    elif fmt.block is not None:
        bm, bn = fmt.block
        if tuple(s.shape) != (-(-n // bm), -(-k // bn)):
            raise ValueError(f"{name}: block scale {tuple(s.shape)} for a {n} x {k} weight")
        scales = s.repeat_interleave(bm, dim=0)[:n]
    elif s.numel() == n and s.shape[0] == n:  # [N] or [N, 1]: one scale an output
        scales = s.reshape(n, 1)
    else:
        raise ValueError(
            f"{name}: scale {tuple(s.shape)} for a {n} x {k} weight (kept FP8 weights take "
            "block, channel or tensor scales; drop --quantized-weights packed to dequantize)"
        )
    data = F.pad(weight.contiguous().view(torch.uint8), (0, -k % 4))
    return {"qweight": data.view(torch.int32).contiguous(), "scales": scales.contiguous(),
            "zeros": torch.zeros(scales.shape, dtype=torch.uint8)}  # fmt: skip
