"""MoE experts on packed integer weights (GPTQ / AWQ / compressed-tensors int4 and int8
experts kept packed on the GPU, runner/models/moe.py): kernels/moe_triton.py's grouped
GEMMs over expert-sorted slot blocks, each weight tile dequantized in registers as it
streams in, so the experts take a quarter (4-bit) or half (8-bit) of their 16-bit bytes.

Layout, per projection: kernels/int_linear.py's with an expert axis in front: `qweight`
int32 [E, N, ceil(K * bits / 32)] (output n's codes along K, the lowest bits first),
`scales` float32 [E, N, G] and `zeros` uint8 [E, N, G], input k in group k // group_size.
The gate/up projection stacks the gate's I rows, then the up's, as the 16-bit experts do.

The spec, `moe_experts_int_ref`, dequantizes every expert to x's dtype (the float32
product `(code - zero) * scale` rounded once, exactly as a checkpoint dequantized at load
is) and runs kernels/moe.py's `moe_experts_ref`; it is also the CPU path. The kernels build
the same rounded tile, so they differ from the spec only in summation order. SiLU-gated
experts without biases only (the families whose experts stay packed). The tiles are
moe_triton's first guesses, not yet measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.attention_parts import attention_dot
from pdserve.kernels.int_linear import dequantize_int
from pdserve.kernels.moe import moe_experts_ref
from pdserve.kernels.moe_triton import _block_slots, _gate, align_slots, choose_tiles


@dataclass(frozen=True)
class PackedExperts:
    """One projection of a layer's experts, packed: [E, N, K] weights in int_linear's layout."""

    qweight: Tensor  # int32 [E, N, words]
    scales: Tensor  # float32 [E, N, G]
    zeros: Tensor  # uint8 [E, N, G]
    bits: int
    group_size: int
    in_features: int  # K

    def __post_init__(self) -> None:
        e, n, words = self.qweight.shape
        groups = -(-self.in_features // self.group_size)
        assert self.bits in (4, 8), f"packed experts take 4- or 8-bit codes, got {self.bits}"
        assert words * (32 // self.bits) >= self.in_features, (
            f"{words} words a row hold fewer than {self.in_features} {self.bits}-bit codes"
        )
        assert self.scales.shape == self.zeros.shape == (e, n, groups), (
            f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must be "
            f"[{e}, {n}, {groups}]"
        )

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """[E, N, K] in `dtype`: each weight (code - zero) * scale, rounded once."""
        return torch.stack([
            dequantize_int(q, s, z, self.bits, self.in_features, self.group_size).to(dtype)
            for q, s, z in zip(self.qweight, self.scales, self.zeros, strict=True)
        ])  # fmt: skip


def moe_experts_int_ref(
    x: Tensor, gate_up: PackedExperts, down: PackedExperts, ids: Tensor, weights: Tensor
) -> Tensor:
    """The spec (and the CPU path): the experts dequantized to x's dtype, then
    `moe_experts_ref`."""
    return moe_experts_ref(x, gate_up.dequantized(x.dtype), down.dequantized(x.dtype), ids, weights)


@triton.jit
def _dequantized_tile(w_rows, s_rows, z_rows, n_ok, k0, k, words, group_size,
                      BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      dtype: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K] weights of inputs k0.. of the rows whose words start at `w_rows`
    and whose scales and zeros start at `s_rows` / `z_rows`: (code - zero) * scale in
    float32, rounded to `dtype`. Each word is loaded once and split in registers."""
    per_word: tl.constexpr = 32 // BITS
    wk = k0 // per_word + tl.arange(0, BLOCK_K // per_word)
    packed = tl.load(w_rows[:, None] + wk[None, :], mask=n_ok[:, None] & (wk < words)[None, :],
                     other=0)  # fmt: skip
    fields = tl.arange(0, per_word) * BITS
    codes = (packed[:, :, None] >> fields[None, None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, [BLOCK_N, BLOCK_K])
    kk = k0 + tl.arange(0, BLOCK_K)
    group = (kk // group_size)[None, :]
    mask = n_ok[:, None] & (kk < k)[None, :]
    s = tl.load(s_rows[:, None] + group, mask=mask, other=0.0)
    z = tl.load(z_rows[:, None] + group, mask=mask, other=0).to(tl.int32)
    return ((codes - z).to(tl.float32) * s).to(dtype)


@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_int_kernel(
    x_ptr,  # [T, H]
    q_ptr,  # [E, 2I, words] int32
    s_ptr,  # [E, 2I, groups] float32
    z_ptr,  # [E, 2I, groups] uint8
    out_ptr,  # [S, I]
    sorted_slots_ptr,
    block_expert_ptr,
    num_slots,
    top_k,
    hidden,
    inter,
    words,
    groups,
    group_size,
    stride_xt,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        slots, valid = _block_slots(sorted_slots_ptr, block, num_slots, BLOCK_M)
        tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        gate_rows = expert * 2 * inter + n.to(tl.int64)  # rows of the [E * 2I] stack
        up_rows = gate_rows + inter
        dtype = out_ptr.dtype.element_ty
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                        mask=valid[:, None] & (k < hidden)[None, :], other=0.0)  # fmt: skip
            w_gate = _dequantized_tile(q_ptr + gate_rows * words, s_ptr + gate_rows * groups,
                                       z_ptr + gate_rows * groups, n_ok, k0, hidden, words,
                                       group_size, BITS, BLOCK_N, BLOCK_K, dtype)  # fmt: skip
            acc_gate = attention_dot(a, tl.trans(w_gate), acc_gate, DOT_PRECISION, UPCAST_DOT)
            w_up = _dequantized_tile(q_ptr + up_rows * words, s_ptr + up_rows * groups,
                                     z_ptr + up_rows * groups, n_ok, k0, hidden, words,
                                     group_size, BITS, BLOCK_N, BLOCK_K, dtype)  # fmt: skip
            acc_up = attention_dot(a, tl.trans(w_up), acc_up, DOT_PRECISION, UPCAST_DOT)
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        out = out_ptr + slots.to(tl.int64)[:, None] * inter + n[None, :]
        tl.store(out, _gate(gate, up, dtype, False, 0.0, 0.0, False),
                 mask=valid[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_slots"])
def _down_int_kernel(
    h_ptr,  # [S, I]
    q_ptr,  # [E, H, words] int32
    s_ptr,  # [E, H, groups] float32
    z_ptr,  # [E, H, groups] uint8
    weights_ptr,  # [S] float32 routing weights
    out_ptr,  # [S, H]
    sorted_slots_ptr,
    block_expert_ptr,
    num_slots,
    hidden,
    inter,
    words,
    groups,
    group_size,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        slots, valid = _block_slots(sorted_slots_ptr, block, num_slots, BLOCK_M)
        rows = tl.where(valid, slots, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = expert * hidden + n.to(tl.int64)  # rows of the [E * H] stack
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + rows[:, None] * inter + k[None, :],
                        mask=valid[:, None] & (k < inter)[None, :], other=0.0)  # fmt: skip
            w = _dequantized_tile(q_ptr + w_rows * words, s_ptr + w_rows * groups,
                                  z_ptr + w_rows * groups, n_ok, k0, inter, words, group_size,
                                  BITS, BLOCK_N, BLOCK_K, dtype)  # fmt: skip
            acc = attention_dot(a, tl.trans(w), acc, DOT_PRECISION, UPCAST_DOT)
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
        out = out_ptr + rows[:, None] * hidden + n[None, :]
        tl.store(out, y.to(dtype), mask=valid[:, None] & n_ok[None, :])


def moe_experts_int_triton(
    x: Tensor, gate_up: PackedExperts, down: PackedExperts, ids: Tensor, weights: Tensor
) -> Tensor:
    """`moe_experts_int_ref` on the GPU (or Triton's interpreter)."""
    num_tokens, top_k = ids.shape
    num_experts, two_inter, _ = gate_up.qweight.shape
    hidden, inter = down.qweight.shape[1], two_inter // 2
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return x.new_zeros(num_tokens, hidden)
    x = x if x.stride(1) == 1 else x.contiguous()
    t = choose_tiles(num_slots, num_experts, x.dtype)
    sorted_slots, block_expert = align_slots(ids, num_experts, t.block_m)
    num_blocks = block_expert.shape[0]
    launch = {
        "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        "UPCAST_DOT": x.device.type == "cpu" and x.dtype == torch.bfloat16,
        "num_warps": t.num_warps, "num_stages": t.num_stages,
    }  # fmt: skip
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    gu = gate_up
    _gate_up_int_kernel[(num_blocks, triton.cdiv(inter, t.block_n))](
        x, gu.qweight, gu.scales, gu.zeros, h, sorted_slots, block_expert, num_slots, top_k,
        hidden, inter, gu.qweight.shape[2], gu.scales.shape[2], gu.group_size, x.stride(0),
        BITS=gu.bits, **launch,
    )  # fmt: skip
    terms = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _down_int_kernel[(num_blocks, triton.cdiv(hidden, t.block_n))](
        h, down.qweight, down.scales, down.zeros, flat_weights, terms, sorted_slots,
        block_expert, num_slots, hidden, inter, down.qweight.shape[2], down.scales.shape[2],
        down.group_size, BITS=down.bits, **launch,
    )  # fmt: skip
    return terms.view(num_tokens, top_k, hidden).sum(dim=1)


def moe_experts_int(
    x: Tensor, gate_up: PackedExperts, down: PackedExperts, ids: Tensor, weights: Tensor
) -> Tensor:
    """[T, H] -> [T, H]: the Triton kernels on CUDA, the spec elsewhere."""
    num_experts, two_inter, _ = gate_up.qweight.shape
    assert x.dim() == 2 and x.shape[1] == gate_up.in_features == down.qweight.shape[1], (
        f"x {tuple(x.shape)} must be [T, {gate_up.in_features}] and the down projection's "
        f"outputs {down.qweight.shape[1]}"
    )
    assert down.in_features * 2 == two_inter and down.qweight.shape[0] == num_experts, (
        f"down experts [{down.qweight.shape[0]}, ·, {down.in_features}] must match gate/up "
        f"[{num_experts}, {two_inter}, ·]"
    )
    assert ids.dim() == 2 and ids.shape[0] == x.shape[0] and weights.shape == ids.shape
    if x.is_cuda:
        return moe_experts_int_triton(x, gate_up, down, ids, weights)
    return moe_experts_int_ref(x, gate_up, down, ids, weights)
