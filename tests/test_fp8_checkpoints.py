"""FP8 checkpoints load on mrv2, dequantized (runner/models/fp8_weights.py) or, with
`quantized_weights="packed"`, with their dense projections' bytes kept
(runner/models/fp8_kept.py).

Each test checkpoint is a tiny random model whose projection weights were quantized
here to float8_e4m3fn: by 16 x 8 blocks with `_scale_inv` (the "fp8" method of
Qwen3-FP8 and DeepSeek-V3; hidden 80 and head widths 24/40 leave blocks cut short), or
per output channel with `_scale` and a static `input_scale` (compressed-tensors). The
reference is the same model saved in float32 with the weights dequantized by an
independent loop over blocks: the FP8 checkpoint must give transformers' tokens and
logprobs on that reference, so a misplaced block, a scale applied as a divisor or a
weight left in raw FP8 values changes them.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, assert_greedy_matches_hf, assert_logprobs_match_hf, hf_greedy
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.runner.models.fp8_weights import Fp8Format, dequantize, dequantized_weights
from pdserve.runner.runner_select import mrv2_unsupported_features

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
BLOCK = (16, 8)


def _quantize_blocks(w: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 weight and float32 scale_inv per (bm, bn) block (last ones cut short)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-n // bm), -(-k // bn))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            s = block.abs().max().clamp(min=1e-8) / FP8_MAX
            scale[i, j] = s
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (block / s).to(torch.float8_e4m3fn)
    return q, scale


def _dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """The reference dequantization: block by block, no broadcasting tricks."""
    w = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] *= scale[i, j]
    return w


def _int8_weights(w: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes and float32 scales ([N, 1] per channel or [N, K / group])."""
    n, k = w.shape
    cols = w.reshape(n, -1, group) if group else w.reshape(n, 1, k)
    scale = cols.abs().amax(-1).clamp(min=1e-8) / 127  # [N, G]
    q = (cols / scale[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return q, scale


def _int8_pair(src: str, dst_q: Path, dst_ref: Path, group: int | None) -> None:
    """compressed-tensors int-quantized (W8A8-INT8) checkpoint and its float32 twin; the
    reference multiplies each code by its scale in a loop over the groups."""
    shutil.copytree(src, dst_q)
    shutil.copytree(src, dst_ref)
    (file,) = sorted(Path(src).glob("*.safetensors"))
    q_ckpt, ref = {}, {}
    for name, w in load_file(file).items():
        if not name.endswith("proj.weight"):
            q_ckpt[name] = ref[name] = w
            continue
        q, scale = _int8_weights(w, group)
        q_ckpt[name], q_ckpt[name + "_scale"] = q, scale
        size = group or w.shape[1]
        deq = torch.empty(w.shape)
        for g in range(scale.shape[1]):
            deq[:, g * size : (g + 1) * size] = (
                q[:, g * size : (g + 1) * size].float() * scale[:, g : g + 1]
            )
        ref[name] = deq
    save_file(q_ckpt, dst_q / file.name, metadata={"format": "pt"})
    save_file(ref, dst_ref / file.name, metadata={"format": "pt"})
    config = json.loads((dst_q / "config.json").read_text())
    weights = {
        "type": "int",
        "num_bits": 8,
        "symmetric": True,
        "strategy": "group" if group else "channel",
        "group_size": group,
    }
    acts = {"type": "int", "num_bits": 8, "symmetric": True, "dynamic": True, "strategy": "token"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"weights": weights, "input_activations": acts,
                                      "targets": ["Linear"]}},
    }  # fmt: skip
    (dst_q / "config.json").write_text(json.dumps(config))


def _fp8_pair(src: str, dst_fp8: Path, dst_ref: Path, per_channel: bool) -> None:
    """Writes the FP8 checkpoint and its dequantized float32 twin from model `src`."""
    shutil.copytree(src, dst_fp8)
    shutil.copytree(src, dst_ref)
    (file,) = sorted(Path(src).glob("*.safetensors"))
    fp8, ref = {}, {}
    for name, w in load_file(file).items():
        if not name.endswith("proj.weight"):  # embeddings, norms, the MoE router, the head
            fp8[name] = ref[name] = w
            continue
        if per_channel:
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / FP8_MAX  # [N, 1]
            q = (w / scale).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale"] = q, scale
            fp8[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
            ref[name] = q.float() * scale
        else:
            q, scale = _quantize_blocks(w, *BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            ref[name] = _dequantize_blocks(q, scale, *BLOCK)
    save_file(fp8, dst_fp8 / file.name, metadata={"format": "pt"})
    save_file(ref, dst_ref / file.name, metadata={"format": "pt"})
    config = json.loads((dst_fp8 / "config.json").read_text())
    if per_channel:
        weights = {"type": "float", "num_bits": 8, "strategy": "channel"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
        }  # fmt: skip
    else:
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK),
        }  # fmt: skip
    (dst_fp8 / "config.json").write_text(json.dumps(config))


CASES = {  # name: (fixture, layout)
    "qwen3-block": ("tiny_qwen3_dir", "fp8-block"),
    "qwen3-channel": ("tiny_qwen3_dir", "fp8-channel"),
    "qwen3-moe-block": ("tiny_qwen3_moe_dir", "fp8-block"),
    "qwen3-int8-channel": ("tiny_qwen3_dir", "int8-channel"),
    "qwen3-moe-int8-group8": ("tiny_qwen3_moe_dir", "int8-group"),  # K = 80/96/40/112
}


@pytest.fixture(scope="module", params=sorted(CASES))
def fp8_pair(request, tmp_path_factory) -> tuple[str, str]:
    fixture, layout = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = request.getfixturevalue(fixture)
    if layout.startswith("int8"):
        _int8_pair(src, root / "fp8", root / "ref", 8 if layout == "int8-group" else None)
    else:
        _fp8_pair(src, root / "fp8", root / "ref", per_channel=layout == "fp8-channel")
    return str(root / "fp8"), str(root / "ref")


def test_greedy_tokens_match_the_dequantized_model(fp8_pair):
    fp8_dir, ref_dir = fp8_pair
    int8 = "int8" in Path(fp8_dir).parent.name
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 990) for _ in range(n)] for n in (1, 9, 40, 70)]
    llm = LLM(model=fp8_dir, device=DEVICE, dtype="float32", max_num_batched_tokens=64)
    assert llm.runner_name == "mrv2"
    assert llm.engine.execution_path["weights"] == ("w8a8" if int8 else "fp8") + "->float32"
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out, exp in zip(prompts, outs, hf_greedy(ref_dir, prompts, 16)):
        assert out.outputs[0].token_ids == exp, f"mismatch for prompt of {len(p)} tokens"


def test_logprobs_match_the_dequantized_model(fp8_pair):
    """Logprobs (conftest.assert_logprobs_match_hf) against the dequantized twin."""
    fp8_dir, ref_dir = fp8_pair
    assert_logprobs_match_hf(fp8_dir, [5, 17, 101, 9, 250, 33, 7], 6, ref_dir=ref_dir)


def test_block_dequantization_matches_the_loop():
    """Blocks cut short on both axes (37 x 50 by 16 x 8), and an expert stack [E, N, K]
    with one scale grid per expert."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g)
    q, scale = _quantize_blocks(w, 16, 8)
    fmt = Fp8Format("fp8", "_scale_inv", (16, 8))
    torch.testing.assert_close(dequantize(q, scale, fmt), _dequantize_blocks(q, scale, 16, 8),
                               rtol=0, atol=0)  # fmt: skip
    stack_q = torch.stack([q, q])
    stack_s = torch.stack([scale, scale * 2])
    got = dequantize(stack_q, stack_s, fmt)
    torch.testing.assert_close(got[1], 2 * _dequantize_blocks(q, scale, 16, 8), rtol=0, atol=0)


def test_bad_fp8_checkpoints_fail_with_the_tensor_named():
    fmt = Fp8Format("fp8", "_scale_inv", (16, 16))
    q = torch.zeros(32, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block scale of shape"):
        dequantize(q, torch.ones(3, 2), fmt)
    lone = [("a.weight", q), ("b.weight_scale_inv", torch.ones(2, 2))]
    with pytest.raises(ValueError, match=r"a\.weight.*b\.weight_scale_inv"):
        list(dequantized_weights(lone, fmt, torch.bfloat16))
    # a scale may come before its weight (another shard); activation scales are dropped
    pairs = [("c.weight_scale_inv", torch.ones(2, 2)), ("c.input_scale", torch.ones(1)),
             ("c.weight", q), ("c.bias", torch.ones(32))]  # fmt: skip
    names = [n for n, _ in dequantized_weights(pairs, fmt, torch.bfloat16)]
    assert names == ["c.weight", "c.bias"]


def test_other_quantizations_are_named_not_run(tiny_qwen3_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_qwen3_dir)
    cfg.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    assert mrv2_unsupported_features(cfg) == [
        "quantized weights (bitsandbytes; mrv2 dequantizes fp8, gptq, awq and compressed-tensors "
        "packed integer checkpoints and gpt-oss's mxfp4)"
    ]
    int4 = {"weights": {"type": "int", "num_bits": 4}}
    cfg.quantization_config = {"quant_method": "compressed-tensors",
                               "config_groups": {"group_0": int4}}  # fmt: skip
    assert "compressed-tensors" in mrv2_unsupported_features(cfg)[0]


def test_packed_keeps_the_fp8_bytes_and_matches_the_dequantized_model(fp8_pair):
    """`quantized_weights="packed"` on an FP8 checkpoint keeps each dense projection's and
    each MoE layer's experts' float8 bytes (runner/models/fp8_kept.py: PackedLinear and
    packed expert stacks with fp8 codes, kernels/int_linear.py and moe_int.py) and gives
    the dequantized twin's greedy tokens; compressed-tensors' int8 weights cannot stay
    packed and say so."""
    from pdserve.runner.models.moe import SparseMoeBlock
    from pdserve.runner.models.packed_linear import PackedLinear

    fp8_dir, ref_dir = fp8_pair
    if "int8" in Path(fp8_dir).parent.name:
        with pytest.raises(ValueError, match="quantized_weights='packed'"):
            LLM(model=fp8_dir, device=DEVICE, dtype="float32", quantized_weights="packed")
        return
    llm = assert_greedy_matches_hf(fp8_dir, (1, 9, 40), 12, seed=5, ref_dir=ref_dir,
                                   quantized_weights="packed")  # fmt: skip
    path = llm.engine.execution_path
    assert path["weights"] == "fp8->float8_e4m3fn"
    model = llm.engine.runner.model
    kept = [m for m in model.modules() if isinstance(m, PackedLinear)]
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(kept) == 4 * len(model.layers) - 2 * len(moe)  # qkv, o (+ gate/up, down)
    assert all(m.fp8 and m.qweight.dtype == torch.int32 for m in kept)
    assert all(b.packed_fp8 and b.packed_bits == 8 for b in moe)
    assert path["experts"] == ("none" if not moe else "torch, packed float8_e4m3fn"
                               if DEVICE == "cpu" else "triton, packed float8_e4m3fn")  # fmt: skip
    # the o projection's bytes are the checkpoint's, viewed as words
    (file,) = sorted(Path(fp8_dir).glob("*.safetensors"))
    o = load_file(file)["model.layers.0.self_attn.o_proj.weight"]
    k = o.shape[1]
    got = model.layers[0].self_attn.o_proj.qweight.cpu().view(torch.uint8)[:, :k]
    assert torch.equal(got, o.view(torch.uint8))


def test_kept_fp8_scales_are_checked_and_the_bytes_padded():
    """A kept FP8 linear (runner/models/fp8_kept.py): K off the words pads the last word
    with zero bytes; block scales repeat over their block's rows; a scale per input group
    or of a block shape that does not fit is refused with the tensor named."""
    from pdserve.runner.models.fp8_kept import kept_fp8_format, kept_parts

    w = (torch.randn(20, 10) * 4).to(torch.float8_e4m3fn)
    block = Fp8Format("fp8", "_scale_inv", (16, 8))
    parts = kept_parts(w, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), block, "q.weight")
    assert parts["qweight"].shape == (20, 3)  # ceil(10 / 4) words
    assert torch.equal(parts["qweight"].view(torch.uint8)[:, :10], w.view(torch.uint8))
    assert not parts["qweight"].view(torch.uint8)[:, 10:].any()
    assert torch.equal(parts["scales"], torch.tensor([[1.0, 2.0]] * 16 + [[3.0, 4.0]] * 4))
    channel = Fp8Format("compressed-tensors", "_scale", None)
    assert kept_parts(w, torch.full((20, 1), 0.5), channel)["scales"].shape == (20, 1)
    assert torch.equal(
        kept_parts(w, torch.tensor(0.25), channel)["scales"], torch.full((20, 1), 0.25)
    )
    with pytest.raises(ValueError, match="q.weight: block scale"):
        kept_parts(w, torch.ones(1, 2), block, "q.weight")
    with pytest.raises(ValueError, match="o.weight: scale .* block, channel or tensor"):
        kept_parts(w, torch.ones(20, 2), channel, "o.weight")
    assert kept_fp8_format(block, int8=False).group_size == 8
    assert kept_fp8_format(channel, int8=False).group_size == -1
    assert kept_fp8_format(channel, int8=True) is None and kept_fp8_format(None, False) is None


def test_the_warm_up_reaches_the_long_batch_dequantize(tiny_qwen3_dir, tmp_path):
    """A worker must not compile the packed linears' long-batch kernel (DEQUANT_ROWS + 1
    rows and more dequantize the weight for cuBLAS) in a request: with packed or kept
    projections the warm-up adds a prompt that long, where one step takes it, and leaves
    nothing behind; a dequantized load adds none."""
    from pdserve.kernels.int_linear import DEQUANT_ROWS
    from pdserve.runner.engine import Engine
    from pdserve.runner.warm_up import packed_variant_batches, warm_up

    _fp8_pair(tiny_qwen3_dir, tmp_path / "fp8", tmp_path / "ref", per_channel=False)
    kw = {"model": str(tmp_path / "fp8"), "device": DEVICE, "dtype": "float32",
          "max_model_len": 512, "max_num_seqs": 8}  # fmt: skip
    packed = Engine.from_args(quantized_weights="packed", max_num_batched_tokens=256, **kw)
    assert packed_variant_batches(packed) == [(DEQUANT_ROWS + 1,)]
    lengths = []  # the warm-up's prompts, as the engine takes them
    add = packed.add_request
    packed.add_request = lambda rid, prompt, params: (
        lengths.append(len(prompt)),
        add(rid, prompt, params),
    )[1]
    assert warm_up(packed) > 0
    assert DEQUANT_ROWS + 1 in lengths
    assert not packed.scheduler.requests and packed.kv.num_free_blocks == packed.kv.num_blocks - 1
    short = Engine.from_args(quantized_weights="packed", max_num_batched_tokens=128, **kw)
    assert packed_variant_batches(short) == []
    assert packed_variant_batches(Engine.from_args(max_num_batched_tokens=256, **kw)) == []
