"""The `local` transport: source and destination in one process (tests, one-box setups).

No packing and no sockets: `copy_units` copies runs of consecutive units directly (one
strided copy per run and tensor covers every layer). The sources are found in a
`LocalRegistry` passed in explicitly (no module-level registry).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pdserve.kvtransfer.layout import GroupStorage
from pdserve.kvtransfer.lease import LeaseError
from pdserve.kvtransfer.pack import copy_units
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

    def __init__(self, registry: LocalRegistry, layout_hash: str) -> None:
        self.registry = registry
        self.layout_hash = layout_hash
        self.descriptors = 0  # copy descriptors issued, for the few-per-group budget

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
        moved = 0
        try:
            with source.leases.pinned(spec.ticket.request_id) as lease:
                for g, (src, d) in enumerate(zip(source.storages, dst, strict=True)):
                    first = spec.first_units[g]
                    src_ids = lease.group_unit_ids[g][first:]
                    dst_ids = spec.dst_unit_ids[g][first:]
                    self.descriptors += copy_units(src, src_ids, d, dst_ids)
                    moved += len(src_ids) * src.group.unit_bytes()
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
