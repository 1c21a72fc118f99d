"""Triton kernels for the sampler: fused Gumbel-max, greedy argmax, logprob stats (top-k /
top-p masking is kernels/top_k_top_p_triton.py; the row-scan shapes kernels/row_scan.py).

Each public launcher has the signature of its torch spec in `pdserve.kernels.sampling`
(`name_ref`) and is reached through that module's `name` dispatcher for CUDA tensors.
On CPU tensors they run only under TRITON_INTERPRET=1, which is how the tests check them
without a GPU. No launcher reads a device value on the host: grids and loop trip counts
come from shapes and host ints, so nothing here syncs.

What stays torch on CUDA: `torch.topk` for the top-k ids of `topk_logprobs` (k is a host
int), and the small [R, num_chunks] reductions that combine per-chunk partial results.

Measured on one H200, V = 151,936, fp32, CUDA-graph timing (do_bench_cudagraph), against
the torch spec on the same GPU:
    gumbel_argmax           R = 1: 12 us vs 203    R = 64: 0.10 vs 1.4 ms    R = 1024: 1.3 vs 18.9 ms
    topk_logprobs (k = 5)   R = 1: 92 us vs 105    R = 64: 0.23 vs 0.35 ms   R = 1024: 2.1 vs 4.0 ms

What this module does not know: requests, or which ops the sampler runs. Numerics:
`gumbel_noise`/`gumbel_argmax` are bit-identical to the torch spec (uint32 hash, float64
log, IEEE-rounded division); `topk_logprobs` differs from torch's logsumexp by float32
rounding only (sums carried in float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.row_scan import TARGET_PROGRAMS, as_fp32_rows, row_chunks, scan_block

# The greedy tail's plain argmax reads 16-bit logits and nothing per row, so its programs
# are short: at 32 rows x 151,936 the sampler's 512 programs (10 tiles each, one after
# another) took 9.1 us of the step graph on the H200 (benchmarks/step_gaps.py,
# results/step_gaps_32_890bd6e.json), ~1 TB/s of the logits.
GREEDY_TARGET_PROGRAMS = 2048

# Salts of the noise recipe (module docstring of `pdserve.kernels.sampling`).
_SEED_SALT = tl.constexpr(0x9E3779B9)
_POSITION_SALT = tl.constexpr(0x85EBCA77)
_VOCAB_SALT = tl.constexpr(0xC2B2AE3D)


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finaliser on uint32 (multiplies wrap mod 2**32 natively)."""
    h ^= h >> 16
    h = h * 0x85EBCA6B
    h ^= h >> 13
    h = h * 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _row_key(seed, position):
    """The recipe's `r` for one row, from an int64 seed and int64 position (uint32)."""
    low = seed.to(tl.uint32)  # truncation keeps the low word
    high = (seed >> 32).to(tl.uint32)
    seed_key = _fmix32(low ^ _fmix32(high ^ _SEED_SALT))
    return _fmix32(seed_key ^ _fmix32(position.to(tl.uint32) ^ _POSITION_SALT))


@triton.jit
def _gumbel(row_key, offs):
    """float32 Gumbel noise at vocab indices `offs`: float64 log, rounded once (the spec)."""
    h = _fmix32(row_key ^ _fmix32(offs.to(tl.uint32) ^ _VOCAB_SALT))
    u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2**-32, exact
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def _gumbel_noise_kernel(
    seeds_ptr,  # [R] int64
    positions_ptr,  # [R] int64
    out_ptr,  # [R, V] float32 out, contiguous
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    tl.store(out_ptr + row * vocab_size + offs, _gumbel(row_key, offs), mask=offs < vocab_size)


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """[R, V] float32 noise, bit-identical to `gumbel_noise_ref`. Tests and debugging only:
    the sampler never materialises the noise (`gumbel_argmax` fuses it)."""
    _check_seeds(seeds, positions)
    assert vocab_size >= 1, f"vocab_size must be >= 1, got {vocab_size}"
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        block = scan_block(vocab_size)
        grid = (seeds.shape[0], triton.cdiv(vocab_size, block))
        _gumbel_noise_kernel[grid](seeds, positions, out, vocab_size, BLOCK=block)
    return out


@triton.jit(do_not_specialize=["tiles_per_chunk"])  # follows the batch size
def _gumbel_argmax_kernel(
    logits_ptr,  # [R, V] float32 (any float with GREEDY), unit stride along V
    temperature_ptr,  # [R] float32, 0 = greedy (not read with GREEDY)
    seeds_ptr,  # [R] int64 (not read with GREEDY)
    positions_ptr,  # [R] int64 (not read with GREEDY)
    best_value_ptr,  # [R, num_chunks] float32 out: max of logits / T + noise in the chunk
    best_index_ptr,  # [R, num_chunks] int32 out: its lowest vocab index
    vocab_size,
    row_stride,
    tiles_per_chunk,
    BLOCK: tl.constexpr,
    GREEDY: tl.constexpr = False,  # every row greedy: a plain argmax, no per-row settings
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    if not GREEDY:  # a compile-time branch: the greedy variant has no noise code at all
        temperature = tl.load(temperature_ptr + row)
        row_key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    first = chunk * tiles_per_chunk * BLOCK
    best_value = tl.full([], float("-inf"), tl.float32)
    best_index = first
    for tile in range(tiles_per_chunk):
        offs = first + tile * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(
            logits_ptr + row * row_stride + offs, mask=offs < vocab_size, other=float("-inf")
        ).to(tl.float32)  # exact for bf16/fp16; a no-op on float32
        # Nested, not `and`: Triton may evaluate both operands, and `temperature` does not
        # exist in the greedy variant.
        if not GREEDY:  # noqa: SIM102
            if temperature != 0.0:
                # div_rn: IEEE division like torch's `x / T`; Triton's `/` on fp32 is
                # approximate.
                x = tl.math.div_rn(x, temperature) + _gumbel(row_key, offs)
        tile_value, tile_index = tl.max(x, axis=0, return_indices=True)
        # Strict `>`: an equal value in a later tile has a higher index (torch.argmax's tie).
        better = tile_value > best_value
        best_value = tl.where(better, tile_value, best_value)
        best_index = tl.where(better, first + tile * BLOCK + tile_index, best_index)
    tl.store(best_value_ptr + row * num_chunks + chunk, best_value)
    tl.store(best_index_ptr + row * num_chunks + chunk, best_index)


def gumbel_argmax(logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """[R] int64, equal to `gumbel_argmax_ref`, without an [R, V] noise tensor.

    Grid (R, num_chunks): each program scans `tiles_per_chunk` tiles of one row and writes
    its best (value, index); a torch argmax over the [R, num_chunks] partials picks the
    first chunk holding the row max, which keeps torch.argmax's lowest-index tie rule.
    Greedy rows (T = 0) skip the hash and the logs.
    """
    logits = as_fp32_rows(logits)
    num_rows, vocab_size = logits.shape
    assert temperature.shape == (num_rows,), (
        f"temperature {tuple(temperature.shape)} must be [R={num_rows}]"
    )
    _check_seeds(seeds, positions)
    assert seeds.shape == (num_rows,), f"seeds {tuple(seeds.shape)} must be [R={num_rows}]"
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    best_value, best_index = _chunk_bests(
        logits, temperature.to(torch.float32).contiguous(), seeds.contiguous(),
        positions.contiguous(), greedy=False,
    )  # fmt: skip
    chunk = best_value.argmax(dim=1, keepdim=True)
    return best_index.gather(1, chunk).squeeze(1).to(torch.int64)


def _chunk_bests(
    logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor, greedy: bool
) -> tuple[Tensor, Tensor]:
    """[R, num_chunks] float32 best values and int32 their lowest vocab indices, one
    program per (row, chunk) of `_gumbel_argmax_kernel`."""
    num_rows, vocab_size = logits.shape
    target = GREEDY_TARGET_PROGRAMS if greedy else TARGET_PROGRAMS
    block, tiles_per_chunk, num_chunks = row_chunks(num_rows, vocab_size, target)
    best_value = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(num_rows, num_chunks)](
        logits,
        temperature,
        seeds,
        positions,
        best_value,
        best_index,
        vocab_size,
        logits.stride(0),
        tiles_per_chunk,
        BLOCK=block,
        GREEDY=greedy,
    )
    return best_value, best_index


@triton.jit
def _first_best_chunk_kernel(
    best_value_ptr,  # [R, num_chunks] float32
    best_index_ptr,  # [R, num_chunks] int32
    out_ptr,  # [R] int64 out
    num_chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    values = tl.load(
        best_value_ptr + row * num_chunks + offs, mask=offs < num_chunks, other=float("-inf")
    )
    # The first chunk holding the row max: its index is the row's lowest one (torch's tie).
    _, chunk = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(best_index_ptr + row * num_chunks + chunk)
    tl.store(out_ptr + row, index.to(tl.int64))


def greedy_argmax(logits: Tensor) -> Tensor:
    """[R] int64, `logits.argmax(dim=-1)` (lowest index among equal maxima) for bf16, fp16
    or fp32 logits, without the float32 copy `gumbel_argmax` makes: its chunk kernel with
    no per-row settings, then one program per row combining the chunks. Two launches where
    torch's argmax takes one, but spread over R * num_chunks programs (torch's runs ~16 us
    at R = 32, V = 151,936 on the H200): for a graph's greedy tail, where launches cost the
    host nothing. NaN logits are not torch's NaN-is-max rule (as in `gumbel_argmax`)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [R, V], unit stride"
    assert logits.is_floating_point(), f"logits must be float, got {logits.dtype}"
    num_rows = logits.shape[0]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    # temperature, seeds, positions: not read when greedy
    best_value, best_index = _chunk_bests(logits, logits, logits, logits, greedy=True)
    num_chunks = best_value.shape[1]
    _first_best_chunk_kernel[(num_rows,)](
        best_value, best_index, out, num_chunks, BLOCK=triton.next_power_of_2(num_chunks)
    )
    return out


@triton.jit(do_not_specialize=["tiles_per_chunk"])  # follows the batch size
def _logprob_stats_kernel(
    logits_ptr,  # [R, V] float32, unit stride along V
    token_ids_ptr,  # [R] int64
    max_ptr,  # [R, num_chunks] float32 out: chunk max
    sum_ptr,  # [R, num_chunks] float64 out: sum of exp(x - chunk max)
    count_ptr,  # [R, num_chunks] int32 out: logits > the token's logit
    vocab_size,
    row_stride,
    tiles_per_chunk,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    row_ptr = logits_ptr + row * row_stride
    token_logit = tl.load(row_ptr + tl.load(token_ids_ptr + row))
    first = chunk * tiles_per_chunk * BLOCK
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.zeros([], tl.float64)
    count = tl.zeros([], tl.int32)
    for tile in range(tiles_per_chunk):
        offs = first + tile * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
        count += tl.sum((x > token_logit).to(tl.int32), axis=0)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        # Online logsumexp; a still-all--inf prefix keeps sum 0 (exp(-inf - -inf) is nan).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        tile_sum = tl.sum(tl.exp(x - safe_max), axis=0).to(tl.float64)
        run_sum = run_sum * tl.exp(run_max - safe_max).to(tl.float64) + tile_sum
        run_max = new_max
    tl.store(max_ptr + row * num_chunks + chunk, run_max)
    tl.store(sum_ptr + row * num_chunks + chunk, run_sum)
    tl.store(count_ptr + row * num_chunks + chunk, count)


def topk_logprobs(
    logits: Tensor, num_logprobs: int, token_ids: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Same outputs as `topk_logprobs_ref`: (ids, logprobs, ranks).

    One pass per row chunk gives an online (max, sum of exp) and the count of logits
    strictly above the token's; torch combines the [R, num_chunks] partials and keeps
    `torch.topk` for the top-k ids (k is a host int, so it does not sync).
    """
    logits = as_fp32_rows(logits)
    num_rows, vocab_size = logits.shape
    assert token_ids.shape == (num_rows,), (
        f"token_ids {tuple(token_ids.shape)} must be [R] for logits {tuple(logits.shape)}"
    )
    assert 0 <= num_logprobs <= vocab_size, (
        f"num_logprobs must be in [0, V={vocab_size}], got {num_logprobs}"
    )
    token_ids = token_ids.to(torch.int64).contiguous()
    block, tiles_per_chunk, num_chunks = row_chunks(num_rows, vocab_size)
    part_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty(num_rows, num_chunks, dtype=torch.float64, device=logits.device)
    part_count = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    if num_rows:
        _logprob_stats_kernel[(num_rows, num_chunks)](
            logits,
            token_ids,
            part_max,
            part_sum,
            part_count,
            vocab_size,
            logits.stride(0),
            tiles_per_chunk,
            BLOCK=block,
        )
    row_max = part_max.amax(dim=1, keepdim=True)
    safe_max = torch.where(torch.isinf(row_max), 0.0, row_max).double()
    total = (part_sum * torch.exp(part_max.double() - safe_max)).sum(dim=1, keepdim=True)
    log_normaliser = (safe_max + torch.log(total)).float()  # [R, 1]
    ranks = part_count.sum(dim=1, dtype=torch.int64) + 1
    ids, values = token_ids[:, None], logits.gather(1, token_ids[:, None])
    if num_logprobs > 0:
        top = logits.topk(num_logprobs, dim=-1)
        ids = torch.cat([ids, top.indices], dim=1)
        values = torch.cat([values, top.values], dim=1)
    return ids, values - log_normaliser, ranks


def _check_seeds(seeds: Tensor, positions: Tensor) -> None:
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64, (
        f"seeds/positions must be int64, got {seeds.dtype}/{positions.dtype}"
    )
    assert seeds.dim() == 1 and seeds.shape == positions.shape, (
        f"seeds {tuple(seeds.shape)} and positions {tuple(positions.shape)} must be equal [R]"
    )
