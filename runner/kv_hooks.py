"""The engine's side of KV transfer: typed hooks, no transport.

Two roles meet here (DESIGN §2):
- prefill role: a request added with `hold_kv=True` runs its prompt, samples one token
  and then leaves the engine with its blocks still referenced (`KVHeld` on its last
  delta) until the worker calls `Engine.release_held`.
- decode role: a request added with `Engine.add_prefilled_request` brings its first
  token and a ticket; when the scheduler admits it, it gets blocks for the prompt and the
  engine asks a `KVLoader` to fill them (`KVLoadSpec`). The scheduler runs other requests
  meanwhile; the loader reports how many prompt tokens it filled (`KVLoadResult`) and
  the request continues from there, computing whatever was not loaded.
- layer-wise early tickets: with a `KVPublisher`, the prefill-role engine tells it, before
  the forward of a step in which held requests finish their prompts, which ones
  (`KVPromptScheduled`), and calls the hook it returns after each decoder layer; a
  decode-role request may then arrive without its first token (it comes with the load:
  `KVLoadResult.first_token`).

This module knows nothing about layouts, sockets or leases: `kvtransfer/`, `prefill/`
and `decode/` do, and plug in through these types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class KVHeld:
    """Blocks a prefill-role request left referenced, covering its prompt's KV."""

    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens whose KV the blocks hold
    block_hashes: tuple[int, ...]  # chain hashes of the full blocks (tier keys)
    state_unit: int | None = None  # a hybrid Mamba model's: the prompt's final state


@dataclass(frozen=True)
class KVLoadSpec:
    """Fill `block_ids` with the KV of prompt tokens [num_local_tokens, num_prompt_tokens)."""

    request_id: str
    block_ids: tuple[int, ...]  # covers every prompt token; the first ones may be local hits
    num_local_tokens: int  # a block multiple: tokens already in the cache (prefix hits)
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]  # chain hashes of the prompt's full blocks (tier lookups)
    ticket: object  # whatever add_prefilled_request was given; opaque to the engine
    # A hybrid Mamba model's: the unit that takes the prompt's final state. Such a load is
    # all or nothing: the state exists only at the prompt's end (runner/state_pool.py).
    state_unit: int | None = None


@dataclass(frozen=True)
class KVLoadResult:
    """`num_tokens`: leading prompt tokens now valid in the request's blocks (local hits
    included). `error`: why the load failed, None when it did not; on failure the
    request continues from `num_tokens` and computes the rest (recompute), or, with
    `fail`, ends with finish reason "error"."""

    request_id: str
    num_tokens: int
    error: str | None = None
    fail: bool = False  # policy `fail`: end the request with an error instead of recomputing
    # An early ticket's first token and its logprobs (a TopLogprobs), from the pull; None
    # otherwise. A failed early load has none: the engine samples it after recomputing.
    first_token: int | None = None
    first_logprobs: Any = None


@dataclass(frozen=True)
class KVPromptScheduled:
    """A held (prefill-role) request whose last prompt chunk runs in the coming step: its
    blocks cover the whole prompt, and its KV is complete layer by layer as the forward
    goes."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens
    num_cached_tokens: int = 0  # of them, found in the prefix cache (not computed)
    queue_s: float = 0.0  # seconds the request waited before its first schedule


class KVPublisher(Protocol):
    def step_started(
        self, scheduled: list[KVPromptScheduled], num_layers: int
    ) -> Callable[[int], None] | None:
        """Called before the forward of a step that finishes these prompts; returns the hook
        the forward calls with each decoder layer's index once its KV writes are queued
        (GPU) or done (CPU), in order, or None to get no calls."""


class KVLoader(Protocol):
    def start_load(self, spec: KVLoadSpec) -> None:
        """Begin filling the blocks in the background; never blocks on the transfer."""

    def poll(self) -> list[KVLoadResult]:
        """Loads that ended since the last call (finished, failed or cancelled)."""

    def cancel(self, request_id: str) -> None:
        """Stop a load; it is still reported by `poll` once nothing writes the blocks."""

    def num_inflight(self) -> int:
        """Loads started and not yet reported by `poll`."""
