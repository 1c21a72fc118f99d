"""Arcee's AFM (runner/models/arcee.py) on mrv2 equals transformers: a Llama whose MLP is
down(relu(up(x))^2), no gate, under YaRN RoPE (factor 4 past 128 original positions, so
the 90-token prompts and their decode sit in the scaled range's frequencies)."""

from __future__ import annotations

import pytest
from conftest import _save_tiny, assert_greedy_matches_hf, assert_logprobs_match_hf

from pdserve.runner.models.nemotron_mlp import ReluSquaredMLP
from pdserve.runner.runner_select import mrv2_unsupported_features


def _config(**kw):
    from transformers import ArceeConfig

    base = dict(
        vocab_size=1009, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128},
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["ArceeForCausalLM"],
    )  # fmt: skip
    return ArceeConfig(**(base | kw))


@pytest.fixture(scope="module")
def tiny_arcee_dir(tmp_path_factory) -> str:
    return _save_tiny(tmp_path_factory, "tiny-arcee", _config())


def test_greedy_tokens_and_logprobs_match_transformers(tiny_arcee_dir):
    llm = assert_greedy_matches_hf(tiny_arcee_dir, (5, 40, 90), 16, seed=14)
    assert isinstance(llm.engine.runner.model.layers[0].mlp, ReluSquaredMLP)
    assert_logprobs_match_hf(tiny_arcee_dir, [(5 * i + 9) % 1000 + 3 for i in range(40)], 8)


def test_only_its_own_activation_is_taken():
    assert mrv2_unsupported_features(_config()) == []
    assert any(
        "hidden_act 'silu'" in p for p in mrv2_unsupported_features(_config(hidden_act="silu"))
    )
