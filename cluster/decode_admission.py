"""The router's queue for decode slots (DESIGN §2 and §5).

A request takes a slot on a decode worker before anything runs for it (its prefill
included) and gives the slot back when it ends. A worker has a fixed number of slots
(the router's `decode_capacity`): its running requests plus those allowed to wait on it,
prefilled ahead so that a finished request's place is refilled at once. When every
worker is full a request waits here, in arrival order, for the first slot that frees or
that a new worker brings. So the workers added by scaling take the backlog. Without the
queue, the backlog would stay in the old workers' own queues. Under the priority policy
a waiter's `priority` orders the queue (lower first, arrival order among equals); with
every priority 0 that is arrival order.

`grant` is the router's choice: it takes a free slot on the best worker and returns the
worker, or returns None when no worker has one. `release` gives a slot back and calls
`wake`; so does a change of the worker list. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

W = TypeVar("W")


class DecodeAdmission(Generic[W]):
    def __init__(self, grant: Callable[[], W | None]) -> None:
        self._grant = grant
        # (priority, arrival number, future, its grant): a heap, so the first is the next
        # to serve.
        self._waiters: list[tuple[int, int, asyncio.Future[W], Callable[[], W | None]]] = []
        self._arrivals = itertools.count()
        # Waiters not yet granted, timed out or cancelled. The heap also holds the ended
        # ones until `wake` reaches them; counting apart keeps `queued` O(1) under a
        # backlog of thousands, where every arrival asks it.
        self._pending = 0

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return self._pending

    async def acquire(
        self,
        timeout_s: float,
        release: Callable[[W], None],
        priority: int = 0,
        grant: Callable[[], W | None] | None = None,
    ) -> W:
        """A slot's worker: at once when nobody waits and a worker has room, else after
        the requests ahead (those of a lower `priority`, then earlier arrivals).
        TimeoutError after `timeout_s`. A wait that ends (timeout, cancel) just as a slot
        was granted gives that slot back through `release`. `grant`: this request's own
        choice among the free slots (its prompt's cached prefix), else the default."""
        grant = grant or self._grant
        if not self.queued:
            worker = grant()
            if worker is not None:
                return worker
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[W] = loop.create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), fut, grant))
        self._pending += 1
        # Not asyncio.wait_for: on 3.11 it can swallow a cancel that lands as the slot is
        # granted, and the router's task would then run a request nobody waits for.
        timer = loop.call_later(timeout_s, self._expire, fut)
        try:
            return await fut
        except BaseException:
            if not fut.done():
                fut.cancel()  # `wake` drops it
            if fut.cancelled():  # never granted nor expired: counted until now
                self._pending -= 1
            elif fut.exception() is None:
                release(fut.result())
            raise
        finally:
            timer.cancel()

    def wake(self) -> None:
        """Grant free slots to the waiters in queue order."""
        while self._waiters:
            if self._waiters[0][2].done():
                heapq.heappop(self._waiters)
                continue
            worker = self._waiters[0][3]()
            if worker is None:
                return
            heapq.heappop(self._waiters)[2].set_result(worker)
            self._pending -= 1

    def _expire(self, fut: asyncio.Future[W]) -> None:
        if not fut.done():
            fut.set_exception(TimeoutError())
            self._pending -= 1
