"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet layers (runner/models/gated_deltanet.py,
state per request unit, as the Mamba hybrids') and gated full-attention layers, as
`layer_types` lists them, each followed by an MoE of top-k SwiGLU experts with a gated
shared expert (runner/models/moe.py, Qwen2-MoE's form) or, in `mlp_only_layers`, a dense
SwiGLU MLP.

- Attention: q_proj gives each head's query and an output gate side by side; q/k norms
  per head; RoPE over the first `partial_rotary_factor` of each head; the attention
  output is multiplied by sigmoid(gate) before o_proj.
- Every RMSNorm outside the DeltaNet (layer, q/k and final norms) scales by 1 + weight:
  the weights are shifted by one at load, so the ordinary kernels apply them (as Gemma's).

What this path does not do: the hybrids' (runner/hybrid.py): no KV tier or layer-wise
tickets, prefix hits only at saved states; LoRA reaches its attention and dense MLPs, not
its experts or Gated DeltaNet projections (runner/lora/); the checkpoint's MTP layer
(speculative decoding's draft) is not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pdserve.kernels.skinny_linear import linear
from pdserve.runner.models import moe
from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.models.gated_deltanet import GatedDeltaNet
from pdserve.runner.models.llama import Attention, family_spec
from pdserve.runner.models.mamba_hybrid import HybridDecoderLayer, MambaHybridForCausalLM
from pdserve.runner.models.mlp import MLP


class GatedAttention(Attention):
    """llama.py's Attention with Qwen3-Next's per-head output gate in q_proj's rows."""

    def __init__(self, cfg: Any, workspace):
        super().__init__(cfg, family_spec(cfg), workspace)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                  bias=bool(getattr(cfg, "attention_bias", False)))  # fmt: skip

    def forward(self, x, positions, cos_sin, kv_cache, attn: AttentionMetadata):
        t = x.shape[0]
        projected = self.qkv_proj(x)
        if self.qkv_lora is not None:  # LoRA's q rows are the query and gate rows (lora/)
            projected = self.qkv_lora.apply(projected, x)
        query_gate, kv = projected.split([2 * self.q_size, 2 * self.kv_size], dim=-1)
        query_gate = query_gate.view(t, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate.split([self.head_dim, self.head_dim], dim=-1)
        qkv = torch.cat([q.reshape(t, self.q_size), kv], dim=-1)
        h = self.prepare_attend(qkv, positions, cos_sin, kv_cache, attn)
        h = h * torch.sigmoid(gate.reshape(t, self.q_size))
        out = linear(h, self.o_proj.weight, self.o_proj.bias, self.workspace)
        return out if self.o_lora is None else self.o_lora.apply(out, h)


class Qwen3NextForCausalLM(MambaHybridForCausalLM):
    _RENAMES = (
        (".linear_attn.", ".mamba."),
        (".post_attention_layernorm.", ".pre_ff_layernorm."),
        (".mlp.gate_proj.", ".feed_forward.gate_proj."),
        (".mlp.up_proj.", ".feed_forward.up_proj."),
        (".mlp.down_proj.", ".feed_forward.down_proj."),
    )

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        if layer in self._mamba_ids:
            mixer: nn.Module = GatedDeltaNet(cfg, self._mamba_ids.index(layer))
        else:
            mixer = GatedAttention(cfg, self.workspace)
        spec = moe.moe_spec(cfg)
        if moe.is_sparse_layer(cfg, spec, layer):
            experts = moe.SparseMoeBlock(cfg.hidden_size, spec, self.workspace)
            return HybridDecoderLayer(cfg, mixer, None, experts)
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size, False, self.workspace)
        return HybridDecoderLayer(cfg, mixer, mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As the hybrids', without the released checkpoints' multi-token-prediction layer
        (`mtp.*`, a draft head for speculative decoding, which this engine does not run)."""
        super().load_weights((n, t) for n, t in weights if not n.startswith("mtp."))

    def _shard_sizes(self, target: str, param: nn.Parameter) -> list[int]:
        if "qkv_proj" in target:  # the query rows carry the output gate
            attn = self._first_attention()
            return [2 * attn.q_size, attn.kv_size, attn.kv_size]
        return super()._shard_sizes(target, param)

    def _after_load(self) -> None:
        """The 1 + weight norms as plain ones (the module docstring)."""
        super()._after_load()
        norms = [self.norm]
        for layer in self.layers:
            norms += [layer.input_layernorm, layer.pre_ff_layernorm]
            if layer.has_attention:
                norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        with torch.no_grad():
            for norm in norms:
                norm.weight.add_(1.0)
