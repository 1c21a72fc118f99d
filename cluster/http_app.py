"""The OpenAI-compatible HTTP server (FastAPI): routes, limits, auth, SSE.

Bodies are read and checked here before any JSON parsing: a body over `max_body_bytes`
is refused (413) from its Content-Length or as it arrives, and a gzip body is inflated
in bounded steps, refused as soon as it passes the limit (a gzip bomb never inflates
past `max_body_bytes`). `--api-key` guards every /v1 route and vLLM's /tokenize and
/detokenize (Bearer); /health (503 while no decode worker is ready), /metrics and
/version stay open. Every response carries a server-made X-Request-Id.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import zlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pdserve.cluster.batch_stream import merged
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.openai_api import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    completion_prompts,
    new_id,
    now,
    parse_sampling,
    prompt_token_ids,
    requested_max_tokens,
    resolve_max_tokens,
    usage,
    wants_echo,
)
from pdserve.cluster.router import Router
from pdserve.version import __version__

logger = logging.getLogger(__name__)


class AppState:
    def __init__(
        self,
        router: Router,
        tokenizer: Any,
        model_names: str | list[str],
        max_model_len: int,
        metrics: Metrics,
        api_key: str | None = None,
        max_body_bytes: int = 4 << 20,
        runner: str = "mrv2",
        sampling_defaults: dict | None = None,
    ) -> None:
        # `--served-model-name`: requests may name any of them; responses carry the first.
        names = [model_names] if isinstance(model_names, str) else list(model_names)
        if not names:
            raise ValueError("a server needs at least one model name")
        self.router, self.tokenizer, self.model_names = router, tokenizer, names
        self.max_model_len, self.metrics, self.api_key = max_model_len, metrics, api_key
        self.max_body_bytes, self.runner = max_body_bytes, runner
        # A request field left out takes these (cluster/generation_defaults.py).
        self.sampling_defaults = dict(sampling_defaults or {})

    @property
    def model_name(self) -> str:
        return self.model_names[0]


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"request body is {declared} bytes; the limit is {limit}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"request body is over the limit of {limit} bytes", 413)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as e:
            raise ApiError(f"request body is not valid {encoding}: {e}") from e
        if len(out) > limit or inflater.unconsumed_tail:
            raise ApiError(f"decompressed request body is over the limit of {limit} bytes", 413)
        body = out
    elif encoding != "identity":
        raise ApiError(f"unsupported Content-Encoding {encoding!r}", 415)
    return body


def json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object, or a 400 saying what it is not."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def check_model(state: AppState, body: dict) -> None:
    """A request that names a model must name one this server serves (404 otherwise)."""
    model = body.get("model")
    if model is not None and model not in state.model_names:
        served = " or ".join(repr(n) for n in state.model_names)
        raise ApiError(
            f"model {model!r} does not exist; this server serves {served}",
            404,
            "invalid_request_error",
            "model",
            "model_not_found",
        )


# Paths the API key guards: the OpenAI routes, and vLLM's tokenizer routes beside them
# (vLLM leaves those open; here a key, when set, guards every route that reads a body).
GUARDED = ("/v1", "/tokenize", "/detokenize")


def build_app(state: AppState) -> FastAPI:
    from pdserve.cluster.tokenize_routes import add_tokenize_routes  # it imports this module

    app = FastAPI(title="pdserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.pd = state

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = new_id("req")
        request.state.request_id = rid
        if request.url.path.startswith(GUARDED) and state.api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {state.api_key}"):
                resp = error_response(
                    ApiError(
                        "missing or wrong API key",
                        401,
                        "authentication_error",
                        None,
                        "invalid_api_key",
                    )
                )
                resp.headers["X-Request-Id"] = rid
                return resp
        try:
            response = await call_next(request)
        except ApiError as e:
            response = error_response(e)
        response.headers["X-Request-Id"] = rid
        return response

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.get("/health")
    async def health() -> Response:
        # Serving needs a ready decode worker (PD falls back to prefilling there); without
        # one (all restarting or drained) the router is up but cannot answer: 503, so a
        # readiness probe takes it out of the Service. /version answers while HTTP does.
        if not state.router.decode_workers:
            return error_response(ApiError("no decode worker is ready", 503, "server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        await state.router.poll_stats()
        return PlainTextResponse(state.metrics.render(state.router), media_type="text/plain")

    add_tokenize_routes(app, state)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "pdserve",
                    "max_model_len": state.max_model_len,
                    "runner": state.runner,
                    "mode": state.router.config.mode,
                }
                for name in state.model_names
            ],
        }

    async def parse(request: Request, kind: str) -> list[ParsedRequest]:
        """One ParsedRequest per prompt (a completion may carry a batch of them)."""
        body = json_object(await read_body(request, state.max_body_bytes))
        check_model(state, body)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ApiError("'seed' must be an integer", param="seed")
        requested = requested_max_tokens(body, kind)
        if kind == "chat":
            prompts = [(prompt_token_ids(body, kind, state.tokenizer), None)]
        else:
            prompts = completion_prompts(body, state.tokenizer)
        echo = kind == "completion" and wants_echo(body)
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError("'stream' must be a boolean", param="stream")
        defaults, out = state.sampling_defaults, []
        for ids, text in prompts:
            max_tokens = resolve_max_tokens(
                requested, len(ids), state.max_model_len, defaults.get("max_tokens")
            )
            params, k = parse_sampling(body, kind, seed, max_tokens, defaults)
            out.append(
                ParsedRequest(
                    kind,
                    state.model_name,
                    ids,
                    params,
                    stream,
                    bool(opts.get("include_usage")),
                    k,
                    text if echo else None,
                )  # fmt: skip
            )
        return out

    def decode_tok(t: int) -> str:
        return state.tokenizer.decode([t])

    def choice(
        req: ParsedRequest, index: int, text: str, toks, lps, finish, stop_reason, delta: bool
    ):
        if req.kind == "chat":
            body: dict[str, Any] = {"index": index}
            if delta:
                body["delta"] = {"content": text} if text or toks else {}
            else:
                body["message"] = {"role": "assistant", "content": text}
            body["logprobs"] = (
                {"content": chat_logprobs(toks, lps, req.echo_logprobs or 0, decode_tok)}
                if lps is not None
                else None
            )
        else:
            body = {"index": index, "text": text}
            body["logprobs"] = (
                completion_logprobs(toks, lps, req.echo_logprobs or 0, decode_tok)
                if lps is not None
                else None
            )
        body["finish_reason"] = _finish(finish)
        if finish is not None and stop_reason is not None:
            body["stop_reason"] = stop_reason
        return body

    async def run(reqs: list[ParsedRequest]):
        start = time.monotonic()
        req = reqs[0]  # the fields every prompt shares
        kind = "chat.completion" if req.kind == "chat" else "text_completion"
        cid = new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        m = state.metrics
        if req.stream:
            return StreamingResponse(
                sse(reqs, cid, start), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )  # fmt: skip
        total = len(reqs) * req.params.n
        texts, toks = [""] * total, [[] for _ in range(total)]
        want_lps = req.echo_logprobs is not None
        lps: list[list | None] = [[] if want_lps else None for _ in range(total)]
        finish: list[str | None] = [None] * total
        stop: list[Any] = [None] * total
        echo_toks: list[list[int]] = [[] for _ in range(total)]
        cached = completion_tokens = 0
        first_token = None
        async for c, d, echo in merged(state.router, reqs):
            if d.token_ids and first_token is None:
                first_token = time.monotonic()
                m.ttft.observe(first_token - start)
            if echo is not None:
                texts[c] += echo.text
                echo_toks[c] = echo.token_ids
                if lps[c] is not None and echo.logprobs is not None:
                    lps[c] += echo.logprobs
            texts[c] += d.text
            toks[c] += d.token_ids
            completion_tokens += len(d.token_ids)
            if lps[c] is not None and d.logprobs:
                lps[c] += d.logprobs
            cached = max(cached, d.num_cached_tokens)
            if d.finish_reason is not None:
                finish[c], stop[c] = d.finish_reason, d.stop_reason
        _check_errors(finish)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        m.finish(req, start, completion_tokens, prompt_tokens, finish)
        return {
            "id": cid,
            "object": kind,
            "created": now(),
            "model": state.model_name,
            "choices": [
                choice(
                    req,
                    c,
                    texts[c],
                    echo_toks[c] + toks[c],
                    lps[c],
                    finish[c],
                    stop[c],
                    delta=False,
                )  # fmt: skip
                for c in range(total)
            ],
            "usage": usage(prompt_tokens, completion_tokens, cached),
        }

    async def sse(reqs: list[ParsedRequest], cid: str, start: float):
        req = reqs[0]
        chunk_kind = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        created, m = now(), state.metrics
        completion_tokens, first_token, last = 0, None, None
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        reasons: list[str | None] = [None] * (len(reqs) * req.params.n)
        if req.kind == "chat":
            for i in range(req.params.n):
                head = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse(
                    {
                        "id": cid,
                        "object": chunk_kind,
                        "created": created,
                        "model": state.model_name,
                        "choices": [head],
                    }
                )
        try:
            async for c, d, echo in merged(state.router, reqs):
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
                text, ids = d.text, d.token_ids
                rows = d.logprobs if req.echo_logprobs is not None and d.logprobs else None
                if echo is not None:
                    text, ids = echo.text + text, echo.token_ids + ids
                    if rows is not None and echo.logprobs is not None:
                        rows = echo.logprobs + rows
                if not ids and not text and d.finish_reason is None:
                    continue
                body = choice(req, c, text, ids, rows, d.finish_reason, d.stop_reason, delta=True)
                yield _sse(
                    {
                        "id": cid,
                        "object": chunk_kind,
                        "created": created,
                        "model": state.model_name,
                        "choices": [body],
                    }
                )
        except ApiError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        m.finish(req, start, completion_tokens, prompt_tokens, reasons)
        if req.include_usage:
            yield _sse(
                {
                    "id": cid,
                    "object": chunk_kind,
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens),
                }
            )
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(await parse(request, "completion"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await run(await parse(request, "chat"))

    return app


def _finish(reason: str | None) -> str | None:
    return None if reason is None else {"abort": "abort", "error": "error"}.get(reason, reason)


def _check_errors(finish: list[str | None]) -> None:
    if any(f == "error" for f in finish):
        raise ApiError("the request failed in a worker (KV transfer)", 500, "server_error")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
