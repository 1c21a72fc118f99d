"""CORS as vLLM's server answers it (cluster/cors.py): any origin by default, the four
flags to narrow it, preflights answered before the API key is asked for, and none of it
on the operator's routes. The app is the server's own (build_app), over ASGI; the real
server's routes are checked in test_serve_faults.py."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from pdserve.cluster.cors import CorsConfig
from pdserve.cluster.http_app import AppState, build_app
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.route_policy import RouterConfig
from pdserve.cluster.router import Router
from pdserve.cluster.serve_args import ServeConfig
from pdserve.cluster.serve_flags import add_serve_args, config_from_args

PREFLIGHT = {"access-control-request-method": "POST",
             "access-control-request-headers": "authorization,content-type"}  # fmt: skip


def _calls(cors: CorsConfig | None, *calls: tuple[str, str, dict]) -> list[httpx.Response]:
    router = Router(RouterConfig(mode="colocated"), [], [])
    app = build_app(AppState(router, None, "m", 64, Metrics("m"), api_key="k", cors=cors))

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.request(m, path, headers=h, timeout=10) for m, path, h in calls]

    return asyncio.run(run())


def test_any_origin_by_default_and_before_the_key():
    """vLLM's defaults: a preflight from any origin is allowed without the key (browsers
    send none); the real call still needs the key, and its 401 carries the CORS header
    so the page can read why."""
    pre, models = _calls(
        None,
        ("OPTIONS", "/v1/chat/completions", {"origin": "https://ui.example", **PREFLIGHT}),
        ("GET", "/v1/models", {"origin": "https://ui.example"}),
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert models.status_code == 401 and models.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in pre.headers


def test_allowed_origins_narrow_it_and_operator_routes_have_none():
    ok, refused, ops, page = _calls(
        CorsConfig(allowed_origins=("https://ui.example",), allow_credentials=True),
        ("OPTIONS", "/v1/completions", {"origin": "https://ui.example", **PREFLIGHT}),
        ("OPTIONS", "/v1/completions", {"origin": "https://evil.example", **PREFLIGHT}),
        ("OPTIONS", "/ops/scale", {"origin": "https://ui.example", **PREFLIGHT}),
        ("GET", "/dashboard", {"origin": "https://ui.example"}),
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://ui.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # (this app has no operator routes: their 404s still say nothing to a browser)
    for r in (ops, page):
        assert not any(k.startswith("access-control") for k in r.headers), r.headers


def _args(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_vllms_cors_flags_and_config_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = _args()
    assert cfg.cors == CorsConfig(("*",), False, ("*",), ("*",))
    cfg = _args(
        "--allowed-origins", '["https://a.example", "https://b.example"]', "--allow-credentials",
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]',
    )  # fmt: skip
    assert cfg.cors == CorsConfig(
        ("https://a.example", "https://b.example"), True, ("GET", "POST"), ("authorization",)
    )
    path = tmp_path / "serve.yaml"
    path.write_text("allowed_origins: https://a.example\nallowed_methods: [GET]\n")
    cfg = _args("--config", str(path))
    assert (cfg.allowed_origins, cfg.allowed_methods) == (("https://a.example",), ("GET",))
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            _args("--allowed-origins", bad)
        assert "expected a JSON list of strings" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--allowed-headers must be a list of non-empty"):
        ServeConfig(allowed_headers=("",))
    path.write_text("allow_credentials: 1\n")
    with pytest.raises(ValueError, match="allow_credentials must be true or false"):
        _args("--config", str(path))
