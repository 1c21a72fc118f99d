"""Triton MoE experts: grouped GEMMs over expert-sorted blocks of (token, pick) slots.

`moe_experts_ref` (kernels/moe.py) is the spec. A batch of T tokens with k picks each has
S = T * k slots; slot s is token s // k's pick s % k. The device path, with no host read
of which experts the batch uses (so a decode step can sync-free run it and be captured in a
CUDA graph):

1. `align_slots` (torch ops on the device): the slots sorted by expert, each expert's run
   padded with the sentinel S to a multiple of BLOCK_M, and for every BLOCK_M-slot block
   its expert (-1 for blocks past the last run). The number of blocks is bounded on the
   host by S and E, so the grid never depends on device values.
2. `_gate_up_kernel`: a program takes one block and BLOCK_N intermediate features; it
   gathers its tokens' rows of x, multiplies them by the expert's gate and up rows (plus
   their biases, gpt-oss) and writes the gate (silu(gate) * up, gpt-oss's clamped
   variant, or NemotronH's relu(up)^2 from up rows alone) for its slots ([S, I]).
3. `_down_kernel`: the same over the down projection (plus its bias), scaling each slot's
   row by its routing weight ([S, H]).
4. The k rows of a token are summed by `Tensor.sum` (fixed order: no atomics, so a
   token's output does not depend on what else is in the batch).

Rounding points are the reference's (see `moe_experts_ref`). `choose_tiles` sizes the
blocks by the mean run: 16 slots (the smallest `tl.dot` tile) while experts hold a few
slots each (decode: 32 tokens x 8 picks over 128 experts is 2 a run), up to 64 for
prefill-sized runs, where each block re-reads its expert's weights. The tiles are first
guesses, not yet measured on a GPU (`benchmarks/moe_bench.py --sweep` measures them).

On CPU tensors this runs only under TRITON_INTERPRET=1, which is how the tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.attention_parts import attention_dot
from pdserve.kernels.expert_act import SILU, ExpertAct

BLOCK_M = 16  # the smallest block (decode sizes)


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # slots a block
    block_n: int  # output features a program
    block_k: int
    num_warps: int
    num_stages: int


def choose_tiles(num_slots: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """Blocks of the mean run's size (16-64); fp32 tiles are twice the bytes, half as deep."""
    mean_run = num_slots / num_experts
    block_m = 16 if mean_run <= 16 else 32 if mean_run <= 64 else 64
    block_k = 64 if dtype in (torch.bfloat16, torch.float16) else 32
    return MoeTiles(block_m, 64, block_k, num_warps=4, num_stages=3)


def max_blocks(num_slots: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Blocks enough for any routing of `num_slots` slots: each expert that gets a slot
    pads its run by at most block_m - 1, and at most min(E, S) experts get one."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m)


def align_slots(ids: Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[Tensor, Tensor]:
    """[T, k] expert ids -> (sorted_slots [B * block_m] int32, block_expert [B] int32).

    sorted_slots lists the slots expert by expert (within an expert in slot order), each
    expert's run starting on a block boundary, padding = S; block_expert[b] is the expert
    of block b, -1 past the runs. B = `max_blocks(S, E)`.
    """
    num_slots = ids.numel()
    device = ids.device
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)
    run_start = run_end - padded
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[run_start[sorted_experts] + rank] = order.to(torch.int32)
    block_first = torch.arange(num_blocks, device=device) * block_m
    # The expert whose padded run [run_start, run_end) holds the block's first slot; runs
    # of empty experts have no length and are never found.
    block_expert = torch.searchsorted(run_end, block_first, right=True)
    block_expert = torch.where(block_first < run_end[-1], block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert


@triton.jit
def block_slots(sorted_slots_ptr, block, num_slots, BLOCK_M: tl.constexpr):
    """A block's slots, and which are real (padding holds `num_slots`)."""
    slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return slots, slots < num_slots


@triton.jit
def gate_act(gate, up, dtype: tl.constexpr, OAI_GATE: tl.constexpr, ALPHA: tl.constexpr,
          LIMIT: tl.constexpr, RELU2: tl.constexpr):  # fmt: skip
    """float32 gate and up (already rounded to `dtype`) -> the gated value in `dtype`,
    rounding after each op as `gate_act_ref` does (RELU2: `up` alone, relu(up)^2)."""
    if RELU2:
        r = tl.maximum(up, 0.0)
        return (r * r).to(dtype)
    if OAI_GATE:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        scaled = (gate * ALPHA).to(dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
        glu = (gate * sig).to(dtype).to(tl.float32)
        return ((up + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H] ([E, I, H]: RELU2), unit stride on H
    bias_ptr,  # [E, 2I] ([E, I]: RELU2) (HAS_BIAS)
    out_ptr,  # [S, I]
    sorted_slots_ptr,  # [B * BLOCK_M] int32
    block_expert_ptr,  # [B] int32
    num_slots,
    top_k,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OAI_GATE: tl.constexpr,  # gpt-oss's clamped gate, else silu
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    RELU2: tl.constexpr,  # NemotronH's ungated relu(up)^2: no gate rows
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        slots, valid = block_slots(sorted_slots_ptr, block, num_slots, BLOCK_M)
        tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        gate_rows = w_ptr + expert * stride_we + n.to(tl.int64)[None, :] * stride_wn
        up_rows = gate_rows if RELU2 else gate_rows + inter * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(
                x_ptr + tokens[:, None] * stride_xt + k[None, :],
                mask=valid[:, None] & k_ok[None, :], other=0.0,
            )  # fmt: skip
            w_mask = k_ok[:, None] & n_ok[None, :]
            if not RELU2:
                w_gate = tl.load(gate_rows + k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, N]
                acc_gate = attention_dot(a, w_gate, acc_gate, DOT_PRECISION, UPCAST_DOT)
            w_up = tl.load(up_rows + k[:, None], mask=w_mask, other=0.0)
            acc_up = attention_dot(a, w_up, acc_up, DOT_PRECISION, UPCAST_DOT)
        if HAS_BIAS:
            if RELU2:
                bias_row = bias_ptr + expert * inter + n
                acc_up += tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            else:
                bias_row = bias_ptr + expert * 2 * inter + n
                acc_gate += tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                acc_up += tl.load(bias_row + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        out = out_ptr + slots.to(tl.int64)[:, None] * inter + n[None, :]
        tl.store(
            out,
            gate_act(gate, up, dtype, OAI_GATE, ALPHA, LIMIT, RELU2),
            mask=valid[:, None] & n_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr,  # [S, I]
    w_ptr,  # [E, H, I], unit stride on I
    bias_ptr,  # [E, H] (HAS_BIAS)
    weights_ptr,  # [S] float32 routing weights
    out_ptr,  # [S, H]
    sorted_slots_ptr,
    block_expert_ptr,
    num_slots,
    hidden,
    inter,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        slots, valid = block_slots(sorted_slots_ptr, block, num_slots, BLOCK_M)
        rows = tl.where(valid, slots, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = w_ptr + expert * stride_we + n.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            a = tl.load(
                h_ptr + rows[:, None] * inter + k[None, :],
                mask=valid[:, None] & k_ok[None, :], other=0.0,
            )  # fmt: skip
            w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = attention_dot(a, w, acc, DOT_PRECISION, UPCAST_DOT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * hidden + n, mask=n_ok, other=0.0).to(tl.float32)[
                None, :
            ]
        dtype = out_ptr.dtype.element_ty
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
        out = out_ptr + rows[:, None] * hidden + n[None, :]
        tl.store(out, y.to(dtype), mask=valid[:, None] & n_ok[None, :])


def moe_experts_triton(
    x: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    ids: Tensor,
    weights: Tensor,
    tiles: MoeTiles | None = None,
    b_gate_up: Tensor | None = None,  # [E, 2I]
    b_down: Tensor | None = None,  # [E, H]
    act: ExpertAct = SILU,
) -> Tensor:
    """`moe_experts_ref` on the GPU (or Triton's interpreter); shapes checked by the caller.
    `tiles` overrides `choose_tiles` (benchmarks/moe_bench.py's sweep)."""
    num_tokens, top_k = ids.shape
    num_experts, _, hidden = w_gate_up.shape
    inter = w_down.shape[2]
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return x.new_zeros(num_tokens, hidden)
    x = x if x.stride(1) == 1 else x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    t = tiles or choose_tiles(num_slots, num_experts, x.dtype)
    sorted_slots, block_expert = align_slots(ids, num_experts, t.block_m)
    num_blocks = block_expert.shape[0]
    launch = {
        "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
        # fp32 without tf32 rounding; bf16 upcast under the interpreter (attention_dot)
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        "UPCAST_DOT": x.device.type == "cpu" and x.dtype == torch.bfloat16,
        "num_warps": t.num_warps, "num_stages": t.num_stages,
    }  # fmt: skip
    has_bias = b_gate_up is not None
    if has_bias:
        b_gate_up, b_down = b_gate_up.contiguous(), b_down.contiguous()
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, t.block_n))](
        x, w_gate_up, b_gate_up if has_bias else x, h, sorted_slots, block_expert, num_slots,
        top_k, hidden, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        HAS_BIAS=has_bias, OAI_GATE=act.kind == "swiglu_oai", ALPHA=act.alpha,
        LIMIT=act.limit, RELU2=act.kind == "relu2", **launch,
    )  # fmt: skip
    terms = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, t.block_n))](
        h, w_down, b_down if has_bias else h, flat_weights, terms, sorted_slots, block_expert,
        num_slots, hidden, inter, w_down.stride(0), w_down.stride(1), HAS_BIAS=has_bias,
        **launch,
    )  # fmt: skip
    return terms.view(num_tokens, top_k, hidden).sum(dim=1)
