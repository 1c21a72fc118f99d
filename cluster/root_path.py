"""vLLM's `--root-path`: the path prefix under which a proxy publishes the server.

As on vLLM (FastAPI's root_path), the routes answer with and without the prefix: at
`/v1/models` for a proxy that strips it, at `/pd/v1/models` for one that forwards the
path as it came; OpenAPI's document names the prefix as its server. `RootPath` puts the
prefix into every request's ASGI scope, where Starlette's routing strips it from the path
before it matches a route.

Whatever else goes by path must read the same route path the routing matches
(`route_path`): the API key, CORS and `/load`'s count read the raw path before, so with a
prefix `/pd/v1/completions` would have reached its route without the key check.
"""

from __future__ import annotations

from typing import Any


def check_root_path(value: str | None) -> str:
    """The prefix as the scope holds it: "" for none, else "/a/b" (a trailing "/" dropped).
    ValueError for one that is not an absolute path of plain segments."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"--root-path is a URL path such as /pdserve, got {value!r}")
    prefix = value.rstrip("/")
    if not prefix:
        return ""
    bad = [c for c in "?#%\\ \t\r\n" if c in prefix]
    if not prefix.startswith("/") or bad or "//" in prefix:
        raise ValueError(
            f"--root-path must be an absolute URL path such as /pdserve, got {value!r}"
        )
    return prefix


def route_path(scope: dict) -> str:
    """The path a route is matched on: the request's path less the scope's root path where
    it starts with it (at a segment boundary), else the path itself (Starlette's rule)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        if path == root:
            return ""
        if path[len(root)] == "/":
            return path[len(root) :]
    return path


class RootPath:
    """ASGI middleware around the whole app: every HTTP request's scope gets the prefix."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.prefix}
        await self.app(scope, receive, send)
