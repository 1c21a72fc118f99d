"""MoE experts on packed integer weights (GPTQ / AWQ / compressed-tensors int4 and int8
experts kept packed on the GPU, runner/models/moe.py): kernels/moe_triton.py's grouped
GEMMs over expert-sorted slot blocks with `PACKED` stacks, each weight tile dequantized in
registers as it streams in (kernels/int_linear.py's `dequantized_tile`), so the experts
take a quarter (4-bit) or half (8-bit) of their 16-bit bytes.

Layout, per projection: kernels/int_linear.py's with an expert axis in front: `qweight`
int32 [E, N, ceil(K * bits / 32)] (output n's codes along K, the lowest bits first),
`scales` float32 [E, N, G] and `zeros` uint8 [E, N, G], input k in group k // group_size.
The gate/up projection stacks the gate's I rows, then the up's, as the 16-bit experts do.

The spec, `moe_experts_int_ref`, dequantizes every expert to x's dtype (the float32
product `(code - zero) * scale` rounded once, exactly as a checkpoint dequantized at load
is) and runs kernels/moe.py's `moe_experts_ref`; it is also the CPU path. The kernels build
the same rounded tile, so they differ from the spec only in summation order. SiLU-gated
experts without biases only (the families whose experts stay packed). The tiles are
moe_triton's first guesses, not yet measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.kernels.int_linear import dequantize_int
from pdserve.kernels.moe import moe_experts_ref
from pdserve.kernels.moe_triton import moe_experts_triton


@dataclass(frozen=True)
class PackedExperts:
    """One projection of a layer's experts, packed: [E, N, K] weights in int_linear's layout."""

    qweight: Tensor  # int32 [E, N, words]
    scales: Tensor  # float32 [E, N, G]
    zeros: Tensor  # uint8 [E, N, G]
    bits: int
    group_size: int
    in_features: int  # K

    def __post_init__(self) -> None:
        e, n, words = self.qweight.shape
        groups = -(-self.in_features // self.group_size)
        assert self.bits in (4, 8), f"packed experts take 4- or 8-bit codes, got {self.bits}"
        assert words * (32 // self.bits) >= self.in_features, (
            f"{words} words a row hold fewer than {self.in_features} {self.bits}-bit codes"
        )
        assert self.scales.shape == self.zeros.shape == (e, n, groups), (
            f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must be "
            f"[{e}, {n}, {groups}]"
        )
        parts = (self.qweight, self.scales, self.zeros)
        assert all(t.is_contiguous() for t in parts), "the kernels read dense [E, N, ·] stacks"

    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K], as a 16-bit stack's."""
        e, n, _ = self.qweight.shape
        return e, n, self.in_features

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """[E, N, K] in `dtype`: each weight (code - zero) * scale, rounded once."""
        return torch.stack([
            dequantize_int(q, s, z, self.bits, self.in_features, self.group_size).to(dtype)
            for q, s, z in zip(self.qweight, self.scales, self.zeros, strict=True)
        ])  # fmt: skip


def moe_experts_int_ref(
    x: Tensor, gate_up: PackedExperts, down: PackedExperts, ids: Tensor, weights: Tensor
) -> Tensor:
    """The spec (and the CPU path): the experts dequantized to x's dtype, then
    `moe_experts_ref`."""
    return moe_experts_ref(x, gate_up.dequantized(x.dtype), down.dequantized(x.dtype), ids, weights)


def moe_experts_int(
    x: Tensor, gate_up: PackedExperts, down: PackedExperts, ids: Tensor, weights: Tensor
) -> Tensor:
    """[T, H] -> [T, H]: the Triton kernels on CUDA, the spec elsewhere."""
    num_experts, two_inter, _ = gate_up.qweight.shape
    assert x.dim() == 2 and x.shape[1] == gate_up.in_features == down.qweight.shape[1], (
        f"x {tuple(x.shape)} must be [T, {gate_up.in_features}] and the down projection's "
        f"outputs {down.qweight.shape[1]}"
    )
    assert down.in_features * 2 == two_inter and down.qweight.shape[0] == num_experts, (
        f"down experts [{down.qweight.shape[0]}, ·, {down.in_features}] must match gate/up "
        f"[{num_experts}, {two_inter}, ·]"
    )
    assert ids.dim() == 2 and ids.shape[0] == x.shape[0] and weights.shape == ids.shape
    if x.is_cuda:
        return moe_experts_triton(x, gate_up, down, ids, weights)  # PACKED stacks
    return moe_experts_int_ref(x, gate_up, down, ids, weights)
