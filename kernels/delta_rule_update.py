"""One decode step of the gated delta rule (Qwen3-Next's Gated DeltaNet,
runner/models/gated_deltanet.py), in place in the state cache.

For each row r (one token) and value head h, from the state S [dk, dv] of the row's unit
(zero for a fresh row):

    S <- exp(g[r, h]) S;   u = beta[r, h] (v[r, h] - S^T k[r, h]);   S <- S + k u^T
    o[r, h] = S^T q[r, h]

with the new S stored back at the unit in the cache's dtype. `delta_rule_decode_ref` is
the spec and the CPU path. A value head's state is 64 KB in float32 (128 x 128), so the
torch form's passes over it (decay, two contractions, the rank-one update, the gather and
scatter) cost ~8 reads and writes of every state a step; the Triton kernel reads and
writes it once: one program per (row, head, block of dv) keeps its [dk, BLOCK_V] tile in
registers (each dv column's update needs only its own column of S).

What this module does not know: where q, k, v, beta and g come from, or which rows are
pads (their units are a scratch unit: runner/mrv2/mamba_state.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def delta_rule_decode_ref(
    cache: torch.Tensor,  # [U, H, dk, dv] a layer's states, updated in place at `units`
    units: torch.Tensor,  # [R] int64
    fresh: torch.Tensor,  # [R] bool: the row's state starts from zero
    q: torch.Tensor,  # [R, H, dk] float32
    k: torch.Tensor,  # [R, H, dk] float32
    v: torch.Tensor,  # [R, H, dv] float32
    beta: torch.Tensor,  # [R, H] float32
    g: torch.Tensor,  # [R, H] float32, <= 0
) -> torch.Tensor:
    """-> o [R, H, dv] float32."""
    s = cache[units].float() * (~fresh)[:, None, None, None].float()
    s = s * torch.exp(g)[..., None, None]
    u = (v - torch.einsum("rhkv,rhk->rhv", s, k)) * beta[..., None]
    s = s + k[..., None] * u[..., None, :]
    cache[units] = s.to(cache.dtype)
    return torch.einsum("rhkv,rhk->rhv", s, q)


@triton.jit
def _delta_rule_decode_kernel(
    cache_ptr, units_ptr, fresh_ptr, q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, o_ptr,
    num_heads, dk, dv, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < dk, vv < dv
    tile_ok = k_ok[:, None] & v_ok[None, :]
    unit = tl.load(units_ptr + r).to(tl.int64)
    keep = 1.0 - tl.load(fresh_ptr + r).to(tl.float32)
    # int64: units x heads x dk x dv passes 2^31 at ~4k units of 32 heads of 128 x 128
    tile = ((unit * num_heads + h) * dk + kk[:, None]) * dv + vv[None, :]
    row_h = r.to(tl.int64) * num_heads + h
    s = tl.load(cache_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32) * keep
    s = s * tl.exp(tl.load(g_ptr + row_h))
    q = tl.load(q_ptr + row_h * dk + kk, mask=k_ok, other=0.0)
    k = tl.load(k_ptr + row_h * dk + kk, mask=k_ok, other=0.0)
    v = tl.load(v_ptr + row_h * dv + vv, mask=v_ok, other=0.0)
    u = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + row_h)
    s = s + k[:, None] * u[None, :]
    tl.store(cache_ptr + tile, s.to(cache_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(o_ptr + row_h * dv + vv, tl.sum(s * q[:, None], axis=0), mask=v_ok)


def _check(cache, units, fresh, q, k, v, beta, g) -> None:
    """The kernel's layout, checked on every path (`delta_rule_decode`), so the CPU tests
    see an input the GPU kernel would refuse."""
    rows, heads, dk = q.shape
    dv = v.shape[2]
    assert cache.shape[1:] == (heads, dk, dv) and cache.is_contiguous(), (
        f"cache {tuple(cache.shape)} is [units, {heads}, {dk}, {dv}], contiguous"
    )
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g)):
        assert t.dtype == torch.float32 and t.is_contiguous(), f"{name}: contiguous float32"
    assert k.shape == q.shape and v.shape[:2] == beta.shape == g.shape == (rows, heads)
    assert units.shape == fresh.shape == (rows,) and fresh.dtype == torch.bool


def delta_rule_decode_triton(cache, units, fresh, q, k, v, beta, g) -> torch.Tensor:
    """`delta_rule_decode_ref` on the GPU (or Triton's interpreter); no host sync, so a
    decode graph captures it."""
    _check(cache, units, fresh, q, k, v, beta, g)
    rows, heads, dk = q.shape
    dv = v.shape[2]
    o = torch.empty_like(v)
    if rows == 0:
        return o
    block_k = triton.next_power_of_2(dk)
    # a [dk, BLOCK_V] float32 tile of <= 8k values: 128 x 64 in 8 warps' registers
    block_v = min(triton.next_power_of_2(dv), max(1, 8192 // block_k))
    grid = (rows, heads, triton.cdiv(dv, block_v))
    _delta_rule_decode_kernel[grid](
        cache, units, fresh.view(torch.uint8), q, k, v, beta, g, o, heads, dk, dv,
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=8 if block_k * block_v >= 4096 else 4,
    )  # fmt: skip
    return o


def delta_rule_decode(cache, units, fresh, q, k, v, beta, g) -> torch.Tensor:
    if cache.is_cuda:  # the launcher checks the layout itself
        return delta_rule_decode_triton(cache, units, fresh, q, k, v, beta, g)
    # the GPU's layout on the CPU path too, so CPU tests catch a view
    _check(cache, units, fresh, q, k, v, beta, g)
    return delta_rule_decode_ref(cache, units, fresh, q, k, v, beta, g)
