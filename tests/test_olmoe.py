"""OLMoE on mrv2 equals transformers: q/k RMSNorms over all heads at once (OLMo 2's), and
every layer an MoE of softmax top-k experts, not renormalised (`norm_topk_prob` False,
its default) and renormalised. A `clip_qkv` config is named unsupported."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_matches_hf, assert_logprobs_match_hf

from pdserve.runner.models.moe import SparseMoeBlock
from pdserve.runner.runner_select import mrv2_unsupported_features


def _config(**kw):
    from transformers import OlmoeConfig

    return OlmoeConfig(**{**dict(
        vocab_size=1009, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["OlmoeForCausalLM"],
    ), **kw})  # fmt: skip


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "renormalised"])
def tiny_olmoe_dir(request, tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_config(norm_topk_prob=request.param))
    with torch.no_grad():  # q/k norm weights unlike each other (ones at init)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny-olmoe")
    model.save_pretrained(path)
    return str(path)


def test_greedy_tokens_and_logprobs_match_transformers(tiny_olmoe_dir):
    llm = assert_greedy_matches_hf(tiny_olmoe_dir, (5, 40, 90), 16, seed=10)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].mlp, SparseMoeBlock)
    assert model.layers[0].self_attn.qk_norm_whole
    assert_logprobs_match_hf(tiny_olmoe_dir, [(17 * i + 6) % 1000 + 3 for i in range(40)], 8)


def test_clip_qkv_is_named_unsupported():
    assert any("clip_qkv" in p for p in mrv2_unsupported_features(_config(clip_qkv=8.0)))
    assert mrv2_unsupported_features(_config()) == []
