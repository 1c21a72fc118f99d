"""Aborts that come before the request they abort.

Ray runs an async actor's calls out of order (only a synchronous, single-threaded actor
keeps one caller's order), and the pool actors are async: a client that hangs up right
after its request was placed can have the router's abort reach a worker before the
request itself. A worker remembers the aborts of requests it does not hold and drops the
request when it comes. The router's request ids are never reused, so a remembered id
never stands for a new request; at most `limit` are kept, the oldest forgotten first.
"""

from __future__ import annotations


class EarlyAborts:
    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}  # insertion-ordered: the oldest first

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        if len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]

    def take(self, request_id: str) -> bool:
        """Whether `request_id` was aborted before it came (forgotten once asked)."""
        return self._ids.pop(request_id, 0) is None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
