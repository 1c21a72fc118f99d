"""The SwiGLU feed-forward of a decoder layer (and of an MoE layer's shared expert).

Gate and up are one fused `[2I, H]` projection (exact on CPU float32: per-element results
do not change when output columns are concatenated); on the skinny path SiLU-and-mul is
that projection's epilogue (kernels/skinny_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.skinny_linear import linear
from pdserve.kernels.workspace import KernelWorkspace


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, workspace: KernelWorkspace):
        super().__init__()
        self.workspace = workspace
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        h = linear(x, gate_up.weight, gate_up.bias, self.workspace, silu_mul_output=True)
        return linear(h, down.weight, down.bias, self.workspace)
