"""The scheduler: one token budget per step, shared by every request, no phases.

Each request is `num_computed_tokens` catching up with `num_tokens`. Running requests
are served first, decodes (one token behind) before partial prefills, then waiting
requests in arrival order (under the priority policy: by priority, then arrival) while
budget, `max_num_seqs` and KV blocks last; a waiting prompt whose prefix is being computed
for another waits for it (runner/prefix_sharing.py). A prompt longer than the remaining budget is
chunked. When blocks run out, the most recently admitted request (under the priority
policy: the last by priority, then arrival) that is not already in this step is preempted
by recompute: its blocks are freed (they stay in the prefix cache) and it waits again
with prompt + output as its new prompt. This file is central: keep it to this loop;
policy pieces live beside it.

With async scheduling, step N+1 is planned while step N runs: a request that samples in
step N holds an output placeholder until its token reaches the host, and counts it as a
token when planning (its KV slot is allocated; its value is only on the device). A
request whose in-flight tokens already reach its token limit is not planned again.

Decode role (runner/kv_hooks.py): a waiting request with a KV ticket is admitted by
giving it blocks for its prompt and a `KVLoadSpec` in the step's output; it waits in
`loading` (no token budget) until `finish_load`, then re-enters the waiting queue with
the loaded tokens computed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from pdserve.runner.config import SchedulerConfig
from pdserve.runner.kv_cache_manager import KVCacheManager
from pdserve.runner.kv_hooks import KVLoadResult, KVLoadSpec
from pdserve.runner.prefix_sharing import PromptsInFlight
from pdserve.runner.request import Request, RequestStatus
from pdserve.runner.runner_output import ModelRunnerOutput
from pdserve.runner.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pdserve.runner.speculative.drafter import Drafter

# Looking an enum member up on its class costs ~0.1 us on Python 3.11, and the step loops
# test every running request's status (512 a step at full decode).
_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        async_scheduling: bool = False,
        drafter: Drafter | None = None,
    ):
        self.config = config
        self.kv = kv
        self.async_scheduling = async_scheduling
        self.by_priority = config.policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Decode role: requests whose blocks a loader is filling. An aborted one stays here
        # (its blocks still referenced) until the loader reports it, so nothing is freed
        # while a transfer may still write into it.
        self.loading: dict[str, Request] = {}
        self._in_runner: set[str] = set()  # requests the runner holds a slot for
        self._free_in_runner: set[str] = set()  # finished/preempted since the last step
        self.num_preemptions = 0
        # Prompt tokens put in steps (prefix-cache hits and loaded KV are not computed, so
        # not counted): the worker's prompt throughput.
        self.num_prompt_tokens_computed = 0
        # Prompts being computed, which the same prompt arriving beside them waits for
        # (runner/prefix_sharing.py), and how many steps a waiting prompt was held so.
        self._in_flight = PromptsInFlight(kv)
        self.num_prefix_waits = 0
        # A hybrid with prefix caching saves a decoding request's state every this many
        # tokens (runner/state_snapshots.py); 0: no such saves.
        self._decode_save_every = kv.decode_save_stride if kv.snapshots is not None else 0
        # Speculative decoding (runner/speculative/): a decode also schedules a draft after
        # its last token when the drafter has one; vLLM's counters of what was kept
        self.drafter = drafter
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        # [i]: drafts whose token at position i (0 first) was kept (vLLM's per-position)
        k = drafter.config.num_speculative_tokens if drafter is not None else 0
        self.num_accepted_per_pos = [0] * k

    # ---- membership -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "request ids are unique while live"
        self.requests[request.request_id] = request
        self._enqueue(request, first=False)

    def _enqueue(self, req: Request, first: bool) -> None:
        """Into the waiting queue. fcfs: at the back, or at the front (`first`: preempted
        or loaded, it goes before later arrivals). priority: after every request of a lower
        or equal (priority, arrival) and before the rest, whichever way it came back."""
        if not self.by_priority:
            if first:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        key = _priority_order(req)
        i = len(self.waiting)
        # From the back: arrivals of one priority come in order, so this is usually O(1).
        while i and _priority_order(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (stop/length/abort) at any time; frees its blocks at once."""
        assert status.is_finished, "finish_request takes a finished status"
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        loading = req.status == RequestStatus.WAITING_FOR_KV
        req.status = status
        if status == RequestStatus.FINISHED_HELD:
            pass  # the engine detaches the blocks: they back a transfer lease now
        elif not loading:
            self.kv.free(req)
        self._release_slot(req)
        return req

    def finish_load(self, result: KVLoadResult) -> Request | None:
        """A load ended: the request waits again (first in line) with the loaded tokens
        computed, or, if it was aborted meanwhile, its blocks are freed now."""
        req = self.loading.pop(result.request_id, None)
        if req is None:
            return None
        if req.is_finished:
            self.kv.free(req)
            return None
        req.kv_ticket = None
        # At least the last token (the first output) is always computed here.
        req.num_computed_tokens = min(result.num_tokens, req.num_tokens - 1)
        if req.num_computed_tokens == 0:
            self.kv.free(req)  # nothing usable: a plain prefill from scratch
        req.status = RequestStatus.WAITING
        self._enqueue(req, first=True)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.loading)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _release_slot(self, req: Request) -> None:
        if req.request_id in self._in_runner:
            self._in_runner.discard(req.request_id)
            self._free_in_runner.add(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self._release_slot(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.runner_counts_stale = False  # it comes back as a new request, with its counts
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, first=True)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled = out.num_scheduled_tokens  # req_id -> tokens, in batch order
        preempted_any = False
        for req, behind in self._decodes_then_partials():
            if budget == 0:
                break
            if req.status is not _RUNNING:
                continue  # preempted earlier in this loop
            if req.num_output_tokens + req.num_output_placeholders >= req.max_new_tokens:
                continue  # async: its last token is in flight; another would be thrown away
            num_new = self._chunk(req, req.num_computed_tokens, min(behind, budget))
            assert num_new > 0, f"running request {req.request_id} has nothing to compute"
            # a draft follows the last token, which must be known: none for a token in flight
            draftable = self.drafter and behind == 1 and not req.num_output_placeholders
            draft = self.drafter.drafts(req, budget) if draftable else ()
            new_blocks = self.kv.allocate_slots(req, num_new + len(draft))
            if new_blocks is None and draft:  # a draft never costs a preemption
                draft = ()
                new_blocks = self.kv.allocate_slots(req, num_new)
            if new_blocks is None:
                preempted_any = True
                new_blocks = self._preempt_until_allocated(req, num_new, scheduled)
                if new_blocks is None:
                    continue  # req itself was preempted
            # The runner tracks computed counts itself; only blocks are news, and after a
            # step with a draft, the counts it could not know
            if new_blocks or req.runner_counts_stale:
                out.cached_requests.append(
                    CachedRequestData(
                        req.request_id, new_blocks, req.num_computed_tokens,
                        req.num_tokens if req.runner_counts_stale else None,
                    )
                )  # fmt: skip
                req.runner_counts_stale = False
            self._take(out, req, num_new + len(draft), samples=num_new == behind)
            if draft:
                out.spec_token_ids[req.request_id] = draft
                req.runner_counts_stale = True
            budget -= num_new + len(draft)

        share = self.kv.enable_prefix_caching and bool(self.waiting)
        # With nothing waiting the set goes unused, but building it forgets the prompts
        # cached or finished since, so none is kept past its step.
        in_flight = self._in_flight.hashes() if share or self._in_flight else set()
        held: list[Request] = []  # waiting for a prompt in flight: back to the front after
        while (
            self.waiting
            and budget > 0
            and not preempted_any
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted with a token in flight: re-admit once its value is known
            if req.kv_ticket is not None:
                if self._in_flight.should_wait(req, in_flight):
                    held.append(self.waiting.popleft())
                    self.num_prefix_waits += 1
                    continue
                spec = self._start_load(req)
                if spec is None:
                    if self._take_blocks_from_waiting(req):
                        continue
                    break
                out.kv_loads.append(spec)
                if share:
                    self._in_flight.admitted(req, in_flight)
                continue
            hit_blocks, num_hit = [], 0
            loaded = req.num_computed_tokens  # > 0: its KV was loaded into blocks it holds
            every = req.params.prompt_logprobs is not None or (
                req.pooling is not None and req.pooling.every_position
            )
            if not loaded and not every:  # those need every position
                if self._in_flight.should_wait(req, in_flight):
                    held.append(self.waiting.popleft())
                    self.num_prefix_waits += 1
                    continue
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            behind = req.num_tokens - num_hit - loaded
            if behind > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self._chunk(req, num_hit + loaded, min(behind, budget))
            if self.kv.allocate_slots(req, num_new, hit_blocks, num_hit) is None:
                if self._take_blocks_from_waiting(req):
                    continue
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit + loaded
            if num_hit:
                self.kv.restore_state(req)  # a hybrid's state at the hit, from its snapshot
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.queue_s < 0:
                req.queue_s = time.monotonic() - req.arrival_time
            out.new_requests.append(
                NewRequestData(
                    req_id=req.request_id,
                    token_ids=req.all_token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    block_ids=list(self.kv.get_block_ids(req.request_id)),
                    num_computed_tokens=req.num_computed_tokens,
                    params=req.params,
                    seed=req.seed,
                    stop_ids=self._suppressed_ids(req),
                    bad_words=req.bad_words,
                    grammar=req.grammar,
                    lora_name=req.lora_name,
                    pooling=req.pooling,
                    state_unit=self.kv.state_unit(req.request_id),
                )
            )
            self._in_runner.add(req.request_id)
            self._take(out, req, num_new, samples=num_new == behind)
            budget -= num_new
            if share:
                self._in_flight.admitted(req, in_flight)
        self.waiting.extendleft(reversed(held))

        out.finished_req_ids = self._free_in_runner
        self._free_in_runner = set()
        out.state_copies = self.kv.take_state_copies()
        return out

    def drafts_due(self) -> bool:
        """Async scheduling with a drafter: whether a running request whose last token is
        in flight would draft once it is known, judged by the tokens known so far (one
        short; `Drafter.likely`): text that repeats drafts from either. The engine then
        reads the step in flight before planning the next (runner/engine.py `step`)."""
        if self.drafter is None:
            return False
        return any(r.num_output_placeholders and self.drafter.likely(r) for r in self.running)

    def _chunk(self, req: Request, done: int, num_new: int) -> int:
        """`num_new` tokens from `done`, or, for a hybrid with prefix caching and chunked
        prefill, fewer so the chunk ends at the prompt's last block boundary, where its
        state is saved (runner/state_snapshots.py)."""
        if not self.config.enable_chunked_prefill:
            return num_new
        return self.kv.snapshot_cut(req, done, num_new)

    def _take(self, out: SchedulerOutput, req: Request, num_new: int, samples: bool) -> None:
        """Put `num_new` tokens of `req` in this step; they count as computed from now on.
        `samples`: they reach its last known token, so the step samples one for it, which
        async scheduling holds as a placeholder until the value reaches the host."""
        out.num_scheduled_tokens[req.request_id] = num_new
        done = req.num_computed_tokens
        req.num_computed_tokens = done + num_new
        if done < req.num_prompt_tokens:
            self.num_prompt_tokens_computed += min(num_new, req.num_prompt_tokens - done)
            self.kv.scheduled(req)  # a hybrid's prompt boundary: its state is saved
        elif self._decode_save_every and req.num_computed_tokens % self._decode_save_every == 0:
            self.kv.scheduled(req)  # a hybrid's decode reached a save point
        if samples and self.async_scheduling:
            req.num_output_placeholders += 1

    def _decodes_then_partials(self) -> Iterator[tuple[Request, int]]:
        """(request, tokens it is behind) of every running request: decodes (one behind)
        first, then partial prefills, each group in admission order. One pass over a
        snapshot (preemption edits `self.running` meanwhile) rather than a sort, which
        cost ~0.3 ms a step at 512 requests."""
        partials = []
        for req in tuple(self.running):
            behind = req.num_tokens_with_inflight - req.num_computed_tokens
            if behind > 1:
                partials.append((req, behind))
            else:
                yield req, behind
        yield from partials

    def _take_blocks_from_waiting(self, head: Request) -> bool:
        """Blocks ran out for `head` while nothing runs or loads, so nothing will free any;
        but loaded requests waiting in the queue hold blocks (a loaded prompt's blocks do
        not cover its first decoded token, so loads alone can fill the cache). Free the
        newest such request's blocks (it computes its prompt itself later) so the queue
        moves. False if there is none or something else will free blocks."""
        if self.running or self.loading:
            return False
        for req in reversed(self.waiting):
            if req is not head and req.num_computed_tokens > 0:
                self.kv.free(req)
                req.num_computed_tokens = 0
                return True
        return False

    def _start_load(self, req: Request) -> KVLoadSpec | None:
        """Blocks for the whole prompt (local prefix hits first), or None if they do not fit."""
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        if (
            self.kv.allocate_slots(req, req.num_prompt_tokens - num_hit, hit_blocks, num_hit)
            is None
        ):
            return None
        self.waiting.popleft()
        self.loading[req.request_id] = req
        req.status = RequestStatus.WAITING_FOR_KV
        if req.num_cached_tokens < 0:  # a pulled prompt's count came with its ticket
            req.num_cached_tokens = num_hit
        if req.queue_s < 0:  # so did its queue time
            req.queue_s = time.monotonic() - req.arrival_time
        num_full = req.num_prompt_tokens // self.kv.block_size
        return KVLoadSpec(
            request_id=req.request_id,
            block_ids=tuple(self.kv.get_block_ids(req.request_id)),
            num_local_tokens=num_hit,
            num_prompt_tokens=req.num_prompt_tokens,
            block_hashes=tuple(self.kv.block_hashes(req)[:num_full]),
            ticket=req.kv_ticket,
            state_unit=self.kv.state_unit(req.request_id),
        )

    def _preempt_until_allocated(
        self, req: Request, num_new: int, scheduled: dict[str, int]
    ) -> list[int] | None:
        """Blocks ran out for `num_new` tokens of `req`: preempt until they fit. Returns the
        new block ids, or None if `req` itself had to go. Victims are running requests not
        already in this step, never one whose blocks are published under an early ticket
        (`kv_pinned`; `req` itself never is): the most recently admitted, or under the
        priority policy the last in (priority, arrival) order, as vLLM picks them."""
        while True:
            candidates = (
                r
                for r in reversed(self.running)
                if r.request_id not in scheduled and not r.kv_pinned
            )
            if self.by_priority:
                victim = max(candidates, key=_priority_order, default=None)
            else:
                victim = next(candidates, None)
            assert victim is not None, "req itself is running and unscheduled"
            self._preempt(victim)
            if victim is req:
                return None
            blocks = self.kv.allocate_slots(req, num_new)
            if blocks is not None:
                return blocks

    @staticmethod
    def _suppressed_ids(req: Request) -> tuple[int, ...]:
        """Tokens the sampler must not emit before min_tokens outputs exist."""
        if req.params.min_tokens == 0:
            return ()
        eos = () if req.params.ignore_eos else req.eos_token_ids
        return tuple(dict.fromkeys([*eos, *req.params.stop_token_ids]))

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Record computed tokens and append sampled ones; returns requests that got a token
        (stop checks are the caller's). Requests finished meanwhile are skipped; a request
        preempted after this step was planned still receives its token. A drafted row's
        further tokens (`out.more_token_ids`) are the caller's to append, one at a time
        between stop checks; its rejected drafts are no longer counted as computed."""
        got_token = []
        # Bound once: this loop runs once per batch row (512 a step at full decode).
        requests, cache_blocks = self.requests, self.kv.cache_blocks
        drafts = so.spec_token_ids
        for req_id, token in zip(out.req_ids, out.sampled_token_ids, strict=True):
            req = requests.get(req_id)
            if req is None:
                continue
            if req.status is _RUNNING:
                draft = drafts.get(req_id) if drafts else None
                if draft is not None:
                    kept = len(out.more_token_ids.get(req_id, ()))
                    req.num_computed_tokens -= len(draft) - kept
                    self.num_drafts += 1
                    self.num_draft_tokens += len(draft)
                    self.num_accepted_tokens += kept
                    for i in range(kept):
                        self.num_accepted_per_pos[i] += 1
                cache_blocks(req, req.num_computed_tokens)
            if token is not None:
                if self.async_scheduling:
                    req.num_output_placeholders -= 1
                req.append_output_token(token)
                got_token.append(req)
        return got_token


def _priority_order(req: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority value first, then earlier arrival."""
    return req.params.priority, req.arrival_time
