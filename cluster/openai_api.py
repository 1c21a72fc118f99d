"""The OpenAI-compatible surface's request side: `ApiError`, `ParsedRequest`, and the
reading of the fields every route shares (typed fields, output length, prompt
truncation, echo), nothing else.

Parsing turns a JSON body into a `ParsedRequest` (prompt token ids, `SamplingParams`,
stream options) or raises `ApiError` with OpenAI's error fields and an HTTP status; chat
messages are read by cluster/chat_messages.py, the sampling fields by
cluster/sampling_api.py, and the pieces of a response body are built by
cluster/response_shapes.py.
Field names follow OpenAI (and vLLM where OpenAI is silent: `top_k`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `repetition_penalty`, `skip_special_tokens`,
`include_stop_str_in_output`). Unknown fields are ignored like OpenAI does; known ones
pdserve does not carry out are refused by name (cluster/unsupported.py). No field picks
workers or transfer parameters: nothing here reads routing from the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.runner.beam_search import BeamSearchParams
from pdserve.runner.sampling_params import MAX_LOGPROBS, SamplingParams

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


@dataclass(frozen=True)
class ApiDefaults:
    """vLLM's server-wide settings of the OpenAI requests and responses (`pdserve serve`
    flags)."""

    # --max-logprobs: the most logprobs a request may ask for a token (sampled or prompt)
    max_logprobs: int = MAX_LOGPROBS
    response_role: str = "assistant"  # --response-role: a chat reply's role
    # --return-tokens-as-token-ids: the default of the request field of that name
    tokens_as_ids: bool = False
    # --enable-force-include-usage: a stream ends with usage as if stream_options asked
    force_include_usage: bool = False
    # --enable-prompt-tokens-details: usage always has prompt_tokens_details (cached_tokens,
    # 0 included); without it, only where a prefix hit was cached
    prompt_tokens_details: bool = False


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
    # vLLM's `include_reasoning`: false parses the thinking off the answer and drops it
    include_reasoning: bool = True
    # vLLM's `return_token_ids`: choices carry their output's token ids, and the prompt's
    # come with them (chat: once, at the top; completions: per choice), in a stream on
    # each choice's first chunk
    return_token_ids: bool = False
    # the client's id for it (vLLM's X-Request-Id header, else its `request_id` field):
    # the response's id is then `chatcmpl-<id>` (or `cmpl-`), and the log names it so
    request_id: str | None = None
    # the served LoRA adapter its `model` named (`--lora-modules`); None: the base model
    lora_name: str | None = None
    # `use_beam_search`: the search's settings (cluster/beam_routes.py); None: sampling
    beam: BeamSearchParams | None = None
    # A completion's `echo` with `max_tokens` 0: each choice is the prompt (with its
    # logprobs) alone, finish_reason "length", no completion tokens. The worker generates
    # one token, which the response leaves out (`batch_stream.merged`).
    echo_only: bool = False
    # --enable-prompt-tokens-details: usage's prompt_tokens_details even with 0 cached
    prompt_details: bool = False


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
    `max_tokens` is 16 when left out and the rest of the context when null; 0 only for a
    completion with `echo` (OpenAI's legacy API and vLLM: the prompt, no output)."""
    if kind == "chat":
        value = typed(body, "max_completion_tokens", (int,))
        if value is None:
            value = typed(body, "max_tokens", (int,))
    else:
        value = typed(body, "max_tokens", (int,), 16 if "max_tokens" not in body else None)
    if value == 0 and kind == "completion" and wants_echo(body):
        return 0  # the prompt echoed alone (`ParsedRequest.echo_only`)
    if value is not None and value <= 0:
        raise ApiError(f"'max_tokens' must be at least 1, got {value}", param="max_tokens")
    return value


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    cap: int | None = None,
    prompt_field: str = "messages",
) -> int:
    """The request's output budget: what it asked for, or the rest of the context, and no
    more than the server's cap (a generation config's max_new_tokens). A prompt that
    fills the context is refused naming `prompt_field` (chat's `messages`, a completion's
    `prompt`)."""
    room = max_model_len - prompt_len
    if room < 1 or (requested is not None and requested > room):
        asked = "" if requested is None else f" and max_tokens is {requested}"
        raise ApiError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len}{asked}",
            param="max_tokens" if room >= 1 else prompt_field,
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


def wants_echo(body: dict) -> bool:
    """Completions' `echo`: the prompt goes before each choice's text (and logprobs)."""
    return typed(body, "echo", (bool,), False)
