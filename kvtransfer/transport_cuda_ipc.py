"""The `cuda_ipc` transport: same node, separate processes, the source's KV mapped once.

At the first pull from a prefill worker, the puller asks for its KV tensors' CUDA IPC
handles (`IpcOpen` -> `IpcExport`, plain msgpack values: device, handle bytes, sizes,
shape, stride; never pickle) and maps them into its own address space; from then on a
pull is a heartbeat (the lease must be live, and is extended past the copy) plus direct
device-to-device copies on a side stream, one strided copy per run of consecutive
blocks and tensor (all layers at once), with no packing. The copy is waited for by
polling an event against the call's deadline.

Endpoints read `cuda_ipc+tcp://host:port`: the control socket is the tcp part.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from pdserve.kvtransfer.layout import DTYPES, GroupStorage, KVLayout
from pdserve.kvtransfer.pack import copy_units
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


def import_tensor(d: dict) -> torch.Tensor:
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            d["device"],
            d["handle"],
            d["size_bytes"],
            d["offset_bytes"],
            d["ref_handle"],
            d["ref_offset"],
            d["event_handle"],
            d["event_sync"],
        )
        t = torch.empty(0, dtype=DTYPES[d["dtype"]], device=f"cuda:{d['device']}")
        return t.set_(storage, d["storage_offset"], d["shape"], d["stride"])
    except (KeyError, TypeError, RuntimeError) as e:
        raise TransferError("ipc_unavailable", f"cannot map the exported tensor: {e}") from e


class CudaIpcTransport(ZmqClient):
    name = SCHEME

    def __init__(
        self, worker_id: str, layout: KVLayout, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        super().__init__(worker_id, layout, max_message_bytes)
        self._mapped: dict[str, tuple[GroupStorage, ...]] = {}
        self._map_lock = threading.Lock()
        self._streams = threading.local()

    def _sources(self, endpoint: str, deadline: float) -> tuple[GroupStorage, ...]:
        with self._map_lock:
            mapped = self._mapped.get(endpoint)
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

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(device)
        return stream

    def pull(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> int:
        ticket = spec.ticket
        deadline = time.monotonic() + timeout_s
        sources = self._sources(ticket.endpoint, deadline)
        # The lease must outlast the copy (nothing pins it across processes). While the
        # ticket's own expiry leaves a margin of the whole timeout, no round trip is needed;
        # closer to it, a heartbeat extends it (and fails if it is gone).
        if ticket.lease_expiry - time.time() < timeout_s + LEASE_MARGIN_S:
            self.heartbeat(ticket, timeout_s, max(deadline - time.monotonic(), 0.001))
        if cancel is not None and cancel.is_set():
            raise TransferError("cancelled", f"pull of {ticket.request_id} cancelled")
        device = dst[0].device
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        moved = 0
        with torch.cuda.stream(stream):
            for g, (src, d) in enumerate(zip(sources, dst, strict=True)):
                first = spec.first_units[g]
                src_ids = ticket.group_unit_ids[g][first:]
                copy_units(src, src_ids, d, spec.dst_unit_ids[g][first:])
                moved += len(src_ids) * src.group.unit_bytes()
            done = torch.cuda.Event()
            done.record(stream)
        spins = 0
        while not done.query():
            if time.monotonic() > deadline:
                raise TransferError("timeout", f"device copy of {ticket.request_id} not done")
            spins += 1
            if spins > 1000:  # past ~1 ms of spinning, stop burning the core
                time.sleep(50e-6)
        return moved

    def close(self) -> None:
        with self._map_lock:
            self._mapped.clear()
        super().close()
