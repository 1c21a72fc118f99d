"""What a runner returns for one step, already on the host, in batch-row order."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TopLogprobs:
    """Logprobs of one position: column 0 is the chosen/target token, then the top-k."""

    token_ids: list[int]  # [k + 1]
    logprobs: list[float]  # [k + 1]
    rank: int  # rank of token_ids[0] in the full distribution (1 = most likely)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # None for a row that is still catching up on its prompt (its sample is discarded).
    sampled_token_ids: list[int | None]
    logprobs: list[TopLogprobs | None] = field(default_factory=list)
    # req_id -> (index in the prompt of the first target token, one entry per target)
    prompt_logprobs: dict[str, tuple[int, list[TopLogprobs]]] = field(default_factory=dict)
    # req_id -> its prompt's pooled vector (embedding requests, on the step that ends it)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: req_id -> the tokens a row yields after its first this step
    # (its accepted drafts' samples: runner/speculative/verify.py), with their logprobs
    # where the row asked for them
    more_token_ids: dict[str, list[int]] = field(default_factory=dict)
    more_logprobs: dict[str, list[TopLogprobs | None]] = field(default_factory=dict)


class ReadyHandle:
    """A step whose outputs are already on the host (the reference runner, CPU steps)."""

    def __init__(self, output: ModelRunnerOutput):
        self._output = output

    def get(self) -> ModelRunnerOutput:
        return self._output
