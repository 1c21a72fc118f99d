"""OLMo 2, OLMo 3 and EXAONE 4 on the paged KV cache, as members of the Llama family: their
layers normalise each branch's output instead of its input.

What differs from Llama, and where it is handled:
- `PostNormDecoderLayer`: attention and MLP read the residual stream as it is; their
  outputs pass an RMSNorm before joining it. No norm precedes a layer; the final norm
  stays.
- OLMo 2/3 normalise q and k over all heads at once (llama.FamilySpec `qk_norm_whole`,
  the unfused prepare path); EXAONE 4 per head, as Qwen3 does.
- OLMo 2/3 take their norms' product in float32 and round once (transformers'
  `(weight * x).to(dtype)`): their norm weights stay float32 in 16-bit models, the norm
  kernels' float32-weight path (kernels/norm.py). EXAONE 4 rounds as Llama does.
- OLMo 3 and EXAONE 4 interleave sliding-window layers (`layer_types`,
  runner/models/attention_window.py); OLMo 3 rotates its two layer types with their own
  RoPE (llama.py's per-type tables); EXAONE 4's full-attention layers rotate nothing
  when it has sliding ones (runner/models/rope.py `rope_free_layers`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.runner.models.llama import LlamaFamilyForCausalLM, RMSNorm


class PostNormDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, cos_sin, kv_cache, attn):
        """(branch output, residual) in and out, as llama.DecoderLayer: the residual
        stream is `x + residual`."""
        stream = x if residual is None else x + residual
        h = self.post_attention_layernorm(
            self.self_attn(stream, positions, cos_sin, kv_cache, attn)
        )
        stream = stream + h
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class PostNormForCausalLM(LlamaFamilyForCausalLM):
    norms_foldable = False  # the norms are on branch outputs, not before a projection

    def __init__(self, cfg: Any, max_positions: int):
        super().__init__(cfg, max_positions)
        # OLMo's norms round once, after a float32 product (see the module docstring)
        if cfg.model_type in ("olmo2", "olmo3"):
            self.keep_fp32 = ("norm.weight",)

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        return PostNormDecoderLayer(
            cfg, self._attention(cfg, layer), self._feed_forward(cfg, layer)
        )
