"""vLLM's `--enable-server-load-tracking`: GET /load answers {"server_load": N}, the model
requests this router is answering now (a stream counts until its last event is sent or
its client hangs up), for a load balancer in front of several routers. Without the flag
/load answers 0, as vLLM's does. Counted in the ASGI layer, around the whole response:
the app's call returns only once its body is sent."""

from __future__ import annotations

from typing import Any

from pdserve.cluster.root_path import route_path

# The routes that run the model (tokenize, models, health and the operator's do not).
LOAD_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
    "/v1/classify", "/classify", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
    "/invocations",
})  # fmt: skip


class LoadCounter:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.count = 0


class CountLoad:
    """ASGI middleware: `counter.count` is the model requests in flight."""

    def __init__(self, app: Any, counter: LoadCounter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if not (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and route_path(scope) in LOAD_PATHS
        ):
            await self.app(scope, receive, send)
            return
        self.counter.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.count -= 1
