"""Sparse MoE feed-forward layers of the Llama family's MoE members: Mixtral, Qwen2-MoE
(with a sigmoid-gated shared expert) and Qwen3-MoE; and the hybrids' (runner/models/
mamba_hybrid.py): Granite 4.0-H's experts, beside an ungated shared MLP, and Jamba's.

Which layers are sparse, how many experts a token takes and whether their weights are
renormalised are config data (`MoeSpec`); attention is the family's own. The experts'
weights are stacked per layer into gate/up `[E, 2I, H]` and down `[E, H, I]`
(kernels/moe.py), filled from checkpoints that store them per expert (`experts.N.
gate_proj`, Mixtral's `experts.N.w1/w3/w2`) or already stacked (`experts.gate_up_proj`,
as ours or, when the shape says so, `[E, in, out]`). A GPTQ / AWQ / compressed-tensors
checkpoint's experts may stay packed (`pack_experts`, runner/models/packed_linear.py):
each stack is then `experts_<gate_up|down>_{qweight,scales,zeros}` in kernels/moe_int.py's
layout, filled from the per-expert parts the loader repacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.moe import moe_experts, route_top_k
from pdserve.kernels.moe_int import PackedExperts, moe_experts_int
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.mlp import MLP

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate: int  # per expert
    renormalize: bool  # the k weights rescaled to sum to 1
    shared_intermediate: int  # the shared expert's; 0 = none

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}] experts, got {self.top_k}"
            )


def moe_spec(cfg: Any) -> MoeSpec | None:
    """The config's MoE layer shape, None for a dense model."""
    model_type = getattr(cfg, "model_type", "")
    if model_type == "mixtral":
        return MoeSpec(
            cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, 0
        )
    if model_type == "jamba" and cfg.num_experts > 1:  # its sparse layers: mamba_hybrid.py
        return MoeSpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size, False, 0)
    if model_type == "granitemoehybrid" and (getattr(cfg, "num_local_experts", 0) or 0) > 0:
        # Softmax over the k largest logits: the same k weights as renormalising the top k
        # of a softmax over all experts. Its shared MLP is not gated (mamba_hybrid.py).
        return MoeSpec(
            cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, 0
        )
    if model_type == "granitemoe":  # Granite 3.x MoE: softmax over the k largest logits
        return MoeSpec(
            cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, 0
        )
    if model_type == "olmoe":  # OLMoE: softmax top-k, renormalised per norm_topk_prob
        return MoeSpec(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
            bool(cfg.norm_topk_prob), 0,
        )  # fmt: skip
    if model_type == "qwen3_vl_moe_text":  # always renormalised (no norm_topk_prob)
        return MoeSpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, True, 0)
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        shared = cfg.shared_expert_intermediate_size if model_type != "qwen3_moe" else 0
        return MoeSpec(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            bool(cfg.norm_topk_prob), int(shared),
        )  # fmt: skip
    return None


def experts_per_pick(cfg: Any) -> float | None:
    """E / k of an MoE model (Mixtral, Qwen-MoE, DeepSeek, GLM-4-MoE, gpt-oss), None for a
    dense one: a batch of T tokens gives each expert T / (E / k) slots on average."""
    spec = moe_spec(cfg)
    if spec is not None:
        return spec.num_experts / spec.top_k
    if getattr(cfg, "model_type", "") in ("gpt_oss", "llama4_text", "minimax_m2"):
        return cfg.num_local_experts / cfg.num_experts_per_tok
    if getattr(cfg, "model_type", "") == "ernie4_5_moe":
        return cfg.num_experts / cfg.num_experts_per_tok
    if getattr(cfg, "n_routed_experts", 0):
        return cfg.n_routed_experts / cfg.num_experts_per_tok
    return None


def is_sparse_layer(cfg: Any, spec: MoeSpec | None, layer: int) -> bool:
    """Mixtral's layers are all sparse; Qwen-MoE's are unless listed in `mlp_only_layers`
    or off the `decoder_sparse_step` stride."""
    if spec is None:
        return False
    if cfg.model_type == "mixtral":
        return True
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return layer not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, spec: MoeSpec, workspace: KernelWorkspace):
        super().__init__()
        self.spec = spec
        experts, inter = spec.num_experts, spec.intermediate
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter))
        shared = spec.shared_intermediate
        self.shared_expert = MLP(hidden, shared, False, workspace) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None
        self.packed_groups: dict[str, int] = {}  # projection -> group size, when packed
        self.packed_bits = 0
        self.packed_fp8 = False

    def pack_experts(self, bits: int, group_size: int, fp8: bool = False) -> None:
        """Replaces the 16-bit expert stacks with packed ones (on the meta device, before
        allocation): int32 codes, float32 scales and uint8 zeros a projection
        (`group_size` -1: one group a row); `fp8`: the codes are an FP8 checkpoint's
        float8_e4m3fn bytes (runner/models/fp8_kept.py)."""
        experts, two_inter, hidden = self.experts_gate_up.shape
        del self.experts_gate_up, self.experts_down
        frozen = {"requires_grad": False}
        for which, n, k in (("gate_up", two_inter, hidden), ("down", hidden, two_inter // 2)):
            size = k if group_size == -1 else group_size
            groups, words = -(-k // size), -(-k * bits // 32)
            for part, shape, dtype in (
                ("qweight", (experts, n, words), torch.int32),
                ("scales", (experts, n, groups), torch.float32),
                ("zeros", (experts, n, groups), torch.uint8),
            ):
                param = nn.Parameter(torch.empty(shape, dtype=dtype), **frozen)
                setattr(self, f"experts_{which}_{part}", param)
            self.packed_groups[which] = size
        self.packed_bits, self.packed_fp8 = bits, fp8

    def _packed(self, which: str, in_features: int) -> PackedExperts:
        return PackedExperts(
            getattr(self, f"experts_{which}_qweight"), getattr(self, f"experts_{which}_scales"),
            getattr(self, f"experts_{which}_zeros"), self.packed_bits, self.packed_groups[which],
            in_features, self.packed_fp8,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate.weight)
        weights, ids = route_top_k(router_logits, self.spec.top_k, self.spec.renormalize)
        if self.packed_bits:
            gate_up = self._packed("gate_up", x.shape[-1])
            down = self._packed("down", self.spec.intermediate)
            out = moe_experts_int(x, gate_up, down, ids, weights)
        else:
            out = moe_experts(x, self.experts_gate_up, self.experts_down, ids, weights)
        if self.shared_expert is not None:
            share = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + share * self.shared_expert(x)
        return out


# ---- checkpoint names ----------------------------------------------------------------------

_PER_EXPERT = re.compile(
    r"^(layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_STACKED = re.compile(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# a packed expert's repacked parts (runner/models/packed_int_weights.py's `repacked`)
_PER_EXPERT_PACKED = re.compile(
    r"^(layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\."
    r"(qweight|scales|zeros)$"
)
PACKED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.\d+\.")
_GATE_UP_HALF = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


def checkpoint_local_name(local: str) -> str:
    """Mixtral calls a layer's MoE `block_sparse_moe`; ours is `mlp`, as in Qwen-MoE."""
    return local.replace(".block_sparse_moe.", ".mlp.")


def load_expert_tensor(
    params: dict[str, nn.Parameter], local: str, tensor: torch.Tensor, loaded: set[str]
) -> bool:
    """Copy an expert weight into its layer's stacked parameter; False if `local` is not
    one. `loaded` gets one key per expert (and gate/up half), as `expert_keys` lists."""
    match = _PER_EXPERT.match(local) or _PER_EXPERT_PACKED.match(local)
    if match is not None:
        layer, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        half = _GATE_UP_HALF.get(proj)
        which = "down" if half is None else "gate_up"
        part = f"_{match.group(4)}" if match.re is _PER_EXPERT_PACKED else ""
        name = f"{layer}.mlp.experts_{which}{part}"
        param = _param(params, name, local)
        if expert >= param.shape[0]:
            raise ValueError(
                f"checkpoint tensor {local!r} is for expert {expert}; the config has "
                f"{param.shape[0]}"
            )
        if half is None:
            param.data[expert].copy_(tensor)
            loaded.add(f"{name}#{expert}")
        else:
            stacked = param.data[expert]
            inter = stacked.shape[0] // 2
            stacked.narrow(0, half * inter, inter).copy_(tensor)
            loaded.add(f"{name}#{expert}.{half}")
        return True
    match = _STACKED.match(local)
    if match is not None:
        which = "gate_up" if match.group(2) == "gate_up_proj" else "down"
        name = f"{match.group(1)}.mlp.experts_{which}"
        param = _param(params, name, local)
        if tensor.shape != param.shape and tensor.transpose(1, 2).shape == param.shape:
            # saved [E, in, out] (Qwen3-VL-MoE's released checkpoints): turned, as
            # transformers turns them, only when the shape says so
            tensor = tensor.transpose(1, 2)
        param.data.copy_(tensor)
        loaded.update(expert_keys(name, param) or ())
        return True
    return False


def expert_keys(name: str, param: nn.Parameter) -> list[str] | None:
    """The `loaded` keys a stacked expert parameter (16-bit or a packed part) needs; None
    for any other parameter."""
    stack = re.sub(r"_(qweight|scales|zeros)$", "", name)
    if stack.endswith(".experts_gate_up"):
        return [f"{name}#{e}.{half}" for e in range(param.shape[0]) for half in (0, 1)]
    if stack.endswith(".experts_down"):
        return [f"{name}#{e}" for e in range(param.shape[0])]
    return None


def _param(params: dict[str, nn.Parameter], name: str, checkpoint_name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in this model")
    return params[name]
