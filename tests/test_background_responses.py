"""Background responses' runs (cluster/background_responses.py) and the checks of the
`background` field (cluster/responses_routes.py), on plain asyncio tasks. A background
response on a real PD server, run, read and cancelled: tests/test_serve_responses.py."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from pdserve.cluster.background_responses import BackgroundRuns
from pdserve.cluster.http_app import AppState, build_app
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.response_store import ResponseStore
from pdserve.cluster.responses_output import response_object
from pdserve.cluster.responses_routes import _background
from pdserve.cluster.route_policy import RouterConfig
from pdserve.cluster.router import Router


def test_a_run_is_owned_until_it_ends_and_a_cancel_waits_for_it():
    """A run is held while it runs and dropped when it ends; cancel stops it and returns
    once it has unwound (its cleanup ran), False for one not running; close cancels every
    run left and waits for them."""
    unwound: list[str] = []

    async def run(name: str, forever: bool) -> None:
        try:
            if forever:
                await asyncio.Event().wait()
        finally:
            unwound.append(name)

    async def main() -> list:
        runs = BackgroundRuns()
        runs.start("a", run("a", forever=False))
        runs.start("b", run("b", forever=True))
        runs.start("c", run("c", forever=True))
        await asyncio.sleep(0.01)
        seen = [len(runs), "a" in runs, "b" in runs]
        seen.append(await runs.cancel("b"))
        seen += [list(unwound), "b" in runs, await runs.cancel("b"), await runs.cancel("a")]
        await runs.close()
        seen += [list(unwound), len(runs)]
        return seen

    assert asyncio.run(main()) == [
        2, False, True, True, ["a", "b"], False, False, False, ["a", "b", "c"], 0,
    ]  # fmt: skip


def test_a_run_that_raises_is_logged_not_lost(caplog):
    async def boom() -> None:
        raise RuntimeError("boom")

    async def main() -> int:
        runs = BackgroundRuns()
        runs.start("x", boom())
        await asyncio.sleep(0.01)
        return len(runs)

    with caplog.at_level(logging.ERROR, logger="pdserve.cluster.background_responses"):
        assert asyncio.run(main()) == 0
    assert "background response x failed" in caplog.text and "boom" in caplog.text


@pytest.mark.parametrize(
    "body, says",
    [
        ({"background": "yes", "store": True}, "'background' must be a boolean"),
        ({"background": True, "store": False}, "needs 'store'.*the request says 'store': false"),
        ({"background": True, "store": True, "stream": True}, "'background' with 'stream'"),
    ],
)
def test_a_background_that_cannot_run_is_a_400_naming_it(body, says):
    with pytest.raises(ApiError, match=says) as e:
        _background(body, store_enabled=True)
    assert e.value.param == "background"


def test_the_background_flag_as_taken():
    assert _background({"background": True, "store": True}, True) is True
    for off in (
        {"store": True},
        {"background": False, "store": False},
        {"background": None, "store": True},
    ):
        assert _background(off, True) is False


def test_a_run_cancelled_before_it_began_is_stored_cancelled():
    """Guards the race a run's own handler cannot see: a cancel that lands before the run
    began (its task never ran, so it stored nothing after `queued`; here a run that stores
    nothing) must still store and answer `cancelled`; a foreground response cannot be
    cancelled (400), an unknown one is a 404, deleting a running one stops its run, and
    with the store off `background` is a 400 that says why. On the server's own app, with
    a router of no workers: nothing here reaches one."""
    store = ResponseStore(1 << 20)
    state = AppState(Router(RouterConfig(mode="colocated"), [], []), None, "m", 64,
                     Metrics("m"), responses=store)  # fmt: skip
    app = build_app(state)
    body = {"model": "m", "input": "x", "store": True, "background": True}
    queued = response_object(body, "resp_q", 0, "m", "queued", [], None)
    store.put(queued, [], None)
    store.put(response_object(dict(body, background=False), "resp_f", 0, "m", "completed", [],
                              None), [], None)  # fmt: skip
    off = build_app(AppState(Router(RouterConfig(mode="colocated"), [], []), None, "m", 64,
                             Metrics("m"), responses=ResponseStore(0)))  # fmt: skip

    async def run() -> list[httpx.Response]:
        async def stores_nothing() -> None:  # as a run whose task had not begun
            await asyncio.Event().wait()

        state.background.start("resp_q", stores_nothing())
        state.background.start("resp_d", stores_nothing())
        store.put(response_object(body, "resp_d", 0, "m", "in_progress", [], None), [], None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:  # fmt: skip
            out = [await c.post("/v1/responses/resp_q/cancel"),
                   await c.get("/v1/responses/resp_q"),
                   await c.post("/v1/responses/resp_f/cancel"),
                   await c.post("/v1/responses/resp_x/cancel"),
                   await c.delete("/v1/responses/resp_d")]  # fmt: skip
            out.append(await c.get("/v1/responses/resp_d"))
            out.append("resp_d" in state.background)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=off),
                                     base_url="http://t") as c:  # fmt: skip
            out.append(await c.post("/v1/responses", json={"model": "m", "input": "x",
                                                           "background": True}))  # fmt: skip
        return out

    cancelled, read, foreground, unknown, deleted, gone, running, store_off = asyncio.run(run())
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert read.json() == cancelled.json() and read.json()["background"] is True
    assert foreground.status_code == 400
    assert "only a background response can be cancelled" in foreground.json()["error"]["message"]
    assert unknown.status_code == 404
    # Deleting a response whose run is still going stops the run (else it would store the
    # response again when it ends).
    assert deleted.status_code == 200 and gone.status_code == 404 and running is False
    err = store_off.json()["error"]
    assert store_off.status_code == 400 and err["param"] == "background"
    assert "this server stores none" in err["message"]
