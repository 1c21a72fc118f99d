"""The router's queue for decode slots (cluster/decode_admission.py) on its own: first
come first served, slots granted as they free or as workers join, timeouts and
cancellations that give back a slot granted at the last moment. Workers are plain names
with a slot count each (the router's `_grant_decode` / `_release_decode` in small);
test_pool_scaling.py drives the same queue through a real router and real workers."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster.decode_admission import DecodeAdmission


class _Slots:
    """Free slots per worker; grant takes one from the freest worker (ties: the first)."""

    def __init__(self, **free: int) -> None:
        self.free = dict(free)
        self.admission: DecodeAdmission[str] = DecodeAdmission(self.grant)

    def grant(self) -> str | None:
        best = max(self.free, key=lambda w: self.free[w], default=None)
        if best is None or self.free[best] == 0:
            return None
        self.free[best] -= 1
        return best

    def release(self, worker: str) -> None:
        self.free[worker] += 1
        self.admission.wake()

    async def take(self, timeout_s: float = 5.0) -> str:
        return await self.admission.acquire(timeout_s, self.release)


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_waiters_are_served_in_arrival_order_as_slots_free():
    """Guards FIFO: with one slot taken, three requests queue; each release goes to the
    oldest waiter, and a newcomer does not take a slot ahead of those already waiting."""

    async def run() -> None:
        slots = _Slots(d0=1)
        assert await slots.take() == "d0"
        order: list[int] = []

        async def waiter(i: int) -> None:
            await slots.take()
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await _settle()
        assert slots.admission.queued == 3 and order == []
        for expected in ([0], [0, 1], [0, 1, 2]):
            slots.release("d0")
            await _settle()
            assert order == expected
        await asyncio.gather(*tasks)
        assert slots.admission.queued == 0 and slots.free == {"d0": 0}

    asyncio.run(run())


def test_a_new_worker_takes_the_queue_at_once():
    """Guards scale-up: the slots a joining worker brings go to the waiting requests as
    soon as the router hears of it (wake), without any request ending."""

    async def run() -> None:
        slots = _Slots(d0=1)
        await slots.take()
        tasks = [asyncio.create_task(slots.take()) for _ in range(3)]
        await _settle()
        slots.free["d1"] = 2
        slots.admission.wake()
        await _settle()
        assert [t.result() for t in tasks[:2]] == ["d1", "d1"]
        assert not tasks[2].done() and slots.admission.queued == 1
        slots.release("d0")
        assert await tasks[2] == "d0"

    asyncio.run(run())


def test_a_wait_times_out_and_leaves_the_queue():
    """Guards the bound on a wait: TimeoutError after the timeout, the waiter gone from the
    queue, and the next freed slot goes to the request behind it."""

    async def run() -> None:
        slots = _Slots(d0=1)
        await slots.take()
        with pytest.raises(TimeoutError):
            await slots.take(timeout_s=0.05)
        assert slots.admission.queued == 0
        behind = asyncio.create_task(slots.take())
        await _settle()
        slots.release("d0")
        assert await behind == "d0" and slots.free == {"d0": 0}

    asyncio.run(run())


def test_a_cancelled_wait_gives_back_a_slot_granted_at_the_same_moment():
    """Guards against a lost slot: a waiter granted a slot and cancelled before it ran (a
    client gone just then) hands the slot to the next waiter instead of keeping it."""

    async def run() -> None:
        slots = _Slots(d0=1)
        await slots.take()
        first = asyncio.create_task(slots.take())
        second = asyncio.create_task(slots.take())
        await _settle()
        slots.release("d0")  # granted to `first`, which has not run since
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second == "d0"
        assert slots.free == {"d0": 0} and slots.admission.queued == 0

    asyncio.run(run())


def test_no_queue_while_a_worker_has_room():
    """Guards the fast path: requests go straight to the freest worker, no waiting."""

    async def run() -> None:
        slots = _Slots(d0=1, d1=2)
        assert [await slots.take() for _ in range(3)] == ["d1", "d0", "d1"]
        assert slots.admission.queued == 0

    asyncio.run(run())


def test_the_count_follows_waits_that_end_each_way():
    """Guards `queued` (kept as a count, not a scan): a wait cancelled while queued, one
    timed out and one granted each leave it exactly once, whatever order the queue
    meets them in; a count left too high would send every arrival to the queue."""

    async def run() -> None:
        slots = _Slots(d0=1)
        await slots.take()
        first = asyncio.create_task(slots.take())
        middle = asyncio.create_task(slots.take())
        short = asyncio.create_task(slots.take(timeout_s=0.05))
        last = asyncio.create_task(slots.take())
        await _settle()
        assert slots.admission.queued == 4
        middle.cancel()
        await _settle()
        assert middle.cancelled() and slots.admission.queued == 3
        with pytest.raises(TimeoutError):
            await short
        assert slots.admission.queued == 2
        slots.release("d0")
        assert await first == "d0" and slots.admission.queued == 1
        slots.release("d0")
        assert await last == "d0" and slots.admission.queued == 0
        # Nobody waits: the next request with room goes straight through.
        slots.release("d0")
        assert await slots.take() == "d0"

    asyncio.run(run())


def test_under_priorities_the_lowest_value_is_served_first():
    """Guards the priority policy in the router's queue: waiters are granted by priority
    (lower first), arrival order among equals, whatever order they arrived in."""

    async def run() -> None:
        slots = _Slots(d0=1)
        await slots.take()
        order: list[str] = []

        async def waiter(name: str, priority: int) -> None:
            await slots.admission.acquire(5.0, slots.release, priority)
            order.append(name)

        arrivals = [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)]
        tasks = []
        for name, priority in arrivals:
            tasks.append(asyncio.create_task(waiter(name, priority)))
            await _settle()
        assert slots.admission.queued == 5
        for _ in arrivals:
            slots.release("d0")
            await _settle()
        await asyncio.gather(*tasks)
        assert order == ["c", "e", "a", "d", "b"]

    asyncio.run(run())


def test_a_waiter_takes_its_own_choice_of_slot():
    """Guards the per-request grant (the router's prefix-aware pick): a waiter that asked
    for a worker of its own choosing gets that worker's slot when it frees, here the
    worker other than the default grant's."""

    async def run() -> None:
        slots = _Slots(d0=1, d1=1)
        assert {await slots.take(), await slots.take()} == {"d0", "d1"}

        def on_d1() -> str | None:
            if slots.free["d1"] == 0:
                return slots.grant()  # any other free slot
            slots.free["d1"] -= 1
            return "d1"

        got = asyncio.create_task(slots.admission.acquire(5.0, slots.release, 0, on_d1))
        await _settle()
        assert slots.admission.queued == 1
        slots.free["d0"] += 1  # d0 frees first: on_d1 takes it (the only free one)
        slots.free["d1"] += 1  # and d1 too, before the wake
        slots.admission.wake()
        assert await got == "d1" and slots.free == {"d0": 1, "d1": 0}

    asyncio.run(run())
