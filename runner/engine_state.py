"""Small state the engine keeps beside the scheduler: host-time counters and, per live
request, what its output side has already handed out."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.runner.detokenizer import IncrementalDetokenizer
from pdserve.runner.outputs import LogprobDict


@dataclass
class StepStats:
    """Where the host's time goes: `cpu_s` is time in `step()` not spent waiting for the
    device; `wait_s` is time blocked on a step's outputs. `generation_tokens`: tokens
    sampled (a prefill worker's first tokens included). Async scheduling with drafts
    (runner/engine.py `step`): `spec_drains`, steps whose in-flight predecessor was read
    early because a request would draft; `spec_sync_steps`, steps with drafts, waited
    for where they were launched."""

    num_steps: int = 0
    cpu_s: float = 0.0
    wait_s: float = 0.0
    generation_tokens: int = 0
    spec_drains: int = 0
    spec_sync_steps: int = 0

    @property
    def cpu_ms_per_step(self) -> float:
        return 1e3 * self.cpu_s / max(self.num_steps, 1)


@dataclass
class Track:
    """Output-side state of one live request."""

    detok: IncrementalDetokenizer | None
    hold_back: int  # chars not streamed yet: a stop string may still start in them
    emitted: int = 0  # chars of output text already handed out in deltas
    first_delta_sent: bool = False
    cached_revised: bool = False  # the next delta reports a new cached count (engine_pd.py)
    prompt_logprobs: list[LogprobDict | None] | None = None
