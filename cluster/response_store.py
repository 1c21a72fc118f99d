"""Stored responses of the Responses API (`store: true`, OpenAI's default): what
`previous_response_id` continues and `GET` / `DELETE /v1/responses/{id}` read.

They live in this router process's memory, bounded by `--responses-store-bytes`: the
least recently used go first. Each holds its own request's input items and its response,
linked to the response it continued, so a conversation of many turns is stored once, not
once per turn; continuing a response touches every response of its conversation, so a
conversation in use is not the one evicted. A conversation whose earlier response is gone
(deleted, or evicted) cannot be continued: the request's 404 names the missing one.
Instructions are not part of a conversation: as on OpenAI's API, a request that continues
one gives its own (or none).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_STORE_BYTES = 256 << 20  # `--responses-store-bytes`


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as it was answered
    input_items: list[dict]  # the request's own input, as items
    previous_id: str | None  # the response it continued
    nbytes: int  # its JSON size, what the store's bound counts


class MissingResponse(KeyError):
    """A response asked for (or one of its conversation's) is not stored."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    """Responses by id, at most `max_bytes` of their JSON; 0 stores nothing."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, input_items: list[dict], previous_id: str | None) -> bool:
        """Keep `response` (its `id` names it), evicting the least recently used until it
        fits; False when it alone is over the bound (then nothing is evicted)."""
        nbytes = len(json.dumps(response)) + len(json.dumps(input_items))
        if nbytes > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, input_items, previous_id, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.nbytes -= gone.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise MissingResponse(response_id)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True

    def conversation(self, response_id: str) -> list[dict]:
        """The items of the conversation `response_id` ends, oldest first: each stored
        response's input items, then its output items. Raises MissingResponse naming the
        first response of the chain that is not stored."""
        chain: list[StoredResponse] = []
        rid: str | None = response_id
        while rid is not None:
            entry = self.get(rid)
            chain.append(entry)
            rid = entry.previous_id
        items: list[dict] = []
        for entry in reversed(chain):
            items += entry.input_items
            items += entry.response.get("output") or []
        return items


def as_items(value: object) -> list[dict]:
    """A Responses request's `input` as items: a string is one user message; an array is
    kept as it is (cluster/responses_input.py reads and checks it)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []
