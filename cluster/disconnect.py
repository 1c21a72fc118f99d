"""A non-streaming request whose client hangs up stops generating.

A streaming response notices a closed connection when it writes; a plain JSON response
writes once, at the end, so without a watch a client that gave up (a timeout, a killed
script) would keep its generations (all `n` of them, every prompt of a batch) running and
queued, in the way of everyone else's, until they finish. vLLM's server cancels such a
handler too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")

# nginx's "client closed request": written to a closed connection, read by no one.
CLIENT_CLOSED = 499


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, or, once the client has hung up first, `work` cancelled (its
    generations abort on their workers) and an empty 499. `work` is bounded by the
    router's own timeouts; the watch ends with it."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_hung_up(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return task.result()


async def _hung_up(request: Request) -> None:
    # The body is read by now: the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
