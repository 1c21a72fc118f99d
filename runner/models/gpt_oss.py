"""gpt-oss (GptOssForCausalLM) on the paged KV cache, as a member of the Llama family.

What differs from Llama, and where it is handled:
- Attention has biases on q/k/v/o and a learned sink logit per query head, which joins
  every softmax's denominator (llama.Attention with `FamilySpec.sinks`; the kernels'
  `sinks`); layers alternate a 128-key sliding window with full attention
  (`layer_types`, runner/models/attention_window.py); RoPE is YaRN.
- Every feed-forward is an MoE block (`GptOssMoe`): a biased router whose k largest
  logits are softmaxed among themselves, and experts with biased projections and a
  clamped gate, (up + 1) * gate * sigmoid(1.702 gate) (kernels/moe.py, `ExpertAct`).
- RMSNorm weights stay float32 in 16-bit models, as transformers keeps them; the norm
  kernels then take the product in float32 and round once (kernels/norm.py).
- Checkpoints store the experts transposed, `[E, in, out]`, with gate and up columns
  interleaved (released checkpoints: MXFP4 blocks in `[E, out, in / 32, 16]`,
  runner/models/mxfp4_weights.py dequantizes them); `_expert_tensor` turns either into
  the `[E, 2I, H]` (gate rows, then up rows) and `[E, H, I]` stacks the kernels read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.expert_act import ExpertAct
from pdserve.kernels.moe import moe_experts, route_top_k
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.llama import LlamaFamilyForCausalLM
from pdserve.runner.models.mxfp4_weights import dequantized_mxfp4


class GptOssExperts(nn.Module):
    """The stacked expert weights and biases of one layer (kernels/moe.py's layout)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.b_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.b_down = nn.Parameter(torch.empty(num_experts, hidden))


class GptOssMoe(nn.Module):
    def __init__(self, cfg: Any, workspace: KernelWorkspace):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = GptOssExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size)
        # transformers before 5.2x keeps alpha in the modeling code, not the config
        alpha = float(getattr(cfg, "swiglu_alpha", None) or 1.702)
        self.act = ExpertAct("swiglu_oai", alpha, float(getattr(cfg, "swiglu_limit", 7.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)
        weights, ids = route_top_k(logits, self.top_k, renormalize=False, softmax_after=True)
        e = self.experts
        return moe_experts(x, e.w_gate_up, e.w_down, ids, weights, e.b_gate_up, e.b_down, self.act)


class GptOssForCausalLM(LlamaFamilyForCausalLM):
    # transformers keeps the norms in float32 (`_keep_in_fp32_modules`); the sinks stay
    # float32 for the kernels
    keep_fp32 = ("layernorm.weight", "norm.weight", "self_attn.sinks")

    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        return GptOssMoe(cfg, self.workspace)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_expert_tensors(dequantized_mxfp4(weights)))


def _expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's expert tensors renamed and laid out as `GptOssExperts` holds them;
    everything else as it is. Dequantized MXFP4 weights arrive `[E, out, in]` (marked by
    their `_blocks` origin); transformers' own saves are `[E, in, out]`."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".mlp.experts.")
        if not prefix:
            yield name, tensor
            continue
        base = f"{prefix}.mlp.experts."
        if leaf in ("gate_up_proj", "gate_up_proj.dequantized"):
            out_in = tensor if leaf.endswith("dequantized") else tensor.transpose(1, 2)
            yield base + "w_gate_up", _uninterleave(out_in, dim=1)
        elif leaf == "gate_up_proj_bias":
            yield base + "b_gate_up", _uninterleave(tensor, dim=1)
        elif leaf in ("down_proj", "down_proj.dequantized"):
            yield (
                base + "w_down",
                tensor if leaf.endswith("dequantized") else tensor.transpose(1, 2),
            )
        elif leaf == "down_proj_bias":
            yield base + "b_down", tensor
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no place in GptOssForCausalLM")


def _uninterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate and up interleaved along `dim` (gate at even indices) -> gate half, up half."""
    index = torch.arange(t.shape[dim], device=t.device)
    return torch.cat([t.index_select(dim, index[0::2]), t.index_select(dim, index[1::2])], dim)
