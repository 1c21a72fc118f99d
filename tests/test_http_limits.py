"""vLLM's HTTP parser bounds (cluster/http_limits.py, `--h11-max-header-count` and
`--h11-max-incomplete-event-size`): the header-count bound over a real ASGI app, and
the flags' checks. A real server with both: test_serve_vllm_compat."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pdserve.cluster.http_limits import HeaderCountLimit
from pdserve.cluster.serve_args import ServeConfig
from pdserve.cluster.serve_flags import add_serve_args, config_from_args


def _app() -> Starlette:
    async def hello(request) -> PlainTextResponse:
        return PlainTextResponse(f"{len(request.headers)} headers")

    return Starlette(routes=[Route("/hello", hello)])


def test_more_header_fields_than_the_bound_is_a_431():
    """At the bound a request reaches its route; one more header field is a 431 in
    OpenAI's error shape that names the flag, and the route never runs."""

    async def run() -> tuple[httpx.Response, ...]:
        transport = httpx.ASGITransport(app=HeaderCountLimit(_app(), 12))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            base = len((await client.get("/hello")).request.headers)
            extra = {f"x-{i}": "1" for i in range(12 - base)}
            at = await client.get("/hello", headers=extra)
            over = await client.get("/hello", headers={**extra, "x-one-more": "1"})
            # The client's X-Request-Id, where valid, names the 431 as it names any answer.
            named = {**extra, "x-request-id": "trace-7"}
            named = await client.get("/hello", headers={**named, "x-one-more": "1"})
            bad = {**extra, "x-request-id": "no spaces"}
            bad = await client.get("/hello", headers={**bad, "x-one-more": "1"})
            return at, over, named, bad

    at, over, named, bad = asyncio.run(run())
    assert at.status_code == 200 and at.text == "12 headers"
    assert over.status_code == named.status_code == bad.status_code == 431
    assert named.headers["x-request-id"] == "trace-7"
    assert over.headers["x-request-id"].startswith("req-")
    assert bad.headers["x-request-id"].startswith("req-")
    assert over.json() == {"error": {
        "message": "the request has 13 header fields; this server takes at most 12 "
        "(--h11-max-header-count)",
        "type": "invalid_request_error", "param": None, "code": None,
    }}  # fmt: skip


def test_the_flags_reach_the_config_and_bad_values_are_refused():
    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = config_from_args(p.parse_args(["--h11-max-incomplete-event-size", "65536",
                                         "--h11-max-header-count", "40"]))  # fmt: skip
    assert (cfg.h11_max_incomplete_event_size, cfg.h11_max_header_count) == (65536, 40)
    for key in ("h11_max_incomplete_event_size", "h11_max_header_count"):
        with pytest.raises(ValueError, match=f"--{key.replace('_', '-')} must be >= 1, got 0"):
            ServeConfig(**{key: 0})
