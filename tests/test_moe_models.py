"""MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) on the MRV2 runner beyond parity with
transformers (`test_parity_hf.py`): loading the experts' stacked weights from either
checkpoint layout, refusing a checkpoint that lacks or overruns an expert, runner
selection, and the engine's self-consistency when a batch mixes tokens of many requests in
one expert's block.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.runner.config import ModelConfig
from pdserve.runner.models.attention_window import windowed_layers
from pdserve.runner.models.loader import load_model
from pdserve.runner.models.norm_fold import fold_norms
from pdserve.runner.runner_select import mrv2_unsupported_features

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)


def _rewrite(src: str, dst: Path, edit) -> str:
    """A copy of the checkpoint directory `src` with its tensors passed through `edit`."""
    shutil.copytree(src, dst)
    (file,) = sorted(dst.glob("*.safetensors"))
    save_file(edit(load_file(file)), file, metadata={"format": "pt"})
    return str(dst)


def _model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoConfig

    cfg = ModelConfig(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, 64)
    return load_model(cfg, torch.device("cpu"))


def test_mixtral_experts_land_in_their_stacked_halves(tiny_mixtral_dir):
    """Guards the name mapping: w1 is the gate (first half of gate/up), w3 the up, w2 the
    down; swapping any two still loads without error but computes another function."""
    tensors = load_file(next(Path(tiny_mixtral_dir).glob("*.safetensors")))
    moe = _model(tiny_mixtral_dir).layers[1].mlp
    prefix = "model.layers.1.block_sparse_moe.experts.3"
    inter = moe.spec.intermediate
    assert torch.equal(moe.experts_gate_up[3, :inter], tensors[f"{prefix}.w1.weight"])
    assert torch.equal(moe.experts_gate_up[3, inter:], tensors[f"{prefix}.w3.weight"])
    assert torch.equal(moe.experts_down[3], tensors[f"{prefix}.w2.weight"])


def test_stacked_checkpoint_layout_loads_the_same(tiny_qwen3_moe_dir, tmp_path):
    """A checkpoint that stores each layer's experts already stacked (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]) gives the same parameters."""

    def stack(tensors):
        out = {}
        for name, t in tensors.items():
            if ".experts." not in name:
                out[name] = t
        for layer in (0, 2):  # layer 1 is dense (mlp_only_layers)
            p = f"model.layers.{layer}.mlp.experts"
            gate_up = [
                torch.cat(
                    [tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]
                )
                for e in range(7)
            ]
            out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{p}.down_proj"] = torch.stack(
                [tensors[f"{p}.{e}.down_proj.weight"] for e in range(7)]
            )
        return out

    stacked_dir = _rewrite(tiny_qwen3_moe_dir, tmp_path / "stacked", stack)
    want, got = _model(tiny_qwen3_moe_dir).state_dict(), _model(stacked_dir).state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_missing_or_extra_expert_is_refused(tiny_qwen2_moe_dir, tmp_path):
    """Guards a silently uninitialised expert (its weights would be whatever memory held)
    and a checkpoint for a model with more experts than the config says."""
    missing = _rewrite(
        tiny_qwen2_moe_dir, tmp_path / "missing",
        lambda t: {k: v for k, v in t.items() if ".experts.4.up_proj" not in k},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"missing 1 tensors.*experts_gate_up#4\.1"):
        _model(missing)

    def extra(tensors):
        p = "model.layers.1.mlp.experts"
        tensors[f"{p}.6.down_proj.weight"] = tensors[f"{p}.0.down_proj.weight"].clone()
        return tensors

    with pytest.raises(ValueError, match="expert 6; the config has 6"):
        _model(_rewrite(tiny_qwen2_moe_dir, tmp_path / "extra", extra))


def test_moe_models_keep_their_norms(tiny_qwen3_moe_dir):
    """The folded-norm decode chain is a dense MLP's; an MoE model must keep its norm
    weights (folding them into gate/up and skipping the norm would feed the router
    unnormalised rows)."""
    model = _model(tiny_qwen3_moe_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fold_norms(model)
    assert not model.norms_folded and model.folded_chain_max_tokens == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_qwen_moe_sliding_window_counts_only_when_used(tiny_qwen3_moe_dir):
    """Qwen3-MoE configs carry `sliding_window` with `use_sliding_window: false` (as the
    released ones do); only the flag decides, as for dense Qwen. Windowed, every layer
    slides (transformers' Qwen3-MoE has no layer_types) and mrv2 runs it."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_qwen3_moe_dir)
    cfg.sliding_window, cfg.use_sliding_window = 4096, False
    assert windowed_layers(cfg) == [0] * cfg.num_hidden_layers
    cfg.use_sliding_window = True
    assert windowed_layers(cfg) == [4096] * cfg.num_hidden_layers
    assert mrv2_unsupported_features(cfg) == []


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe_dir", "tiny_mixtral_dir"])
def test_moe_batch_and_chunking_do_not_change_tokens(fixture, request):
    """Guards cross-request leaks through expert blocks: tokens of 24 requests share each
    expert's rows, and a request must decode the same alone, in the batch, and with its
    prompt chunked 16 tokens a step."""
    model_dir = request.getfixturevalue(fixture)
    rng = random.Random(5)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 990) for _ in range(rng.randint(1, 60))]}
        for _ in range(24)
    ]
    llm = LLM(model=model_dir, device=DEVICE, dtype="float32", max_num_batched_tokens=512)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = [
        llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[::6]
    ]
    assert alone == together[::6]
    chunked = LLM(model=model_dir, device=DEVICE, dtype="float32", max_num_batched_tokens=16)
    outs = chunked.generate(prompts[1::6], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == together[1::6]


def test_execution_path_names_how_experts_run(tiny_qwen2_moe_dir, tiny_qwen3_dir):
    """The operator's view (`engine_info{experts}` on /metrics, the ready log): which
    experts path runs, and `none` on a dense model."""
    kw = {"device": DEVICE, "dtype": "float32"}
    moe_path = LLM(model=tiny_qwen2_moe_dir, **kw).engine.execution_path
    assert moe_path["runner"] == "mrv2"
    assert moe_path["experts"] == ("triton" if DEVICE == "cuda" else "torch")
    assert moe_path["norms"] == "kernels"
    # on a Hopper GPU, bf16 SwiGLU experts may take torch's grouped GEMM
    # (kernels/moe_grouped.py): the label says so for them and for no other dtype
    from pdserve.kernels.moe_grouped import grouped_device
    from pdserve.runner.runner_select import _experts_path, grouped_stacks

    bf16 = LLM(model=tiny_qwen2_moe_dir, device=DEVICE, dtype="bfloat16").engine.runner.model
    fp32 = LLM(model=tiny_qwen2_moe_dir, **kw).engine.runner.model
    assert grouped_stacks(bf16) and not grouped_stacks(fp32)
    hopper = grouped_device("cuda:0")
    assert hopper == (DEVICE == "cuda" and torch.cuda.get_device_capability(0) >= (9, 0))
    grouped = "triton, grouped_mm for long runs" if hopper else "triton"
    assert _experts_path("mrv2", bf16, "cuda:0") == grouped
    assert _experts_path("mrv2", fp32, "cuda:0") == "triton"
    reference = LLM(model=tiny_qwen2_moe_dir, runner="reference", **kw).engine.execution_path
    assert reference["experts"] == "transformers"
    assert LLM(model=tiny_qwen3_dir, **kw).engine.execution_path["experts"] == "none"


def test_warm_up_reaches_the_larger_expert_blocks(tiny_qwen3_moe_dir, tiny_qwen3_dir):
    """A worker must not compile the experts' 32- and 64-slot variants in a request: the
    warm-up adds one prompt per block size (7 experts / 3 picks: 75 and 187 tokens give
    mean runs of 32 and 80 slots), only where one step takes it, and leaves nothing."""
    from pdserve.kernels.moe_triton import choose_tiles
    from pdserve.runner.engine import Engine
    from pdserve.runner.warm_up import moe_variant_batches, warm_up

    def engine(model, **kw) -> Engine:
        return Engine.from_args(model=model, device=DEVICE, dtype="float32", **kw)

    big = engine(tiny_qwen3_moe_dir, max_model_len=512, max_num_batched_tokens=256)
    assert moe_variant_batches(big) == [(75,), (187,)]
    assert [choose_tiles(n * 3, 7, torch.bfloat16).block_m for n in (75, 187)] == [32, 64]
    assert warm_up(big) > 0
    assert not big.scheduler.requests and big.kv.num_free_blocks == big.kv.num_blocks - 1
    small_steps = engine(tiny_qwen3_moe_dir, max_model_len=512, max_num_batched_tokens=128)
    assert moe_variant_batches(small_steps) == [(75,)]
    assert moe_variant_batches(engine(tiny_qwen3_dir)) == []


@pytest.mark.parametrize(
    "fixture,fp32",
    [("tiny_deepseek_v3_dir", True), ("tiny_glm4_moe_dir", True), ("tiny_qwen3_moe_dir", False)],
)
def test_routers_keep_float32_where_transformers_does(fixture, fp32, request):
    """DeepSeek's and GLM-4's routers and correction biases stay float32 in a bf16 model
    (transformers' `_keep_in_fp32_modules_strict`): rounded to bf16, the biased scores that
    pick experts (a bias around 0.2 against scores in (0, 1)) would pick others. Qwen-MoE
    routes in the model's dtype, as transformers does."""
    from transformers import AutoConfig

    model_dir = request.getfixturevalue(fixture)
    cfg = ModelConfig(model_dir, AutoConfig.from_pretrained(model_dir), torch.bfloat16, 64)
    model = load_model(cfg, torch.device("cpu"))
    layer = next(i for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "gate"))
    gate = model.layers[layer].mlp.gate
    want = torch.float32 if fp32 else torch.bfloat16
    assert gate.weight.dtype == want
    if getattr(gate, "e_score_correction_bias", None) is not None:
        assert gate.e_score_correction_bias.dtype == want
        saved = load_file(next(Path(model_dir).glob("*.safetensors")))
        bias = saved[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert torch.equal(gate.e_score_correction_bias, bias.float())
    assert model.layers[layer].self_attn.o_proj.weight.dtype == torch.bfloat16
    out = LLM(model=model_dir, device="cpu", dtype="bfloat16").generate(
        {"prompt_token_ids": [5, 6, 7, 8]}, GREEDY, use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
