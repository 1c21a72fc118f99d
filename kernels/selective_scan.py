"""Mamba1's selective scan (runner/models/mamba1.py: Jamba's Mamba layers) over a step's
rows, each a run of one request's tokens, in place in the state cache.

For each row, its tokens t in order, channel d and state feature n, from the state of the
row's unit (zero for a fresh row):

    h[d, n] = exp(delta[t, d] * a[d, n]) * h[d, n] + delta[t, d] * u[t, d] * b[t, n]
    y[t, d] = sum_n h[d, n] * c[t, n] + d_skip[d] * u[t, d]

and the row's last h stored back at its unit in the cache's dtype. A is a [D, N] matrix,
so unlike Mamba2's scalar-per-head decay there is no chunked matrix form; the recurrence
runs token by token. `selective_scan_ref` is the spec and the CPU path: a torch loop over
each row's tokens, ~3 launches a token on a GPU. The Triton kernel runs one program per
(row, block of channels) that keeps its [BLOCK_D, N] state in registers and walks the
row's tokens, so a 2,048-token prompt is one launch and the [T, D, N] decay and input
tensors are never written.

Rows are given by `query_start` (a device tensor of R + 1 offsets), or, for a step of
one token a row (decodes), by `query_start=None`: row r is token r, and the launch reads
nothing from the host, so a decode graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def selective_scan_ref(
    cache: torch.Tensor,  # [U, D, N] a layer's states, updated in place at `units`
    units: torch.Tensor,  # [R] int64
    fresh: torch.Tensor,  # [R] bool: the row's state starts from zero
    query_start: torch.Tensor | None,  # [R + 1] int: row r is tokens [qs[r], qs[r + 1])
    u: torch.Tensor,  # [T, D] float32, the conv's output
    delta: torch.Tensor,  # [T, D] float32, after softplus
    a: torch.Tensor,  # [D, N] float32, negative
    b: torch.Tensor,  # [T, N] float32
    c: torch.Tensor,  # [T, N] float32
    d_skip: torch.Tensor,  # [D] float32
) -> torch.Tensor:
    """-> y [T, D] float32."""
    if query_start is None:  # one token a row: the rows at once
        h0 = torch.where(fresh[:, None, None], 0.0, cache[units].float())
        h = torch.exp(delta[..., None] * a) * h0
        h = h + (delta * u)[..., None] * b[:, None, :]  # [R, D, N]
        cache[units] = h.to(cache.dtype)
        return (h * c[:, None, :]).sum(-1) + d_skip * u
    qs = query_start.tolist()
    y = torch.empty_like(u)
    for r, (first, end) in enumerate(zip(qs[:-1], qs[1:], strict=True)):
        h = torch.zeros_like(cache[0], dtype=torch.float32) if fresh[r] else cache[units[r]].float()
        for t in range(first, end):
            h = torch.exp(delta[t, :, None] * a) * h + (delta[t] * u[t])[:, None] * b[t]
            y[t] = h @ c[t]
        cache[units[r]] = h.to(cache.dtype)
    return y + d_skip * u


@triton.jit
def _selective_scan_kernel(
    cache_ptr, units_ptr, fresh_ptr, qs_ptr, u_ptr, delta_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
    channels, state_dim,
    PER_TOKEN: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < channels, n < state_dim
    tile_ok = d_ok[:, None] & n_ok[None, :]
    if PER_TOKEN:
        first = r.to(tl.int64)
        end = first + 1
    else:
        first = tl.load(qs_ptr + r)
        end = tl.load(qs_ptr + r + 1)
    unit = tl.load(units_ptr + r).to(tl.int64)
    stale = tl.load(fresh_ptr + r) == 0  # a fresh row starts from zero, whatever its unit holds
    # int64: units x D x N passes 2^31 at ~16k units of an 8,192 x 16 layer
    tile = (unit * channels + d[:, None]) * state_dim + n[None, :]
    h = tl.load(cache_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    h = tl.where(stale, h, 0.0)
    a = tl.load(a_ptr + d[:, None] * state_dim + n[None, :], mask=tile_ok, other=0.0)
    d_skip = tl.load(d_ptr + d, mask=d_ok, other=0.0)
    for t in range(first, end):  # int64 (query_start's dtype): T x D may pass 2^31
        dl = tl.load(delta_ptr + t * channels + d, mask=d_ok, other=0.0)
        x = tl.load(u_ptr + t * channels + d, mask=d_ok, other=0.0)
        bt = tl.load(b_ptr + t * state_dim + n, mask=n_ok, other=0.0)
        ct = tl.load(c_ptr + t * state_dim + n, mask=n_ok, other=0.0)
        h = tl.exp(dl[:, None] * a) * h + (dl * x)[:, None] * bt[None, :]
        y = tl.sum(h * ct[None, :], axis=1) + d_skip * x
        tl.store(y_ptr + t * channels + d, y, mask=d_ok)
    tl.store(cache_ptr + tile, h.to(cache_ptr.dtype.element_ty), mask=tile_ok)


def _check(cache, units, fresh, query_start, u, delta, a, b, c, d_skip) -> None:
    """The kernel's layout, checked on every path (`selective_scan`), so the CPU tests see
    an input the GPU kernel would refuse."""
    tokens, channels = u.shape
    state_dim = b.shape[1]
    rows = units.shape[0]
    assert cache.shape[1:] == (channels, state_dim) and cache.is_contiguous(), (
        f"cache {tuple(cache.shape)} is [units, {channels}, {state_dim}], contiguous"
    )
    for name, t in (("u", u), ("delta", delta), ("a", a), ("b", b), ("c", c), ("d", d_skip)):
        assert t.dtype == torch.float32 and t.is_contiguous(), f"{name}: contiguous float32"
    assert delta.shape == u.shape and c.shape == b.shape == (tokens, state_dim)
    assert a.shape == (channels, state_dim) and fresh.shape == (rows,)
    assert fresh.dtype == torch.bool
    if query_start is None:
        assert rows == tokens, "one token a row without query_start"
    else:
        assert query_start.shape == (rows + 1,) and query_start.device == u.device
        assert query_start.dtype == torch.int64, "query_start: int64 (token offsets x D)"


def selective_scan_triton(cache, units, fresh, query_start, u, delta, a, b, c, d_skip):
    """`selective_scan_ref` on the GPU (or Triton's interpreter). With `query_start=None`
    no host sync, so a decode graph captures it."""
    _check(cache, units, fresh, query_start, u, delta, a, b, c, d_skip)
    channels, state_dim, rows = u.shape[1], b.shape[1], units.shape[0]
    y = torch.empty_like(u)
    if rows == 0:
        return y
    block_n = triton.next_power_of_2(state_dim)
    # a [BLOCK_D, N] float32 state of <= 2k values in 4 warps' registers; narrower blocks
    # when few rows would leave SMs idle (one 2,048-token prompt of Jamba's 8,192 channels:
    # 256 programs of 32)
    block_d = max(16, min(2048 // block_n, triton.next_power_of_2(channels)))
    if rows * triton.cdiv(channels, block_d) < 256:
        block_d = max(16, min(block_d, 32))
    grid = (rows, triton.cdiv(channels, block_d))
    qs = units if query_start is None else query_start  # unread when PER_TOKEN
    _selective_scan_kernel[grid](
        cache, units, fresh.view(torch.uint8), qs, u, delta, a, b, c, d_skip, y,
        channels, state_dim,
        PER_TOKEN=query_start is None, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return y


def selective_scan(cache, units, fresh, query_start, u, delta, a, b, c, d_skip) -> torch.Tensor:
    if cache.is_cuda:  # the launcher checks the layout itself
        return selective_scan_triton(cache, units, fresh, query_start, u, delta, a, b, c, d_skip)
    # the GPU's layout on the CPU path too, so CPU tests catch a view
    _check(cache, units, fresh, query_start, u, delta, a, b, c, d_skip)
    return selective_scan_ref(cache, units, fresh, query_start, u, delta, a, b, c, d_skip)
