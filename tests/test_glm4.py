"""GLM-4 dense models on mrv2 equal transformers: GlmForCausalLM (GLM-4-9B-chat) and
Glm4ForCausalLM (GLM-4-0414, GLM-Z1: sandwich norms, runner/models/glm4.py). Both rotate
the first half of each head on interleaved pairs (partial_rotary_factor 0.5, reordered
into halves at load), with q/k/v biases and a fused gate/up projection. The norms' weights
are random, so GLM-4-0414's four norms, renamed at load, cannot trade places unseen."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_matches_hf, assert_logprobs_match_hf

from pdserve.runner.models.gemma import GemmaDecoderLayer

COMMON = dict(
    vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
)  # fmt: skip


@pytest.fixture(scope="module", params=["glm", "glm4"])
def glm_dir(request, tmp_path_factory) -> str:
    from transformers import Glm4Config, GlmConfig

    config = (
        GlmConfig(architectures=["GlmForCausalLM"], **COMMON)
        if request.param == "glm"
        else Glm4Config(architectures=["Glm4ForCausalLM"], **COMMON)
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms unlike each other (initialised to ones, swaps would hide)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model.save_pretrained(path)
    return str(path)


def test_greedy_tokens_and_logprobs_match_transformers(glm_dir):
    llm = assert_greedy_matches_hf(glm_dir, (5, 40, 90), 16, seed=8)
    model = llm.engine.runner.model
    attn = model.layers[0].self_attn
    assert attn.rotary_dim == 8 and attn.qkv_proj.bias is not None
    sandwich = model.config.model_type == "glm4"
    assert isinstance(model.layers[0], GemmaDecoderLayer) == sandwich
    assert_logprobs_match_hf(glm_dir, [(11 * i + 4) % 1000 + 3 for i in range(40)], 8)
