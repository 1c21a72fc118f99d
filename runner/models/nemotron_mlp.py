"""NemotronH's feed-forward blocks (runner/models/mamba_hybrid.py): the relu^2 MLP (up,
then relu(.)^2, then down; no gate) and the MoE block of Nemotron 3 Nano (relu^2 experts
on kernels/moe.py's `RELU2`, DeepSeek-V3's grouped sigmoid router, a shared relu^2
expert, optional latent projections), and the stacking of its per-expert checkpoint
tensors at load."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.kernels.expert_act import RELU2
from pdserve.kernels.moe import moe_experts
from pdserve.kernels.skinny_linear import linear
from pdserve.runner.models.deepseek_moe import DeepseekRouting, Router

if TYPE_CHECKING:
    from pdserve.runner.lora.slots import LoraSite


class ReluSquaredMLP(nn.Module):
    """NemotronH's MLP: down(relu(up(x))^2), no gate. (`up`: the checkpoint's `up_proj`,
    renamed at load, as llama.py's loader fuses every `up_proj` with a gate.)"""

    def __init__(self, hidden: int, intermediate: int, bias: bool, workspace):
        super().__init__()
        self.workspace = workspace
        self.up = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.up_lora: LoraSite | None = None  # LoRA adapters' sites (runner/lora/slots.py)
        self.down_lora: LoraSite | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.up, self.down_proj
        u = linear(x, up.weight, up.bias, self.workspace)
        if self.up_lora is not None:
            u = self.up_lora.apply(u, x)
        h = torch.relu(u).square()
        y = linear(h, down.weight, down.bias, self.workspace)
        return y if self.down_lora is None else self.down_lora.apply(y, h)


def nemotron_routing(cfg: Any) -> DeepseekRouting:
    """NemotronH's router is DeepSeek-V3's: sigmoid scores plus a correction bias choose
    within the best `topk_group` of `n_group` groups, the unbiased scores weigh, optionally
    renormalised, times `routed_scaling_factor`."""
    return DeepseekRouting(
        num_experts=int(cfg.n_routed_experts), top_k=int(cfg.num_experts_per_tok),
        intermediate=int(cfg.moe_intermediate_size),
        shared_intermediate=int(cfg.moe_shared_expert_intermediate_size), sigmoid=True,
        topk_method="noaux_tc", num_groups=int(cfg.n_group), topk_groups=int(cfg.topk_group),
        renormalize=bool(cfg.norm_topk_prob), routed_scaling=float(cfg.routed_scaling_factor),
    )  # fmt: skip


class NemotronHMoe(nn.Module):
    """NemotronH's MoE block (Nemotron 3 Nano): routed experts of relu(up)^2, no gate
    (kernels/moe.py `RELU2`), optionally between a latent down- and up-projection
    (`moe_latent_size`), plus an always-on shared expert of the same kind."""

    def __init__(self, cfg: Any, workspace):
        super().__init__()
        routing = nemotron_routing(cfg)
        hidden, inter = cfg.hidden_size, routing.intermediate
        latent = getattr(cfg, "moe_latent_size", None)
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.fc1_latent_proj = nn.Linear(hidden, latent, bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, hidden, bias=bias) if latent else None
        width = latent or hidden
        self.gate = Router(hidden, routing)
        self.experts_up = nn.Parameter(torch.empty(routing.num_experts, inter, width))
        self.experts_down = nn.Parameter(torch.empty(routing.num_experts, width, inter))
        self.shared_experts = ReluSquaredMLP(hidden, routing.shared_intermediate, bias, workspace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = moe_experts(h, self.experts_up, self.experts_down, ids, weights, act=RELU2)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


# A released NemotronH checkpoint's expert tensor, one expert each (`backbone.` or `model.`)
_NEMOTRON_EXPERT = re.compile(r"^(.*layers\.\d+\.mixer\.)experts\.(\d+)\.(up|down)_proj\.weight$")
# transformers 5's stacked form
_NEMOTRON_STACKED = re.compile(r"^(.*layers\.\d+\.mixer\.)experts\.(up|down)_proj$")


def stacked_nemotron_experts(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """NemotronH's expert tensors as our stacked `mixer.experts_up` / `experts_down` (each
    yielded once all of a layer's experts have come); every other tensor as it is."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _NEMOTRON_EXPERT.match(name)
        if match is None:
            stacked = _NEMOTRON_STACKED.match(name)
            if stacked is not None:
                name = f"{stacked.group(1)}experts_{stacked.group(2)}"
            yield name, tensor
            continue
        key = f"{match.group(1)}experts_{match.group(3)}"
        expert = int(match.group(2))
        if expert >= num_experts:
            raise ValueError(f"checkpoint tensor {name!r} is for expert {expert}; the config "
                             f"has {num_experts}")  # fmt: skip
        experts = pending.setdefault(key, {})
        experts[expert] = tensor
        if len(experts) == num_experts:
            yield key, torch.stack([experts[e] for e in range(num_experts)])
            del pending[key]
    # A layer left incomplete stays unloaded: the loader names it as missing.
