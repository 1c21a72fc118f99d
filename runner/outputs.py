"""What the engine hands back: per-step deltas (workers) and whole outputs (offline API).

Shapes follow vLLM's `RequestOutput` / `CompletionOutput` / `Logprob` so that code
written against vLLM reads the same fields here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.runner.kv_hooks import KVHeld
from pdserve.runner.runner_output import TopLogprobs

# One position's logprobs: token id -> Logprob. Holds the chosen token and the top-k.
LogprobDict = dict[int, "Logprob"]


# slots: one RequestDelta per running request per step (512 a step at full decode) and one
# Logprob per top-k entry; slotted instances are smaller and quicker to build and read.
@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass(slots=True)
class RequestDelta:
    """What one engine step produced for one request (the worker-facing unit)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    new_logprobs: list[LogprobDict] | None = None
    # Set on the step that finished the prompt when prompt_logprobs was asked for.
    prompt_logprobs: list[LogprobDict | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # num_cached_tokens replaces what an earlier delta said: a decode worker whose KV load
    # failed computed the prompt itself, and reports what it found cached (`max` of the
    # deltas would keep the prefill side's count, which no longer holds)
    cached_revised: bool = False
    queue_s: float = 0.0  # on the first delta: seconds the prompt waited to be scheduled
    # Prefill role: the request left this engine with its prompt's blocks held.
    kv_held: KVHeld | None = None
    first_top_logprobs: TopLogprobs | None = None  # the raw row, for a transfer ticket
    embedding: list[float] | None = None  # an embedding request's pooled prompt

    @property
    def finished(self) -> bool:
        """True on a request's last delta from this engine."""
        return self.finish_reason is not None or self.kv_held is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobDict] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[LogprobDict | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `LLM.embed` result: one prompt's pooled vector."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (the raw logits with activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's `LLM.classify` result: one prompt's label probabilities."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's `LLM.score` result: one pair's score."""

    request_id: str
    outputs: ScoringOutput
    finished: bool = True
