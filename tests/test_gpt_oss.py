"""gpt-oss on mrv2 equals transformers: greedy tokens and their logprobs, from a float
checkpoint and from an MXFP4 one.

The tiny model has what sets gpt-oss apart (runner/models/gpt_oss.py): biased q/k/v/o,
a sink logit per query head, a 6-key sliding window on every other layer, YaRN RoPE,
MoE layers with a biased router whose top-2 logits are softmaxed, experts with biases and
the clamped gate (inputs reach the clamp at 7: the weights are scaled up), and interleaved
gate/up columns in the checkpoint. The MXFP4 checkpoint holds random 4-bit expert blocks
and exponents; its reference is the same model with the experts dequantized by
transformers' own converter (`convert_moe_packed_tensors`), so the test pins our layout
reading to the released checkpoints' (a transposed or de-interleaved-wrong expert changes
the tokens).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    DEVICE,
    _save_tiny,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
    hf_greedy,
)
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.runner.models.mxfp4_weights import dequantize_mxfp4, dequantized_mxfp4
from pdserve.runner.runner_select import mrv2_unsupported_features


def _config():
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=1013, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False},
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["GptOssForCausalLM"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(tmp_path_factory) -> str:
    path = _save_tiny(tmp_path_factory, "tiny-gpt-oss", _config())
    (file,) = sorted(Path(path).glob("*.safetensors"))
    tensors = load_file(file)
    g = torch.Generator().manual_seed(9)
    for name, t in tensors.items():
        if "norm" in name:  # ones at init: randomise so their float32 handling shows
            tensors[name] = 1 + 0.3 * torch.randn(t.shape, generator=g)
        if name.endswith("gate_up_proj"):  # gates of several units: past the clamp at 7
            tensors[name] = t * 6
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def mxfp4_pair(tiny_gpt_oss_dir, tmp_path_factory) -> tuple[str, str]:
    """(an MXFP4 checkpoint, its twin with the experts dequantized by transformers)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    fp4, twin = root / "mxfp4", root / "twin"
    shutil.copytree(tiny_gpt_oss_dir, fp4)
    shutil.copytree(tiny_gpt_oss_dir, twin)
    (file,) = sorted(fp4.glob("*.safetensors"))
    tensors = load_file(file)
    quantized, dequantized = dict(tensors), dict(tensors)
    g = torch.Generator().manual_seed(4)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, fan_in, fan_out = tensors[name].shape  # transformers' [E, in, out]
        blocks = torch.randint(0, 256, (e, fan_out, fan_in // 32, 16), generator=g,
                               dtype=torch.uint8)  # fmt: skip
        scales = torch.randint(122, 127, (e, fan_out, fan_in // 32), generator=g,
                               dtype=torch.uint8)  # fmt: skip
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(quantized, file, metadata={"format": "pt"})
    save_file(dequantized, twin / file.name, metadata={"format": "pt"})
    config = json.loads((fp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}  # fmt: skip
    (fp4 / "config.json").write_text(json.dumps(config))
    return str(fp4), str(twin)


def test_greedy_tokens_match_transformers(tiny_gpt_oss_dir):
    llm = assert_greedy_matches_hf(tiny_gpt_oss_dir, (1, 5, 17, 40, 90), 20, seed=2)
    assert llm.engine.execution_path["experts"] == ("triton" if DEVICE == "cuda" else "torch")


def test_logprobs_match_transformers(tiny_gpt_oss_dir):
    prompt = [(11 * i + 5) % 1000 + 3 for i in range(20)]
    assert_logprobs_match_hf(tiny_gpt_oss_dir, prompt, 8)


def test_mxfp4_checkpoint_matches_its_dequantized_twin(mxfp4_pair):
    fp4_dir, twin_dir = mxfp4_pair
    from transformers import AutoConfig

    assert mrv2_unsupported_features(AutoConfig.from_pretrained(fp4_dir)) == []
    llm = LLM(model=fp4_dir, device=DEVICE, dtype="float32")
    assert llm.engine.execution_path["weights"] == "mxfp4->float32"
    prompts = [[7, 99, 400, 12, 5], [(3 * i) % 900 + 3 for i in range(30)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, exp in zip(outs, hf_greedy(twin_dir, prompts, 12)):
        assert out.outputs[0].token_ids == exp
    assert_logprobs_match_hf(fp4_dir, prompts[1], 6, ref_dir=twin_dir)


def test_mxfp4_dequantization_matches_transformers():
    """Every nibble value, low nibble first, exponents around the bias, an expert dim."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 135, (3, 5, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)


def test_lone_mxfp4_halves_are_named():
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="a.gate_up_proj_blocks"):
        list(dequantized_mxfp4([("a.gate_up_proj_blocks", blocks)]))
