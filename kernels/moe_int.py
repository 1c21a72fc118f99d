"""MoE experts on packed integer weights (GPTQ / AWQ / compressed-tensors int4 and int8
experts kept packed on the GPU, runner/models/moe.py): grouped GEMMs over kernels/
moe_triton.py's expert-sorted slot blocks whose weight tiles are unpacked in registers as
they stream in, so the experts take a quarter (4-bit) or half (8-bit) of their 16-bit bytes.

Layout, per projection: kernels/int_linear.py's with an expert axis in front: `qweight`
int32 [E, N, ceil(K * bits / 32)] (output n's codes along K, the lowest bits first),
`scales` float32 [E, N, G] and `zeros` uint8 [E, N, G], input k in group k // group_size.
The gate/up projection stacks the gate's I rows, then the up's, as the 16-bit experts do.

The spec, `moe_experts_int_ref`, dequantizes every expert to x's dtype (the float32
product `(code - zero) * scale` rounded once, exactly as a checkpoint dequantized at load
is) and runs kernels/moe.py's `moe_experts_ref`; it is also the CPU path. The kernels build
the same rounded tile, so they differ from the spec only in summation order. SiLU-gated
experts without biases only (the families whose experts stay packed).

The kernels are int_linear's (swap-AB: the weight tile is the MMA's M side, so a 16-slot
block needs no transposed tile; `int_tile` unpacks a tile's words once, and a tile within
one group loads one scale and zero an output). The first form, moe_triton's own kernels
with each dequantized tile transposed and a scale and zero loaded per weight, ran a
Qwen3-30B-A3B-shaped GPTQ model 10x slower than its 16-bit twin on an H100
(model_throughput_qwen3_30b_a3b_gptq4_*_d31c0a3.json).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.int_linear import (
    dequantize_int,
    fields_apply,
    float_magic,
    int_fields_dot,
    int_tile,
    int_tile_dot,
)
from pdserve.kernels.moe import moe_experts_ref
from pdserve.kernels.moe_triton import align_slots, block_slots, choose_tiles, gate_act


@dataclass(frozen=True)
class PackedExperts:
    """One projection of a layer's experts, packed: [E, N, K] weights in int_linear's layout."""

    qweight: Tensor  # int32 [E, N, words]
    scales: Tensor  # float32 [E, N, G]
    zeros: Tensor  # uint8 [E, N, G]
    bits: int
    group_size: int
    in_features: int  # K
    fp8: bool = False  # 8-bit codes that are float8_e4m3fn bytes (runner/models/fp8_kept.py)

    def __post_init__(self) -> None:
        e, n, words = self.qweight.shape
        groups = -(-self.in_features // self.group_size)
        assert self.bits in (4, 8), f"packed experts take 4- or 8-bit codes, got {self.bits}"
        assert not self.fp8 or self.bits == 8, "float8 codes are bytes"
        assert words * (32 // self.bits) >= self.in_features, (
            f"{words} words a row hold fewer than {self.in_features} {self.bits}-bit codes"
        )
        assert self.scales.shape == self.zeros.shape == (e, n, groups), (
            f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must be "
            f"[{e}, {n}, {groups}]"
        )
        parts = (self.qweight, self.scales, self.zeros)
        assert all(t.is_contiguous() for t in parts), "the kernels read dense [E, N, ·] stacks"

    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K], as a 16-bit stack's."""
        e, n, _ = self.qweight.shape
        return e, n, self.in_features

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """[E, N, K] in `dtype`: each weight (code - zero) * scale (with fp8: its float8
        value * scale), rounded once."""
        k, size, fp8 = self.in_features, self.group_size, self.fp8
        return torch.stack([
            dequantize_int(q, s, z, self.bits, k, size, fp8).to(dtype)
            for q, s, z in zip(self.qweight, self.scales, self.zeros, strict=True)
        ])  # fmt: skip


def moe_experts_int_ref(
    x: Tensor, gate_up: PackedExperts, down: PackedExperts, ids: Tensor, weights: Tensor
) -> Tensor:
    """The spec (and the CPU path): the experts dequantized to x's dtype, then
    `moe_experts_ref`."""
    return moe_experts_ref(x, gate_up.dequantized(x.dtype), down.dequantized(x.dtype), ids, weights)


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


@dataclass(frozen=True)
class IntMoeTiles:
    block_n: int  # outputs a program (the MMA's M side)
    block_k: int  # inputs a tile (less where the group size does not allow it)
    num_warps: int
    num_stages: int
    block_m: int  # slots a block
    words_once: bool = True  # int_linear's forms (IntLinearConfig)
    # int_linear's scale_after + zero_after (4-bit codes, 16-bit tiles of one group): each
    # weight's rounding to the dtype skipped, so not the spec's function to the ulp
    scale_after: bool = False
    fields: bool = False  # int_linear's `int_fields_dot` form (`fields_apply`)


def choose_int_tiles(
    num_slots: int, num_experts: int, dtype: torch.dtype = torch.bfloat16, bits: int = 4
) -> IntMoeTiles:
    """128 outputs in tiles of 64 inputs, 4 warps, 3 stages: the best of 24 tiles at 32 and
    512 tokens of Qwen3-30B-A3B's experts on an H100 (moe_int_bench.py --sweep; 526 / 876 us
    a layer against 2,965 / 5,118 for 64 outputs in tiles of 128 inputs), and of 24 block
    sizes and forms at 2,048 and 8,192 tokens (--sweep-long: 1,783 / 5,464 us at 64-slot
    blocks). Blocks of moe_triton's `choose_tiles` (16-64 slots by the mean run). Blocks of
    16 slots of 4-bit codes and 16-bit activations take the fields form in tiles of 128
    inputs: 326 us a layer at 32 tokens against 515 (--forms; the bf16 experts take 444),
    where at 512 tokens it only ties. (fp32 activations' fields tiles overflow the shared
    memory at 3 stages.)"""
    block_m = choose_tiles(num_slots, num_experts, torch.bfloat16).block_m
    if block_m == 16 and bits == 4 and dtype in (torch.bfloat16, torch.float16):
        return IntMoeTiles(128, 128, 4, 3, block_m, fields=True)
    return IntMoeTiles(128, 64, 4, 3, block_m)


def _fields_run(packed: PackedExperts, block_k: int, x: Tensor) -> bool:
    """Where the fields form runs as it was timed: 16-bit activations, tiles of whole groups."""
    whole = packed.scales.shape[2] == 1 or packed.group_size % block_k == 0
    return whole and x.dtype in (torch.float16, torch.bfloat16)


def _depth(t: IntMoeTiles, packed: PackedExperts, x: Tensor) -> int:
    """The tile depth to ask for: the fields form's (128 inputs) only where it runs
    (`_fields_run`); elsewhere the tile form's 64 of `choose_int_tiles`. (Those tiles 128
    deep needed 303-319 KB of shared memory at 3 stages, past sm_90's 227 KB: OutOfResources
    in three GPU tests on an H100.)"""
    if t.fields and not _fields_run(packed, t.block_k, x):
        return min(t.block_k, 64)
    return t.block_k


def _block_k(want: int, packed: PackedExperts) -> int:
    """The largest tile depth <= want within one group (tiles then load one scale and zero
    an output), else `want` (a scale and zero a weight)."""
    groups = packed.scales.shape[2]
    fits = [
        b for b in (128, 64, 32, 16) if b <= want and (groups == 1 or packed.group_size % b == 0)
    ]
    return fits[0] if fits else want


def _tile_args(packed: PackedExperts, block_k: int, t: IntMoeTiles, x: Tensor) -> dict:
    """int_tile's constexprs for one stack."""
    tile_group = packed.scales.shape[2] == 1 or packed.group_size % block_k == 0
    magic = float_magic(x)
    scale_after = t.scale_after and tile_group and packed.bits == 4 and magic is not None
    fields = t.fields and _fields_run(packed, block_k, x)
    return {"BITS": packed.bits, "BLOCK_K": block_k, "TILE_GROUP": tile_group,
            "WORDS_ONCE": t.words_once, "SCALE_AFTER": scale_after and not packed.fp8,
            "FIELDS": fields and fields_apply(block_k, packed.bits) and not packed.fp8,
            "MAGIC": (magic or (0, 0))[0], "BIAS": (magic or (0, 0))[1],
            "FP8": packed.fp8}  # fmt: skip


@triton.jit
def _int_rows_dot(acc, xs, w_ptr, s_ptr, z_ptr, rows, n_ok, k0, kk, k_ok, words, groups,
                  group_size, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  TILE_GROUP: tl.constexpr, WORDS_ONCE: tl.constexpr,
                  SCALE_AFTER: tl.constexpr, MAGIC: tl.constexpr, BIAS: tl.constexpr,
                  IEEE_DOT: tl.constexpr, dtype: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] + the packed stack's rows `rows` (int64) times xs^T."""
    w, s, z = int_tile(w_ptr + rows[:, None] * words, rows * groups, s_ptr, z_ptr, n_ok, k0, kk,
                       k_ok, words, group_size, BITS, BLOCK_N, BLOCK_K, TILE_GROUP, WORDS_ONCE,
                       SCALE_AFTER, MAGIC, SCALE_AFTER, BIAS, dtype, FP8)  # fmt: skip
    return int_tile_dot(acc, w, s, z, xs, SCALE_AFTER, SCALE_AFTER, BIAS, IEEE_DOT, dtype)


@triton.jit
def _int_rows_fields(acc, x_rows, x_ok, w_ptr, s_ptr, z_ptr, rows, n_ok, k0, k, words, groups,
                     group_size, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUP: tl.constexpr,
                     SCALE_AFTER: tl.constexpr, MAGIC: tl.constexpr, BIAS: tl.constexpr,
                     IEEE_DOT: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """`_int_rows_dot` in the fields form: x's rows `x_rows` ([BLOCK_M, 1] pointers) read
    field by field."""
    return int_fields_dot(acc, x_rows, x_ok, w_ptr + rows[:, None] * words, rows * groups, s_ptr,
                          z_ptr, n_ok, k0, k, words, group_size, BITS, BLOCK_M, BLOCK_N, BLOCK_K,
                          TILE_GROUP, SCALE_AFTER, MAGIC, BIAS, IEEE_DOT, dtype)  # fmt: skip


@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_int_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E * 2I, words] int32: each expert's gate rows, then its up rows
    s_ptr,  # [E * 2I, groups] float32
    z_ptr,  # [E * 2I, groups] uint8
    out_ptr,  # [S, I]
    sorted_slots_ptr,  # [B * BLOCK_M] int32 (moe_triton.align_slots)
    block_expert_ptr,  # [B] int32
    num_slots,
    top_k,
    hidden,
    inter,
    stride_xt,
    words,
    groups,
    group_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITS: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    WORDS_ONCE: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    MAGIC: tl.constexpr,
    BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FIELDS: tl.constexpr,
    FP8: tl.constexpr,  # float8_e4m3fn bytes (PackedExperts.fp8)
):
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert >= 0:
        slots, valid = block_slots(sorted_slots_ptr, tl.program_id(0), num_slots, BLOCK_M)
        tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        gate_rows = expert * 2 * inter + n.to(tl.int64)
        dtype = out_ptr.dtype.element_ty
        acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        x_rows = x_ptr + tokens[:, None] * stride_xt
        for k0 in range(0, hidden, BLOCK_K):
            if FIELDS:
                acc_gate = _int_rows_fields(acc_gate, x_rows, valid, w_ptr, s_ptr, z_ptr,
                                            gate_rows, n_ok, k0, hidden, words, groups,
                                            group_size, BITS, BLOCK_M, BLOCK_N, BLOCK_K,
                                            TILE_GROUP, SCALE_AFTER, MAGIC, BIAS, IEEE_DOT,
                                            dtype)  # fmt: skip
                acc_up = _int_rows_fields(acc_up, x_rows, valid, w_ptr, s_ptr, z_ptr,
                                          gate_rows + inter, n_ok, k0, hidden, words, groups,
                                          group_size, BITS, BLOCK_M, BLOCK_N, BLOCK_K,
                                          TILE_GROUP, SCALE_AFTER, MAGIC, BIAS, IEEE_DOT,
                                          dtype)  # fmt: skip
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < hidden
                xs = tl.load(x_rows + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                             other=0.0)  # fmt: skip
                acc_gate = _int_rows_dot(acc_gate, xs, w_ptr, s_ptr, z_ptr, gate_rows, n_ok, k0,
                                         kk, k_ok, words, groups, group_size, BITS, BLOCK_N,
                                         BLOCK_K, TILE_GROUP, WORDS_ONCE, SCALE_AFTER, MAGIC,
                                         BIAS, IEEE_DOT, dtype, FP8)  # fmt: skip
                acc_up = _int_rows_dot(acc_up, xs, w_ptr, s_ptr, z_ptr, gate_rows + inter, n_ok,
                                       k0, kk, k_ok, words, groups, group_size, BITS, BLOCK_N,
                                       BLOCK_K, TILE_GROUP, WORDS_ONCE, SCALE_AFTER, MAGIC, BIAS,
                                       IEEE_DOT, dtype, FP8)  # fmt: skip
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        out = out_ptr + slots.to(tl.int64)[None, :] * inter + n[:, None]
        tl.store(out, gate_act(gate, up, dtype, False, 1.0, 0.0, False),
                 mask=n_ok[:, None] & valid[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_slots"])
def _down_int_kernel(
    h_ptr,  # [S, I]
    w_ptr,  # [E * H, words] int32
    s_ptr,  # [E * H, groups] float32
    z_ptr,  # [E * H, groups] uint8
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITS: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    WORDS_ONCE: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    MAGIC: tl.constexpr,
    BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FIELDS: tl.constexpr,
    FP8: tl.constexpr,  # float8_e4m3fn bytes (PackedExperts.fp8)
):
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert >= 0:
        slots, valid = block_slots(sorted_slots_ptr, tl.program_id(0), num_slots, BLOCK_M)
        rows = tl.where(valid, slots, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = expert * hidden + n.to(tl.int64)
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        h_rows = h_ptr + rows[:, None] * inter
        for k0 in range(0, inter, BLOCK_K):
            if FIELDS:
                acc = _int_rows_fields(acc, h_rows, valid, w_ptr, s_ptr, z_ptr, w_rows, n_ok, k0,
                                       inter, words, groups, group_size, BITS, BLOCK_M, BLOCK_N,
                                       BLOCK_K, TILE_GROUP, SCALE_AFTER, MAGIC, BIAS, IEEE_DOT,
                                       dtype)  # fmt: skip
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < inter
                xs = tl.load(h_rows + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                             other=0.0)  # fmt: skip
                acc = _int_rows_dot(acc, xs, w_ptr, s_ptr, z_ptr, w_rows, n_ok, k0, kk, k_ok,
                                    words, groups, group_size, BITS, BLOCK_N, BLOCK_K, TILE_GROUP,
                                    WORDS_ONCE, SCALE_AFTER, MAGIC, BIAS, IEEE_DOT,
                                    dtype, FP8)  # fmt: skip
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
        y = acc.to(dtype).to(tl.float32) * weight[None, :]
        out = out_ptr + rows[None, :] * hidden + n[:, None]
        tl.store(out, y.to(dtype), mask=n_ok[:, None] & valid[None, :])


def moe_experts_int_triton(
    x: Tensor, gate_up: PackedExperts, down: PackedExperts, ids: Tensor, weights: Tensor,
    tiles: IntMoeTiles | None = None,
) -> Tensor:  # fmt: skip
    """`moe_experts_int_ref` on the GPU (or Triton's interpreter); shapes checked by the
    caller. `tiles` overrides the defaults (benchmarks' sweeps)."""
    num_tokens, top_k = ids.shape
    num_experts, _, hidden = gate_up.shape
    inter = down.in_features
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return x.new_zeros(num_tokens, hidden)
    x = x if x.stride(1) == 1 else x.contiguous()
    t = tiles or choose_int_tiles(num_slots, num_experts, x.dtype, gate_up.bits)
    sorted_slots, block_expert = align_slots(ids, num_experts, t.block_m)
    num_blocks = block_expert.shape[0]
    launch = {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "num_warps": t.num_warps,
              "num_stages": t.num_stages,
              # fp32 operands without tf32 rounding, and the interpreter's 16-bit tiles
              "IEEE_DOT": x.dtype == torch.float32 or not x.is_cuda}  # fmt: skip
    gu_k, d_k = _block_k(_depth(t, gate_up, x), gate_up), _block_k(_depth(t, down, x), down)
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    _gate_up_int_kernel[(num_blocks, triton.cdiv(inter, t.block_n))](
        x, gate_up.qweight, gate_up.scales, gate_up.zeros, h, sorted_slots, block_expert,
        num_slots, top_k, hidden, inter, x.stride(0), gate_up.qweight.shape[2],
        gate_up.scales.shape[2], gate_up.group_size, **_tile_args(gate_up, gu_k, t, x),
        **launch,
    )  # fmt: skip
    terms = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _down_int_kernel[(num_blocks, triton.cdiv(hidden, t.block_n))](
        h, down.qweight, down.scales, down.zeros, flat_weights, terms, sorted_slots,
        block_expert, num_slots, hidden, inter, down.qweight.shape[2], down.scales.shape[2],
        down.group_size, **_tile_args(down, d_k, t, x), **launch,
    )  # fmt: skip
    return terms.view(num_tokens, top_k, hidden).sum(dim=1)
