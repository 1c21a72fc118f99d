"""How `pdserve serve` stops: vLLM's `--shutdown-timeout` semantics on uvicorn.

On SIGTERM (a Kubernetes pod ending) or Ctrl-C uvicorn stops accepting connections and
waits for the running requests. Left to itself it would, after its own timeout, cancel
the handlers still running: each client got a bare "Internal Server Error" and the log a
traceback per request. Here the running requests get `timeout_s` to finish; then the
router ends every one left with a 503 naming the reason (a stream gets it as an error
event, then `[DONE]`: its 200 has gone) and aborts it on its workers, and uvicorn's own
timeout, a few seconds later, is only a backstop for a handler that did not return.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn

# Seconds past `timeout_s` before uvicorn cancels what is still running: the 503s go out.
ANSWER_S = 5.0
REASON = "the server is shutting down"


class GracefulServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, timeout_s: float, stop_requests: Callable[[str], int]
    ) -> None:
        config.timeout_graceful_shutdown = timeout_s + ANSWER_S
        super().__init__(config)
        self.timeout_s = timeout_s
        self.stop_requests = stop_requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.server_state.tasks:
            print(
                f"pdserve: stopping: no new requests; {len(self.server_state.tasks)} running "
                f"get up to {self.timeout_s:g} s to finish (--shutdown-timeout)",
                flush=True,
            )
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._end_running)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_running(self) -> None:
        ended = self.stop_requests(REASON)
        if ended:
            print(
                f"pdserve: shutdown: {ended} request(s) still running after "
                f"{self.timeout_s:g} s (--shutdown-timeout) ended with a 503",
                flush=True,
            )
