"""`SamplingParams`: what a caller may ask of one request, validated at construction.

Names and meanings follow vLLM's `SamplingParams` where they are shared, so an operator
moving from vLLM keeps their client code. Every rule broken raises `ValueError` naming
the rule; nothing is clamped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The widest top-k logprobs we return per token; vLLM's default cap is 20.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Filled in by the engine, not by callers: the stop strings as a list.
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.top_k < 0:
            self.top_k = 0
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _validate(self) -> None:
        def rule(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        rule(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})",
        )
        rule(self.temperature >= 0.0, f"temperature must be >= 0 (got {self.temperature})")
        rule(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1] (got {self.top_p})")
        rule(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be an integer >= -1; 0 or -1 disable it (got {self.top_k!r})",
        )
        rule(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1] (got {self.min_p})")
        rule(
            self.seed is None or isinstance(self.seed, int),
            f"seed must be an integer or None (got {self.seed!r})",
        )
        rule(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0 (got {self.min_tokens!r})",
        )
        rule(
            self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens (got {self.min_tokens} > {self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            rule(
                v is None or (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS),
                f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (got {v!r})",
            )
        rule(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0 (got {self.repetition_penalty})",
        )
        rule(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})",
        )
        rule(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})",
        )
        rule(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1 (got {self.n!r})")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        rule(
            all(isinstance(s, str) and s for s in stops),
            f"stop must be a non-empty string or a list of non-empty strings (got {self.stop!r})",
        )
        rule(
            all(isinstance(t, int) and t >= 0 for t in (self.stop_token_ids or [])),
            f"stop_token_ids must be non-negative integers (got {self.stop_token_ids!r})",
        )

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
