"""Prefill on engine A, KV transfer, decode on engine B == one engine doing both (greedy).

Real engines, real weights (the bundled SmolLM2 and a random tiny Qwen3), real transports
(`local`, and `tcp` over a loopback ZMQ socket), real leases and the host tier.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from conftest import DEVICE

from pdserve.cluster.serve_process import free_port
from pdserve.decode.lease_keeper import HEARTBEAT_TIMEOUT_S, LeaseKeeper
from pdserve.decode.worker import DecodeWorker
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.tier import HostKVTier
from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillResult, PrefillWorker
from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def wait_for_tickets(worker: PrefillWorker, n: int, timeout_s: float) -> list[PrefillResult]:
    """Step until `n` requests have left the prefill worker."""
    deadline = time.monotonic() + timeout_s
    out: list[PrefillResult] = []
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} prefills done in {timeout_s} s"
        out += worker.step()
    return out


def _kw(model: str | None, **extra) -> dict:
    return dict(model=model, dtype="float32", device=DEVICE, **extra)


def _prompts(n: int, vocab: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(step, has_work, timeout_s: float = 120.0) -> dict[str, list]:
    out: dict[str, list] = {}
    finish: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while has_work():
        assert time.monotonic() < deadline, "engine did not finish in time"
        for d in step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason
    return {k: (v, finish.get(k)) for k, v in out.items()}


def _colocated(model: str | None, prompts, params=GREEDY, **extra) -> dict:
    engine = Engine.from_args(**_kw(model, **extra))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    return _run(engine.step, engine.has_unfinished)


def _pd(prefill: PrefillWorker, decode: DecodeWorker, prompts, params=GREEDY) -> dict:
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, params)
    results = wait_for_tickets(prefill, len(prompts), timeout_s=120)
    for r in results:
        assert r.ticket is not None, r
        decode.submit(r.request_id, prompts[int(r.request_id)], params, r.ticket)
    return _run(decode.step, decode.has_work)


def _local_pair(model, tier=None, **extra):
    registry = LocalRegistry()
    prefill = PrefillWorker(
        Engine.from_args(**_kw(model, **extra)), "P0", registry=registry, tier=tier
    )
    transports = {"local": LocalTransport(registry, prefill.source.layout_hash)}
    decode = DecodeWorker(_kw(model, **extra), "D0", transports, tier=tier)
    return prefill, decode


def _free_after_release(prefill: PrefillWorker) -> int:
    prefill.step()  # frees what the decode side released
    return prefill.engine.kv.num_free_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pd_local_equals_colocated_smollm2(smollm_dir, async_scheduling):
    """Guards the whole hand-off on real weights: P's held blocks, the ticket's first
    token, B's block allocation and load, and decoding from a loaded prefix whose last
    block is partial. Any off-by-one in positions or slots changes greedy tokens."""
    prompts = _prompts(5, 49_000, seed=1, lo=7, hi=90)
    want = _colocated(smollm_dir, prompts, async_scheduling=async_scheduling)
    prefill, decode = _local_pair(smollm_dir, async_scheduling=async_scheduling)
    free0 = prefill.engine.kv.num_free_blocks
    got = _pd(prefill, decode, prompts)
    assert got == want
    assert decode.loader.stats.loads == len(prompts)
    assert decode.loader.stats.recomputes == 0
    assert _free_after_release(prefill) == free0, "released blocks must return to P's pool"
    assert decode.engine.kv.num_free_blocks == decode.engine.kv.num_blocks - 1


def test_pd_tcp_equals_colocated_tiny_qwen3(tiny_qwen3_dir):
    """The same over a real ZMQ socket, layer-wise frames: frames are checked and
    scattered per layer, so a layer or unit mix-up shows as different tokens."""
    prompts = _prompts(6, 990, seed=2, lo=3, hi=70)
    want = _colocated(tiny_qwen3_dir, prompts)
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0")
    try:
        layout = prefill.source.layout
        decode = DecodeWorker(
            _kw(tiny_qwen3_dir), "D0", {"tcp": TcpTransport("D0", layout, layer_wise=True)}
        )
        free0 = prefill.engine.kv.num_free_blocks
        assert _pd(prefill, decode, prompts) == want
        assert decode.loader.stats.bytes_pulled > 0
        assert _free_after_release(prefill) == free0
        assert prefill.server.counts["errors"] == 0
    finally:
        prefill.close()


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_deepseek_v3_dir"])
def test_decode_loads_from_tier_instead_of_prefill(fixture, request):
    """Guards the tier path: B gets the prompt's full blocks from the tier (written behind
    by A earlier), computes only the partial tail itself, and decodes the same tokens.
    No ticket and no transfer from A are involved. Paged GQA blocks, and an MLA model's
    latent blocks (the `paged_mla` group) through the same tier."""
    model = request.getfixturevalue(fixture)
    prompts = _prompts(4, 990, seed=3, lo=40, hi=80)
    want = _colocated(model, prompts)
    tier = HostKVTier(byte_budget=64 << 20)
    prefill, decode = _local_pair(model, tier=tier)
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    for r in wait_for_tickets(prefill, len(prompts), 60):
        prefill.abort(r.request_id)  # A hands nothing over: only the tier has its KV
    assert prefill.engine.num_held == 0
    expected_blocks = sum(len(p) // 16 for p in prompts)
    assert prefill.num_tier_blocks == expected_blocks
    for i, p in enumerate(prompts):
        decode.submit(str(i), p, GREEDY, ticket=None)
    got = _run(decode.step, decode.has_work)
    assert got == want
    assert decode.loader.stats.tier_blocks == expected_blocks
    assert decode.loader.stats.loads == 0  # nothing was pulled from a prefill worker


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_ticket_over_a_device_path_skips_the_tier(tiny_qwen3_dir, transport):
    """Guards where a ticketed load reads from when the tier also has the prompt (the
    prefill worker wrote it behind): over a device path (local here; cuda_ipc and nccl
    alike) it pulls every block from the prefill worker and never touches the tier; over
    tcp it takes the tier's full blocks and pulls only the partial tail. Tokens equal the
    colocated run's either way."""
    prompts = _prompts(3, 990, seed=5, lo=40, hi=80)
    want = _colocated(tiny_qwen3_dir, prompts)
    tier = HostKVTier(byte_budget=64 << 20)
    if transport == "local":
        prefill, decode = _local_pair(tiny_qwen3_dir, tier=tier)
    else:
        prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", tier=tier)
        tcp = TcpTransport("D0", prefill.source.layout)
        decode = DecodeWorker(_kw(tiny_qwen3_dir), "D0", {"tcp": tcp}, tier=tier)
    try:
        full_blocks = sum(len(p) // 16 for p in prompts)
        assert _pd(prefill, decode, prompts) == want
        assert prefill.num_tier_blocks == full_blocks  # the tier had every full block
        assert decode.loader.stats.loads == len(prompts) and decode.loader.stats.recomputes == 0
        tier_stats = tier.stats()
        if transport == "local":
            assert decode.loader.stats.tier_blocks == 0 and tier_stats["hits"] == 0
            assert tier_stats["misses"] == 0, "the tier was not even asked"
        else:
            assert decode.loader.stats.tier_blocks == full_blocks
            tail_bytes = sum(-(-len(p) // 16) - len(p) // 16 for p in prompts)
            unit = prefill.source.layout.groups[0].unit_bytes()
            assert decode.loader.stats.bytes_pulled == tail_bytes * unit
    finally:
        prefill.close()


def test_dead_prefill_endpoint_recomputes_or_fails(tiny_qwen3_dir):
    """Guards the failure policies: a ticket whose prefill worker is gone must neither hang
    nor decode from garbage. `recompute` gives the colocated tokens; `fail` ends the
    request with finish reason "error"; both are counted and every block comes back."""
    prompts = _prompts(2, 990, seed=4, lo=20, hi=40)
    want = _colocated(tiny_qwen3_dir, prompts)
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0")
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    tickets = {r.request_id: r.ticket for r in wait_for_tickets(prefill, len(prompts), 60)}
    prefill.close()  # the peer is gone: pulls time out
    layout = prefill.source.layout
    for policy in ("recompute", "fail"):
        decode = DecodeWorker(
            _kw(tiny_qwen3_dir),
            "D0",
            {"tcp": TcpTransport("D0", layout)},
            policy=policy,
            timeout_s=0.5,
        )
        for i, p in enumerate(prompts):
            decode.submit(str(i), p, GREEDY, tickets[str(i)])
        start = time.monotonic()
        got = _run(decode.step, decode.has_work, timeout_s=30)
        assert time.monotonic() - start < 10, "a dead peer must cost about one timeout"
        assert decode.loader.stats.errors["timeout"] == len(prompts)
        if policy == "recompute":
            assert got == want
            assert decode.loader.stats.recomputes == len(prompts)
        else:
            assert {k: v[1] for k, v in got.items()} == {"0": "error", "1": "error"}
            assert all(len(v[0]) == 1 for v in got.values())  # only the ticket's token
            assert decode.loader.stats.fails == len(prompts)
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.num_blocks - 1
        decode.close()


def test_a_recomputed_prompt_reports_what_was_cached_where_it_ran(tiny_qwen3_dir):
    """Guards usage honesty after a failed load: the ticket says the prefill side found 32+
    prompt tokens cached, and the first delta (the ticket's token) reports that; once the
    decode side computes the prompt itself (nothing cached there), a later delta revises
    the count to 0, and the router's fold of the deltas ends at 0, not at the max."""
    from pdserve.cluster.token_stream import delta_from_engine

    prompt = _prompts(1, 990, seed=6, lo=50, hi=50)[0]
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0")
    prefill.submit("warm", prompt, GREEDY)
    wait_for_tickets(prefill, 1, 60)
    prefill.submit("0", prompt, GREEDY)  # the same prompt again: a prefix hit over there
    (result,) = wait_for_tickets(prefill, 1, 60)
    assert result.ticket.num_cached_tokens >= 32
    layout = prefill.source.layout
    prefill.close()  # the peer is gone: the pull times out
    decode = DecodeWorker(
        _kw(tiny_qwen3_dir), "D0", {"tcp": TcpTransport("D0", layout)}, timeout_s=0.5
    )
    try:
        decode.submit("0", prompt, GREEDY, result.ticket)
        deltas, deadline = [], time.monotonic() + 30
        while decode.has_work():
            assert time.monotonic() < deadline
            deltas += decode.step()
        assert decode.loader.stats.recomputes == 1
        assert deltas[0].num_cached_tokens == result.ticket.num_cached_tokens
        revised = [d for d in deltas if d.cached_revised]
        assert len(revised) == 1 and revised[0].num_cached_tokens == 0
        reported = 0
        for d in deltas:
            reported = delta_from_engine(d).cached_after(reported)
        assert reported == 0
    finally:
        decode.close()


def test_a_lease_gone_by_the_release_fails_a_direct_copy(tiny_qwen3_dir):
    """Guards cuda_ipc's proof of a good copy: a direct copy reads the source's memory
    with nothing on the wire, so the release after it must be acknowledged (the lease was
    live, the blocks not freed meanwhile). Here a real tcp transport stands in with the
    cuda_ipc policy, and the lease of one request ends between its pull and its release:
    the source answers `lease_gone`, that load counts as failed and recomputes, the other
    loads stand, and the tokens equal the colocated run's."""
    prompts = _prompts(3, 990, seed=6, lo=30, hi=60)
    want = _colocated(tiny_qwen3_dir, prompts)
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0")

    class DirectCopyPolicy(TcpTransport):
        release_confirms_copy = True

        def pull(self, spec, dst, timeout_s, cancel=None):
            moved = super().pull(spec, dst, timeout_s, cancel)
            if spec.ticket.request_id == "1":  # its lease ends before the release
                prefill.leases.release("1", "aborted")
            return moved

    try:
        transport = DirectCopyPolicy("D0", prefill.source.layout)
        decode = DecodeWorker(_kw(tiny_qwen3_dir), "D0", {"tcp": transport})
        assert _pd(prefill, decode, prompts) == want
        stats = decode.loader.stats
        assert stats.errors["source_lost"] == 1 and stats.errors["release_lease_gone"] == 1
        assert stats.recomputes == 1 and stats.loads == len(prompts) - 1
        assert prefill.server.counts["errors"] == 1
    finally:
        prefill.close()


def test_lease_expiry_frees_prefill_blocks(tiny_qwen3_dir):
    """Guards against a decode worker that never comes: the prefill side's blocks must
    return to its pool when the lease expires, and a late pull must be refused."""
    clock = [1000.0]
    registry = LocalRegistry()
    prefill = PrefillWorker(
        Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", lease_s=5.0, registry=registry
    )
    prefill.leases._clock = lambda: clock[0]
    free0 = prefill.engine.kv.num_free_blocks
    prompts = _prompts(3, 990, seed=5, lo=30, hi=50)
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    results = wait_for_tickets(prefill, 3, 60)
    assert prefill.engine.kv.num_free_blocks < free0
    clock[0] += 4.0
    prefill.step()
    assert prefill.engine.num_held == 3, "leases must not expire early"
    clock[0] += 2.0
    prefill.step()
    assert prefill.engine.num_held == 0
    assert prefill.engine.kv.num_free_blocks == free0
    assert prefill.leases.counts["expired"] == 3
    transport = LocalTransport(registry, prefill.source.layout_hash)
    decode = DecodeWorker(_kw(tiny_qwen3_dir), "D0", {"local": transport})
    decode.submit("0", prompts[0], GREEDY, results[0].ticket)
    got = _run(decode.step, decode.has_work)
    assert decode.loader.stats.errors["unknown_lease"] == 1
    assert got["0"] == _colocated(tiny_qwen3_dir, prompts[:1])["0"]


@pytest.mark.parametrize("keep", [True, False])
def test_a_request_queued_on_decode_keeps_its_lease(tiny_qwen3_dir, keep):
    """Guards a wasted prefill: a request that waits on the decode worker (its one slot
    busy) for twice the prefill side's lease must still find its KV there, because the
    decode worker extends the lease while it waits; without the keeper the lease expires
    and the decode worker computes the prompt again (the case the keeper is for)."""
    registry = LocalRegistry()
    prefill = PrefillWorker(
        Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", lease_s=1.0, registry=registry
    )
    transport = LocalTransport(registry, prefill.source.layout_hash)
    decode = DecodeWorker(
        _kw(tiny_qwen3_dir, max_num_seqs=1), "D0", {"local": transport},
        keep_leases_s=0.2 if keep else None,
    )  # fmt: skip
    try:
        prompts = _prompts(2, 990, seed=8, lo=40, hi=40)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i, p in enumerate(prompts):
            prefill.submit(str(i), p, params)
        for r in wait_for_tickets(prefill, 2, 60):
            decode.submit(r.request_id, prompts[int(r.request_id)], params, r.ticket)

        def step():
            time.sleep(0.05)  # the first request's 40 steps: ~2 s, twice the lease
            prefill.step()  # where leases expire
            return decode.step()

        got = _run(step, decode.has_work)
        assert got == _colocated(tiny_qwen3_dir, prompts, params)
        stats = decode.loader.stats
        if keep:
            assert prefill.leases.counts["expired"] == 0
            assert (stats.loads, stats.recomputes) == (2, 0), stats
            assert decode.lease_keeper.extended >= 3
        else:
            assert prefill.leases.counts["expired"] == 1
            assert (stats.loads, stats.recomputes) == (1, 1), stats
        assert prefill.engine.num_held == 0
    finally:
        decode.close()
        prefill.close()


def test_the_lease_keeper_waits_for_a_silent_prefill_worker_once(tiny_qwen3_dir):
    """Guards against one dead prefill worker starving the others' leases: a round with
    five tickets of a tcp endpoint nobody answers and one live local ticket waits out one
    heartbeat timeout, not five, and still extends the live lease; close returns at once."""
    registry = LocalRegistry()
    prefill = PrefillWorker(
        Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", lease_s=30.0, registry=registry
    )
    keeper = LeaseKeeper(
        {"local": LocalTransport(registry, prefill.source.layout_hash),
         "tcp": TcpTransport("D0", prefill.source.layout)},
        every_s=20.0,
    )  # fmt: skip
    try:
        prefill.submit("live", _prompts(1, 990, seed=9)[0], GREEDY)
        (result,) = wait_for_tickets(prefill, 1, 60)
        dead = f"tcp://127.0.0.1:{free_port()}"
        ghosts = [
            dataclasses.replace(result.ticket, request_id=f"ghost-{i}", endpoint=dead)
            for i in range(5)
        ]
        expiry = prefill.leases.extend("live", 0.0)
        start = time.monotonic()
        assert keeper.due()
        keeper.start([*ghosts, None, "tier-only", result.ticket])  # not tickets: skipped
        assert not keeper.due()  # the next round is every_s away
        keeper._round.result(timeout=30)
        assert time.monotonic() - start < 2 * HEARTBEAT_TIMEOUT_S
        assert (keeper.extended, dict(keeper.errors)) == (1, {"timeout": 1})
        assert prefill.leases.extend("live", 0.0) >= expiry + 25  # now + 3 x every_s
        # A lease with more than 2 x every_s left is not worth a message yet.
        patient = LeaseKeeper({"local": LocalTransport(registry, prefill.source.layout_hash)}, 1.0)
        patient.start([result.ticket])
        assert patient._round is None and patient.extended == 0
        patient.close()
    finally:
        start = time.monotonic()
        keeper.close()
        assert time.monotonic() - start < 1.0
        prefill.close()


def test_abort_while_loading_frees_blocks_after_the_load(tiny_qwen3_dir):
    """Guards a use-after-free: a request aborted while its KV is being written must keep
    its blocks until the loader stops, then free all of them."""
    registry = LocalRegistry()
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", registry=registry)
    transport = LocalTransport(registry, prefill.source.layout_hash)
    decode = DecodeWorker(_kw(tiny_qwen3_dir), "D0", {"local": transport})
    prompt = _prompts(1, 990, seed=6, lo=60, hi=60)[0]
    prefill.submit("r", prompt, GREEDY)
    (result,) = wait_for_tickets(prefill, 1, 60)
    decode.submit("r", prompt, GREEDY, result.ticket)
    decode.step()  # admits it: blocks allocated, load started
    assert "r" in decode.engine.scheduler.loading
    assert decode.abort("r")
    total = decode.engine.kv.num_blocks - 1
    _run(decode.step, decode.has_work)
    assert decode.engine.kv.num_free_blocks == total
    assert not decode.engine.scheduler.loading
    prefill.step()
    assert prefill.engine.num_held == 0


def test_first_token_that_ends_the_request_releases_the_ticket(tiny_qwen3_dir):
    """Guards stop checks on the ticket's token: max_tokens=1 ends the request on the
    decode side at once, nothing is loaded, and the prefill side gets its blocks back."""
    registry = LocalRegistry()
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", registry=registry)
    free0 = prefill.engine.kv.num_free_blocks
    decode = DecodeWorker(
        _kw(tiny_qwen3_dir),
        "D0",
        {"local": LocalTransport(registry, prefill.source.layout_hash)},
    )
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = _prompts(1, 990, seed=7)[0]
    prefill.submit("r", prompt, one)
    (result,) = wait_for_tickets(prefill, 1, 60)
    decode.submit("r", prompt, one, result.ticket)
    got = _run(decode.step, decode.has_work)
    assert got == {"r": ([result.ticket.first_token], "length")}
    assert decode.loader.stats.loads == 0
    assert _free_after_release(prefill) == free0


def test_lease_table_pins_defer_release():
    """Guards a read of freed blocks: a release during a pinned transfer takes effect
    only when the transfer ends."""
    table = LeaseTable(10.0)
    table.add("r", [[1, 2]], 20)
    with table.pinned("r"):
        assert table.release("r")
        assert table.drain_freeable() == []
    assert table.drain_freeable() == ["r"]
    assert not table.release("r")


def test_an_abort_that_comes_before_its_submit_drops_the_request(tiny_qwen3_dir):
    """Ray runs an async actor's calls out of order, so a client that hangs up at once can
    have its abort reach the decode worker before its submit. The submit that follows is
    dropped (it would otherwise decode to max_tokens for nobody) and its ticket aborted, so
    the prefill side frees the prompt's blocks at once; other requests run as before. A
    prefill worker drops a prompt whose abort came first the same way."""
    prefill, decode = _local_pair(tiny_qwen3_dir)
    free0 = prefill.engine.kv.num_free_blocks
    prompts = _prompts(2, 990, seed=5)
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    tickets = {r.request_id: r.ticket for r in wait_for_tickets(prefill, 2, timeout_s=120)}
    held = _free_after_release(prefill)  # both prompts' blocks held for the decode side
    assert decode.abort("0") is False  # not submitted yet
    decode.submit("0", prompts[0], GREEDY, tickets["0"])
    assert not decode.has_work() and "0" not in decode.early_aborts
    assert held < _free_after_release(prefill) < free0  # "0"'s freed, "1"'s still held
    decode.submit("1", prompts[1], GREEDY, tickets["1"])
    got = _run(decode.step, decode.has_work)
    assert set(got) == {"1"} and len(got["1"][0]) == GREEDY.max_tokens
    assert _free_after_release(prefill) == free0
    # colocated (no ticket) alike; the memory of early aborts is bounded
    decode.abort("2")
    decode.submit("2", prompts[0], GREEDY, None)
    assert not decode.has_work()
    limit = decode.early_aborts.limit
    for i in range(limit + 1):
        decode.abort(f"gone-{i}")
    assert len(decode.early_aborts) == limit and "gone-0" not in decode.early_aborts
    assert "gone-1" in decode.early_aborts
    # the prefill worker alike: a prompt whose abort came first does not run
    assert prefill.abort("3") is False and prefill.submit("3", prompts[0], GREEDY) is False
    assert not prefill.has_work() and "3" not in prefill.early_aborts
    assert prefill.submit("4", prompts[0], GREEDY) is True
    assert [r.request_id for r in wait_for_tickets(prefill, 1, timeout_s=120)] == ["4"]
