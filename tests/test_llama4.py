"""Llama 4's language model on mrv2 (runner/models/llama4.py) equals transformers.

The tiny model has four layers: dense, MoE, dense, MoE (`interleave_moe_layer_step` 2),
RoPE on interleaved pairs with the weightless q/k norm and chunked attention (chunks of 32
positions, so prompts of 40 and 90 tokens cross one and two chunk edges, in prefill
chunks of 64 and in decode) on layers 0-2, and layer 3 NoPE with temperature tuning. Its `floor_scale` is 16 and `attn_scale` 0.5, so queries past
position 14 are scaled (1.35 from 15, 1.55 from 31): prompts of 5-90 tokens and 16 decoded
ones cross several steps of it. The MoE layers take one of four experts a token, its
sigmoid score scaling the expert's input, beside the shared expert."""

from __future__ import annotations

import pytest
import torch
from conftest import _save_tiny, assert_greedy_matches_hf, assert_logprobs_match_hf

from pdserve.runner.models.llama4 import Llama4ForCausalLM, Llama4Moe
from pdserve.runner.models.text_only import text_view


def _config(**kw):
    from transformers import Llama4TextConfig

    base = dict(
        vocab_size=1009, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        max_position_embeddings=128, attention_chunk_size=32, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=16, attn_scale=0.5, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["Llama4ForCausalLM"],
    )  # fmt: skip
    return Llama4TextConfig(**(base | kw))


@pytest.fixture(scope="module")
def tiny_llama4_dir(tmp_path_factory) -> str:
    return _save_tiny(tmp_path_factory, "tiny-llama4", _config())


def test_the_tiny_model_has_each_kind_of_layer():
    cfg = _config()
    assert cfg.moe_layers == [1, 3] and cfg.no_rope_layers == [1, 1, 1, 0]
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]


def test_greedy_tokens_and_logprobs_match_transformers(tiny_llama4_dir):
    llm = assert_greedy_matches_hf(tiny_llama4_dir, (5, 40, 90), 16, seed=4)
    model = llm.engine.runner.model
    assert isinstance(model.layers[1].mlp, Llama4Moe)
    assert model.layers[0].self_attn.q_norm is not None
    assert model.layers[3].self_attn.q_norm is None
    assert model.layers[3].self_attn.q_position_scale == (0.5, 16, 1)
    assert [layer.self_attn.window for layer in model.layers] == [-32, -32, -32, 0]
    # the NoPE layer's identity table is one row seen at every position (no second table)
    assert model.layer_cos_sin(3).stride(0) == 0 and model.layer_cos_sin(3).shape[0] == 129
    assert model.layer_cos_sin(3).dtype == model.layer_cos_sin(0).dtype == torch.float32
    assert_logprobs_match_hf(tiny_llama4_dir, [(5 * i + 2) % 1000 + 3 for i in range(40)], 8)


def test_more_than_one_expert_a_token_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok=2"):
        Llama4ForCausalLM(_config(num_experts_per_tok=2), 129)


def test_the_multimodal_checkpoint_runs_its_language_model():
    from transformers import Llama4Config

    outer = Llama4Config(text_config=_config().to_dict(),
                         architectures=["Llama4ForConditionalGeneration"])  # fmt: skip
    view, of = text_view(outer)
    assert view.architectures == ["Llama4ForCausalLM"] and of == "Llama4ForConditionalGeneration"


def test_expert_weights_load_transposed():
    """transformers stores the stacked experts [E, H, 2I] and [E, I, H]; ours are
    [E, 2I, H] and [E, H, I] with gate rows first."""
    cfg = _config()
    model = Llama4ForCausalLM(cfg, 129)
    g = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(p.shape, generator=g)
        for name, p in model.named_parameters()
        if "experts_" not in name
    }
    renamed = {}
    for name, t in tensors.items():
        hf = f"model.{name}".replace(".mlp.", ".feed_forward.").replace(".gate.", ".router.")
        renamed[hf.replace("model.lm_head", "lm_head")] = t
    gate_up = torch.randn(4, 64, 96, generator=g)
    down = torch.randn(4, 48, 64, generator=g)
    for layer in (1, 3):
        renamed[f"model.layers.{layer}.feed_forward.experts.gate_up_proj"] = gate_up
        renamed[f"model.layers.{layer}.feed_forward.experts.down_proj"] = down
    model.load_weights(renamed.items())
    moe = model.layers[3].mlp
    assert torch.equal(moe.experts_gate_up[2, :48], gate_up[2, :, :48].T)  # gate
    assert torch.equal(moe.experts_gate_up[2, 48:], gate_up[2, :, 48:].T)  # up
    assert torch.equal(moe.experts_down[1], down[1].T)


def test_the_identity_table_stays_float32_in_a_16_bit_model():
    """Every cos/sin table is float32, the one a NoPE layer reads too, though the model's
    `.to(bfloat16)` converted its buffer before `init_rope` (the loader's order)."""
    model = Llama4ForCausalLM(_config(), 129).to(torch.bfloat16)
    model.init_rope()
    assert model.layer_cos_sin(3).dtype == model.layer_cos_sin(0).dtype == torch.float32
    assert model.layer_cos_sin(3)[100].tolist() == [1.0] * 8 + [0.0] * 8
