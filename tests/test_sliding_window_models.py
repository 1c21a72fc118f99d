"""Sliding-window models on mrv2 equal transformers: greedy tokens and their logprobs.

Tiny random models whose windows (5-9 keys) are far shorter than the prompts (up to 100
tokens, prefilled in 64-token chunks, so a chunk attends through a cached prefix) and the
24 decoded tokens: a runner that ignored the window, or misplaced its edge by one key,
attends to different keys from the sixth token on. Each family takes its windows from the
config the way transformers does (runner/models/attention_window.py): Mistral and Phi-3
on every layer, Qwen2 and Ministral only on the layers `layer_types` names (here layer 1
of 2).
"""

from __future__ import annotations

import pytest
from conftest import (
    _save_tiny,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
)

from pdserve.runner.models.attention_window import windowed_layers


@pytest.fixture(scope="module")
def tiny_mistral_window_dir(tmp_path_factory) -> str:
    """Mistral v0.1's shape of config: a window on every layer; 4 q / 2 kv heads of 16."""
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=6, tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, architectures=["MistralForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-mistral-window", cfg)


@pytest.fixture(scope="module")
def tiny_qwen2_window_dir(tmp_path_factory) -> str:
    """Qwen2 with `use_sliding_window`: layers from `max_window_layers` (1) on slide."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=5, max_window_layers=1,
        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        architectures=["Qwen2ForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-qwen2-window", cfg)


@pytest.fixture(scope="module")
def tiny_phi3_window_dir(tmp_path_factory) -> str:
    """Phi-3-mini's shape of config (a window on every layer, as its 2,047) with RoPE over
    3/4 of each head, so the window also runs through the partial-RoPE prepare path."""
    from transformers import Phi3Config

    cfg = Phi3Config(
        vocab_size=1031, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75},
        sliding_window=9, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Phi3ForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-phi3-window", cfg)


@pytest.fixture(scope="module")
def tiny_ministral_window_dir(tmp_path_factory) -> str:
    """Ministral 8B's shape of config: windowed and full layers interleaved by
    `layer_types`."""
    from transformers import MinistralConfig

    cfg = MinistralConfig(
        vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, sliding_window=5,
        layer_types=["full_attention", "sliding_attention"], tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        architectures=["MinistralForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-ministral-window", cfg)


FIXTURES = ["tiny_mistral_window_dir", "tiny_qwen2_window_dir", "tiny_phi3_window_dir",
            "tiny_ministral_window_dir"]  # fmt: skip
WINDOWS = {
    "tiny_ministral_window_dir": [0, 5],
    "tiny_mistral_window_dir": [6, 6],
    "tiny_qwen2_window_dir": [0, 5],
    "tiny_phi3_window_dir": [9, 9],
}


@pytest.mark.parametrize("fixture", FIXTURES)
def test_windows_are_read_as_transformers_does(fixture, request):
    """Guards the per-layer rule itself (a Qwen2 config windows only its upper layers)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(request.getfixturevalue(fixture))
    assert windowed_layers(cfg) == WINDOWS[fixture]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_greedy_tokens_match_transformers(fixture, request):
    """Prefill chunks on a cached prefix, fresh prompts and decode rows, all windowed."""
    assert_greedy_matches_hf(request.getfixturevalue(fixture), (1, 5, 17, 33, 64, 100), 24)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_logprobs_match_transformers(fixture, request):
    """Logprobs (conftest.assert_logprobs_match_hf) over a 30-token prompt and 8 decoded
    tokens, past every window."""
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(30)]
    assert_logprobs_match_hf(request.getfixturevalue(fixture), prompt, 8, block_size=16)
