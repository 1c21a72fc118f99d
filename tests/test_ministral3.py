"""Ministral 3 on mrv2 equals transformers: its queries are scaled by position (1 + beta *
log(1 + floor(pos / original length)), the "llama_4" scaling) on top of YaRN RoPE.

The tiny model's original length is 16 positions and its beta 0.5, so every query past
position 15 is scaled (by 1.35 at 16, 1.55 at 32): prompts of 40-90 tokens and 16 decoded
ones cross several steps of it. The multimodal checkpoints (Mistral3ForConditionalGeneration
with a ministral3 text config) run the same class (runner/models/text_only.py)."""

from __future__ import annotations

import pytest
from conftest import (
    _save_tiny,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
)

from pdserve.runner.models.text_only import text_view


def _config(**kw):
    from transformers import Ministral3Config

    return Ministral3Config(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_parameters={"type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "max_position_embeddings": 512,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                         "mscale": 1.0, "llama_4_scaling_beta": 0.5},
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["Ministral3ForCausalLM"], **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_ministral3_dir(tmp_path_factory) -> str:
    return _save_tiny(tmp_path_factory, "tiny-ministral3", _config())


def test_greedy_tokens_and_logprobs_match_transformers(tiny_ministral3_dir):
    assert_greedy_matches_hf(tiny_ministral3_dir, (5, 40, 90), 16, seed=4)
    assert_logprobs_match_hf(tiny_ministral3_dir, [(5 * i + 2) % 1000 + 3 for i in range(40)], 8)


def test_multimodal_checkpoint_picks_the_text_class_by_model_type():
    from transformers import Mistral3Config, MistralConfig

    for text, arch in (
        (_config(), "Ministral3ForCausalLM"),
        (MistralConfig(), "MistralForCausalLM"),
    ):
        outer = Mistral3Config(text_config=text.to_dict(),
                               architectures=["Mistral3ForConditionalGeneration"])  # fmt: skip
        view, of = text_view(outer)
        assert view.architectures == [arch] and of == "Mistral3ForConditionalGeneration"
