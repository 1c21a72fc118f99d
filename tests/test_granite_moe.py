"""Granite 3.x MoE on mrv2 (runner/models/granite_moe.py) equals transformers: Granite's
four multipliers (embeddings x12, residual branches x0.22, softmax scale 1/64, logits
/ 6) around top-k SwiGLU experts whose k largest router logits are softmaxed among
themselves. transformers 5 saves the stacked experts as released checkpoints hold them
(`block_sparse_moe.input_linear` / `output_linear`, `router.layer`), which is what loads
here."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import _save_tiny, assert_greedy_matches_hf, assert_logprobs_match_hf
from safetensors import safe_open

from pdserve.runner.models.moe import SparseMoeBlock


@pytest.fixture(scope="module")
def tiny_granite_moe_dir(tmp_path_factory) -> str:
    from transformers import GraniteMoeConfig

    cfg = GraniteMoeConfig(
        vocab_size=1039, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
        num_experts_per_tok=2, max_position_embeddings=512, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=1 / 64, logits_scaling=6.0,
        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        architectures=["GraniteMoeForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-granite-moe", cfg)


def test_greedy_tokens_and_logprobs_match_transformers(tiny_granite_moe_dir):
    (file,) = Path(tiny_granite_moe_dir).glob("*.safetensors")
    with safe_open(str(file), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 - safe_open is not a mapping
    assert any("block_sparse_moe" in n for n in names), names[:5]
    llm = assert_greedy_matches_hf(tiny_granite_moe_dir, (5, 40, 90), 16, seed=11)
    assert isinstance(llm.engine.runner.model.layers[0].mlp, SparseMoeBlock)
    assert_logprobs_match_hf(tiny_granite_moe_dir, [(19 * i + 1) % 1000 + 3 for i in range(40)], 8)
