"""KV transfer under faults: peers that die mid-stream, bytes that are wrong on the wire
in either direction, and 1,000 random interleavings of submit / step / hand-off / abort /
lease expiry between a prefill and a decode worker.

Every peer here is real: a serving process that crashes after its first frame, or is
SIGKILLed (tests/kv_source_proc.py), a raw ZMQ ROUTER in its own process that speaks the
protocol but breaks the reply stream, a raw DEALER that sends a live `KVSourceServer`
broken requests, and real engines on the tiny Qwen3 fixture.
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time

import kv_source_proc as sp
import msgpack
import pytest
import torch
import zmq
from conftest import DEVICE
from test_pd_engine import wait_for_tickets

from pdserve.decode.worker import DecodeWorker
from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.layout import KVLayout, MambaStateGroup, PagedGQAGroup, paged_cache_storage
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Error,
    Handshake,
    HandshakeOk,
    Heartbeat,
    Pull,
    Ticket,
    decode,
    encode,
)
from pdserve.kvtransfer.server import KVSourceServer
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillWorker
from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams

HYBRID = sp.LAYOUTS["hybrid"]
SRC_IDS = [[9, 2, 3, 4, 12], [7]]  # [group][unit]: attention blocks, one Mamba slot
DST_IDS = [[0, 10, 11, 5, 1], [3]]
SEED = 7


def _ticket(
    request_id: str, endpoint: str, layout_hash: str, ids=SRC_IDS, num_tokens=1, first_token=0
) -> Ticket:
    return Ticket(
        request_id, "P", endpoint, [list(g) for g in ids], num_tokens, layout_hash,
        time.time() + 3600, first_token, first_logprobs=None, finish_reason=None,
    )  # fmt: skip


def _spec(ticket: Ticket, dst_ids=DST_IDS) -> PullSpec:
    return PullSpec(ticket, tuple(map(tuple, dst_ids)), (0,) * len(dst_ids))


def _zeroed(layout: KVLayout = HYBRID, num_units: int = sp.NUM_UNITS):
    return tuple(g.allocate(num_units) for g in layout.groups)


def _untouched_outside(dst, dst_ids=DST_IDS) -> None:
    for g, storage in enumerate(dst):
        others = [u for u in range(storage.num_units) if u not in dst_ids[g]]
        for t in storage.tensors:
            assert not bitwise_view(t)[:, others].any(), f"group {g}: a unit outside was written"


def _source_spec(leases: dict, layout: str = "hybrid", num_units: int = sp.NUM_UNITS) -> dict:
    return {"layout": layout, "num_units": num_units, "seed": SEED, "leases": leases}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's matmuls gain nothing from a second thread, and on a shared 2-core
    box OpenMP's spinning threads make the step time swing tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _kw(model: str, **extra) -> dict:
    return dict(model=model, dtype="float32", device=DEVICE, **extra)


def _drive(step, has_work, timeout_s: float = 60.0) -> dict[str, tuple[list[int], str | None]]:
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    deadline = time.monotonic() + timeout_s
    while has_work():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for d in step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason
    return {rid: (toks, finish.get(rid)) for rid, toks in tokens.items()}


def _colocated(model: str, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    engine = Engine.from_args(**_kw(model))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = _drive(engine.step, engine.has_unfinished)
    return [out[str(i)][0] for i in range(len(prompts))]


def _fields_of(msg) -> dict:
    return msgpack.unpackb(encode(msg))["f"]


def _assert_pulled(dst) -> None:
    src = sp.fill_storages(HYBRID, sp.NUM_UNITS, SEED)
    for g in range(len(SRC_IDS)):
        for s, d in zip(src[g].tensors, dst[g].tensors, strict=True):
            assert torch.equal(bitwise_view(d)[:, DST_IDS[g]], bitwise_view(s)[:, SRC_IDS[g]])
    _untouched_outside(dst)


# ---- a peer that dies mid-transfer ---------------------------------------------------------


@pytest.mark.parametrize("death", ["exit", "sigkill"])
def test_peer_dying_mid_pull_raises_within_the_timeout(death):
    """Guards against a hang (or a silent half-success) when the prefill process dies
    after sending part of a stream: the receiver must raise TransferError within its
    timeout, and nothing outside the ticket's destination units may be written."""
    mode = "die" if death == "exit" else "stall"
    proc, info = sp.start({"mode": mode, "sources": [_source_spec({"r": SRC_IDS})]})
    killer = None
    if death == "sigkill":

        def kill_when_sent() -> None:
            if sp.read_line(proc, 30.0).strip() == "sent":
                os.kill(proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_sent, daemon=True)
        killer.start()
    transport = TcpTransport("D", HYBRID, layer_wise=True)
    timeout_s = 2.0
    try:
        dst = _zeroed()
        ticket = _ticket("r", info["endpoints"][0], info["hashes"][0])
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            transport.pull(_spec(ticket), dst, timeout_s)
        elapsed = time.monotonic() - start
        assert err.value.code == "timeout"
        assert elapsed < timeout_s + 1.0, f"a dead peer cost {elapsed:.1f} s"
        _untouched_outside(dst)
        if death == "exit":
            # The first frame (layer 0 of the attention K/V) landed before the crash: the
            # failure really was mid-stream, and the later layers were never written.
            src = sp.fill_storages(HYBRID, sp.NUM_UNITS, SEED)
            got, want = bitwise_view(dst[0].tensors[0]), bitwise_view(src[0].tensors[0])
            assert torch.equal(got[0, DST_IDS[0]], want[0, SRC_IDS[0]])
            assert not got[1:].any() and not dst[1].tensors[0].any()
    finally:
        transport.close()
        if killer is not None:
            killer.join(30.0)
        code = sp.stop(proc)
    assert code == (1 if death == "exit" else -signal.SIGKILL)


def test_decode_worker_recomputes_when_the_peer_dies_mid_pull(tiny_qwen3_dir):
    """Guards the decode side of a crash mid-transfer: the half-written blocks must not be
    decoded from (policy recompute gives the colocated greedy tokens), the failure is
    counted, and every block of the decode engine comes back."""
    prompt = [(7 * i + 3) % 990 + 3 for i in range(37)]  # 3 blocks, the last partial
    want = _colocated(tiny_qwen3_dir, [prompt])[0]
    decode_worker = None
    proc = None
    try:
        # The dying peer serves exactly the decode engine's layout, with random bits.
        engine = Engine.from_args(**_kw(tiny_qwen3_dir))
        layout, _ = paged_cache_storage(engine.config.model.source, engine.runner.kv_cache)
        transports = {"tcp": TcpTransport("D0", layout, layer_wise=True)}
        decode_worker = DecodeWorker(
            {}, "D0", transports, policy="recompute", timeout_s=1.0, engine=engine
        )
        ids = [list(range(math.ceil(len(prompt) / layout.groups[0].block_size)))]
        # Random bits with NaN payloads: the half-written blocks left past the context must
        # not poison the recomputed decode (masked V slots are zeroed before P @ V).
        spec = {"wire": layout.to_wire(), "num_units": 8, "seed": 3, "finite": False}
        proc, info = sp.start({"mode": "die", "sources": [{**spec, "leases": {"r": ids}}]})
        assert info["hashes"][0] == decode_worker.loader.layout_hash
        ticket = _ticket(
            "r", info["endpoints"][0], info["hashes"][0], ids, num_tokens=len(prompt),
            first_token=want[0],
        )  # fmt: skip
        decode_worker.submit("r", prompt, GREEDY, ticket)
        start = time.monotonic()
        got = _drive(decode_worker.step, decode_worker.has_work)
        assert time.monotonic() - start < 10.0, "a dead peer must cost about one timeout"
        assert got == {"r": (want, "length")}
        stats = decode_worker.loader.stats
        assert stats.errors["timeout"] == 1 and stats.recomputes == 1 and stats.loads == 0
        kv = decode_worker.engine.kv
        assert kv.num_free_blocks == kv.num_blocks - 1
        assert not decode_worker.engine.scheduler.loading
    finally:
        if decode_worker is not None:
            decode_worker.close()
        if proc is not None:
            assert sp.stop(proc) == 1  # it crashed on the Pull, as told


# ---- broken requests to a live server -------------------------------------------------------


def _rpc(sock: zmq.Socket, frames: list[bytes]) -> Error | object:
    sock.send_multipart(frames)
    assert sock.poll(10_000, zmq.POLLIN), "the server must answer every message"
    (reply,) = sock.recv_multipart()
    return decode(reply)


def _lease_snapshot(leases: LeaseTable) -> dict:
    with leases._lock:
        rows = {
            rid: (lease.group_unit_ids, lease.num_tokens, lease.expiry, lease.pins, lease.ended)
            for rid, lease in leases._leases.items()
        }
        return {"leases": rows, "counts": dict(leases.counts), "to_free": list(leases._to_free)}


def test_server_answers_broken_requests_with_errors_and_keeps_serving():
    """Guards the server against what a peer may send: every broken message (garbage,
    truncated, wrong version, oversized, multi-frame, wrong layout, unknown lease, ...)
    gets an Error with its code and a message that says what was wrong, the serving
    thread survives, the lease table is not disturbed, and a correct pull still works."""
    source = KVSource("P", HYBRID, sp.fill_storages(HYBRID, sp.NUM_UNITS, SEED), LeaseTable(60.0))
    source.leases.add("r", SRC_IDS, 1)
    server = KVSourceServer(source, max_message_bytes=4096)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    rng = random.Random(0)
    pull = Pull("r", source.layout_hash, False, [0, 0])
    wrong_version = msgpack.packb({"v": 99, "t": "pull", "f": _fields_of(pull)})
    other = KVLayout(
        "m",
        (
            PagedGQAGroup("attn", 2, 8, 1, 6, "bfloat16"),  # block_size 8, not 4
            MambaStateGroup("mamba", 2, (5, 3), (3, 7), "bfloat16", "float32"),
        ),
    )
    cases = [
        # (what, frames, code, words the message must contain, request id of the reply)
        ("garbage", [b"\xc1" + rng.randbytes(200)], "corrupt", ["cannot unpack"], ""),
        ("truncated", [encode(pull)[:-7]], "corrupt", ["cannot unpack"], ""),
        ("version", [wrong_version], "bad_version", ["99", f"expected {PROTOCOL_VERSION}"], ""),
        (
            "pull layout",
            [encode(Pull("r", "f" * 64, False, [0, 0]))],
            "layout_mismatch",
            [source.layout_hash[:12], "f" * 12],
            "r",
        ),
        (
            "handshake layout",
            [encode(Handshake("D", other.to_wire(), other.compat_hash()))],
            "layout_mismatch",
            ["block_size", "4 here vs 8"],
            "",
        ),
        (
            "handshake garbage layout",
            [encode(Handshake("D", {"x": 1}, "h"))],
            "layout_mismatch",
            ["exactly the fields"],
            "",
        ),
        (
            "oversized",
            [encode(Handshake("x" * 10_000, HYBRID.to_wire(), source.layout_hash))],
            "too_large",
            ["4096"],
            "",
        ),
        ("two frames", [encode(pull), encode(pull)], "corrupt", ["one message frame"], ""),
        (
            "unknown type",
            [msgpack.packb({"v": PROTOCOL_VERSION, "t": "explode", "f": {}})],
            "unknown_type",
            ["explode"],
            "",
        ),
        ("not a request", [encode(Ack("r"))], "unexpected", ["ack"], "r"),
        (
            "unknown lease",
            [encode(Pull("nobody", source.layout_hash, False, [0, 0]))],
            "unknown_lease",
            ["nobody"],
            "nobody",
        ),
        (
            "first_units",
            [encode(Pull("r", source.layout_hash, False, [0]))],
            "bad_pull",
            ["first_units"],
            "r",
        ),
        ("heartbeat", [encode(Heartbeat("nobody", 5.0))], "unknown_lease", ["nobody"], "nobody"),
    ]
    try:
        before = _lease_snapshot(source.leases)
        for what, frames, code, words, rid in cases:
            reply = _rpc(sock, frames)
            assert isinstance(reply, Error), f"{what}: got {reply}"
            assert reply.code == code, f"{what}: {reply}"
            assert reply.request_id == rid, f"{what}: {reply}"
            for word in words:
                assert word in reply.message, f"{what}: {word!r} not in {reply.message!r}"
        assert server.counts["errors"] == len(cases)
        assert _lease_snapshot(source.leases) == before, "a refused message changed the leases"
        # The same socket is still served, and a real pull is still bit-exact.
        ok = _rpc(sock, [encode(Handshake("D", HYBRID.to_wire(), source.layout_hash))])
        assert isinstance(ok, HandshakeOk)
        transport = TcpTransport("D", HYBRID)
        try:
            dst = _zeroed()
            ticket = _ticket("r", server.endpoint, source.layout_hash)
            transport.pull(_spec(ticket), dst, 10.0)
        finally:
            transport.close()
        _assert_pulled(dst)
        assert server.counts["pulls"] == 1
        assert _lease_snapshot(source.leases) == before
    finally:
        sock.close(linger=0)
        server.close()


# ---- broken replies to a client ------------------------------------------------------------

# breakage -> the TransferError code the puller must raise ("" = the pull must succeed)
BROKEN_REPLIES = {
    "ok": "",
    "bad_shape": "bad_frame",
    "bad_dtype": "bad_frame",
    "truncated_frame": "bad_frame",
    "bad_nbytes": "bad_frame",
    "bad_layers": "bad_frame",
    "bad_group": "bad_frame",
    "other_request": "bad_reply",
    "no_data_frame": "bad_frame",
    "ack_instead": "bad_frame",
    "garbage_reply": "corrupt",
    "short_done": "bad_frame",
    "missing_frame": "bad_frame",
    "duplicate_frame": "bad_frame",
}
# These fail on the first frame: nothing at all may have been written.
FAIL_FIRST = {"bad_shape", "bad_dtype", "truncated_frame", "bad_nbytes", "bad_layers",
              "bad_group", "other_request", "no_data_frame", "ack_instead", "garbage_reply"}  # fmt: skip


@pytest.fixture(scope="module")
def misbehaving_peer():
    assert set(BROKEN_REPLIES) == set(sp.BREAKAGES)
    leases = {name: SRC_IDS for name in sp.BREAKAGES}
    proc, info = sp.start({"mode": "misbehave", "sources": [_source_spec(leases)]})
    try:
        yield info["endpoints"][0], info["hashes"][0]
    finally:
        assert sp.stop(proc) == 0


@pytest.mark.parametrize("layer_wise", [False, True], ids=["whole", "layer_wise"])
@pytest.mark.parametrize("breakage", list(BROKEN_REPLIES))
def test_client_refuses_a_broken_reply_stream(misbehaving_peer, breakage, layer_wise):
    """Guards the puller against a peer whose reply does not match the pull: a frame of
    the wrong shape, dtype, size, layers or group, a reply for another request, a header
    without its frame, a stream with a frame missing or repeated. Each must raise
    TransferError with a stable code (never succeed with holes in the KV, never write
    outside the ticket's units), and a first-frame failure must write nothing."""
    endpoint, layout_hash = misbehaving_peer
    transport = TcpTransport("D", HYBRID, layer_wise=layer_wise)
    try:
        dst = _zeroed()
        ticket = _ticket(breakage, endpoint, layout_hash)
        code = BROKEN_REPLIES[breakage]
        if not code:
            transport.pull(_spec(ticket), dst, 10.0)
            _assert_pulled(dst)
            return
        with pytest.raises(TransferError) as err:
            transport.pull(_spec(ticket), dst, 10.0)
        assert err.value.code == code, str(err.value)
        _untouched_outside(dst)
        if breakage in FAIL_FIRST:
            assert not any(t.any() for s in dst for t in s.tensors), "a refused frame was written"
        # The transport dropped the socket it had: the next call starts clean.
        transport.release(_ticket("ok", endpoint, layout_hash), 10.0)
    finally:
        transport.close()


# ---- prefill / decode interleavings ----------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_pool(tiny_qwen3_dir):
    """Few short prompts (block size 16: one, two and three blocks, partial last blocks)
    and their colocated greedy outputs, computed once."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 990) for _ in range(n)] for n in (5, 16, 23, 40)]
    return prompts, _colocated(tiny_qwen3_dir, prompts, INTERLEAVE_PARAMS)


INTERLEAVE_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LEASE_S = 5.0
OPS = (
    ("submit", 12),
    ("step_prefill", 14),
    ("hand_off", 12),
    ("step_decode", 16),
    ("abort_prefill_running", 3),  # before its ticket (or a late abort of one that ended)
    ("abort_prefill_ticketed", 3),  # after its ticket, handed over or not
    ("abort_decode", 4),  # waiting for blocks, loading or decoding
    ("abort_loading", 3),
    ("abort_waiting", 2),  # handed over, not admitted yet: its load never started
    ("advance_clock", 4),
    ("step_both", 10),
)


@pytest.mark.parametrize("seed", [1234, 5, 77])
def test_random_interleavings_leak_nothing(tiny_qwen3_dir, prompt_pool, seed):
    """Guards leaks and races between the two sides over 1,000 seeded random operations
    (submit, step either side, hand a ticket over, abort on prefill before or after its
    ticket, abort on decode while waiting, loading or decoding, leases expiring under a
    fake clock): at the end no block is held or referenced on either side, no lease is
    left, nothing is still loading, every request ended once, and every output is a prefix
    of (finished: equal to) the colocated greedy output."""
    prompts, want = prompt_pool
    clock = [1000.0]
    registry = LocalRegistry()
    prefill = PrefillWorker(
        Engine.from_args(**_kw(tiny_qwen3_dir, num_gpu_blocks=24, max_model_len=64)),
        "P0",
        lease_s=LEASE_S,
        registry=registry,
    )
    prefill.leases._clock = lambda: clock[0]
    transport = LocalTransport(registry, prefill.source.layout_hash)
    decode_worker = DecodeWorker(
        _kw(tiny_qwen3_dir, num_gpu_blocks=9, max_model_len=64),
        "D0",
        {"local": transport},
        timeout_s=5.0,
    )
    rng = random.Random(seed)
    names, weights = zip(*OPS)
    prompt_of: dict[str, int] = {}
    tickets: dict[str, Ticket] = {}  # ready, not handed over yet
    prefill_end: dict[str, str] = {}  # rid -> "ticket" | finish reason
    handed: set[str] = set()
    lost: set[str] = set()
    aborted_on_decode: set[str] = set()
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    seen_ops = dict.fromkeys(names, 0)

    def step_prefill() -> None:
        for r in prefill.step():
            assert r.request_id not in prefill_end, f"{r.request_id} left prefill twice"
            if r.ticket is None:
                prefill_end[r.request_id] = r.finish_reason
                assert r.finish_reason == "abort", r
            else:
                prefill_end[r.request_id] = "ticket"
                assert r.ticket.first_token == want[prompt_of[r.request_id]][0]
                tickets[r.request_id] = r.ticket

    def step_decode() -> None:
        for d in decode_worker.step():
            assert d.request_id not in finish, f"{d.request_id} got tokens after finishing"
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason

    try:
        for i in range(1000):
            op = rng.choices(names, weights)[0]
            seen_ops[op] += 1
            if op == "submit":
                rid = f"q{i}"
                prompt_of[rid] = rng.randrange(len(prompts))
                prefill.submit(rid, prompts[prompt_of[rid]], INTERLEAVE_PARAMS)
            elif op == "step_prefill":
                step_prefill()
            elif op == "hand_off" and tickets:
                rid = rng.choice(sorted(tickets))
                ticket = tickets.pop(rid)
                if rng.random() < 0.1:
                    lost.add(rid)  # the router lost it: only the lease's expiry frees it
                    continue
                decode_worker.submit(rid, prompts[prompt_of[rid]], INTERLEAVE_PARAMS, ticket)
                handed.add(rid)
            elif op == "step_decode":
                step_decode()
            elif op == "abort_prefill_running" and prompt_of:
                running = sorted(set(prompt_of) - set(prefill_end))
                prefill.abort(rng.choice(running or sorted(prompt_of)))
            elif op == "abort_prefill_ticketed" and prefill_end:
                prefill.abort(rng.choice(sorted(prefill_end)))
            elif op == "abort_decode" and handed:
                rid = rng.choice(sorted(handed))
                if decode_worker.abort(rid):
                    aborted_on_decode.add(rid)
            elif op == "abort_loading":
                # Loading and not aborted yet (an aborted load stays until the loader stops).
                loading = set(decode_worker.engine.scheduler.loading) - aborted_on_decode
                if loading:
                    rid = rng.choice(sorted(loading))
                    assert decode_worker.abort(rid)
                    aborted_on_decode.add(rid)
            elif op == "abort_waiting":
                scheduler = decode_worker.engine.scheduler
                waiting = [r.request_id for r in scheduler.waiting if r.kv_ticket is not None]
                if waiting:
                    rid = rng.choice(sorted(waiting))
                    assert decode_worker.abort(rid)
                    aborted_on_decode.add(rid)
            elif op == "advance_clock":
                clock[0] += rng.choice([0.5, 1.5, LEASE_S + 0.1])
            elif op == "step_both":
                step_prefill()
                step_decode()

        # Drain, clock frozen: hand over every ticket and step both sides until decode is
        # idle and prefill is idle or waits for blocks that only an expiry can free
        # (leases of lost tickets). Closing the decode worker waits for its releases and
        # aborts; then only lost tickets may still hold leases.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the workers did not drain"
            for rid in sorted(tickets):
                decode_worker.submit(rid, prompts[prompt_of[rid]], INTERLEAVE_PARAMS, tickets[rid])
                handed.add(rid)
            tickets.clear()
            blocked = not prefill.engine.scheduler.num_running  # prompts fit in one step
            if not decode_worker.has_work() and (not prefill.has_work() or blocked):
                break
            step_prefill()
            step_decode()
        decode_worker.close()
        step_prefill()
        leased = {rid for rid in prompt_of if rid in prefill.leases}
        assert leased <= lost, f"requests the decode side ended kept leases: {leased - lost}"
        # Then let time pass: every lease expires, the waiting prompts run, and their
        # tickets (nobody takes them now) expire in turn.
        while prefill.has_work() or len(prefill.leases):
            assert time.monotonic() < deadline, "the prefill side did not drain"
            clock[0] += 2 * LEASE_S
            step_prefill()
    finally:
        decode_worker.close()
        prefill.close()

    assert all(n > 10 for n in seen_ops.values()), seen_ops
    for side, engine in (("prefill", prefill.engine), ("decode", decode_worker.engine)):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks - 1, f"{side} leaked blocks"
        assert engine.num_held == 0, f"{side} still holds blocks"
        assert not engine.scheduler.has_unfinished()
    assert len(prefill.leases) == 0
    assert not decode_worker.engine.scheduler.loading
    assert decode_worker.loader.num_inflight() == 0
    assert set(prefill_end) == set(prompt_of), "every prompt leaves prefill exactly once"
    assert set(finish) == handed, "every handed-over request finishes exactly once"
    for rid in handed:
        ref = want[prompt_of[rid]]
        assert out[rid] == ref[: len(out[rid])], f"{rid}: {out[rid]} is not a prefix of {ref}"
        if rid in aborted_on_decode:
            assert finish[rid] == "abort", (rid, finish[rid])
        else:
            assert finish[rid] == "length" and out[rid] == ref, (rid, out[rid], finish[rid])
    # Enough of each path ran for the test to mean something.
    assert len(handed) > 20 and len(aborted_on_decode) > 5
    assert sum(1 for r in handed if finish[r] == "length") > 10
    stats = decode_worker.loader.stats
    assert stats.loads > 10 and stats.recomputes > 0, stats
    assert set(stats.errors) <= {"unknown_lease", "lease_expired"}, stats.errors


def test_prefill_abort_during_a_transfer_frees_only_after_it(tiny_qwen3_dir):
    """Guards a use-after-free on the prefill side: an abort while a transfer reads the
    lease's blocks (pinned, as the server and the local transport pin them) must leave the
    blocks held until the transfer ends, also when the abort comes twice (a router retry)."""
    registry = LocalRegistry()
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", registry=registry)
    free0 = prefill.engine.kv.num_free_blocks
    prefill.submit("r", [(5 * i + 7) % 990 + 3 for i in range(40)], GREEDY)
    wait_for_tickets(prefill, 1, 60)
    with prefill.leases.pinned("r"):
        assert prefill.abort("r")
        prefill.abort("r")
        prefill.step()
        assert prefill.engine.num_held == 1, "blocks freed under a running transfer"
    prefill.step()
    assert prefill.engine.num_held == 0
    assert prefill.engine.kv.num_free_blocks == free0
    assert len(prefill.leases) == 0


def test_decode_abort_before_the_load_starts_ends_the_lease(tiny_qwen3_dir):
    """Guards a leak until lease expiry: a request aborted on the decode side while it
    still waits for admission (no load started, so the loader never saw its ticket) must
    abort the ticket's lease at once: the prefill side gets its blocks back now, not
    `lease_s` later, and nothing is pulled."""
    registry = LocalRegistry()
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", registry=registry)
    transport = LocalTransport(registry, prefill.source.layout_hash)
    decode_worker = DecodeWorker(_kw(tiny_qwen3_dir), "D0", {"local": transport})
    try:
        free0 = prefill.engine.kv.num_free_blocks
        prompt = [(3 * i + 11) % 990 + 3 for i in range(40)]
        prefill.submit("r", prompt, GREEDY)
        (result,) = wait_for_tickets(prefill, 1, 60)
        decode_worker.submit("r", prompt, GREEDY, result.ticket)
        assert decode_worker.abort("r")  # before any step: not admitted, nothing loading
        got = _drive(decode_worker.step, decode_worker.has_work)
        assert got == {"r": ([result.ticket.first_token], "abort")}
        deadline = time.monotonic() + 10
        while len(prefill.leases) and time.monotonic() < deadline:
            time.sleep(0.01)  # the abort may travel on the loader's thread
        prefill.step()
        assert prefill.leases.counts["aborted"] == 1
        assert prefill.engine.num_held == 0
        assert prefill.engine.kv.num_free_blocks == free0
        assert decode_worker.loader.stats.loads == 0
        kv = decode_worker.engine.kv
        assert kv.num_free_blocks == kv.num_blocks - 1
    finally:
        decode_worker.close()


def test_decode_makes_progress_when_loaded_requests_hold_every_block(tiny_qwen3_dir):
    """Guards a deadlock of the decode role: loads take blocks for the prompt only, so
    four 2-block prompts fill an 8-block cache, and after loading each needs a third
    block for its first decoded token. Nothing runs, so nothing frees a block; the
    scheduler must take blocks back from a loaded request (it recomputes) rather than
    wait forever, and every output must still be the colocated one."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 990) for _ in range(32)] for _ in range(4)]
    want = _colocated(tiny_qwen3_dir, prompts)
    registry = LocalRegistry()
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", registry=registry)
    transport = LocalTransport(registry, prefill.source.layout_hash)
    kw = _kw(tiny_qwen3_dir, num_gpu_blocks=9, max_model_len=64)
    decode_worker = DecodeWorker(kw, "D0", {"local": transport})
    try:
        for i, p in enumerate(prompts):
            prefill.submit(str(i), p, GREEDY)
        for r in sorted(wait_for_tickets(prefill, len(prompts), 60), key=lambda r: r.request_id):
            decode_worker.submit(r.request_id, prompts[int(r.request_id)], GREEDY, r.ticket)
        got = _drive(decode_worker.step, decode_worker.has_work, timeout_s=30)
        assert got == {str(i): (w, "length") for i, w in enumerate(want)}
        assert decode_worker.loader.stats.loads == len(prompts)
        kv = decode_worker.engine.kv
        assert kv.num_free_blocks == kv.num_blocks - 1
    finally:
        decode_worker.close()


def test_cuda_ipc_forgets_a_source_that_stops_answering():
    """Guards cuda_ipc against reading a dead prefill worker's memory: once a call to a
    source times out (a heartbeat here; any call alike), the transport drops that
    source's mapping and the copy set-up that holds it, so no later pull copies through
    the old mapping (the next one maps afresh, after a handshake). Runs on the CPU: the
    mapping is a stand-in storage, the silent source a real socket that never answers."""
    from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"cuda_ipc+tcp://127.0.0.1:{port}"
    transport = CudaIpcTransport("D", HYBRID)
    try:
        transport._mapped[endpoint] = _zeroed()  # as if mapped by an earlier pull
        pairs = transport._pairs
        ticket = _ticket("r", endpoint, HYBRID.compat_hash())
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            transport.heartbeat(ticket, 5.0, 0.3)
        assert err.value.code == "timeout" and time.monotonic() - start < 2.0
        assert endpoint not in transport._mapped and transport._pairs is not pairs
        assert not transport.forget(endpoint)  # nothing left to drop
    finally:
        transport.close()
        silent.close(linger=0)
