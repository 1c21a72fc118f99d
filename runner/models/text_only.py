"""Multimodal checkpoints served as text models: the language model inside Gemma 3
4B/12B/27B (Gemma3ForConditionalGeneration) runs as Gemma3ForCausalLM, Llama 4 Scout's
and Maverick's (Llama4ForConditionalGeneration) as Llama4ForCausalLM, Qwen2-VL's and
Qwen2.5-VL's as Qwen2ForCausalLM, Qwen3-VL's as Qwen3ForCausalLM and Qwen3-VL-MoE's as
Qwen3MoeForCausalLM (their multimodal
RoPE, fed a text token's one position on every axis, is the text model's RoPE), the one inside
Mistral Small 3.1/3.2 and Ministral 3 (Mistral3ForConditionalGeneration) as
MistralForCausalLM or Ministral3ForCausalLM, by its text config's model type.

`text_view` turns the checkpoint's config into its text config (with the top-level keys a
runner reads: token ids, dtype, quantization); `language_model_weights` renames the
language model's tensors as the text model names them and drops the vision tower's and
the projector's, which are never loaded. Requests carrying images are refused by the
router (chat content parts are text only), so nothing reaches the model that would have
needed the vision tower. The reference runner loads the whole checkpoint as transformers
does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pdserve.runner.config import architecture_of

# multimodal architecture -> the text model types its language model may be, and the
# causal-LM architecture of each
TEXT_ONLY = {
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Llama4ForConditionalGeneration": {"llama4_text": "Llama4ForCausalLM"},  # Scout, Maverick
    # Qwen2-VL, Qwen2.5-VL and Qwen3-VL: their multimodal RoPE gives a text token the same
    # position on all three axes, which is the plain RoPE of the text model they extend
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM"},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
    "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": "Qwen3ForCausalLM"},
    "Qwen3VLMoeForConditionalGeneration": {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
    "Mistral3ForConditionalGeneration": {
        "mistral": "MistralForCausalLM",  # Mistral Small 3.1, 3.2
        "ministral3": "Ministral3ForCausalLM",  # Ministral 3
    },
}
# checkpoint prefix -> the text model's: transformers 5 exports write language_model.model.*,
# others model.language_model.*
_RENAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_DROPPED = ("vision_tower.", "model.vision_tower.", "vision_model.", "model.vision_model.",
            "visual.", "model.visual.", "multi_modal_projector.",
            "model.multi_modal_projector.")  # fmt: skip
_INHERITED = ("eos_token_id", "bos_token_id", "pad_token_id", "dtype", "quantization_config")


def text_view(hf_config: Any) -> tuple[Any, str | None]:
    """(the config a runner runs, the multimodal architecture it came from or None)."""
    arch = architecture_of(hf_config)
    if arch not in TEXT_ONLY:
        return hf_config, None
    text = copy.deepcopy(hf_config.text_config)
    text_arch = TEXT_ONLY[arch].get(getattr(text, "model_type", ""))
    # an unknown language model keeps a name runner_select refuses by, not a wrong class
    text.architectures = [text_arch or f"{arch}[text_config {text.model_type}]"]
    for key in _INHERITED:
        outer = getattr(hf_config, key, None)
        if outer is not None and getattr(text, key, None) is None:
            setattr(text, key, outer)
    # transformers ties the head to the embeddings by the outer config's word
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    if arch == "Gemma3ForConditionalGeneration":
        # transformers' Gemma3ForConditionalGeneration never softcaps its logits, whatever
        # the text config says (released Gemma 3 configs set no cap, so the two agree)
        text.final_logit_softcapping = None
    return text, arch


def language_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under the text model's names."""
    for name, tensor in weights:
        if name.startswith(_DROPPED):
            continue
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor
