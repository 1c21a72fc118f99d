"""Mixture-of-experts feed-forward: top-k routing and the experts' gated MLPs, for MoE layers.

A sparse layer sends each token to `top_k` of `E` experts, each a gated MLP with its own
weights, and sums the experts' outputs weighted by the router's probabilities. The
weights are stacked per layer: gate/up `[E, 2I, H]` (the gate's I rows, then the up's) and
down `[E, H, I]`, the layout transformers keeps in memory too, with optional biases
`[E, 2I]` and `[E, H]` (gpt-oss). The gate is SwiGLU's silu(gate) * up, gpt-oss's
clamped variant, or NemotronH's ungated relu(up)^2, whose first projection is the up
rows alone, `[E, I, H]` (`ExpertAct`).

`moe_experts_ref` is the spec and the CPU path: a loop over the experts a batch uses, each
a dense SwiGLU over its tokens. It reads which experts those are on the host, so on a
GPU it would sync every layer and could not be captured in a graph; `moe_experts` sends
CUDA tensors to kernels/moe_triton.py instead (grouped GEMMs over expert-sorted token
blocks, no host reads), or, when every expert gets a long run of tokens, to torch's grouped
GEMM (kernels/moe_grouped.py). Nothing here knows about requests, caches or the router's
checkpoint names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pdserve.kernels import moe_triton
from pdserve.kernels.expert_act import SILU, ExpertAct
from pdserve.kernels.moe_grouped import grouped_applies, moe_experts_grouped


def route_top_k(
    router_logits: Tensor, top_k: int, renormalize: bool, softmax_after: bool = False
) -> tuple[Tensor, Tensor]:
    """[T, E] router logits -> (weights [T, k] float32, expert ids [T, k] int64).

    Softmax over the experts in float32, the k most probable, and with `renormalize`
    those k rescaled to sum to 1 (Mixtral always; Qwen-MoE per `norm_topk_prob`). With
    `softmax_after` (gpt-oss) the k largest logits are taken first and the softmax runs
    over those k alone, in the logits' dtype, as transformers does it. The weights stay
    float32 up to the product with each expert's output.
    """
    assert 0 < top_k <= router_logits.shape[-1], (
        f"top_k must be in [1, E={router_logits.shape[-1]}], got {top_k}"
    )
    if softmax_after:
        top, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(torch.float32), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor,
    b_gate_up: Tensor | None = None, b_down: Tensor | None = None, act: ExpertAct = SILU,
) -> None:  # fmt: skip
    num_experts, two_inter, hidden = w_gate_up.shape
    halves = 2 if act.gated else 1
    assert x.dim() == 2 and x.shape[1] == hidden, f"x {tuple(x.shape)} must be [T, {hidden}]"
    assert two_inter % halves == 0, f"gate/up weights {tuple(w_gate_up.shape)} must be [E, 2I, H]"
    assert w_down.shape == (num_experts, hidden, two_inter // halves), (
        f"down weights {tuple(w_down.shape)} must be [E, H, I] = "
        f"[{num_experts}, {hidden}, {two_inter // halves}]"
    )
    assert ids.dim() == 2 and ids.shape[0] == x.shape[0] and weights.shape == ids.shape, (
        f"expert ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, k]"
    )
    assert x.dtype == w_gate_up.dtype == w_down.dtype, (
        f"x, gate/up and down must share a dtype: {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}"
    )
    assert (b_gate_up is None) == (b_down is None), "gate/up and down biases come together"
    if b_gate_up is not None:
        assert b_gate_up.shape == (num_experts, two_inter) and b_down.shape == (
            num_experts, hidden,
        ), f"biases {tuple(b_gate_up.shape)}, {tuple(b_down.shape)} must be [E, 2I], [E, H]"  # fmt: skip
        assert b_gate_up.dtype == b_down.dtype == x.dtype, "biases share the weights' dtype"


def gate_act_ref(gate_up: Tensor, inter: int, act: ExpertAct) -> Tensor:
    """[N, 2I] gate | up (relu2: [N, I] up) -> [N, I], in the input's dtype, rounding after
    each op."""
    if not act.gated:
        return torch.relu(gate_up).square()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if act.kind == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def moe_experts_ref(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor,
    b_gate_up: Tensor | None = None, b_down: Tensor | None = None, act: ExpertAct = SILU,
) -> Tensor:  # fmt: skip
    """[T, H] -> [T, H]: sum over j of weights[t, j] * expert ids[t, j]'s gated MLP of x[t].

    Rounding points, for 16-bit inputs: each projection (with its bias) rounds to the
    dtype, each op of the gate rounds (`gate_act_ref`; silu's as kernels/activation.py's),
    the expert's output rounds, then its product with the float32 weight rounds once more;
    the k rounded terms of a token are summed by `Tensor.sum` (float32 accumulation, one
    final rounding).
    """
    _check(x, w_gate_up, w_down, ids, weights, b_gate_up, b_down, act)
    num_tokens, top_k = ids.shape
    inter = w_down.shape[2]
    flat_ids = ids.reshape(-1)
    flat_weights = weights.reshape(-1).to(torch.float32)
    terms = x.new_zeros(num_tokens * top_k, x.shape[1])  # [T * k, H], one per (token, pick)
    for expert in torch.unique(flat_ids).tolist():
        picks = (flat_ids == expert).nonzero().squeeze(1)
        bias_gu = None if b_gate_up is None else b_gate_up[expert]
        gate_up = F.linear(x[picks // top_k], w_gate_up[expert], bias_gu)
        h = gate_act_ref(gate_up, inter, act)
        y = F.linear(h, w_down[expert], None if b_down is None else b_down[expert])
        terms[picks] = (y.to(torch.float32) * flat_weights[picks, None]).to(x.dtype)
    return terms.view(num_tokens, top_k, -1).sum(dim=1)


def moe_experts(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor,
    b_gate_up: Tensor | None = None, b_down: Tensor | None = None, act: ExpertAct = SILU,
):  # fmt: skip
    if x.is_cuda:
        _check(x, w_gate_up, w_down, ids, weights, b_gate_up, b_down, act)
        if grouped_applies(x, w_gate_up, ids.numel(), b_gate_up, act):  # long runs an expert
            return moe_experts_grouped(x, w_gate_up, w_down, ids, weights)
        return moe_triton.moe_experts_triton(
            x, w_gate_up, w_down, ids, weights, b_gate_up=b_gate_up, b_down=b_down, act=act
        )
    return moe_experts_ref(x, w_gate_up, w_down, ids, weights, b_gate_up, b_down, act)
