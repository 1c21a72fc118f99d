"""The OpenAI-compatible HTTP server (FastAPI): the app, body limits, auth, health and
metrics; the routes that answer requests are cluster/completion_routes.py and
cluster/tokenize_routes.py.

Bodies are read and checked here before any JSON parsing: a body over `max_body_bytes`
is refused (413) from its Content-Length or as it arrives, and a gzip body is inflated
in bounded steps, refused as soon as it passes the limit (a gzip bomb never inflates
past `max_body_bytes`). `--api-key` guards every /v1 route and vLLM's /tokenize and
/detokenize (Bearer); /health (503 while no decode worker is ready), /metrics, /load
(cluster/server_load.py) and /version stay open. Every response carries an X-Request-Id: the client's, as vLLM takes
it (then also in the response's id), or one made here. Browsers get
vLLM's CORS answers on every route but the operator's (cluster/cors.py).
"""

from __future__ import annotations

import json
import logging
import secrets
import zlib
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pdserve.cluster.background_responses import BackgroundRuns
from pdserve.cluster.cors import ApiCors, CorsConfig
from pdserve.cluster.lora_registry import LoraRegistry
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.openai_api import ApiDefaults, ApiError
from pdserve.cluster.request_log import RequestLog
from pdserve.cluster.response_shapes import client_request_id, new_id, now
from pdserve.cluster.response_store import DEFAULT_STORE_BYTES, ResponseStore
from pdserve.cluster.root_path import route_path
from pdserve.cluster.router import Router
from pdserve.cluster.server_load import CountLoad, LoadCounter
from pdserve.version import __version__

if TYPE_CHECKING:
    from pdserve.runner.pooling import ModelPooling

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
        chat_template: str | None = None,
        request_log: RequestLog | None = None,
        vocab_size: int | None = None,
        scheduling_policy: str = "fcfs",
        auto_tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        cors: CorsConfig | None = None,
        responses: ResponseStore | None = None,
        lora_modules: dict[str, str] | None = None,
        pooling: ModelPooling | None = None,
        runtime_lora_rank: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        grammar_in_reasoning: bool = False,
        openapi: bool = True,
        api_defaults: ApiDefaults | None = None,
        server_load: LoadCounter | None = None,
    ) -> None:
        # `--served-model-name`: requests may name any of them; responses carry the first.
        names = [model_names] if isinstance(model_names, str) else list(model_names)
        if not names:
            raise ValueError("a server needs at least one model name")
        self.router, self.tokenizer, self.model_names = router, tokenizer, names
        self.max_model_len, self.metrics, self.api_key = max_model_len, metrics, api_key
        self.max_body_bytes, self.runner = max_body_bytes, runner
        # A request field left out takes these (runner/generation_defaults.py).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.chat_template = chat_template  # `--chat-template`; None: the tokenizer's
        self.request_log = request_log  # `--enable-log-requests`
        self.vocab_size = vocab_size  # the model's; token ids past it are refused (400)
        self.scheduling_policy = scheduling_policy  # `priority` fields need "priority"
        # `--tool-call-parser` when `--enable-auto-tool-choice`: tool_choice auto is
        # answered, its calls read by this parser; None: auto is refused (400).
        self.auto_tool_parser = auto_tool_parser
        # `--reasoning-parser`: chat replies' thinking split from their answer; None: not.
        self.reasoning_parser = reasoning_parser
        # `--structured-outputs-config '{"enable_in_reasoning": true}'`: with a reasoning
        # parser, a grammar holds the reply from its first token; else the answer after the
        # thinking (cluster/reasoning_api.py)
        self.grammar_in_reasoning = grammar_in_reasoning
        self.cors = cors or CorsConfig()  # vLLM's CORS flags (cluster/cors.py)
        # Stored Responses API responses (`--responses-store-bytes`)
        self.responses = ResponseStore(DEFAULT_STORE_BYTES) if responses is None else responses
        # Their background runs (`background: true`), cancelled when the server stops
        self.background = BackgroundRuns()
        # The LoRA adapters served (`--lora-modules`, then runtime loads): the router's
        # registry, which a request's `model` may name (cluster/lora_registry.py)
        self.loras = router.loras if router is not None else LoraRegistry()
        for name, path in (lora_modules or {}).items():
            self.loras.add(name, path)
        # What pooling requests the model serves (runner/pooling.py): embeddings, or a
        # classifier's classify/score/rerank; None: not known (no pooling route answers)
        self.pooling = pooling
        # vLLM's runtime LoRA routes (cluster/lora_routes.py) with this largest rank; None:
        # not served
        self.runtime_lora_rank = runtime_lora_rank
        self.eos_token_ids = eos_token_ids  # the model's (beam search ends beams on them)
        self.openapi = openapi  # /openapi.json served; `--disable-fastapi-docs`: not
        self.api_defaults = api_defaults or ApiDefaults()  # vLLM's request/response flags
        # `--enable-server-load-tracking`: model requests in flight, for GET /load
        self.server_load = server_load or LoadCounter()

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


def model_cards(state: AppState) -> list[dict]:
    """/v1/models' entries: the served names, then the loaded LoRA adapters."""
    common = {
        "object": "model", "created": now(), "owned_by": "pdserve",
        "max_model_len": state.max_model_len, "runner": state.runner,
        "mode": state.router.config.mode,
    }  # fmt: skip
    bases = [{"id": name, **common} for name in state.model_names]
    # vLLM's: an adapter names its checkpoint (root) and its base model (parent)
    adapters = [
        {"id": a.name, **common, "root": a.path, "parent": state.model_name}
        for a in state.loras.adapters()
    ]
    return bases + adapters


def check_model(state: AppState, body: dict) -> str | None:
    """A request that names a model must name one this server serves (404 otherwise):
    returns the LoRA adapter it named (`--lora-modules`), None for the base model."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    if model in state.loras:
        return model
    if model is not None and model not in state.model_names:
        names = [*state.model_names, *(a.name for a in state.loras.adapters())]
        served = " or ".join(repr(n) for n in names)
        raise ApiError(
            f"model {model!r} does not exist; this server serves {served}",
            404,
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return None


# Paths the API key guards: the OpenAI routes, and vLLM's tokenizer, score, rerank,
# classify and SageMaker routes beside them (vLLM leaves those open; here a key, when set,
# guards every route that reads a body).
GUARDED = ("/v1", "/v2", "/tokenize", "/detokenize", "/invocations", "/score", "/rerank",
           "/classify")  # fmt: skip


def build_app(state: AppState) -> FastAPI:
    # They import this module (its body reading and checks).
    from pdserve.cluster.classify_routes import add_classify_routes
    from pdserve.cluster.completion_routes import add_completion_routes
    from pdserve.cluster.embedding_routes import add_embedding_routes
    from pdserve.cluster.lora_routes import add_lora_routes
    from pdserve.cluster.responses_routes import add_responses_routes
    from pdserve.cluster.tokenize_routes import add_tokenize_routes

    app = FastAPI(
        title="pdserve", version=__version__, docs_url=None, redoc_url=None,
        openapi_url="/openapi.json" if state.openapi else None,
    )  # fmt: skip
    app.state.pd = state

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        # The client's X-Request-Id (an operator's gateway sets one to trace a request
        # through) is the request's id, as on vLLM; else one of ours.
        try:
            given = client_request_id(request.headers.get("x-request-id"), "X-Request-Id")
        except ApiError as e:
            return error_response(e)
        rid = given or new_id("req")
        request.state.request_id, request.state.client_request_id = rid, given
        if route_path(request.scope).startswith(GUARDED) and state.api_key is not None:
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

    # SageMaker's health check (vLLM serves it too, GET and POST): /health's answer.
    @app.api_route("/health", methods=["GET"])
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        # Serving needs a ready decode worker (PD falls back to prefilling there); without
        # one (all restarting or drained) the router is up but cannot answer: 503, so a
        # readiness probe takes it out of the Service. /version answers while HTTP does.
        if not state.router.decode_workers:
            return error_response(ApiError("no decode worker is ready", 503, "server_error"))
        return Response(status_code=200)

    @app.get("/load")  # vLLM's: 0 unless --enable-server-load-tracking
    async def load() -> dict:
        return {"server_load": state.server_load.count}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        await state.router.poll_stats()
        return PlainTextResponse(state.metrics.render(state.router), media_type="text/plain")

    add_tokenize_routes(app, state)
    add_embedding_routes(app, state)
    add_classify_routes(app, state)
    if state.runtime_lora_rank is not None:
        add_lora_routes(app, state, state.runtime_lora_rank)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": model_cards(state)}

    # OpenAI's "retrieve model": one card of the list; served names may hold a "/".
    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        check_model(state, {"model": model})  # the list's 404 for a name not served
        return next(card for card in model_cards(state) if card["id"] == model)

    add_completion_routes(app, state)
    add_responses_routes(app, state)
    if state.server_load.enabled:
        app.add_middleware(CountLoad, counter=state.server_load)
    # Added last, so outermost: a preflight is answered before the API key is asked for.
    app.add_middleware(ApiCors, config=state.cors)
    return app
