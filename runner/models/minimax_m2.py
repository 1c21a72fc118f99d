"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): the Llama family's layer with q/k RMSNorms over all
heads at once (OLMo 2's `qk_norm_whole`), RoPE over the first `rotary_dim` of each head,
and a sparse MoE on every layer routed as DeepSeek-V3 routes without groups: sigmoid
scores, an expert chosen by score + `e_score_correction_bias`, its weight the unbiased
score renormalised over the k chosen; no shared expert.

Checkpoints keep Mixtral's names (`block_sparse_moe`, `experts.N.w1/w3/w2`, which
runner/models/moe.py reads) with the correction bias beside the router; here it is the
router's, as in DeepSeek's MoE (runner/models/deepseek_moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pdserve.runner.models.deepseek_moe import KEEP_FP32, DeepseekMoe, DeepseekRouting
from pdserve.runner.models.llama import LlamaFamilyForCausalLM


def minimax_routing(cfg: Any) -> DeepseekRouting:
    return DeepseekRouting(
        num_experts=int(cfg.num_local_experts), top_k=int(cfg.num_experts_per_tok),
        intermediate=int(cfg.intermediate_size), shared_intermediate=0, sigmoid=True,
        topk_method="greedy", num_groups=0, topk_groups=0, renormalize=True,
        routed_scaling=1.0,
    )  # fmt: skip


class MiniMaxM2ForCausalLM(LlamaFamilyForCausalLM):
    keep_fp32 = KEEP_FP32  # the router and its bias, as transformers keeps them

    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        return DeepseekMoe(cfg.hidden_size, minimax_routing(cfg), self.workspace)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old in (".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias"):
            name = name.replace(old, ".mlp.gate.e_score_correction_bias")
        yield name, tensor
