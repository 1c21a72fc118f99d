"""vLLM's `quantization` argument (`LLM(quantization=...)`, `pdserve serve -q`): the
checkpoint's own method, or none, runs; anything else is refused by name as the engine's
config resolves, before a weight loads (runner/models/fp8_weights.py check_quantization).
"fp8" on a 16-bit checkpoint is vLLM's online quantization (tests/test_fp8_online.py)."""

from __future__ import annotations

import pytest
from conftest import DEVICE
from transformers import AutoConfig

from pdserve import LLM
from pdserve.runner.models.fp8_weights import check_quantization


def test_none_or_the_checkpoints_own_method_is_accepted(tiny_llama_dir):
    bf16 = AutoConfig.from_pretrained(tiny_llama_dir)
    check_quantization(None, bf16)
    check_quantization("fp8", bf16)  # quantized at load (runner/models/fp8_online.py)
    fp8 = AutoConfig.from_pretrained(tiny_llama_dir)
    fp8.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    check_quantization("fp8", fp8)
    mxfp4 = AutoConfig.from_pretrained(tiny_llama_dir)
    mxfp4.quantization_config = {"quant_method": "mxfp4"}
    check_quantization("mxfp4", mxfp4)


@pytest.mark.parametrize(
    "requested, quant, message",
    [
        ("gptq", None, "the checkpoint is 16-bit"),
        ("awq", None, "the checkpoint is 16-bit"),
        ("mxfp4", {"quant_method": "fp8"}, r"the checkpoint is fp8 \(read as such"),
    ],
)
def test_other_methods_are_refused(tiny_llama_dir, requested, quant, message):
    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    if quant is not None:
        cfg.quantization_config = quant
    with pytest.raises(ValueError, match=message):
        check_quantization(requested, cfg)


def test_the_engine_refuses_it(tiny_llama_dir):
    with pytest.raises(ValueError, match="the checkpoint is 16-bit"):
        LLM(model=tiny_llama_dir, device=DEVICE, dtype="float32", quantization="awq")
