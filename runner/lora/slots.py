"""Adapters on the device: per projection, a stack of every loaded adapter's A and B, and
one per-token index saying which slot each token of the step runs with (0: none).

A site is one projection of one layer (`qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`). Our q/k/v and gate/up projections are fused, while an adapter's targets may
be the parts (`q_proj`, `k_proj`, ...): each part owns a block of `max_rank` columns of
the site's rank dimension and its row range of B, so the fused site's
`(x A^T) B^T` is exactly the parts' deltas side by side (the other blocks are zeros). A
rank below `max_rank` is padded with zero columns, which add exact zeros.

Families whose interleaved RoPE had their q/k rows reordered at load (GLM-4, ERNIE 4.5,
Llama 4, Command R: llama.py `interleaved_rows`) get the same order on their q/k B rows,
so a delta lands on the row its base weight moved to.

`apply` adds each token's `(x A_s^T) B_s^T` for its slot `s` (kernels/lora.py: two Triton
launches on CUDA, a loop over the slots on the CPU): no host sync and fixed buffers, so it
runs the same eagerly and inside the decode CUDA graphs (`token_slots` is written before
each step, in place).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pdserve.kernels.lora import add_lora
from pdserve.runner.lora.adapter import LoraAdapter
from pdserve.runner.models.mlp import MLP


class LoraSite:
    def __init__(
        self,
        token_slots: torch.Tensor,
        in_features: int,
        parts: dict[str, tuple[int, int, int]],  # target -> (rank block, first row, end row)
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        out_scale: float = 1.0,  # what the load folded into the base weight's output
        row_order: torch.Tensor | None = None,  # B's leading rows as the load reordered them
    ):
        self.token_slots = token_slots
        self.parts = parts
        self.max_rank = max_rank
        self.out_scale = out_scale
        self.row_order = row_order
        blocks = 1 + max(block for block, _, _ in parts.values())
        rows = max(end for _, _, end in parts.values())
        dev, dt = token_slots.device, dtype
        self.a = torch.zeros(num_slots, blocks * max_rank, in_features, device=dev, dtype=dt)
        self.b = torch.zeros(num_slots, rows, blocks * max_rank, device=dev, dtype=dt)

    def load(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` becomes these targets' A and B (every other entry of it zero)."""
        a, b = torch.zeros_like(self.a[slot]), torch.zeros_like(self.b[slot])
        for target, (la, lb) in weights.items():
            block, first, end = self.parts[target]
            if la.shape[1] != a.shape[1] or lb.shape[0] != end - first:
                raise ValueError(
                    f"{target}: A {tuple(la.shape)} / B {tuple(lb.shape)} do not fit the "
                    f"model's projection ({a.shape[1]} inputs, {end - first} outputs)"
                )
            k, r = block * self.max_rank, la.shape[0]
            a[k : k + r] = la.to(a.dtype)
            b[first:end, k : k + r] = (lb * self.out_scale).to(b.dtype)
        if self.row_order is not None:
            n = self.row_order.numel()
            b[:n] = b[:n][self.row_order]
        self.a[slot].copy_(a)
        self.b[slot].copy_(b)

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base projection of x [T, in]) plus each token's adapter delta,
        in place (kernels/lora.py)."""
        return add_lora(y, x, self.a, self.b, self.token_slots)


class LoraSlots:
    """`max_loras` adapter slots over a Llama-family model's layers (slot 0: no adapter)."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        max_tokens: int,
        dtype: torch.dtype,
    ):
        check_supported(model)
        from pdserve.runner.models.llama import family_spec, interleaved_rows

        interleaved = family_spec(model.config).rope_interleaved
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1 ({max_loras}, {max_rank})")
        device = model.embed_tokens.weight.device
        self.max_loras, self.max_rank = max_loras, max_rank
        self.token_slots = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.dtype = dtype
        self.by_name: dict[str, int] = {}
        self.sites: dict[tuple[int, str], tuple[LoraSite, str]] = {}  # (layer, target) ->
        slots, res = max_loras + 1, float(getattr(model, "residual_multiplier", 1.0))
        for i, layer in enumerate(model.layers):
            if getattr(layer, "has_attention", True):  # a hybrid's Mamba/MLP layers have none
                attn = layer.self_attn
                # q's rows: Qwen3-Next's carry each head's output gate beside its query
                kv = attn.kv_size
                q = attn.qkv_proj.out_features - 2 * kv
                qkv = {"q_proj": (0, 0, q), "k_proj": (1, q, q + kv),
                       "v_proj": (2, q + kv, q + 2 * kv), "qkv_proj": (0, 0, q + 2 * kv)}  # fmt: skip
                order = interleaved_rows(attn) if interleaved else None
                attn.qkv_lora = self._site(i, qkv, attn.qkv_proj.in_features, slots, order=order)
                o = {"o_proj": (0, 0, attn.o_proj.out_features)}
                attn.o_lora = self._site(i, o, attn.o_proj.in_features, slots, res)
            mlp = _dense_mlp(layer)
            if isinstance(mlp, MLP):
                n = mlp.down_proj.in_features
                gu = {  # Granite 4.0-H's shared MLP stores gate and up as `input_linear`
                    "gate_proj": (0, 0, n),
                    "up_proj": (1, n, 2 * n),
                    "gate_up_proj": (0, 0, 2 * n),
                    "input_linear": (0, 0, 2 * n),
                }
                mlp.gate_up_lora = self._site(i, gu, mlp.gate_up_proj.in_features, slots)
                down = {"down_proj": (0, 0, mlp.down_proj.out_features),
                        "output_linear": (0, 0, mlp.down_proj.out_features)}  # fmt: skip
                mlp.down_lora = self._site(i, down, n, slots, res)
            elif mlp is not None:  # NemotronH's relu^2 MLP: up, then down, no gate
                up = {"up_proj": (0, 0, mlp.up.out_features)}
                mlp.up_lora = self._site(i, up, mlp.up.in_features, slots)
                down = {"down_proj": (0, 0, mlp.down_proj.out_features)}
                mlp.down_lora = self._site(i, down, mlp.down_proj.in_features, slots, res)
            mixer = getattr(layer, "mamba", None)
            if hasattr(mixer, "in_proj"):  # a hybrid's Mamba mixer (Mamba2 or Mamba1; Qwen3-
                # Next's Gated DeltaNet has other projections, and no sites)
                inp = {"in_proj": (0, 0, mixer.in_proj.out_features)}
                mixer.in_lora = self._site(i, inp, mixer.in_proj.in_features, slots)
                out = {"out_proj": (0, 0, mixer.out_proj.out_features)}
                mixer.out_lora = self._site(i, out, mixer.out_proj.in_features, slots, res)

    def _site(self, layer, parts, in_features, slots, out_scale=1.0, order=None) -> LoraSite:
        site = LoraSite(
            self.token_slots,
            in_features,
            parts,
            slots,
            self.max_rank,
            self.dtype,
            out_scale,
            order,
        )
        for target in parts:
            self.sites[(layer, target)] = (site, target)
        return site

    def index_of(self, name: str | None) -> int:
        return 0 if name is None else self.by_name[name]

    def add(self, adapter: LoraAdapter, evictable: Iterable[str] = ()) -> int:
        """Loads `adapter` into a free slot (or one whose adapter is in `evictable`: no
        request runs with it) and returns the slot; an adapter already loaded keeps its."""
        if adapter.name in self.by_name:
            return self.by_name[adapter.name]
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r}: rank {adapter.rank} > {self.max_rank}")
        per_site: dict[int, tuple[LoraSite, dict]] = {}
        for key, ab in adapter.weights.items():
            if key not in self.sites:
                layer, target = key
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} targets {target} of layer {layer}, which "
                    "this model does not have as a dense projection (MoE experts, "
                    "layers past the model's, fused-vs-split names of another family)"
                )
            site, target = self.sites[key]
            per_site.setdefault(id(site), (site, {}))[1][target] = ab
        for _, weights in per_site.values():
            fused = {"qkv_proj", "gate_up_proj"} & set(weights)
            if fused and len(weights) > 1:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} targets both {sorted(fused)[0]} and its parts"
                )
        used = set(self.by_name.values())
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if not free:
            gone = next((n for n in self.by_name if n in set(evictable)), None)
            if gone is None:
                raise ValueError(
                    f"{self.max_loras} LoRA adapters are in use by live requests; raise "
                    f"max_loras (--max-loras) to serve {adapter.name!r} beside them"
                )
            free = [self.by_name.pop(gone)]
        slot = free[0]
        loaded = {id(site) for site, _ in per_site.values()}
        for site in {id(s): s for s, _ in self.sites.values()}.values():
            site.load(slot, per_site[id(site)][1] if id(site) in loaded else {})
        self.by_name[adapter.name] = slot
        return slot


def _dense_mlp(layer: nn.Module) -> nn.Module | None:
    """The layer's dense MLP: llama's `MLP` (a Llama-family `mlp`, a hybrid's
    `feed_forward`, Granite 4.0-H's shared one beside its experts) or NemotronH's relu^2
    block (or its MoE block's shared expert); None for a Llama-family MoE layer and a Mamba
    or attention block. Routed experts take no adapter."""
    from pdserve.runner.models.nemotron_mlp import ReluSquaredMLP

    for name in ("feed_forward", "mlp", "mixer"):
        module = getattr(layer, name, None)
        if isinstance(module, MLP | ReluSquaredMLP):
            return module
    shared = getattr(getattr(layer, "mixer", None), "shared_experts", None)
    return shared if isinstance(shared, ReluSquaredMLP) else None  # NemotronH's MoE block


def check_supported(model: nn.Module) -> None:
    """LoRA runs where the layers are llama.py's Attention and MLP: the plain Llama-family
    model (Llama, Mistral, Qwen2/3, SmolLM, Granite, Phi-3, Seed-OSS, GLM-4-9B, ERNIE 4.5,
    and the attention and dense layers of Mixtral / Qwen-MoE / ERNIE 4.5 MoE / Llama 4 /
    GLM-4.5 / gpt-oss), Gemma 1/2/3 and GLM-4-0414 (sandwich norms around the same
    projections), Command R / R+ / R7B / A (a parallel block), Arcee (a gateless relu^2
    MLP), the post-norm families (OLMo 2/3, EXAONE 4) and the hybrid Mamba models (their
    attention, dense MLPs and Mamba mixers' in/out projections, Qwen3-Next's gated
    attention and dense MLPs; not their experts, nor Gated DeltaNet's projections); MLA is
    refused by name."""
    check_model_class(type(model), model.config)


def check_model_class(cls: type, hf_config: Any) -> None:
    """`check_supported` before a model is built (`pdserve serve` at start)."""
    from pdserve.runner.models.arcee import ArceeForCausalLM
    from pdserve.runner.models.cohere import CohereForCausalLM
    from pdserve.runner.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
    from pdserve.runner.models.gemma import Gemma1ForCausalLM, GemmaForCausalLM
    from pdserve.runner.models.glm4 import Glm4ForCausalLM
    from pdserve.runner.models.glm4_moe import Glm4MoeForCausalLM
    from pdserve.runner.models.gpt_oss import GptOssForCausalLM
    from pdserve.runner.models.llama import LlamaFamilyForCausalLM
    from pdserve.runner.models.llama4 import Llama4ForCausalLM
    from pdserve.runner.models.mamba_hybrid import MambaHybridForCausalLM
    from pdserve.runner.models.post_norm import PostNormForCausalLM

    served = (LlamaFamilyForCausalLM, GemmaForCausalLM, Gemma1ForCausalLM, PostNormForCausalLM,
              CohereForCausalLM, Glm4ForCausalLM, ArceeForCausalLM, Ernie4_5_MoeForCausalLM,
              Llama4ForCausalLM, Glm4MoeForCausalLM, GptOssForCausalLM)  # fmt: skip
    if cls not in served and not issubclass(cls, MambaHybridForCausalLM):
        raise ValueError(
            "LoRA adapters are served on Llama-family models (Llama 4, ERNIE 4.5 MoE, GLM-4.5 "
            "and gpt-oss too), Gemma, GLM-4, Command R, Arcee, OLMo/EXAONE and hybrid Mamba "
            f"models; {cls.__name__} ({hf_config.model_type}) is not one"
        )
