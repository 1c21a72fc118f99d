"""Decode batches without RMSNorm launches: the norm weights folded into the linears.

A decoder layer normalises its residual stream twice, each time right before a linear:
`rms_norm(r, g) @ W.T = s * (r @ (W * g).T)` per row, with `s = rsqrt(mean(r^2) + eps)`.
`fold_norms` moves each weight `g` into the next linear's input columns once at load and
sets the norm's weight to 1, so every path still computes the model's function (the
folded weights are rounded once to the dtype, as a checkpoint stored that way would be).

A decode batch (<= 64 rows) then runs the folded chain: no norm kernel at all. The o and
down projections add the residual in their epilogue and write the new stream's row sums of
squares (kernels/skinny_linear.py); the q/k/v preparation and the gate/up projection
scale their rows by the factor those sums give. Layer 0 takes its sums from a small kernel
over the embeddings. Per layer that is 6 launches (qkv, prepare, attention, o, gate/up,
down) instead of 8 with two norms; larger batches keep the norm kernels (with unit
weights), where a launch is not what the time goes to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels.row_squares import (
    MAX_PARTS,
    SQ_ROWS,
    ScaleRows,
    row_squares_triton,
    squares_buffer,
)
from pdserve.kernels.skinny_linear import (
    choose_config,
    skinny_linear_add_residual,
    skinny_linear_triton,
)
from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.models.mlp import MLP


@torch.no_grad()
def fold_norms(model: torch.nn.Module) -> None:
    """Folds every decoder layer's two RMSNorm weights into the qkv and gate/up weights
    (in place) and marks the model for the folded decode chain: batches of up to
    `model.folded_chain_max_tokens` tokens (0 when the hidden size has more output tiles
    than the squares buffer holds parts). A model with MoE layers keeps its norms (the
    chain's gate/up epilogue is a dense MLP's, and the router reads the normalised rows),
    as do MLA and partial-RoPE models (their q/k/v preparation is not the fused kernel),
    GeGLU MLPs (the epilogue is SiLU's), Gemma (`norms_foldable`: four norms a layer) and
    packed integer projections (runner/models/packed_linear.py: a norm weight cannot be
    folded into their per-group scales)."""
    if not model.norms_foldable or not all(
        isinstance(layer.mlp, MLP)
        and layer.mlp.act == "silu"
        and isinstance(getattr(layer.self_attn, "qkv_proj", None), torch.nn.Linear)
        and isinstance(layer.mlp.gate_up_proj, torch.nn.Linear)  # not packed integers
        and layer.self_attn.rotary_dim == layer.self_attn.head_dim
        for layer in model.layers
    ):
        return  # MoE feed-forwards, MLA attention (runner/models/deepseek.py), partial RoPE
    for layer in model.layers:
        _fold(layer.input_layernorm.weight, layer.self_attn.qkv_proj.weight)
        _fold(layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj.weight)
    model.norms_folded = True
    first = model.layers[0]
    hidden = model.config.hidden_size
    tiles = max(
        _tiles(hidden, first.self_attn.o_proj.weight.shape[1]),
        _tiles(hidden, first.mlp.down_proj.weight.shape[1]),
    )
    model.folded_chain_max_tokens = SQ_ROWS if tiles <= MAX_PARTS else 0


def _fold(norm_weight: torch.Tensor, weight: torch.Tensor) -> None:
    weight.copy_((weight.float() * norm_weight.float()[None, :]).to(weight.dtype))
    norm_weight.fill_(1.0)


def _tiles(n: int, k: int) -> int:
    return -(-n // choose_config(n, k).block_n)


def chain_applies(model: torch.nn.Module, num_tokens: int) -> bool:
    """A batch the folded chain takes (worked out by `fold_norms`, nothing per call)."""
    return 0 < num_tokens <= model.folded_chain_max_tokens


def folded_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    attn: AttentionMetadata,
    layer_hook: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The model's forward for a decode-sized batch with folded norms: [T] ids ->
    [T, hidden] final hidden states before the final norm (the residual stream)."""
    ws = model.workspace
    r = model.embed(input_ids)
    squares = row_squares_triton(r, squares_buffer(ws, r.device))
    for i, (layer, kv_cache) in enumerate(zip(model.layers, kv_caches, strict=True)):
        a, mlp = layer.self_attn, layer.mlp
        qkv = F.linear(r, a.qkv_proj.weight)  # the bias goes in after the row scale
        scale = ScaleRows(squares, layer.input_layernorm.eps)
        cos_sin = model.layer_cos_sin(i)  # NoPE layers: the identity table
        out = a.prepare_attend(qkv, positions, cos_sin, kv_cache, attn, scale, a.qkv_proj.bias)
        o = a.o_proj
        r, squares = skinny_linear_add_residual(out, o.weight, o.bias, r, ws)
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        h = skinny_linear_triton(
            r, gate_up.weight, gate_up.bias, ws, silu_mul_output=True,
            scale_rows=ScaleRows(squares, layer.post_attention_layernorm.eps),
        )  # fmt: skip
        r, squares = skinny_linear_add_residual(h, down.weight, down.bias, r, ws)
        if layer_hook is not None:
            layer_hook(i)
    return r
