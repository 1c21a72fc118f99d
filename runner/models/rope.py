"""RoPE frequencies for the scaling variants Llama-family configs use, and the cos/sin table.

Supported `rope_type`s: default, linear, llama3, yarn, longrope. Others (dynamic NTK, ...)
depend on the running sequence length or per-request state and are reported as
unsupported by `runner.runner_select`, which then falls back to the reference runner.

LongRoPE (Phi-3.5, Phi-4-mini) has two sets of factors: transformers switches from the
short to the long set for a forward whose sequence passes
`original_max_position_embeddings`, so keys cached before the switch were rotated with the
other set. Here, as in vLLM, the set is chosen once per engine: the long one when
max_model_len passes the original length (a warning says so), the short one otherwise,
so every token of every request rotates alike and a cached key never goes stale. Both
agree with transformers on sequences on their side of the original length.
The formulas mirror the published definitions so that inverse frequencies are
bit-identical to transformers' (tests compare them).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings as one dict (transformers 5 `rope_parameters`, or 4.x
    `rope_theta` + `rope_scaling`). Configs whose layer types rotate differently (Gemma 3:
    local layers at base 10,000, global ones at 1,000,000, maybe linearly scaled) keep one
    dict per type; `layer_type` picks one (None: the first layer's)."""
    params = getattr(hf_config, "rope_parameters", None)
    if per_layer_type(hf_config):
        if layer_type is None:
            layer_type = hf_config.layer_types[0]
        params = params[layer_type]
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(hf_config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    return out


def per_layer_type(hf_config: Any) -> bool:
    """Whether `rope_parameters` holds one dict per layer type (keyed by `layer_types`)."""
    params = getattr(hf_config, "rope_parameters", None)
    types = getattr(hf_config, "layer_types", None) or []
    return isinstance(params, dict) and bool(types) and all(t in params for t in types)


def rope_layer_types(hf_config: Any) -> list[str | None]:
    """The layer types with their own RoPE settings, or [None] for one set for all."""
    return list(dict.fromkeys(hf_config.layer_types)) if per_layer_type(hf_config) else [None]


def rope_free_layers(hf_config: Any) -> frozenset[int]:
    """Layers that rotate no position (NoPE): SmolLM3's `no_rope_layers[i] == 0`, EXAONE
    4's and Cohere 2's full-attention layers when they have sliding ones (their "global
    NoPE"), and every
    layer of NemotronH and Jamba, and of Granite 4.0-H without `position_embedding_type:
    rope`."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type in ("nemotron_h", "jamba") or (
        model_type == "granitemoehybrid"
        and getattr(hf_config, "position_embedding_type", None) != "rope"
    ):  # NemotronH's attention, and Granite 4.0-H's unless its config says "rope": NoPE
        return frozenset(range(hf_config.num_hidden_layers))
    flags = getattr(hf_config, "no_rope_layers", None)
    if flags:
        return frozenset(i for i, rope in enumerate(flags) if not rope)
    if getattr(hf_config, "model_type", "") in ("exaone4", "cohere2") and hf_config.sliding_window:
        types = hf_config.layer_types
        return frozenset(i for i, t in enumerate(types) if t == "full_attention")
    return frozenset()


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p["factor"]
    orig = p.get("original_max_position_embeddings") or max_pos

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_factor) + extrapolated * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(
    hf_config: Any, base: float, dim: int, p: dict[str, Any], max_model_len: int | None
) -> tuple[torch.Tensor, float]:
    orig = int(p.get("original_max_position_embeddings")
               or hf_config.original_max_position_embeddings)  # fmt: skip
    factor = p.get("factor") or hf_config.max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    use_long = max_model_len is not None and max_model_len > orig
    if use_long:
        logger.warning(
            "LongRoPE: max_model_len %d passes the original %d positions, so every sequence "
            "rotates with the long factors (as vLLM does), which costs some quality on short "
            "ones; set max_model_len <= %d to use the short factors",
            max_model_len, orig, orig,
        )  # fmt: skip
    ext = torch.tensor(p["long_factor"] if use_long else p["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), float(attention_factor)


def inv_freq_and_scaling(
    hf_config: Any,
    head_dim: int,
    layer_type: str | None = None,
    max_model_len: int | None = None,  # longrope: the long factors when it passes the original
) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] float32 inverse frequencies and the attention scaling for cos/sin."""
    p = rope_parameters(hf_config, layer_type)
    rope_type, base = p["rope_type"], float(p["rope_theta"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by the mrv2 runner "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "yarn":
        return _yarn(base, head_dim, p, int(hf_config.max_position_embeddings))
    if rope_type == "longrope":
        return _longrope(hf_config, base, head_dim, p, max_model_len)
    inv_freq = _default_inv_freq(base, head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / p["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, p)
    return inv_freq, 1.0


def build_cos_sin_cache(
    hf_config: Any,
    head_dim: int,
    max_positions: int,
    device: torch.device | str = "cpu",
    layer_type: str | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(pos * inv_freq) | sin(pos * inv_freq), scaled.
    The table covers positions up to max_model_len inclusive (loader.py)."""
    inv_freq, scaling = inv_freq_and_scaling(hf_config, head_dim, layer_type, max_positions - 1)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # one rounding, as in transformers' matmul
    cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return cache.to(device)
