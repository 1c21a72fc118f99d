"""Which runner executes a model: the one function that lists what MRV2 cannot do.

`runner="auto"` takes MRV2 when the list is empty and otherwise warns, naming each
feature, and falls back to the reference runner; `runner="mrv2"` raises `ValueError`
naming each. The environment variable PDSERVE_RUNNER applies when the argument is left
at "auto" (an explicit argument wins). The decision is logged and kept as
`engine.runner_name`, so an operator can always see which path really runs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from pdserve.kernels.moe_grouped import grouped_device
from pdserve.runner.config import RUNNER_CHOICES, architecture_of
from pdserve.runner.models import MODEL_REGISTRY
from pdserve.runner.models.fp8_weights import fp8_format
from pdserve.runner.models.mamba_hybrid import mamba_layers
from pdserve.runner.models.mlp import DENSE_ACTIVATIONS, activation_of
from pdserve.runner.models.moe import SparseMoeBlock, experts_per_pick
from pdserve.runner.models.rope import SUPPORTED_ROPE_TYPES, rope_layer_types, rope_parameters

logger = logging.getLogger(__name__)
ENV_VAR = "PDSERVE_RUNNER"


def mrv2_unsupported_features(hf_config: Any) -> list[str]:
    """Everything about this model config that the MRV2 runner does not implement."""
    arch = architecture_of(hf_config)
    if arch not in MODEL_REGISTRY:
        return [f"architecture {arch} (mrv2 implements {', '.join(sorted(MODEL_REGISTRY))})"]
    problems = []
    for layer_type in rope_layer_types(hf_config):
        rope_type = rope_parameters(hf_config, layer_type)["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            problems.append(
                f"rope_type {rope_type!r} (mrv2 implements {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
    act = activation_of(hf_config)
    supported = ("silu",) if experts_per_pick(hf_config) is not None else DENSE_ACTIVATIONS
    if getattr(hf_config, "model_type", "") == "arcee":
        supported = ("relu2",)  # its MLP has no gate (runner/models/arcee.py)
    if act not in supported:
        problems.append(f"hidden_act {act!r} (mrv2 implements {', '.join(supported)})")
    if getattr(hf_config, "model_type", "") == "nemotron_h":
        if getattr(hf_config, "mlp_hidden_act", "relu2") != "relu2":
            problems.append(f"NemotronH mlp_hidden_act {hf_config.mlp_hidden_act!r} (relu2 runs)")
        act = getattr(hf_config, "mamba_hidden_act", "silu")
    if mamba_layers(hf_config) and act != "silu":  # the Mamba2 mixer's activation too
        problems.append(f"hidden_act {act!r} in Mamba layers (mrv2 implements silu)")
    if getattr(hf_config, "clip_qkv", None) is not None:  # OLMoE's option
        problems.append(f"clip_qkv={hf_config.clip_qkv} (q/k/v clamped after projection)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        problems.append("bidirectional attention")
    try:
        fp8_format(hf_config)  # fp8, GPTQ, AWQ ... checkpoints are dequantized at load
    except ValueError as e:
        problems.append(str(e))
    return problems


def select_runner(requested: str | None, hf_config: Any) -> str:
    """Resolve "auto" (or the env var) to "mrv2" or "reference"."""
    requested = requested or "auto"
    source = "argument"
    if requested == "auto" and os.environ.get(ENV_VAR):
        requested, source = os.environ[ENV_VAR].strip().lower(), f"${ENV_VAR}"
    if requested not in RUNNER_CHOICES:
        raise ValueError(
            f"runner must be one of {', '.join(RUNNER_CHOICES)} (got {requested!r} from {source})"
        )
    if requested == "reference":
        chosen = "reference"
    else:
        problems = mrv2_unsupported_features(hf_config)
        if problems and requested == "mrv2":
            raise ValueError(
                "runner='mrv2' cannot run this model: it does not support " + "; ".join(problems)
            )
        if problems:
            logger.warning(
                "runner=auto: mrv2 does not support %s; falling back to the "
                "reference runner (slow, unpaged)",
                "; ".join(problems),
            )
        chosen = "reference" if problems else "mrv2"
    logger.info("runner: %s (requested %r via %s)", chosen, requested, source)
    return chosen


def execution_path(runner_config: Any, runner: Any) -> dict[str, str]:
    """What an engine with this runner config and runner runs: its runner, decode attention,
    norms, CUDA-graph scope, MoE experts, weights, LoRA slots and KV cache dtype, as the
    engine's ready log and the workers' stats say it."""
    cfg = runner_config
    model = getattr(runner, "model", None)
    folded = getattr(model, "norms_folded", False)
    return {
        "runner": runner.name,
        "decode_attention": _decode_attention_path(
            cfg.decode_attention, runner.name, model, cfg.device
        ),
        # runner/models/norm_fold.py: folded on CUDA in 16 bits, where batches of <= 64
        # tokens then run without RMSNorm launches
        "norms": "folded" if folded else "kernels",
        "graph_scope": cfg.cuda_graph_scope if cfg.cuda_graph_sizes else "none",
        "experts": _experts_path(runner.name, model, cfg.device),
        "weights": _weights_path(model),
        # runner/lora/slots.py: "off", or the adapter slots and the largest rank served
        "lora": _lora_path(runner),
        # the paged KV cache's dtype (--kv-cache-dtype: float8_e4m3fn / float8_e5m2 for
        # fp8, kernels/fp8_kv.py); "transformers" where the reference runner keeps its own
        "kv_cache": _kv_cache_path(runner),
    }


def _decode_attention_path(requested: str, runner_name: str, model: Any, device: str) -> str:
    """What decode attention runs: the reference runner attends with transformers', MLA
    models with kernels/mla_attention*.py whatever --decode-attention says; off CUDA every
    choice runs the torch reference (kernels/attention.py's `paged_attention_ref`);
    `per_head_prep` runs as `per_head` where no attention layer prepares q/k/v with the
    fused kernel (partial RoPE, whole-width q/k norms, position-scaled queries); and `auto`
    says what it chooses: the fused kernel where it applies (kernels/qkv_attend.applies:
    pure decode, an unsplit plan, at most FEW_DECODE_PAIRS (row, kv head) pairs) and a
    layer can fuse, `per_head` else."""
    if runner_name != "mrv2":
        return "transformers"
    if getattr(model, "mla", False):
        return "mla"
    if not device.startswith("cuda"):
        return "torch"
    if requested not in ("per_head_prep", "auto"):
        return requested
    fusable = any(getattr(m, "prepare_fusable", False) for m in model.modules())
    if requested == "auto":
        return (
            "auto (per_head_prep where it applies, else per_head)" if fusable else "auto (per_head)"
        )
    return requested if fusable else "per_head (per_head_prep does not apply)"


def _kv_cache_path(runner: Any) -> str:
    cache = getattr(runner, "kv_cache", None)
    return str(cache.dtype).removeprefix("torch.") if cache is not None else "transformers"


def _lora_path(runner: Any) -> str:
    lora = getattr(runner, "lora", None)
    if lora is None:
        return "off"
    kernels = "triton" if lora.token_slots.is_cuda else "torch"  # kernels/lora.py
    return f"{lora.max_loras}x r{lora.max_rank} {kernels}"


def _weights_path(model: Any) -> str:
    """The dtype the matmuls read weights in; "fp8->bfloat16" for an FP8 checkpoint
    dequantized at load (runner/models/fp8_weights.py), "gptq->bfloat16" / "awq->bfloat16"
    for GPTQ / AWQ ones dequantized at load (runner/models/packed_int_weights.py),
    "gptq->int4" where the dense projections run on the packed codes
    (runner/models/packed_linear.py; MoE experts and the rest in the model's dtype),
    "fp8->float8_e4m3fn" where they run on an FP8 checkpoint's kept bytes (fp8_kept.py),
    "bfloat16->float8_e4m3fn" where `--quantization fp8` quantized a 16-bit checkpoint's
    at load (fp8_online.py), either with ", w8a8" where (some of) those projections run
    W8A8 FP8 GEMMs (kernels/fp8_gemm.py: a scale a channel, bf16), "mxfp4->bfloat16" for
    gpt-oss's MXFP4 experts (no FP4 GEMM runs)."""
    params = getattr(model, "parameters", None)
    first = next(params(), None) if params is not None else None
    if first is None:
        return "?"
    dtype = str(first.dtype).removeprefix("torch.")
    source = getattr(model, "weights_from", None)
    bits = getattr(model, "packed_bits", None)
    if bits:  # the dense projections run on packed integers (runner/models/packed_linear.py)
        codes = "float8_e4m3fn" if getattr(model, "packed_fp8", False) else f"int{bits}"
        w8a8 = getattr(model, "w8a8", 0)  # projections run as W8A8 (kernels/fp8_gemm.py)
        return f"{source}->{codes}" + (", w8a8" if w8a8 else "")
    return f"{source}->{dtype}" if source else dtype


def _experts_path(runner_name: str, model: Any, device: str) -> str:
    """How an MoE model's experts run (kernels/moe.py): "triton" grouped GEMMs on CUDA,
    with ", grouped_mm for long runs" where bf16 SwiGLU experts take torch's grouped GEMM
    once every expert gets a long run of tokens (kernels/moe_grouped.py); the "torch" loop
    over experts on the CPU, "transformers" on the reference runner; "none" for a dense
    model. Experts kept packed (kernels/moe_int.py) add ", packed int4" (or int8, or
    float8_e4m3fn for an FP8 checkpoint's kept bytes)."""
    config = getattr(model, "config", None)
    if config is None or experts_per_pick(config) is None:
        return "none"
    if runner_name != "mrv2":
        return "transformers"
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.packed_bits]
    packed = ""
    if blocks:
        fp8 = any(m.packed_fp8 for m in blocks)
        packed = ", packed " + (
            "float8_e4m3fn" if fp8 else f"int{max(m.packed_bits for m in blocks)}"
        )
    if not device.startswith("cuda"):
        return "torch" + packed
    grouped = grouped_stacks(model) and grouped_device(device)
    return ("triton, grouped_mm for long runs" if grouped else "triton") + packed


def grouped_stacks(model: Any) -> bool:
    """Whether the model has experts kernels/moe_grouped.py takes: bf16 SwiGLU stacks
    without biases (runner/models/moe.py's `experts_gate_up`; gpt-oss's biased and
    NemotronH's ungated experts are named otherwise)."""
    stacks = [m.experts_gate_up for m in model.modules() if hasattr(m, "experts_gate_up")]
    return any(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in stacks)
