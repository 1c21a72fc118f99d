"""MXFP4 checkpoint tensors (gpt-oss's experts), dequantized as they load.

A quantized weight `W` of shape `[..., out, in]` is stored as `W_blocks`, uint8
`[..., out, in / 32, 16]` (two 4-bit e2m1 values a byte, the low nibble first), and
`W_scales`, uint8 `[..., out, in / 32]` (one power-of-two exponent per 32 values, biased
by 127). The weight is each 4-bit value times two to its block's exponent.

What this does not do: run MXFP4 GEMMs. The experts take the model dtype's memory (4x the
packed bytes in bf16: gpt-oss-20b's experts grow from ~12 GB to ~40 GB) and run on the
16-bit MoE kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# e2m1: sign, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
SUFFIX_BLOCKS, SUFFIX_SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., out, G, 16] and scales [..., out, G] -> float32 [..., out, G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + (16,)"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., out, G, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents[..., None])
    return values.flatten(-2)


def dequantized_mxfp4(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each `W_blocks` / `W_scales` pair replaced by
    `W.dequantized` (float32 `[..., out, in]`), whichever of the two comes first; others
    pass through. A lone half raises ValueError."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in weights:
        for suffix in (SUFFIX_BLOCKS, SUFFIX_SCALES):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                if base in waiting:
                    _, partner = waiting.pop(base)
                    blocks, scales = (
                        (tensor, partner) if suffix == SUFFIX_BLOCKS else (partner, tensor)
                    )
                    yield f"{base}.dequantized", dequantize_mxfp4(blocks, scales)
                else:
                    waiting[base] = (suffix, tensor)
                break
        else:
            yield name, tensor
    if waiting:
        lone = [f"{base}{suffix}" for base, (suffix, _) in sorted(waiting.items())][:3]
        raise ValueError(f"MXFP4 checkpoint has blocks without scales or the reverse: {lone}")
