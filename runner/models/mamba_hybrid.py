"""Hybrids of Mamba and attention layers, as members of the Llama family: Bamba
(BambaForCausalLM), Granite 4.0-H (GraniteMoeHybridForCausalLM) and NemotronH
(NemotronHForCausalLM), dense or with experts, on Mamba2; Jamba (JambaForCausalLM) on
Mamba1.

Each decoder layer normalises its input, mixes tokens with either a Mamba mixer
(runner/models/mamba2.py or mamba1.py, state per request unit) or llama.py's Attention, adds the
residual, then normalises again into a SwiGLU MLP. Only the attention layers have paged
KV: the cache holds `num_kv_layers` layers, and attention layer j reads the j-th.

- Bamba: RoPE over the first half of each head (the config's partial_rotary_factor
  0.5); the checkpoint names the MLP `feed_forward`, its norm `pre_ff_layernorm` and the
  final norm `final_layernorm`.
- Granite 4.0-H: Granite's scalars (embedding, attention, residual and logits
  multipliers; the residual one folded into each branch's output projection at load, the
  Mamba mixer's `out_proj` included); attention without RoPE unless
  `position_embedding_type` is "rope"; the MLP is `shared_mlp` (`input_linear`: gate and
  up, fused; `output_linear`); its MoE forms (`num_local_experts` > 0) add top-k SwiGLU
  experts (runner/models/moe.py) to the shared MLP.
- Jamba: Mamba1 mixers (a per-channel scan with dt/B/C norms), attention without any
  positional embedding, every `expert_layer_period`-th feed-forward an MoE without
  renormalisation and without a shared MLP.
- NemotronH: blocks of one mixer each (`HybridBlock`: norm, then Mamba2, attention
  without RoPE, a ReLU^2 MLP or an MoE of ReLU^2 experts: runner/models/nemotron_mlp.py),
  as `layers_block_type` lists them.

Qwen3-Next's Gated DeltaNet layers use the same state units (runner/models/qwen3_next.py).

What this path does not do (refused or switched off by name, runner/hybrid.py): the KV
tier (its blocks come without states), layer-wise early tickets and norm folding; prefix
caching reaches only the block boundaries where a state was saved
(runner/state_snapshots.py). PD moves the prompt's final state with its
blocks; decode steps run in the CUDA graphs (runner/mrv2/mamba_state.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pdserve.runner.models import moe
from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.models.deepseek_moe import KEEP_FP32
from pdserve.runner.models.gated_deltanet import GatedDeltaNet
from pdserve.runner.models.llama import Attention, LlamaFamilyForCausalLM, RMSNorm, family_spec
from pdserve.runner.models.mamba1 import Mamba1Mixer
from pdserve.runner.models.mamba2 import Mamba2Mixer, MambaStep
from pdserve.runner.models.mlp import MLP
from pdserve.runner.models.nemotron_mlp import (
    NemotronHMoe,
    ReluSquaredMLP,
    stacked_nemotron_experts,
)

HYBRID_TYPES = ("bamba", "granitemoehybrid", "nemotron_h", "jamba", "qwen3_next")


def mamba_layers(cfg: Any) -> list[int]:
    """Indices of a hybrid config's Mamba layers (its `layers_block_type`), or Qwen3-Next's
    Gated DeltaNet layers (`linear_attention`), which keep state units the same way."""
    if getattr(cfg, "model_type", "") not in HYBRID_TYPES:
        return []
    types = getattr(cfg, "layers_block_type", None) or getattr(cfg, "layer_types", None) or []
    return [i for i, t in enumerate(types) if t in ("mamba", "linear_attention")]


class HybridDecoderLayer(nn.Module):
    """Norm, token mixer (Mamba2, Mamba1 or attention), norm, MLP (Bamba, Granite 4.0-H,
    Jamba); with `experts` (Granite 4.0-H's MoE forms) the MLP is the shared one, added to
    the experts' output, or absent (Jamba's MoE layers). The experts are `mlp`, the name
    llama.py's expert loader fills."""

    def __init__(
        self, cfg: Any, mixer: nn.Module, mlp: nn.Module | None, experts: nn.Module | None = None
    ):
        super().__init__()
        self.mlp = experts
        self.is_mamba = isinstance(mixer, Mamba2Mixer | Mamba1Mixer | GatedDeltaNet)
        self.has_attention = not self.is_mamba
        if self.is_mamba:
            self.mamba = mixer
        else:
            self.self_attn = mixer
        self.feed_forward = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, cos_sin, kv_cache, attn, mamba):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.is_mamba:
            x = self.mamba(x, *mamba)
        else:
            x = self.self_attn(x, positions, cos_sin, kv_cache, attn)
        x, residual = self.pre_ff_layernorm(x, residual)
        if self.mlp is None:
            return self.feed_forward(x), residual
        if self.feed_forward is None:  # Jamba's MoE layers: the experts alone
            return self.mlp(x), residual
        return self.mlp(x) + self.feed_forward(x), residual


class HybridBlock(nn.Module):
    """NemotronH's block: norm, then one mixer (Mamba2, attention or an MLP), as the
    checkpoint names them (`norm`, `mixer`)."""

    def __init__(self, cfg: Any, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self.is_mamba = isinstance(mixer, Mamba2Mixer)
        self.has_attention = isinstance(mixer, Attention)
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)

    @property
    def mamba(self) -> nn.Module:
        return self.mixer

    @property
    def self_attn(self) -> nn.Module:
        return self.mixer

    def forward(self, x, residual, positions, cos_sin, kv_cache, attn, mamba):
        if residual is None:
            residual, x = x, self.norm(x)
        else:
            x, residual = self.norm(x, residual)
        if self.is_mamba:
            return self.mixer(x, *mamba), residual
        if self.has_attention:
            return self.mixer(x, positions, cos_sin, kv_cache, attn), residual
        return self.mixer(x), residual


class MambaHybridForCausalLM(LlamaFamilyForCausalLM):
    norms_foldable = False  # the folded chain is Attention's, not the mixer's
    # checkpoint name fragment -> ours (Bamba's; Granite 4.0-H's below)
    _RENAMES: tuple[tuple[str, str], ...] = (("model.final_layernorm.", "model.norm."),)

    def __init__(self, cfg: Any, max_positions: int):
        self._mamba_ids = mamba_layers(cfg)
        super().__init__(cfg, max_positions)
        self.attention_layers = [i for i, layer in enumerate(self.layers) if layer.has_attention]
        # Set by runner/mrv2/mamba_state.py: the state tensors, and each step's rows
        self.mamba_states: tuple[torch.Tensor, torch.Tensor] | None = None
        self.mamba_step: MambaStep | None = None

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        if layer in self._mamba_ids:
            mixer: nn.Module = Mamba2Mixer(cfg, self._mamba_ids.index(layer))
        else:
            mixer = Attention(cfg, family_spec(cfg), self.workspace)
        bias = bool(getattr(cfg, "mlp_bias", False))
        mlp = MLP(cfg.hidden_size, self._mlp_width(cfg), bias, self.workspace)
        spec = moe.moe_spec(cfg)
        experts = moe.SparseMoeBlock(cfg.hidden_size, spec, self.workspace) if spec else None
        return HybridDecoderLayer(cfg, mixer, mlp, experts)

    def _mlp_width(self, cfg: Any) -> int:
        return cfg.intermediate_size

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def num_mamba_layers(self) -> int:
        return len(self._mamba_ids)

    @property
    def mamba_state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's conv and SSM state shapes in one Mamba layer (mamba_state.py)."""
        return self.layers[self._mamba_ids[0]].mamba.state_shapes

    def _first_attention(self) -> nn.Module:
        return self.layers[self.attention_layers[0]].self_attn

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """As llama's, over `num_kv_layers` caches (attention layers only)."""
        assert self.mamba_states is not None and self.mamba_step is not None, (
            "a hybrid step needs its Mamba state (runner/mrv2/mamba_state.py)"
        )
        conv, ssm = self.mamba_states
        x, residual = self.embed(input_ids), None
        kv_index = 0
        for i, layer in enumerate(self.layers):
            cache = None
            mamba = None
            if layer.is_mamba:
                j = layer.mamba.state_index
                mamba = (self.mamba_step, conv[j], ssm[j])
            elif layer.has_attention:
                cache = kv_caches[kv_index]
                kv_index += 1
            x, residual = layer(x, residual, positions, self.layer_cos_sin(i), cache, attn, mamba)
            if layer_hook is not None:
                layer_hook(i)
        return x + residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As llama's, after the family's renames."""

        def renamed(name: str) -> str:
            for theirs, ours in self._RENAMES:
                name = name.replace(theirs, ours)
            return name

        super().load_weights((renamed(name), t) for name, t in weights)

    def _after_load(self) -> None:
        """Granite's residual multiplier into each branch's output projection (the mixer's
        and the MLP's), whose outputs it scales."""
        if self.residual_multiplier == 1.0:
            return
        for layer in self.layers:  # Granite 4.0-H (Bamba and NemotronH keep 1.0)
            mixer_out = layer.mamba.out_proj if layer.is_mamba else layer.self_attn.o_proj
            for linear_layer in (mixer_out, layer.feed_forward.down_proj):
                linear_layer.weight.mul_(self.residual_multiplier)
                if linear_layer.bias is not None:
                    linear_layer.bias.mul_(self.residual_multiplier)
            if layer.mlp is not None:  # the experts' down projections, as the shared one's
                layer.mlp.experts_down.mul_(self.residual_multiplier)


class BambaForCausalLM(MambaHybridForCausalLM):
    pass


class GraniteHybridForCausalLM(MambaHybridForCausalLM):
    """Granite 4.0-H, dense (H-Micro) or with experts (H-Tiny, H-Small: top-k of
    `num_local_experts`, SwiGLU, beside the shared MLP). Released checkpoints store the
    experts as `block_sparse_moe.input_linear` / `output_linear` and the router as
    `router.layer`; transformers 5 as `experts.gate_up_proj` / `down_proj` and
    `router.weight`: both load."""

    _RENAMES = (
        (".shared_mlp.input_linear.", ".feed_forward.gate_up_proj."),
        (".shared_mlp.output_linear.", ".feed_forward.down_proj."),
        (".post_attention_layernorm.", ".pre_ff_layernorm."),
        (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
        (".block_sparse_moe.router.layer.", ".mlp.gate."),
        (".block_sparse_moe.router.weight", ".mlp.gate.weight"),
        (".block_sparse_moe.experts.", ".mlp.experts."),
    )

    def _mlp_width(self, cfg: Any) -> int:
        return cfg.shared_intermediate_size


class NemotronHForCausalLM(MambaHybridForCausalLM):
    """NemotronH (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): blocks of one mixer each,
    Mamba2, attention without RoPE, a ReLU^2 MLP or an MoE of ReLU^2 experts
    (`layers_block_type`). Real checkpoints name the base model `backbone` and store the
    experts one by one."""

    _RENAMES = (
        ("backbone.", "model."),
        ("model.embeddings.", "model.embed_tokens."),
        ("model.norm_f.", "model.norm."),
        (".mixer.up_proj.", ".mixer.up."),
        (".mixer.shared_experts.up_proj.", ".mixer.shared_experts.up."),
    )
    keep_fp32 = KEEP_FP32  # the router and its correction bias, as transformers keeps them

    def __init__(self, cfg: Any, max_positions: int):
        if getattr(cfg, "rms_norm_eps", None) is None:  # the Llama family's name for it
            cfg.rms_norm_eps = cfg.layer_norm_epsilon
        super().__init__(cfg, max_positions)

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        kind = cfg.layers_block_type[layer]
        if layer in self._mamba_ids:
            return HybridBlock(cfg, Mamba2Mixer(cfg, self._mamba_ids.index(layer)))
        if kind in ("attention", "full_attention"):
            return HybridBlock(cfg, Attention(cfg, family_spec(cfg), self.workspace))
        if kind == "moe":
            return HybridBlock(cfg, NemotronHMoe(cfg, self.workspace))
        assert kind == "mlp", f"NemotronH block type {kind!r}"
        bias = bool(getattr(cfg, "mlp_bias", False))
        mlp = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, bias, self.workspace)
        return HybridBlock(cfg, mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As the hybrids', the experts stacked first."""
        experts = int(getattr(self.config, "n_routed_experts", 0) or 0)
        super().load_weights(stacked_nemotron_experts(weights, experts) if experts else weights)


class JambaForCausalLM(MambaHybridForCausalLM):
    """Jamba: Mamba (Mamba1, runner/models/mamba1.py) and attention layers (every
    `attn_layer_period`-th from `attn_layer_offset`), attention without any positional
    embedding, and every `expert_layer_period`-th feed-forward an MoE (softmax over all
    experts, the top k not renormalised; Mixtral-style SwiGLU experts)."""

    _RENAMES = (
        ("model.final_layernorm.", "model.norm."),
        (".feed_forward.router.", ".mlp.gate."),
        (".feed_forward.experts.", ".mlp.experts."),
    )

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        if layer in self._mamba_ids:
            mixer: nn.Module = Mamba1Mixer(cfg, self._mamba_ids.index(layer))
        else:
            mixer = Attention(cfg, family_spec(cfg), self.workspace)
        if cfg.layers_num_experts[layer] > 1:
            experts = moe.SparseMoeBlock(cfg.hidden_size, moe.moe_spec(cfg), self.workspace)
            return HybridDecoderLayer(cfg, mixer, None, experts)
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size, False, self.workspace)
        return HybridDecoderLayer(cfg, mixer, mlp)
