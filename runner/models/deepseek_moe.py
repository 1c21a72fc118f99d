"""DeepSeek-V2/V3 MoE layers (GLM-4's MoE too): routed experts with group-limited routing,
plus shared experts.

Routing, as transformers computes it (the oracle the tests compare against):
- V2: softmax over the experts (router in float32); `greedy` takes the top k,
  `group_limited_greedy` first keeps the `topk_group` groups with the highest expert score;
  the k weights are not renormalised.
- V3 and GLM-4-MoE: sigmoid scores; an expert is chosen by score + `e_score_correction_bias`, among the
  `topk_group` groups whose two best biased scores sum highest; its weight is the unbiased
  score, renormalised when `norm_topk_prob`.
Both scale the weights by `routed_scaling_factor`. The routed experts run in
kernels/moe.py like any other MoE's; the `n_shared_experts` shared experts are one SwiGLU of
`n_shared_experts * moe_intermediate_size`, added ungated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.moe import moe_experts
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.mlp import MLP

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class DeepseekRouting:
    num_experts: int
    top_k: int
    intermediate: int  # per routed expert
    shared_intermediate: int  # all shared experts as one MLP; 0 = none
    sigmoid: bool  # V3's sigmoid scores (V2: softmax)
    topk_method: str
    num_groups: int
    topk_groups: int
    renormalize: bool
    routed_scaling: float
    # an `e_score_correction_bias` added to the scores to choose (not to weigh): V3's, and
    # ERNIE 4.5's on softmax scores (runner/models/ernie4_5_moe.py); default: sigmoid's
    correction_bias: bool | None = None

    @property
    def biased(self) -> bool:
        return self.sigmoid if self.correction_bias is None else self.correction_bias

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}"
            )
        if self.grouped and not (
            self.num_groups > 0
            and self.num_experts % self.num_groups == 0
            and 0 < self.topk_groups <= self.num_groups
        ):
            raise ValueError(
                f"{self.topk_method} needs n_group dividing the {self.num_experts} experts and "
                f"1 <= topk_group <= n_group (got n_group={self.num_groups}, "
                f"topk_group={self.topk_groups})"
            )

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy"


def deepseek_routing(cfg: Any) -> DeepseekRouting:
    v3 = cfg.model_type in ("deepseek_v3", "glm4_moe")  # GLM-4's MoE routes as V3 does
    return DeepseekRouting(
        num_experts=int(cfg.n_routed_experts),
        top_k=int(cfg.num_experts_per_tok),
        intermediate=int(cfg.moe_intermediate_size),
        shared_intermediate=int(cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)),
        sigmoid=v3,
        topk_method="noaux_tc" if v3 else str(cfg.topk_method or "greedy"),
        num_groups=int(cfg.n_group or 0),
        topk_groups=int(cfg.topk_group or 0),
        renormalize=bool(cfg.norm_topk_prob) if v3 else False,
        routed_scaling=float(cfg.routed_scaling_factor),
    )


class Router(nn.Module):
    def __init__(self, hidden: int, routing: DeepseekRouting):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden))
        bias = torch.empty(routing.num_experts) if routing.biased else None
        self.e_score_correction_bias = None if bias is None else nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        r = self.routing
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if r.sigmoid else logits.softmax(dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if r.grouped:
            groups = choice.view(x.shape[0], r.num_groups, -1)
            if r.topk_method == "noaux_tc":
                group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = groups.amax(dim=-1)
            kept = group_scores.topk(r.topk_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            keep = keep.unsqueeze(-1).expand_as(groups).reshape_as(choice)
            choice = choice.masked_fill(~keep, float("-inf") if r.sigmoid else 0.0)
        ids = choice.topk(r.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if r.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * r.routed_scaling, ids


# What a model with these MoE layers keeps in float32 (runner/models/loader.py).
KEEP_FP32 = (".gate.weight", ".gate.e_score_correction_bias")


class DeepseekMoe(nn.Module):
    def __init__(self, hidden: int, routing: DeepseekRouting, workspace: KernelWorkspace):
        super().__init__()
        self.gate = Router(hidden, routing)
        experts, inter = routing.num_experts, routing.intermediate
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter))
        shared = routing.shared_intermediate
        self.shared_experts = MLP(hidden, shared, False, workspace) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = moe_experts(x, self.experts_gate_up, self.experts_down, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
