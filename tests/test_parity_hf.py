"""Greedy CPU float32 output is token-for-token equal to transformers' `generate`."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE, assert_logprobs_match_hf, hf_greedy, hf_greedy_along

from pdserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colors:",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    " Then the dog woke up and",
    "Q: What is 2 + 2?\nA:",
    "In machine learning, a transformer is",
    "Hi",
]
NEW_TOKENS = 32
# On a GPU every Triton decode attention kernel must match transformers; the CPU path has
# one (the torch reference), whatever the setting.
DECODE_ATTENTION = ["per_head", "packed", "flat", "per_head_prep"] if DEVICE == "cuda" else ["auto"]


def _greedy(n: int) -> SamplingParams:
    # min_tokens mirrors transformers' min_new_tokens: EOS is suppressed, not just ignored.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


@pytest.mark.slow
def test_smollm2_batch_matches_transformers(smollm_dir):
    """Guards against any numeric or indexing bug in the paged forward pass (RoPE offsets,
    GQA head mapping, block tables, chunk boundaries) on the real bundled model."""
    llm = LLM(model=smollm_dir, device=DEVICE, dtype="float32", max_model_len=1024, seed=0)
    assert llm.runner_name == "mrv2"
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    assert len({len(i) for i in ids}) >= 6, "prompt lengths must be mixed"
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], _greedy(NEW_TOKENS), use_tqdm=False)
    got = [list(out.outputs[0].token_ids) for out in outs]
    assert all(len(g) == NEW_TOKENS for g in got)
    for prompt, g, exp in zip(PROMPTS, got, hf_greedy_along(smollm_dir, ids, got), strict=True):
        assert g == exp, f"mismatch for {prompt!r}"
    assert all(out.outputs[0].finish_reason == "length" for out in outs)


@pytest.mark.slow
def test_bundled_model_chat_answers_paris():
    """The default model (model=None -> bundled GGUF) with its chat template answers the
    reference question exactly; guards the GGUF conversion, template and EOS handling."""
    llm = LLM(device=DEVICE, dtype="float32", max_model_len=1024)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("decode_attention", DECODE_ATTENTION)
@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama_dir", "tiny_qwen3_dir", "tiny_qwen2_dir", "tiny_mistral_dir",
        "tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_mixtral_dir",
        "tiny_deepseek_v2_dir", "tiny_deepseek_v2_yarn_dir", "tiny_deepseek_v3_dir",
        "tiny_glm4_moe_dir", "tiny_phi3_dir", "tiny_granite_dir", "tiny_smollm3_dir",
    ],
)  # fmt: skip
def test_tiny_random_models_match_transformers(fixture, request, decode_attention):
    """Awkward shapes (head_dim 20/36, 1-3 kv heads, MHA, tied/untied, llama3/yarn/linear
    RoPE, q/k norm, qkv bias) through the paged path equal transformers token for token;
    the MoE members also guard routing (top-k, renormalised or not), the experts' stacked
    weights, dense layers between sparse ones and Qwen2-MoE's shared expert; DeepSeek's
    MLA (absorbed projections, interleaved RoPE, YaRN's mscale), its group-limited and
    biased sigmoid routing and its shared experts; GLM-4-MoE's RoPE over half a head,
    Phi-3's fused checkpoint tensors, Granite's four multipliers and SmolLM3's NoPE
    layers."""
    model_dir = request.getfixturevalue(fixture)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 990) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100)]
    llm = LLM(
        model=model_dir, device=DEVICE, dtype="float32", block_size=16, max_num_batched_tokens=64,
        decode_attention=decode_attention,
    )  # fmt: skip
    assert llm.runner_name == "mrv2"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(24), use_tqdm=False)
    expected = hf_greedy(model_dir, prompts, 24)
    for p, out, exp in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == exp, f"mismatch for prompt of {len(p)} tokens"


@pytest.mark.parametrize(
    "decode_attention,scope",
    [(k, "layers") for k in DECODE_ATTENTION]
    + ([("per_head", "step"), ("per_head_prep", "step")] if DEVICE == "cuda" else []),
)
def test_qwen3_shaped_model_matches_transformers(qwen3_shaped_dir, decode_attention, scope):
    """The benchmark model's real shapes (head_dim 128, GQA 16/8, 151,936-entry vocab,
    tied head) in float32: guards tile/mask edges that tiny shapes never reach. On a GPU
    also with step-scope graphs, whose input prep runs inside the graph, and with the q/k/v
    preparation inside the decode attention (kernels/qkv_attend.py)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 151_000) for _ in range(n)] for n in (7, 60, 150)]
    llm = LLM(
        model=qwen3_shaped_dir,
        device=DEVICE,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=128,
        decode_attention=decode_attention,
        cuda_graph_scope=scope,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(10), use_tqdm=False)
    expected = hf_greedy(qwen3_shaped_dir, prompts, 10)
    for p, out, exp in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == exp, f"mismatch for prompt of {len(p)} tokens"


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_granite_dir", "tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_mixtral_dir",
        "tiny_deepseek_v2_dir", "tiny_deepseek_v2_yarn_dir", "tiny_deepseek_v3_dir",
        "tiny_glm4_moe_dir", "tiny_phi3_dir", "tiny_smollm3_dir",
    ],
)  # fmt: skip
def test_logprobs_match_transformers(fixture, request):
    """Greedy tokens can hide a wrong scale: a tiny Granite's are decided by its x12
    embeddings (the norm before the head leaves the residual branches little say), so they
    do not show whether its residual multiplier, softmax scale or logit scaling are
    applied. The sampled tokens' logprobs do (conftest.assert_logprobs_match_hf), for the
    families added with MoE and MLA."""
    assert_logprobs_match_hf(request.getfixturevalue(fixture), [5, 17, 101, 9, 250, 33, 7], 6)
