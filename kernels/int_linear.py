"""Linear layers on packed integer weights (GPTQ / AWQ / compressed-tensors int4 and int8
checkpoints, runner/models/packed_linear.py): `y = x @ W.T + b` where each weight is
`(code - zero) * scale` of its input's group, computed tile by tile as the weights stream
in, so a 4-bit linear reads a quarter of its 16-bit twin's bytes.

Layout (one for every checkpoint format; runner/models/packed_int_weights.py converts):
- `qweight` int32 [N, ceil(K * bits / 32)]: output n's codes along K, 32 / bits to a
  word, the lowest bits first (the last word zero-padded);
- `scales` float32 [N, G] and `zeros` uint8 [N, G], G = ceil(K / group_size): input k
  is in group k // group_size (contiguous groups; act-order checkpoints stay on the
  dequantized path);
- an FP8 checkpoint's kept weights (runner/models/fp8_kept.py) take the same layout with
  8-bit codes that are float8_e4m3fn bytes (`fp8`): each weight is value * scale, the
  zeros unread.

The spec, `int_linear_ref`, dequantizes the whole weight to x's dtype (the float32
product `(code - zero) * scale` rounded once, exactly as a checkpoint dequantized at load
is) and calls `F.linear`; it is also the CPU path. The kernel builds the same rounded tile
in registers and multiplies it with fp32 accumulation (the two differ only in summation
order), except for 4-bit codes in 16-bit tiles of one group (`scale_after`): there the
tile holds exact integers made from the codes' bits (`MAGIC | code` is the float
BIAS + code), `(BIAS + zero) * sum(x)` comes off the tile's dot product (`zero_after`;
the fp32 sum loses a few bits more to the cancellation, far below the output's rounding)
and the row's scale multiplies it, so each weight's rounding to the dtype is skipped (a
difference of at most half an ulp a weight).

Device path: one Triton kernel, swap-AB as kernels/skinny_linear.py (a program owns
BLOCK_N outputs of BLOCK_M rows; the weight tile is the MMA's M side). A tile of BLOCK_K
inputs loads its words once and splits each into its codes in registers (a [BLOCK_N,
words, codes] tensor reshaped to the tile; the alternative, each word loaded once per
code from L1, is kept for the sweep, and so is `fields`: a dot a field of the words
against x's inputs strided by the codes a word, with no reshaped tile; not yet timed);
where the group size is a multiple of BLOCK_K a
tile is one group and loads one scale and zero per output, else one per (output, input).
A decode batch splits K over programs when given the model's KernelWorkspace: each slice
writes its fp32 partial there and the last program of an output tile to arrive sums the
slices in split order (kernels/skinny_linear.py's scheme), so the chip keeps several
programs' weight streams in flight where one tile's 4-bit words are only a few KB.
Past DEQUANT_ROWS rows a dequantize kernel writes the 16-bit weight and cuBLAS multiplies.
The tiles come from H100 sweeps (benchmarks/int_linear_bench.py --sweep); the kernel is
still slower than cuBLAS on the 16-bit weights (1.2-1.5x at decode, bound by the unpacking
arithmetic, not by bytes), so packed weights run only where asked or where 16-bit ones
would crowd out the KV cache (runner/models/packed_linear.py); the execution path says
which (`weights=gptq->int4`). `int_tile` and `int_tile_dot` (a tile's unpacking and its
product) are shared with kernels/moe_int.py's packed experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels.skinny_linear import swap_ab_dot
from pdserve.kernels.workspace import KernelWorkspace, arrives_last

# Rows past which a batch multiplies a dequantized scratch copy of the weight with cuBLAS
# instead of dequantizing tile by tile. On the H100 with today's tiles (Llama-3-8B,
# int_linear_bench_llama3_8b_h100_969d5c6.json), us tiled / dequantized: at 64 rows
# gate/up 183 / 601, o 57 / 90; at 256 qkv 155 / 142, o 153 / 97, down 577 / 318 but
# gate/up 404 / 638; at 2,048 (the sweep, ..._a1b0df2.json) gate/up 2,692 / 1,165.
DEQUANT_ROWS = 128


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int64 codes of an int32 tensor packed along `dim` (0 or 1), 32 // bits to a word, the
    lowest bits first: dim grows by 32 // bits, a word's codes in a row."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=packed.device)
    codes = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, p]
    rows, cols = packed.shape
    if dim == 1:
        return codes.reshape(rows, cols * per_word)
    return codes.permute(0, 2, 1).reshape(rows * per_word, cols)


def dequantize_int(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, k: int,
    group_size: int, fp8: bool = False,
) -> torch.Tensor:  # fmt: skip
    """float32 [N, K]: each weight (code - zero) * scale of its input's group; with `fp8`
    the 8-bit codes are float8_e4m3fn bytes, each weight value * scale (no zero)."""
    assert qweight.shape[1] * (32 // bits) >= k
    codes = unpack_int32(qweight, bits, dim=1)[:, :k]  # [N, K]
    group = torch.arange(k, device=qweight.device) // group_size
    if fp8:
        assert bits == 8, "float8 codes are bytes"
        return codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * scales.float()[:, group]
    return (codes - zeros.to(torch.int64)[:, group]).float() * scales.float()[:, group]


def int_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group_size: int, bias: torch.Tensor | None, fp8: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The spec: the weight dequantized to x's dtype, then `F.linear`."""
    w = dequantize_int(qweight, scales, zeros, bits, x.shape[-1], group_size, fp8)
    return F.linear(x, w.to(x.dtype), bias)


@triton.jit
def int_tile(w_rows, s_rows, s_ptr, z_ptr, n_mask, k0, kk, k_mask, k_words, group_size,
             BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             TILE_GROUP: tl.constexpr, WORDS_ONCE: tl.constexpr, SCALE_AFTER: tl.constexpr,
             MAGIC: tl.constexpr, ZERO_AFTER: tl.constexpr, BIAS: tl.constexpr,
             dtype: tl.constexpr, FP8: tl.constexpr = False):  # fmt: skip
    """The [BLOCK_N, BLOCK_K] weight tile of inputs `kk` (= k0 + arange) of the rows whose
    words start at `w_rows` ([BLOCK_N, 1] pointers) and whose scales and zeros start at
    offsets `s_rows` ([BLOCK_N]), with the scale and zero `int_tile_dot` needs: the tile in
    float32 (code - zero) * scale, or with SCALE_AFTER the codes as 16-bit floats (minus
    BIAS + zero unless ZERO_AFTER) and the row's one scale and zero. With FP8 the 8-bit
    codes are float8_e4m3fn bytes: the tile is value * scale, and no zero is read."""
    per_word: tl.constexpr = 32 // BITS
    tile_mask = n_mask[:, None] & k_mask[None, :]
    if WORDS_ONCE:  # each word loaded once, its codes split out in registers
        wk = k0 // per_word + tl.arange(0, BLOCK_K // per_word)
        words = tl.load(w_rows + wk[None, :], mask=n_mask[:, None] & (wk < k_words)[None, :],
                        other=0)  # fmt: skip
        fields = tl.arange(0, per_word) * BITS
        codes = (words[:, :, None] >> fields[None, None, :]) & ((1 << BITS) - 1)
        codes = tl.reshape(codes, [BLOCK_N, BLOCK_K])
    else:  # each word loaded once per code it holds (the repeats from L1)
        words = tl.load(w_rows + (kk // per_word)[None, :], mask=tile_mask, other=0)
        codes = (words >> ((kk % per_word) * BITS)[None, :]) & ((1 << BITS) - 1)
    if FP8:  # the byte's float8 value, exact in float32
        values = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        z = tl.zeros([BLOCK_N], dtype=tl.int32)
        if TILE_GROUP:
            s = tl.load(s_ptr + s_rows + k0 // group_size, mask=n_mask, other=0.0)
            w = values * s[:, None]
        else:
            s = tl.load(s_ptr + s_rows[:, None] + (kk // group_size)[None, :], mask=tile_mask,
                        other=0.0)  # fmt: skip
            w = values * s
    elif SCALE_AFTER:  # 4-bit codes as 16-bit floats by their bits: MAGIC | code is the
        # float BIAS + code exactly (bf16 0x4300 = 128, fp16 0x6400 = 1024), so one
        # subtraction of BIAS + zero gives code - zero, exact, with no conversion
        g = k0 // group_size
        s = tl.load(s_ptr + s_rows + g, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + s_rows + g, mask=n_mask, other=0).to(tl.int32)
        w = (codes | MAGIC).to(tl.int16).to(dtype, bitcast=True)
        if not ZERO_AFTER:
            w = w - (z + BIAS).to(dtype)[:, None]
    elif TILE_GROUP:
        g = k0 // group_size
        s = tl.load(s_ptr + s_rows + g, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + s_rows + g, mask=n_mask, other=0).to(tl.int32)
        w = (codes - z[:, None]).to(tl.float32) * s[:, None]
    else:
        where = s_rows[:, None] + (kk // group_size)[None, :]
        s = tl.load(s_ptr + where, mask=tile_mask, other=0.0)
        z = tl.load(z_ptr + where, mask=tile_mask, other=0).to(tl.int32)
        w = (codes - z).to(tl.float32) * s
    return w, s, z


@triton.jit
def int_tile_dot(acc, w, s, z, xs, SCALE_AFTER: tl.constexpr, ZERO_AFTER: tl.constexpr,
                 BIAS: tl.constexpr, IEEE_DOT: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] + an `int_tile` times xs [BLOCK_M, BLOCK_K] transposed."""
    if SCALE_AFTER:  # exact (code - zero) in the dtype, the row's scale after the dot
        d = swap_ab_dot(w, xs, None, IEEE_DOT)
        if ZERO_AFTER:  # the tile held BIAS + code: (BIAS + zero) * sum(x) comes off
            d -= (z + BIAS).to(tl.float32)[:, None] * tl.sum(xs.to(tl.float32), 1)[None, :]
        return acc + d * s[:, None]
    return swap_ab_dot(w.to(dtype), xs, acc, IEEE_DOT)  # kernels/skinny_linear.py


@triton.jit
def int_fields_dot(acc, x_rows, m_mask, w_rows, s_rows, s_ptr, z_ptr, n_mask, k0, k, k_words,
                   group_size, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, TILE_GROUP: tl.constexpr, SCALE_AFTER: tl.constexpr,
                   MAGIC: tl.constexpr, BIAS: tl.constexpr, IEEE_DOT: tl.constexpr,
                   dtype: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] + the weight tile of inputs k0.. times x's rows, one field of
    the words at a time (the `fields` form): field f of word j is input k0 + j * per_word + f,
    so a field's codes are a [BLOCK_N, words] tile made in place from the words (no
    reshape of a [BLOCK_N, words, codes] tensor into the tile) and multiply x's inputs
    k0 + f, k0 + per_word + f, ... (`x_rows` [BLOCK_M, 1] pointers: a strided load, the
    same bytes for every field, from L1). With SCALE_AFTER the tile holds BIAS + code and
    the zero comes off after the dot (int_tile_dot's zero_after)."""
    per_word: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // per_word
    wk = k0 // per_word + tl.arange(0, WORDS)
    words = tl.load(w_rows + wk[None, :], mask=n_mask[:, None] & (wk < k_words)[None, :],
                    other=0)  # fmt: skip
    if TILE_GROUP:  # (SCALE_AFTER tiles are) the tile's one group: a scale and zero a row
        g = k0 // group_size
        s = tl.load(s_ptr + s_rows + g, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + s_rows + g, mask=n_mask, other=0).to(tl.int32)
    else:
        s = tl.zeros([BLOCK_N], dtype=tl.float32)
        z = tl.zeros([BLOCK_N], dtype=tl.int32)
    d = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for f in tl.static_range(per_word):
        kk = k0 + tl.arange(0, WORDS) * per_word + f
        k_mask = kk < k
        xs = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        codes = (words >> (f * BITS)) & ((1 << BITS) - 1)
        if SCALE_AFTER:
            w = (codes | MAGIC).to(tl.int16).to(dtype, bitcast=True)
            d = swap_ab_dot(w, xs, d, IEEE_DOT)
            x_sum += tl.sum(xs.to(tl.float32), 1)
        elif TILE_GROUP:
            w = (codes - z[:, None]).to(tl.float32) * s[:, None]
            acc = swap_ab_dot(w.to(dtype), xs, acc, IEEE_DOT)
        else:
            where = s_rows[:, None] + (kk // group_size)[None, :]
            tile_mask = n_mask[:, None] & k_mask[None, :]
            sf = tl.load(s_ptr + where, mask=tile_mask, other=0.0)
            zf = tl.load(z_ptr + where, mask=tile_mask, other=0).to(tl.int32)
            w = (codes - zf).to(tl.float32) * sf
            acc = swap_ab_dot(w.to(dtype), xs, acc, IEEE_DOT)
    if SCALE_AFTER:
        d -= (z + BIAS).to(tl.float32)[:, None] * x_sum[None, :]
        acc += d * s[:, None]
    return acc


@triton.jit(do_not_specialize=["num_rows"])
def _int_linear_kernel(
    x_ptr,  # [M, K], unit stride on K
    w_ptr,  # [N, k_words] int32
    s_ptr,  # [N, groups] float32
    z_ptr,  # [N, groups] uint8
    bias_ptr,  # [N] or unused
    out_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, m_total, N] fp32 workspace (unused when SPLIT_K == 1)
    count_ptr,  # [tiles_m * tiles_n] int32 arrival counters, zero between launches
    num_rows,
    n,
    k,
    k_words,
    groups,
    group_size,
    stride_xm,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    m_total,  # the row tiles' rows: cdiv(M, BLOCK_M) * BLOCK_M
    HAS_BIAS: tl.constexpr,
    BITS: tl.constexpr,
    TILE_GROUP: tl.constexpr,  # every tile lies in one group (group_size % BLOCK_K == 0)
    WORDS_ONCE: tl.constexpr,
    SCALE_AFTER: tl.constexpr,  # 4-bit 16-bit-float tiles of one group: scale after the dot
    MAGIC: tl.constexpr,  # the dtype's bits of BIAS (SCALE_AFTER)
    ZERO_AFTER: tl.constexpr,  # SCALE_AFTER with BIAS + zero taken off after the dot
    BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FIELDS: tl.constexpr,  # int_fields_dot's form (scale_after implies zero_after there)
    FP8: tl.constexpr,  # 8-bit codes that are float8_e4m3fn bytes (int_tile)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < n
    m_mask = offs_m < num_rows
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * k_words
    s_rows = offs_n.to(tl.int64) * groups
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k, k_start + k_per_split), BLOCK_K):
        if FIELDS:
            x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
            acc = int_fields_dot(acc, x_rows, m_mask, w_rows, s_rows, s_ptr, z_ptr, n_mask, k0,
                                 k, k_words, group_size, BITS, BLOCK_M, BLOCK_N, BLOCK_K,
                                 TILE_GROUP, SCALE_AFTER, MAGIC, BIAS, IEEE_DOT, dtype)  # fmt: skip
        else:
            kk = k0 + offs_k
            k_mask = kk < k
            w, s, z = int_tile(w_rows, s_rows, s_ptr, z_ptr, n_mask, k0, kk, k_mask, k_words,
                               group_size, BITS, BLOCK_N, BLOCK_K, TILE_GROUP, WORDS_ONCE,
                               SCALE_AFTER, MAGIC, ZERO_AFTER, BIAS, dtype, FP8)  # fmt: skip
            xs = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            acc = int_tile_dot(acc, w, s, z, xs, SCALE_AFTER, ZERO_AFTER, BIAS, IEEE_DOT, dtype)
    if SPLIT_K > 1:  # the last program of the tile to arrive sums the slices in split order
        tile = offs_m[None, :].to(tl.int64) * n + offs_n[:, None]
        tl.store(part_ptr + (pid_k * m_total).to(tl.int64) * n + tile, acc, mask=n_mask[:, None])
        last, counter = arrives_last(count_ptr, pid_m * tl.num_programs(0) + pid_n, SPLIT_K)
        if not last:
            return
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for sk in range(SPLIT_K):
            acc += tl.load(part_ptr + (sk * m_total).to(tl.int64) * n + tile, mask=n_mask[:, None],
                           cache_modifier=".cg")  # fmt: skip
        tl.store(counter, 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(dtype), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, n, k, k_words, groups, group_size,
    BITS: tl.constexpr, TILE_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    # One [BLOCK_N, BLOCK_K] tile of the dequantized weight, as the linear kernel's tile.
    per_word: tl.constexpr = 32 // BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < n)[:, None] & (kk < k)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    words = tl.load(w_ptr + rows * k_words + (kk // per_word)[None, :], mask=mask, other=0)
    codes = (words >> ((kk % per_word) * BITS)[None, :]) & ((1 << BITS) - 1)
    if TILE_GROUP:  # one group a tile: a scale and a zero a row, no division per code
        where = rows * groups + tl.program_id(1) * BLOCK_K // group_size
        sz_mask = (offs_n < n)[:, None]
    else:
        where = rows * groups + (kk // group_size)[None, :]
        sz_mask = mask
    s = tl.load(s_ptr + where, mask=sz_mask, other=0.0)
    if FP8:  # float8_e4m3fn bytes (int_tile's FP8)
        w = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
    else:
        z = tl.load(z_ptr + where, mask=sz_mask, other=0)
        w = (codes - z.to(tl.int32)).to(tl.float32) * s
    tl.store(out_ptr + rows * k + kk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int_triton(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, k: int,
    group_size: int, dtype: torch.dtype, fp8: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`dequantize_int(...).to(dtype)` in one kernel (the long-batch path)."""
    n = qweight.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    groups = scales.shape[1]
    block_k = 128 if groups == 1 or group_size % 128 == 0 else 64
    grid = (triton.cdiv(n, 32), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](qweight, scales, zeros, out, n, k, qweight.shape[1], groups,
                             group_size, BITS=bits, TILE_GROUP=groups == 1 or group_size % block_k == 0,
                             BLOCK_N=32, BLOCK_K=block_k, FP8=fp8)  # fmt: skip
    return out


@dataclass(frozen=True)
class IntLinearConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0  # rows a program takes; 0: by the batch (16 / 32 / 64)
    words_once: bool = True  # load a word once and split it (else once per code, from L1)
    # 4-bit codes in bf16 / fp16 tiles of one group: (code - zero) as a float by its bits,
    # the row's scale applied to the tile's dot product (else each weight dequantized)
    scale_after: bool = True
    # with scale_after: the tile keeps BIAS + code and (BIAS + zero) * sum(x) is taken off
    # the dot product, no subtraction a weight (7-11% faster at decode on the H100,
    # int_linear_bench_llama3_8b_zero_after_h100.json)
    zero_after: bool = True
    # K slices (programs) an output tile's sum is split into, merged by the last to arrive
    # (needs a KernelWorkspace; 1 without one)
    split_k: int = 1
    # `int_fields_dot`: a dot a field of the words over x's strided inputs, no reshaped tile
    # (with scale_after the zero always comes off after the dot; `fields_apply`: tiles of
    # 16 words or more); not yet timed
    fields: bool = False


def choose_config(m: int, n: int, group_size: int, groups: int, k: int = 0) -> IntLinearConfig:
    """The best tiles of the H100 sweeps on Llama-3-8B's four GEMMs
    (int_linear_bench_llama3_8b_sweep_*_h100_*.json). Decode batches (<= 64 rows) split K
    while the grid stays within ~1,024 programs of 128 outputs and each slice keeps >= 512
    inputs: 8 slices for o, down and qkv, 4 for gate/up, in tiles of 64 inputs (at 1 and
    32 rows 1.3-1.9x the unsplit tiles). Unsplit (`k` 0: no workspace for the partials, or
    a short K) they take 32 outputs a program where N is narrow and 128 where it is wide
    (gate/up, 28,672), in tiles of 128 inputs. Longer batches take 128 x 128 tiles of 64
    inputs. Inputs tile within a group where the group size allows."""

    def block_k(want: int) -> int:
        fits = [b for b in (128, 64, 32, 16) if b <= want and (groups == 1 or group_size % b == 0)]
        return fits[0] if fits else 64

    if m > 64:
        return IntLinearConfig(128, block_k(64), block_m=128)
    tiles, split = triton.cdiv(n, 128), 1
    while split < 8 and tiles * split * 2 <= 1024 and k // (split * 2) >= 512:
        split *= 2
    if split == 1:
        return IntLinearConfig(128 if n >= 16_384 else 32, block_k(128))
    return IntLinearConfig(128, block_k(64), split_k=split)


def fields_apply(block_k: int, bits: int) -> bool:
    """Whether a tile of `block_k` inputs can take the fields form: each field's dot needs
    K >= 16 (tl.dot's least), i.e. 16 words a tile: 128 inputs of 4-bit codes, 64 of 8-bit.
    Shallower tiles run the tile form."""
    return block_k * bits >= 16 * 32


def float_magic(x: torch.Tensor) -> tuple[int, int] | None:
    """(MAGIC, BIAS) of `scale_after` tiles in x's dtype: the bits of the 16-bit float BIAS,
    whose low mantissa bits a 4-bit code fills; None where the form does not apply.
    (Triton's interpreter bitcasts int16 to bf16 wrongly: the CPU runs bf16 tiles the other
    way; fp16 checks the bit form there, bf16 on a GPU.)"""
    if x.dtype == torch.bfloat16 and not x.is_cuda:
        return None
    return {torch.bfloat16: (0x4300, 128), torch.float16: (0x6400, 1024)}.get(x.dtype)


def int_linear_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group_size: int, bias: torch.Tensor | None,
    config: IntLinearConfig | None = None, workspace: KernelWorkspace | None = None,
    fp8: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`int_linear_ref` on the GPU (or Triton's interpreter): x [M, K] 16-bit or fp32.
    A split-K config needs the `workspace` for its partials (without one: no split)."""
    assert not fp8 or bits == 8, "float8 codes are bytes"
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with unit stride on K"
    m, k = x.shape
    n, k_words = qweight.shape
    assert k_words * (32 // bits) >= k and scales.shape == zeros.shape == (n, scales.shape[1])
    groups = scales.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or choose_config(m, n, group_size, groups, k if workspace is not None else 0)
    tile_group = groups == 1 or group_size % cfg.block_k == 0
    magic = float_magic(x)
    scale_after = cfg.scale_after and tile_group and bits == 4 and magic is not None and not fp8
    block_m = cfg.block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    ieee = x.dtype == torch.float32 or not x.is_cuda
    tiles_n, tiles_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k if workspace else 1), cfg.block_k)
    k_per_split *= cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice: each program counts itself in
    part = counters = out  # unused unless split
    if split > 1:
        part = workspace.scratch("int_linear", split * tiles_m * block_m * n, x.device)
        counters = workspace.counters("int_linear", tiles_m * tiles_n, x.device)
    _int_linear_kernel[(tiles_n, tiles_m, split)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, part, counters,
        m, n, k, k_words, groups, group_size, x.stride(0), out.stride(0), k_per_split,
        tiles_m * block_m,
        HAS_BIAS=bias is not None, BITS=bits, TILE_GROUP=tile_group,
        WORDS_ONCE=cfg.words_once, SCALE_AFTER=scale_after, MAGIC=(magic or (0, 0))[0],
        ZERO_AFTER=scale_after and cfg.zero_after,
        BIAS=(magic or (0, 0))[1], SPLIT_K=split, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE_DOT=ieee,
        FIELDS=cfg.fields and fields_apply(cfg.block_k, bits) and not fp8, FP8=fp8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def int_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group_size: int, bias: torch.Tensor | None,
    workspace: KernelWorkspace | None = None, fp8: bool = False,
) -> torch.Tensor:  # fmt: skip
    """x [..., K] -> [..., N]: on CUDA the Triton kernel, or for batches of more than
    DEQUANT_ROWS rows the weight dequantized to a scratch tensor and cuBLAS (the spec's
    math, one kernel); the spec elsewhere. `fp8`: the 8-bit codes are float8_e4m3fn bytes
    (an FP8 checkpoint's weights kept as they are, runner/models/fp8_kept.py)."""
    if not x.is_cuda:
        return int_linear_ref(x, qweight, scales, zeros, bits, group_size, bias, fp8)
    if x.numel() > DEQUANT_ROWS * x.shape[-1]:
        w = dequantize_int_triton(qweight, scales, zeros, bits, x.shape[-1], group_size,
                                  x.dtype, fp8)  # fmt: skip
        return F.linear(x, w, bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    y = int_linear_triton(flat, qweight, scales, zeros, bits, group_size, bias, None, workspace,
                          fp8)  # fmt: skip
    return y.reshape(*x.shape[:-1], y.shape[-1])
