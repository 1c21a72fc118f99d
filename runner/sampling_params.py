"""`SamplingParams`: what a caller may ask of one request, validated at construction.

Names and meanings follow vLLM's `SamplingParams` where they are shared, so an operator
moving from vLLM keeps their client code. Every rule broken raises `ValueError` naming
the rule; nothing is clamped silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.runner.structured.spec import StructuredOutputs

# The widest top-k logprobs we return per token; vLLM's default cap is 20.
MAX_LOGPROBS = 20
# Integers travel to the workers as msgpack and into int64 tensors there: every integer
# field (a seed, top_k, token ids, lengths, priority) must fit a signed 64-bit integer.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


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
    # Added to the logits of these token ids before sampling (OpenAI's `logit_bias`, in
    # [-100, 100]); the logprobs stay the model's own, as vLLM's default raw logprobs do.
    logit_bias: dict[int, float] | None = None
    # vLLM's: sample only among these ids (every other logit -inf before sampling).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to generate; the engine tokenizes them (runner/bad_words.py).
    bad_words: list[str] | None = None
    # Scheduling, not sampling: under scheduling_policy "priority" a lower value runs
    # first (vLLM's `priority`, which it passes beside the params; here it travels in them
    # so that every hop of a PD request carries it). Must be 0 under "fcfs".
    priority: int = 0
    # vLLM's `structured_outputs`: the output follows a JSON schema, a regex, one of a few
    # strings, or is any JSON object (runner/structured/). A map with one of those keys is
    # taken as well.
    structured_outputs: StructuredOutputs | None = None
    # Not sampling either: vLLM's `cache_salt`. Requests reuse each other's cached prefix
    # blocks only under the same salt (runner/block_hash.py `salt_root`), so tenants given
    # different salts cannot hit, and so time, each other's prompts.
    cache_salt: str | None = None
    # Filled in by the engine, not by callers: the stop strings as a list.
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.from_wire(self.structured_outputs)
        self._validate()
        if self.top_k < 0:
            self.top_k = 0
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words) or None

    def _validate(self) -> None:
        def rule(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        rule(
            _is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX,
            f"max_tokens must be an integer >= 1 and < 2**63 (got {self.max_tokens!r})",
        )
        rule(
            _is_number(self.temperature) and self.temperature >= 0.0,
            f"temperature must be >= 0 and finite (got {self.temperature})",
        )
        rule(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1] (got {self.top_p})")
        rule(
            _is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX,
            f"top_k must be an integer >= -1 and < 2**63; 0 or -1 disable it (got {self.top_k!r})",
        )
        rule(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1] (got {self.min_p})")
        rule(
            self.seed is None or _is_int64(self.seed),
            f"seed must be an integer in [-2**63, 2**63) or None (got {self.seed!r})",
        )
        rule(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
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
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0 and finite (got {self.repetition_penalty})",
        )
        rule(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})",
        )
        rule(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})",
        )
        rule(
            _is_int(self.n) and 1 <= self.n <= INT64_MAX,
            f"n must be an integer >= 1 and < 2**63 (got {self.n!r})",
        )
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        rule(
            all(isinstance(s, str) and s for s in stops),
            f"stop must be a non-empty string or a list of non-empty strings (got {self.stop!r})",
        )
        rule(
            all(map(_is_id, self.stop_token_ids or [])),
            f"stop_token_ids must be non-negative integer token ids (got {self.stop_token_ids!r})",
        )
        rule(
            _is_int64(self.priority),
            f"priority must be an integer in [-2**63, 2**63) (got {self.priority!r})",
        )
        bias = self.logit_bias
        rule(
            bias is None
            or (
                isinstance(bias, dict)
                and all(_is_id(t) for t in bias)
                and all(_is_number(b) and -100.0 <= b <= 100.0 for b in bias.values())
            ),
            "logit_bias must map non-negative integer token ids to numbers in [-100, 100] "
            f"(got {bias!r})",
        )
        allowed = self.allowed_token_ids
        rule(
            allowed is None
            or (isinstance(allowed, (list, tuple)) and allowed and all(map(_is_id, allowed))),
            "allowed_token_ids must be a non-empty list of non-negative integer token ids "
            f"(got {allowed!r})",
        )
        rule(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs must be a StructuredOutputs or a map with one of json, regex, "
            f"choice, json_object (got {self.structured_outputs!r})",
        )
        words = self.bad_words
        rule(
            words is None
            or (
                isinstance(words, (list, tuple))
                and all(isinstance(w, str) and w.strip() for w in words)
            ),
            f"bad_words must be a list of strings with a non-space character each (got {words!r})",
        )
        salt = self.cache_salt
        rule(
            salt is None or (isinstance(salt, str) and salt != "" and _is_utf8(salt)),
            f"cache_salt must be a non-empty string (valid UTF-8) or None (got {salt!r})",
        )

    @property
    def token_ids_used(self) -> list[int]:
        """The token ids the request names besides its prompt (logit_bias and
        allowed_token_ids), for the vocabulary check of whoever knows the vocabulary."""
        return [*(self.logit_bias or ()), *(self.allowed_token_ids or ())]

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


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_int64(x: object) -> bool:
    return _is_int(x) and INT64_MIN <= x <= INT64_MAX


def _is_id(t: object) -> bool:
    return _is_int(t) and 0 <= t <= INT64_MAX


def _is_utf8(s: str) -> bool:
    """False for a string with a lone surrogate (JSON's "\\ud800" reads as one): it has no
    UTF-8, so it could be neither hashed nor sent to a worker as msgpack."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
