"""One HTTP request's timeline, split into vLLM's request phases for the metrics.

The server sees every delta of a request on one clock; the workers say how long its
prompt waited to be scheduled (the first delta's `queue_s`: the router's wait for a
decode slot plus the wait on the worker that ran the prompt). From those:

    queue      arrival -> the prompt's first schedule            (the first delta's queue_s)
    prefill    the prompt's first schedule -> the first token here     (TTFT - queue)
    decode     the first token -> the last token here
    inference  prefill + decode

Time between tokens is per choice, so the n choices of one request do not cut into each
other's gaps. A request whose choices start at different times takes the queue time of
the choice that gave the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class RequestTiming:
    def __init__(
        self, start: float, num_choices: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.start, self._clock = start, clock
        self.first_token: float | None = None  # the request's, over all its choices
        self.last_token: float | None = None
        self.queue_s = 0.0
        self._queued: list[float | None] = [None] * num_choices  # per choice, its first delta's
        self._last: list[float | None] = [None] * num_choices
        self._tokens = [0] * num_choices

    def on_delta(self, metrics: Any, c: int, d: Any) -> None:
        """Choice `c`'s delta `d` arrived now: observes TTFT (the request's first token)
        and the time between this choice's tokens."""
        if self._queued[c] is None:
            self._queued[c] = d.queue_s
        if not d.token_ids:
            return
        t = self._clock()
        if self.first_token is None:
            self.first_token = t
            self.queue_s = self._queued[c] or 0.0
            metrics.ttft.observe(t - self.start)
        last = self._last[c]
        if last is not None:
            metrics.itl.observe((t - last) / len(d.token_ids))
        self._last[c] = self.last_token = t
        self._tokens[c] += len(d.token_ids)

    def now(self) -> float:
        return self._clock()

    @property
    def max_choice_tokens(self) -> int:
        return max(self._tokens, default=0)

    def phases(self) -> dict[str, float] | None:
        """queue, prefill, decode and inference seconds, and the time per output token
        after the first of the longest choice (None with one token); None if no token
        came."""
        if self.first_token is None or self.last_token is None:
            return None
        ttft = self.first_token - self.start
        queue = min(self.queue_s, ttft)  # another host's clock may run a little apart
        prefill = ttft - queue
        decode = self.last_token - self.first_token
        longest = self.max_choice_tokens
        return {
            "queue": queue,
            "prefill": prefill,
            "decode": decode,
            "inference": prefill + decode,
            "per_output_token": decode / (longest - 1) if longest > 1 else None,
        }
