"""Llama-shaped families that differ in a detail, on mrv2, equal to transformers (greedy
tokens and logprobs): Seed-OSS (a bias on q/k/v and, separately, on o) and ERNIE 4.5
(biases everywhere, RoPE on interleaved pairs: its q/k rows are reordered at load,
llama.py `_interleaved_to_halves`; a missed reorder changes every rotated score)."""

from __future__ import annotations

import pytest
from conftest import _save_tiny, assert_greedy_matches_hf, assert_logprobs_match_hf

COMMON = dict(
    vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip


def _config(name: str):
    from transformers import Ernie4_5Config, SeedOssConfig

    if name == "seed_oss":
        return SeedOssConfig(attention_bias=True, attention_out_bias=True,
                             architectures=["SeedOssForCausalLM"], **COMMON)  # fmt: skip
    return Ernie4_5Config(use_bias=True, architectures=["Ernie4_5ForCausalLM"], **COMMON)


@pytest.fixture(scope="module", params=["seed_oss", "ernie4_5"])
def model_dir(request, tmp_path_factory) -> str:
    from conftest import _randomize_tensors

    path = _save_tiny(tmp_path_factory, f"tiny-{request.param}", _config(request.param))
    _randomize_tensors(path, "bias", scale=0.3)  # zeros at init: make the biases count
    return path


def test_greedy_tokens_and_logprobs_match_transformers(model_dir):
    assert_greedy_matches_hf(model_dir, (1, 9, 40, 90), 16, seed=12)
    assert_logprobs_match_hf(model_dir, [(9 * i + 4) % 1000 + 3 for i in range(25)], 8)
