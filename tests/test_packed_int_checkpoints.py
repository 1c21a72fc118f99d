"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints load on mrv2, dequantized
(runner/models/packed_int_weights.py).

Each test checkpoint is a tiny random model whose projections were quantized here to
b-bit codes with per-group scales and zero points, then packed into int32 words by the
layouts the exporters write: GPTQ along the inputs (v1 zero points stored minus one, v2
as they are; act-order with a shuffled `g_idx`), AWQ along the outputs in its 0 2 4 6 1 3
5 7 nibble order, compressed-tensors along the inputs of [N, K] (the last word padded;
symmetric codes centred on 2^(b-1), asymmetric zero points packed along the outputs). The packers below write each word from the codes by strided slices
(no unpacking code of the product's). The reference is the same model saved in float32
with each weight `(code - zero) * scale` computed from the codes before packing: the
packed checkpoint must give transformers' tokens and logprobs on it, so a code read from
the wrong nibble, a zero point off by one or a group misassigned changes them.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICE, assert_logprobs_match_hf, hf_greedy
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen2Config

from pdserve import LLM, SamplingParams
from pdserve.runner.config import CacheConfig
from pdserve.runner.models import MODEL_REGISTRY
from pdserve.runner.models.fp8_weights import check_quantization
from pdserve.runner.models.loader import kv_cache_reserve, weights_budget
from pdserve.runner.models.mlp import MLP
from pdserve.runner.models.moe import SparseMoeBlock
from pdserve.runner.models.packed_int_weights import (
    PackedIntFormat,
    dequantize_packed,
    dequantized_packed_weights,
    packed_int_format,
)
from pdserve.runner.models.packed_linear import PackedLinear, packed_target, runs_packed
from pdserve.runner.mrv2.kv_cache import GPU_ACTIVATION_RESERVE_BYTES
from pdserve.runner.runner_select import mrv2_unsupported_features

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output ORDER[i]


def _words(columns: list[np.ndarray], bits: int) -> torch.Tensor:
    """int32 words whose i-th b-bit field (lowest first) is columns[i]."""
    word = np.zeros(columns[0].shape, dtype=np.uint64)
    for i, c in enumerate(columns):
        word |= c.astype(np.uint64) << np.uint64(bits * i)
    return torch.from_numpy(word.astype(np.uint32).view(np.int32).copy())


def _pack_gptq_weight(codes: np.ndarray, bits: int) -> torch.Tensor:
    """codes [K, N] -> [K * bits / 32, N]: word r holds inputs r*p .. r*p + p - 1."""
    p = 32 // bits
    return _words([codes[i::p, :] for i in range(p)], bits)


def _pack_along_outputs(codes: np.ndarray, bits: int, order: tuple[int, ...]) -> torch.Tensor:
    """codes [R, N] -> [R, N * bits / 32]: word j's field i holds output j*p + order[i]."""
    p = 32 // bits
    return _words([codes[:, order[i] :: p] for i in range(p)], bits)


def _quantize(
    w: torch.Tensor, bits: int, g_idx: np.ndarray, groups: int, min_zero: int, sym: bool = False
):
    """Codes [K, N], zero points [G, N] (>= min_zero) and float16 scales [G, N] of w [N, K]
    by asymmetric min/max per (group, output); `sym`: zero points fixed at 2^(bits-1)."""
    wt = w.t().double().numpy()  # [K, N]
    top = (1 << bits) - 1
    scales = np.zeros((groups, wt.shape[1]))
    zeros = np.zeros((groups, wt.shape[1]), dtype=np.int64)
    codes = np.zeros(wt.shape, dtype=np.int64)
    for g in range(groups):
        rows = g_idx == g
        lo, hi = wt[rows].min(0), wt[rows].max(0)
        if sym:
            lo = -np.maximum(np.abs(lo), np.abs(hi))
        s = np.float16(np.maximum(hi - lo, 1e-4) / top).astype(np.float64)
        z = np.clip(np.round(-lo / s), min_zero, top).astype(np.int64)
        if sym:
            z[:] = 1 << (bits - 1)
        scales[g], zeros[g] = s, z
        codes[rows] = np.clip(np.round(wt[rows] / s) + z, 0, top)
    return codes, zeros, torch.from_numpy(scales).half()


def _reference(codes: np.ndarray, zeros: np.ndarray, scales: torch.Tensor, g_idx) -> torch.Tensor:
    """float32 [N, K]: each weight (code - zero) * scale of its input's group, one by one
    over the groups."""
    w = torch.zeros(codes.shape, dtype=torch.float32)
    s = scales.float()
    for k in range(codes.shape[0]):
        g = int(g_idx[k])
        w[k] = (torch.from_numpy(codes[k] - zeros[g]).float()) * s[g]
    return w.t().contiguous()


def _quantized_linear(w: torch.Tensor, spec: dict, rng: np.random.Generator):
    """(the checkpoint's tensors for this linear by part name, its float32 reference)."""
    n, k = w.shape
    bits, size = spec["bits"], spec["group_size"]
    size = k if size == -1 else size
    groups = -(-k // size)
    g_idx = np.arange(k) // size
    if spec.get("desc_act"):
        g_idx = rng.permutation(g_idx)
    if spec["quant_method"] == "gptq":
        v1 = spec["checkpoint_format"] == "gptq"
        codes, zeros, scales = _quantize(w, bits, g_idx, groups, 1 if v1 else 0)
        parts = {
            "qweight": _pack_gptq_weight(codes, bits),
            "qzeros": _pack_along_outputs(zeros - int(v1), bits, tuple(range(32 // bits))),
            "scales": scales,
            "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
        }
    elif spec["quant_method"] == "awq":
        codes, zeros, scales = _quantize(w, bits, g_idx, groups, 0)
        parts = {
            "qweight": _pack_along_outputs(codes, bits, AWQ_PACK_ORDER),
            "qzeros": _pack_along_outputs(zeros, bits, AWQ_PACK_ORDER),
            "scales": scales,
        }
    else:  # compressed-tensors: [N, K] packed along K, padded to whole words
        sym = spec["symmetric"]
        codes, zeros, scales = _quantize(w, bits, g_idx, groups, 0, sym=sym)
        p = 32 // bits
        padded = np.pad(codes.T, [(0, 0), (0, -k % p)])
        parts = {
            "weight_packed": _pack_along_outputs(padded, bits, tuple(range(p))),
            "weight_scale": scales.t().contiguous(),
            "weight_shape": torch.tensor([n, k]),
        }
        if not sym:
            parts["weight_zero_point"] = _pack_gptq_weight(
                np.pad(zeros.T, [(0, -n % p), (0, 0)]), bits
            )
        if spec.get("desc_act"):
            parts["weight_g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
    return parts, _reference(codes, zeros, scales, g_idx)


def _config(spec: dict) -> dict:
    """The checkpoint's quantization_config for a test spec."""
    if spec["quant_method"] != "compressed-tensors":
        return spec
    strategy = "channel" if spec["group_size"] == -1 else "group"
    weights = {"num_bits": spec["bits"], "type": "int", "symmetric": spec["symmetric"],
               "strategy": strategy, "group_size": None if strategy == "channel" else spec["group_size"],
               "actorder": "group" if spec.get("desc_act") else None}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip


LINEARS = ("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")  # Mixtral's experts


def _packed_pair(src: str, dst_q: Path, dst_ref: Path, spec: dict) -> None:
    """Writes the packed checkpoint and its dequantized float32 twin from model `src`."""
    shutil.copytree(src, dst_q)
    shutil.copytree(src, dst_ref)
    (file,) = sorted(Path(src).glob("*.safetensors"))
    rng = np.random.default_rng(7)
    packed, ref = {}, {}
    for name, w in load_file(file).items():
        if not name.endswith(LINEARS):  # embeddings, norms, biases, the router, the head
            packed[name] = ref[name] = w
            continue
        parts, ref[name] = _quantized_linear(w, spec, rng)
        prefix = name.removesuffix(".weight")
        packed.update({f"{prefix}.{part}": t for part, t in parts.items()})
    save_file(packed, dst_q / file.name, metadata={"format": "pt"})
    save_file(ref, dst_ref / file.name, metadata={"format": "pt"})
    config = json.loads((dst_q / "config.json").read_text())
    config["quantization_config"] = _config(spec)
    (dst_q / "config.json").write_text(json.dumps(config))


GPTQ = {"quant_method": "gptq", "sym": False, "desc_act": False}
AWQ = {"quant_method": "awq", "zero_point": True, "version": "gemm", "bits": 4}
CT = {"quant_method": "compressed-tensors"}
CASES = {
    "qwen2-gptq-v1-4bit-g16": ("tiny_qwen2_dir", {**GPTQ, "bits": 4, "group_size": 16,
                                                  "checkpoint_format": "gptq"}),
    "qwen2-gptq-v2-8bit-actorder": ("tiny_qwen2_dir", {**GPTQ, "bits": 8, "group_size": 32,
                                                       "desc_act": True,
                                                       "checkpoint_format": "gptq_v2"}),
    "qwen2-awq-g16": ("tiny_qwen2_dir", {**AWQ, "group_size": 16}),
    "qwen3-moe-awq-g8": ("tiny_qwen3_moe_dir", {**AWQ, "group_size": 8}),
    "qwen3-moe-gptq-v1-8bit-channel": ("tiny_qwen3_moe_dir", {**GPTQ, "bits": 8,
                                                              "group_size": -1,
                                                              "checkpoint_format": "gptq"}),
    "qwen2-moe-gptq-v2-4bit-g8": ("tiny_qwen2_moe_dir", {**GPTQ, "bits": 4, "group_size": 8,
                                                         "checkpoint_format": "gptq_v2"}),
    "mixtral-ct-w4a16-asym-g12": ("tiny_mixtral_dir", {**CT, "bits": 4, "group_size": 12,
                                                       "symmetric": False}),
    "qwen2-gptq-v1-2bit-channel": ("tiny_qwen2_dir", {**GPTQ, "bits": 2, "group_size": -1,
                                                      "checkpoint_format": "gptq"}),
    "qwen2-ct-w4a16-sym-g16": ("tiny_qwen2_dir", {**CT, "bits": 4, "group_size": 16,
                                                  "symmetric": True}),
    "qwen2-ct-w8a16-asym-channel": ("tiny_qwen2_dir", {**CT, "bits": 8, "group_size": -1,
                                                       "symmetric": False}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CASES))
def packed_pair(request, tmp_path_factory) -> tuple[str, str, dict]:
    fixture, spec = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    _packed_pair(request.getfixturevalue(fixture), root / "q", root / "ref", spec)
    return str(root / "q"), str(root / "ref"), spec


def _packable(spec: dict) -> bool:
    """4- and 8-bit contiguous groups can run packed (runner/models/packed_linear.py);
    act-order and 2-bit checkpoints are dequantized at load."""
    return spec["bits"] in (4, 8) and not spec.get("desc_act")


@pytest.mark.parametrize("mode", ["packed", "auto"])
def test_greedy_tokens_match_the_dequantized_model(packed_pair, mode):
    """`quantized_weights="packed"` keeps the integers, an MoE layer's routed experts
    included (on the CPU the kernels' spec runs them), "auto" dequantizes them where the
    16-bit weights fit (always on the CPU)."""
    q_dir, ref_dir, spec = packed_pair
    native = mode == "packed" and _packable(spec)
    if mode == "packed" and not native:
        mode = "auto"  # refused by name: test_packed_is_refused_where_it_cannot_run
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 980) for _ in range(n)] for n in (1, 9, 40, 70)]
    method = spec["quant_method"]
    ct = method == "compressed-tensors"
    named = method if ct else f"{method}_marlin"  # vLLM's names for these checkpoints
    llm = LLM(model=q_dir, device=DEVICE, dtype="float32", max_num_batched_tokens=64,
              quantization=named, quantized_weights=mode)  # fmt: skip
    assert llm.runner_name == "mrv2"
    source = f"w{spec['bits']}a16" if ct else method
    assert llm.engine.execution_path["weights"] == (
        f"{source}->int{spec['bits']}" if native else f"{source}->float32"
    )
    model = llm.engine.runner.model
    packed = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    assert len(packed) == (_dense_projections(model) if native else 0)
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        assert block.packed_bits == (spec["bits"] if native else 0)  # routed experts packed
        assert hasattr(block, "experts_gate_up") != native
        experts = llm.engine.execution_path["experts"]
        assert experts.endswith(f", packed int{spec['bits']}") == native, experts
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out, exp in zip(prompts, outs, hf_greedy(ref_dir, prompts, 16)):
        assert out.outputs[0].token_ids == exp, f"mismatch for prompt of {len(p)} tokens"


@pytest.mark.parametrize(
    "case, why",
    [("qwen2-gptq-v2-8bit-actorder", "act-order groups"), ("qwen2-gptq-v1-2bit-channel", "2-bit codes")],
)  # fmt: skip
def test_packed_is_refused_where_it_cannot_run(case, why, tmp_path, request):
    fixture, spec = CASES[case]
    _packed_pair(request.getfixturevalue(fixture), tmp_path / "q", tmp_path / "ref", spec)
    with pytest.raises(ValueError, match=f"quantized_weights='packed': {why}"):
        LLM(model=str(tmp_path / "q"), device=DEVICE, dtype="float32", quantized_weights="packed")
    with pytest.raises(ValueError, match="quantized_weights must be one of auto, packed"):
        LLM(model=str(tmp_path / "q"), device=DEVICE, dtype="float32", quantized_weights="int4")


def _dense_projections(model) -> int:
    """qkv and o of every layer, gate/up and down of every dense MLP layer and of every MoE
    layer's shared expert."""
    mlps = [layer.mlp if type(layer.mlp) is MLP else getattr(layer.mlp, "shared_expert", None)
            for layer in model.layers]  # fmt: skip
    return sum(2 + (2 if mlp is not None else 0) for mlp in mlps)


def test_logprobs_match_the_dequantized_model(packed_pair):
    q_dir, ref_dir, spec = packed_pair
    mode = "packed" if _packable(spec) else "auto"
    assert_logprobs_match_hf(q_dir, [5, 17, 101, 9, 250, 33, 7], 6, ref_dir=ref_dir,
                             quantized_weights=mode)  # fmt: skip


@pytest.mark.parametrize(
    "method, bits, group_size",
    [("gptq-v1", 2, 32), ("gptq-v1", 4, -1), ("gptq-v2-actorder", 4, 32),
     ("gptq-v2-actorder", 8, 32), ("gptq-v2", 2, 16), ("awq", 4, 32), ("ct-sym", 4, 32),
     ("ct-asym", 4, 32), ("ct-asym-actorder", 8, 32), ("ct-sym", 2, -1)],
)  # fmt: skip
def test_dequantization_is_exact(method, bits, group_size):
    """Every weight of a 48-output linear equals its code's (code - zero) * scale bit for
    bit, with 96 inputs and with 48 (the last group of 32 cut short); compressed-tensors
    also with 44 (its last word padded) and 40 outputs (zero points padded)."""
    name, _, variant = method.partition("-")
    ct = name == "ct"
    spec = {"quant_method": "compressed-tensors" if ct else name, "bits": bits,
            "group_size": group_size, "desc_act": "actorder" in variant,
            "checkpoint_format": "gptq" if variant == "v1" else "gptq_v2",
            "symmetric": variant.startswith("sym")}  # fmt: skip
    fmt = packed_int_format(_cfg(_config(spec)))
    for n, k in [(48, 96), (48, 48)] + ([(40, 44)] if ct else []):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
        parts, expected = _quantized_linear(w, spec, np.random.default_rng(k))
        got = dequantize_packed(parts, fmt, "x")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _cfg(quant: dict):
    return type("C", (), {"quantization_config": quant, "model_type": "qwen2"})()


def _ct_config(*weights: dict) -> dict:
    groups = {f"group_{i}": {"weights": {"type": "int", "group_size": 16, **w}}
              for i, w in enumerate(weights)}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": groups}  # fmt: skip


def test_refused_layouts_are_named(tiny_qwen2_dir):
    cfg = AutoConfig.from_pretrained(tiny_qwen2_dir)
    for quant, message in [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3-bit weights"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
         "gptq checkpoint_format 'marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq gemv with 4-bit"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "awq without zero points"),
        (_ct_config({"num_bits": 3, "strategy": "group"}),
         "compressed-tensors pack-quantized 3-bit by group"),
        (_ct_config({"num_bits": 4, "strategy": "tensor"}),
         "compressed-tensors pack-quantized 4-bit by tensor"),
        (_ct_config({"num_bits": 4, "strategy": "group"}, {"num_bits": 8, "strategy": "group"}),
         "compressed-tensors with differently quantized groups"),
    ]:  # fmt: skip
        cfg.quantization_config = quant
        (problem,) = mrv2_unsupported_features(cfg)
        assert problem.startswith(message), problem


def test_parts_may_come_in_any_order_and_lone_parts_are_named():
    spec = {"quant_method": "gptq", "bits": 4, "group_size": 16, "checkpoint_format": "gptq_v2"}
    fmt = packed_int_format(_cfg(spec))
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    parts, expected = _quantized_linear(w, spec, np.random.default_rng(1))
    stream = [("a.scales", parts["scales"]), ("a.bias", torch.ones(16)),
              ("a.qweight", parts["qweight"]), ("a.g_idx", parts["g_idx"]),
              ("norm.weight", torch.ones(3)), ("a.qzeros", parts["qzeros"])]  # fmt: skip
    out = dict(dequantized_packed_weights(stream, fmt, torch.float32))
    assert list(out) == ["a.bias", "norm.weight", "a.weight"]
    torch.testing.assert_close(out["a.weight"], expected, rtol=0, atol=0)
    # without g_idx (older exports) the groups are k // group_size, taken at the stream's end
    no_gidx = [(f"b.{p}", t) for p, t in parts.items() if p != "g_idx"]
    out = dict(dequantized_packed_weights(no_gidx, fmt, torch.float32))
    torch.testing.assert_close(out["b.weight"], expected, rtol=0, atol=0)
    # ... unless the checkpoint is act-order, where only g_idx knows them
    act = PackedIntFormat("gptq", 4, 16, 0, act_order=True)
    with pytest.raises(ValueError, match=r"b \(no g_idx\)"):
        list(dequantized_packed_weights(no_gidx, act, torch.float32))
    with pytest.raises(ValueError, match=r"c \(no qzeros, scales, g_idx\)"):
        list(dequantized_packed_weights([("c.qweight", parts["qweight"])], fmt, torch.float32))


def test_bad_shapes_fail_with_the_linear_named():
    fmt = PackedIntFormat("gptq", 4, 16, 1, act_order=False)
    parts = {"qweight": torch.zeros(4, 16, dtype=torch.int32),  # K = 32, N = 16
             "qzeros": torch.zeros(2, 2, dtype=torch.int32),
             "scales": torch.ones(3, 16, dtype=torch.float16)}  # fmt: skip
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj: scales \(3, 16\)"):
        dequantize_packed(parts, fmt, "layers.0.q_proj")
    parts["scales"] = torch.ones(2, 16, dtype=torch.float16)
    parts["g_idx"] = torch.full((32,), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="g_idx of shape"):
        dequantize_packed(parts, fmt, "layers.0.q_proj")


def test_the_quantization_argument(tiny_qwen2_dir):
    cfg = AutoConfig.from_pretrained(tiny_qwen2_dir)
    cfg.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 16}
    for name in (None, "gptq", "gptq_marlin"):
        check_quantization(name, cfg)
    with pytest.raises(ValueError, match=r"quantization='awq': the checkpoint is gptq"):
        check_quantization("awq", cfg)
    cfg.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 16}
    check_quantization("awq_marlin", cfg)
    with pytest.raises(ValueError, match="reads FP8, GPTQ, AWQ, compressed-tensors"):
        check_quantization("gptq", cfg)
    cfg.quantization_config = _config({**CT, "bits": 4, "group_size": 16, "symmetric": True})
    check_quantization("compressed-tensors", cfg)
    with pytest.raises(ValueError, match=r"the checkpoint is w4a16 \(read as such"):
        check_quantization("gptq", cfg)


def test_packed_is_refused_for_families_that_rework_their_weights(tiny_granite_dir, tmp_path):
    """Granite scales its o and down weights by its residual multiplier after load: its
    projections stay dequantized, and asking for them packed says so."""
    spec = {**GPTQ, "bits": 4, "group_size": 16, "checkpoint_format": "gptq_v2"}
    _packed_pair(tiny_granite_dir, tmp_path / "q", tmp_path / "ref", spec)
    with pytest.raises(ValueError, match="GraniteForCausalLM's projections do not run packed"):
        LLM(model=str(tmp_path / "q"), device=DEVICE, dtype="float32", quantized_weights="packed")
    llm = LLM(model=str(tmp_path / "q"), device=DEVICE, dtype="float32")
    assert llm.engine.execution_path["weights"] == "gptq->float32"


def test_which_checkpoint_linears_stay_packed():
    """Checkpoint names -> the swapped modules: fused q/k/v and gate/up fragments, and
    experts by their layer's stack (Mixtral's block_sparse_moe / w1 names too)."""
    swapped = {"layers.0.self_attn.qkv_proj", "layers.0.mlp.experts"}
    assert packed_target("model.layers.0.self_attn.k_proj", swapped)
    assert packed_target("model.layers.0.mlp.experts.3.gate_proj", swapped)
    assert packed_target("model.layers.0.block_sparse_moe.experts.7.w2", swapped)
    assert not packed_target("model.layers.1.mlp.experts.3.gate_proj", swapped)
    assert not packed_target("model.layers.0.mlp.shared_expert.gate_proj", swapped)
    shared = {"layers.0.mlp.shared_expert.gate_up_proj"}
    assert packed_target("model.layers.0.mlp.shared_expert.up_proj", shared)
    assert not packed_target("model.layers.0.self_attn.o_proj", swapped)


def test_the_kv_cache_reserve_auto_keeps():
    """What "auto" leaves the KV cache, from the model's own block shape: one request of
    max_model_len tokens in whole blocks (half the bytes in an FP8 cache), or the cache's
    explicit size."""
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=256)  # fmt: skip
    with torch.device("meta"):
        model = MODEL_REGISTRY["Qwen2ForCausalLM"](cfg, 129)
    per_block = 3 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block x kv heads x head dim x fp32
    assert kv_cache_reserve(model, CacheConfig(), torch.float32, 100) == 7 * per_block
    fp8 = CacheConfig(cache_dtype="fp8")
    assert kv_cache_reserve(model, fp8, torch.float32, 100) == 7 * per_block // 4
    assert kv_cache_reserve(model, CacheConfig(num_blocks=50), torch.float32, 100) == 50 * per_block
    explicit = CacheConfig(kv_cache_memory_bytes=12345)
    assert kv_cache_reserve(model, explicit, torch.float32, 100) == 12345


def test_when_packed_weights_are_kept():
    """quantized_weights: "auto" packs only where the 16-bit weights exceed the weights'
    budget (never off a GPU); "packed" / "dequantized" choose; where packing cannot run,
    "auto" dequantizes (the fit check then speaks) and "packed" is refused by name."""
    fmt = PackedIntFormat("gptq", 4, 128, 1, act_order=False)
    act = PackedIntFormat("gptq", 4, 128, 1, act_order=True)
    gib = 2**30
    assert runs_packed("auto", fmt, False, 9 * gib, 80 * gib) is False
    assert runs_packed("auto", fmt, False, 90 * gib, 80 * gib) is True
    # a 32B model's 64 GiB of 16-bit weights fit an 80 GB GPU's 79 GiB free, but not the
    # budget that leaves its KV cache one full-length request: kept packed
    budget = weights_budget(79 * gib, 80 * gib, 0.9, kv_reserve=8 * gib)
    assert budget == 72 * gib - gib - GPU_ACTIVATION_RESERVE_BYTES - 8 * gib
    assert runs_packed("auto", fmt, False, 64 * gib, budget) is True
    assert runs_packed("auto", fmt, False, 50 * gib, budget) is False
    assert runs_packed("auto", fmt, False, None, None) is False
    assert runs_packed("auto", act, False, 90 * gib, 80 * gib) is False
    assert runs_packed("auto", fmt, True, 90 * gib, 80 * gib) is False  # LoRA
    assert runs_packed("packed", fmt, False, None, None) is True
    assert runs_packed("dequantized", fmt, False, 90 * gib, 80 * gib) is False
    with pytest.raises(ValueError, match="quantized_weights='packed': LoRA adapters"):
        runs_packed("packed", fmt, True, None, None)
