"""Gemma 2 and Gemma 3 (text) on mrv2 equal transformers: greedy tokens and their logprobs.

The tiny model has what sets Gemma 3 apart (runner/models/gemma.py): sandwich norms with
weights stored as offsets from one (randomised here: at init they are all zero, which
would hide a missing `1 +`), q/k norms, GeGLU, sqrt(hidden) embeddings, a softmax scale
from `query_pre_attn_scalar` (20, not the head dim 32), local layers with a 5-key window
at RoPE base 10,000 and a global layer at base 1,000,000 scaled linearly by 2 (two cos/sin
tables), tied embeddings and a final logit softcap. The tiny Gemma 2 adds attention
logit softcapping (cap 1.5, with scores scaled up to reach it) on alternating local and
global layers. Prompts run past the window, in 64-token chunks on a cached prefix, and
decode 24 tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DEVICE,
    _randomize_tensors,
    _save_tiny,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
)

from pdserve import LLM, SamplingParams
from pdserve.runner.models.attention_window import windowed_layers
from pdserve.runner.runner_select import mrv2_unsupported_features


def _gemma3_config(**overrides):
    from transformers import Gemma3TextConfig

    kw = dict(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=5, max_position_embeddings=512, final_logit_softcapping=5.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
        },
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory) -> str:
    path = _save_tiny(tmp_path_factory, "tiny-gemma3", _gemma3_config())
    _randomize_tensors(path, "norm", scale=0.5)
    return path


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory) -> str:
    """Gemma 2: attention softcap 1.5 (scores of a few units: tanh bends them), final cap
    4, a 6-key window on layers 0 and 2, head_dim 24, query_pre_attn_scalar 12."""
    from transformers import Gemma2Config

    cfg = Gemma2Config(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=6, attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
        max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Gemma2ForCausalLM"],
    )  # fmt: skip
    path = _save_tiny(tmp_path_factory, "tiny-gemma2", cfg)
    _randomize_tensors(path, "norm", scale=0.5)
    return path


@pytest.fixture(scope="module")
def tiny_gemma1_dir(tmp_path_factory) -> str:
    """Gemma (1): Llama's two norms a layer (offsets from one, randomised), one kv head for
    four query heads (the 2B's multi-query attention), head_dim 32, GeGLU, sqrt(hidden)
    embeddings, tied."""
    from transformers import GemmaConfig

    cfg = GemmaConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["GemmaForCausalLM"],
    )  # fmt: skip
    path = _save_tiny(tmp_path_factory, "tiny-gemma1", cfg)
    _randomize_tensors(path, "norm", scale=0.5)
    return path


def test_gemma1_matches_transformers(tiny_gemma1_dir):
    from pdserve.runner.models.llama import DecoderLayer

    llm = assert_greedy_matches_hf(tiny_gemma1_dir, (5, 40, 90), 16, seed=13)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0], DecoderLayer) and model.embedding_multiplier == 8.0
    assert_logprobs_match_hf(tiny_gemma1_dir, [(7 * i + 2) % 1000 + 3 for i in range(40)], 8)


@pytest.fixture(scope="module")
def tiny_gemma3_vision_dir(tmp_path_factory) -> str:
    """Gemma 3 as its 4B-27B checkpoints ship: Gemma3ForConditionalGeneration, the text
    model under `language_model.`, beside a (tiny) SigLIP tower and projector."""
    from transformers import Gemma3Config, SiglipVisionConfig

    text = _gemma3_config()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    cfg = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=1000, boi_token_index=1001, eoi_token_index=1002,
        architectures=["Gemma3ForConditionalGeneration"],
    )  # fmt: skip
    path = _save_tiny(tmp_path_factory, "tiny-gemma3-vision", cfg)
    _randomize_tensors(path, "norm", scale=0.5)
    return path


GEMMAS = ["tiny_gemma3_dir", "tiny_gemma2_dir", "tiny_gemma3_vision_dir"]


def test_config_is_read_as_transformers_reads_it(tiny_gemma3_dir):
    """Guards the per-layer reading: windows on the local layers only, and both RoPE sets
    supported (no fallback to the reference runner)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_gemma3_dir)
    assert windowed_layers(cfg) == [5, 0, 5]
    assert mrv2_unsupported_features(cfg) == []


def test_multimodal_checkpoint_runs_its_language_model(tiny_gemma3_vision_dir):
    """The text view: Gemma3ForCausalLM on mrv2, no vision tensor loaded (a leftover would
    fail the loader's "no place" check), the top-level token ids kept."""
    llm = LLM(model=tiny_gemma3_vision_dir, device=DEVICE, dtype="float32")
    model_config = llm.engine.config.model
    assert model_config.architecture == "Gemma3ForCausalLM"
    assert model_config.text_only_of == "Gemma3ForConditionalGeneration"
    assert llm.runner_name == "mrv2"


def test_bf16_keeps_one_plus_w_in_float32(tiny_gemma3_dir):
    """In a bf16 model every norm weight (`1 + w`, q/k norms included) stays float32 while
    the rest is bf16, and generation runs through the float32-weight norms (their
    numerics: test_gemma_norm.py)."""
    llm = LLM(model=tiny_gemma3_dir, device=DEVICE, dtype="bfloat16")
    params = dict(llm.engine.runner.model.named_parameters())
    norms = {n: p.dtype for n, p in params.items() if n.endswith("norm.weight")}
    assert len(norms) == 3 * 6 + 1 and set(norms.values()) == {torch.float32}
    assert params["layers.0.self_attn.qkv_proj.weight"].dtype == torch.bfloat16
    out = llm.generate({"prompt_token_ids": [5, 9, 77, 3]},
                       SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(out.token_ids) == 4


def test_unsupported_gemma_features_are_named():
    """Bidirectional attention (EmbeddingGemma) is named, not silently dropped; an unknown
    RoPE type on one layer type is named too."""
    cfg = _gemma3_config(use_bidirectional_attention=True)
    cfg.rope_parameters["full_attention"] = {"rope_type": "dynamic", "rope_theta": 1e6,
                                             "factor": 2.0}  # fmt: skip
    problems = mrv2_unsupported_features(cfg)
    assert any("bidirectional" in p for p in problems)
    assert any("dynamic" in p for p in problems)


@pytest.mark.parametrize("fixture", GEMMAS)
def test_greedy_tokens_match_transformers(fixture, request):
    assert_greedy_matches_hf(request.getfixturevalue(fixture), (1, 5, 17, 33, 64, 100), 24)


@pytest.mark.parametrize("fixture", GEMMAS)
def test_logprobs_match_transformers(fixture, request):
    """Logprobs of the (softcapped) logits (conftest.assert_logprobs_match_hf)."""
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(30)]
    assert_logprobs_match_hf(request.getfixturevalue(fixture), prompt, 8, block_size=16)


def test_bf16_embedding_scale_is_rounded_as_transformers_rounds_it():
    """sqrt(3072) = 55.4256 is 55.5 in bf16: transformers multiplies by the rounded value,
    so the model does too (a 0.13% scale on every input otherwise)."""
    from pdserve.runner.models.gemma import GemmaForCausalLM

    cfg = _gemma3_config(hidden_size=3072, num_hidden_layers=1, intermediate_size=8,
                         num_attention_heads=1, num_key_value_heads=1,
                         layer_types=["full_attention"])  # fmt: skip
    with torch.device("meta"):
        model = GemmaForCausalLM(cfg, 8).to(torch.bfloat16)
    model._after_load()
    assert model.embedding_multiplier == 55.5
