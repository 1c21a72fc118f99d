"""A pull's device work as direct launches with the ids in the kernel's parameters.

The cuda_ipc transport's first choice on one GPU, before the copy graph
(kvtransfer/copy_graph.py): kernels/kv_copy_cuda.py `ParamCopy` takes up to 256 id pairs in
its launch parameters, so nothing is uploaded and no graph is launched. Per pull the host
makes, through the driver: one event record on the caller's stream (`ready`: the
destination units were just allocated there), one wait for it on the side stream, one
launch per tensor, one record of `done`. Against a graph replay that drops the id upload
node and the graph launch's own latency from the copy's critical path.

Rules that keep it correct:
- The driver copies a launch's parameters when it is queued, so the ids of the next pull
  may be written at once: unlike the graph's pinned buffer, nothing waits for `done`.
- The launchers hold the tables' addresses, a source's CUDA IPC mapping among them; the
  owner calls `clear` when it forgets that source.
- Ids are packed before anything is queued: an id that is not an int32 launches nothing
  and the caller takes another path (which names it); out-of-range ids are skipped on the
  device and the caller checks every id on the host while the copy runs.

What this module does not know: transports, leases, which units a request owns.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pdserve.kernels import kv_copy_cuda
from pdserve.kernels.sm_count import num_sms
from pdserve.kvtransfer.pack import UnitCopy


class _Driver(NamedTuple):
    event_record: Callable[[int, int], int]  # cuEventRecord(event, stream)
    stream_wait_event: Callable[[int, int, int], int]  # cuStreamWaitEvent(stream, event, 0)


@functools.cache
def _driver() -> _Driver | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        record, wait = lib.cuEventRecord, lib.cuStreamWaitEvent
    except (OSError, AttributeError):
        return None
    record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    for fn in (record, wait):
        fn.restype = ctypes.c_int
    return _Driver(record, wait)


def available(device: torch.device) -> bool:
    """Direct launches work on this device: the driver library and the NVRTC-compiled
    kernels are there."""
    return _driver() is not None and kv_copy_cuda.available(device)


class DirectCopies:
    """One thread's direct pulls on one side stream. Not thread-safe: one per side stream.
    `ready` and `done` are the side stream's events (created here if they are not yet)."""

    def __init__(
        self, stream: torch.cuda.Stream, ready: torch.cuda.Event, done: torch.cuda.Event
    ) -> None:
        driver = _driver()
        assert driver is not None, "DirectCopies without the driver library"
        self._driver = driver
        self._stream = stream.cuda_stream
        ready.record(stream)  # events are created on their first record
        done.record(stream)
        self._ready, self._done = ready.cuda_event, done.cuda_event
        self._num_sms = num_sms(stream.device)
        self._caller: torch.cuda.Stream | None = None
        self._caller_handle = 0
        # Per (source, destination) storage pair: a launcher per tensor, or None when a
        # tensor's layout does not suit the kernel (the pull takes another path).
        self._launchers: dict[tuple[int, int], tuple[kv_copy_cuda.ParamCopy, ...] | None] = {}
        self.launches = 0  # pulls queued this way

    def _for(self, c: UnitCopy) -> tuple[kv_copy_cuda.ParamCopy, ...] | None:
        src, dst = c.src.flat(), c.dst.flat()
        key = (id(src), id(dst))
        if key not in self._launchers:
            ok = all(kv_copy_cuda.eligible(s, d) for s, d in zip(src, dst, strict=True))
            self._launchers[key] = (
                tuple(
                    kv_copy_cuda.ParamCopy(s, d, self._num_sms)
                    for s, d in zip(src, dst, strict=True)
                )
                if ok
                else None
            )
        launchers = self._launchers[key]
        # The cache keys on identities: a launcher must still hold those very tables.
        if launchers and launchers[0].tables[0] is not src[0]:
            del self._launchers[key]
            return self._for(c)
        return launchers

    def try_launch(self, copies: Sequence[UnitCopy], caller: torch.cuda.Stream) -> bool:
        """Queue `copies` on the side stream after the work queued so far on `caller`, and
        `done` after them; False, queueing nothing, when a group has more pairs than a
        launch holds, a tensor does not suit the kernel, or an id is not an int32."""
        plans = []
        for c in copies:
            if len(c.src_ids) > kv_copy_cuda.PARAM_CAPACITY:
                return False
            launchers = self._for(c)
            if launchers is None:
                return False
            plans.append((launchers, c.src_ids, c.dst_ids))
        try:  # every id packed before anything is queued
            for launchers, src_ids, dst_ids in plans:
                for launcher in launchers:
                    launcher.fill(src_ids, dst_ids)
        except struct.error:
            return False
        if caller is not self._caller:  # raw handles: a property call into C per read
            self._caller, self._caller_handle = caller, caller.cuda_stream
        driver = self._driver
        err = driver.event_record(self._ready, self._caller_handle)
        if err == 0:
            err = driver.stream_wait_event(self._stream, self._ready, 0)
        if err != 0:
            raise RuntimeError(f"direct copy: ordering after the caller failed, CUresult {err}")
        for launchers, _, _ in plans:
            for launcher in launchers:
                launcher.launch(self._stream)
        err = driver.event_record(self._done, self._stream)
        if err != 0:
            raise RuntimeError(f"direct copy: recording its end failed, CUresult {err}")
        self.launches += 1
        return True

    def clear(self) -> None:
        self._launchers.clear()
