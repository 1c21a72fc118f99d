"""vLLM's `--h11-max-header-count`: a request with more header fields than this is
answered 431 before any route (or the API key check) sees it, with an X-Request-Id as
every app response has (the client's where it gave a valid one). Its sibling
`--h11-max-incomplete-event-size` (the most bytes of a request line and headers h11 buffers)
is uvicorn's own setting and goes to it unchanged (cluster/serve.py)."""

from __future__ import annotations

from typing import Any

from pdserve.cluster.http_app import error_response
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.response_shapes import client_request_id, new_id


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
        response = error_response(error)
        response.headers["X-Request-Id"] = _request_id(scope["headers"])
        await response(scope, receive, send)


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id where it is a valid id (the last of several), else ours."""
    given = [v for k, v in headers if k.lower() == b"x-request-id"]
    try:
        rid = client_request_id(given[-1].decode("latin-1"), "X-Request-Id") if given else None
    except ApiError:
        rid = None
    return rid or new_id("req")
