"""One decode step of Mamba2's selective state space (runner/models/mamba2.py), in place
in the state cache.

For each row r (one token), head h, head feature p and state feature n, from the state of
the row's unit (zero for a fresh row):

    state = state * exp(dt[r, h] * a[h]) + dt[r, h] * x[r, h, p] * b[r, g, n]
    y[r, h, p] = sum_n state * c[r, g, n] + d_skip[h] * x[r, h, p]

with g = h // heads_per_group, and the new state stored back at the unit in the cache's
dtype. `ssm_decode_ref` is the spec and the CPU path. The torch form makes ~10 passes
over the rows' states ([R, H, P, N] float32: 805 MB for 512 rows of Granite-4.0-H's 48
heads of 64 x 128); the Triton kernel reads and writes each state once: one program per
(row, head, block of head features) keeps its [BLOCK_P, N] tile in registers.

What this module does not know: where dt, x, B and C come from (the convolution and the
time-step softplus stay with the model), or which rows are pads (their units are a
scratch unit: runner/mrv2/mamba_state.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def ssm_decode_ref(
    cache: torch.Tensor,  # [U, H, P, N] a layer's states, updated in place at `units`
    units: torch.Tensor,  # [R] int64
    fresh: torch.Tensor,  # [R] bool: the row's state starts from zero
    x: torch.Tensor,  # [R, H, P] float32
    dt: torch.Tensor,  # [R, H] float32, after softplus (and clamp)
    a: torch.Tensor,  # [H] float32, negative
    b: torch.Tensor,  # [R, G, N] float32
    c: torch.Tensor,  # [R, G, N] float32
    d_skip: torch.Tensor,  # [H] float32
) -> torch.Tensor:
    """-> y [R, H, P] float32."""
    per = x.shape[1] // b.shape[1]
    b, c = b.repeat_interleave(per, dim=1), c.repeat_interleave(per, dim=1)  # [R, H, N]
    keep = (~fresh)[:, None, None, None].float()
    state = cache[units].float() * keep
    state = (
        state * torch.exp(dt * a)[..., None, None]
        + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    )
    cache[units] = state.to(cache.dtype)
    return (state * c[:, :, None, :]).sum(-1) + d_skip[:, None] * x


@triton.jit
def _ssm_decode_kernel(
    cache_ptr, units_ptr, fresh_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
    num_heads, head_dim, state_dim, heads_per_group, num_groups,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < head_dim, n < state_dim
    tile_ok = p_ok[:, None] & n_ok[None, :]
    unit = tl.load(units_ptr + r).to(tl.int64)
    keep = 1.0 - tl.load(fresh_ptr + r).to(tl.float32)
    g = h // heads_per_group
    # int64: units x heads x head_dim x state passes 2^31 at ~700 units of a 48 x 64 x 128
    # layer
    tile = ((unit * num_heads + h) * head_dim + p[:, None]) * state_dim + n[None, :]
    state = tl.load(cache_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32) * keep
    row_h = r.to(tl.int64) * num_heads + h
    x = tl.load(x_ptr + row_h * head_dim + p, mask=p_ok, other=0.0)
    dt = tl.load(dt_ptr + row_h)
    decay = tl.exp(dt * tl.load(a_ptr + h))
    row_g = (r.to(tl.int64) * num_groups + g) * state_dim
    b = tl.load(b_ptr + row_g + n, mask=n_ok, other=0.0)
    c = tl.load(c_ptr + row_g + n, mask=n_ok, other=0.0)
    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(cache_ptr + tile, state.to(cache_ptr.dtype.element_ty), mask=tile_ok)
    y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + h) * x
    tl.store(y_ptr + row_h * head_dim + p, y, mask=p_ok)


def _check(cache, units, fresh, x, dt, a, b, c, d_skip) -> None:
    """The kernel's layout, checked on every path (`ssm_decode`), so the CPU tests see an
    input the GPU kernel would refuse."""
    rows, heads, head_dim = x.shape
    groups, state_dim = b.shape[1], b.shape[2]
    assert cache.shape[1:] == (heads, head_dim, state_dim) and cache.is_contiguous(), (
        f"cache {tuple(cache.shape)} is [units, {heads}, {head_dim}, {state_dim}], contiguous"
    )
    assert heads % groups == 0 and c.shape == b.shape, "B and C are [R, groups, N]"
    for name, t in (("x", x), ("dt", dt), ("a", a), ("b", b), ("c", c), ("d_skip", d_skip)):
        assert t.dtype == torch.float32 and t.is_contiguous(), f"{name}: contiguous float32"
    assert units.shape == fresh.shape == (rows,) and fresh.dtype == torch.bool


def ssm_decode_triton(cache, units, fresh, x, dt, a, b, c, d_skip) -> torch.Tensor:
    """`ssm_decode_ref` on the GPU (or Triton's interpreter); no host sync, so a decode
    graph captures it."""
    _check(cache, units, fresh, x, dt, a, b, c, d_skip)
    rows, heads, head_dim = x.shape
    groups, state_dim = b.shape[1], b.shape[2]
    y = torch.empty_like(x)
    if rows == 0:
        return y
    block_n = triton.next_power_of_2(state_dim)
    # a [BLOCK_P, N] float32 tile of <= 8k values: 64 x 128 in 8 warps' registers
    block_p = min(triton.next_power_of_2(head_dim), max(1, 8192 // block_n))
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    _ssm_decode_kernel[grid](
        cache, units, fresh.view(torch.uint8), x, dt, a, b, c, d_skip, y, heads, head_dim, state_dim,
        heads // groups, groups, BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=8 if block_p * block_n >= 4096 else 4,
    )  # fmt: skip
    return y


def ssm_decode(cache, units, fresh, x, dt, a, b, c, d_skip) -> torch.Tensor:
    if cache.is_cuda:  # the launcher checks the layout itself
        return ssm_decode_triton(cache, units, fresh, x, dt, a, b, c, d_skip)
    # the GPU's layout on the CPU path too, so CPU tests catch a view
    _check(cache, units, fresh, x, dt, a, b, c, d_skip)
    return ssm_decode_ref(cache, units, fresh, x, dt, a, b, c, d_skip)
