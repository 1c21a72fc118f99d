"""/v1/completions and /v1/chat/completions (and SageMaker's /invocations, either of
them by its body): a parsed request per prompt, its choices
collected (or streamed as SSE) from the router, in OpenAI's response shapes.

A completion may carry a batch of prompts; every prompt runs `n` generations, and the
choices are numbered `prompt index * n + i` (cluster/batch_stream.py). The body is read
by cluster/completion_request.py, each choice shaped by cluster/completion_choices.py,
and a stream sent by cluster/completion_stream.py; a whole response's timing
(cluster/request_timing.py) and token counters are observed here (cluster/metrics.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.cluster.batch_stream import merged
from pdserve.cluster.beam_routes import beam_reply
from pdserve.cluster.completion_choices import chat_reply, choice
from pdserve.cluster.completion_request import parse_body, parse_request
from pdserve.cluster.completion_stream import sse_stream
from pdserve.cluster.disconnect import unless_disconnected
from pdserve.cluster.http_app import AppState, json_object, read_body
from pdserve.cluster.openai_api import ApiError, ParsedRequest
from pdserve.cluster.request_log import route_hook, watched
from pdserve.cluster.request_timing import RequestTiming
from pdserve.cluster.response_shapes import new_id, now, prompt_logprobs_entries, usage


def add_completion_routes(app: FastAPI, state: AppState) -> None:
    def decode_tok(t: int) -> str:
        return state.tokenizer.decode([t])

    async def run(reqs: list[ParsedRequest]):
        start = time.monotonic()
        req = reqs[0]  # the fields every prompt shares
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        cid = f"{prefix}-{req.request_id}" if req.request_id else new_id(prefix)
        if state.request_log is not None:
            state.request_log.received(cid, reqs)
        if req.beam is not None:
            return await beam_reply(state, reqs, cid, start)
        if req.stream:
            return StreamingResponse(
                sse_stream(state, reqs, cid, start, decode_tok), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )  # fmt: skip
        return await whole_reply(state, reqs, cid, start, decode_tok)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await unless_disconnected(
            request, run(await parse_request(state, request, "completion"))
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await unless_disconnected(request, run(await parse_request(state, request, "chat")))

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's inference route, as vLLM serves it: a body with `messages` is a chat
        completion, one with `prompt` a completion."""
        body = json_object(await read_body(request, state.max_body_bytes))
        kind = "chat" if "messages" in body else "completion" if "prompt" in body else None
        if kind is None:
            raise ApiError("an /invocations body needs 'messages' (a chat completion) or "
                           "'prompt' (a completion)")  # fmt: skip
        header_id = getattr(request.state, "client_request_id", None)
        return await unless_disconnected(request, run(await parse_body(state, body, kind,
                                                                       header_id)))  # fmt: skip


async def whole_reply(
    state: AppState,
    reqs: list[ParsedRequest],
    cid: str,
    start: float,
    decode_tok: Callable[[int], str],
) -> dict[str, Any]:
    """The whole (unstreamed) response: every choice collected from the router."""
    req = reqs[0]  # the fields every prompt shares
    kind = "chat.completion" if req.kind == "chat" else "text_completion"
    m, log = state.metrics, state.request_log
    total = len(reqs) * req.params.n
    texts, toks = [""] * total, [[] for _ in range(total)]
    echoed = [""] * total  # the start of texts[c] that chat's echo put there
    want_lps = req.echo_logprobs is not None
    lps: list[list | None] = [[] if want_lps else None for _ in range(total)]
    finish: list[str | None] = [None] * total
    stop: list[Any] = [None] * total
    echo_toks: list[list[int]] = [[] for _ in range(total)]
    prompt_rows: dict[int, list] = {}  # prompt index -> its prompt logprobs rows
    cached = completion_tokens = 0
    cached_by_choice: dict[int, int] = {}  # a revision (a recomputed prompt) replaces one
    timing = RequestTiming(start, total)
    with watched(log, cid, start):
        async for c, d, echo in merged(state.router, reqs, route_hook(log, cid)):
            timing.on_delta(m, c, d)
            if echo is not None:
                texts[c] += echo.text
                echoed[c] = echo.text
                echo_toks[c] = echo.token_ids
                if lps[c] is not None and echo.logprobs is not None:
                    lps[c] += echo.logprobs
            if d.prompt_logprobs is not None:
                prompt_rows.setdefault(c // req.params.n, d.prompt_logprobs)
            texts[c] += d.text
            toks[c] += d.token_ids
            completion_tokens += len(d.token_ids)
            if lps[c] is not None and d.logprobs:
                lps[c] += d.logprobs
            cached_by_choice[c] = d.cached_after(cached_by_choice.get(c, 0))
            cached = max(cached_by_choice.values())
            if d.finish_reason is not None:
                finish[c], stop[c] = d.finish_reason, d.stop_reason
        _check_errors(finish, stop)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    m.finish(req, timing, completion_tokens, prompt_tokens, finish)
    if log is not None:
        log.finished(cid, timing, completion_tokens, finish)
    choices = [
        choice(
            req,
            c,
            texts[c],
            echo_toks[c] + toks[c],
            lps[c],
            finish[c],
            stop[c],
            False,
            decode_tok,
        )
        for c in range(total)
    ]
    if req.kind == "chat" and (req.tool_choice is not None or req.reasoning is not None):
        choices = [
            chat_reply(req, body, echoed[c], texts[c][len(echoed[c]) :])
            for c, body in enumerate(choices)
        ]
    out = {
        "id": cid,
        "object": kind,
        "created": now(),
        "model": req.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached, req.prompt_details),
    }
    if req.show_prompt_logprobs:  # vLLM's places: per choice, or the chat response's
        entries = {p: prompt_logprobs_entries(rows, decode_tok) for p, rows in prompt_rows.items()}
        if req.kind == "chat":
            out["prompt_logprobs"] = entries.get(0)
        for c, body in enumerate(choices):
            if req.kind != "chat":
                body["prompt_logprobs"] = entries.get(c // req.params.n)
    if req.return_token_ids:  # vLLM's places: chat's prompt once, a completion's per choice
        if req.kind == "chat":
            out["prompt_token_ids"] = req.prompt_token_ids
        for c, body in enumerate(choices):
            body["token_ids"] = toks[c]
            if req.kind != "chat":
                body["prompt_token_ids"] = reqs[c // req.params.n].prompt_token_ids
    return out


def _check_errors(finish: list[str | None], why: list[Any]) -> None:
    """A 500 naming the worker's reason (as a stream's error event does) when any choice
    ended in an error."""
    for f, reason in zip(finish, why, strict=True):
        if f == "error":
            raise ApiError(f"the request failed in a worker: {reason}", 500, "server_error")
