"""Staged writes: CPU-side diffs to a large device table, applied by one kernel per step.

`stage(row, start, values)` means `table[row, start:start+len(values)] = values` as if
applied in order. Overlapping writes to the same row are merged here (later values win)
so the kernel's writes are disjoint and may run in any order. `apply()` packs everything
into one small buffer, copies it to the device and launches `apply_staged_writes`; the
persistent CPU lists are never the source of an in-flight copy (a fresh tensor is built
per apply).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels.staged_write import apply_staged_writes
from pdserve.runner.mrv2.host_ring import HostRing

_NP_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}


class StagedWrites:
    def __init__(self, table: torch.Tensor, ring: HostRing | None = None):
        assert table.dim() == 2, "staged writes target a 2-D [rows, width] table"
        self.table = table
        self.ring = ring or HostRing(table.device)
        self._pending: dict[int, list[tuple[int, np.ndarray]]] = {}

    @property
    def num_pending(self) -> int:
        return sum(len(segs) for segs in self._pending.values())

    def stage(self, row: int, start: int, values) -> None:
        vals = np.asarray(values, dtype=np.int64)
        if vals.size == 0:
            return
        assert start >= 0 and start + vals.size <= self.table.shape[1], (
            f"write [{start}, {start + vals.size}) is outside the table width {self.table.shape[1]}"
        )
        segs = self._pending.setdefault(row, [])
        end = start + vals.size
        # Merge every pending segment that overlaps or touches the new one; new values win.
        lo, hi = start, end
        touching = [s for s in segs if s[0] <= end and s[0] + s[1].size >= start]
        for s in touching:
            lo, hi = min(lo, s[0]), max(hi, s[0] + s[1].size)
        if touching:
            merged = np.zeros(hi - lo, dtype=np.int64)
            for s_start, s_vals in touching:
                merged[s_start - lo : s_start - lo + s_vals.size] = s_vals
            merged[start - lo : end - lo] = vals
            gone = {id(s) for s in touching}
            segs[:] = [s for s in segs if id(s) not in gone]
            segs.append((lo, merged))
        else:
            segs.append((start, vals))

    def take_appends(self, rows: set[int]) -> dict[int, tuple[int, int]] | None:
        """If every pending write is one value in one of `rows` (a decode step's new
        blocks), hand them over as {row: (column, value)} and forget them: the caller
        writes them another way (kernels/decode_prep.py, inside a graph). Otherwise None,
        and nothing changes."""
        taken = {}
        for row, segs in self._pending.items():
            if row not in rows or len(segs) != 1 or segs[0][1].size != 1:
                return None
            taken[row] = (segs[0][0], int(segs[0][1][0]))
        self._pending.clear()
        return taken

    def discard_row(self, row: int) -> None:
        """Forget pending writes of a row whose request has gone (its slot is being reused)."""
        self._pending.pop(row, None)

    def apply(self) -> None:
        if not self._pending:
            return
        rows, starts, lens, chunks = [], [], [], []
        for row, segs in self._pending.items():
            for start, vals in segs:
                rows.append(row)
                starts.append(start)
                lens.append(vals.size)
                chunks.append(vals)
        self._pending.clear()
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        meta = self.ring.to_device(np.concatenate([np.asarray(rows), np.asarray(starts), cu]))
        values = self.ring.to_device(
            np.concatenate(chunks).astype(_NP_DTYPES[self.table.dtype], copy=False)
        )
        w = len(rows)
        apply_staged_writes(self.table, meta[:w], meta[w : 2 * w], meta[2 * w :], values)
