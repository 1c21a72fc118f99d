"""vLLM's `--enable-server-load-tracking` (cluster/server_load.py): the count of model
requests in flight, a stream included until it ends, over a real ASGI app. The /load
route on a real server, with and without the flag: test_serve_vllm_compat."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from pdserve.cluster.root_path import RootPath
from pdserve.cluster.server_load import CountLoad, LoadCounter


def _app(release: asyncio.Event) -> Starlette:
    async def stream(request) -> StreamingResponse:
        async def events():
            yield "data: 1\n\n"
            await release.wait()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def fails(request):
        raise RuntimeError("boom")

    async def tokenize(request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(routes=[
        Route("/v1/chat/completions", stream, methods=["POST"]),
        Route("/v1/completions", fails, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
    ])  # fmt: skip


async def _call(app, method: str, path: str, first_body: asyncio.Event) -> list[dict]:
    """One request through the ASGI app as a server makes it (httpx's ASGI transport
    would wait for a stream's whole body): what the app sent."""
    sent: list[dict] = []
    asked = False

    async def receive() -> dict:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            first_body.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": [], "server": ("t", 80),
             "client": ("c", 1)}  # fmt: skip
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("prefix", ["", "/pd"])
def test_a_stream_counts_until_it_ends_and_a_failure_uncounts(prefix):
    """A streamed model request counts from its start until its last event is sent; a
    route that is not the model's never counts; one that fails is uncounted. Under a
    --root-path (cluster/root_path.py) a prefixed path counts as its route does."""
    counter = LoadCounter(enabled=True)

    async def run() -> list[int]:
        release, first = asyncio.Event(), asyncio.Event()
        app = CountLoad(_app(release), counter)
        if prefix:
            app = RootPath(app, prefix)
        stream = asyncio.create_task(_call(app, "POST", prefix + "/v1/chat/completions", first))
        await asyncio.wait_for(first.wait(), 10)  # the first event is out: in flight
        seen = [counter.count]
        await _call(app, "POST", prefix + "/tokenize", asyncio.Event())
        seen.append(counter.count)
        release.set()
        sent = await asyncio.wait_for(stream, 10)
        assert any(b"[DONE]" in m.get("body", b"") for m in sent)
        seen.append(counter.count)
        with pytest.raises(RuntimeError, match="boom"):
            await _call(app, "POST", prefix + "/v1/completions", asyncio.Event())
        seen.append(counter.count)
        return seen

    assert asyncio.run(run()) == [1, 1, 0, 0]
