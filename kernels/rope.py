"""Rotary position embedding, NeoX style (rotate_half), from a precomputed cos/sin table.

`cos_sin_cache` is `[max_positions, rotary_dim]`: the first half holds cos, the second
sin, of `position * inv_freq` (already multiplied by any attention scaling the RoPE
variant defines). The table is built by `runner.models.rope`, which knows the variants.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32: cos half | sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).unsqueeze(1).to(q.dtype)
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rope(q, k, positions, cos_sin_cache):
    assert q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[1], "rope covers the full head dim"
    return apply_rope_ref(q, k, positions, cos_sin_cache)
