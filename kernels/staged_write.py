"""Apply a batch of staged `(row, start, values)` writes to a 2-D device table in one go.

The CPU collects diffs (new block ids, a new request's prompt tokens) and ships them as
one packed buffer; this kernel scatters them. It replaces copying a whole
`[max_num_reqs, width]` table per step (256 x 513 int32 = 525 KB for the block table at
the default sizes) with a few hundred bytes. Writes in one batch must not overlap; the
CPU side (`runner.mrv2.staged_writes`) guarantees that by merging.
"""

from __future__ import annotations

import torch


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


def apply_staged_writes(table, rows, starts, cu_lens, values) -> None:
    assert table.dim() == 2 and values.dtype == table.dtype, "table must be 2-D; dtypes must match"
    assert cu_lens.numel() == rows.numel() + 1 == starts.numel() + 1, "one (row, start) per write"
    apply_staged_writes_ref(table, rows, starts, cu_lens, values)
