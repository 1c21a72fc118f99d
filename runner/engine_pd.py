"""The engine's PD-role half: the prefill side that holds a prompt's KV blocks for a
puller, and the decode side that takes a request whose prompt ran elsewhere.

`Engine` (runner/engine.py) inherits this; the hooks it drives are runner/kv_hooks.py's.
Prefill role: `add_request(hold_kv=True)` ends a request with its blocks (and a hybrid
Mamba model's state unit) held (`_hold`), `_publish` tells a `KVPublisher` which held
prompts a step finishes (layer-wise early tickets), and `release_held` frees them. Decode
role:
`add_prefilled_request` queues a request for the `KVLoader` to fill, `add_first_token`
takes an early ticket's first token, and `_finish_load` applies a load's result.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from pdserve.runner.config import EngineConfig
from pdserve.runner.engine_state import Track
from pdserve.runner.kv_cache_manager import KVCacheManager
from pdserve.runner.kv_hooks import (
    KVHeld,
    KVLoader,
    KVLoadResult,
    KVPromptScheduled,
    KVPublisher,
)
from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.output_text import logprob_dict
from pdserve.runner.outputs import RequestDelta
from pdserve.runner.request import Request, RequestStatus
from pdserve.runner.request_checks import is_token
from pdserve.runner.runner_output import TopLogprobs
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.scheduler import Scheduler
from pdserve.runner.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class PDRoles:
    """Methods of `Engine` for the PD roles; the state they use is the engine's."""

    config: EngineConfig
    tokenizer: Any
    scheduler: Scheduler
    kv: KVCacheManager
    kv_loader: KVLoader | None
    kv_publisher: KVPublisher | None
    first_tokens_by_source: Counter[str]
    # prefill role: blocks (and a hybrid's state unit) under a lease
    _held: dict[str, tuple[tuple[int, ...], int | None]]
    _pending: list[RequestDelta]
    _tracks: dict[str, Track]

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token: int | None,
        first_logprobs: TopLogprobs | None,
        ticket: object,
        num_cached_tokens: int = 0,
        queue_s: float = 0.0,
        lora_request: LoRARequest | None = None,
    ) -> bool:
        """Decode role: a request whose prompt ran elsewhere. Its first token is emitted on
        the next step (stop checks applied here); if that token does not end it, the
        scheduler gives it blocks and the `KVLoader` fills them from `ticket`. Returns
        False when the first token already finished it (nothing will be loaded).
        `first_token=None` (an early ticket): the token comes later through
        `add_first_token` (relayed, or with the load result); a failed load leaves this
        engine to compute it. `num_cached_tokens`: the prompt tokens the prefill side
        found cached, which the request reports as its cached tokens; `queue_s`: the seconds
        its prompt waited there before it was scheduled (its queue time); `lora_request`:
        the adapter the prompt ran with, which the rest runs with too."""
        self.validate(request_id, prompt_token_ids, params)
        self._require_lm_head()
        self.require_paged("add_prefilled_request")
        if self.kv_loader is None:
            raise ValueError("add_prefilled_request needs an engine built with a kv_loader")
        if first_token is not None and not is_token(first_token, self.config.model.vocab_size):
            vocab = self.config.model.vocab_size
            raise ValueError(f"first_token must be an integer in [0, {vocab}) (got {first_token})")
        lora_name = self.load_lora(lora_request)
        req = self._new_request(
            request_id, prompt_token_ids, params, kv_ticket=ticket, lora_name=lora_name
        )
        req.num_cached_tokens = num_cached_tokens
        req.queue_s = queue_s
        if first_token is None:
            return True
        req.append_output_token(first_token)
        delta = self._process_token(req, first_logprobs)
        self._pending.append(delta)
        return not delta.finished

    def release_held(self, request_id: str) -> bool:
        """Prefill role: free the blocks a held request left behind (transfer done, lease
        expired or aborted). False if nothing was held under that id."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.kv.release(*held)
        return True

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _publish(self, so: SchedulerOutput) -> Callable[[int], None] | None:
        """Tell the publisher which held prompts this step finishes (their blocks cover the
        prompt now); returns its per-layer hook for the forward, or None. Those requests
        are pinned: no preemption may free blocks a puller is about to read."""
        scheduled = []
        for rid in so.num_scheduled_tokens:
            req = self.scheduler.requests[rid]
            if (
                req.hold_kv
                and not req.kv_pinned
                and req.num_computed_tokens >= req.num_prompt_tokens
            ):
                req.kv_pinned = True
                block_ids = tuple(self.kv.get_block_ids(rid))
                cached = max(req.num_cached_tokens, 0)
                scheduled.append(
                    KVPromptScheduled(
                        rid, block_ids, req.num_prompt_tokens, cached, max(req.queue_s, 0.0)
                    )
                )
        return self.kv_publisher.step_started(scheduled) if scheduled else None

    def add_first_token(
        self, request_id: str, token: int, logprobs: TopLogprobs | None, source: str = "relay"
    ) -> bool:
        """Decode role: the first token of an early ticket's request whose KV is still
        loading, emitted on the next step (its stop checks may end the request; the
        scheduler frees its blocks once the load ends). It comes either relayed apart from
        the KV (`source="relay"`: the router takes it from the prefill worker as soon as it
        is sampled, while the layers are still on their way) or at the end of the pull
        (`"pull"`), whichever is first; False, with nothing emitted, for the second, for a
        request not loading, and for a token outside the vocabulary (the request then
        computes its own)."""
        loading = self.scheduler.loading.get(request_id)
        if loading is None or loading.is_finished or loading.num_output_tokens != 0:
            return False
        if not is_token(token, self.config.model.vocab_size):
            logger.warning("first token %r of %s refused", token, request_id)
            return False
        loading.append_output_token(token)
        self._pending.append(self._process_token(loading, logprobs))
        self.first_tokens_by_source[source] += 1
        return True

    def _finish_load(self, result: KVLoadResult) -> None:
        if result.first_token is not None:
            self.add_first_token(
                result.request_id, result.first_token, result.first_logprobs, source="pull"
            )
        req = self.scheduler.finish_load(result)
        if req is None:
            return
        if result.error is not None:
            logger.warning(
                "KV load of %s failed: %s; %s",
                result.request_id,
                result.error,
                "the request ends with an error (policy fail)"
                if result.fail
                else f"its prompt is computed here from token {req.num_computed_tokens} "
                "(policy recompute)",
            )
            if not result.fail:  # the tokens that count as cached are those valid here
                req.num_cached_tokens = result.num_tokens
                track = self._tracks.get(req.request_id)
                if track is not None and track.first_delta_sent:
                    track.cached_revised = True
        if result.fail:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            self._tracks.pop(req.request_id, None)
            self._pending.append(
                RequestDelta(
                    req.request_id,
                    [],
                    "",
                    finish_reason="error",
                    stop_reason=result.error,
                    num_prompt_tokens=req.num_prompt_tokens,
                )
            )

    def _hold(self, req: Request, lp: TopLogprobs | None) -> RequestDelta:
        """Prefill role: the first token is sampled; keep the prompt's blocks, end here."""
        track = self._tracks.pop(req.request_id)
        self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_HELD)
        blocks, unit = self.kv.detach(req)
        block_ids = tuple(blocks)
        self._held[req.request_id] = (block_ids, unit)
        delta = RequestDelta(
            req.request_id,
            [req.output_token_ids[-1]],
            "",
            num_prompt_tokens=req.num_prompt_tokens,
            prompt_logprobs=track.prompt_logprobs,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            queue_s=max(req.queue_s, 0.0),
            kv_held=KVHeld(
                block_ids,
                req.num_prompt_tokens,
                tuple(self.kv.block_hashes(req)[: req.num_prompt_tokens // self.kv.block_size]),
                unit,
            ),
        )
        if lp is not None:
            delta.new_logprobs = [logprob_dict(self.tokenizer, lp)]
            delta.first_top_logprobs = lp
        return delta
