"""CORS on the API, as vLLM's server sets it (`--allowed-origins`, `--allow-credentials`,
`--allowed-methods`, `--allowed-headers`; every origin, method and header by default), so
a page served from another origin can call /v1 from the browser as it calls vLLM.

The operator's routes are left out: /ops/*, /dashboard and /reset_prefix_cache (vLLM's
path of /ops/reset_prefix_cache) answer no preflight and send no CORS headers, so a page
of another site can never send them a JSON POST (the operator's POSTs require one,
cluster/ops_api.py). A preflight never needs the API key: browsers send it without one,
and it is answered before the key is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.root_path import route_path

OPERATOR_PATHS = ("/ops/", "/dashboard", "/reset_prefix_cache")


@dataclass(frozen=True)
class CorsConfig:
    """vLLM's defaults: any origin, method and header, no credentials."""

    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        for flag, value in (
            ("--allowed-origins", self.allowed_origins),
            ("--allowed-methods", self.allowed_methods),
            ("--allowed-headers", self.allowed_headers),
        ):
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{flag} must be a list of non-empty strings, got {value!r}")
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(
                f"--allow-credentials must be true or false, got {self.allow_credentials!r}"
            )


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings, as vLLM reads `--allowed-origins '["https://a"]'`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"expected a JSON list of strings, e.g. '[\"*\"]': {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return value


class ApiCors:
    """Starlette's CORS middleware for every path but the operator's."""

    def __init__(self, app: Any, config: CorsConfig) -> None:
        from starlette.middleware.cors import CORSMiddleware

        self.app = app
        self.cors = CORSMiddleware(
            app,
            allow_origins=list(config.allowed_origins),
            allow_credentials=config.allow_credentials,
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not route_path(scope).startswith(OPERATOR_PATHS):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
