"""ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`, ERNIE-4.5-21B-A3B and 300B-A47B): ERNIE 4.5's
layer (interleaved RoPE, reordered at load; llama.FamilySpec) with MoE feed-forwards on
the layers from `moe_layer_start_index` to `moe_layer_end_index` at `moe_layer_interval`,
dense ones elsewhere.

Its routing is DeepSeek-V3's without groups on softmax scores (runner/models/
deepseek_moe.py): float32 softmax over the experts, the k chosen by score plus the
checkpoint's correction bias (`moe_statics`), weighed by their unbiased scores
renormalised; shared experts as one MLP beside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pdserve.runner.models.deepseek_moe import KEEP_FP32, DeepseekMoe, DeepseekRouting
from pdserve.runner.models.llama import LlamaFamilyForCausalLM
from pdserve.runner.models.mlp import MLP


def ernie_routing(cfg: Any) -> DeepseekRouting:
    shared = int(cfg.moe_intermediate_size * (cfg.moe_num_shared_experts or 0))
    return DeepseekRouting(
        num_experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
        intermediate=int(cfg.moe_intermediate_size), shared_intermediate=shared,
        sigmoid=False, topk_method="greedy", num_groups=0, topk_groups=0, renormalize=True,
        routed_scaling=1.0, correction_bias=True,
    )  # fmt: skip


def is_moe_layer(cfg: Any, layer: int) -> bool:
    end = cfg.moe_layer_end_index
    end = cfg.num_hidden_layers - 1 if end in (None, -1) else end
    interval = cfg.moe_layer_interval or 1
    return (layer + 1) % interval == 0 and cfg.moe_layer_start_index <= layer <= end


class Ernie4_5_MoeForCausalLM(LlamaFamilyForCausalLM):
    keep_fp32 = KEEP_FP32  # the router and its bias, as transformers keeps them

    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        if is_moe_layer(cfg, layer):
            return DeepseekMoe(cfg.hidden_size, ernie_routing(cfg), self.workspace)
        return MLP(cfg.hidden_size, cfg.intermediate_size, bool(cfg.use_bias), self.workspace)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The correction bias (`moe_statics`, `[1, E]`) as the router's `[E]`."""
    for name, tensor in weights:
        if name.endswith("moe_statics.e_score_correction_bias"):
            layer = name.split(".moe_statics.")[0].removesuffix(".gate")
            yield f"{layer}.gate.e_score_correction_bias", tensor.reshape(-1)
        else:
            yield name, tensor
