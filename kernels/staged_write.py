"""Apply a batch of staged `(row, start, values)` writes to a 2-D device table in one go.

The CPU collects diffs (new block ids, a new request's prompt tokens) and ships them as
one packed buffer; this kernel scatters them. It replaces copying a whole
`[max_num_reqs, width]` table per step (256 x 513 int32 = 525 KB for the block table at
the default sizes) with a few hundred bytes. Writes in one batch must not overlap; the
CPU side (`runner.mrv2.staged_writes`) guarantees that by merging.

Device path: one Triton program per write, looping over its values in BLOCK chunks. The
grid is the number of writes (a shape), so the launcher never reads a length on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_staged_writes_ref(
    table: torch.Tensor,  # [num_rows, width] int32, updated in place
    rows: torch.Tensor,  # [W] int64: target row of each write
    starts: torch.Tensor,  # [W] int64: first column of each write
    cu_lens: torch.Tensor,  # [W + 1] int64: write w's values are values[cu_lens[w]:cu_lens[w+1]]
    values: torch.Tensor,  # [N] same dtype as table
) -> None:
    num_values = values.numel()
    if num_values == 0:
        return
    lens = cu_lens[1:] - cu_lens[:-1]
    row_of_value = torch.repeat_interleave(rows, lens, output_size=num_values)
    first_of_value = torch.repeat_interleave(cu_lens[:-1], lens, output_size=num_values)
    start_of_value = torch.repeat_interleave(starts, lens, output_size=num_values)
    col = start_of_value + (torch.arange(num_values, device=values.device) - first_of_value)
    table[row_of_value, col] = values


# The write descriptors are slices of one packed per-apply buffer, so their alignment
# changes from call to call: specialising on it would compile new variants mid-serving.
@triton.jit(do_not_specialize_on_alignment=["rows_ptr", "starts_ptr", "cu_lens_ptr", "values_ptr"])
def _apply_staged_writes_kernel(
    table_ptr,
    rows_ptr,
    starts_ptr,
    cu_lens_ptr,
    values_ptr,
    table_row_stride,
    width,
    BLOCK: tl.constexpr,
):
    w = tl.program_id(0)
    row = tl.load(rows_ptr + w).to(tl.int64)
    start = tl.load(starts_ptr + w).to(tl.int64)
    first = tl.load(cu_lens_ptr + w).to(tl.int64)
    length = (tl.load(cu_lens_ptr + w + 1).to(tl.int64) - first).to(tl.int32)
    # int64 row offset: a [max_num_reqs, max_len] token table can pass 2^31 elements.
    dst_ptr = table_ptr + row * table_row_stride + start
    src_ptr = values_ptr + first
    for off in range(0, length, BLOCK):
        i = off + tl.arange(0, BLOCK)
        # `start + i < width`: a malformed write is dropped at the edge instead of
        # spilling into the next row.
        mask = (i < length) & (start + i < width)
        vals = tl.load(src_ptr + i, mask=mask)
        tl.store(dst_ptr + i, vals, mask=mask)


def _is_index(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int32, torch.int64)


def apply_staged_writes_triton(
    table: torch.Tensor,  # [num_rows, width] int32, updated in place
    rows: torch.Tensor,  # [W] int64
    starts: torch.Tensor,  # [W] int64
    cu_lens: torch.Tensor,  # [W + 1] int64
    values: torch.Tensor,  # [N] same dtype as table
) -> None:
    assert table.dim() == 2 and table.stride(1) == 1, "table must be 2-D with contiguous rows"
    assert values.dtype == table.dtype, f"values {values.dtype} must match table {table.dtype}"
    assert all(_is_index(t) for t in (rows, starts, cu_lens)), "rows/starts/cu_lens are int32/64"
    assert all(t.is_contiguous() for t in (rows, starts, cu_lens, values)), (
        "rows, starts, cu_lens and values must be contiguous"
    )
    num_writes = rows.numel()
    assert cu_lens.numel() == num_writes + 1 and starts.numel() == num_writes, (
        "one (row, start) per write and cu_lens is [W + 1]"
    )
    if num_writes == 0 or values.numel() == 0:
        return
    # A fixed BLOCK (not sized from N) so a new batch never triggers a recompile; 512
    # int32 = 2 KB per iteration, and most writes (a few block ids) take one.
    _apply_staged_writes_kernel[(num_writes,)](
        table, rows, starts, cu_lens, values, table.stride(0), table.shape[1], BLOCK=512
    )


def apply_staged_writes(table, rows, starts, cu_lens, values) -> None:
    assert table.dim() == 2 and values.dtype == table.dtype, "table must be 2-D; dtypes must match"
    assert cu_lens.numel() == rows.numel() + 1 == starts.numel() + 1, "one (row, start) per write"
    if table.is_cuda:
        apply_staged_writes_triton(table, rows, starts, cu_lens, values)
    else:
        apply_staged_writes_ref(table, rows, starts, cu_lens, values)
