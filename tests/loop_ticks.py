"""How often a 10 ms ticker on an asyncio loop runs while a coroutine is awaited on it: the
tests' measure of work kept off the router's event loop (on the loop, the ticker stops)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def ticks_while(coro_fn: Callable[[], Awaitable[T]]) -> tuple[int, T]:
    """(ticks, what `coro_fn()` returned), on a fresh loop."""

    async def run() -> tuple[int, T]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            result = await coro_fn()
        finally:
            ticker.cancel()
            try:
                await ticker
            except asyncio.CancelledError:
                pass
            else:
                raise AssertionError("the ticker ended before it was cancelled")
        return ticks, result

    return asyncio.run(run())
