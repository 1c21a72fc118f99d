"""Layer-wise early tickets: the ticket leaves the prefill worker before the forward, the
source streams each layer once the forward has marked it, and the stream's end brings
the first token. Real sockets (tcp on loopback), real leases, real engines on CPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_pd_engine import GREEDY, _colocated, _kw, _prompts, _run

from pdserve.decode.worker import DecodeWorker
from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.layer_marks import LayerMarks
from pdserve.kvtransfer.layout import KVLayout, PagedGQAGroup
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.server import KVSourceServer
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillResult, PrefillWorker
from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams

_GROUP = PagedGQAGroup("kv", 4, 4, 2, 8, "float32")
_LAYOUT = KVLayout("tiny", (_GROUP,))
_SRC_IDS, _DST_IDS = [5, 1, 6], [0, 7, 3]


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


class _Source:
    """A served storage with one early lease (marks not done) and a puller thread."""

    def __init__(self, lease_s: float = 30.0, layer_wise: bool = True) -> None:
        self.storage = _GROUP.allocate(8)
        for t in self.storage.tensors:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(3)))
        self.marks = LayerMarks(_GROUP.num_layers, torch.device("cpu"))
        self.leases = LeaseTable(lease_s)
        lease = self.leases.add("r", [_SRC_IDS], 12, self.marks)
        self.server = KVSourceServer(KVSource("P", _LAYOUT, (self.storage,), self.leases))
        ticket = Ticket(
            "r", "P", self.server.endpoint, [_SRC_IDS], 12, _LAYOUT.compat_hash(),
            lease.expiry, None, None, None,
        )  # fmt: skip
        self.dst = (_GROUP.allocate(8),)
        self.transport = TcpTransport("D", _LAYOUT, layer_wise=layer_wise)
        self.result: list = []
        spec = PullSpec(ticket, (tuple(_DST_IDS),), (0,))
        self.thread = threading.Thread(target=self._pull, args=(spec,), daemon=True)
        self.thread.start()

    def _pull(self, spec: PullSpec) -> None:
        try:
            self.result.append(self.transport.pull_early(spec, self.dst, timeout_s=20))
        except TransferError as e:
            self.result.append(e)

    @property
    def layer_bytes(self) -> int:
        return len(_SRC_IDS) * self.storage.flat()[0].shape[2] * 4

    def close(self) -> None:
        self.thread.join(25)
        self.transport.close()
        self.server.close()


@pytest.mark.parametrize("layer_wise", [True, False], ids=["layer_wise", "whole"])
def test_a_stream_sends_each_layer_only_once_the_forward_marked_it(layer_wise):
    """Guards the early stream: layer l must not leave before the forward marked it (its
    KV is still being written), must leave as soon as it is marked (layer-wise), the
    stream must not end before the first token is known, and what lands equals the
    source bit for bit. A whole-tensor pull waits for every layer instead."""
    src = _Source(layer_wise=layer_wise)
    try:
        time.sleep(0.05)
        assert src.server.counts["bytes"] == 0 and not src.result
        for layer in range(_GROUP.num_layers):
            src.marks.done(layer)
            if layer_wise:
                _until(lambda n=layer + 1: src.server.counts["bytes"] == n * src.layer_bytes)
            else:
                time.sleep(0.01)
                want = _GROUP.num_layers * src.layer_bytes if layer == 3 else 0
                _until(lambda w=want: src.server.counts["bytes"] == w)
        time.sleep(0.05)
        assert not src.result, "the stream ended before the first token was known"
        src.leases.complete("r", 42, [[42, -0.5, 1]])
        _until(lambda: bool(src.result))
        moved, token, rows = src.result[0]
        assert (token, rows) == (42, [[42, -0.5, 1]])
        assert moved == _GROUP.num_layers * src.layer_bytes
        (got,), (want,) = src.dst[0].flat(), src.storage.flat()
        for s, d in zip(_SRC_IDS, _DST_IDS):
            assert torch.equal(bitwise_view(got[:, d]), bitwise_view(want[:, s]))
        assert src.server.counts["errors"] == 0
    finally:
        src.close()


def test_a_prompt_that_ends_without_a_token_fails_its_stream_at_once():
    """Guards a stream whose prompt was aborted after its early ticket went out: the puller
    must get an error promptly (and recompute), not wait out its timeout."""
    src = _Source()
    try:
        src.marks.done(0)
        start = time.monotonic()
        src.leases.fail_pending("r", "prompt ended: abort")
        _until(lambda: bool(src.result))
        assert isinstance(src.result[0], TransferError) and src.result[0].code == "prompt_ended"
        assert time.monotonic() - start < 2.0
    finally:
        src.close()


def test_a_stream_whose_forward_never_ends_stops_at_the_lease():
    """Guards the source side's wait: a forward that never marks its layers (a hung or
    crashed step) must not keep the stream, and the lease's pin, forever: the stream ends
    with an error at the lease's expiry, and the lease can then expire."""
    src = _Source(lease_s=0.4)
    try:
        _until(lambda: bool(src.result), timeout_s=5.0)
        assert isinstance(src.result[0], TransferError) and src.result[0].code == "timeout"
        _until(lambda: bool(src.leases.expire()) or "r" not in src.leases, timeout_s=2.0)
        assert "r" not in src.leases
    finally:
        src.close()


# ---- engines ----------------------------------------------------------------------------


def _early_pair(model: str, on_ticket=None, **extra):
    prefill = PrefillWorker(Engine.from_args(**_kw(model, **extra)), "P0", early_tickets=True)
    prefill.on_early_ticket = on_ticket
    tcp = TcpTransport("D0", prefill.source.layout, layer_wise=True)
    decode = DecodeWorker(_kw(model, **extra), "D0", {"tcp": tcp})
    return prefill, decode


def _pd_early(prefill: PrefillWorker, decode: DecodeWorker, prompts, params=GREEDY) -> dict:
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, params)
    tickets: list[PrefillResult] = []
    deadline = time.monotonic() + 120
    while len(tickets) < len(prompts):
        assert time.monotonic() < deadline, "early tickets did not all come"
        tickets += [r for r in prefill.step() if r.ticket is not None]
    for r in tickets:
        assert r.ticket.first_token is None, "an early ticket carries no first token"
        decode.submit(r.request_id, prompts[int(r.request_id)], params, r.ticket)

    def both():  # the prefill side must keep stepping: it samples the first tokens
        if prefill.has_work():
            prefill.step()
        return decode.step()

    return _run(both, lambda: prefill.has_work() or decode.has_work())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_early_tickets_equal_colocated_tiny_qwen3(tiny_qwen3_dir, async_scheduling):
    """Guards the whole early hand-off: the ticket leaves at the last chunk's schedule
    (prompts of 3-70 tokens in chunks of 16), the decode side allocates for a prompt with
    no token yet, the stream brings the first token, and decoding continues from it.
    Greedy tokens equal one engine doing both; a max_tokens=1 request ends with the
    token the stream brought; every block returns to both pools."""
    prompts = _prompts(6, 990, seed=7, lo=3, hi=70)
    extra = dict(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    want = _colocated(tiny_qwen3_dir, prompts, **extra)
    prefill, decode = _early_pair(tiny_qwen3_dir, **extra)
    try:
        free0 = prefill.engine.kv.num_free_blocks
        assert _pd_early(prefill, decode, prompts) == want
        assert decode.loader.stats.loads == len(prompts)
        assert decode.loader.stats.recomputes == 0
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        want_one = _colocated(tiny_qwen3_dir, prompts[:2], one, **extra)
        assert _pd_early(prefill, decode, prompts[:2], one) == want_one
        prefill.step()
        assert prefill.engine.kv.num_free_blocks == free0
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.num_blocks - 1
        assert prefill.server.counts["errors"] == 0
    finally:
        prefill.close()
        decode.close()


def test_early_tickets_equal_colocated_smollm2(smollm_dir):
    """The same on the bundled SmolLM2's real weights (30 layers streamed per prompt)."""
    prompts = _prompts(3, 49_000, seed=8, lo=20, hi=90)
    want = _colocated(smollm_dir, prompts)
    prefill, decode = _early_pair(smollm_dir)
    try:
        assert _pd_early(prefill, decode, prompts) == want
        assert decode.loader.stats.recomputes == 0
    finally:
        prefill.close()
        decode.close()


def test_a_relayed_first_token_is_emitted_while_the_kv_loads(tiny_qwen3_dir):
    """Guards the first-token relay (`Engine.add_first_token`, `--kv-layer-wise` in
    `pdserve serve`): the prefill worker reports each early request's first token as it is
    sampled; handed to the decode worker while the request is still loading, it is emitted
    on the next step, before the load's result is processed, and exactly once (the copy
    that ends the pull is not emitted again). Greedy tokens equal one engine doing both,
    a late or unknown relay is refused, and every block returns."""
    prompts = _prompts(4, 990, seed=11, lo=20, hi=60)
    want = _colocated(tiny_qwen3_dir, prompts)
    firsts: dict[str, tuple] = {}
    prefill, decode = _early_pair(tiny_qwen3_dir)
    prefill.on_first_token = lambda rid, token, rows, why: firsts.setdefault(rid, (token, rows))
    try:
        free0 = prefill.engine.kv.num_free_blocks
        for i, p in enumerate(prompts):
            prefill.submit(str(i), p, GREEDY)
        tickets: list[PrefillResult] = []
        deadline = time.monotonic() + 60
        while len(firsts) < 4:  # tickets first (before each forward), then the tokens
            assert time.monotonic() < deadline, "the first tokens were not all sampled"
            tickets += [r for r in prefill.step() if r.ticket is not None]
        assert len(tickets) == 4 and all(r.ticket.first_token is None for r in tickets)
        for r in tickets:
            decode.submit(r.request_id, prompts[int(r.request_id)], GREEDY, r.ticket)
        calls = 0

        def step():
            nonlocal calls
            calls += 1
            out = decode.step()
            if calls == 1:  # admitted: every request loads; nothing emitted yet
                assert not out and set(decode.engine.scheduler.loading) == set(firsts)
                for rid, (token, rows) in firsts.items():
                    assert decode.first_token(rid, token, rows)
            elif calls == 2:  # the relayed tokens come first, whatever the loads did
                seen = {}
                for d in out:
                    if d.new_token_ids:
                        seen.setdefault(d.request_id, d.new_token_ids[0])
                assert seen == {rid: token for rid, (token, _) in firsts.items()}
            return out

        assert _run(step, decode.has_work) == want
        assert decode.engine.first_tokens_by_source == {"relay": 4}
        assert decode.loader.stats.loads == 4 and decode.loader.stats.recomputes == 0
        assert not decode.first_token("0", firsts["0"][0], None)  # finished: refused
        assert not decode.first_token("nope", 1, None)
        _until(lambda: prefill.step() == [] and prefill.engine.kv.num_free_blocks == free0)
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.num_blocks - 1
    finally:
        prefill.close()
        decode.close()


def test_an_early_ticket_whose_source_dies_before_the_forward_recomputes(tiny_qwen3_dir):
    """Guards the failure after an early ticket: the prefill side goes away between the
    ticket and the first layer (here its server closes from inside the step, before the
    forward). The decode side's stream must fail within its timeout, the request must
    compute its prompt itself, first token included, and give the colocated tokens."""
    prompts = _prompts(2, 990, seed=9, lo=20, hi=40)
    want = _colocated(tiny_qwen3_dir, prompts)
    issued: list[PrefillResult] = []

    def die(result: PrefillResult) -> None:
        issued.append(result)
        if prefill.server is not None:
            prefill.server.close()
            prefill.server = None

    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir)), "P0", early_tickets=True)
    prefill.on_early_ticket = die
    decode = DecodeWorker(
        _kw(tiny_qwen3_dir), "D0",
        {"tcp": TcpTransport("D0", prefill.source.layout, layer_wise=True)}, timeout_s=2.0,
    )  # fmt: skip
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    _until(lambda: prefill.step() is not None and len(issued) == len(prompts), timeout_s=60)
    for r in issued:
        decode.submit(r.request_id, prompts[int(r.request_id)], GREEDY, r.ticket)
    try:
        assert _run(decode.step, decode.has_work) == want
        assert decode.loader.stats.recomputes == len(prompts)
    finally:
        decode.close()
        prefill.close()


def test_an_early_lease_ended_before_its_request_is_held_frees_the_blocks(tiny_qwen3_dir):
    """Guards the leak between an early ticket and the held delta: with async scheduling
    the step that samples the prompt's token is processed one call later, so a lease that
    ends in between (the decode side aborts, or the router's client left) finds nothing
    held yet. The blocks must still come back once the request is held."""
    prefill, decode = _early_pair(tiny_qwen3_dir, async_scheduling=True)
    try:
        free0 = prefill.engine.kv.num_free_blocks
        prefill.submit("0", _prompts(1, 990, seed=10, lo=40, hi=40)[0], GREEDY)
        results: list[PrefillResult] = []

        def ticketed() -> bool:
            results.extend(prefill.step())
            return bool(results)

        _until(ticketed, timeout_s=60)
        assert results[0].ticket is not None and prefill.engine.num_held == 0
        assert prefill.abort("0")  # the lease ends; nothing is held to free yet
        _until(lambda: prefill.step() is not None and not prefill.has_work(), timeout_s=60)
        prefill.step()
        assert prefill.engine.num_held == 0
        assert prefill.engine.kv.num_free_blocks == free0
    finally:
        prefill.close()
        decode.close()


def test_early_tickets_refuse_a_device_transport(tiny_qwen3_dir):
    """Only the tcp stream can carry the first token: asking for early tickets with
    cuda_ipc or nccl must fail at construction, naming the rule."""
    engine = Engine.from_args(**_kw(tiny_qwen3_dir))
    with pytest.raises(ValueError, match="early tickets"):
        PrefillWorker(engine, "P0", early_tickets=True, cuda_ipc=True)
    with pytest.raises(ValueError, match="early tickets"):
        PrefillWorker(engine, "P0", early_tickets=True, nccl=True)
