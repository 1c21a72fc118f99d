"""MiniMax-M2 on mrv2 (runner/models/minimax_m2.py) equals transformers.

The tiny model: q/k norms over all heads at once, RoPE over half of each head
(`rotary_dim` 8 of 16, the released checkpoints' legacy field, with the factor it
means written out too: transformers releases before 5.2x ignore the legacy field, and
then neither side would rotate partially), and eight experts of
which two a token, chosen by sigmoid score plus a correction bias that is random here
(transformers initialises it to zero, which would hide a bias ignored or applied to the
weights), their unbiased scores renormalised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import DEVICE, assert_greedy_matches_hf, assert_logprobs_match_hf
from safetensors import safe_open

from pdserve import LLM


@pytest.fixture(scope="module")
def tiny_minimax_m2_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, MiniMaxM2Config

    cfg = MiniMaxM2Config(
        vocab_size=1009, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-6, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["MiniMaxM2ForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    path = tmp_path_factory.mktemp("tiny-minimax-m2")
    model.save_pretrained(path)
    return str(path)


def test_greedy_tokens_and_logprobs_match_transformers(tiny_minimax_m2_dir):
    llm = assert_greedy_matches_hf(tiny_minimax_m2_dir, (5, 40, 90), 16, seed=5)
    attn = llm.engine.runner.model.layers[0].self_attn
    assert attn.rotary_dim == 8 and attn.qk_norm_whole
    assert_logprobs_match_hf(tiny_minimax_m2_dir, [(3 * i + 1) % 1000 + 3 for i in range(40)], 8)


def test_the_correction_bias_is_loaded(tiny_minimax_m2_dir):
    """The checkpoint's bias (Mixtral-style names beside the router) reaches the router."""
    (file,) = Path(tiny_minimax_m2_dir).glob("*.safetensors")
    with safe_open(str(file), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 - safe_open is not a mapping
        name = next(n for n in names if n.endswith("e_score_correction_bias"))
        want = f.get_tensor(name)
    assert any(".experts.0.w1." in n for n in names), "Mixtral's expert names, as released"
    llm = LLM(model=tiny_minimax_m2_dir, device=DEVICE, dtype="float32")
    layer = int(name.split(".")[2])
    got = llm.engine.runner.model.layers[layer].mlp.gate.e_score_correction_bias
    assert torch.equal(got.cpu(), want) and want.abs().sum() > 0


def test_the_legacy_rotary_dim_is_read_without_a_factor():
    """A config that carries only `rotary_dim` (what an older transformers keeps of a
    released MiniMax-M2 config.json) still rotates that many dims of each head."""
    from transformers import PretrainedConfig

    from pdserve.runner.models.llama import rotary_dim_of

    legacy = PretrainedConfig(head_dim=16, hidden_size=64, num_attention_heads=4, rotary_dim=8)
    assert rotary_dim_of(legacy) == 8
    plain = PretrainedConfig(head_dim=16, hidden_size=64, num_attention_heads=4)
    assert rotary_dim_of(plain) == 16
