"""Runs of drafted decode rows in the per-head decode attention (kernels/paged_decode_split.py).

With k-token speculative drafts every drafted position is a decode row of its own, with its
request's block table and its own length (runner/mrv2/model_runner.py). Given `row_slots`
and `max_run` = k + 1, the kernel serves a run of such rows (same slot, consecutive tokens,
consecutive lengths) from its first row's program, reading each K/V tile once for the whole
run. The checks:
- the result is the per-row kernel's, bit for bit on a GPU where both use one tile size
  (within 4 ulps otherwise), and the spec's within the attention tests' tolerance
  (tests/test_paged_attention_triton.py);
- the run really is served by its first row: the later rows' block tables are replaced by
  the null block, which holds NaN, so a program that read them would give NaN;
- rows that only look alike do not join a run (they keep their own tables, so a program
  that took them in would give them another row's keys): a neighbour of another slot at the
  next length, pad rows behind a real row of slot 0, a row of the same slot whose length
  skips.

The cache is NaN outside every context, as in the attention tests. On the CPU the kernel
runs in Triton's interpreter with short contexts; on a GPU they span several tiles.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import paged_attention_ref
from pdserve.kernels.paged_attention_triton import paged_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
X = 10 if DEVICE == "cuda" else 1
BLOCK = 16


def _batch(requests, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """requests: (slot, context before the step, rows) -> q, cache, tables, qsl, seq_lens,
    slots; each request's rows are its drafted positions, then two pad rows."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + n) // BLOCK) for _, ctx, n in requests]
    num_blocks = 1 + sum(need) + 4
    cache = torch.full((num_blocks, 2, BLOCK, hkv, d), float("nan"), dtype=torch.float32)
    width = max(need)
    ids = (1 + torch.randperm(num_blocks - 1, generator=g)).to(torch.int32).tolist()
    tables, seq_lens, slots = [], [], []
    for (slot, ctx, n), nb in zip(requests, need, strict=True):
        row = [ids.pop() for _ in range(nb)] + [0] * (width - nb)
        for pos in range(ctx + n):  # the step's own K/V were written before attention
            blk, off = row[pos // BLOCK], pos % BLOCK
            cache[blk, :, off] = torch.randn(2, hkv, d, generator=g)
        for i in range(n):
            tables.append(row)
            seq_lens.append(ctx + 1 + i)
            slots.append(slot)
    for _ in range(2):  # pads: slot 0, no context, a zero table row
        tables.append([0] * width)
        seq_lens.append(0)
        slots.append(0)
    rows = len(seq_lens)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    as_int = dict(dtype=torch.int32, device=DEVICE)
    return (
        q.to(DEVICE),
        cache.to(dtype).to(DEVICE),
        torch.tensor(tables, **as_int),
        torch.arange(rows + 1, **as_int),
        torch.tensor(seq_lens, **as_int),
        torch.tensor(slots, **as_int),
    )


def _attend(q, cache, tables, qsl, seq_lens, slots=None, max_run=1):
    out = torch.full_like(q, 7.0)
    paged_attention_triton(
        q, cache, tables, qsl, seq_lens, q.shape[-1] ** -0.5, out, 1, int(seq_lens.max()),
        num_splits=1, row_slots=slots, max_run=max_run,
    )  # fmt: skip
    return out


# Slot 0 runs last, so the pad rows behind it (slot 0) follow a real row of their slot. Slot
# 5's first row sits at the length after slot 2's last (another slot); slot 7's rows skip a
# length between two runs of its own.
REQUESTS = [(3, 20 * X, 1), (2, 33 * X, 4), (5, 33 * X + 4, 3), (7, 17 * X, 2),
            (7, 17 * X + 3, 2), (1, 1, 4), (0, 64 * X - 2, 3)]  # fmt: skip


@pytest.mark.parametrize(
    "hq, hkv, d, max_run",
    [(4, 2, 32, 4), (6, 2, 24, 4), (8, 2, 32, 5)],  # q tile rows 8, 12, 20 (-> 16, 16, 32)
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_runs_of_drafted_rows_equal_the_per_row_kernel(hq, hkv, d, max_run, dtype):
    q, cache, tables, qsl, seq_lens, slots = _batch(REQUESTS, hq, hkv, d, dtype, seed=hq + d)
    per_row = _attend(q, cache, tables, qsl, seq_lens)
    # Every row after a run's first gets the null block's NaN for its table: only a program
    # that reads the first row's table gives a finite result there.
    later = torch.zeros(len(slots), dtype=torch.bool)
    s, n = slots.cpu(), seq_lens.cpu()
    later[1:] = (s[1:] == s[:-1]) & (n[1:] == n[:-1] + 1)
    assert int(later.sum()) == 3 + 2 + 1 + 1 + 3 + 2, "the runs the batch is built with"
    run_tables = tables.clone()
    run_tables[later.to(DEVICE)] = 0
    runs = _attend(q, cache, run_tables, qsl, seq_lens, slots, max_run)
    assert not runs.isnan().any(), "a later row of a run read its own table"
    same_tile = max(16, 1 << (hq // hkv * max_run - 1).bit_length()) == 16
    if DEVICE == "cuda" and same_tile:
        assert torch.equal(runs, per_row)
    else:
        # Triton's interpreter multiplies tiles with numpy's BLAS, whose kernels for the
        # edge rows of a tile can sum in another order than for the rest: a row's result
        # may move by an ulp with what shares its tile (seen on an AVX2-only CPU)
        eps = torch.finfo(dtype).eps
        assert torch.allclose(runs, per_row, rtol=4 * eps, atol=4 * eps)
    ref = torch.zeros(q.shape, dtype=torch.float64)  # pad rows: zeros, as the kernel writes
    paged_attention_ref(
        q.double().cpu(), cache.double().cpu(), tables.cpu(), qsl.cpu(), seq_lens.cpu(),
        d**-0.5, ref, 1, int(seq_lens.max()),
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(runs.double().cpu(), ref, atol=tol, rtol=tol)
