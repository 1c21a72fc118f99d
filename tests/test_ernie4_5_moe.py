"""ERNIE 4.5 MoE on mrv2 (runner/models/ernie4_5_moe.py) equals transformers.

The tiny model has three layers, dense then MoE from `moe_layer_start_index` 1; eight
experts, two a token, chosen by softmax score plus a correction bias that is random here
(transformers initialises it to zero, which would hide one ignored or used to weigh),
weighed by the unbiased scores renormalised; two shared experts; interleaved RoPE."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_matches_hf, assert_logprobs_match_hf

from pdserve.runner.models.deepseek_moe import DeepseekMoe
from pdserve.runner.models.ernie4_5_moe import is_moe_layer


def _config(**kw):
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(**{**dict(
        vocab_size=1009, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_num_shared_experts=2,
        moe_layer_start_index=1, max_position_embeddings=512, rms_norm_eps=1e-5,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["Ernie4_5_MoeForCausalLM"],
    ), **kw})  # fmt: skip


@pytest.fixture(scope="module")
def tiny_ernie_moe_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("tiny-ernie-moe")
    model.save_pretrained(path)
    return str(path)


def test_moe_layers_follow_the_config():
    assert [is_moe_layer(_config(), i) for i in range(3)] == [False, True, True]
    cfg = _config(num_hidden_layers=6, moe_layer_interval=2, moe_layer_end_index=4)
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, True, False, False]


def test_greedy_tokens_and_logprobs_match_transformers(tiny_ernie_moe_dir):
    llm = assert_greedy_matches_hf(tiny_ernie_moe_dir, (5, 40, 90), 16, seed=9)
    model = llm.engine.runner.model
    moe = model.layers[1].mlp
    assert isinstance(moe, DeepseekMoe) and not isinstance(model.layers[0].mlp, DeepseekMoe)
    assert moe.gate.e_score_correction_bias.abs().sum() > 0  # the checkpoint's, loaded
    assert_logprobs_match_hf(tiny_ernie_moe_dir, [(13 * i + 2) % 1000 + 3 for i in range(40)], 8)
