"""/v1/completions and /v1/chat/completions: a parsed request per prompt, its choices
collected (or streamed as SSE) from the router, in OpenAI's response shapes.

A completion may carry a batch of prompts; every prompt runs `n` generations, and the
choices are numbered `prompt index * n + i` (cluster/batch_stream.py). Latency and token
counters are observed here (cluster/metrics.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.cluster.auto_tools import AutoToolStream, auto_reply
from pdserve.cluster.batch_stream import merged
from pdserve.cluster.chat_messages import chat_echo, chat_role
from pdserve.cluster.disconnect import unless_disconnected
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
from pdserve.cluster.reasoning_api import (
    PROMPT_TAIL_TOKENS,
    ReasoningSplits,
    request_parser,
    split_message,
    with_reasoning,
)
from pdserve.cluster.request_log import RequestLog
from pdserve.cluster.response_shapes import (
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    prompt_logprobs_entries,
    usage,
)
from pdserve.cluster.sampling_api import check_priority, check_token_ids, parse_sampling
from pdserve.cluster.structured_api import compile_checked, structured_param
from pdserve.cluster.tool_calls import ToolStream, parse_tool_choice
from pdserve.cluster.unsupported import refuse_unsupported


def add_completion_routes(app: FastAPI, state: AppState) -> None:
    async def parse(request: Request, kind: str) -> list[ParsedRequest]:
        """One ParsedRequest per prompt (a completion may carry a batch of them)."""
        body = json_object(await read_body(request, state.max_body_bytes))
        check_model(state, body)
        refuse_unsupported(body)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ApiError("'seed' must be an integer", param="seed")
        requested = requested_max_tokens(body, kind)
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
        role = chat_role(body) if kind == "chat" else "assistant"
        # What `echo` puts before each output: chat's continued turn, a completion's prompt.
        chat_echoed = chat_echo(body, role) if kind == "chat" else None
        prompt_echoed = kind == "completion" and wants_echo(body)
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError("'stream' must be a boolean", param="stream")
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
                requested, len(ids), state.max_model_len, defaults.get("max_tokens")
            )
            params, k = parse_sampling(body, kind, seed, max_tokens, defaults, constraint)
            check_token_ids(params, state.vocab_size)
            check_priority(params, state.scheduling_policy)
            out.append(
                ParsedRequest(
                    kind,
                    state.model_name,
                    ids,
                    params,
                    stream,
                    bool(opts.get("include_usage")),
                    bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
                    k,
                    chat_echoed if kind == "chat" else (text if prompt_echoed else None),
                    body.get("prompt_logprobs") is not None,
                    typed(body, "return_tokens_as_token_ids", (bool,), False),
                    role,
                    tools,
                    request_parser(state.reasoning_parser, kind, params, tail(ids)),
                )
            )
        spec = out[0].params.structured_outputs if out else None
        if spec is not None:  # a tool's parameters or the client's own constraint
            await compile_checked(
                spec, "tools" if constraint is not None else structured_param(body)
            )
        return out

    def tail(ids: list[int]) -> str:
        """The text of a chat prompt's last tokens, read for a `<think>` left open."""
        if state.reasoning_parser is None:
            return ""
        return state.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:])

    def decode_tok(t: int) -> str:
        return state.tokenizer.decode([t])

    def token_id(t: int) -> str:
        return f"token_id:{t}"

    def choice(
        req: ParsedRequest, index: int, text: str, toks, lps, finish, stop_reason, delta: bool
    ):
        name = token_id if req.tokens_as_ids else decode_tok
        if req.kind == "chat":
            body: dict[str, Any] = {"index": index}
            if delta:
                body["delta"] = {"content": text} if text or toks else {}
            else:
                body["message"] = {"role": req.role, "content": text}
            body["logprobs"] = (
                {"content": chat_logprobs(toks, lps, req.echo_logprobs or 0, name)}
                if lps is not None
                else None
            )
        else:
            body = {"index": index, "text": text}
            body["logprobs"] = (
                completion_logprobs(toks, lps, req.echo_logprobs or 0, name)
                if lps is not None
                else None
            )
        body["finish_reason"] = _finish(finish)
        if finish is not None and stop_reason is not None:
            body["stop_reason"] = stop_reason
        return body

    def chat_reply(req: ParsedRequest, body: dict, echoed: str, text: str) -> dict:
        """A whole chat choice: its reasoning split off (`--reasoning-parser`), then the
        tool calls of its answer."""
        reasoning = None
        if req.reasoning is not None:
            reasoning, text = split_message(req.reasoning, body, echoed, text)
        if req.tool_choice is not None:
            body = tool_reply(req, body, echoed, text)
        if req.reasoning is not None:
            body["message"]["reasoning"] = reasoning
        return body

    def tool_reply(req: ParsedRequest, body: dict, echoed: str, text: str) -> dict:
        """A whole chat choice with tools: under auto, the calls the parser reads in the
        generated `text`; under required or named, its text as tool calls (content null,
        finish_reason tool_calls), or as text when it is not whole."""
        if req.tool_choice.kind == "auto":
            return auto_reply(req.tool_choice, body, echoed, text)
        calls = req.tool_choice.calls(echoed + text)
        if calls is not None:
            body["message"] = {"role": req.role, "content": None, "tool_calls": calls}
            if body["finish_reason"] == "stop":
                body["finish_reason"] = "tool_calls"
        return body

    async def run(reqs: list[ParsedRequest]):
        start = time.monotonic()
        req = reqs[0]  # the fields every prompt shares
        kind = "chat.completion" if req.kind == "chat" else "text_completion"
        cid = new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        m, log = state.metrics, state.request_log
        if log is not None:
            log.received(cid, reqs)
        if req.stream:
            return StreamingResponse(
                sse(reqs, cid, start), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )  # fmt: skip
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
        first_token = None
        with _watched(log, cid, start):
            async for c, d, echo in merged(state.router, reqs, _routes(log, cid)):
                if d.token_ids and first_token is None:
                    first_token = time.monotonic()
                    m.ttft.observe(first_token - start)
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
                cached = max(cached, d.num_cached_tokens)
                if d.finish_reason is not None:
                    finish[c], stop[c] = d.finish_reason, d.stop_reason
            _check_errors(finish, stop)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        m.finish(req, start, completion_tokens, prompt_tokens, finish)
        if log is not None:
            log.finished(cid, start, first_token, completion_tokens, finish)
        choices = [
            choice(req, c, texts[c], echo_toks[c] + toks[c], lps[c], finish[c], stop[c], False)
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
            "model": state.model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached),
        }
        if req.show_prompt_logprobs:  # vLLM's places: per choice, or the chat response's
            entries = {
                p: prompt_logprobs_entries(rows, decode_tok) for p, rows in prompt_rows.items()
            }
            if req.kind == "chat":
                out["prompt_logprobs"] = entries.get(0)
            for c, body in enumerate(choices):
                if req.kind != "chat":
                    body["prompt_logprobs"] = entries.get(c // req.params.n)
        return out

    async def sse(reqs: list[ParsedRequest], cid: str, start: float):
        req = reqs[0]
        chunk_kind = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        created, m, log = now(), state.metrics, state.request_log
        completion_tokens, first_token, last = 0, None, None
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        reasons: list[str | None] = [None] * (len(reqs) * req.params.n)
        tc = req.tool_choice
        tools: ToolStream | AutoToolStream | None = None
        if req.kind == "chat" and tc is not None and tc.kind != "none":
            tools = AutoToolStream(tc) if tc.kind == "auto" else ToolStream(tc)
        splits = ReasoningSplits(req.reasoning) if req.reasoning is not None else None

        def chunk(choices: list[dict], final_usage: bool = False) -> str:
            body = {
                "id": cid, "object": chunk_kind, "created": created, "model": state.model_name,
                "choices": choices,
            }  # fmt: skip
            if final_usage or req.continuous_usage:  # vLLM's continuous_usage_stats: so far
                body["usage"] = usage(prompt_tokens, completion_tokens)
            return _sse(body)

        if req.kind == "chat":
            for i in range(req.params.n):
                head = {
                    "index": i,
                    "delta": {"role": req.role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield chunk([head])
        try:
            with _watched(log, cid, start):
                async for c, d, echo in merged(state.router, reqs, _routes(log, cid)):
                    t = time.monotonic()
                    if d.token_ids:
                        if first_token is None:
                            first_token = t
                            m.ttft.observe(t - start)
                        elif last is not None:
                            m.itl.observe((t - last) / len(d.token_ids))
                        last = t
                    completion_tokens += len(d.token_ids)
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
                        generated, reasoning = step.content, step.reasoning
                    text, ids = generated, d.token_ids
                    rows = d.logprobs if req.echo_logprobs is not None and d.logprobs else None
                    if echo is not None:
                        text, ids = echo.text + text, echo.token_ids + ids
                        if rows is not None and echo.logprobs is not None:
                            rows = echo.logprobs + rows
                    if not ids and not text and not reasoning and d.finish_reason is None:
                        continue
                    body = choice(
                        req, c, text, ids, rows, d.finish_reason, d.stop_reason, delta=True
                    )
                    sent: dict | None = body
                    if tools is not None:
                        echoed = echo.text if echo is not None else ""
                        sent = tools.delta(c, body, echoed, generated, d.finish_reason)
                    if splits is not None:
                        sent = with_reasoning(sent, body, reasoning)
                    if sent is None:
                        continue
                    yield chunk([sent])
        except ApiError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        m.finish(req, start, completion_tokens, prompt_tokens, reasons)
        if log is not None:
            log.finished(cid, start, first_token, completion_tokens, reasons)
        if req.include_usage:
            yield chunk([], final_usage=True)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await unless_disconnected(request, run(await parse(request, "completion")))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await unless_disconnected(request, run(await parse(request, "chat")))


def _watched(log: RequestLog | None, api_id: str, start: float):
    return log.watch(api_id, start) if log is not None else contextlib.nullcontext()


def _routes(log: RequestLog | None, api_id: str):
    return (lambda route: log.route(api_id, route)) if log is not None else None


def _finish(reason: str | None) -> str | None:
    return None if reason is None else {"abort": "abort", "error": "error"}.get(reason, reason)


def _check_errors(finish: list[str | None], why: list[Any]) -> None:
    """A 500 naming the worker's reason (as a stream's error event does) when any choice
    ended in an error."""
    for f, reason in zip(finish, why, strict=True):
        if f == "error":
            raise ApiError(f"the request failed in a worker: {reason}", 500, "server_error")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
