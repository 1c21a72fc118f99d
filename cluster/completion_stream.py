"""A completion or chat response streamed as SSE (`stream: true`), in OpenAI's chunk
shapes, relayed from the router as the tokens arrive.

Each choice's pieces go out as they come; with tools or a reasoning parser a piece may
be held back until it is known to be a call, reasoning or answer text (cluster/tool_calls.py,
cluster/auto_tools.py, cluster/reasoning_api.py). Each delta's timing goes to the
request's `RequestTiming` (cluster/request_timing.py). A worker's error ends the stream with an
error event and `[DONE]`: the 200 has already gone.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pdserve.cluster.auto_tools import AutoToolStream
from pdserve.cluster.batch_stream import merged
from pdserve.cluster.completion_choices import choice
from pdserve.cluster.http_app import AppState
from pdserve.cluster.openai_api import ApiError, ParsedRequest
from pdserve.cluster.reasoning_api import ReasoningSplits, with_reasoning
from pdserve.cluster.request_log import route_hook, watched
from pdserve.cluster.request_timing import RequestTiming
from pdserve.cluster.response_shapes import now, usage
from pdserve.cluster.tool_calls import ToolStream


async def sse_stream(
    state: AppState,
    reqs: list[ParsedRequest],
    cid: str,
    start: float,
    decode_tok: Callable[[int], str],
) -> AsyncIterator[str]:
    """The response's SSE events: its chunks (`chunk_stream`), an error event if a worker
    fails, then `[DONE]`."""
    try:
        async for body in chunk_stream(state, reqs, cid, start, decode_tok):
            yield _sse(body)
    except ApiError as e:
        yield _sse(e.body())
    yield "data: [DONE]\n\n"


async def chunk_stream(
    state: AppState,
    reqs: list[ParsedRequest],
    cid: str,
    start: float,
    decode_tok: Callable[[int], str],
) -> AsyncIterator[dict]:
    """The response's chunks: chat's role chunks, a chunk per piece of each choice (tool
    calls and reasoning split off as they become known), the usage chunk when asked for;
    an ApiError when a worker fails."""
    req = reqs[0]
    chunk_kind = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    created, m, log = now(), state.metrics, state.request_log
    completion_tokens, cached = 0, 0
    cached_by_choice: dict[int, int] = {}  # a revision (a recomputed prompt) replaces one
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    reasons: list[str | None] = [None] * (len(reqs) * req.params.n)
    timing = RequestTiming(start, len(reasons))
    tc = req.tool_choice
    tools: ToolStream | AutoToolStream | None = None
    if req.kind == "chat" and tc is not None and tc.kind != "none":
        tools = AutoToolStream(tc) if tc.kind == "auto" else ToolStream(tc)
    splits = ReasoningSplits(req.reasoning) if req.reasoning is not None else None

    def chunk(choices: list[dict], final_usage: bool = False) -> dict:
        body = {
            "id": cid, "object": chunk_kind, "created": created, "model": req.model,
            "choices": choices,
        }  # fmt: skip
        if final_usage or req.continuous_usage:  # vLLM's continuous_usage_stats: so far
            body["usage"] = usage(prompt_tokens, completion_tokens, cached, req.prompt_details)
        return body

    if req.kind == "chat":
        for i in range(req.params.n):
            head = {
                "index": i,
                "delta": {"role": req.role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            first = chunk([head])
            if req.return_token_ids and i == 0:  # vLLM's: the prompt's, on the first chunk
                first["prompt_token_ids"] = req.prompt_token_ids
            yield first
    started: set[int] = set()  # choices that have sent a chunk
    with watched(log, cid, start):
        async for c, d, echo in merged(state.router, reqs, route_hook(log, cid)):
            timing.on_delta(m, c, d)
            completion_tokens += len(d.token_ids)
            cached_by_choice[c] = d.cached_after(cached_by_choice.get(c, 0))
            cached = max(cached_by_choice.values())
            if d.finish_reason is not None:
                reasons[c] = d.finish_reason
            if d.finish_reason == "error":
                raise ApiError(
                    f"the request failed in a worker: {d.stop_reason}", 500, "server_error"
                )
            # The generated piece; with a reasoning parser, its answer's part.
            generated, reasoning = d.text, ""
            if splits is not None:
                step = splits.feed(c, d.text, d.finish_reason is not None)
                # `include_reasoning: false`: the thinking is parsed off and not sent.
                generated = step.content
                reasoning = step.reasoning if req.include_reasoning else ""
            text, ids = generated, d.token_ids
            rows = d.logprobs if req.echo_logprobs is not None and d.logprobs else None
            if echo is not None:
                text, ids = echo.text + text, echo.token_ids + ids
                if rows is not None and echo.logprobs is not None:
                    rows = echo.logprobs + rows
            if not ids and not text and not reasoning and d.finish_reason is None:
                continue
            body = choice(req, c, text, ids, rows, d.finish_reason, d.stop_reason, True, decode_tok)
            sent: dict | None = body
            if tools is not None:
                echoed = echo.text if echo is not None else ""
                sent = tools.delta(c, body, echoed, generated, d.finish_reason)
            if splits is not None:
                sent = with_reasoning(sent, body, reasoning)
            if req.return_token_ids:
                sent = _with_token_ids(sent, req, reqs, c, d.token_ids, c not in started)
            if sent is None:
                continue
            started.add(c)
            yield chunk([sent])
    m.finish(req, timing, completion_tokens, prompt_tokens, reasons)
    if log is not None:
        log.finished(cid, timing, completion_tokens, reasons)
    if req.include_usage:
        yield chunk([], final_usage=True)


def _with_token_ids(
    sent: dict | None,
    req: ParsedRequest,
    reqs: list[ParsedRequest],
    c: int,
    token_ids: list[int],
    first: bool,
) -> dict | None:
    """vLLM's `return_token_ids` in a stream: each chunk's choice carries the tokens it
    came from, even where a parser holds their text back (then with an empty delta), and
    a completion choice's first chunk carries its prompt's."""
    if sent is None:
        if not token_ids:
            return None
        sent = {"index": c, "delta": {}, "logprobs": None, "finish_reason": None}
    sent["token_ids"] = token_ids
    if first and req.kind != "chat":
        sent["prompt_token_ids"] = reqs[c // req.params.n].prompt_token_ids
    return sent


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
