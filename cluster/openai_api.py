"""The OpenAI-compatible surface: request parsing and response shapes, nothing else.

Parsing turns a JSON body into a `ParsedRequest` (prompt token ids, `SamplingParams`,
stream options) or raises `ApiError` with OpenAI's error fields and an HTTP status.
Field names follow OpenAI (and vLLM where OpenAI is silent: `top_k`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `repetition_penalty`, `skip_special_tokens`,
`include_stop_str_in_output`). Unknown fields are ignored like OpenAI does; known ones
pdserve does not carry out are refused by name (cluster/unsupported.py). No field picks
workers or transfer parameters: nothing here reads routing from the client.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.structured.spec import StructuredOutputs

if TYPE_CHECKING:  # it imports this module
    from pdserve.cluster.reasoning.base import ReasoningParser
    from pdserve.cluster.tool_calls import ToolChoice


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
    # stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    continuous_usage: bool
    echo_logprobs: int | None  # completions: logprobs=k; chat: top_logprobs when logprobs
    # `echo`, put before the output: a completion's prompt; in chat the last message's
    # content when it has the reply's role (`chat_echo`), with no tokens or logprobs
    echo_text: str | None = None
    # vLLM's `prompt_logprobs` field was given: the response carries the prompt's logprobs.
    show_prompt_logprobs: bool = False
    # vLLM's `return_tokens_as_token_ids`: logprobs name tokens as "token_id:{id}".
    tokens_as_ids: bool = False
    role: str = "assistant"  # chat: the reply's role (`chat_role`)
    # chat: tools and tool_choice (cluster/tool_calls.py), None without tools
    tool_choice: ToolChoice | None = None
    # chat with `--reasoning-parser`: splits the reply's thinking from its answer
    # (cluster/reasoning_api.py); None otherwise
    reasoning: ReasoningParser | None = None


def typed(body: dict, name: str, types: tuple, default: Any = None) -> Any:
    """`body[name]` if it is one of `types` (a boolean never passes for a number), the
    default when absent or null; otherwise a 400 naming the field."""
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


def requested_max_tokens(body: dict, kind: str) -> int | None:
    """The output length the client asked for; None: up to the end of the context. As in
    vLLM: chat's `max_completion_tokens` (or `max_tokens`) may be left out, completions'
    `max_tokens` is 16 when left out and the rest of the context when null."""
    if kind == "chat":
        value = typed(body, "max_completion_tokens", (int,))
        if value is None:
            value = typed(body, "max_tokens", (int,))
    else:
        value = typed(body, "max_tokens", (int,), 16 if "max_tokens" not in body else None)
    if value is not None and value <= 0:
        raise ApiError(f"'max_tokens' must be at least 1, got {value}", param="max_tokens")
    return value


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, cap: int | None = None
) -> int:
    """The request's output budget: what it asked for, or the rest of the context, and no
    more than the server's cap (a generation config's max_new_tokens)."""
    room = max_model_len - prompt_len
    if room < 1 or (requested is not None and requested > room):
        asked = "" if requested is None else f" and max_tokens is {requested}"
        raise ApiError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len}{asked}",
            param="max_tokens" if room >= 1 else "messages",
            code="context_length_exceeded",
        )
    out = room if requested is None else requested
    return out if cap is None else min(out, cap)


def prompt_truncation(body: dict, max_model_len: int) -> int | None:
    """vLLM's `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: as many
    as the context holds); None when the field is absent or null."""
    k = typed(body, "truncate_prompt_tokens", (int,))
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if not 1 <= k <= max_model_len:
        raise ApiError(
            f"'truncate_prompt_tokens' must be -1 or in [1, {max_model_len}] (the model's "
            f"context), got {k}",
            param="truncate_prompt_tokens",
        )
    return k


def chat_messages(body: dict) -> list[dict]:
    """`messages` with each content as one string: a string, or an array of text parts
    (joined by newlines, as vLLM does); other parts are refused (the models are text only)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("each message needs a string 'role' and 'content'", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(_text_part(part) for part in content)
        if not isinstance(content, str):
            raise ApiError("each message needs a string 'role' and 'content'", param="messages")
        out.append({**m, "content": content})
    return out


def wants_echo(body: dict) -> bool:
    """Completions' `echo`: the prompt goes before each choice's text (and logprobs)."""
    return typed(body, "echo", (bool,), False)


def chat_role(body: dict) -> str:
    """The role of a chat reply (vLLM's rule): the assistant's, or with
    `add_generation_prompt: false` the last message's, whose turn the reply continues."""
    if typed(body, "add_generation_prompt", (bool,), True):
        return "assistant"
    return chat_messages(body)[-1]["role"]


def chat_echo(body: dict, role: str) -> str | None:
    """Chat's `echo` (vLLM's): the last message's content, put before each choice's, when
    that message has the reply's role, as when `continue_final_message` continues an
    answer the client began; None otherwise (nothing to join)."""
    if not wants_echo(body):
        return None
    last = chat_messages(body)[-1]
    return (last["content"] or None) if last["role"] == role else None


def _text_part(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(kind, str) and kind != "text":
        raise ApiError(
            f"content parts of type {kind!r} are not supported: the model reads text only",
            param="messages",
        )
    raise ApiError("a content part must be {'type': 'text', 'text': <string>}", param="messages")


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
    from pdserve.cluster.structured_api import parse_structured  # it raises ApiError (cycle)

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
        if rows is None:  # an echoed prompt's first token: nothing before it to predict it
            out["tokens"].append(decode(tok))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen, top = _split(tok, rows, k)
        out["tokens"].append(decode(tok))
        out["token_logprobs"].append(float(chosen[1]))
        out["top_logprobs"].append({decode(int(r[0])): float(r[1]) for r in top})
    return out


def prompt_logprobs_entries(rows: list, decode) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position (the first null), token id (a string
    key) -> logprob, rank and decoded token, the prompt's own token among them."""
    return [
        None
        if pos is None
        else {
            str(int(t)): {"logprob": float(lp), "rank": int(rank), "decoded_token": decode(int(t))}
            for t, lp, rank in pos
        }
        for pos in rows
    ]


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
