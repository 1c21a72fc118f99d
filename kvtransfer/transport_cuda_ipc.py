"""The `cuda_ipc` transport: same node, separate processes, the source's KV mapped once.

At the first pull from a prefill worker, the puller asks for its KV tensors' CUDA IPC
handles (`IpcOpen` -> `IpcExport`, plain msgpack values: device, handle bytes, sizes,
shape, stride; never pickle) and maps them into its own address space; from then on a
pull is direct device-to-device copies on a side stream, one kernel launch per tensor
(all units and layers at once), with no packing; a heartbeat that extends the lease past
the copy comes first only when the ticket's lease would end within the call's timeout.
The copy is waited for by polling an event against the call's deadline. Nothing on the
wire shows that the source was alive and still held the blocks while the copy ran: the
release after it does (`release_confirms_copy`; the decode loader fails the load when it
is not acknowledged), and a source that stops answering is forgotten, mapping and all.

Per pull the host does little. On one GPU the copy is a replay of a CUDA graph captured
once per (tables, id capacity) on the thread's side stream (kvtransfer/copy_graph.py):
the host records where the caller's stream is, writes the ids into the graph's pinned
buffer and replays it (a wait for that record, the id upload, one counted-kernel launch per
tensor, the record of its `done`), and checks the ids while the device copies; the pull fails
after the copy if they were bad (the kernel skips out-of-range ids). Otherwise (two GPUs,
a graph whose last replay is still queued, more ids than a graph holds) the eager path
checks the ids first, stages them through a pinned buffer (`IdStaging`) and launches the
kernel. The side stream and its two events are made once per thread and (source,
destination) device pair, not per pull. Pulls from several threads (the decode loader's
pool) each use their own stream, events, graphs and staging buffers, so they need no
lock.

Between two GPUs of a node (peer access over NVLink): the export names its GPU by UUID, so
processes that number the GPUs differently agree on it; peer access is enabled once per
pair, and the copy kernel runs on the source's GPU, where the mapping lives, writing the
destination's memory across the link.

Endpoints read `cuda_ipc+tcp://host:port`: the control socket is the tcp part.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.kernels import kv_copy_cuda
from pdserve.kernels.kv_copy import PairCache
from pdserve.kvtransfer import copy_graph
from pdserve.kvtransfer.copy_graph import CopyGraphs, GraphedCopy
from pdserve.kvtransfer.id_staging import IdStagingPool
from pdserve.kvtransfer.layout import DTYPES, GroupStorage, KVLayout
from pdserve.kvtransfer.pack import UnitCopy, copy_groups, verify_copies
from pdserve.kvtransfer.protocol import DEFAULT_MAX_MESSAGE_BYTES, IpcExport, IpcOpen
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_tcp import ZmqClient

SCHEME = "cuda_ipc"
LEASE_MARGIN_S = 1.0


def export_tensor(t: torch.Tensor) -> dict:
    """What another process needs to map `t` (a CUDA tensor) — msgpack-able values only."""
    assert t.is_cuda, "only CUDA tensors can be exported over CUDA IPC"
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, sync) = (
        t.untyped_storage()._share_cuda_()
    )
    return {
        "device": int(device),
        # Indices differ between processes that see the GPUs in other orders (a worker
        # sees its own GPU as cuda:0): the importer finds the GPU by UUID.
        "device_uuid": str(torch.cuda.get_device_properties(int(device)).uuid),
        "handle": bytes(handle),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "ref_handle": bytes(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": None if event_handle is None else bytes(event_handle),
        "event_sync": bool(sync),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": int(t.storage_offset()),
        "dtype": str(t.dtype).removeprefix("torch."),
    }


def export_storages(storages: Sequence[GroupStorage]) -> dict:
    return {"tensors": [[export_tensor(t) for t in s.tensors] for s in storages]}


def local_device_index(d: dict) -> int:
    """This process's index of the exporter's GPU (by UUID; the exporter's own index when
    the export names none)."""
    uuid = d.get("device_uuid")
    if uuid is None:
        return int(d["device"])
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise TransferError(
        "ipc_unavailable",
        f"the source's GPU {uuid} is not visible to this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
    )


def enable_peer_access(a: torch.device, b: torch.device) -> None:
    """Let kernels on either GPU read and write the other's memory. torch enables peer
    access (once per pair, then cached) on a copy between two devices; a 1-byte copy each
    way between scratch tensors of this process triggers it without touching the source's
    memory."""
    if a == b:
        return
    if not torch.cuda.can_device_access_peer(a, b):
        raise TransferError("ipc_unavailable", f"{a} and {b} have no peer access")
    x = torch.zeros(1, dtype=torch.uint8, device=a)
    y = torch.zeros(1, dtype=torch.uint8, device=b)
    y.copy_(x)
    x.copy_(y)


def import_tensor(d: dict) -> torch.Tensor:
    device = local_device_index(d)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            d["handle"],
            d["size_bytes"],
            d["offset_bytes"],
            d["ref_handle"],
            d["ref_offset"],
            d["event_handle"],
            d["event_sync"],
        )
        t = torch.empty(0, dtype=DTYPES[d["dtype"]], device=f"cuda:{device}")
        return t.set_(storage, d["storage_offset"], d["shape"], d["stride"])
    except (KeyError, TypeError, RuntimeError) as e:
        raise TransferError("ipc_unavailable", f"cannot map the exported tensor: {e}") from e


class QueuedPull(NamedTuple):
    """A pull's device work, queued and not waited for (a named tuple: it is built on the
    pull's critical path, where a frozen dataclass costs ~1 us more)."""

    moved: int  # bytes the copies will move
    done: torch.cuda.Event  # completes after the last copy; reused by the thread's next pull
    # Copies queued before their ids were checked (the graph path): `pull` checks them
    # while the device copies, and fails the pull if they are bad.
    unchecked: Sequence[UnitCopy] = ()
    graph: GraphedCopy | None = None  # the graph replayed (its `done` is `done`)


class _SideStream:
    """What one thread reuses across its pulls from one device to one device. The copies
    run on the source's device (for a mapping of another GPU, the one device that may use
    it: kernels/kv_copy.py); `ready` is recorded on the destination's stream."""

    def __init__(self, src: torch.device, dst: torch.device) -> None:
        self.stream = torch.cuda.Stream(src)
        # The stream current on this thread for the destination's device: the engine's
        # compute stream (the default stream; loader threads never switch streams). Kept,
        # not asked per pull: `torch.cuda.current_stream` costs the H200 host ~7 us.
        self.caller = torch.cuda.current_stream(dst)
        # The caller stream's position when a pull starts: the copies wait for it, since
        # the destination blocks were just allocated (and maybe freed) on that stream.
        self.ready = torch.cuda.Event()
        self.done = torch.cuda.Event()
        # Same-device pulls replay captured graphs (kvtransfer/copy_graph.py); the
        # transport's generation says when a forgotten source makes them stale.
        self.graphs = CopyGraphs(self.stream) if src == dst else None
        self.generation = 0


class CudaIpcTransport(ZmqClient):
    name = SCHEME
    beats_tier = True
    release_confirms_copy = True

    def __init__(
        self, worker_id: str, layout: KVLayout, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        super().__init__(worker_id, layout, max_message_bytes)
        self._mapped: dict[str, tuple[GroupStorage, ...]] = {}
        self._map_lock = threading.Lock()
        self._side = threading.local()
        self._stagings = IdStagingPool()
        self._pairs = PairCache()  # the copy kernel's set-up per (source, destination) table
        self._peers: set[tuple[torch.device, torch.device]] = set()  # peer access enabled
        self._generation = 0  # bumped when a source is forgotten: graphs of it are stale
        self._unit_bytes = [g.unit_bytes() for g in layout.groups]  # per pull otherwise

    def prepare(self, storages: Sequence[GroupStorage]) -> None:
        """Compile now what the first pull into `storages` would otherwise compile on a
        request's path: the copy graph's CUDA kernel (NVRTC, kernels/kv_copy_cuda.py) and
        the rest of its first capture (`copy_graph.warm_up`)."""
        if all(s.device.type == "cuda" for s in storages):
            kv_copy_cuda.available(storages[0].device)
            copy_graph.warm_up(storages)

    def _sources(self, endpoint: str, deadline: float) -> tuple[GroupStorage, ...]:
        mapped = self._mapped.get(endpoint)  # one dict read is atomic: no lock on the hit
        if mapped is not None:
            return mapped
        self.handshake(endpoint, deadline)
        self.send(endpoint, IpcOpen(self.layout_hash))
        reply = self.recv_message(endpoint, deadline)
        if not isinstance(reply, IpcExport):
            raise TransferError("bad_reply", f"IpcOpen answered with {reply.TYPE}")
        tables = reply.handles.get("tensors")
        if not isinstance(tables, list) or len(tables) != len(self.layout.groups):
            raise TransferError("bad_reply", "IpcExport does not match the layout's groups")
        mapped = tuple(
            GroupStorage(group, tuple(import_tensor(d) for d in entries))
            for group, entries in zip(self.layout.groups, tables)
        )
        with self._map_lock:
            self._mapped[endpoint] = mapped
        return mapped

    def _ensure_peer(self, src: torch.device, dst: torch.device) -> None:
        if src != dst and (src, dst) not in self._peers:
            enable_peer_access(src, dst)
            self._peers.add((src, dst))

    def _side_stream(self, src: torch.device, dst: torch.device) -> _SideStream:
        sides = self._side.__dict__.setdefault("sides", {})
        side = sides.get((src, dst))
        if side is None:
            side = sides[(src, dst)] = _SideStream(src, dst)
        if side.graphs is not None and side.generation != self._generation:
            side.graphs.clear()  # they hold a forgotten source's addresses
            side.generation = self._generation
        return side

    def enqueue_pull(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> QueuedPull:
        """The device half of `pull`: map the source, keep its lease alive, queue the copies
        on this thread's side stream and return without waiting (`deadline` is
        `time.monotonic()` based). `dst` is not final until `done` has completed; benchmarks
        use this to time the device work alone."""
        ticket = spec.ticket
        # The lines below are the pull's critical path before the GPU can start: every
        # microsecond here is one the copy waits (benchmarks/transfer.py `host_ms`).
        sources = self._mapped.get(ticket.endpoint)  # one dict read is atomic: no lock
        if sources is None:
            sources = self._sources(ticket.endpoint, deadline)
        timeout_s = max(deadline - time.monotonic(), 0.001)
        # The lease must outlast the copy (nothing pins it across processes). While the
        # ticket's own expiry leaves a margin of the whole timeout, no round trip is needed;
        # closer to it, a heartbeat extends it (and fails if it is gone).
        if ticket.lease_expiry - time.time() < timeout_s + LEASE_MARGIN_S:
            self.heartbeat(ticket, timeout_s, max(deadline - time.monotonic(), 0.001))
        if cancel is not None and cancel.is_set():
            raise TransferError("cancelled", f"pull of {ticket.request_id} cancelled")
        src_device, device = sources[0].device, dst[0].device
        peer = src_device != device
        if peer:
            self._ensure_peer(src_device, device)
        side = self._side_stream(src_device, device)
        copies = []
        moved = 0
        src_groups, dst_groups, firsts = ticket.group_unit_ids, spec.dst_unit_ids, spec.first_units
        for g, (src, d) in enumerate(zip(sources, dst, strict=True)):
            first = firsts[g]
            # A tuple's [0:] is the tuple itself; a list's is a copy, so skip it.
            src_ids = src_groups[g][first:] if first else src_groups[g]
            dst_ids = dst_groups[g][first:] if first else dst_groups[g]
            copies.append(UnitCopy(src, src_ids, d, dst_ids, src.device != d.device))
            moved += len(src_ids) * self._unit_bytes[g]
        graph = self._replay(side, copies)
        if graph is not None:  # it waits for the caller stream and records its own `done`
            return QueuedPull(moved, graph.done, copies, graph)
        side.ready.record(side.caller)
        side.stream.wait_event(side.ready)
        with torch.cuda.stream(side.stream):
            copy_groups(copies, self._stagings.for_stream(side.stream), self._pairs)
            side.done.record(side.stream)
        return QueuedPull(moved, side.done)

    def _replay(self, side: _SideStream, copies: list[UnitCopy]) -> GraphedCopy | None:
        """Queue `copies` as a replay of this thread's captured graph for their tables and
        id capacities (capturing it on first use) and return the graph; None when the
        eager path must run: a pull between two GPUs, more ids than any graph holds, the
        graph's id buffer still read by an unfinished replay, or an id that is not an
        int64 (the eager path's check names it)."""
        if side.graphs is None:
            return None
        graph = side.graphs.get(copies, self._pairs)
        try:
            if graph is None or not graph.try_fill(copies):
                return None
        except struct.error:
            return None
        graph.replay(side.stream, side.caller)
        return graph

    def pull(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> int:
        deadline = time.monotonic() + timeout_s
        queued = self.enqueue_pull(spec, dst, deadline, cancel)
        bad_ids = None
        if queued.unchecked:  # checked now, while the device copies
            try:
                verify_copies(queued.unchecked)
            except ValueError as e:
                bad_ids = e
        spins = 0
        while not queued.done.query():
            if time.monotonic() > deadline:
                raise TransferError("timeout", f"device copy of {spec.ticket.request_id} not done")
            spins += 1
            if spins > 1000:  # past ~1 ms of spinning, stop burning the core
                time.sleep(50e-6)
        if queued.graph is not None:
            queued.graph.idle = True  # its next fill needs no query
        if bad_ids is not None:
            # Raised once the copy is done, so the caller may free the destination units:
            # the kernel skipped out-of-range ids, the rest landed as garbage.
            raise bad_ids
        return queued.moved

    def recv(self, endpoint: str, deadline: float) -> list:
        try:
            return super().recv(endpoint, deadline)
        except TransferError as e:
            if e.code == "timeout":
                self.forget(endpoint)
            raise

    def forget(self, endpoint: str) -> bool:
        """Drop a source's mapping and the copy set-up that holds it. A source that stops
        answering may be gone, its memory freed: a copy must not read the old mapping
        again, and holding it keeps nothing useful (a later pull maps afresh). Pulls in
        flight keep their own references until they end."""
        with self._map_lock:
            if self._mapped.pop(endpoint, None) is None:
                return False
            self._pairs = PairCache()
            self._generation += 1
            return True

    def close(self) -> None:
        with self._map_lock:
            self._mapped.clear()
            self._pairs = PairCache()
            self._generation += 1
        super().close()
