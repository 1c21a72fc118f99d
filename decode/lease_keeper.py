"""The decode worker's `LeaseKeeper`: keeps the prefill side's leases of queued requests.

A request handed to a decode worker with its ticket may wait there before its KV is
pulled: for a slot, or for free blocks when the worker's cache is full. The prefill side
holds the prompt's blocks only for its lease (`--lease-s`, 30 s by default), so a long
wait used to end in a lease expiry: the pull failed, and the decode worker computed the
whole prompt again (policy recompute) on the GPU the split was meant to keep free of
prefills, after the prefill worker had already done it.

So every `every_s` the worker's step hands the keeper the tickets of its queued requests,
and the keeper extends each lease with less than `2 × every_s` left to `3 × every_s` from
now (a heartbeat over the ticket's transport) on its own thread. The prefill worker then
keeps those blocks while the decode worker is alive and still wants them (backpressure:
its cache fills with prompts waiting for decode, and further prefills wait); a decode
worker that dies stops the heartbeats, and its leases expire within three intervals.

Fresh tickets are left alone: a request that waits only briefly costs no message, and a
heartbeat racing its release is rare (the prefill side answers it with an error it does
not log as a fault). A ticket whose lease is already gone is left to its load, which
fails and falls back as before.

It knows nothing about scheduling: the worker says which tickets are still wanted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.decode.kv_loader import scheme_of
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.transport import TransferError, Transport

logger = logging.getLogger(__name__)

EVERY_S = 5.0  # how often queued tickets' leases are extended
HEARTBEAT_TIMEOUT_S = 2.0  # a dead prefill worker delays only the keeper's own thread


class LeaseKeeper:
    def __init__(self, transports: dict[str, Transport], every_s: float | None = EVERY_S):
        """`every_s=None` turns keeping off: leases then last their prefill-side length."""
        if every_s is not None and not every_s > 0:
            raise ValueError(f"every_s must be > 0 or None, got {every_s}")
        self.transports = transports
        self.every_s = every_s
        self._next = 0.0  # time.monotonic() of the next round
        self._round: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-lease-keeper")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # request id -> the lease's expiry as last known (the ticket's, then the prefill
        # side's replies); written by a round, read between rounds, never during one.
        self._expiry: dict[str, float] = {}
        self.extended = 0  # leases extended, over all rounds
        self.errors: Counter = Counter()  # by TransferError code

    def due(self) -> bool:
        """A round is due: its interval has passed and the last round has ended. Cheap, so
        a step asks before it gathers tickets."""
        if self.every_s is None or time.monotonic() < self._next:
            return False
        return self._round is None or self._round.done()

    def start(self, tickets: Sequence[object]) -> None:
        """Start a round for the tickets still wanted whose leases end soon (on the
        keeper's thread: it never blocks the caller); the next is due `every_s` from now."""
        if self.every_s is None or (self._round is not None and not self._round.done()):
            return  # off, or a round still runs (it owns `_expiry` until it ends)
        self._next = time.monotonic() + self.every_s
        current = [t for t in tickets if isinstance(t, Ticket)]
        self._expiry = {
            t.request_id: self._expiry.get(t.request_id, t.lease_expiry) for t in current
        }
        soon = time.time() + 2 * self.every_s  # unix time, as the prefill side's expiries
        wanted = [t for t in current if self._expiry[t.request_id] < soon]
        if wanted:
            self._round = self._pool.submit(self._extend_all, wanted, 3 * self.every_s)

    def _extend_all(self, tickets: list[Ticket], extend_s: float) -> None:
        silent: set[str] = set()  # endpoints that did not answer: the rest of theirs wait
        for ticket in tickets:
            if self._stop.is_set():
                return
            transport = self.transports.get(scheme_of(ticket.endpoint))
            if transport is None or ticket.endpoint in silent:
                continue
            try:
                self._expiry[ticket.request_id] = transport.heartbeat(
                    ticket, extend_s, HEARTBEAT_TIMEOUT_S
                )
            except TransferError as e:  # gone already: its load will say so
                if e.code == "timeout":  # a dead or stuck prefill worker
                    silent.add(ticket.endpoint)
                with self._lock:
                    self.errors[e.code] += 1
                logger.debug("lease of %s not extended: %s", ticket.request_id, e)
                continue
            except Exception:  # a bug: say so, and keep the other leases going
                logger.exception("lease of %s not extended", ticket.request_id)
                with self._lock:
                    self.errors["internal"] += 1
                continue
            with self._lock:
                self.extended += 1

    def num_errors(self) -> int:
        """Heartbeats that extended nothing, over all rounds (any thread may ask)."""
        with self._lock:
            return sum(self.errors.values())

    def close(self) -> None:
        """Stop after the heartbeat in flight (at most HEARTBEAT_TIMEOUT_S)."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
