"""Unit ids of a direct copy, host to device in one asynchronous copy per pull.

`torch.tensor(ids, device="cuda")` copies from pageable memory, which synchronizes the
stream: a pull then waits for everything queued before it (a decode step included) just to
ship a few hundred int64s. `IdStaging` keeps a pinned host buffer and a device buffer
across pulls, fills the host one with numpy and copies it with `non_blocking=True`.

Reuse rules, so a copy never reads a buffer being refilled:
- the device buffer is written and read only on the staging's own stream, so stream order
  puts the next copy into it after the kernels that read the last one;
- the host buffer is refilled only once the copy that last read it has completed (an
  event); if it has not (a pull that timed out and left work queued), a fresh buffer is
  taken instead of waiting, and torch keeps the old one until that copy is done.

What this module does not know: what the ids mean or whether they are in range
(`kvtransfer.pack` checks them before staging).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

# 4,096 ids (32 KB pinned) cover src + dst ids of a 32k-token request at block size 16;
# larger pulls grow the buffers to the next power of two.
_INITIAL_IDS = 4096


class IdStaging:
    """Pinned and device int64 buffers for one stream. Not thread-safe: one per thread
    (`IdStagingPool`)."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.device = stream.device
        self._host = torch.empty(_INITIAL_IDS, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(stream):  # freed later on this stream, so reuse is ordered
            self._device = torch.empty(_INITIAL_IDS, dtype=torch.int64, device=self.device)
        # The last copy out of `_host`; query() is True before the first record.
        self._copied = torch.cuda.Event()

    def stage(self, id_arrays: Sequence[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
        """The arrays back to back in one device int64 buffer, filled by one host-to-device
        copy queued on `self.stream`, which must be the current stream (`copy_groups`
        checks), and where each array starts in it; valid until the next `stage` (kernels
        reading it must be queued on the same stream). No views are made: each costs the
        host a few microseconds, and the copy kernel takes the buffer and an offset."""
        total = sum(a.size for a in id_arrays)
        if total == 0:  # every unit was local already: nothing to queue
            return self._device, [0] * len(id_arrays)
        if total > self._host.numel() or not self._copied.query():
            size = _capacity(total, self._host.numel())
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        if total > self._device.numel():
            with torch.cuda.stream(self.stream):
                self._device = torch.empty(
                    _capacity(total, self._device.numel()), dtype=torch.int64, device=self.device
                )
        host = self._host.numpy()
        offsets = []
        start = 0
        for a in id_arrays:
            host[start : start + a.size] = a
            offsets.append(start)
            start += a.size
        # The caller runs on `self.stream` already (copy_groups asserts it): no stream
        # context here, each costs the host a few us.
        self._device[:total].copy_(self._host[:total], non_blocking=True)
        self._copied.record(self.stream)
        return self._device, offsets


def _capacity(needed: int, current: int) -> int:
    return max(current, 1 << max(needed - 1, 0).bit_length())


class IdStagingPool:
    """One `IdStaging` per thread and stream, made on first use: threads pulling at once
    (the decode loader runs two) never share a host buffer."""

    def __init__(self) -> None:
        self._local = threading.local()

    def for_stream(self, stream: torch.cuda.Stream) -> IdStaging:
        stagings = self._local.__dict__.setdefault("stagings", {})
        key = (stream.device_index, stream.stream_id)
        staging = stagings.get(key)
        if staging is None:
            staging = stagings[key] = IdStaging(stream)
        return staging
