"""Background responses of the Responses API (`background: true`, OpenAI's and vLLM's):
the request is answered at once with its response `queued`, and the generation runs on in
the router, bound to no connection, its response stored as it goes (`in_progress`, then
`completed`, `incomplete` or `failed`). `GET /v1/responses/{id}` reads it;
`POST /v1/responses/{id}/cancel` stops it (`cancelled`).

`BackgroundRuns` owns the runs' tasks: each is awaited by whoever cancels it, and the server
cancels and awaits those left when it stops (cluster/serve.py), so none outlives the
router. A run that a stopping server's request drain ends is stored `failed` with the
reason; a cancelled run is stored `cancelled` by the cancel route.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 10.0  # how long a cancel waits for its run to unwind


class BackgroundRuns:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._tasks

    def start(self, response_id: str, run: Coroutine[Any, Any, None]) -> None:
        """Run `run` as the background response `response_id`."""
        task = asyncio.create_task(run, name=f"background-{response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda t: self._done(response_id, t))

    async def cancel(self, response_id: str) -> bool:
        """Stop the run of `response_id` and wait for it to unwind (its generations
        aborted); False when none is running."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_TIMEOUT_S)
        return True

    async def close(self) -> None:
        """Cancel every run left and wait for them (the server is stopping)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_TIMEOUT_S)

    def _done(self, response_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(response_id) is task:
            del self._tasks[response_id]
        if not task.cancelled() and task.exception() is not None:
            logger.error("background response %s failed", response_id, exc_info=task.exception())
