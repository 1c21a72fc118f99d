"""GLM-4.5/4.6-style MoE models (`Glm4MoeForCausalLM`): the Llama family's attention with
q/k/v bias, optional per-head q/k norm and RoPE over the first half of each head
(`partial_rotary_factor`), and DeepSeek-V3's MoE (sigmoid routing with a correction bias,
shared experts) from `first_k_dense_replace` on.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.runner.models.deepseek_moe import KEEP_FP32, DeepseekMoe, deepseek_routing
from pdserve.runner.models.llama import LlamaFamilyForCausalLM
from pdserve.runner.models.mlp import MLP


class Glm4MoeForCausalLM(LlamaFamilyForCausalLM):
    keep_fp32 = KEEP_FP32

    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        if cfg.n_routed_experts and layer >= cfg.first_k_dense_replace:
            return DeepseekMoe(cfg.hidden_size, deepseek_routing(cfg), self.workspace)
        return MLP(cfg.hidden_size, cfg.intermediate_size, False, self.workspace)
