"""The body of a /v1/completions or /v1/chat/completions request, read into one
`ParsedRequest` per prompt (a completion may carry a batch of them).

Everything a request can be refused for is found here, before any worker sees it: the
model name, fields pdserve does not carry out, the prompt's length against the context,
sampling fields, token ids outside the vocabulary, a priority the server does not
schedule by, and a structured-output spec that does not compile (cluster/structured_api.py).
"""

from __future__ import annotations

from fastapi import Request

from pdserve.cluster.beam_routes import beam_params
from pdserve.cluster.chat_messages import chat_echo, chat_role
from pdserve.cluster.http_app import AppState, check_model, json_object, read_body
from pdserve.cluster.openai_api import (
    ApiError,
    ParsedRequest,
    prompt_truncation,
    requested_max_tokens,
    resolve_max_tokens,
    typed,
    wants_echo,
)
from pdserve.cluster.prompts import completion_prompts, off_loop, prompt_token_ids
from pdserve.cluster.reasoning.base import ReasoningParser
from pdserve.cluster.reasoning_api import (
    PROMPT_TAIL_TOKENS,
    reasoned_constraint,
    request_parser,
)
from pdserve.cluster.response_shapes import client_request_id
from pdserve.cluster.sampling_api import (
    check_logprobs,
    check_priority,
    check_token_ids,
    parse_sampling,
)
from pdserve.cluster.structured_api import compile_checked, structured_param
from pdserve.cluster.tool_calls import ToolChoice, parse_tool_choice
from pdserve.cluster.tool_parsers import PARSERS as TOOL_PARSERS
from pdserve.cluster.unsupported import refuse_unsupported


async def parse_request(state: AppState, request: Request, kind: str) -> list[ParsedRequest]:
    """One ParsedRequest per prompt (a completion may carry a batch of them)."""
    body = json_object(await read_body(request, state.max_body_bytes))
    return await parse_body(state, body, kind, getattr(request.state, "client_request_id", None))


async def parse_body(
    state: AppState, body: dict, kind: str, header_id: str | None = None
) -> list[ParsedRequest]:
    """`parse_request` on a body already read (the Responses API reads its own);
    `header_id`: the client's X-Request-Id, which goes before a `request_id` field."""
    lora_name = check_model(state, body)
    if state.pooling is not None and not state.pooling.generates:
        raise ApiError(f"this model does not generate text: it serves {state.pooling.serves()}")
    refuse_unsupported(body)
    request_id = header_id or client_request_id(
        body.get("request_id"), "'request_id'", "request_id"
    )
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError("'seed' must be an integer", param="seed")
    requested = requested_max_tokens(body, kind)
    echo_only = requested == 0  # the prompt alone: one token generated, then left out
    if echo_only:
        requested = 1
    if kind == "chat":
        ids = await off_loop(prompt_token_ids, body, kind, state.tokenizer, state.chat_template)
        prompts = [(ids, None)]
    else:
        prompts = await off_loop(completion_prompts, body, state.tokenizer, state.vocab_size)
    keep = prompt_truncation(body, state.max_model_len)
    if keep is not None:  # the last `keep` tokens; an echo shows what was kept
        prompts = [
            (ids, text) if len(ids) <= keep else
            (ids[-keep:], None if text is None else state.tokenizer.decode(ids[-keep:]))
            for ids, text in prompts
        ]  # fmt: skip
    api = state.api_defaults
    role = chat_role(body, api.response_role) if kind == "chat" else "assistant"
    # What `echo` puts before each output: chat's continued turn, a completion's prompt.
    chat_echoed = chat_echo(body, role) if kind == "chat" else None
    prompt_echoed = kind == "completion" and wants_echo(body)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean", param="stream")
    if opts and not stream:  # as OpenAI's API and vLLM refuse it
        raise ApiError("'stream_options' can only be given when 'stream' is true",
                       param="stream_options")  # fmt: skip
    if stream and body.get("prompt_logprobs") is not None:
        raise ApiError(
            "'prompt_logprobs' are not available when 'stream' is true (as in vLLM)",
            param="prompt_logprobs",
        )
    tools = parse_tool_choice(body, state.auto_tool_parser) if kind == "chat" else None
    constraint = tools.constraint() if tools is not None else None
    defaults, out = state.sampling_defaults, []
    for ids, text in prompts:
        max_tokens = resolve_max_tokens(
            requested, len(ids), state.max_model_len, defaults.get("max_tokens"),
            "messages" if kind == "chat" else "prompt",
        )  # fmt: skip
        params, k = parse_sampling(body, kind, seed, max_tokens, defaults, constraint)
        beam = beam_params(body, params, stream)
        check_token_ids(params, state.vocab_size)
        check_priority(params, state.scheduling_policy)
        check_logprobs(params, kind, api.max_logprobs)
        reasoning = request_parser(
            state.reasoning_parser, kind, params, _tail(state, ids), state.grammar_in_reasoning
        )
        params.structured_outputs = reasoned_constraint(reasoning, params.structured_outputs)
        if _reads_special_tokens(reasoning, tools):
            params.skip_special_tokens = False  # the parsers read the markers, then drop them
        out.append(
            ParsedRequest(
                kind,
                lora_name or state.model_name,
                ids,
                params,
                stream,
                api.force_include_usage or bool(opts.get("include_usage")),
                bool(
                    (api.force_include_usage or opts.get("include_usage"))
                    and opts.get("continuous_usage_stats")
                ),
                k,
                chat_echoed if kind == "chat" else (text if prompt_echoed else None),
                body.get("prompt_logprobs") is not None,
                typed(body, "return_tokens_as_token_ids", (bool,), api.tokens_as_ids),
                role,
                tools,
                reasoning,
                typed(body, "include_reasoning", (bool,), True),
                typed(body, "return_token_ids", (bool,), False),
                request_id,
                lora_name,
                beam,
                echo_only,
                api.prompt_tokens_details,
            )
        )
    spec = out[0].params.structured_outputs if out else None
    if spec is not None:  # a tool's parameters or the client's own constraint
        await compile_checked(spec, "tools" if constraint is not None else structured_param(body))
    return out


def _reads_special_tokens(reasoning: ReasoningParser | None, tools: ToolChoice | None) -> bool:
    """Whether the reply's parsers read special tokens (gpt-oss's harmony markers)."""
    if reasoning is not None and reasoning.needs_special_tokens:
        return True
    return bool(tools and tools.parser and TOOL_PARSERS[tools.parser].needs_special_tokens)


def _tail(state: AppState, ids: list[int]) -> str:
    """The text of a chat prompt's last tokens, read for a `<think>` left open."""
    if state.reasoning_parser is None:
        return ""
    return state.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:])
