"""Write-behind to the KV tier actor, off the caller's thread.

A prefill worker writes a finished prompt's full blocks behind into the tier. Turning them
into one bytes blob and handing it to Ray copies every byte, under the GIL for part of it:
~0.5 GB of a long prompt took the worker's step loop long enough that its health checks
timed out (H200 x2, c615c22), and smaller puts still stalled the prompts queued behind them.
So `put` only reserves room and queues the blocks; one writer thread serializes and submits
them while the step loop goes on. At most `MAX_PENDING_PUTS` puts and `max_pending_bytes`
are queued or in flight; past either a put is dropped, and counted (the tier is a cache:
a dropped put is a later miss, never an error).

The caller's blocks must not change after `put` (the prefill worker hands over host copies
it does not keep). `close` stops the thread; `flush` waits for everything queued.

`admits` and `put` run on the prefill worker's step loop and make no Ray call: a put in
flight is watched through its ObjectRef's future, so seeing it finished is a flag read.
(With `ray.wait`/`ray.get(timeout=0)` each check was a call into Ray's core worker, and a
`ray.get` in an async actor, even off its event loop, makes Ray log that it blocks the
event loop.) The writer also frees finished puts by itself, every `REAP_S` while some
are in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import ray

from pdserve.kvtransfer.tier import Block

logger = logging.getLogger(__name__)

Submit = Callable[[str, list[int], list[Block]], "ray.ObjectRef"]


def blocks_nbytes(blocks: list[Block]) -> int:
    return sum(t.numel() * t.element_size() for b in blocks for t in b)


class TierWriter:
    MAX_PENDING_PUTS = 8
    MAX_PENDING_BYTES = 256 << 20
    READY_TIMEOUT_S = 30.0  # for a put's host copies to complete
    REAP_S = 0.02  # how often the writer frees finished puts while some are in flight

    def __init__(self, submit: Submit, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self._submit = submit  # serializes and sends one put; returns its ObjectRef
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._in_flight: dict[Future, int] = {}  # a put's future -> bytes, not yet reaped
        self._queued = 0  # puts queued, not yet submitted
        self._bytes = 0  # bytes queued or in flight
        self.dropped_puts = 0
        self.failed_puts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tier-writer", daemon=True)
        self._thread.start()

    def _reap(self) -> None:
        with self._lock:
            self._reap_locked()

    def _reap_locked(self) -> None:
        """Forget finished puts (counting failures); no Ray call, no wait."""
        for fut in [f for f in self._in_flight if f.done()]:
            self._bytes -= self._in_flight.pop(fut)
            error = fut.exception() if not fut.cancelled() else "cancelled"
            if error is not None:
                self.failed_puts += 1
                logger.warning("tier put failed: %r", error)

    @property
    def pending_bytes(self) -> int:
        """Bytes queued or in flight (what the cap counts)."""
        with self._lock:
            return self._bytes

    def _fits(self, nbytes: int) -> bool:
        """Room for `nbytes` more (finished puts freed first); call with the lock held."""
        self._reap_locked()
        count = self._queued + len(self._in_flight)
        return count < self.MAX_PENDING_PUTS and self._bytes + nbytes <= self.max_pending_bytes

    def admits(self, nbytes: int) -> bool:
        """Whether a put of `nbytes` would be queued now; a refusal counts as a dropped put
        (the caller then skips preparing the blocks)."""
        with self._lock:
            ok = self._fits(nbytes)
            if not ok:
                self.dropped_puts += 1
            return ok

    def put(
        self, layout_hash: str, block_hashes: list[int], blocks: list[Block], ready=None
    ) -> bool:
        """Queue a write-behind and return at once; False if it was dropped. `ready`: an
        event (`query()` true once the blocks' bytes are final, e.g. a CUDA event after
        queued device-to-host copies) the writer waits for, up to READY_TIMEOUT_S."""
        nbytes = blocks_nbytes(blocks)
        with self._lock:
            if self._stop.is_set() or not self._fits(nbytes):
                self.dropped_puts += 1
                return False
            self._queued += 1
            self._bytes += nbytes
        self._queue.put((layout_hash, block_hashes, blocks, nbytes, ready))
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._reap()
            wait_s = self.REAP_S if self._in_flight else 0.1
            try:
                item = self._queue.get(timeout=wait_s)
            except queue.Empty:
                continue
            if item is None:
                return
            layout_hash, block_hashes, blocks, nbytes, ready = item
            try:
                self._wait_ready(ready)
                ref = self._submit(layout_hash, block_hashes, blocks)
            except Exception as e:  # not ready in time, the actor is gone, or bad blocks
                with self._lock:
                    self._queued -= 1
                    self._bytes -= nbytes
                    self.failed_puts += 1
                logger.warning("tier put failed: %r", e)
                continue
            with self._lock:
                self._queued -= 1
                self._in_flight[ref.future()] = nbytes

    def _wait_ready(self, ready) -> None:
        if ready is None:
            return
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        while not ready.query():
            if self._stop.is_set() or time.monotonic() > deadline:
                raise TimeoutError("the blocks' host copies did not complete")
            time.sleep(0.0005)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued put has been submitted and has finished; False if some
        had not by the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._reap()
            with self._lock:
                if self._queued == 0 and not self._in_flight:
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; puts still queued are dropped (counted)."""
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
        with self._lock:
            self.dropped_puts += self._queued
