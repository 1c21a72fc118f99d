"""The OpenAI-compatible surface: request parsing and response shapes, nothing else.

Parsing turns a JSON body into a `ParsedRequest` (prompt token ids, `SamplingParams`,
stream options) or raises `ApiError` with OpenAI's error fields and an HTTP status.
Field names follow OpenAI (and vLLM where OpenAI is silent: `top_k`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `repetition_penalty`). Unknown fields are ignored like
OpenAI does, except fields that would pick workers or transfer parameters: none exist,
and nothing here reads routing from the client.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.runner.sampling_params import SamplingParams


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo_logprobs: int | None  # completions: logprobs=k; chat: top_logprobs when logprobs


def _typed(body: dict, name: str, types: tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise ApiError(f"'{name}' must be {_names(types)}, got a boolean", param=name)
    if not isinstance(value, types):
        raise ApiError(f"'{name}' must be {_names(types)}, got {type(value).__name__}", param=name)
    return value


def _names(types: tuple) -> str:
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "an array", dict: "an object"}.get(t, t.__name__) for t in types)  # fmt: skip


def parse_sampling(body: dict, kind: str, seed: int) -> tuple[SamplingParams, int | None]:
    """SamplingParams from OpenAI fields; the seed is resolved by the caller (the router
    picks one when the client gives none, so prefill and decode sample alike)."""
    if kind == "chat":
        max_tokens = _typed(body, "max_completion_tokens", (int,))
        if max_tokens is None:
            max_tokens = _typed(body, "max_tokens", (int,), 16)
        want_lp = _typed(body, "logprobs", (bool,), False)
        top = _typed(body, "top_logprobs", (int,), 0)
        logprobs = top if want_lp else None
        if top and not want_lp:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        max_tokens = _typed(body, "max_tokens", (int,), 16)
        logprobs = _typed(body, "logprobs", (int,))
    if max_tokens <= 0:
        raise ApiError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    stop = _typed(body, "stop", (str, list))
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise ApiError("'stop' must be a string or an array of strings", param="stop")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_typed(body, "temperature", (int, float), 1.0)),
            top_p=float(_typed(body, "top_p", (int, float), 1.0)),
            top_k=_typed(body, "top_k", (int,), 0),
            min_p=float(_typed(body, "min_p", (int, float), 0.0)),
            seed=seed,
            stop=stop,
            stop_token_ids=_typed(body, "stop_token_ids", (list,)),
            ignore_eos=_typed(body, "ignore_eos", (bool,), False),
            min_tokens=_typed(body, "min_tokens", (int,), 0),
            logprobs=logprobs,
            presence_penalty=float(_typed(body, "presence_penalty", (int, float), 0.0)),
            frequency_penalty=float(_typed(body, "frequency_penalty", (int, float), 0.0)),
            repetition_penalty=float(_typed(body, "repetition_penalty", (int, float), 1.0)),
            n=_typed(body, "n", (int,), 1),
        )
    except (ValueError, TypeError) as e:
        raise ApiError(str(e)) from e
    return params, logprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _split(token_id: int, rows: list, k: int) -> tuple[list, list]:
    """(the sampled token's row, the top-k rows in rank order) of one position. Rows are
    [token_id, logprob, rank]: the top-k first, then the sampled token if not among them."""
    chosen = next(r for r in rows if int(r[0]) == token_id)
    top = sorted((r for r in rows if int(r[2]) <= k), key=lambda r: int(r[2]))
    return chosen, top


def completion_logprobs(token_ids: list[int], rows_per_token: list, k: int, decode) -> dict:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs (k per position)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for tok, rows in zip(token_ids, rows_per_token, strict=True):
        chosen, top = _split(tok, rows, k)
        out["tokens"].append(decode(tok))
        out["token_logprobs"].append(float(chosen[1]))
        out["top_logprobs"].append({decode(int(r[0])): float(r[1]) for r in top})
    return out


def chat_logprobs(token_ids: list[int], rows_per_token: list, k: int, decode) -> list[dict]:
    """OpenAI chat `logprobs.content` entries."""

    def entry(tok: int, logprob: float) -> dict:
        text = decode(tok)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}

    content = []
    for tok, rows in zip(token_ids, rows_per_token, strict=True):
        chosen, top = _split(tok, rows, k)
        item = entry(tok, chosen[1])
        item["top_logprobs"] = [entry(int(r[0]), r[1]) for r in top]
        content.append(item)
    return content
