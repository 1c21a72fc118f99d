"""Command R (Cohere) and Command R7B / Command A (Cohere 2) on mrv2 (runner/models/
cohere.py) equal transformers: parallel attention and MLP on one LayerNorm, interleaved
RoPE, logits scaled. The tiny Cohere 2 has four layers, three sliding-window ones (a
window of 24 keys, so 40- and 90-token prompts slide) with RoPE and a full-attention one
without. Command R+'s form adds q/k LayerNorms with a weight row per head (random here:
transformers initialises them to ones, which would hide a weight applied to the wrong head
or left out of the interleaved RoPE's reorder)."""

from __future__ import annotations

import pytest
import torch
from conftest import _save_tiny, assert_greedy_matches_hf, assert_logprobs_match_hf

from pdserve.runner.models.cohere import CohereLayerNorm, ParallelDecoderLayer
from pdserve.runner.runner_select import mrv2_unsupported_features

COMMON = dict(
    vocab_size=1009, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, layer_norm_eps=1e-5,
    logit_scale=0.25, initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
)  # fmt: skip


def _cohere(**kw):
    from transformers import CohereConfig

    return CohereConfig(num_hidden_layers=2, architectures=["CohereForCausalLM"],
                        **(COMMON | kw))  # fmt: skip


def _cohere2():
    from transformers import Cohere2Config

    return Cohere2Config(num_hidden_layers=4, sliding_window=24, head_dim=16,
                         architectures=["Cohere2ForCausalLM"], **COMMON)  # fmt: skip


def _save_with_random_qk_norms(tmp_path_factory, config) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape))
    path = tmp_path_factory.mktemp("tiny-cohere-qk-norm")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["cohere", "cohere2", "cohere_qk_norm"])
def cohere_dir(request, tmp_path_factory) -> str:
    if request.param == "cohere_qk_norm":  # Command R+'s form
        return _save_with_random_qk_norms(tmp_path_factory, _cohere(use_qk_norm=True))
    config = _cohere() if request.param == "cohere" else _cohere2()
    return _save_tiny(tmp_path_factory, f"tiny-{request.param}", config)


def test_greedy_tokens_and_logprobs_match_transformers(cohere_dir):
    llm = assert_greedy_matches_hf(cohere_dir, (5, 40, 90), 16, seed=6)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0], ParallelDecoderLayer)
    assert isinstance(model.norm, CohereLayerNorm)
    if model.config.model_type == "cohere2":
        assert [layer.self_attn.window for layer in model.layers] == [24, 24, 24, 0]
        assert model.nope_layers == frozenset({3})
    qk_norm = getattr(model.config, "use_qk_norm", False)
    assert model.layers[0].self_attn.qk_norm_heads == qk_norm
    if qk_norm:
        assert model.layers[0].self_attn.q_norm.weight.shape == (4, 16)
    assert_logprobs_match_hf(cohere_dir, [(3 * i + 5) % 1000 + 3 for i in range(40)], 8)


def test_per_head_qk_layernorms_run_on_mrv2():
    assert mrv2_unsupported_features(_cohere(use_qk_norm=True)) == []
    assert mrv2_unsupported_features(_cohere()) == []
