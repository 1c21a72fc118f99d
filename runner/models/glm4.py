"""GLM-4 dense models on the paged KV cache: `GlmForCausalLM` (GLM-4-9B-chat's transformers
export) as a Llama-family member, and `Glm4ForCausalLM` (GLM-4-9B/32B-0414, GLM-Z1) here.

Both rotate the first half of each head (`partial_rotary_factor` 0.5) on interleaved pairs,
which the load reorders into halves (llama.py `_interleaved_to_halves`), with q/k/v biases
and a fused gate/up projection in the checkpoint. GLM-4-0414's layer adds Gemma's sandwich
norms: the attention and MLP outputs are normalised before they join the stream
(gemma.GemmaDecoderLayer, whose four norms are GLM's under other names: `_NORMS`), with
plain RMSNorm weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pdserve.runner.models.gemma import GemmaDecoderLayer
from pdserve.runner.models.llama import LlamaFamilyForCausalLM

# GLM-4-0414's norm names -> GemmaDecoderLayer's (read as one mapping: GLM's
# post_attention_layernorm is the norm before the MLP, Gemma's the one after attention)
_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}


class Glm4ForCausalLM(LlamaFamilyForCausalLM):
    norms_foldable = False  # four norms a layer, two of them on branch outputs

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, self._attention(cfg, layer), self._feed_forward(cfg, layer))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _NORMS:
            parts[-2] = _NORMS[parts[-2]]
        yield ".".join(parts), tensor
