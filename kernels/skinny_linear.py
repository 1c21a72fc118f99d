"""Linear layers for a few rows (decode batches): `y = x @ W.T + b` with M <= 64.

At M = 32 cuBLAS reads the Qwen3-0.6B decoder weights at 0.8-2.1 TB/s (profile_step_32:
5-6 us per GEMM, 0.66 ms of a 1.65 ms step; the H200 copies at 4.28 TB/s). The weights are
4-13 MB per GEMM, so what matters is how fast the whole chip starts streaming them: the
o_proj (N=1024) and down_proj (N=1024) outputs give too few output tiles to occupy 132 SMs.

Device path: one Triton kernel. A program owns BLOCK_N output features and a slice of K
(split-K), streams its `[BLOCK_N, BLOCK_K]` weight tiles and multiplies them by the
`[BLOCK_K, M]` transposed input (swap-AB: the weight rows are the MMA's M side, so a
32-row batch does not pad to a 64-row tile). With split-K every program writes its fp32
partial to a workspace, counts itself in on an arrival counter per output tile, and the
last to arrive sums the SPLIT_K partials in split order, adds the bias and stores the
output: one launch, and the result does not depend on which program came last.

With `silu_mul_output` the weight is the fused [gate | up] projection ([2N, K]): a program
computes the gate and the up rows of its N features and writes `silu(gate) * up` with
kernels/activation.py's rounding points (each projection rounded to the dtype first, as
cuBLAS would write it), so the MLP needs no separate activation launch. (Applying it on
the down projection's input loads instead was measured at 20.5 us against 8.0 for the
unfused pair: every output tile recomputes the activation of the whole input.)

Measured at 32 rows in CUDA graphs over 28 distinct weights (benchmarks/skinny_bench.py,
H200, results/skinny_bench_*.json): o_proj 5.2 vs cuBLAS 5.6-5.9 us, down_proj 5.8 vs
6.9 us (cuBLAS splits K and adds a reduce kernel there), gate_up with SiLU-and-mul 6.8 vs
7.6 for cuBLAS plus the activation launch. On the plain qkv output the best tiles only tie
cuBLAS (5.2 vs 4.9-5.3), so `linear` sends narrow outputs (N <= 2048) and fused
activations here, the rest to cuBLAS.

Two epilogues serve the folded-norm decode chain (runner/models/norm_fold.py): with a
`residual` the rounded output has the residual added (one more rounding, as the fused add
+ RMSNorm kernel does it) and each output tile writes its rows' sums of squares of the new
residual stream (kernels/row_squares.py); with `scale_rows` each output row is multiplied
by its RMSNorm factor before the bias, computed from such sums.

The partials and counters live in the model's `KernelWorkspace` (kernels/workspace.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from pdserve.kernels.row_squares import (
    MAX_PARTS,
    SQ_ROWS,
    RowSquares,
    ScaleRows,
    row_scale,
    row_scale_ref,
    squares_buffer,
)
from pdserve.kernels.workspace import KernelWorkspace, arrives_last

MAX_ROWS = SQ_ROWS  # the largest M this path takes (64); larger batches go to cuBLAS
NARROW_N = 2048  # outputs this narrow need split-K, where cuBLAS adds a reduce launch


def skinny_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul_output: bool = False,
) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    return silu_and_mul_ref(y) if silu_mul_output else y


def scaled_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: ScaleRows,
    silu_mul_output: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The `scale_rows` epilogue's spec: the product in fp32, scaled, the bias added, then
    rounded (and SiLU-and-mul of the rounded projections)."""
    s = row_scale_ref(scale, x.shape[0])
    y = F.linear(x.float(), weight.float()) * s[:, None]
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return silu_and_mul_ref(y) if silu_mul_output else y


def residual_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `residual` epilogue's spec: (F.linear + residual, its rows' sums of squares)."""
    out = F.linear(x, weight, bias) + residual
    outf = out.float()
    return out, (outf * outf).sum(-1)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def swap_ab_dot(w, xs, acc, IEEE_DOT: tl.constexpr):
    # acc + w @ xs^T. IEEE_DOT: fp32 inputs, and 16-bit ones under Triton's interpreter
    # (which multiplies 16-bit tiles as raw bits): fp32 operands, no tf32 rounding; 16-bit
    # products are exact in fp32, so this is what the tensor cores give.
    if IEEE_DOT:
        return tl.dot(w.to(tl.float32), tl.trans(xs.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(xs), acc)


# num_rows is the batch's row count: not specialised on (a variant per value class would
# compile mid-serving); M_PAD is. k_per_split is: its divisibility by 16 is what lets the
# compiler prove the weight rows 16-byte aligned and load them in wide vectors (without it
# the loads went scalar and ran at 0.5-1 TB/s).
@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr,  # [M, K], unit stride on K
    w_ptr,  # [N, K], unit stride on K; [2N, K] ([gate | up]) when SILU_MUL
    bias_ptr,  # [N] ([2N] when SILU_MUL) or unused
    out_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, M_PAD, N] fp32 workspace (unused when SPLIT_K == 1)
    count_ptr,  # [cdiv(N, BLOCK_N)] int32 arrival counters, zero between launches
    res_ptr,  # [M, N] residual (ADD_RESIDUAL)
    sq_out_ptr,  # [cdiv(N, BLOCK_N), SQ_STRIDE] fp32 row sums of squares (ADD_RESIDUAL)
    sq_in_ptr,  # [num_sq_parts, SQ_STRIDE] fp32 row sums of squares (SCALE_ROWS)
    num_rows,
    n,
    k,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    num_sq_parts,
    sq_dim,
    eps,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SQ_PARTS_PAD: tl.constexpr,
    SQ_STRIDE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # k_per_split divides K: no slice is short, no K mask
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < n
    m_mask = offs_m < num_rows
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    out_mask = n_mask[:, None] & m_mask[None, :]
    # The epilogue's inputs are loaded before the K loop: they are complete at launch, and
    # so their latency hides under the weight stream instead of adding a round trip after
    # the merge (every split program loads them; only the last arriver uses them).
    if ADD_RESIDUAL:
        res_ptrs = res_ptr + offs_m[None, :].to(tl.int64) * stride_rm + offs_n[:, None]
        res = tl.load(res_ptrs, mask=out_mask, other=0.0)
    if SCALE_ROWS:  # the folded RMSNorm's factor, applied to the product before the bias
        inv = row_scale(sq_in_ptr, offs_m, m_mask, num_sq_parts, sq_dim, eps, SQ_PARTS_PAD,
                        SQ_STRIDE)  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            up_bias = tl.load(bias_ptr + n + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)  # SILU_MUL only
    for step in range(tl.cdiv(tl.minimum(k_per_split, k - k_start), BLOCK_K)):
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            k_mask = offs_k < k - k_start - step * BLOCK_K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        xs = tl.load(x_ptrs, mask=x_mask, other=0.0)
        acc = swap_ab_dot(w, xs, acc, IEEE_DOT)
        if SILU_MUL:  # the up rows sit N rows below the gate rows
            w_up = tl.load(w_ptrs + n * stride_wn, mask=w_mask, other=0.0)
            acc_up = swap_ab_dot(w_up, xs, acc_up, IEEE_DOT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    if SPLIT_K > 1:
        # [SPLIT_K, M_PAD, N]: rows past num_rows hold zeros (their x was masked to 0).
        # With SILU_MUL the up partials follow as a second [SPLIT_K, M_PAD, N] block.
        tile = offs_m[None, :].to(tl.int64) * n + offs_n[:, None]
        tl.store(part_ptr + pid_k * M_PAD * n + tile, acc, mask=n_mask[:, None])
        if SILU_MUL:
            tl.store(part_ptr + (SPLIT_K + pid_k) * M_PAD * n + tile, acc_up, mask=n_mask[:, None])
        last, counter = arrives_last(count_ptr, pid_n, SPLIT_K)
        if not last:
            return
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
        for s in range(SPLIT_K):  # split order, whoever arrived last: deterministic
            acc += tl.load(
                part_ptr + s * M_PAD * n + tile, mask=n_mask[:, None], cache_modifier=".cg"
            )
            if SILU_MUL:
                acc_up += tl.load(
                    part_ptr + (SPLIT_K + s) * M_PAD * n + tile, mask=n_mask[:, None],
                    cache_modifier=".cg",
                )  # fmt: skip
        tl.store(counter, 0)
    dtype = out_ptr.dtype.element_ty
    if SCALE_ROWS:
        acc = acc * inv[None, :]
        if SILU_MUL:
            acc_up = acc_up * inv[None, :]
    if HAS_BIAS:
        acc += bias[:, None]
        if SILU_MUL:
            acc_up += up_bias[:, None]
    if SILU_MUL:
        # kernels/activation.py on the rounded projections: silu in fp32 rounded to the
        # dtype, then the product (rounded by the store below).
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    y = acc.to(dtype)
    if ADD_RESIDUAL:
        # The rounded projection plus the residual, rounded once more (exact in fp32 before
        # that rounding, as in kernels/norm.py); then this tile's share of each row's sum
        # of squares of the new residual stream (masked lanes are 0).
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
        yf = tl.where(out_mask, y.to(tl.float32), 0.0)
        tl.store(sq_out_ptr + pid_n * SQ_STRIDE + offs_m, tl.sum(yf * yf, 0), mask=m_mask)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, y, mask=out_mask)


def choose_config(n: int, k: int, silu_mul: bool = False, elem_bytes: int = 2) -> SkinnyConfig:
    """Tiles for an [M <= 64] x [N, K] product on the H200's 132 SMs (skinny_bench sweep).

    Output tiles of 32 features; K is split while the grid stays under ~2 programs per SM
    and each slice keeps at least 4 steps of 128 (the pipeline needs a few to fill): 4-way
    for the 1024-wide o/down projections. SiLU-and-mul outputs are not split by default
    (the kernel can: the last arriver merges the gate and the up partials, not yet timed on
    the H200); 64-feature tiles (gate and up: 128 weight rows a program) measured best
    unsplit, 6.8 us against 7.7 for 16 and 7.6 for cuBLAS + silu.
    float32 (the folded chain's parity runs) takes 2-stage pipelines: 4 stages of fp32
    tiles need more than an SM's 227 KB of shared memory.
    """
    stages = 4 if elem_bytes <= 2 else 2
    if silu_mul:
        return SkinnyConfig(64, 128, 1, num_warps=4, num_stages=stages)
    block_n, block_k, num_sms = 32, 128, 132
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= 2 * num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=stages)


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    workspace: KernelWorkspace,
    silu_mul_output: bool = False,
    config: SkinnyConfig | None = None,
    scale_rows: ScaleRows | None = None,
) -> torch.Tensor:
    """`skinny_linear_ref` for M <= 64 rows on the GPU (or Triton's interpreter); with
    `scale_rows`, `scaled_linear_ref`."""
    return _launch(x, weight, bias, workspace, silu_mul_output, config, scale_rows, None)[0]


def skinny_linear_add_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    workspace: KernelWorkspace,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, RowSquares]:
    """`residual_linear_ref`: the new residual stream and its rows' sums of squares (one part
    per output tile, in the workspace's squares buffer)."""
    assert residual.shape == (x.shape[0], weight.shape[0]) and residual.dtype == x.dtype, (
        f"residual is [{x.shape[0]}, {weight.shape[0]}] {x.dtype}, got "
        f"{tuple(residual.shape)} {residual.dtype}"
    )
    assert residual.stride(1) == 1, "the residual's features are contiguous"
    out, tiles = _launch(x, weight, bias, workspace, False, config, None, residual)
    return out, RowSquares(squares_buffer(workspace, x.device), tiles, out.shape[1])


def _launch(x, weight, bias, workspace, silu_mul_output, config, scale_rows, residual):
    """-> (the output, its number of output tiles)."""
    assert x.dim() == 2 and weight.dim() == 2, "x is [M, K] and weight is [N, K]"
    num_rows, k = x.shape
    assert weight.shape[1] == k, f"x has {k} features, weight expects {weight.shape[1]}"
    rows_w = weight.shape[0]
    assert not silu_mul_output or rows_w % 2 == 0, "a [gate | up] weight has 2N rows"
    n = rows_w // 2 if silu_mul_output else rows_w
    assert 0 < num_rows <= MAX_ROWS, f"the skinny path takes 1..{MAX_ROWS} rows, got {num_rows}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight have unit stride on K"
    assert x.dtype == weight.dtype and x.dtype.is_floating_point, (
        f"x ({x.dtype}) and weight ({weight.dtype}) share a float dtype"
    )
    assert bias is None or (bias.shape == (rows_w,) and bias.is_contiguous()), (
        "bias has one value per weight row"
    )
    cfg = config or choose_config(n, k, silu_mul_output, x.element_size())
    m_pad = max(16, triton.next_power_of_2(num_rows))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice: each program counts itself in
    tiles = triton.cdiv(n, cfg.block_n)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if split > 1:
        # Partials laid out for m_pad rows; sized for the largest pad so that a batch
        # wider than the captured ones does not grow the buffer.
        halves = 2 if silu_mul_output else 1  # gate and up partials
        part = workspace.scratch(
            "skinny_linear", halves * split * max(m_pad, MAX_ROWS) * n, x.device
        )
        counters = workspace.counters("skinny_linear", tiles, x.device)
    else:
        part = counters = out  # unused
    sq_out = sq_in = out  # unused unless an epilogue reads or writes squares
    sq_parts, sq_dim, eps = 1, 1, 0.0
    if residual is not None:
        assert tiles <= MAX_PARTS, f"{tiles} output tiles exceed the {MAX_PARTS} square parts"
        sq_out = squares_buffer(workspace, x.device)
    if scale_rows is not None:
        sq = scale_rows.squares
        sq_in, sq_parts, sq_dim, eps = sq.buf, sq.parts, sq.dim, scale_rows.eps
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"
    _skinny_linear_kernel[(tiles, split)](
        x, weight, bias if bias is not None else out, out, part, counters,
        residual if residual is not None else out, sq_out, sq_in, num_rows, n, k,
        k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, sq_parts, sq_dim, eps,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul_output, ADD_RESIDUAL=residual is not None,
        SCALE_ROWS=scale_rows is not None,
        SQ_PARTS_PAD=scale_rows.squares.parts_pad if scale_rows is not None else 1,
        SQ_STRIDE=SQ_ROWS,
        SPLIT_K=split, EVEN_K=k % k_per_split == 0, M_PAD=m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        IEEE_DOT=ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, tiles


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    workspace: KernelWorkspace,
    silu_mul_output: bool = False,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (then `silu_and_mul` with `silu_mul_output`): the skinny
    kernel for a 16-bit decode batch into a narrow output or a fused SiLU-and-mul, cuBLAS
    otherwise."""
    if (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (silu_mul_output or weight.shape[0] <= NARROW_N)
    ):
        return skinny_linear_triton(x, weight, bias, workspace, silu_mul_output)
    y = F.linear(x, weight, bias)
    return silu_and_mul(y) if silu_mul_output else y
