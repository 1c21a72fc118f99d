"""Cohere's Command R (`CohereForCausalLM`) and Command R7B / Command A
(`Cohere2ForCausalLM`) on the paged KV cache, as members of the Llama family.

What differs from Llama, and where it is handled:
- A parallel block: one norm, and attention and MLP both read it, their outputs joining
  the stream together (`ParallelDecoderLayer`). transformers adds attention first, then
  the MLP; so does the stream here.
- LayerNorm without a bias (`CohereLayerNorm`: the mean taken away, float32, rounded once;
  kernels/norm.py's LayerNorm form, with the residual add fused in front of it on a GPU),
  not RMSNorm: no folding (`norms_foldable`).
- RoPE on interleaved pairs (q/k rows reordered at load, llama.FamilySpec).
- Cohere 2's layers are three sliding-window ones (with RoPE) to one full-attention one
  with no RoPE (runner/models/rope.py `rope_free_layers`, attention_window.py).
- Logits times `logit_scale`.

- Command R+'s q/k LayerNorms (`use_qk_norm`): over each head, with a weight row per head
  (`[H, D]`), before RoPE; they run outside the fused prepare kernel
  (llama.Attention.qk_norm_heads), and their weights' columns follow the interleaved
  RoPE's reorder of the q/k rows at load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.kernels.norm import fused_add_layer_norm, layer_norm
from pdserve.runner.models.llama import LlamaFamilyForCausalLM, interleaved_order


class CohereLayerNorm(nn.Module):
    def __init__(self, size: int | tuple[int, int], eps: float):
        """`size` (H, D): a weight row per head, for x [..., H, D] (Command R+'s q/k)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm of x, or (the norm of x + residual, x + residual)."""
        if residual is None:
            return layer_norm(x, self.weight, self.eps)
        return fused_add_layer_norm(x, residual, self.weight, self.eps)


class ParallelDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x, residual, positions, cos_sin, kv_cache, attn):
        """(branch output, residual) in and out, as llama.DecoderLayer (the stream is
        `x + residual`): out goes the MLP's output beside stream + attention, so the next
        sum is transformers' (stream + attention) + MLP."""
        if residual is None:
            stream, h = x, self.input_layernorm(x)
        else:
            h, stream = self.input_layernorm(x, residual)
        return self.mlp(h), stream + self.self_attn(h, positions, cos_sin, kv_cache, attn)


class CohereForCausalLM(LlamaFamilyForCausalLM):
    norms_foldable = False  # LayerNorms (runner/models/norm_fold.py folds RMSNorms)

    def __init__(self, cfg: Any, max_positions: int):
        super().__init__(cfg, max_positions)
        self.logit_scale = float(cfg.logit_scale)

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        return ParallelDecoderLayer(
            cfg, self._attention(cfg, layer), self._feed_forward(cfg, layer)
        )

    def _attention(self, cfg: Any, layer: int) -> nn.Module:
        attn = super()._attention(cfg, layer)
        if getattr(cfg, "use_qk_norm", False):
            attn.q_norm = CohereLayerNorm((attn.num_heads, attn.head_dim), cfg.layer_norm_eps)
            attn.k_norm = CohereLayerNorm((attn.num_kv_heads, attn.head_dim), cfg.layer_norm_eps)
            attn.qk_norm_heads = True
        return attn

    def _after_load(self) -> None:
        """The q/k rows of each head are reordered for the halves RoPE (llama.py): so are
        the columns of the per-head q/k norm weights (the norm itself does not care)."""
        super()._after_load()
        for layer in self.layers:
            attn = layer.self_attn
            if attn.qk_norm_heads:
                order = interleaved_order(attn.head_dim, attn.rotary_dim).to(
                    attn.q_norm.weight.device
                )
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.data = norm.weight.data[:, order].contiguous()

    def _final_norm(self, cfg: Any) -> nn.Module:
        return CohereLayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, float32=False) * self.logit_scale
        return logits.float() if float32 else logits
