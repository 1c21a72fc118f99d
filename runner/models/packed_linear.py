"""Dense projections that keep a GPTQ / AWQ / compressed-tensors checkpoint's integer
weights packed (kernels/int_linear.py runs them), instead of dequantizing them at load.

When: `quantized_weights="packed"` (`--quantized-weights packed`), or "auto" (the default)
where the model's 16-bit weights would not leave the KV cache room for one full-length
request within `gpu_memory_utilization` (or the cache's explicit size). Where they fit,
"auto" dequantizes: the packed kernels run 1.2-1.5x slower than cuBLAS
on 16-bit weights (benchmarks/int_linear_bench.py), so packing buys memory, not speed.

Which linears: a Llama-family decoder layer's qkv and o projections and a dense SiLU /
GeGLU MLP's gate/up and down (`swap_packed_linears`): `PackedLinear` takes their place on
the meta model before any byte is allocated, so the weights take their packed size on the
GPU (and `check_weights_fit` counts that). Its parameters are N-major ([N, words] codes,
[N, G] scales and zeros), so the loader's fused q/k/v and gate/up shards stack along
dim 0 exactly as 16-bit weights do. A Llama-family MoE layer's routed experts
(runner/models/moe.py's SparseMoeBlock: Mixtral, Qwen2-MoE, Qwen3-MoE) stay packed as
stacks run by kernels/moe_int.py (`pack_experts`), and a shared expert's projections as
PackedLinears; the router stays 16-bit.

What stays dequantized at load (runner/models/packed_int_weights.py), the model running
as for a 16-bit checkpoint: the experts of other families, every other family's
projections, act-order
checkpoints (their groups are not contiguous), 2-bit ones, LoRA-served models (the
adapters read 16-bit weights), and models that rework projection weights after load
(interleaved-RoPE rows, Granite's residual multiplier). The RMSNorms are not folded into
packed weights (runner/models/norm_fold.py): they run as kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pdserve.kernels.fp8_gemm import fp8_linear, w8a8_applies
from pdserve.kernels.int_linear import int_linear
from pdserve.kernels.skinny_linear import linear
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.fp8_kept import FP8_KEPT
from pdserve.runner.models.packed_int_weights import PackedIntFormat

NATIVE_BITS = (4, 8)
# checkpoint fragment -> the fused projection it lands in (the loader's _STACKED)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip


class PackedLinear(nn.Module):
    """`nn.Linear(in_features, out_features, bias)` on packed integer weights, or on an FP8
    checkpoint's float8_e4m3fn bytes (`fp8`, 8 bits: runner/models/fp8_kept.py)."""

    def __init__(
        self, in_features: int, out_features: int, bias: torch.Tensor | None, bits: int,
        group_size: int, workspace: KernelWorkspace | None = None, fp8: bool = False,
    ):  # fmt: skip
        """`workspace`: the model's (kernels/workspace.py), where a decode batch's split-K
        partials go; None: no split."""
        super().__init__()
        self.workspace, self.fp8 = workspace, fp8
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group_size = in_features if group_size == -1 else group_size
        groups = -(-in_features // self.group_size)
        words = -(-in_features * bits // 32)
        frozen = {"requires_grad": False}
        self.qweight = nn.Parameter(torch.empty(out_features, words, dtype=torch.int32), **frozen)
        self.scales = nn.Parameter(torch.empty(out_features, groups), **frozen)
        self.zeros = nn.Parameter(torch.empty(out_features, groups, dtype=torch.uint8), **frozen)
        self.bias = None if bias is None else nn.Parameter(torch.empty_like(bias), **frozen)

        # kept FP8 with a scale a channel, bf16: every batch runs as W8A8
        # (kernels/fp8_gemm.py), set by `prepare_w8a8` once the weights are loaded
        self.w8a8 = False
        self.w8a8_scales: torch.Tensor | None = None  # [1, N] float32

    @torch.no_grad()
    def prepare_w8a8(self, dtype: torch.dtype) -> bool:
        """Takes kernels/fp8_gemm.py's W8A8 GEMM for kept FP8 weights it applies to (else
        the weight-only tiles of kernels/int_linear.py run, as for integer codes)."""
        self.w8a8 = self.fp8 and w8a8_applies(self.scales, self.out_features,
                                              self.in_features, dtype)  # fmt: skip
        if self.w8a8:
            self.w8a8_scales = self.scales.reshape(1, -1).float().contiguous()
        return self.w8a8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w8a8:
            weight = self.qweight.view(torch.uint8).view(torch.float8_e4m3fn)  # [N, K]
            return fp8_linear(x, weight, self.w8a8_scales, self.bias)
        return int_linear(x, self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                          self.bias, self.workspace, self.fp8)  # fmt: skip

    def extra_repr(self) -> str:
        codes = "float8_e4m3fn" if self.fp8 else f"bits={self.bits}"
        w8a8 = ", w8a8" if self.w8a8 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{codes}, group_size={self.group_size}{w8a8}")  # fmt: skip


def project(
    module: nn.Module, x: torch.Tensor, workspace: KernelWorkspace, act: str | None = None
) -> torch.Tensor:
    """`module(x)` for an nn.Linear (through kernels/skinny_linear.py's dispatch) or a
    PackedLinear, then `act` ("silu" / "gelu_pytorch_tanh"-style GeGLU) and-mul if given."""
    if isinstance(module, PackedLinear):
        y = module(x)
        if act is None:
            return y
        return silu_and_mul(y) if act == "silu" else gelu_tanh_and_mul(y)
    if act == "silu":
        return linear(x, module.weight, module.bias, workspace, silu_mul_output=True)
    y = linear(x, module.weight, module.bias, workspace)
    return y if act is None else gelu_tanh_and_mul(y)


def packed_refusal(fmt: PackedIntFormat, lora: bool) -> str | None:
    """Why `fmt`'s linears cannot stay packed (they are dequantized at load), None if they
    can."""
    if lora:
        return "LoRA adapters read 16-bit projection weights"
    if fmt.act_order:
        return "act-order groups are not contiguous"
    if fmt.bits not in NATIVE_BITS:
        return f"{fmt.bits}-bit codes (the kernels take {' and '.join(map(str, NATIVE_BITS))})"
    return None


def runs_packed(
    mode: str, fmt: PackedIntFormat, lora: bool, dequantized_bytes: int | None,
    budget_bytes: int | None,
) -> bool:  # fmt: skip
    """Whether a packed checkpoint's projections stay packed. `mode` (quantized_weights):
    "packed" keeps them (refused by name where they cannot run so), "dequantized" never,
    "auto" only where the model's 16-bit weights (`dequantized_bytes`) exceed what the
    weights may take and still leave the KV cache its room (`budget_bytes`,
    runner/models/loader.py's `weights_budget`; None, None off a GPU: never)."""
    why = packed_refusal(fmt, lora)
    if mode == "packed" and why is not None:
        raise ValueError(f"quantized_weights='packed': {why}; drop it to dequantize at load")
    if mode == "dequantized" or why is not None:
        return False
    if mode == "packed":
        return True
    return (
        dequantized_bytes is not None
        and budget_bytes is not None
        and (dequantized_bytes > budget_bytes)
    )


def swap_packed_linears(model: nn.Module, fmt: PackedIntFormat) -> set[str]:
    """Replaces the dense projections `model` can run packed with PackedLinears and packs its
    MoE layers' expert stacks (on the meta device, before allocation); returns their names
    (model-local, e.g. "layers.0.self_attn.qkv_proj", "layers.1.mlp.experts"). Models this
    does not cover return an empty set. A kept FP8 checkpoint (`fmt.method` FP8_KEPT)
    keeps float8 bytes in both."""
    # (imported here: llama.py imports this module for `project`)
    from pdserve.runner.models.llama import Attention, LlamaFamilyForCausalLM, family_spec
    from pdserve.runner.models.mlp import MLP
    from pdserve.runner.models.moe import SparseMoeBlock

    if type(model) is not LlamaFamilyForCausalLM:
        return set()  # subclasses (Gemma, gpt-oss, ...) rework their projections
    fp8 = fmt.method == FP8_KEPT
    if family_spec(model.config).rope_interleaved or model.residual_multiplier != 1.0:
        return set()
    swapped: set[str] = set()
    for i, layer in enumerate(model.layers):
        sites = []
        if type(layer.self_attn) is Attention:
            sites += [
                (layer.self_attn, "self_attn", "qkv_proj"),
                (layer.self_attn, "self_attn", "o_proj"),
            ]
        if type(layer.mlp) is MLP:
            sites += [(layer.mlp, "mlp", "gate_up_proj"), (layer.mlp, "mlp", "down_proj")]
        if type(layer.mlp) is SparseMoeBlock:  # its experts (kernels/moe_int.py)
            layer.mlp.pack_experts(fmt.bits, fmt.group_size, fp8)
            swapped.add(f"layers.{i}.mlp.experts")
            if type(layer.mlp.shared_expert) is MLP:  # Qwen2-MoE's
                shared = layer.mlp.shared_expert
                sites += [(shared, "mlp.shared_expert", "gate_up_proj"),
                          (shared, "mlp.shared_expert", "down_proj")]  # fmt: skip
        for parent, where, name in sites:
            old = getattr(parent, name)
            with torch.device(old.weight.device):  # meta: nothing is allocated yet
                new = PackedLinear(old.in_features, old.out_features, old.bias, fmt.bits,
                                   fmt.group_size, model.workspace, fp8)  # fmt: skip
            setattr(parent, name, new)
            swapped.add(f"layers.{i}.{where}.{name}")
    return swapped


def packed_target(checkpoint_prefix: str, swapped: set[str]) -> bool:
    """Whether a checkpoint linear (e.g. "model.layers.0.self_attn.q_proj") lands in a
    PackedLinear, or an expert's ("model.layers.0.mlp.experts.3.gate_proj", Mixtral's
    "block_sparse_moe.experts.3.w1") in packed expert stacks."""
    from pdserve.runner.models.moe import PACKED_EXPERTS, checkpoint_local_name

    local = checkpoint_local_name(checkpoint_prefix.removeprefix("model."))
    experts = PACKED_EXPERTS.match(local)
    if experts is not None:
        return experts.group(1) in swapped
    return ".".join(_FUSED.get(p, p) for p in local.split(".")) in swapped
