"""Checking that a URL is an OpenAI-compatible server, for `pdserve bench` and `contract`.

Both tools speak plain HTTP to any OpenAI-compatible endpoint, so this module knows
nothing about pdserve: it asks `GET /v1/models` and wants `{"data": [{"id": ...}]}`.
Everything that is not that becomes an `EndpointError` (a ValueError, so the CLI prints
it and exits 2) whose message says which URL and what was wrong.
"""

from __future__ import annotations

import httpx


class EndpointError(ValueError):
    pass


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model id served at `base_url`, or EndpointError naming what is wrong."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        r = httpx.get(url, headers=auth_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EndpointError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    if r.status_code in (401, 403):
        raise EndpointError(f"{url} refused the API key (HTTP {r.status_code}); pass --api-key")
    if r.status_code != 200:
        raise EndpointError(f"{url} answered HTTP {r.status_code}: not an OpenAI-compatible server")
    try:
        models = r.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(
            f"{url} did not answer an OpenAI model list ({{'data': [{{'id': ...}}]}}); got "
            f"{r.headers.get('content-type', '?')}: {r.text[:80]!r}"
        ) from None


def normalize_base_url(url: str) -> str:
    """Accept `http://host:port` and `http://host:port/v1` alike."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
