"""The gated feed-forward of a decoder layer (and of an MoE layer's shared expert):
SwiGLU, or GeGLU with GELU(tanh) (Gemma's `gelu_pytorch_tanh`).

Gate and up are one fused `[2I, H]` projection (exact on CPU float32: per-element results
do not change when output columns are concatenated); on the skinny path SiLU-and-mul is
that projection's epilogue (kernels/skinny_linear.py). GELU runs as its own kernel after
the projection (kernels/activation.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pdserve.kernels.skinny_linear import linear
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.packed_linear import project

if TYPE_CHECKING:
    from pdserve.runner.lora.slots import LoraSite

# The gate activations a dense MLP implements (transformers' names).
DENSE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def activation_of(hf_config: Any) -> str:
    """The feed-forward's gate activation: `hidden_activation` (Gemma) or `hidden_act`."""
    return getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")


class MLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        workspace: KernelWorkspace,
        act: str = "silu",
    ):
        super().__init__()
        assert act in DENSE_ACTIVATIONS, f"activation {act!r} (implemented: {DENSE_ACTIVATIONS})"
        self.act = act
        self.workspace = workspace
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        # LoRA adapters' deltas (runner/lora/slots.py), when served: the activation then
        # runs apart from the gate/up projection, after the delta is added
        self.gate_up_lora: LoraSite | None = None
        self.down_lora: LoraSite | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.gate_up_lora is not None:
            gu = linear(x, gate_up.weight, gate_up.bias, self.workspace)
            gu = self.gate_up_lora.apply(gu, x)
            h = silu_and_mul(gu) if self.act == "silu" else gelu_tanh_and_mul(gu)
            return self.down_lora.apply(linear(h, down.weight, down.bias, self.workspace), h)
        h = project(gate_up, x, self.workspace, act=self.act)  # nn.Linear or PackedLinear
        return project(down, h, self.workspace)
