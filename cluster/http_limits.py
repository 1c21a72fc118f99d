"""vLLM's `--h11-max-header-count`: a request with more header fields than this is
answered 431 before any route (or the API key check) sees it: the one answer without an
X-Request-Id, as the parser's own refusals (400) are. Its sibling
`--h11-max-incomplete-event-size` (the most bytes of a request line and headers h11 buffers)
is uvicorn's own setting and goes to it unchanged (cluster/serve.py)."""

from __future__ import annotations

from typing import Any

from pdserve.cluster.http_app import error_response
from pdserve.cluster.openai_api import ApiError


class HeaderCountLimit:
    """ASGI middleware around the whole app; lifespan and other scopes pass through."""

    def __init__(self, app: Any, max_count: int) -> None:
        self.app = app
        self.max_count = max_count

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or len(scope["headers"]) <= self.max_count:
            await self.app(scope, receive, send)
            return
        error = ApiError(
            f"the request has {len(scope['headers'])} header fields; this server takes at "
            f"most {self.max_count} (--h11-max-header-count)", 431,
        )  # fmt: skip
        await error_response(error)(scope, receive, send)
