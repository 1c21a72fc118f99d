"""Gemma, Gemma 2 and Gemma 3 (text: GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM)
on the paged KV cache, as members of the Llama family.

What differs from Llama, and where it is handled:
- Sandwich norms (Gemma 2 and 3): a layer normalises its attention output and its MLP
  output before each joins the residual stream (`GemmaDecoderLayer`), four RMSNorms a
  layer. Gemma (1) has Llama's two (`Gemma1ForCausalLM`), with everything else below
  that is not about Gemma 2 or 3.
- RMSNorm weights are stored as offsets from one (`x * (1 + w)`): one is added at load,
  in float32 (`keep_fp32`), so the norm kernels run unchanged (the q/k norms too) but
  for taking the product in float32 (kernels/norm.py).
- Gemma 3 normalises q and k per head (llama.FamilySpec); Gemma 2 does not.
- Embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype first as
  transformers does (55.4256 becomes 55.5 in bf16 at hidden 3,072).
- GeGLU: GELU(tanh) on the gate (runner/models/mlp.py, kernels/activation.py).
- The softmax scale is `query_pre_attn_scalar`^-0.5 (llama.Attention reads it).
- Local layers attend through a sliding window (runner/models/attention_window.py).
- Gemma 3 rotates local and global layers at their own RoPE bases, maybe linearly scaled
  (4B and up): one cos/sin table per layer type (llama.py's `layer_cos_sin`).
- Attention logit softcapping (Gemma 2: `cap * tanh(score / cap)` before the softmax) in
  the attention kernels (llama.Attention passes `attn_logit_softcapping`), and final logit
  softcapping here, when the config sets them.

Bidirectional attention (EmbeddingGemma) is refused by runner_select, so such configs run
on the reference runner; Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration)
are not in the registry.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.runner.models.llama import DecoderLayer, LlamaFamilyForCausalLM, RMSNorm


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x, residual, positions, cos_sin, kv_cache, attn):
        """(branch output, residual) in, as llama.DecoderLayer: the residual stream is
        `x + residual` (the fused add-norm adds the previous branch in)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, cos_sin, kv_cache, attn))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaFamilyForCausalLM):
    norms_foldable = False  # four norms a layer, two of them on branch outputs
    # `1 + w` in float32 (loader.py keeps these float32 in 16-bit models): in bf16 every
    # |w| under 2^-8 would round away; the norm kernels then take the product in float32
    # and round once, as transformers' Gemma RMSNorm does (kernels/norm.py)
    keep_fp32 = ("norm.weight",)

    def __init__(self, cfg: Any, max_positions: int):
        super().__init__(cfg, max_positions)
        self.final_logit_softcapping = float(getattr(cfg, "final_logit_softcapping", None) or 0)

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        attention, mlp = self._attention(cfg, layer), self._feed_forward(cfg, layer)
        return GemmaDecoderLayer(cfg, attention, mlp)

    def _after_load(self) -> None:
        """RMSNorm weights are offsets from one; the embedding scale is rounded to the
        model's dtype, as transformers rounds it."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data.add_(1.0)
        dtype = self.embed_tokens.weight.dtype
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=dtype)
        self.embedding_multiplier = float(scale)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, float32)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


class Gemma1ForCausalLM(GemmaForCausalLM):
    """The first Gemma: Llama's layer (a norm before attention, one before the MLP) with
    Gemma's `1 + w` norms, GeGLU and scaled embeddings."""

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        return DecoderLayer(cfg, self._attention(cfg, layer), self._feed_forward(cfg, layer))
