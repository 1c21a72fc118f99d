"""The decoder layer's fused decode path (runner/models/llama.py `DecoderLayer.forward`):
the o and down projections add the residual and sum its squares (`linear_add_residual`),
the gate/up and the next layer's qkv projections apply the RMSNorm as they load
(`InputNorm`).

On the GPU that path is taken for 16-bit decode batches only; here the choice
(`takes_skinny`) is widened to every dtype and device, so the fused kernels run through
Triton's interpreter in float32 inside a real engine, and the engine must decode exactly
the tokens it decodes with the path closed (cuBLAS/torch linears and the separate norm).
float32 keeps the two paths' rounding differences (summation order) far below the
tiny model's logit margins; a wiring mistake (the wrong residual carried on, the norm
applied twice or not at all) changes the tokens within a few steps."""

from __future__ import annotations

import torch

from pdserve.kernels import skinny_linear as sl
from pdserve.runner.llm import LLM
from pdserve.runner.models import llama
from pdserve.runner.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _any_small_batch(x, weight, silu_mul_output=False, any_width=False) -> bool:
    return x.dim() == 2 and 0 < x.shape[0] <= sl.MAX_ROWS and x.stride(1) == 1


def _generate(model_dir: str) -> list[list[int]]:
    llm = LLM(model=model_dir, device=DEVICE, dtype="float32", max_model_len=128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 990, (n,), generator=g).tolist() for n in (5, 11, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_fused_decode_layers_decode_the_unfused_tokens(tiny_qwen3_dir, monkeypatch):
    unfused = _generate(tiny_qwen3_dir)
    calls = {"add_residual": 0, "norm": 0}
    add_residual, launch = sl.linear_add_residual, sl._launch

    def counting_add_residual(*args, **kwargs):
        calls["add_residual"] += 1
        return add_residual(*args, **kwargs)

    def counting_launch(x, weight, bias, workspace, silu, config, norm, residual):
        calls["norm"] += norm is not None
        return launch(x, weight, bias, workspace, silu, config, norm, residual)

    monkeypatch.setattr(sl, "takes_skinny", _any_small_batch)
    monkeypatch.setattr(llama, "takes_skinny", _any_small_batch)
    monkeypatch.setattr(llama, "linear_add_residual", counting_add_residual)
    monkeypatch.setattr(sl, "_launch", counting_launch)
    fused = _generate(tiny_qwen3_dir)
    # Each fused forward: two residual adds a layer (o, down), and a norm on load for
    # gate/up in each layer and for qkv in every layer after the first (prefill steps
    # too: their rows are few enough here).
    assert calls["add_residual"] > 0 and calls["add_residual"] % 4 == 0, calls
    forwards = calls["add_residual"] // 4
    assert calls["norm"] == 3 * forwards, calls
    assert fused == unfused
