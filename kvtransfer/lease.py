"""Leases on the prefill side: how long a finished prompt's blocks wait for their puller.

A lease is added when a prefill-role request leaves the engine with its blocks held. It
ends in exactly one way: released (the decode side is done or gave up), aborted, or
expired (nobody came in time: the decode worker died or the router dropped the request).
Then its request id is queued for the owner of the blocks (the engine thread) to free;
this table never touches blocks itself, so it can be used from the transfer server's
thread. A transfer in progress pins its lease: a release or expiry during the copy is
deferred until the copy ends, so freed blocks are never read.

An early lease (layer-wise mode) is added when the prompt's last chunk is scheduled,
before its forward runs: it carries the step's `marks` (per-layer completion of the KV
writes, `kvtransfer.layer_marks`), and the first token arrives later (`complete`), or the
prompt ends without one (`fail_pending`: its pullers get an error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class LeaseError(RuntimeError):
    """The lease is unknown, released or expired; `code` says which, for the wire."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Lease:
    request_id: str
    group_unit_ids: tuple[tuple[int, ...], ...]  # [group][unit]: what the blocks are
    num_tokens: int
    expiry: float  # unix time (it travels in tickets to other processes)
    pins: int = 0
    ended: str | None = None  # "released" | "aborted" | "expired"
    marks: Any = None  # early leases: the forward's per-layer marks (LayerMarks)
    # Early leases: (first token, logprob rows) once sampled; None before, and always None
    # for leases added after the forward (their ticket carries the token).
    first: tuple[int, list[list[float]] | None] | None = None
    pending_error: str | None = None  # early leases: why no first token will come

    @property
    def early(self) -> bool:
        return self.marks is not None


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.time) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._to_free: list[str] = []
        self.counts = {"added": 0, "released": 0, "aborted": 0, "expired": 0}
        # Called (under the table's lock: it must not block) whenever blocks become
        # freeable, from whichever thread ended the lease: the owner's loop, stalled on a
        # cache full of held prompts, wakes to free them (cluster/worker_loop.py).
        self.on_freeable: Callable[[], None] | None = None

    def add(
        self,
        request_id: str,
        group_unit_ids: list[list[int]] | tuple,
        num_tokens: int,
        marks: Any = None,
    ) -> Lease:
        """A lease from now; with `marks`, an early one (see the module docstring)."""
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            lease = Lease(
                request_id,
                tuple(tuple(ids) for ids in group_unit_ids),
                num_tokens,
                self._clock() + self.lease_s,
                marks=marks,
            )
            self._leases[request_id] = lease
            self.counts["added"] += 1
            return lease

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        """A lease not yet handed back: live, or ended while a transfer pins it."""
        with self._lock:
            return request_id in self._leases

    @contextmanager
    def pinned(self, request_id: str) -> Iterator[Lease]:
        """The live lease, kept from ending until the block exits."""
        with self._lock:
            lease = self._live(request_id)
            lease.pins += 1
        try:
            yield lease
        finally:
            with self._lock:
                lease.pins -= 1
                if lease.ended is not None and lease.pins == 0:
                    self._end_now(lease)

    def extend(self, request_id: str, extend_s: float) -> float:
        """Push the expiry to at least now + extend_s; returns the new expiry."""
        with self._lock:
            lease = self._live(request_id)
            lease.expiry = max(lease.expiry, self._clock() + extend_s)
            return lease.expiry

    def complete(
        self, request_id: str, first_token: int, first_logprobs: list[list[float]] | None
    ) -> bool:
        """An early lease's first token is sampled; False if the lease is gone."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            lease.first = (first_token, first_logprobs)
            return True

    def fail_pending(self, request_id: str, why: str) -> None:
        """An early lease's prompt ended without a first token (aborted before it was
        sampled): pullers waiting for it get an error instead of waiting out the lease."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None and lease.first is None:
                lease.pending_error = why

    def release(self, request_id: str, how: str = "released") -> bool:
        """End a lease ("released" or "aborted"); False if it was not live."""
        assert how in ("released", "aborted"), how
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.ended is not None:
                return False
            self._end(lease, how)
            return True

    def expire(self) -> list[str]:
        """End every unpinned lease past its expiry; returns their request ids."""
        now = self._clock()
        with self._lock:
            due = [
                lease
                for lease in self._leases.values()
                if lease.ended is None and lease.expiry <= now and lease.pins == 0
            ]
            for lease in due:
                self._end(lease, "expired")
            return [lease.request_id for lease in due]

    def drain_freeable(self) -> list[str]:
        """Request ids whose blocks the owner must free now (each is returned once)."""
        with self._lock:
            out, self._to_free = self._to_free, []
            return out

    def _live(self, request_id: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise LeaseError("unknown_lease", f"no lease for request {request_id!r}")
        if lease.ended is not None:
            raise LeaseError(f"lease_{lease.ended}", f"the lease of {request_id!r} {lease.ended}")
        if lease.expiry <= self._clock():
            raise LeaseError("lease_expired", f"the lease of {request_id!r} expired")
        return lease

    def _end(self, lease: Lease, how: str) -> None:
        lease.ended = how
        self.counts[how] += 1
        if lease.pins == 0:
            self._end_now(lease)

    def _end_now(self, lease: Lease) -> None:
        del self._leases[lease.request_id]
        self._to_free.append(lease.request_id)
        if self.on_freeable is not None:
            self.on_freeable()
