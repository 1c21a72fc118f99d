"""The Llama family on the paged KV cache: Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3/4
(checkpoints with q/k/v and gate/up already fused), Granite 3 (four scalars), and the MoE
members Mixtral, Qwen2-MoE and Qwen3-MoE (GLM-4-MoE and DeepSeek subclass it: glm4_moe.py,
deepseek.py).

One module tree covers the family; the differences are data in `FamilySpec`
(attention biases, per-head q/k RMSNorm), each layer's sliding window
(runner/models/attention_window.py) and, for the MoE members, `MoeSpec` (which
layers' feed-forward is a sparse expert block, runner/models/moe.py). GQA/MHA, RoPE
variants from `runner.models.rope`, SwiGLU, tied or untied embeddings. Q/K/V and gate/up
are fused into one GEMM each at load time (exact on CPU float32: per-element results do
not change when output columns are concatenated).

The forward pass takes flat tokens `[T]` and per-step `AttentionMetadata`; it knows
nothing about requests, slots or sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pdserve.kernels.attention import paged_attention, write_kv
from pdserve.kernels.fp8_kv import is_fp8
from pdserve.kernels.norm import fused_add_rms_norm, rms_norm
from pdserve.kernels.qkv_attend import applies as qkv_attend_applies
from pdserve.kernels.qkv_attend import qkv_attend_triton
from pdserve.kernels.qkv_prep import prepare_qkv
from pdserve.kernels.rope import apply_rope
from pdserve.kernels.row_squares import ScaleRows
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.classify import ClassifierSpec, pooling_only
from pdserve.runner.models import moe
from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.models.attention_window import sliding_window_of
from pdserve.runner.models.mlp import MLP, activation_of
from pdserve.runner.models.norm_fold import chain_applies, folded_forward
from pdserve.runner.models.packed_linear import project
from pdserve.runner.models.rope import (
    build_cos_sin_cache,
    rope_free_layers,
    rope_layer_types,
    rope_parameters,
)

if TYPE_CHECKING:
    from pdserve.runner.lora.slots import LoraSite


@dataclass(frozen=True)
class FamilySpec:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sinks: bool = False  # a learned sink logit per query head (gpt-oss)
    qk_norm_whole: bool = False  # q/k norms over all heads at once (OLMo 2/3), not per head
    # RoPE on interleaved pairs (ERNIE 4.5): q/k rows are reordered at load so the halves
    # kernels rotate them (`_after_load`)
    rope_interleaved: bool = False


def family_spec(hf_config: Any) -> FamilySpec:
    model_type = getattr(hf_config, "model_type", "")
    bias = bool(getattr(hf_config, "attention_bias", False))
    if model_type in ("qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text"):
        qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        return FamilySpec(qkv_bias=qkv_bias, o_bias=False, qk_norm=False)
    if model_type in ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl_text", "qwen3_vl_moe_text"):
        return FamilySpec(qkv_bias=bias, o_bias=bias, qk_norm=True)
    if model_type == "gpt_oss":
        return FamilySpec(qkv_bias=bias, o_bias=bias, qk_norm=False, sinks=True)
    if model_type in ("gemma3_text", "exaone4"):
        return FamilySpec(qkv_bias=bias, o_bias=bias, qk_norm=True)
    if model_type == "seed_oss":
        out_bias = bool(getattr(hf_config, "attention_out_bias", False))
        return FamilySpec(qkv_bias=bias, o_bias=out_bias, qk_norm=False)
    if model_type == "llama4_text":  # per layer: runner/models/llama4.py
        return FamilySpec(qkv_bias=bias, o_bias=bias, qk_norm=False, rope_interleaved=True)
    if model_type in ("glm", "glm4"):  # GLM-4 dense: interleaved RoPE over half of a head
        return FamilySpec(qkv_bias=bias, o_bias=False, qk_norm=False, rope_interleaved=True)
    if model_type in ("cohere", "cohere2"):  # runner/models/cohere.py
        return FamilySpec(qkv_bias=bias, o_bias=bias, qk_norm=False, rope_interleaved=True)
    if model_type in ("ernie4_5", "ernie4_5_moe"):
        use_bias = bool(getattr(hf_config, "use_bias", False))
        return FamilySpec(qkv_bias=use_bias, o_bias=use_bias, qk_norm=False, rope_interleaved=True)
    if model_type in ("olmo2", "olmo3", "olmoe", "minimax_m2"):
        return FamilySpec(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True)
    if model_type == "glm4_moe":
        qk_norm = bool(getattr(hf_config, "use_qk_norm", False))
        return FamilySpec(qkv_bias=bias, o_bias=False, qk_norm=qk_norm)
    return FamilySpec(qkv_bias=bias, o_bias=bias, qk_norm=False)


def head_dim_of(hf_config: Any) -> int:
    hd = getattr(hf_config, "head_dim", None)
    return int(hd) if hd else hf_config.hidden_size // hf_config.num_attention_heads


def rotary_dim_of(hf_config: Any) -> int:
    """The leading dims of each head that RoPE rotates (`partial_rotary_factor`, e.g.
    GLM-4's 0.5; transformers 5 keeps it in `rope_parameters`); the rest pass through.
    Released MiniMax-M2 checkpoints name a count instead (legacy `rotary_dim`), which
    older transformers releases drop from the factor: read here, whatever the release."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    legacy = getattr(hf_config, "rotary_dim", None)
    if factor is None and isinstance(legacy, int) and legacy > 0:
        return legacy
    return int(head_dim_of(hf_config) * float(factor or 1.0))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Any, spec: FamilySpec, workspace: KernelWorkspace, window: int = 0):
        super().__init__()
        self.workspace = workspace
        # > 0: sliding-window attention over the last `window` keys; < 0: chunked attention
        # in blocks of -window positions (Llama 4's); attention_window.py
        self.window = window
        # > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
        self.softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        self.rotary_dim = rotary_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Granite's `attention_multiplier` replaces the usual head_dim^-0.5; Gemma scales by
        # `query_pre_attn_scalar`^-0.5
        pre_attn = getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim
        self.scale = float(getattr(cfg, "attention_multiplier", None) or pre_attn**-0.5)
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=spec.o_bias)
        # LoRA adapters' deltas on the two projections (runner/lora/slots.py), when served
        self.qkv_lora: LoraSite | None = None
        self.o_lora: LoraSite | None = None
        self.qk_norm_whole = spec.qk_norm_whole
        q_width = self.q_size if spec.qk_norm_whole else self.head_dim
        k_width = self.kv_size if spec.qk_norm_whole else self.head_dim
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if spec.qk_norm else None
        # q/k norms with a weight row per head (Command R+'s LayerNorms, cohere.py): they run
        # outside the fused prepare kernel, whose norm weight is one row for every head
        self.qk_norm_heads = False
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if spec.sinks else None
        # An FP8 cache's dequantization scales (kernels/fp8_kv.py): the checkpoint's, where
        # it has them (runner/models/kv_scales.py), else 1.0; other caches ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # (beta, length, offset): each query scaled by 1 + beta * log(1 + floor((pos +
        # offset) / length)): Ministral 3's (offset 0), Llama 4's NoPE layers' (llama4.py)
        rope = rope_parameters(cfg)
        beta = rope.get("llama_4_scaling_beta") if cfg.model_type == "ministral3" else None
        self.q_position_scale: tuple[float, int, int] | None = (
            None
            if beta is None
            else (float(beta), int(rope["original_max_position_embeddings"]), 0)
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qkv_lora is not None:
            qkv = self.qkv_lora.apply(qkv, x)
        h = self.prepare_attend(qkv, positions, cos_sin, kv_cache, attn)
        out = project(self.o_proj, h, self.workspace)  # nn.Linear or PackedLinear
        return out if self.o_lora is None else self.o_lora.apply(out, h)

    def prepare(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale_rows: ScaleRows | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Split, q/k norm, rope and the KV write in one kernel (kernels/qkv_prep.py) ->
        q [T, Hq, D]. `scale_rows` / `bias`: the folded-norm chain's projection."""
        if not self._kernel_prepares:
            assert scale_rows is None, "these models keep their norms (norm_fold.py)"
            q = self._prepare_unfused(qkv, positions, cos_sin, kv_cache, attn)
        else:
            qn, kn = self.q_norm, self.k_norm
            q = prepare_qkv(
                qkv, self.num_heads, self.num_kv_heads,
                None if qn is None else qn.weight, None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps, positions, cos_sin, kv_cache, attn.slot_mapping,
                scale_rows, bias, (self.k_scale, self.v_scale),
            )  # fmt: skip
        if self.q_position_scale is not None:
            beta, length, offset = self.q_position_scale
            pos = positions[: q.shape[0]] + offset
            scale = 1 + beta * torch.log(1 + torch.floor(pos / length))
            q = q * scale[:, None, None].to(q.dtype)
        return q

    def prepare_attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale_rows: ScaleRows | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attend(prepare(...))` -> [T, Hq * D]; in one launch (kernels/qkv_attend.py)
        where `attn` asks for "per_head_prep" or leaves the choice to the kernels (`auto`),
        and the batch is one the fused kernel takes:
        a decode batch on the GPU that `qkv_attend.applies` admits, for a layer whose
        preparation is the fused kernel's (`prepare_fusable`)."""
        if not self._fuses_prepare(qkv, attn):
            q = self.prepare(qkv, positions, cos_sin, kv_cache, attn, scale_rows, bias)
            return self.attend(q, kv_cache, attn)
        qn, kn = self.q_norm, self.k_norm
        fp8 = is_fp8(kv_cache.dtype)
        out = qkv_attend_triton(
            qkv, self.num_heads, self.num_kv_heads, None if qn is None else qn.weight,
            None if kn is None else kn.weight, 0.0 if qn is None else qn.eps, positions,
            cos_sin, kv_cache, attn.slot_mapping, attn.block_tables, attn.query_start_loc,
            attn.seq_lens, self.scale * self.k_scale if fp8 else self.scale, attn.max_seq_len,
            scale_rows, bias, (self.k_scale, self.v_scale), self.window, self.softcap,
            self.sinks,
        )  # fmt: skip
        if fp8 and self.v_scale != 1.0:
            out.mul_(self.v_scale)
        return out.reshape(qkv.shape[0], self.q_size)

    @property
    def _kernel_prepares(self) -> bool:
        """`prepare` runs kernels/qkv_prep.py's kernel: RoPE over whole heads, per-head q/k
        norms or none (else `_prepare_unfused`)."""
        return not (self.rotary_dim < self.head_dim or self.qk_norm_whole or self.qk_norm_heads)

    @property
    def prepare_fusable(self) -> bool:
        """Whether this layer's q/k/v preparation is the fused kernel's (kernels/qkv_attend.py):
        the preparation kernel's, with no position-scaled queries. Where no layer's is,
        `per_head_prep` runs as `per_head` (runner_select.execution_path)."""
        return self._kernel_prepares and self.q_position_scale is None

    def _fuses_prepare(self, qkv: torch.Tensor, attn: AttentionMetadata) -> bool:
        return (
            attn.decode_kernel in (None, "per_head_prep") and qkv.is_cuda and attn.max_query_len == 1
            and attn.max_run == 1 and self.prepare_fusable
            and attn.query_start_loc.numel() == qkv.shape[0] + 1
            and qkv_attend_applies(qkv.dtype, self.head_dim, qkv.shape[0], self.num_kv_heads,
                                   attn.max_seq_len, self.window)
        )  # fmt: skip

    def _prepare_unfused(self, qkv, positions, cos_sin, kv_cache, attn) -> torch.Tensor:
        """`prepare` for RoPE over the first `rotary_dim` dims of each head, or q/k norms
        over all heads at once or weighted per head: the same steps as the fused kernel's
        spec (split, norm, rope, KV write), as separate kernels."""
        t, d, rot = qkv.shape[0], self.head_dim, self.rotary_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None and not self.qk_norm_whole:  # [T, H, D]: each head a row
            q, k = self.q_norm(q), self.k_norm(k)
        q_rot, k_rot = apply_rope(q[..., :rot], k[..., :rot], positions, cos_sin)
        q = torch.cat([q_rot, q[..., rot:]], dim=-1)
        k = torch.cat([k_rot, k[..., rot:]], dim=-1)
        write_kv(k, v.reshape(t, self.num_kv_heads, d), kv_cache, attn.slot_mapping,
                 (self.k_scale, self.v_scale))  # fmt: skip
        return q

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata):
        """Paged attention of q [T, Hq, D] -> [T, Hq * D], the o projection's input. An
        FP8 cache holds K / k_scale and V / v_scale: the K scale joins the softmax scale,
        the V scale multiplies the output."""
        out = torch.empty_like(q)
        fp8 = is_fp8(kv_cache.dtype)
        paged_attention(
            q, kv_cache, attn.block_tables, attn.query_start_loc, attn.seq_lens,
            self.scale * self.k_scale if fp8 else self.scale, out, attn.max_query_len,
            attn.max_seq_len, workspace=self.workspace, decode_kernel=attn.decode_kernel,
            window=self.window, softcap=self.softcap, sinks=self.sinks,
            row_slots=attn.row_slots, max_run=attn.max_run,
        )  # fmt: skip
        if fp8 and self.v_scale != 1.0:
            out.mul_(self.v_scale)
        return out.reshape(q.shape[0], self.q_size)


def interleaved_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's rows in the order `_interleaved_to_halves` puts them: the rotated pairs'
    first members, then their second, then the unrotated rest."""
    return torch.cat([
        torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
        torch.arange(rotary_dim, head_dim),
    ])  # fmt: skip


def interleaved_rows(attn: Attention) -> torch.Tensor:
    """The fused projection's q and k output rows in the order `_interleaved_to_halves`
    puts them (row j of the result is row `rows[j]` of the checkpoint's); v's follow
    unmoved. A LoRA adapter's q/k deltas move the same way (runner/lora/slots.py)."""
    within = interleaved_order(attn.head_dim, attn.rotary_dim)
    heads = attn.num_heads + attn.num_kv_heads
    rows = (torch.arange(heads)[:, None] * attn.head_dim + within[None, :]).reshape(-1)
    return rows.to(attn.qkv_proj.weight.device)


def _interleaved_to_halves(attn: Attention) -> None:
    """Reorders each q and k head's rotated output rows [0, 2, 4, ..., 1, 3, 5, ...]: the
    pairs an interleaved RoPE rotates, (2i, 2i+1), become the halves kernels' (i, i + R/2)
    at the same frequency i, over the head's first R = `rotary_dim` rows (GLM-4 rotates
    half a head); the rest stay. q.k is unchanged (both move alike); v and o are
    untouched."""
    rows = interleaved_rows(attn)
    qk = rows.numel()
    w = attn.qkv_proj.weight.data
    w[:qk] = w[:qk][rows]
    if attn.qkv_proj.bias is not None:
        b = attn.qkv_proj.bias.data
        b[:qk] = b[:qk][rows]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention  # Attention, or deepseek.MLAAttention
        self.mlp = mlp  # MLP, or an MoE block on an MoE model's sparse layers
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, cos_sin, kv_cache, attn):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, cfg: Any, max_positions: int):
        super().__init__()
        self.config = cfg
        # Made without its random init (the loader fills it): on the meta device that init
        # runs torch's Python reference of normal_, whose first call imports torch._dynamo,
        # ~0.75 s of each worker's start.
        size = (cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*size, _weight=torch.empty(size))
        # Split-kernel scratch and arrival counters, shared by the layers (they run in turn
        # on one stream); sized by the first forward at each size, before graph capture.
        self.workspace = KernelWorkspace()
        self.layers = nn.ModuleList(
            self._decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = self._final_norm(cfg)
        # Set by runner/models/norm_fold.fold_norms: decode batches of up to this many
        # tokens take the folded chain.
        self.norms_folded = False
        self.folded_chain_max_tokens = 0
        # "fp8" once loader.py has dequantized an FP8 checkpoint into this model
        self.weights_from: str | None = None
        # Granite's scalars (1.0 for every other family): inputs, residual branches, logits
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)
        self.residual_multiplier = float(getattr(cfg, "residual_multiplier", 1.0) or 1.0)
        self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # A base-model checkpoint (`Qwen3Model`, ...) has no LM head: embeddings only; a
        # classifier (`...ForSequenceClassification`) has its `score` head instead, which
        # runner/models/loader.py attaches (`attach_classifier`)
        self.pooling_only = pooling_only(cfg)
        self.score: nn.Linear | None = None
        self.classifier: ClassifierSpec | None = None
        self.lm_head = (
            None
            if self.tie_word_embeddings or self.pooling_only
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # [max_positions, rotary_dim] float32, filled by `init_rope` once on the target device.
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_positions, rotary_dim_of(cfg)), persistent=False
        )
        # Layers that rotate no position (SmolLM3's, EXAONE 4's global ones, Llama 4's every
        # fourth) read an identity table (cos 1, sin 0: the rope kernels return q and k as
        # they came): one row, which `init_rope` expands to every position as a view
        # (stride 0; the kernels index rows by their stride), so a long max_model_len does
        # not cost a second table (Llama 4's 10M positions: 5.4 GB). Layer types with
        # their own RoPE (Gemma 3, OLMo 3) each have a table.
        self.nope_layers = rope_free_layers(cfg)
        self.rope_types = rope_layer_types(cfg)
        self.register_buffer(
            "cos_sin_identity_row", torch.empty(1, rotary_dim_of(cfg)), persistent=False
        )
        self._cos_sin_identity: torch.Tensor | None = None  # set by init_rope
        for name in [t for t in self.rope_types if t is not None]:
            table = torch.empty(max_positions, rotary_dim_of(cfg))
            self.register_buffer(f"cos_sin_{name}", table, persistent=False)

    # ---- what a subclass (deepseek.py, glm4_moe.py, gemma.py) replaces -----------------------

    # runner/models/norm_fold.py may fold the two norms of each layer into its projections
    norms_foldable = True

    def _decoder_layer(self, cfg: Any, layer: int) -> nn.Module:
        return DecoderLayer(cfg, self._attention(cfg, layer), self._feed_forward(cfg, layer))

    def _final_norm(self, cfg: Any) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _attention(self, cfg: Any, layer: int) -> nn.Module:
        return Attention(cfg, family_spec(cfg), self.workspace, sliding_window_of(cfg, layer))

    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        spec = moe.moe_spec(cfg)
        if moe.is_sparse_layer(cfg, spec, layer):
            return moe.SparseMoeBlock(cfg.hidden_size, spec, self.workspace)
        bias = bool(getattr(cfg, "mlp_bias", False) or getattr(cfg, "use_bias", False))
        return MLP(cfg.hidden_size, cfg.intermediate_size, bias, self.workspace, activation_of(cfg))

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """One layer's KV block: `[2, block_size, kv_heads, head_dim]` (paged GQA)."""
        return (2, block_size, self.num_kv_heads, self.head_dim)

    def _after_load(self) -> None:
        """Rearranges loaded weights where a family needs it: interleaved-RoPE q/k rows into
        halves (ERNIE 4.5); Granite's residual multiplier into the o and down projections,
        whose outputs it scales (nothing for Llama)."""
        if family_spec(self.config).rope_interleaved:
            for layer in self.layers:
                _interleaved_to_halves(layer.self_attn)
        if self.residual_multiplier == 1.0:
            return
        for layer in self.layers:
            for linear_layer in (layer.self_attn.o_proj, layer.mlp.down_proj):
                linear_layer.weight.mul_(self.residual_multiplier)
                if linear_layer.bias is not None:
                    linear_layer.bias.mul_(self.residual_multiplier)

    def init_rope(self) -> None:
        cache = self.cos_sin_cache
        self.cos_sin_cache = build_cos_sin_cache(
            self.config, rotary_dim_of(self.config), cache.shape[0], cache.device
        )
        if self.nope_layers:  # float32, as every table (the buffer took the model's dtype)
            row = torch.zeros(1, cache.shape[1], dtype=torch.float32, device=cache.device)
            row[:, : row.shape[1] // 2] = 1.0
            self.cos_sin_identity_row = row
            self._cos_sin_identity = row.expand(cache.shape[0], -1)
        for layer_type in self.rope_types:
            if layer_type is not None:
                table = build_cos_sin_cache(
                    self.config, cache.shape[1], cache.shape[0], cache.device, layer_type
                )
                setattr(self, f"cos_sin_{layer_type}", table)

    def layer_cos_sin(self, layer: int) -> torch.Tensor:
        """The cos/sin table layer `layer` rotates with: its layer type's, or the one for
        all layers; the identity for a NoPE layer."""
        if layer in self.nope_layers:
            return self._cos_sin_identity
        if self.rope_types == [None]:
            return self.cos_sin_cache
        return getattr(self, f"cos_sin_{self.config.layer_types[layer]}")

    @property
    def num_kv_heads(self) -> int:
        return self._first_attention().num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._first_attention().head_dim

    def _first_attention(self) -> nn.Module:
        """An attention layer, whose geometry the KV cache takes."""
        return self.layers[0].self_attn

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden] final hidden states (before the norm).
        `layer_hook(i)` runs once layer i is queued (its KV written, in stream order): the
        prefill side of layer-wise transfer publishes each layer as it lands."""
        if chain_applies(self, input_ids.shape[0]):
            return folded_forward(self, input_ids, positions, kv_caches, attn, layer_hook)
        x, residual = self.embed(input_ids), None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, positions, self.layer_cos_sin(i), kv_cache, attn)
            if layer_hook is not None:
                layer_hook(i)
        return x + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden] inputs, times Granite's `embedding_multiplier` (1 elsewhere:
        no multiply is launched)."""
        x = self.embed_tokens(input_ids)
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[N, hidden] pre-norm hidden states of the rows to sample -> [N, vocab] float32
        (or the model's dtype with `float32=False`: the sampler converts only when it needs
        to; a plain argmax does not, which saves a [N, vocab] copy a step)."""
        h = self.norm(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.nn.functional.linear(h, weight)
        if self.logits_scaling != 1.0:  # Granite divides its logits
            logits = logits / self.logits_scaling
        return logits.float() if float32 else logits

    # ---- weights -------------------------------------------------------------------------

    # checkpoint name fragment -> (our fused parameter, shard index)
    _STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into our fused parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                if self._score_from_tokens():  # a causal LM converted into a classifier
                    self._score_from_head(tensor)
                    loaded.add("score.weight")
                continue  # tied: the embedding is the head
            local = moe.checkpoint_local_name(name.removeprefix("model."))
            if moe.load_expert_tensor(params, local, tensor, loaded):
                continue
            parts = local.split(".")
            fused = next((self._STACKED[p] for p in parts if p in self._STACKED), None)
            if fused is not None:
                frag = next(p for p in parts if p in self._STACKED)
                target = local.replace(frag, fused[0])
                param = params[target]
                sizes = self._shard_sizes(target, param)
                offset = sum(sizes[: fused[1]])
                param.data.narrow(0, offset, sizes[fused[1]]).copy_(tensor)
                loaded.add(f"{target}#{fused[1]}")
            else:
                if local not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                    )
                params[local].data.copy_(tensor)
                loaded.add(local)
                loaded.update(moe.expert_keys(local, params[local]) or ())  # all experts
                if "qkv_proj" in local or "gate_up_proj" in local:  # stored fused (Phi-3)
                    loaded.update(f"{local}#{i}" for i in range(3 if "qkv" in local else 2))
        if self._score_from_tokens() and "score.weight" not in loaded:  # tied: the embedding
            self._score_from_head(self.embed_tokens.weight)
            loaded.add("score.weight")
        self._check_all_loaded(params, loaded)
        self._after_load()

    def attach_classifier(self, spec: ClassifierSpec) -> None:
        """The classifier's head (runner/classify.py): [num_labels, hidden], loaded as
        `score.weight` or made from LM-head rows."""
        self.classifier = spec
        self.score = nn.Linear(self.config.hidden_size, spec.num_labels, bias=False)

    def _score_from_tokens(self) -> bool:
        return self.classifier is not None and bool(self.classifier.from_token_ids)

    def _score_from_head(self, head: torch.Tensor) -> None:
        """`score.weight` from the LM head's rows of the classifier's tokens; a two-way
        head's one row is the positive token's minus the negative's (in fp32, rounded
        once)."""
        assert self.classifier is not None and self.score is not None
        rows = head[list(self.classifier.from_token_ids)].float()
        if self.classifier.two_way:
            rows = rows[1:2] - rows[0:1]
        self.score.weight.copy_(rows)

    def _shard_sizes(self, target: str, param: nn.Parameter) -> list[int]:
        if "qkv_proj" in target:
            attn = self._first_attention()
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = param.shape[0] // 2  # a dense layer's, or an MoE layer's shared expert's
        return [inter, inter]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name, param in params.items():
            experts = moe.expert_keys(name, param)
            if experts is not None:
                missing += [key for key in experts if key not in loaded]
            elif "qkv_proj" in name or "gate_up_proj" in name:
                shards = 3 if "qkv_proj" in name else 2
                missing += [f"{name}#{i}" for i in range(shards) if f"{name}#{i}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
