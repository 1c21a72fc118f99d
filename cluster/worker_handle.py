"""The router's view of a worker (DESIGN §2): the `WorkerHandle` protocol, and the calls
on it that must never fail a request.

A handle is what the router drives, a Ray actor's (cluster/ray_pool.py) or an in-process
service's, so the same request flow runs both. The calls here are best effort: an abort
of a request nobody waits for, the relay of an early ticket's first token, a stats poll.
Each is bounded by a timeout, and a failure is logged or returned, never raised: a dead
or slow worker must not take the request, or the poll of the others, down with it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

logger = logging.getLogger(__name__)
# A stats poll waits this long for each worker (all at once): a worker's loop answers
# between steps, and on a loaded CPU host a step can take seconds.
STATS_TIMEOUT_S = 10.0


class WorkerHandle(Protocol):
    worker_id: str

    async def submit(self, payload: bytes) -> None: ...
    async def prefill(self, payload: bytes) -> bytes: ...
    # --kv-layer-wise: a prefill worker's early ticket's first token (`wire.FirstToken`),
    # and its delivery to the decode worker loading the KV (False: it came too late).
    async def first_token(self, request_id: str) -> bytes: ...
    async def deliver_first_token(self, payload: bytes) -> bool: ...
    async def abort(self, request_id: str) -> bool: ...
    async def stats(self) -> dict: ...
    async def reset_prefix_cache(self) -> bool: ...


async def abort_quietly(worker: WorkerHandle, request_id: str) -> None:
    try:
        await asyncio.wait_for(worker.abort(request_id), 10.0)
    except Exception as e:  # the worker may be dead; its leases expire on their own
        logger.info("abort of %s on %s: %s", request_id, worker.worker_id, e)


async def relay_first_token(
    prefill_w: WorkerHandle, decode_w: WorkerHandle, request_id: str, timeout_s: float
) -> None:
    """An early ticket's first token, from the prefill worker to the decode worker as
    soon as the forward has sampled it, instead of at the end of the layer stream,
    which over tcp can be seconds later. The stream still ends with the token, so a
    relay that fails or loses the race only costs that time (logged, not an error).
    `timeout_s` bounds the wait for the prefill worker's token."""
    try:
        raw = await asyncio.wait_for(prefill_w.first_token(request_id), timeout_s)
        # False: the pull's end brought it first (counted by the decode worker).
        await asyncio.wait_for(decode_w.deliver_first_token(raw), 30.0)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.info("first token of %s not relayed: %r", request_id, e)


async def ask_stats(worker: WorkerHandle) -> tuple[str, dict | None, str | None]:
    """(worker id, its stats, None), or (worker id, None, the error) when it does not
    answer within STATS_TIMEOUT_S."""
    try:
        return worker.worker_id, await asyncio.wait_for(worker.stats(), STATS_TIMEOUT_S), None
    except Exception as e:  # a slow or dead worker: the caller keeps what it said last
        return worker.worker_id, None, repr(e)
