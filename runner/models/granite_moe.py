"""Granite 3.x MoE (`GraniteMoeForCausalLM`: granite-3.1-1b-a400m, 3b-a800m): Granite's
layer (its embedding, attention, residual and logit multipliers; llama.py) with every
feed-forward an MoE of top-k SwiGLU experts, the k largest router logits softmaxed among
themselves (the same weights as renormalising a softmax's top k: moe.MoeSpec).

Released checkpoints store the experts stacked as `block_sparse_moe.input_linear` (gate
and up) and `output_linear`, the router as `router.layer`; transformers 5's exports as
`experts.gate_up_proj` / `down_proj` and `router.weight`: both load. The residual
multiplier scales the o projection and the experts' down projections at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pdserve.runner.models import moe
from pdserve.runner.models.llama import LlamaFamilyForCausalLM

_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
    (".block_sparse_moe.router.weight", ".mlp.gate.weight"),
    (".block_sparse_moe.experts.", ".mlp.experts."),
)


class GraniteMoeForCausalLM(LlamaFamilyForCausalLM):
    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        return moe.SparseMoeBlock(cfg.hidden_size, moe.moe_spec(cfg), self.workspace)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))

    def _after_load(self) -> None:
        if self.residual_multiplier == 1.0:
            return
        for layer in self.layers:
            o = layer.self_attn.o_proj
            o.weight.mul_(self.residual_multiplier)
            if o.bias is not None:
                o.bias.mul_(self.residual_multiplier)
            layer.mlp.experts_down.mul_(self.residual_multiplier)


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield name, tensor
