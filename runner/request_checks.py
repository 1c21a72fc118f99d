"""What a request must be before an engine queues it: each rule raises naming itself.

The engine calls these before anything is queued (runner/engine.py), so a bad request
changes nothing and disturbs no other. They read the engine's configuration and
tokenizer, never its state, except for the ids of the live requests.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from pdserve.runner.bad_words import bad_word_ids
from pdserve.runner.config import EngineConfig
from pdserve.runner.sampling_params import SamplingParams


def check_request(
    config: EngineConfig,
    tokenizer: Any,  # None: the model directory has no tokenizer
    live_ids: Container[str],
    request_id: str,
    prompt_token_ids: list[int],
    params: Any,
) -> None:
    """Raise ValueError/TypeError naming the rule the request breaks."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams (got {type(params).__name__})")
    if request_id in live_ids:
        raise ValueError(f"request_id {request_id!r} is already in use by a live request")
    if params.n != 1:
        raise ValueError(
            f"the engine runs n=1 requests (got n={params.n}); fan out "
            "with runner.parallel_sampling first"
        )
    n, limit, vocab = len(prompt_token_ids), config.model.max_model_len, config.model.vocab_size
    if n == 0:
        raise ValueError("prompt must contain at least one token (got an empty prompt)")
    if n > limit:
        raise ValueError(f"prompt is {n} tokens, longer than max_model_len={limit}")
    bad = [t for t in prompt_token_ids if not is_token(t, vocab)]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}) (got {bad[:3]})")
    bad = [t for t in params.token_ids_used if not is_token(t, vocab)]
    if bad:
        raise ValueError(
            f"logit_bias and allowed_token_ids must name token ids in [0, {vocab}) (got {bad[:3]})"
        )
    if params.priority != 0 and config.scheduler.policy != "priority":
        raise ValueError(
            f"priority {params.priority} needs scheduling_policy='priority' (this engine "
            f"schedules {config.scheduler.policy}, where every request has priority 0)"
        )
    if params.stop_strings and tokenizer is None:
        # Logprobs work without one (decoded_token is None); stop strings cannot.
        raise ValueError("stop strings need a tokenizer; this model directory has none")
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model directory has none")
        ids = [t for seq in bad_word_ids(tokenizer, params.bad_words) for t in seq]
        if any(not is_token(t, vocab) for t in ids):
            raise ValueError(
                f"bad_words tokenize to ids outside the model's vocabulary [0, {vocab})"
            )


def is_token(token: object, vocab_size: int) -> bool:
    """A token id of this vocabulary (an int, not a bool)."""
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size
