"""Scheduler-side state of one request.

There is no prefill/decode phase flag: a request is `num_computed_tokens` catching up
with `num_tokens` (prompt + generated). Preemption resets `num_computed_tokens` to 0 and
keeps the generated tokens, so the request re-enters as a longer prompt.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.runner.pooling import PoolingSpec
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.structured.token_table import TokenGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks held, a loader is filling them
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # the KV it needed could not be had (policy `fail`)
    FINISHED_HELD = "finished_held"  # prefill role: left the engine, its blocks held

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
            RequestStatus.FINISHED_HELD,
        )

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the caller's seed or one derived from the engine seed
    eos_token_ids: tuple[int, ...] = ()
    # params.bad_words as token sequences (runner/bad_words.py), by the engine's tokenizer.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # params.structured_outputs lifted to the engine's tokenizer (runner/structured/).
    grammar: TokenGrammar | None = None
    # The LoRA adapter it runs with (runner/lora/), by name; None: the base model.
    lora_name: str | None = None
    # An embedding request (runner/pooling.py): its prompt is pooled, nothing is generated.
    pooling: PoolingSpec | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache at first schedule
    # Seconds from arrival to its first schedule (vLLM's queue time); -1 until then. A
    # pulled prompt's comes with its ticket: the wait on the worker that prefilled it.
    queue_s: float = -1.0
    num_preemptions: int = 0
    # Async scheduling: tokens sampled on the device but not yet seen by the host. The
    # scheduler counts them as present, so the next step is planned before they arrive.
    num_output_placeholders: int = 0
    # Speculative decoding (runner/speculative/): the runner counted its last step's draft
    # as kept, so the next step it is in tells the runner its real counts.
    runner_counts_stale: bool = False
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Chain hashes of this request's full blocks, filled in lazily by the KV cache manager.
    block_hashes: list[int] = field(default_factory=list)
    # PD roles (runner/kv_hooks.py). Prefill: stop after one token and hold the blocks.
    hold_kv: bool = False
    # Decode: the ticket to load the prompt's KV with; None once the load has ended.
    kv_ticket: object | None = None
    # Prefill, layer-wise early tickets: its prompt's blocks are published to pullers
    # before the request is held, so it is never a preemption victim (they read them).
    kv_pinned: bool = False
    # Fixed at creation (the prompt never changes: a preempted request re-prefills prompt +
    # output). Plain attributes, not properties: the step loops read them for every
    # request every step, and a property call costs ~0.1 us on Python 3.11.
    num_prompt_tokens: int = field(init=False)
    max_new_tokens: int = field(init=False)  # tokens this engine may sample for it

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_new_tokens = 1 if self.hold_kv else self.params.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_tokens_with_inflight(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
