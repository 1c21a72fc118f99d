"""LoRA deltas for a batch whose tokens run with different adapters (runner/lora/slots.py):
`y[t] += B_s (A_s x[t])` with `s = token_slots[t]` from stacks `A [S, R, K]` and
`B [S, N, R]`; slot 0 is the base model (all zeros, nothing added).

The reference loops over the slots, computing every slot's delta for every token and
keeping each token's own (`where`): no host sync, but 4 launches a slot.

Device path: two Triton kernels whatever the number of slots (punica's "BGMV" shape).
The shrink kernel gives each (token, rank block) a program that reads the token's slot and
reduces `A_s[r, :] . x[t]` over K in fp32 into a scratch `v [T, R]`; the expand kernel
gives each (token, output block) a program that adds `B_s[n, :] . v[t]` to `y[t, n]` in
fp32 and rounds once. A base-model token's programs read its slot and stop, so a batch
that uses no adapter pays two launches a projection and nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def add_lora_ref(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """y [T, N] += each token's delta, in place; `slots` [>= T] int32."""
    ids = slots[: x.shape[0], None]
    for s in range(1, a.shape[0]):
        delta = (x @ a[s].T) @ b[s].T
        y.add_(torch.where(ids == s, delta, 0))
    return y


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, v_ptr,
    K, R, x_stride, a_slot_stride, a_row_stride,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s != 0:
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        a_rows = a_ptr + s * a_slot_stride + rows[:, None].to(tl.int64) * a_row_stride
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xv = tl.load(x_ptr + t.to(tl.int64) * x_stride + ks, mask=k_ok, other=0.0)
            av = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(av.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        tl.store(v_ptr + t.to(tl.int64) * R + rows, acc, mask=row_ok)


@triton.jit
def _expand_kernel(
    v_ptr, b_ptr, slots_ptr, y_ptr,
    N, R, y_stride, b_slot_stride, b_row_stride,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s != 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        b_rows = b_ptr + s * b_slot_stride + cols[:, None].to(tl.int64) * b_row_stride
        delta = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):  # rank blocks: a large rank keeps its tile small
            rs = r0 + tl.arange(0, BLOCK_R)
            r_ok = rs < R
            vv = tl.load(v_ptr + t.to(tl.int64) * R + rs, mask=r_ok, other=0.0)
            bv = tl.load(b_rows + rs[None, :], mask=col_ok[:, None] & r_ok[None, :], other=0.0)
            delta += tl.sum(bv.to(tl.float32) * vv[None, :], axis=1)
        y_row = y_ptr + t.to(tl.int64) * y_stride + cols
        yv = tl.load(y_row, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(y_row, (yv + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`add_lora_ref` in two launches: the delta in fp32, added to y and rounded once."""
    t, k = x.shape
    num_slots, r, n = a.shape[0], a.shape[1], b.shape[1]
    assert a.shape == (num_slots, r, k) and b.shape == (num_slots, n, r), (a.shape, b.shape)
    assert y.shape == (t, n) and slots.dtype == torch.int32 and slots.numel() >= t
    if t == 0:
        return y
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    v = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = min(32, triton.next_power_of_2(r))
    block_k = min(256, triton.next_power_of_2(k))
    _shrink_kernel[(t, triton.cdiv(r, block_r))](
        x, a, slots, v, k, r, x.stride(0), a.stride(0), a.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    block_n = min(128, triton.next_power_of_2(n))
    _expand_kernel[(t, triton.cdiv(n, block_n))](
        v, b, slots, y, n, r, y.stride(0), b.stride(0), b.stride(1),
        BLOCK_N=block_n, BLOCK_R=min(64, triton.next_power_of_2(r)), num_warps=4,
    )  # fmt: skip
    return y


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    if x.is_cuda:
        return add_lora_triton(y, x, a, b, slots)
    return add_lora_ref(y, x, a, b, slots)
