"""The loader's fit check (runner/models/loader.py): a model whose weights exceed the
GPU's free memory is refused before anything is allocated, naming the sizes (a worker
runs on one GPU; there is no tensor parallelism to spread it). The check reads the
meta-device model, so its byte count is tested against the real model's here, and the
refusal against given (free, total) numbers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from pdserve.runner.models.deepseek_moe import KEEP_FP32
from pdserve.runner.models.glm4_moe import Glm4MoeForCausalLM
from pdserve.runner.models.llama import LlamaFamilyForCausalLM
from pdserve.runner.models.loader import check_weights_fit, weight_bytes

CUDA = torch.device("cuda")  # only its type is read when (free, total) are given


def _meta(cls, model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        return cls(AutoConfig.from_pretrained(model_dir), 513).to(dtype)


def test_weight_bytes_count_every_parameter_and_buffer(tiny_llama_dir):
    meta = _meta(LlamaFamilyForCausalLM, tiny_llama_dir, torch.bfloat16)
    real = LlamaFamilyForCausalLM(AutoConfig.from_pretrained(tiny_llama_dir), 513)
    real = real.to(torch.bfloat16)
    want = sum(t.numel() * t.element_size() for t in [*real.parameters(), *real.buffers()])
    assert weight_bytes(meta) == want


def test_float32_routers_count_four_bytes(tiny_glm4_moe_dir):
    model = _meta(Glm4MoeForCausalLM, tiny_glm4_moe_dir, torch.bfloat16)
    kept = sum(p.numel() for n, p in model.named_parameters() if n.endswith(KEEP_FP32))
    assert kept > 0
    as_bf16 = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes(model) == as_bf16 + 2 * kept


def test_weights_larger_than_free_memory_are_refused(tiny_llama_dir):
    model = _meta(LlamaFamilyForCausalLM, tiny_llama_dir, torch.bfloat16)
    need = weight_bytes(model)
    check_weights_fit(model, CUDA, None, memory=(need, 10 * need))  # exactly fits
    with pytest.raises(ValueError, match=r"more than the .* GiB free .* one GPU"):
        check_weights_fit(model, CUDA, None, memory=(need - 1, 10 * need))
    with pytest.raises(ValueError, match="fp8 weights are dequantized at load"):
        check_weights_fit(model, CUDA, "fp8", memory=(need - 1, 10 * need))
    check_weights_fit(model, torch.device("cpu"), None, memory=(0, 0))  # the CPU: no check
