"""Llama 4's language model (`Llama4ForCausalLM`; Scout and Maverick's, inside
`Llama4ForConditionalGeneration`, through runner/models/text_only.py).

The Llama family's layer with five differences, all config data:
- **Attention.** RoPE on interleaved pairs (q/k rows reordered at load, as ERNIE 4.5's)
  on three layers in four; every fourth (`no_rope_layers[i] == 0`) is NoPE. The RoPE
  layers normalise q and k per head with a weightless RMSNorm (`use_qk_norm`).
  transformers applies it after RoPE. A rotation keeps each pair's length, so the norm
  commutes with it, and here it runs before, in the fused q/k/v preparation, with unit
  weights. The NoPE layers scale each query by `1 + attn_scale * log(1 + floor((p + 1)
  / floor_scale))` (`attn_temperature_tuning`).
- **MoE.** `moe_layers` hold a router and `num_local_experts` SwiGLU experts beside an
  always-on shared expert; the other layers are dense MLPs of `intermediate_size_mlp`.
  The router takes the top-k logits through a sigmoid, and the score scales the
  expert's *input*, not its output. With k = 1 (every released model), the token is
  scaled first, then the expert runs at weight 1.
- **Experts' checkpoint layout.** `experts.gate_up_proj` is `[E, H, 2I]` and
  `experts.down_proj` is `[E, I, H]`: transposed into ours.

- **Chunked attention.** The RoPE layers (`layer_types` "chunked_attention") attend
  within blocks of `attention_chunk_size` (8,192) positions: a query at p sees keys
  `p - p % 8192..p` (runner/models/attention_window.py gives them a negative window, which
  every attention kernel reads so, kernels/attention.py); the NoPE layers see everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.moe import moe_experts
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.attention_window import sliding_window_of
from pdserve.runner.models.llama import Attention, LlamaFamilyForCausalLM, family_spec
from pdserve.runner.models.mlp import MLP
from pdserve.runner.models.rope import rope_free_layers


class Llama4Moe(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, inter: int, ws: KernelWorkspace):
        super().__init__()
        if top_k != 1:
            raise ValueError(
                f"Llama 4 with num_experts_per_tok={top_k}: its router scores scale each "
                "expert's input, implemented for one expert a token (every released model)"
            )
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter))
        self.shared_expert = MLP(hidden, inter, False, ws)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        top, ids = logits.max(dim=-1, keepdim=True)  # [T, 1]
        score = torch.sigmoid(top.float()).to(x.dtype)  # as transformers rounds it
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        out = moe_experts(x * score, self.experts_gate_up, self.experts_down, ids, ones)
        return out + self.shared_expert(x)


class Llama4ForCausalLM(LlamaFamilyForCausalLM):
    def _attention(self, cfg: Any, layer: int) -> nn.Module:
        rope = layer not in rope_free_layers(cfg)
        qk_norm = bool(getattr(cfg, "use_qk_norm", False)) and rope
        spec = dataclasses.replace(family_spec(cfg), qk_norm=qk_norm)
        attn = Attention(cfg, spec, self.workspace, sliding_window_of(cfg, layer))
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None:  # weightless: unit weights the checkpoint does not hold,
                del norm.weight  # set by _after_load (the loader builds on "meta")
                norm.register_buffer("weight", torch.ones(attn.head_dim), persistent=False)
        if not rope and getattr(cfg, "attn_temperature_tuning", False):
            attn.q_position_scale = (float(cfg.attn_scale), int(cfg.floor_scale), 1)
        return attn

    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        if layer in (cfg.moe_layers or ()):
            return Llama4Moe(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                             cfg.intermediate_size, self.workspace)  # fmt: skip
        return MLP(cfg.hidden_size, cfg.intermediate_size_mlp, False, self.workspace)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))

    def _after_load(self) -> None:
        super()._after_load()
        for layer in self.layers:  # the weightless q/k norms' units (built on "meta")
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                if norm is not None:
                    norm.weight.fill_(1.0)


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' Llama 4 names -> the Llama family's: `feed_forward` is `mlp`, the
    router is the MoE block's `gate`, and the stacked experts turn to `[E, out, in]`."""
    for name, tensor in weights:
        name = name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensor = tensor.transpose(1, 2)
        yield name, tensor
