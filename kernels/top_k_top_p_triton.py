"""Triton top-k / top-p masking for the sampler: a per-row threshold found by searching the
row's float keys, then one `masked_fill` (kernels/sampling.py dispatches here for CUDA
tensors; the spec is `apply_top_k_top_p_ref` there).

On CPU tensors it runs only under TRITON_INTERPRET=1, which is how the tests check it.
No device value is read on the host: which searches compile in comes from host ints.
What stays torch: the final `masked_fill` (masking by the threshold is one element-wise
pass torch already does), and top-k without top-p (the dispatcher keeps `torch.topk`,
faster than the count search here).

Measured on one H200, V = 151,936, fp32, CUDA-graph timing, against the torch spec:
    top-k 50 + top-p 0.9    R = 1: 0.85 vs 0.60 ms R = 64: 1.2 vs 1.9 ms     R = 1024: 7.6 vs 20.9 ms
    top-p 0.9 alone         R = 1: 0.67 vs 0.51 ms R = 64: 0.97 vs 1.9 ms    R = 1024: 6.2 vs 20.8 ms
The search is one program per row, so a single row is latency-bound on one SM (~5 passes
over 600 KB); splitting a row's search over programs is the next step. The top-p mass is
summed per lane in float32 (<= V / BLOCK terms) and across lanes in float64 where the spec
uses a float32 cumsum over the whole row, so the two can disagree on tokens whose
mass-above lies within the spec's cumsum error (~1e-5 at V = 150k) of top_p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve.kernels.row_scan import as_fp32_rows, scan_block

# Each pass over a row tests NUM_PIVOTS keys at once (3 ops per pivot per logit), so the
# candidate interval shrinks >= 8x every other pass (key-uniform edges) and much faster on
# value-uniform ones; trimming to the keys present ends it early.
_SEARCH_BLOCK = 1024
_NUM_PIVOTS = 8
_SEARCH_WARPS = 8


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
    logits = as_fp32_rows(logits)
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
        BLOCK=min(_SEARCH_BLOCK, scan_block(vocab_size)),
        NUM_PIVOTS=_NUM_PIVOTS,
        num_warps=_SEARCH_WARPS,
    )
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))
