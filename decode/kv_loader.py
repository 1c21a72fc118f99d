"""The decode worker's `KVLoader`: fills a request's blocks from the tier and the ticket.

For each load (runner/kv_hooks.py `KVLoadSpec`), on a background thread:
1. blocks already in the local prefix cache are skipped;
2. the next full blocks found in the secondary tier (by chain hash) are copied from it;
3. the rest comes from the prefill worker named in the ticket, over the transport its
   endpoint's scheme names (`local://`, `tcp://`, ...); then the lease is released. A
   hybrid Mamba model's ticket has a second group, the prompt's final state, pulled into
   the request's state unit with the blocks (all or nothing: a failed pull leaves the
   whole prompt to compute).
   An early ticket (no first token yet: layer-wise mode) is always pulled, even when
   nothing is left to move, since the pull's end brings the first token; only a
   transport that streams it (tcp) can take one.
A failed pull is never silent: it is counted by error code and reported with the tokens
that are valid (local + tier); policy `recompute` lets the engine compute the rest,
`fail` ends the request with an error. Every transport call has a timeout, so a dead
prefill worker costs at most `timeout_s`.

It knows nothing about scheduling: the engine asks, the loader reports.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pdserve.kvtransfer.copy_stream import CopyStreams
from pdserve.kvtransfer.layout import GroupStorage
from pdserve.kvtransfer.pack import unpack
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.tier import HostKVTier
from pdserve.kvtransfer.transport import PullSpec, TransferError, Transport
from pdserve.runner.kv_hooks import KVLoadResult, KVLoadSpec
from pdserve.runner.runner_output import TopLogprobs

logger = logging.getLogger(__name__)

POLICIES = ("recompute", "fail")


def logprobs_from_rows(rows: list[list[float]] | None) -> TopLogprobs | None:
    """A ticket's (or PullDone's) first-token logprob rows [token_id, logprob, rank] as
    the engine's TopLogprobs."""
    if not rows:
        return None
    return TopLogprobs(
        token_ids=[int(r[0]) for r in rows],
        logprobs=[float(r[1]) for r in rows],
        rank=int(rows[0][2]),
    )


def scheme_of(endpoint: str) -> str:
    """The transport an endpoint names: `tcp://…` -> tcp, `cuda_ipc+tcp://…` -> cuda_ipc."""
    return endpoint.partition("://")[0].partition("+")[0]


@dataclass
class LoaderStats:
    loads: int = 0
    bytes_pulled: int = 0
    tier_blocks: int = 0
    seconds: float = 0.0
    recomputes: int = 0
    fails: int = 0
    errors: Counter = field(default_factory=Counter)  # by TransferError code
    pulls: Counter = field(default_factory=Counter)  # successful pulls by transport name


class TransferLoader:
    def __init__(
        self,
        transports: dict[str, Transport],
        layout_hash: str,
        policy: str = "recompute",
        timeout_s: float = 30.0,
        tier: HostKVTier | None = None,
        max_workers: int = 2,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.transports = transports  # endpoint scheme ("tcp", "local", ...) -> transport
        self.layout_hash = layout_hash
        self.policy = policy
        self.timeout_s = timeout_s
        self.tier = tier
        self.stats = LoaderStats()
        self._dst: tuple[GroupStorage, ...] | None = None
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-load")
        self._done: queue.SimpleQueue[KVLoadResult] = queue.SimpleQueue()
        self._cancel: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._copies = CopyStreams()
        # Called on the loading thread after each result is queued for `poll` (the worker's
        # loop sleeps while its engine only waits on loads, and this wakes it).
        self.on_done: Callable[[], None] | None = None

    def attach(self, dst: tuple[GroupStorage, ...]) -> None:
        """The engine's KV storage the loads write into (known once the engine exists)."""
        self._dst = dst

    # ---- KVLoader ---------------------------------------------------------------------

    def start_load(self, spec: KVLoadSpec) -> None:
        assert self._dst is not None, "attach() the destination storage first"
        event = threading.Event()
        with self._lock:
            self._cancel[spec.request_id] = event
        self._pool.submit(self._run, spec, event)

    def poll(self) -> list[KVLoadResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def cancel(self, request_id: str) -> None:
        with self._lock:
            event = self._cancel.get(request_id)
        if event is not None:
            event.set()

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._cancel)

    def abort_ticket(self, ticket: object) -> None:
        """Give up a ticket whose load never started (its request ended first): the prefill
        side is told on a pool thread, so a dead peer costs the engine thread nothing."""
        self._pool.submit(self.finish_ticket, ticket, False)

    def close(self) -> None:
        with self._lock:
            for event in self._cancel.values():
                event.set()
        self._pool.shutdown(wait=True, cancel_futures=False)

    # ---- one load, on a pool thread ---------------------------------------------------

    def _run(self, spec: KVLoadSpec, cancel: threading.Event) -> None:
        try:
            result = self._load(spec, cancel)
        except Exception as e:  # a bug must still end the load, or the blocks leak
            logger.exception("KV load of %s crashed", spec.request_id)
            result = self._failed(spec, spec.num_local_tokens, TransferError("internal", repr(e)))
        with self._lock:
            self._cancel.pop(spec.request_id, None)
        self._done.put(result)
        if self.on_done is not None:
            self.on_done()

    def _load(self, spec: KVLoadSpec, cancel: threading.Event) -> KVLoadResult:
        assert self._dst is not None
        block_size = self._dst[0].group.block_size
        first = spec.num_local_tokens // block_size
        ticket = spec.ticket
        has_ticket = isinstance(ticket, Ticket)
        transport = self.transports.get(scheme_of(ticket.endpoint)) if has_ticket else None
        if transport is None or not transport.beats_tier:
            first += self._from_tier(spec, first)
        valid = first * block_size
        early = has_ticket and ticket.first_token is None
        if not has_ticket or (valid >= spec.num_prompt_tokens and not early):
            self.finish_ticket(ticket, release=True)
            return KVLoadResult(spec.request_id, max(valid, spec.num_local_tokens))
        if cancel.is_set():
            self.finish_ticket(ticket, release=False)
            return KVLoadResult(spec.request_id, valid, "cancelled")
        try:
            if transport is None:
                raise TransferError("unreachable", f"no transport for {ticket.endpoint!r}")
            if ticket.num_tokens != spec.num_prompt_tokens:
                raise TransferError(
                    "bad_ticket",
                    f"ticket covers {ticket.num_tokens} tokens, the prompt has "
                    f"{spec.num_prompt_tokens}",
                )
            if len(ticket.group_unit_ids) != len(self._dst):
                raise TransferError(
                    "bad_ticket",
                    f"ticket has {len(ticket.group_unit_ids)} unit groups, this worker's "
                    f"layout {len(self._dst)}",
                )
            n = len(ticket.group_unit_ids[0])
            dst, firsts = (tuple(spec.block_ids[:n]),), (min(first, n),)
            if spec.state_unit is not None:  # a hybrid's final Mamba state: its one unit
                dst, firsts = (*dst, (spec.state_unit,)), (*firsts, 0)
            pull = PullSpec(ticket, dst, firsts)
            start = time.perf_counter()
            first_token = first_logprobs = None
            if not early:
                moved = transport.pull(pull, self._dst, self.timeout_s, cancel)
            elif getattr(transport, "streams_first_token", False):
                moved, first_token, rows = transport.pull_early(
                    pull, self._dst, self.timeout_s, cancel
                )
                first_logprobs = logprobs_from_rows(rows)
            else:
                raise TransferError(
                    "bad_ticket",
                    f"an early ticket (no first token) over {transport.name}, which cannot "
                    "stream one; layer-wise early tickets need the tcp transport",
                )
            self.stats.seconds += time.perf_counter() - start
        except TransferError as e:
            self.finish_ticket(ticket, release=False)
            return self._failed(spec, valid, e)
        released = self.finish_ticket(ticket, release=True)
        if not released and transport.release_confirms_copy:
            # The copy read the source's memory with no proof it was still held then.
            return self._failed(
                spec, valid, TransferError("source_lost", "the release after the copy failed")
            )
        self.stats.loads += 1
        self.stats.bytes_pulled += moved
        self.stats.pulls[transport.name] += 1
        return KVLoadResult(
            spec.request_id,
            spec.num_prompt_tokens,
            first_token=first_token,
            first_logprobs=first_logprobs,
        )

    def _from_tier(self, spec: KVLoadSpec, first: int) -> int:
        """Copy the tier's run of blocks after the local hits; returns how many."""
        if self.tier is None or first >= len(spec.block_hashes):
            return 0
        hashes = list(spec.block_hashes[first:])
        n = self.tier.lookup(self.layout_hash, hashes)
        if n == 0:
            return 0
        try:
            blocks = self.tier.get(self.layout_hash, hashes[:n])
        except KeyError:  # evicted between lookup and get: use what the ticket has
            return 0
        storage = self._dst[0]
        with self._copies.scope(storage.device):  # beside the engine's steps, done on return
            buffers = [
                torch.stack([b[t] for b in blocks], dim=1).to(storage.device)
                for t in range(len(blocks[0]))
            ]
            unpack(storage, list(spec.block_ids[first : first + n]), buffers)
        self.stats.tier_blocks += n
        return n

    def _failed(self, spec: KVLoadSpec, valid: int, e: TransferError) -> KVLoadResult:
        self.stats.errors[e.code] += 1
        if self.policy == "fail":
            self.stats.fails += 1
            return KVLoadResult(spec.request_id, valid, str(e), fail=True)
        self.stats.recomputes += 1
        return KVLoadResult(spec.request_id, max(valid, spec.num_local_tokens), str(e))

    def finish_ticket(self, ticket: object, release: bool) -> bool:
        """Tell the prefill side we are done with its blocks (best effort: if it is gone,
        its lease expires and frees them); False if it did not acknowledge."""
        if not isinstance(ticket, Ticket):
            return False
        transport = self.transports.get(scheme_of(ticket.endpoint))
        if transport is None:
            return False
        try:
            if release:
                transport.release(ticket, self.timeout_s)
            else:
                transport.abort(ticket, min(self.timeout_s, 2.0))
        except TransferError as e:
            self.stats.errors[f"release_{e.code}"] += 1
            logger.warning("could not release %s at %s: %s", ticket.request_id, ticket.endpoint, e)
            return False
        return True
