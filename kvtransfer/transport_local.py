"""The `local` transport: source and destination in one process (tests, one-box setups).

No packing and no sockets: `copy_groups` copies the units directly (on one GPU, one
kernel launch per tensor, on the caller's current stream and not waited for; otherwise
one strided copy per run of consecutive units and tensor). On a GPU the unit ids cross
in one asynchronous copy from a pinned buffer kept per thread and stream. The sources are
found in a `LocalRegistry` passed in explicitly (no module-level registry).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdserve.kernels.kv_copy import PairCache
from pdserve.kvtransfer.id_staging import IdStagingPool
from pdserve.kvtransfer.layout import GroupStorage
from pdserve.kvtransfer.lease import LeaseError
from pdserve.kvtransfer.pack import UnitCopy, copy_groups
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec, TransferError

SCHEME = "local://"


class LocalRegistry:
    def __init__(self) -> None:
        self._sources: dict[str, KVSource] = {}
        self._lock = threading.Lock()

    def add(self, source: KVSource) -> str:
        """Register a source; returns the endpoint its tickets name."""
        with self._lock:
            self._sources[source.worker_id] = source
        return SCHEME + source.worker_id

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._sources.pop(worker_id, None)

    def get(self, endpoint: str) -> KVSource:
        with self._lock:
            source = self._sources.get(endpoint.removeprefix(SCHEME))
        if not endpoint.startswith(SCHEME) or source is None:
            raise TransferError("unreachable", f"no local source at {endpoint!r}")
        return source


class LocalTransport:
    name = "local"
    beats_tier = True
    release_confirms_copy = False

    def __init__(self, registry: LocalRegistry, layout_hash: str) -> None:
        self.registry = registry
        self.layout_hash = layout_hash
        self.descriptors = 0  # copy descriptors issued, for the few-per-group budget
        self._stagings = IdStagingPool()
        self._pairs = PairCache()  # the copy kernel's set-up per (source, destination) table

    def pull(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> int:
        source = self.registry.get(spec.ticket.endpoint)
        if source.layout_hash != self.layout_hash:
            raise TransferError("layout_mismatch", "the source's KV layout differs from ours")
        device = dst[0].device
        staging = None
        if device.type == "cuda":
            staging = self._stagings.for_stream(torch.cuda.current_stream(device))
        moved = 0
        try:
            with source.leases.pinned(spec.ticket.request_id) as lease:
                copies = []
                for g, (src, d) in enumerate(zip(source.storages, dst, strict=True)):
                    first = spec.first_units[g]
                    src_ids = lease.group_unit_ids[g][first:]
                    copies.append(UnitCopy(src, src_ids, d, spec.dst_unit_ids[g][first:]))
                    moved += len(src_ids) * src.group.unit_bytes()
                self.descriptors += copy_groups(copies, staging, self._pairs)
        except LeaseError as e:
            raise TransferError(e.code, str(e)) from e
        return moved

    def release(self, ticket: Ticket, timeout_s: float) -> None:
        self.registry.get(ticket.endpoint).leases.release(ticket.request_id)

    def abort(self, ticket: Ticket, timeout_s: float) -> None:
        self.registry.get(ticket.endpoint).leases.release(ticket.request_id, "aborted")

    def heartbeat(self, ticket: Ticket, extend_s: float, timeout_s: float) -> float:
        try:
            return self.registry.get(ticket.endpoint).leases.extend(ticket.request_id, extend_s)
        except LeaseError as e:
            raise TransferError(e.code, str(e)) from e

    def close(self) -> None:
        pass
