"""Background responses' runs (cluster/background_responses.py) and the checks of the
`background` field (cluster/responses_routes.py), on plain asyncio tasks. A background
response on a real PD server, run, read and cancelled: tests/test_serve_responses.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.cluster.background_responses import BackgroundRuns
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.responses_routes import _background


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
        ({"background": True, "store": False}, "'background' needs 'store'"),
        ({"background": True, "store": True, "stream": True}, "'background' with 'stream'"),
    ],
)
def test_a_background_that_cannot_run_is_a_400_naming_it(body, says):
    with pytest.raises(ApiError, match=says) as e:
        _background(body)
    assert e.value.param == "background"


def test_the_background_flag_as_taken():
    assert _background({"background": True, "store": True}) is True
    for off in (
        {"store": True},
        {"background": False, "store": False},
        {"background": None, "store": True},
    ):
        assert _background(off) is False
