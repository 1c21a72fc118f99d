"""A pull's device work as a CUDA graph: captured once per (tables, id capacity), replayed.

Why: before this, a 2,048-token cuda_ipc pull on the H200 spent 0.15-0.35 ms of host time
before its 0.13 ms copy ran. The calls it made, measured one by one on that host
(benchmarks/kv_copy_sweep.py --host): Triton's launcher ~30 us, `with torch.cuda.stream`
~20 us, the id checks ~20 us a side, the pinned staging copy ~9 us. A replayed graph holds
the id upload (a pinned host buffer into a device buffer, by a small kernel reading the
pinned memory: `kernels.kv_copy.stage_ids`, 6 us of device time less than a memcpy node)
and one counted-kernel launch per tensor (kernels/kv_copy.py `launch_counted`). The
kernel reads the id count from the buffer, so one graph serves every count up to its
capacity. The host then packs the ids into the pinned buffer (10 us for 2 x 128 ids,
kv_copy_sweep.py's replay_e2e) and launches the graph through the driver; a filled replay
of the 2,048-token request took 139 us end to end there, one plain copy of its bytes
126 us.

The graph also holds the pull's two stream events, as an event wait node (for `ready`,
which the caller records on its own stream: the destination units were just allocated
there) and an event record node (`done`); so a replay costs the host one event record,
the fill and one driver launch, where recording, waiting and recording again as three
calls of their own cost it ~5.4 us more (1.8 us each, kv_copy_sweep.py --host).

Rules that keep it correct:
- The pinned buffer is refilled only once the replay that last read it has completed
  (`done`; or `idle`, which the owner sets once it has seen `done` complete, saving a
  2 us query). If it has not (a pull that timed out and left work queued), `try_fill`
  says no and the caller takes the eager path.
- The graph holds the tables' addresses, a source's CUDA IPC mapping among them. Its owner
  drops it when it forgets that source.
- The capture uses thread-local error mode and allocates nothing, so it does not disturb
  CUDA work other threads are queueing (the decode engine's step loop). It runs on the
  stream the graph will be replayed on.
- Ids are not checked before the replay: the kernel skips an out-of-range id, and the
  caller checks them on the host while the copy runs (`kvtransfer.pack.verify_copies`).

What this module does not know: transports, leases, which units a request owns.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pdserve.kernels.kv_copy import PairCache, stage_ids
from pdserve.kvtransfer.layout import GroupStorage
from pdserve.kvtransfer.pack import UnitCopy

logger = logging.getLogger(__name__)

# Capacities are powers of two from 8 ids: a pull of n ids uses the graph of the next
# power of two, whose kernel then skips at most half of its slots (a skipped slot's
# programs load the count and return). Past 8,192 units (a 131k-token request at block
# size 16), pulls take the eager path.
MIN_CAPACITY = 8
MAX_CAPACITY = 8192


class _Driver(NamedTuple):
    graph_launch: Callable[[int, int], int]  # cuGraphLaunch(exec, stream)
    event_record: Callable[[int, int], int]  # cuEventRecord(event, stream)


@functools.cache
def _driver() -> _Driver | None:
    """The driver's cuGraphLaunch and cuEventRecord, or None without libcuda. torch's
    `replay` launches on the current stream, so the caller must switch streams around it;
    the driver call takes the stream (end to end 139.0 vs 141.6 us for the 2,048-token
    replay, kv_copy_sweep.py's replay_e2e on the H200). torch's `Event.record` costs the
    host ~1 us more than the driver call it makes (a device guard and argument parsing)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fns = (lib.cuGraphLaunch, lib.cuEventRecord)
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return _Driver(*fns)


@functools.cache
def _int64s(n: int) -> struct.Struct:
    """Packs n ints as int64 straight into a buffer: half the host time of a numpy slice
    assignment from a list, and it refuses floats and out-of-range ints (struct.error)."""
    return struct.Struct(f"{n}q")


def capacity_for(n: int) -> int | None:
    """The graph capacity for a group of `n` ids; None past MAX_CAPACITY."""
    if n > MAX_CAPACITY:
        return None
    return max(MIN_CAPACITY, 1 << max(n - 1, 0).bit_length())


class GraphedCopy:
    """One captured copy: per group, its tables' pairs and a slot region
    `[count, capacity source ids, capacity destination ids]` of one int64 buffer."""

    def __init__(
        self,
        tables: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],  # [group][tensor]
        capacities: Sequence[int],
        stream: torch.cuda.Stream,
        pairs: PairCache,
    ) -> None:
        self.capacities = tuple(capacities)
        self.offsets = []
        total = 0
        for cap in self.capacities:
            self.offsets.append(total)
            total += 1 + 2 * cap
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=True)
        self.slots = self.host.numpy()
        self.graph = torch.cuda.CUDAGraph()
        # External: captured as a wait node and a record node, not as the capture's own
        # cross-stream dependencies (torch.cuda.Event's `external`).
        self.ready = torch.cuda.Event(external=True)  # recorded by `replay` on the caller
        self.done = torch.cuda.Event(external=True)  # recorded by each replay, at its end
        self.idle = True  # no replay, or the owner has seen the last one's `done` complete
        self.keep: list = []  # what the owner's cache key names (kept alive with the graph)
        with torch.cuda.stream(stream):
            self.device = torch.zeros(total, dtype=torch.int64, device=stream.device)
            self._launches = launches = [
                (pairs.get(src, dst), off, cap)
                for group, off, cap in zip(tables, self.offsets, self.capacities, strict=True)
                for src, dst in group
            ]
            # Eager first with every count 0: compiles and loads the kernels (neither may
            # happen inside a capture) and copies nothing.
            stage_ids(self.host, self.device)
            for pair, off, cap in launches:
                pair.launch_counted(self.device, off, cap)
            # Events are created on first record, which a capture must not be.
            self.ready.record(stream)
            self.done.record(stream)
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                stream.wait_event(self.ready)
                stage_ids(self.host, self.device)
                for pair, off, cap in launches:
                    pair.launch_counted(self.device, off, cap)
                self.done.record(stream)
            finally:
                self.graph.capture_end()
        raw = getattr(self.graph, "raw_cuda_graph_exec", None)  # torch >= 2.7
        self._exec = raw() if raw is not None else 0
        self._stream_handle = stream.cuda_stream
        self._ready_handle = self.ready.cuda_event  # created by the record above
        self._caller: torch.cuda.Stream | None = None
        self._caller_handle = 0

    def try_fill(self, copies: Sequence[UnitCopy]) -> bool:
        """Write each group's source and destination ids into the pinned slots; False,
        writing nothing, while the last replay may still be reading them. Raises
        struct.error for an id that is not an int64 (the caller's eager path names it);
        bools pass as 0/1, and the caller's check refuses them later."""
        if not (self.idle or self.done.query()):
            return False
        host = self.slots
        for c, off, cap in zip(copies, self.offsets, self.capacities, strict=True):
            src, dst = c.src_ids, c.dst_ids
            n = len(src)
            assert n == len(dst) and n <= cap, f"{n} ids for a capacity of {cap}"
            pack = _int64s(n).pack_into
            pack(host, 8 * (off + 1), *src)
            pack(host, 8 * (off + 1 + cap), *dst)
            host[off] = n
        return True

    def replay(self, stream: torch.cuda.Stream, caller: torch.cuda.Stream) -> None:
        """Queue the upload and the copies on `stream` (the one captured on), after the work
        queued so far on `caller` (the stream current on this thread, restored if torch's
        replay, which launches on the current stream, has to run); `done` completes after
        them."""
        driver = _driver()
        if driver is not None and self._exec:
            if caller is not self._caller:  # raw handles: a property call into C per read
                self._caller, self._caller_handle = caller, caller.cuda_stream
            err = driver.event_record(self._ready_handle, self._caller_handle)
            if err == 0:
                self.idle = False
                err = driver.graph_launch(self._exec, self._stream_handle)
            if err != 0:
                raise RuntimeError(f"copy graph replay failed with CUresult {err}")
            return
        self.ready.record(caller)
        self.idle = False
        torch.cuda.set_stream(stream)
        try:
            self.graph.replay()
        finally:
            torch.cuda.set_stream(caller)


class CopyGraphs:
    """`GraphedCopy`s of one thread's stream by (table identities, capacities), at most
    `limit` (a full cache starts over). Not thread-safe: one per side stream. A capture
    that fails (a CUDA error) is logged once and not tried again for those tables and
    capacities until `clear`: their pulls take the eager path, which reports its own
    errors, instead of failing in a capture every time."""

    def __init__(
        self,
        stream: torch.cuda.Stream,
        limit: int = 32,
        capture: Callable[..., GraphedCopy] = GraphedCopy,
    ) -> None:
        self.stream = stream
        self.limit = limit
        self._capture = capture
        self._graphs: dict[tuple, GraphedCopy] = {}
        self._failed: set[tuple] = set()

    def get(self, copies: Sequence[UnitCopy], pairs: PairCache) -> GraphedCopy | None:
        """The graph for `copies` (one per group, same device), captured on first use;
        None when a group has more ids than any graph holds, or its capture failed."""
        key = []
        for c in copies:
            cap = capacity_for(len(c.src_ids))
            if cap is None:
                return None
            # The storages' `flat()` tuples are made once per storage, and the graph
            # holds them, so their ids stay theirs while it is cached.
            key.append((id(c.src.flat()), id(c.dst.flat()), cap))
        key = tuple(key)
        graph = self._graphs.get(key)
        if graph is None:
            if key in self._failed:
                return None
            if len(self._graphs) >= self.limit:
                self._graphs.clear()
            tables = [list(zip(c.src.flat(), c.dst.flat(), strict=True)) for c in copies]
            try:
                graph = self._capture(tables, [cap for _, _, cap in key], self.stream, pairs)
            # RuntimeError: a CUDA error in the capture. ValueError: Triton refusing the
            # pinned id buffer as a pointer the GPU cannot address (host memory registered
            # without a device mapping), which the staging kernel reads.
            except (RuntimeError, ValueError) as e:
                self._failed.add(key)
                logger.warning("copy graph capture failed, pulls of these tables go eager: %s", e)
                return None
            graph.keep = [(c.src.flat(), c.dst.flat()) for c in copies]
            self._graphs[key] = graph
        return graph

    def clear(self) -> None:
        self._graphs.clear()
        self._failed.clear()


def warm_up(storages: Sequence[GroupStorage]) -> None:
    """Compile and load, before the first pull, what the first capture of a same-device
    pull's graph needs (the id staging kernel, the copy kernel): a graph of `storages`' own
    tables as source and destination, never replayed. Its eager pass copies nothing (every
    count is 0). On a fresh H200 the first two pulls of a PD pair waited 1.1-1.2 s for
    this (benchmarks/gpu_serve_log.sh)."""
    devices = {s.device for s in storages}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return
    (device,) = devices
    stream = torch.cuda.Stream(device)
    tables = [list(zip(s.flat(), s.flat(), strict=True)) for s in storages]
    GraphedCopy(tables, [MIN_CAPACITY] * len(tables), stream, PairCache())
    stream.synchronize()
