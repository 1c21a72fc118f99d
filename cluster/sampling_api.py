"""The sampling fields of an OpenAI request, read into `SamplingParams`.

`parse_sampling` takes OpenAI's names (and vLLM's where OpenAI is silent) with the
server's generation defaults under them; SamplingParams' own rules come back as a 400
naming the field. The checks that need the server (its scheduling policy, the model's
vocabulary) run after parsing, before a request reaches a worker. The seed and the
output length are the caller's to resolve (cluster/openai_api.py `resolve_max_tokens`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from pdserve.cluster.openai_api import ApiError, typed, wants_echo
from pdserve.cluster.structured_api import parse_structured
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.structured.spec import StructuredOutputs


def parse_sampling(
    body: dict,
    kind: str,
    seed: int | None,
    max_tokens: int,
    defaults: dict | None = None,
    tool_constraint: StructuredOutputs | None = None,
) -> tuple[SamplingParams, int | None]:
    """SamplingParams from OpenAI fields; a field left out takes the server's default
    (`defaults`, runner/generation_defaults.py), then OpenAI's. The seed is resolved by
    the caller (the router picks one when the client gives none, so prefill and decode
    sample alike), and so is `max_tokens` (`resolve_max_tokens`). `tool_constraint`: what
    a chat's tool_choice makes the reply follow (cluster/tool_calls.py)."""
    defaults = defaults or {}

    def number(name: str, openai_default: float) -> float:
        return float(typed(body, name, (int, float), defaults.get(name, openai_default)))

    if kind == "chat":
        want_lp = typed(body, "logprobs", (bool,), False)
        top = typed(body, "top_logprobs", (int,), 0)
        logprobs = top if want_lp else None
        if top and not want_lp:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        prompt_logprobs = typed(body, "prompt_logprobs", (int,))
    else:
        logprobs = typed(body, "logprobs", (int,))
        # `echo` with logprobs: the prompt's tokens get theirs too (vLLM's and the legacy
        # OpenAI API's rule; how lm-eval's loglikelihood scores a continuation).
        prompt_logprobs = typed(body, "prompt_logprobs", (int,))
        if prompt_logprobs is None and wants_echo(body):
            prompt_logprobs = logprobs
    structured = parse_structured(body)
    if tool_constraint is not None:
        if structured is not None:
            raise ApiError(
                "'tool_choice' required or named already constrains the reply; leave out "
                "response_format, structured_outputs and guided_*",
                param="tool_choice",
            )
        structured = tool_constraint
    stop = typed(body, "stop", (str, list))
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise ApiError("'stop' must be a string or an array of strings", param="stop")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=number("temperature", 1.0),
            top_p=number("top_p", 1.0),
            top_k=typed(body, "top_k", (int,), defaults.get("top_k", 0)),
            min_p=number("min_p", 0.0),
            seed=seed,
            stop=stop,
            stop_token_ids=typed(body, "stop_token_ids", (list,)),
            ignore_eos=typed(body, "ignore_eos", (bool,), False),
            min_tokens=typed(body, "min_tokens", (int,), 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=number("presence_penalty", 0.0),
            frequency_penalty=number("frequency_penalty", 0.0),
            repetition_penalty=number("repetition_penalty", 1.0),
            n=_n(body),
            skip_special_tokens=typed(body, "skip_special_tokens", (bool,), True),
            include_stop_str_in_output=typed(body, "include_stop_str_in_output", (bool,), False),
            logit_bias=_logit_bias(body),
            priority=typed(body, "priority", (int,), 0),
            allowed_token_ids=typed(body, "allowed_token_ids", (list,)),
            bad_words=typed(body, "bad_words", (list,)),
            structured_outputs=structured,
            cache_salt=typed(body, "cache_salt", (str,)),
        )
    except (ValueError, TypeError) as e:
        # SamplingParams' rules start with the field they break: name it as `param`.
        field = str(e).split(" ", 1)[0]
        raise ApiError(str(e), param=field if field in _PARAM_NAMES else None) from e
    return params, logprobs


_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams) if f.init)

# The most completions one HTTP request may ask for per prompt: OpenAI's own bound (vLLM
# sets none). Each is a sequence of its own on a decode worker; the offline API, where
# the caller owns the machine, has no such bound.
MAX_N = 128


def _n(body: dict) -> int:
    n = typed(body, "n", (int,), 1)
    if n > MAX_N:
        raise ApiError(f"'n' must be at most {MAX_N} (OpenAI's bound), got {n}", param="n")
    return n


def _logit_bias(body: dict) -> dict[int, Any] | None:
    """OpenAI's `logit_bias`: an object from token ids (as strings, JSON keys are) to a
    bias; SamplingParams checks the biases' range."""
    bias = typed(body, "logit_bias", (dict,))
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(f"'logit_bias' keys must be token ids (got {key!r})", param="logit_bias")
        out[int(key)] = value
    return out


def check_priority(params: SamplingParams, policy: str) -> None:
    """vLLM's rule: a `priority` other than 0 needs a server scheduling by priority."""
    if params.priority != 0 and policy != "priority":
        raise ApiError(
            f"'priority' {params.priority} needs a server started with --scheduling-policy "
            f"priority (this one schedules {policy})",
            param="priority",
        )


def check_logprobs(params: SamplingParams, kind: str, limit: int) -> None:
    """vLLM's `--max-logprobs`: a request may ask for at most `limit` logprobs a token,
    sampled or of the prompt."""
    asked = (("top_logprobs" if kind == "chat" else "logprobs", params.logprobs),
             ("prompt_logprobs", params.prompt_logprobs))  # fmt: skip
    for name, value in asked:
        if value is not None and value > limit:
            raise ApiError(
                f"'{name}' {value} is over this server's limit of {limit} (--max-logprobs)",
                param=name,
            )


def check_token_ids(params: SamplingParams, vocab_size: int | None) -> None:
    """A 400 for a token id outside the model's vocabulary in logit_bias or
    allowed_token_ids, before the request reaches a worker."""
    check_vocab("logit_bias", list(params.logit_bias or ()), vocab_size)
    check_vocab("allowed_token_ids", params.allowed_token_ids or [], vocab_size)


def check_vocab(name: str, ids: list[int], vocab_size: int | None) -> None:
    """A 400 naming field `name` when one of `ids` is outside the model's vocabulary
    (nothing to check when the vocabulary size is unknown)."""
    bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            f"'{name}': token ids must be in [0, {vocab_size}), the model's vocabulary "
            f"(got {bad[:3]})",
            param=name,
        )
