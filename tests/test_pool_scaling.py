"""Scaling the pools on a real local Ray instance: the controller's `scale` and
`start_drain`, one autoscaler tick driving them through a real router, and the router's
queue for decode slots handing its backlog to a worker added by scaling."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray_controller import controller_on_ray, free_endpoint, tiny_spec

from pdserve.cluster.autoscale import AutoscaleConfig, Autoscaler
from pdserve.cluster.controller import Controller
from pdserve.cluster.membership import sync_members
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.openai_api import ApiError, ParsedRequest
from pdserve.cluster.pool_control import PoolControl
from pdserve.cluster.route_policy import RouterConfig
from pdserve.cluster.router import Router
from pdserve.cluster.token_stream import TokenSubscriber
from pdserve.runner.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def stream_endpoint():
    """Where the decode workers stream tokens: a router's subscriber binds it when a test
    generates."""
    return free_endpoint()


@pytest.fixture(scope="module")
def pools(tiny_qwen3_dir, stream_endpoint):
    bounds = {"decode": (1, 3), "prefill": (1, 2)}
    with controller_on_ray(tiny_qwen3_dir, 1, bounds, stream_endpoint) as handle:
        yield handle


def _members(controller) -> dict[str, dict]:
    return {m["worker_id"]: m for m in ray.get(controller.members.remote(), timeout=30)}


def _wait(controller, predicate, what: str, timeout_s: float = 120) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        members = _members(controller)
        if predicate(members):
            return members
        assert time.monotonic() < deadline, f"{what}: {members}"
        time.sleep(0.3)


def test_scale_up_starts_workers_that_become_ready(pools):
    """Guards scale-up: new ids (never reused), "starting" until their info answers with
    the pool's KV layout, then "ready" and alive."""
    out = ray.get(pools.scale.remote("decode", 3), timeout=30)
    assert out == {"role": "decode", "replicas": 3, "started": ["decode-1", "decode-2"],
                   "draining": []}  # fmt: skip
    assert {_members(pools)[w]["state"] for w in out["started"]} <= {"starting", "ready"}
    members = _wait(
        pools, lambda ms: all(ms[w]["state"] == "ready" for w in out["started"]), "bring-up"
    )
    for w in out["started"]:
        assert members[w]["state"] == "ready"
        assert ray.get(members[w]["actor"].health.remote(), timeout=30)["alive"]
    events = [e["text"] for e in ray.get(pools.stats.remote(), timeout=30)["events"]]
    assert "decode-1 ready" in events and "decode-2 ready" in events


def test_scale_down_drains_the_newest_and_refuses_out_of_bounds(pools):
    """Guards scale-down and the bounds: the newest workers drain and leave; a count or
    role outside the bounds is a ValueError that changes nothing."""
    out = ray.get(pools.scale.remote("decode", 1), timeout=30)
    assert out["draining"] == ["decode-2", "decode-1"] and out["started"] == []
    _wait(pools, lambda ms: sorted(w for w in ms if w.startswith("decode")) == ["decode-0"],
          "drain")  # fmt: skip
    for role, n, fragment in [("decode", 4, r"\[1, 3\]"), ("decode", 0, r"\[1, 3\]"),
                              ("tier", 1, "role must be"), ("decode", True, "integer")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            ray.get(pools.scale.remote(role, n), timeout=30)
    assert sorted(_members(pools)) == ["decode-0", "prefill-0"]


def test_start_drain_keeps_the_minimum(pools):
    """Guards /ops/drain's rule: draining the last worker of a pool at its minimum is
    refused; an unknown id is refused; a drain of a surplus worker returns at once."""
    with pytest.raises(ValueError, match="fewer ready decode workers than the minimum"):
        ray.get(pools.start_drain.remote("decode-0"), timeout=30)
    with pytest.raises(ValueError, match="no worker"):
        ray.get(pools.start_drain.remote("decode-7"), timeout=30)
    ray.get(pools.scale.remote("prefill", 2), timeout=30)
    _wait(pools, lambda ms: ms.get("prefill-1", {}).get("state") == "ready", "prefill bring-up")
    start = time.monotonic()
    assert ray.get(pools.start_drain.remote("prefill-0"), timeout=30)["draining"]
    assert time.monotonic() - start < 5
    _wait(pools, lambda ms: "prefill-0" not in ms, "prefill drain")


def test_an_autoscaler_tick_resizes_through_the_router(pools):
    """Guards the autoscaler's wiring: a tick reads the real router's polled stats and
    asks the real controller. With a zero hold and cooldown, an empty decode pool reads
    "low" (shrinks to its minimum) and an impossible low mark reads "high" (grows)."""
    router = Router(RouterConfig(mode="pd"), [], [])
    control = PoolControl(pools)

    async def tick(cfg: AutoscaleConfig) -> dict:
        sync_members(router, await control.members())
        scaler = Autoscaler(cfg, {"decode": (1, 2), "prefill": (1, 1)})
        return await scaler.tick(control, router, time.monotonic())

    grow = AutoscaleConfig(up_after_s=0, cooldown_s=0, decode_waiting_high=-1)
    assert asyncio.run(tick(grow)) == {"decode": 2}
    _wait(pools, lambda ms: sum(m["role"] == "decode" and m["state"] == "ready" for m in ms.values()) == 2,
          "autoscaled bring-up")  # fmt: skip
    shrink = AutoscaleConfig(down_after_s=0, cooldown_s=0, decode_kv_low=2.0)
    assert asyncio.run(tick(shrink)) == {"decode": 1}
    _wait(
        pools, lambda ms: sum(m["role"] == "decode" for m in ms.values()) == 1, "autoscaled drain"
    )


def test_a_gone_controller_is_a_503_not_a_crash(pools, tiny_qwen3_dir):
    """Guards PoolControl: the ops endpoints answer a dead controller with the API's error
    shape (503), and a bad request in the live one with a 400."""
    spec = tiny_spec(tiny_qwen3_dir, "tcp://127.0.0.1:1")
    doomed = ray.remote(Controller).options(num_cpus=0).remote(spec)
    ray.get(doomed.stats.remote(), timeout=60)
    ray.kill(doomed, no_restart=True)
    deadline = time.monotonic() + 30
    while True:  # the kill lands asynchronously: a call just after it may still be served
        try:
            ray.get(doomed.stats.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed controller still answers"
        time.sleep(0.1)
    with pytest.raises(ApiError) as e:
        asyncio.run(PoolControl(doomed).members())
    assert e.value.status == 503 and "gone" in e.value.message
    with pytest.raises(ApiError) as e:
        asyncio.run(PoolControl(pools).scale("decode", 99))
    assert e.value.status == 400 and "[1, 3]" in e.value.message


def test_an_nccl_group_cannot_be_scaled(tiny_qwen3_dir):
    """Guards the nccl rule: its process group has a fixed world size."""
    c = Controller(tiny_spec(tiny_qwen3_dir, "tcp://127.0.0.1:1", kv_transport="nccl"))
    with pytest.raises(ValueError, match="fixed size"):
        asyncio.run(c.scale("decode", 2))
    assert c.members_ == {}


def _request(max_tokens: int) -> ParsedRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return ParsedRequest("completion", "m", [1, 2, 3, 4, 5], params, True, False, False, None)


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def test_the_router_remembers_a_reply_on_its_decode_worker(pools, stream_endpoint):
    """Guards the router's prefix index after a reply: the request's prompt and its reply
    (all but the last token, whose KV is never computed) count as cached on its decode
    worker, so a conversation's next turn, which resends both, is routed by all of it
    (route_policy.prefer_cached), not by its first prompt alone."""
    router = Router(RouterConfig(mode="colocated"), [], [])

    async def scenario() -> None:
        subscriber = TokenSubscriber(stream_endpoint, router.on_delta)
        subscriber.start()
        try:
            sync_members(router, await PoolControl(pools).members())
            req, output, routes = _request(40), [], []
            async for _, delta in router.generate(req, routes.append):
                output += delta.token_ids
            seq = req.prompt_token_ids + output
            assert len(output) == 40 and len(routes) == 1
            hit = router.prefix_index.hit_tokens(routes[0].decode, router.prefix_index.hashes(seq))
            assert hit == (len(seq) - 1) // 16 * 16 == 32
        finally:
            await router.close()
            await subscriber.close()

    asyncio.run(scenario())


def test_a_hybrids_router_counts_only_prompts_a_worker_computed(pools, stream_endpoint):
    """Guards RouterConfig.state_snapshots (a hybrid Mamba model: a worker's hit reaches
    only where it saved a state, the end of a prompt it prefilled or the last block
    boundary its reply crossed). A remotely prefilled prompt counts on its prefill worker,
    not on the decode worker that pulled it; a prompt a worker computed counts there; the
    reply (40 + 39 computed tokens: a state saved at 64) counts on the decode worker either way,
    and a prompt sharing only part of it reaches no further than the last state before."""
    prompt = [(7 * i) % 900 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    req = ParsedRequest("completion", "m", prompt, params, True, False, False, None)

    async def run(configs: list[RouterConfig]) -> list[tuple[Router, list]]:
        # One subscriber for both routers: a socket closes in zmq's I/O thread, so binding
        # the stream endpoint again at once may find it still taken.
        current: list[Router] = []
        subscriber = TokenSubscriber(stream_endpoint, lambda w, d: current[-1].on_delta(w, d))
        subscriber.start()
        results = []
        try:
            for config in configs:
                router = Router(config, [], [])
                current.append(router)
                try:
                    sync_members(router, await PoolControl(pools).members())
                    routes, output = [], []
                    async for _, delta in router.generate(req, routes.append):
                        output += delta.token_ids
                    assert len(output) == 40 and len(routes) == 1
                    results.append((router, routes, output))
                finally:
                    await router.close()
            return results
        finally:
            await subscriber.close()

    modes = [RouterConfig(mode=m, state_snapshots=True) for m in ("pd", "colocated")]
    (router, routes, output), colocated = asyncio.run(run(modes))
    index, hashes = router.prefix_index, router.prefix_index.hashes(prompt)
    assert routes[0].decision == "remote_prefill"
    assert index.hit_tokens(routes[0].decode, hashes) == 0
    assert index.hit_tokens(routes[0].prefill, hashes) == 32
    next_turn = index.hashes(prompt + output + [5] * 9)
    assert index.hit_tokens(routes[0].decode, next_turn) == 64
    assert index.hit_tokens(routes[0].prefill, next_turn) == 32
    router, routes, output = colocated
    index = router.prefix_index
    assert index.hit_tokens(routes[0].decode, index.hashes(prompt + output + [5] * 9)) == 64
    other_reply = index.hashes(prompt + [5] * 40)
    assert index.hit_tokens(routes[0].decode, other_reply) == 32  # the prompt's state only


def test_a_request_queued_for_a_decode_slot_goes_to_a_worker_added_by_scaling(
    pools, stream_endpoint
):
    """Guards the router's queue (cluster/decode_admission.py) with real workers: at one
    slot per decode worker, a second request waits in the router while a long one runs on
    the only routed worker (queued 1, also on /metrics); once the member list brings a
    second ready worker, the waiting request runs there at once, while the first still
    holds its slot, and both end with every token they asked for. The wait in the router
    is part of the second's queue time (its first delta's `queue_s`)."""
    new = ray.get(pools.scale.remote("decode", 2), timeout=30)["started"][0]
    _wait(pools, lambda ms: ms.get(new, {}).get("state") == "ready", "bring-up")
    router = Router(RouterConfig(mode="colocated", decode_capacity=1), [], [])
    routes, busy_when_routed = {}, {}

    def on_route(name: str):
        def hear(route) -> None:
            routes[name] = route
            if name == "b":  # is the first request still on its worker?
                busy_when_routed["a"] = router.load_of(routes["a"].decode)["inflight"]

        return hear

    async def tokens(stream) -> tuple[int, str | None, float | None]:
        n, reason, queued = 0, None, None
        async for _, delta in stream:
            n, reason = n + len(delta.token_ids), delta.finish_reason or reason
            queued = delta.queue_s if queued is None else queued
        return n, reason, queued

    async def scenario() -> None:
        members = await PoolControl(pools).members()
        subscriber = TokenSubscriber(stream_endpoint, router.on_delta)
        subscriber.start()
        try:
            sync_members(router, [m for m in members if m["worker_id"] != new])
            first = router.generate(_request(240), on_route("a"))
            _, delta = await anext(first)  # running on its worker
            second = asyncio.create_task(tokens(router.generate(_request(8), on_route("b"))))
            await _until(lambda: router.queued() == 1, "the second request queues")
            waiting = time.monotonic()
            assert "b" not in routes
            await asyncio.sleep(0.05)  # still queued: part of its queue time
            assert 'pdserve:router_requests_queued{model_name="m"} 1.0' in Metrics("m").render(
                router
            )
            waited = time.monotonic() - waiting  # at least: it was queued before and after
            sync_members(router, members)  # the new worker joins the router
            await _until(lambda: "b" in routes, "the queued request starts")
            assert routes["b"].decode == new and routes["a"].decode != new
            assert busy_when_routed == {"a": 1} and router.queued() == 0
            assert delta.queue_s < waited  # the first one did not wait in the router
            n, reason, _ = await tokens(first)
            assert (n + len(delta.token_ids), reason) == (240, "length")
            n, reason, queued = await second
            assert (n, reason) == (8, "length")
            assert waited <= queued < waited + 5.0, (queued, waited)
            assert all(router.load_of(m["worker_id"])["inflight"] == 0 for m in members)
        finally:
            await router.close()
            await subscriber.close()

    asyncio.run(scenario())
