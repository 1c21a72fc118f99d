"""The Responses API's store (cluster/response_store.py): a conversation is its responses'
own items joined along their links, the bound counts bytes and evicts the least recently
used (a conversation being continued is touched whole), a broken link is named; and the
routes' reading of a request against it (`answered_body`). With the store off the server's
own app (over ASGI) answers 404s that say so, before any worker. The real servers'
chains are in tests/test_serve_responses.py."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from pdserve.cluster.http_app import AppState, build_app
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.response_store import MissingResponse, ResponseStore, as_items
from pdserve.cluster.responses_routes import answered_body
from pdserve.cluster.route_policy import RouterConfig
from pdserve.cluster.router import Router
from pdserve.cluster.serve_args import ServeConfig
from pdserve.cluster.serve_flags import add_serve_args, config_from_args


def _response(rid: str, text: str) -> dict:
    item = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip
    return {"id": rid, "object": "response", "output": [item]}


def _size(rid: str, text: str, items: list[dict]) -> int:
    return len(json.dumps(_response(rid, text))) + len(json.dumps(items))


def test_a_conversation_is_its_responses_items_in_order():
    """Guards the chain: each response's own input then its output, oldest first, a string
    input as one user message; a continued response's entry holds only its own turn."""
    store = ResponseStore(1 << 20)
    store.put(_response("r1", "Hello Ada."), as_items("I am Ada."), None)
    own = [{"type": "message", "role": "user", "content": "Who am I?"}]
    store.put(_response("r2", "Ada."), own, "r1")
    items = store.conversation("r2")
    assert [(i["role"], i.get("content")) for i in items[::2]] == [
        ("user", "I am Ada."), ("user", "Who am I?")]  # fmt: skip
    assert [i["content"][0]["text"] for i in items[1::2]] == ["Hello Ada.", "Ada."]
    assert store.get("r2").input_items == own and store.get("r2").previous_id == "r1"
    assert store.conversation("r1") == items[:2]


def test_the_bound_evicts_the_least_recently_used_and_counts_bytes():
    """Guards the memory bound: it holds exactly what fits, evicts oldest first, a
    conversation continued (or read) moves to the back, and a response bigger than the
    bound is refused without evicting anything."""
    one = _size("r1", "x" * 100, as_items("q"))
    store = ResponseStore(3 * one)
    for i in (1, 2, 3):
        assert store.put(_response(f"r{i}", "x" * 100), as_items("q"), None)
    assert len(store) == 3 and store.nbytes == 3 * one
    store.conversation("r1")  # r1 is in use: r2 is now the least recently used
    store.put(_response("r4", "x" * 100), as_items("q"), None)
    assert sorted(store._entries) == ["r1", "r3", "r4"]
    assert not store.put(_response("big", "x" * 4 * one), as_items("q"), None)
    assert sorted(store._entries) == ["r1", "r3", "r4"] and store.nbytes == 3 * one
    assert store.delete("r3") and not store.delete("r3") and store.nbytes == 2 * one


def test_a_broken_link_names_the_missing_response():
    """Guards a conversation whose earlier response is gone: continuing it names that
    response, not the one asked for."""
    store = ResponseStore(1 << 20)
    store.put(_response("r1", "a"), as_items("q"), None)
    store.put(_response("r2", "b"), as_items("q"), "r1")
    store.delete("r1")
    with pytest.raises(MissingResponse) as e:
        store.conversation("r2")
    assert e.value.response_id == "r1"


def test_a_request_is_answered_with_the_store_it_gets():
    """Guards `answered_body`: store is true by default and when asked, false when asked
    or when the server stores nothing; a continued response's conversation comes back; a
    bad `store` or `previous_response_id` is a 400, an unknown one a 404 naming
    previous_response_id."""
    on, off = ResponseStore(1 << 20), ResponseStore(0)
    assert answered_body(on, {"input": "x"}) == ({"input": "x", "store": True}, [])
    assert answered_body(on, {"input": "x", "store": False})[0]["store"] is False
    assert answered_body(off, {"input": "x", "store": True})[0]["store"] is False
    for body, status in (({"store": "yes"}, 400), ({"previous_response_id": 3}, 400),
                         ({"previous_response_id": "resp_x"}, 404)):  # fmt: skip
        with pytest.raises(ApiError) as e:
            answered_body(on, {"input": "x", **body})
        assert e.value.status == status and e.value.param == next(iter(body)), e.value.body()
    on.put(_response("resp_1", "a"), as_items("q"), None)
    body, history = answered_body(on, {"input": "x", "previous_response_id": "resp_1"})
    assert body["previous_response_id"] == "resp_1" and body["store"] is True
    assert history == on.conversation("resp_1")


def test_with_the_store_off_the_server_says_none_are_stored():
    """Guards `--responses-store-bytes 0` end to end on the server's own app: the flag
    reaches the config, and continuing, reading or deleting a response are 404s that say
    the server stores none, answered before any worker is asked."""
    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = config_from_args(p.parse_args(["--responses-store-bytes", "0"]))
    assert cfg.responses_store_bytes == 0 and ServeConfig().responses_store_bytes == 256 << 20
    with pytest.raises(ValueError, match="responses-store-bytes"):
        ServeConfig(responses_store_bytes=-1)
    router = Router(RouterConfig(mode="colocated"), [], [])
    app = build_app(AppState(router, None, "m", 64, Metrics("m"),
                             responses=ResponseStore(cfg.responses_store_bytes)))  # fmt: skip

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"model": "m", "input": "x", "previous_response_id": "resp_1"}
            return [await c.post("/v1/responses", json=body, timeout=10),
                    await c.get("/v1/responses/resp_1", timeout=10),
                    await c.delete("/v1/responses/resp_1", timeout=10)]  # fmt: skip

    for r, param in zip(asyncio.run(run()), ("previous_response_id", "response_id", "response_id")):
        err = r.json()["error"]
        assert r.status_code == 404 and err["param"] == param, err
        assert "stores no responses" in err["message"], err
