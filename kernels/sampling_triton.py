"""Triton kernels for the sampler: fused Gumbel-max, top-k/top-p thresholds, logprob stats.

Each public launcher has the signature of its torch spec in `pdserve.kernels.sampling`
(`name_ref`) and is reached through that module's `name` dispatcher for CUDA tensors.
On CPU tensors they run only under TRITON_INTERPRET=1, which is how the tests check them
without a GPU. No launcher reads a device value on the host: grids, loop trip counts and
which searches compile in come from shapes and host ints, so nothing here syncs.

What stays torch on CUDA: `torch.topk` for the top-k ids of `topk_logprobs` (k is a host
int), the final `masked_fill` of `apply_top_k_top_p` (the kernel finds a per-row
threshold; masking by it is one element-wise pass torch already does), top-k without
top-p (the dispatcher keeps `torch.topk`, faster than the count search here), and the
small [R, num_chunks] reductions that combine per-chunk partial results.

Measured on one H200, V = 151,936, fp32, CUDA-graph timing (do_bench_cudagraph), against
the torch spec on the same GPU:
    gumbel_argmax           R = 1: 12 us vs 203    R = 64: 0.10 vs 1.4 ms    R = 1024: 1.3 vs 18.9 ms
    topk_logprobs (k = 5)   R = 1: 92 us vs 105    R = 64: 0.23 vs 0.35 ms   R = 1024: 2.1 vs 4.0 ms
    top-k 50 + top-p 0.9    R = 1: 0.85 vs 0.60 ms R = 64: 1.2 vs 1.9 ms     R = 1024: 7.6 vs 20.9 ms
    top-p 0.9 alone         R = 1: 0.67 vs 0.51 ms R = 64: 0.97 vs 1.9 ms    R = 1024: 6.2 vs 20.8 ms
The threshold search is one program per row, so a single row is latency-bound on one SM
(~5 passes over 600 KB); splitting a row's search over programs is the next step.

What this module does not know: requests, or which ops the sampler runs. Numerics:
`gumbel_noise`/`gumbel_argmax` are bit-identical to the torch spec (uint32 hash, float64
log, IEEE-rounded division); `topk_logprobs` differs from torch's logsumexp by float32
rounding only (sums carried in float64); the top-p mass is summed per lane in float32
(<= V / BLOCK terms) and across lanes in float64 where the spec uses a float32 cumsum over
the whole row, so the two can disagree on tokens whose mass-above lies within the spec's
cumsum error (~1e-5 at V = 150k) of top_p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Salts of the noise recipe (module docstring of `pdserve.kernels.sampling`).
_SEED_SALT = tl.constexpr(0x9E3779B9)
_POSITION_SALT = tl.constexpr(0x85EBCA77)
_VOCAB_SALT = tl.constexpr(0xC2B2AE3D)

# Row scans: tiles of up to 1024 fp32 logits (4 KiB a load; V = 151,936 is 149 tiles), at
# least 8 tiles a row for small vocabs. A chunk of tiles is one program, so a small batch
# still spreads each row over many SMs.
_MAX_BLOCK = 1024
# Threshold search: each pass over a row tests NUM_PIVOTS keys at once (3 ops per pivot
# per logit), so the candidate interval shrinks >= 8x every other pass (key-uniform edges)
# and much faster on value-uniform ones; trimming to the keys present ends it early.
_SEARCH_BLOCK = 1024
_NUM_PIVOTS = 8
_SEARCH_WARPS = 8
# Programs to aim for when splitting rows into chunks: a few waves of H200's 132 SMs.
_TARGET_PROGRAMS = 512


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
        block = _scan_block(vocab_size)
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
    logits = _as_fp32_rows(logits)
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
    block, tiles_per_chunk, num_chunks = _row_chunks(num_rows, vocab_size)
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


@triton.jit
def _float_key(x):
    """int32 key with the order of float32 values: flip the magnitude bits of negatives.
    -0.0 is folded onto +0.0 so keys tie exactly when values compare equal; NaN sorts as
    +inf, so keys stay <= 0x7F800000 and `key + 1` never overflows."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.minimum(tl.where(x == 0.0, 0, key), 0x7F800000)


@triton.jit
def _key_to_float(key):
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pivot_keys(j, lo, hi, low_value, step, by_value, NUM_PIVOTS: tl.constexpr):
    """Lower edge of segment j of [lo, hi) (j = NUM_PIVOTS gives hi), int64 keys.

    Key-uniform edges shrink the interval NUM_PIVOTS-fold a pass whatever the data; on
    `by_value` passes an edge is raised to the value-uniform one where that is higher,
    which adapts to where logits actually lie (float keys are ~log-spaced, so key-uniform
    edges alone spend most segments on values near 0). Both are non-decreasing in j."""
    edge = lo + ((hi - lo) * j) // NUM_PIVOTS
    value_edge = _float_key(low_value + step * j.to(tl.float32)).to(tl.int64)
    edge = tl.where(by_value, tl.maximum(edge, tl.minimum(value_edge, hi - 1)), edge)
    return tl.where(j == 0, lo, tl.where(j == NUM_PIVOTS, hi, edge))


@triton.jit
def _search_threshold(
    row_ptr,
    vocab_size,
    lo,
    hi,
    row_max,
    target,
    MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """Largest key t of the row with W(key >= t) >= target, for t in [lo, hi) (int64).

    W sums a weight over elements with key >= the initial lo: 1 per element (count,
    top-k) or exp(x - row_max) (MASS, top-p; then `target` is a fraction of W(>= lo),
    known after the first pass). Invariant: W(>= lo) >= target > W(>= hi), or hi - 1 is
    the row max. Each pass splits [lo, hi) into NUM_PIVOTS segments, keeps the highest
    whose lower edge still reaches the target, and trims it to the smallest and largest
    keys present in [lo, hi). Only elements inside [lo, hi) add weight: W(>= hi) is
    carried from the pass before. Sums, min and max accumulate per lane in registers and
    are reduced once per pass: a cross-warp reduction per tile costs a barrier per tile.
    """
    pivot = tl.arange(0, NUM_PIVOTS)
    above = tl.zeros([], tl.float64)  # W(>= hi)
    total = tl.full([], -1.0, tl.float64)
    num_passes = 0
    while hi - lo > 1:
        low_value = _key_to_float(lo)
        high_value = _key_to_float(hi - 1)
        # Value edges need a finite range (-inf logits from an earlier mask are common).
        finite = (low_value > -1e38) & (high_value < 1e38)
        by_value = (num_passes % 2 == 0) & finite & (high_value > low_value)
        low_value = tl.where(finite, low_value, 0.0)
        step = (tl.where(finite, high_value, 0.0) - low_value) / NUM_PIVOTS
        lower = _pivot_keys(pivot, lo, hi, low_value, step, by_value, NUM_PIVOTS)
        upper = _pivot_keys(pivot + 1, lo, hi, low_value, step, by_value, NUM_PIVOTS)
        lower_key = lower.to(tl.int32)  # keys fit int32: lo >= -2**31, hi <= 0x7F800001
        lo_key = lo.to(tl.int32)
        hi_key = hi.to(tl.int32)
        lane_weight = tl.zeros([BLOCK, NUM_PIVOTS], tl.float32)  # per-lane W(>= lower[j])
        lane_min = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
        lane_max = tl.full([BLOCK], -0x7FFFFFFF, tl.int32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            in_row = offs < vocab_size
            x = tl.load(row_ptr + offs, mask=in_row, other=float("-inf"))
            key = _float_key(x)
            inside = in_row & (key >= lo_key) & (key < hi_key)
            if MASS:
                w = tl.where(inside, tl.exp(x - row_max), 0.0)
            else:
                w = inside.to(tl.float32)
            at_or_above = key[:, None] >= lower_key[None, :]  # [BLOCK, NUM_PIVOTS]
            lane_weight += tl.where(at_or_above, w[:, None], 0.0)
            lane_min = tl.minimum(lane_min, tl.where(inside, key, 0x7FFFFFFF))
            lane_max = tl.maximum(lane_max, tl.where(inside, key, -0x7FFFFFFF))
        # Per lane, count weights are exact integers and a mass is a sum of <= V / BLOCK
        # terms <= 1 (fp32 error ~1e-6 relative); across lanes and passes, float64.
        weight = tl.sum(lane_weight.to(tl.float64), axis=0) + above  # [NUM_PIVOTS]
        if MASS:
            # The first pass's weight[0] = W(>= lo) is the total mass above the top-k cut
            # (the renormalised softmax's denominator); W never grows with the pivot.
            total = tl.where(total < 0.0, tl.max(weight, axis=0), total)
            goal = target * total
        else:
            goal = target
        chosen = tl.max(tl.where(weight >= goal, pivot, 0), axis=0)
        is_top = chosen == NUM_PIVOTS - 1
        above = tl.where(is_top, above, tl.sum(tl.where(pivot == chosen + 1, weight, 0.0)))
        # No element of [lo, hi) lies below its min or above its max: trimming to them
        # keeps W(>= lo) and W(>= hi), and ends the search once one key is left.
        present_min = tl.min(lane_min, axis=0).to(tl.int64)
        present_max = tl.max(lane_max, axis=0).to(tl.int64)
        lo = tl.maximum(tl.sum(tl.where(pivot == chosen, lower, 0), axis=0), present_min)
        hi = tl.minimum(tl.sum(tl.where(pivot == chosen, upper, 0), axis=0), present_max + 1)
        num_passes += 1
    return lo


@triton.jit
def _top_k_top_p_threshold_kernel(
    logits_ptr,  # [R, V] float32, unit stride along V
    top_k_ptr,  # [R] int32, <= 0 or >= V = off
    top_p_ptr,  # [R] float32, >= 1 = off
    threshold_ptr,  # [R] float32 out: keep logits >= threshold (-inf = keep all)
    vocab_size,
    row_stride,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    k_active = HAS_TOP_K & (top_k > 0) & (top_k < vocab_size)
    p_active = HAS_TOP_P & (top_p < 1.0)
    threshold = tl.full([], float("-inf"), tl.float32)
    if k_active | p_active:
        row_max = tl.full([], float("-inf"), tl.float32)
        row_min = tl.full([], float("inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
            row_max = tl.maximum(row_max, tl.max(x, axis=0))
            row_min = tl.minimum(row_min, tl.min(tl.where(offs < vocab_size, x, row_max), axis=0))
        cut = _float_key(row_min).to(tl.int64)
        max_key = _float_key(row_max).to(tl.int64)
        # Outer ifs are constexpr, so a batch without top-k (or top-p) compiles no search.
        if HAS_TOP_K:  # noqa: SIM102
            if k_active:
                cut = _search_threshold(
                    row_ptr, vocab_size, cut, max_key + 1, row_max,
                    top_k.to(tl.float64), False, BLOCK, NUM_PIVOTS,
                )  # fmt: skip
        if HAS_TOP_P:  # noqa: SIM102
            if p_active:
                cut = _search_threshold(
                    row_ptr, vocab_size, cut, max_key + 1, row_max,
                    top_p.to(tl.float64), True, BLOCK, NUM_PIVOTS,
                )  # fmt: skip
        threshold = _key_to_float(cut)
    tl.store(threshold_ptr + row, threshold)


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor, top_p: Tensor, max_top_k: int, any_top_p: bool
) -> Tensor:
    """New [R, V] logits equal to `apply_top_k_top_p_ref`'s mask, without a sort.

    One program per row finds the smallest kept logit by a threshold search over the
    row's float keys (a count search for top-k, then a probability-mass search above the
    top-k cut for top-p), each ~5 passes over the row (600 KB at V = 151,936, L2-resident);
    the mask is then `logits < threshold`. Ties at either boundary are kept, as the spec
    says. `max_top_k` and `any_top_p` only decide which searches are compiled in.
    """
    logits = _as_fp32_rows(logits)
    num_rows, vocab_size = logits.shape
    assert top_k.shape == (num_rows,) and top_p.shape == (num_rows,), (
        f"top_k {tuple(top_k.shape)} and top_p {tuple(top_p.shape)} must be [{num_rows}]"
    )
    if num_rows == 0 or not (max_top_k > 0 or any_top_p):
        return logits
    threshold = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    _top_k_top_p_threshold_kernel[(num_rows,)](
        logits,
        top_k.to(torch.int32).contiguous(),
        top_p.to(torch.float32).contiguous(),
        threshold,
        vocab_size,
        logits.stride(0),
        HAS_TOP_K=max_top_k > 0,
        HAS_TOP_P=any_top_p,
        BLOCK=min(_SEARCH_BLOCK, _scan_block(vocab_size)),
        NUM_PIVOTS=_NUM_PIVOTS,
        num_warps=_SEARCH_WARPS,
    )
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))


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
    logits = _as_fp32_rows(logits)
    num_rows, vocab_size = logits.shape
    assert token_ids.shape == (num_rows,), (
        f"token_ids {tuple(token_ids.shape)} must be [R] for logits {tuple(logits.shape)}"
    )
    assert 0 <= num_logprobs <= vocab_size, (
        f"num_logprobs must be in [0, V={vocab_size}], got {num_logprobs}"
    )
    token_ids = token_ids.to(torch.int64).contiguous()
    block, tiles_per_chunk, num_chunks = _row_chunks(num_rows, vocab_size)
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


def _as_fp32_rows(logits: Tensor) -> Tensor:
    """[R, V] float32 with unit stride along V (bf16/fp16 logits are cast, as the spec's
    callers do); a row stride is kept, so a sliced batch is not copied."""
    assert logits.dim() == 2, f"logits must be [R, V], got {tuple(logits.shape)}"
    logits = logits.float()
    return logits if logits.stride(1) == 1 else logits.contiguous()


def _scan_block(vocab_size: int) -> int:
    """Tile width: up to _MAX_BLOCK, and at least 8 tiles a row (128 lanes at least)."""
    return min(_MAX_BLOCK, max(128, triton.next_power_of_2(vocab_size) // 8))


def _row_chunks(num_rows: int, vocab_size: int) -> tuple[int, int, int]:
    """(block, tiles_per_chunk, num_chunks): split rows so R * num_chunks ~ _TARGET_PROGRAMS."""
    block = _scan_block(vocab_size)
    num_tiles = triton.cdiv(vocab_size, block)
    num_chunks = min(num_tiles, max(1, _TARGET_PROGRAMS // max(num_rows, 1)))
    tiles_per_chunk = triton.cdiv(num_tiles, num_chunks)
    return block, tiles_per_chunk, triton.cdiv(num_tiles, tiles_per_chunk)
