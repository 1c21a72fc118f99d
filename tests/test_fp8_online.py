"""vLLM's `--quantization fp8` on a 16-bit checkpoint (runner/models/fp8_online.py): the
Llama-family projections are quantized to float8_e4m3fn as they load, one scale an
output channel, and run as an FP8 checkpoint's kept bytes do.

- The model's tokens and logprobs equal its "quantized twin": a 16-bit checkpoint whose
  projections are the FP8 codes times their scales, written here by the spec quantizer
  (kernels/fp8_quant.py's `quantize_fp8_ref`), run by transformers. Float32 weights:
  the kept path multiplies the same dequantized values, so only summation order differs.
- In bf16 the projections run as W8A8 FP8 GEMMs (kernels/fp8_gemm.py) at every batch
  size where their shapes allow, and the execution path says so; a loaded projection
  equals the W8A8 spec on the checkpoint's own weights quantized by the spec.
- What cannot run so is refused by name, never left 16-bit silently.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, assert_greedy_matches_hf, assert_logprobs_match_hf
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.kernels.fp8_gemm import fp8_linear_ref
from pdserve.kernels.fp8_quant import quantize_fp8_ref
from pdserve.runner.models.packed_linear import PackedLinear


def quantized_twin(src: str, dst: Path) -> str:
    """`src` with every decoder projection replaced by its FP8 codes times their scales."""
    shutil.copytree(src, dst)
    (file,) = sorted(Path(src).glob("*.safetensors"))
    out = {}
    for name, w in load_file(file).items():
        if name.endswith("proj.weight") and ".layers." in name:
            codes, scale = quantize_fp8_ref(w)
            w = (codes.float() * scale).to(w.dtype)
        out[name] = w
    save_file(out, dst / file.name, metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module", params=["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def online_pair(request, tmp_path_factory) -> tuple[str, str]:
    src = request.getfixturevalue(request.param)
    return src, quantized_twin(src, tmp_path_factory.mktemp(request.param) / "twin")


def test_online_fp8_equals_the_quantized_twin(online_pair):
    from pdserve.runner.models.moe import SparseMoeBlock

    src, twin = online_pair
    llm = assert_greedy_matches_hf(src, (1, 9, 40), 12, ref_dir=twin, quantization="fp8")
    path = llm.engine.execution_path
    assert path["weights"].endswith("->float8_e4m3fn"), path["weights"]
    assert "w8a8" not in path["weights"]  # float32 activations: no FP8 GEMM
    model = llm.engine.runner.model
    kept = [m for m in model.modules() if isinstance(m, PackedLinear)]
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert kept and len(kept) == 4 * len(model.layers) - 2 * len(moe)
    assert all(m.fp8 and m.scales.shape[1] == 1 for m in kept)  # a scale a channel
    assert all(b.packed_fp8 for b in moe)
    del llm
    assert_logprobs_match_hf(src, [5, 17, 101, 9, 250, 33, 7], 6, ref_dir=twin,
                             quantization="fp8")  # fmt: skip


def test_bf16_runs_w8a8(tiny_qwen3_dir):
    llm = LLM(model=tiny_qwen3_dir, device=DEVICE, dtype="bfloat16", quantization="fp8",
              max_num_batched_tokens=256)  # fmt: skip
    assert llm.engine.execution_path["weights"].endswith("->float8_e4m3fn, w8a8")
    attn = llm.engine.runner.model.layers[0].self_attn
    # qkv's 216 outputs are not 16-aligned: its weight-only FP8 tiles run; o (96 x 144) is
    # W8A8 with the checkpoint's weight quantized by the spec, at 1 row and at 130
    assert not attn.qkv_proj.w8a8 and attn.o_proj.w8a8
    (file,) = sorted(Path(tiny_qwen3_dir).glob("*.safetensors"))
    w = load_file(file)["model.layers.0.self_attn.o_proj.weight"]
    codes, scale = quantize_fp8_ref(w)
    for rows in (1, 130):
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
        got = attn.o_proj(x.bfloat16().to(DEVICE)).cpu()
        want = fp8_linear_ref(x.bfloat16(), codes, scale.reshape(1, -1), None)
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        else:  # the FP8 GEMM sums in another order: a bf16 rounding of |y| apart
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-3).all()
    # prompts through it, short and past 128 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    out = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 150)],
                       params, use_tqdm=False)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_what_cannot_run_fp8_is_refused_by_name(tiny_qwen3_dir, tiny_granite_dir):
    with pytest.raises(ValueError, match="quantized_weights='dequantized'"):
        LLM(model=tiny_qwen3_dir, device=DEVICE, dtype="float32", quantization="fp8",
            quantized_weights="dequantized")  # fmt: skip
    with pytest.raises(ValueError, match="LoRA adapters read 16-bit"):
        LLM(model=tiny_qwen3_dir, device=DEVICE, dtype="float32", quantization="fp8",
            enable_lora=True)  # fmt: skip
    with pytest.raises(ValueError, match="projections do not run on FP8 weights"):
        LLM(model=tiny_granite_dir, device=DEVICE, dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match="mrv2 runner only"):
        LLM(model=tiny_qwen3_dir, device=DEVICE, dtype="float32", quantization="fp8",
            runner="reference")  # fmt: skip
