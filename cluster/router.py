"""The router's request flow (DESIGN §2), independent of HTTP and of Ray.

`Router.generate` takes a parsed request and yields `(index, StreamDelta)` for each of
its `n` completions: it picks a decode worker with a free slot (the one holding most of
the prompt among those near the least busy, route_policy.prefer_cached; with
`decode_capacity` and every worker full, the request waits in the router's queue,
cluster/decode_admission.py), decides whether remote
prefill pays (`pd` mode, a prompt whose part not already cached on the decode worker is
long enough, a prefill worker up and, with `pd_max_prefill_queue_tokens`, not backed up;
a request that wants its prompt's logprobs prefills where they are computed, on the
decode worker; every decision is counted by reason), runs the prefill on the prefill
worker with the most cached prefix (then the least busy), hands the ticket to the
decode worker, and relays the token stream that arrives over ZMQ. If the prefill fails,
policy `recompute` lets the decode worker prefill itself and `fail` ends the request with
an error; both are counted. When the consumer stops early (client disconnect) every
worker that may hold the request is told to abort it.

Workers are reached through handles (`WorkerHandle`, cluster/worker_handle.py) so the
same flow drives Ray actors and in-process services. Where a prompt prefills is decided
by cluster/route_policy.py, from the loads and cached prefixes this router tracks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from pdserve.cluster.decode_admission import DecodeAdmission
from pdserve.cluster.lora_registry import LoraRegistry, ServedAdapter
from pdserve.cluster.openai_api import ApiError, ParsedRequest
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.route_policy import Route, RouterConfig, decide, prefer_cached
from pdserve.cluster.token_stream import StreamDelta
from pdserve.cluster.wire import WorkRequest
from pdserve.cluster.worker_handle import (
    STATS_TIMEOUT_S,
    WorkerHandle,
    abort_quietly,
    ask_stats,
    relay_first_token,
)
from pdserve.kvtransfer.protocol import Ticket, decode, ticket_to_wire
from pdserve.runner.parallel_sampling import child_params
from pdserve.runner.pooling import PoolingParams, pooling_to_wire
from pdserve.runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        decode_workers: list[WorkerHandle],
        prefill_workers: list[WorkerHandle],
    ) -> None:
        self.config = config
        self.decode_workers = decode_workers
        self.prefill_workers = prefill_workers
        self.decisions: Counter[str] = Counter()
        self.prefill_failures: Counter[str] = Counter()
        self.worker_stats: dict[str, dict] = {}  # worker id -> last polled stats
        self.stats_failures: Counter[str] = Counter()  # worker id -> polls it did not answer
        self.prefix_index = PrefixIndex(
            config.block_size, enabled=config.prefix_caching, state_points=config.state_snapshots
        )
        self.tier = None  # the KV tier actor, when there is one (stats only)
        self.tier_stats: dict = {}
        # (role, state) -> workers, from the controller's last member list (/metrics)
        self.pool_states: Counter[tuple[str, str]] = Counter()
        self._inflight: Counter[str] = Counter()  # worker id -> requests in flight
        self._prefill_tokens: Counter[str] = (
            Counter()
        )  # prefill worker id -> prompt tokens in flight
        self._queues: dict[str, asyncio.Queue[StreamDelta]] = {}
        self._assigned: dict[str, str] = {}  # request id -> decode worker id
        self._background: set[asyncio.Task] = set()  # aborts in flight; awaited by close()
        self._seeds = random.Random(config.seed) if config.seed is not None else None
        self._admission: DecodeAdmission[WorkerHandle] = DecodeAdmission(self._grant_decode)
        # The LoRA adapters served, by name (cluster/lora_registry.py): requests carry
        # their adapter's key and folder to the workers
        self.loras = LoraRegistry()
        # Each running `generate`'s queue of choices; `stop_requests` ends them all.
        self._running: set[asyncio.Queue] = set()
        self._stopped: str | None = None  # why generations end: the server is stopping

    def worker_roles(self) -> dict[str, str]:
        """Worker id -> "decode" | "prefill" for the workers requests are routed to."""
        roles = {w.worker_id: "decode" for w in self.decode_workers}
        roles.update({w.worker_id: "prefill" for w in self.prefill_workers})
        return roles

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=15.0)

    def stop_requests(self, reason: str) -> int:
        """The server is stopping (cluster/shutdown.py): every generation still running,
        and any asked for later, ends with a 503 saying `reason`; its workers abort it,
        as for a client gone. Returns how many requests it ended."""
        self._stopped = reason
        for queue in self._running:
            queue.put_nowait((-1, ApiError(reason, 503, "server_error")))
        return len(self._running)

    # ---- token stream -------------------------------------------------------------------

    def on_delta(self, worker_id: str, delta: StreamDelta) -> None:
        q = self._queues.get(delta.request_id)
        if q is not None:
            q.put_nowait(delta)

    def worker_failed(self, worker_id: str) -> int:
        """A decode worker died (or was restarted): end its requests with an error now
        instead of letting them wait for tokens that will never come."""
        self.prefix_index.forget(worker_id)
        lost = [rid for rid, w in self._assigned.items() if w == worker_id]
        for rid in lost:
            self.on_delta(
                worker_id,
                StreamDelta(rid, [], "", "error", f"decode worker {worker_id} died", None, 0, 0),
            )
        return len(lost)

    def queued(self) -> int:
        """Requests waiting in the router for a decode slot."""
        return self._admission.queued

    def workers_changed(self) -> None:
        """The decode worker list changed (cluster/membership.py): a new worker's slots go
        to the requests waiting for one."""
        self._admission.wake()

    def load_of(self, worker_id: str) -> dict[str, int]:
        """What this router has in flight on a worker: requests, and prompt tokens sent to
        it for prefill (the ops view and the autoscaler read it)."""
        return {
            "inflight": self._inflight[worker_id],
            "prompt_tokens_in_flight": self._prefill_tokens[worker_id],
        }

    # ---- choices ------------------------------------------------------------------------

    def _pick(self, workers: list[WorkerHandle]) -> WorkerHandle:
        def load(w: WorkerHandle) -> tuple:
            s = self.worker_stats.get(w.worker_id, {})
            return (self._inflight[w.worker_id], s.get("kv_cache_usage_perc", 0.0))

        return min(workers, key=load)

    def _grant_decode(
        self, hashes: list[int] | None = None, sibling: str | None = None
    ) -> WorkerHandle | None:
        """A free slot: on the worker holding most of the prompt (its block `hashes`)
        within the load band (`prefer_cached`), else the least busy. `sibling`: where
        another choice of the same request went, which counts as holding all of it (there
        the prompt is computed or pulled once for every choice)."""
        cap = self.config.decode_capacity
        free = [w for w in self.decode_workers if not cap or self._inflight[w.worker_id] < cap]
        if not free:
            return None
        if hashes:
            worker = prefer_cached(
                free,
                lambda w: self._inflight[w.worker_id],
                lambda w: (
                    len(hashes) * self.prefix_index.block_size
                    if w.worker_id == sibling
                    else self.prefix_index.hit_tokens(w.worker_id, hashes)
                ),
                lambda w: self.worker_stats.get(w.worker_id, {}).get("kv_cache_usage_perc", 0.0),
                self.config.decode_prefix_slack,
            )
        else:
            worker = self._pick(free)
        self._inflight[worker.worker_id] += 1
        return worker

    def _release_decode(self, worker: WorkerHandle) -> None:
        self._inflight[worker.worker_id] -= 1
        self._admission.wake()

    def _pick_prefill(self, hashes: list[int]) -> WorkerHandle:
        """Most cached prefix first, then the fewest requests in flight."""

        def score(w: WorkerHandle) -> tuple:
            return (-self.prefix_index.hit_tokens(w.worker_id, hashes), self._inflight[w.worker_id])

        return min(self.prefill_workers, key=score)

    # ---- one request --------------------------------------------------------------------

    async def generate(
        self, req: ParsedRequest, on_route: Callable[[Route], None] | None = None
    ) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(choice index, delta) of each of the request's `n` generations. `on_route` hears
        where each one went, once it is on its decode worker (`--enable-log-requests`)."""
        if self._stopped is not None:
            raise ApiError(self._stopped, 503, "server_error")
        base_seed = req.params.seed
        if base_seed is None:
            base_seed = (self._seeds or secrets.SystemRandom()).getrandbits(63)
        children = child_params(replace(req.params, seed=base_seed), base_seed)
        adapter = self._adapter(req.lora_name)
        rid = f"r-{secrets.token_hex(8)}"
        ids = [f"{rid}-{i}" for i in range(len(children))]
        merged: asyncio.Queue[tuple[int, StreamDelta | BaseException]] = asyncio.Queue()
        placed: list[str] = []  # the decode worker the first choice went to
        tasks = [
            asyncio.create_task(
                self._one(cid, i, req.prompt_token_ids, p, merged, on_route, placed, adapter)
            )
            for i, (cid, p) in enumerate(zip(ids, children))
        ]
        done = 0
        self._running.add(merged)
        try:
            while done < len(tasks):
                index, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    done += 1
                yield index, item
        finally:
            self._running.discard(merged)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(
        self,
        request_id,
        index,
        prompt,
        params,
        out: asyncio.Queue,
        on_route=None,
        placed: list[str] | None = None,
        adapter: ServedAdapter | None = None,
    ) -> None:
        if not self.decode_workers:
            await out.put((index, ApiError("no decode worker is available", 503, "server_error")))
            return
        timeout_s = self.config.stream_idle_timeout_s
        arrived = time.monotonic()
        lora = adapter.key if adapter is not None else None
        hashes = self.prefix_index.hashes(prompt, params.cache_salt, lora)
        try:
            decode_w = await self._admission.acquire(
                timeout_s, self._release_decode, params.priority,
                lambda: self._grant_decode(hashes, placed[0] if placed else None),
            )  # fmt: skip
        except TimeoutError:
            message = f"no decode slot was free within {timeout_s:g} s ({self.queued()} queued)"
            await out.put((index, ApiError(message, 503, "server_error")))
            return
        waited = time.monotonic() - arrived  # for a decode slot: part of its queue time
        if placed is not None and not placed:
            placed.append(decode_w.worker_id)
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        holders: list[WorkerHandle] = []
        finished = False
        relay: asyncio.Task | None = None
        try:
            ticket = prefill_w = None
            hits = self.prefix_index.hit_tokens(decode_w.worker_id, hashes)
            loads = [self._prefill_tokens[w.worker_id] for w in self.prefill_workers]
            decision = decide(
                self.config, len(prompt), hits, params.prompt_logprobs is not None, loads
            )
            self.decisions[decision] += 1
            work = WorkRequest(
                request_id, prompt, params, lora=lora, lora_path=adapter and adapter.path
            )
            if decision == "remote_prefill":
                prefill_w = self._pick_prefill(hashes)
                ticket = await self._remote_prefill(prefill_w, work, holders, hashes)
                if ticket is None:  # failed; policy recompute: the decode worker prefills
                    decision = "recompute_after_prefill_failure"
            # The decode worker holds the prompt's KV once it computes it (no ticket) or
            # pulls it, which it does only for a request its first token did not end.
            on_decode, output = ticket is None, []
            # remember what the decode worker holds once it computed or pulled the prompt;
            # a hybrid's state only where it computed it (RouterConfig.state_snapshots)
            if on_decode:
                self.prefix_index.remember(decode_w.worker_id, hashes)
            work = replace(work, ticket=ticket_to_wire(ticket) if ticket is not None else None)
            holders.append(decode_w)
            self._assigned[request_id] = decode_w.worker_id
            await decode_w.submit(work.encode())
            if on_route is not None:
                prefilled_by = prefill_w.worker_id if ticket is not None else None
                on_route(Route(index, request_id, decision, prefilled_by, decode_w.worker_id))
            if ticket is not None and ticket.first_token is None:  # an early ticket
                relay = asyncio.create_task(
                    relay_first_token(
                        prefill_w, decode_w, request_id, self.config.prefill_timeout_s
                    )
                )
            while True:
                delta = await asyncio.wait_for(queue.get(), self.config.stream_idle_timeout_s)
                # The first delta carries the queue time: add the wait for a decode slot.
                delta.queue_s, waited = delta.queue_s + waited, 0.0
                output += delta.token_ids
                if not on_decode and (delta.finish_reason is None or len(output) > 1):
                    on_decode = True  # it went on past its first token: the KV is pulled
                    self.prefix_index.remember(decode_w.worker_id, hashes, state=False)
                await out.put((index, delta))
                if delta.finish_reason is not None:
                    finished = True
                    if on_decode and delta.finish_reason != "error":
                        # The reply's KV is cached there too (all but its last token's):
                        # a conversation's next turn resends it.
                        seq = list(prompt) + output[:-1]
                        prefixes = self.prefix_index
                        reply = prefixes.extended(hashes, seq, params.cache_salt, lora)
                        prefixes.remember_reply(decode_w.worker_id, reply, len(hashes))
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, which raises it
            await out.put((index, e))
        finally:
            if relay is not None:
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
            self._queues.pop(request_id, None)
            self._assigned.pop(request_id, None)
            self._release_decode(decode_w)
            if not finished:
                for w in holders:  # client gone or error: nothing may keep its blocks
                    task = asyncio.create_task(abort_quietly(w, request_id))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)

    async def pool(
        self, prompt: list[int], lora_name: str | None, task: str,
        pooling: PoolingParams | None = None,
    ) -> StreamDelta:  # fmt: skip
        """One pooling request (runner/pooling.py) of `task`, "embed" or "classify", on a
        decode worker, chosen as a generating request's is: its one delta, carrying the
        vector (a classification's: its label probabilities)."""
        if not self.decode_workers:
            raise ApiError("no decode worker is available", 503, "server_error")
        timeout_s = self.config.stream_idle_timeout_s
        adapter = self._adapter(lora_name)
        lora = adapter.key if adapter is not None else None
        hashes = self.prefix_index.hashes(prompt, None, lora)
        try:
            decode_w = await self._admission.acquire(
                timeout_s, self._release_decode, 0, lambda: self._grant_decode(hashes)
            )
        except TimeoutError:
            message = f"no decode slot was free within {timeout_s:g} s ({self.queued()} queued)"
            raise ApiError(message, 503, "server_error") from None
        request_id = f"e-{secrets.token_hex(8)}"
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._assigned[request_id] = decode_w.worker_id
            params = SamplingParams(max_tokens=1)
            work = WorkRequest(
                request_id,
                prompt,
                params,
                lora=lora,
                lora_path=adapter and adapter.path,
                embed=pooling_to_wire(task, pooling),
            )
            await decode_w.submit(work.encode())
            self.prefix_index.remember(decode_w.worker_id, hashes)
            while True:
                delta = await asyncio.wait_for(queue.get(), timeout_s)
                if delta.finish_reason is None:
                    continue
                finished = True
                if delta.embedding is None:
                    raise ApiError(
                        f"the {task} request ended with {delta.finish_reason!r}", 500,
                        "server_error",
                    )  # fmt: skip
                return delta
        finally:
            self._queues.pop(request_id, None)
            self._assigned.pop(request_id, None)
            self._release_decode(decode_w)
            if not finished:  # client gone or error: nothing may keep its blocks
                task = asyncio.create_task(abort_quietly(decode_w, request_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    def _adapter(self, name: str | None) -> ServedAdapter | None:
        """The adapter a request names (None: the base model); a 404 if it was unloaded
        since the request was read."""
        adapter = self.loras.get(name)
        if name is not None and adapter is None:
            raise ApiError(f"the LoRA adapter {name!r} is no longer served", 404,
                           "invalid_request_error", "model", "model_not_found")  # fmt: skip
        return adapter

    async def _remote_prefill(
        self, prefill_w: WorkerHandle, work: WorkRequest, holders: list, hashes: list[int]
    ) -> Ticket | None:
        self.prefix_index.remember(prefill_w.worker_id, hashes)
        self._inflight[prefill_w.worker_id] += 1
        self._prefill_tokens[prefill_w.worker_id] += len(work.prompt_token_ids)
        holders.append(prefill_w)
        start = time.monotonic()
        try:
            raw = await asyncio.wait_for(
                prefill_w.prefill(work.encode()), self.config.prefill_timeout_s
            )
            ticket = decode(raw)
            if not isinstance(ticket, Ticket):
                raise RuntimeError(f"prefill answered with {ticket.TYPE}")
            return ticket
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = type(e).__name__
            self.prefill_failures[reason] += 1
            logger.warning(
                "prefill of %s on %s failed after %.1f s: %s",
                work.request_id,
                prefill_w.worker_id,
                time.monotonic() - start,
                e,
            )
            if self.config.policy == "fail":
                raise ApiError(
                    f"prefill failed ({reason}); policy is 'fail'", 503, "server_error"
                ) from e
            self.decisions["recompute_after_prefill_failure"] += 1
            return None
        finally:
            self._inflight[prefill_w.worker_id] -= 1
            self._prefill_tokens[prefill_w.worker_id] -= len(work.prompt_token_ids)

    async def poll_stats(self) -> None:
        """Fresh stats from the tier and every worker, all asked at once. A worker that does
        not answer within STATS_TIMEOUT_S keeps its last stats, marked with the error, so
        its counters do not vanish from /metrics; its failures are counted."""

        async def ask_tier() -> None:
            try:
                self.tier_stats = await asyncio.wait_for(self.tier.stats.remote(), STATS_TIMEOUT_S)
            except Exception as e:
                self.tier_stats = {"error": repr(e)}

        workers = [*self.decode_workers, *self.prefill_workers]
        polls = [ask_stats(w) for w in workers] + ([ask_tier()] if self.tier is not None else [])
        answers = await asyncio.gather(*polls)
        for worker_id, stats, error in answers[: len(workers)]:
            if error is None:
                self.worker_stats[worker_id] = stats
            else:
                self.stats_failures[worker_id] += 1
                self.worker_stats[worker_id] = {
                    **self.worker_stats.get(worker_id, {}),
                    "error": error,
                }
