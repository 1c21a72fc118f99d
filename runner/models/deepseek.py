"""DeepSeek-V2 and V3 (and models of their shape: DeepSeek-V2-Lite, Moonlight) on a paged
MLA latent cache.

The decoder is the Llama family's (runner/models/llama.py: embeddings, residual RMSNorms,
tied or untied head, the forward loop); what differs:
- Attention is multi-head latent attention (kernels/mla_attention.py). A token caches one
  latent row `[kv_lora_rank + qk_rope_head_dim]` per layer, the `paged_mla` layout of
  DESIGN §4, not K and V per head: DeepSeek-V2-Lite's 27 layers hold 31 KB a token where
  its 16 heads' K (192) and V (128) would hold 276 KB. The key up-projection is absorbed
  into the query and the value up-projection applied to the attention's latent output,
  both as views of `kv_b_proj` (no copy of the weights).
- RoPE covers the last `qk_rope_head_dim` dims of q and the shared k_pe, pairing adjacent
  elements (V2, V3's `rope_interleave`); at load the rows of those projections are
  reordered evens-then-odds, so the NeoX-style rotation (kernels/rope.py) computes it.
  Dot products between q and k are unchanged by the common reorder.
- The softmax scale is qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2.
- From `first_k_dense_replace` on, layers are MoE (runner/models/deepseek_moe.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pdserve.kernels.fp8_kv import is_fp8
from pdserve.kernels.mla_attention import paged_mla_attention, write_latent
from pdserve.kernels.rope import apply_rope
from pdserve.kernels.skinny_linear import linear
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.models.deepseek_moe import KEEP_FP32, DeepseekMoe, deepseek_routing
from pdserve.runner.models.llama import LlamaFamilyForCausalLM, RMSNorm
from pdserve.runner.models.mlp import MLP
from pdserve.runner.models.rope import rope_parameters


def mla_softmax_scale(cfg: Any) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    p = rope_parameters(cfg)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        factor = float(p["factor"])
        mscale = 0.1 * float(p["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    def __init__(self, cfg: Any, workspace: KernelWorkspace):
        super().__init__()
        self.workspace = workspace
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = heads
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = mla_softmax_scale(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        q_out = heads * (self.nope + self.rope)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        # An FP8 latent cache's scale (kernels/fp8_kv.py; the checkpoint's k_scale, as vLLM
        # reads it, else 1.0). The latent is both key and value: the scale joins the
        # softmax scale and multiplies the output. v_scale is accepted and unused.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def _linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return linear(x, layer.weight, layer.bias, self.workspace)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self._linear(x, self.q_proj)
        return self._linear(self.q_a_layernorm(self._linear(x, self.q_a_proj)), self.q_b_proj)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, block_size, r + rope]
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self._query(x).view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent = self._linear(x, self.kv_a_proj_with_mqa)
        c, k_pe = latent.split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = apply_rope(q_pe, k_pe.unsqueeze(1), positions, cos_sin)
        c = self.kv_a_layernorm(c.contiguous())
        write_latent(torch.cat([c, k_pe[:, 0]], dim=-1), kv_cache, attn.slot_mapping,
                     self.k_scale)  # fmt: skip
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope :]  # [H, nope, r], [H, v, r]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        out = q.new_empty(num_tokens, self.num_heads, self.rank)
        fp8 = is_fp8(kv_cache.dtype)
        paged_mla_attention(
            torch.cat([q_latent, q_pe], dim=-1), kv_cache, attn.block_tables,
            attn.query_start_loc, attn.seq_lens, self.scale * self.k_scale if fp8 else self.scale,
            self.rank, out, attn.max_query_len,
        )  # fmt: skip
        if fp8 and self.k_scale != 1.0:
            out.mul_(self.k_scale)
        values = torch.einsum("thr,hvr->thv", out, w_uv).reshape(num_tokens, -1)
        return self._linear(values, self.o_proj)


class DeepseekForCausalLM(LlamaFamilyForCausalLM):
    # Only the dense MLPs' gate/up are fused; MLA's projections keep their names.
    _STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    mla = True  # the execution path reports `decode_attention=mla`
    keep_fp32 = KEEP_FP32

    def _attention(self, cfg: Any, layer: int) -> nn.Module:
        return MLAAttention(cfg, self.workspace)

    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        if cfg.n_routed_experts and layer >= cfg.first_k_dense_replace:
            return DeepseekMoe(cfg.hidden_size, deepseek_routing(cfg), self.workspace)
        return MLP(cfg.hidden_size, cfg.intermediate_size, False, self.workspace)

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """One layer's MLA block: `[block_size, kv_lora_rank + qk_rope_head_dim]`."""
        return (block_size, self.config.kv_lora_rank + self.config.qk_rope_head_dim)

    def _after_load(self) -> None:
        if self.config.model_type == "deepseek_v3" and not getattr(
            self.config, "rope_interleave", True
        ):
            return
        for layer in self.layers:
            a = layer.self_attn
            q = a.q_proj if hasattr(a, "q_proj") else a.q_b_proj
            _deinterleave_rows(q.weight, q.bias, a.num_heads, a.nope + a.rope, a.nope)
            kv = a.kv_a_proj_with_mqa
            _deinterleave_rows(kv.weight, kv.bias, 1, a.rank + a.rope, a.rank)


def _deinterleave_rows(
    weight: torch.Tensor, bias: torch.Tensor | None, groups: int, group: int, first: int
) -> None:
    """In each of `groups` row groups of `group` rows, reorder rows `first:` (the rotary
    dims, adjacent pairs) to their even rows then their odd rows, in place."""
    order = torch.arange(weight.shape[0], device=weight.device).view(groups, group)
    rot = order[:, first:]
    order[:, first:] = torch.cat([rot[:, 0::2], rot[:, 1::2]], dim=1)
    flat = order.reshape(-1)
    weight.copy_(weight[flat])
    if bias is not None:
        bias.copy_(bias[flat])
