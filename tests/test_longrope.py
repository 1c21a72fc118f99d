"""LongRoPE (Phi-3.5, Phi-4-mini) on mrv2 equals transformers on each side of the trained
length (runner/models/rope.py chooses one factor set per engine, as vLLM does)."""

from __future__ import annotations

import pytest
from conftest import (
    _save_tiny,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
)


@pytest.fixture(scope="module")
def tiny_phi3_longrope_dir(tmp_path_factory) -> str:
    """Phi-4-mini's RoPE: longrope over 3/4 of each head, short and long factor sets (6
    each), trained at 32 positions and stretched to 128 (attention factor
    sqrt(1 + ln 4 / ln 32))."""
    from transformers import Phi3Config

    cfg = Phi3Config(
        vocab_size=1031, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]},
        sliding_window=None, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Phi3ForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-phi3-longrope", cfg)


@pytest.mark.parametrize(
    "max_model_len,prompt_lens,new_tokens",
    [(32, (3, 11, 20), 12), (128, (33, 50, 90), 16)],
    ids=["short-factors", "long-factors"],
)
def test_longrope_matches_transformers_on_its_side(
    tiny_phi3_longrope_dir, max_model_len, prompt_lens, new_tokens
):
    """LongRoPE's factor set is chosen once (runner/models/rope.py): the short set when
    max_model_len stays within the 32 trained positions, where transformers uses it too
    for every sequence that fits; the long set beyond, where transformers uses it for a
    sequence longer than 32 from its prompt on. Greedy tokens and logprobs match it on
    each side (a wrong factor set or attention factor changes both)."""
    assert_greedy_matches_hf(tiny_phi3_longrope_dir, prompt_lens, new_tokens, seed=5,
                             max_model_len=max_model_len)  # fmt: skip
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(prompt_lens[-1])]
    assert_logprobs_match_hf(tiny_phi3_longrope_dir, prompt, 6, max_model_len=max_model_len)
