"""The nccl transport's control protocol and P2P path, over gloo between two CPU processes.

One pair of processes runs every case once, in order: rank 0 serves (one server per
layout, plus one that announces frames and never sends them), rank 1 pulls and reports
each case's outcome; each test below checks one. The last case breaks the group on
purpose, as a timed-out P2P op does.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.layout import KVLayout, MambaStateGroup, PagedGQAGroup
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_nccl import NcclSourceServer, NcclTransport

# head_dim 24 and 40 conv channels: nothing is a power of two, so a stride bug shows.
_GQA = PagedGQAGroup("kv", 3, 16, 2, 24, "bfloat16")
_MAMBA = MambaStateGroup("mamba", 2, (40, 3), (4, 12, 16), "bfloat16", "float32")
LAYOUTS = {
    "paged_gqa": KVLayout("gqa", (_GQA,)),
    "hybrid": KVLayout("hybrid", (_GQA, _MAMBA)),
    "silent": KVLayout("gqa", (_GQA,)),
    "framed": KVLayout("gqa", (_GQA,)),  # served in one frame per layer
}
SIZES = {"paged_gqa": (24,), "hybrid": (24, 5), "silent": (24,), "framed": (24,)}
# Scattered on both sides, with one run consecutive on both (3, 4 -> 10, 11).
_SRC, _DST = (17, 3, 4, 9, 22, 0), (5, 10, 11, 2, 23, 7)
UNITS = {  # name -> (source units per group, destination units per group)
    "paged_gqa": ((_SRC,), (_DST,)),
    "hybrid": ((_SRC, (4,)), (_DST, (1,))),
    "silent": ((_SRC,), (_DST,)),
    "framed": ((_SRC,), (_DST,)),
}
FIRST = {"paged_gqa": (2,), "hybrid": (1, 0), "silent": (0,), "framed": (1,)}
SEED = 11


def _fill(storages, seed: int) -> None:
    """Random bits, NaN payloads included, the same in both processes."""
    gen = torch.Generator().manual_seed(seed)
    for storage in storages:
        for t in storage.tensors:
            bits = bitwise_view(t)
            info = torch.iinfo(bits.dtype)
            bits.copy_(torch.randint(info.min, info.max, t.shape, generator=gen, dtype=bits.dtype))


def _storages(name: str, seed: int | None):
    layout = LAYOUTS[name]
    storages = tuple(g.allocate(n) for g, n in zip(layout.groups, SIZES[name]))
    if seed is not None:
        _fill(storages, seed)
    return storages


class _SilentServer(NcclSourceServer):
    """Announces its frames and never sends them: a source that hung or died mid-pull."""

    def _send_frames(self, headers, units, dst_rank, request_id) -> int:
        return 0


def _serve(port: int, endpoints: mp.Queue, done: mp.Event) -> None:
    dist.init_process_group("gloo", rank=0, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    servers = {}
    for name, layout in LAYOUTS.items():
        leases = LeaseTable(60.0)
        for rid in ("r", "r-release"):
            leases.add(rid, [list(u) for u in UNITS[name][0]], 100)
        source = KVSource("P", layout, _storages(name, SEED), leases)
        cls = _SilentServer if name == "silent" else NcclSourceServer
        # "framed": a frame size of one byte splits every tensor into per-layer frames.
        frame_bytes = 1 if name == "framed" else None
        servers[name] = cls(source, send_timeout_s=10.0, frame_bytes=frame_bytes)
    endpoints.put({name: s.ticket_endpoint for name, s in servers.items()})
    done.wait(60)
    for server in servers.values():
        server.close()


def _ticket(name: str, endpoint: str, request_id: str = "r") -> Ticket:
    layout = LAYOUTS[name]
    return Ticket(
        request_id, "P", endpoint, [list(u) for u in UNITS[name][0]], 100,
        layout.compat_hash(), time.time() + 60, 1, None, None,
    )  # fmt: skip


def _round_trip(transports: dict, endpoints: dict, name: str) -> None:
    src_units, dst_units = UNITS[name]
    first = FIRST[name]
    expect = _storages(name, SEED)
    dst = _storages(name, None)
    spec = PullSpec(_ticket(name, endpoints[name]), dst_units, first)
    moved = transports[name].pull(spec, dst, timeout_s=20)
    layout = LAYOUTS[name]
    assert moved == sum(
        (len(u) - f) * g.unit_bytes() for u, f, g in zip(src_units, first, layout.groups)
    )
    for g, (e, d) in enumerate(zip(expect, dst)):
        pairs = list(zip(src_units[g][first[g] :], dst_units[g][first[g] :]))
        for te, td in zip(e.flat(), d.flat()):
            for s, u in pairs:
                assert torch.equal(bitwise_view(td[:, u]), bitwise_view(te[:, s])), (g, s, u)
            # Units before first_units are the receiver's own; nothing else is written.
            for u in set(range(td.shape[1])) - {u for _, u in pairs}:
                assert not bitwise_view(td[:, u]).any(), f"group {g} unit {u} was written"


def _expect_error(code: str, fn) -> TransferError:
    with pytest.raises(TransferError) as info:
        fn()
    assert info.value.code == code, str(info.value)
    return info.value


def _pull_cases(port: int, endpoints_q: mp.Queue, results: mp.Queue) -> None:
    dist.init_process_group("gloo", rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    endpoints = endpoints_q.get(timeout=30)
    # One transport per layout (a transport has one layout); "silent" shares gqa's, so the
    # broken group is seen by a transport that has pulled before.
    gqa = NcclTransport("D", LAYOUTS["paged_gqa"])
    transports = {
        "paged_gqa": gqa, "hybrid": NcclTransport("D", LAYOUTS["hybrid"]), "silent": gqa,
        "framed": gqa,
    }  # fmt: skip
    out: dict[str, str] = {}

    def case(name, fn) -> None:
        try:
            fn()
            out[name] = "ok"
        except BaseException:  # pytest.raises failures too; the parent fails the test
            out[name] = traceback.format_exc()

    def refused() -> None:
        spec = PullSpec(
            _ticket("paged_gqa", endpoints["paged_gqa"], "nope"), UNITS["paged_gqa"][1], (0,)
        )
        _expect_error("unknown_lease", lambda: gqa.pull(spec, _storages("paged_gqa", None), 10))
        assert gqa.broken is None

    def control() -> None:
        ticket = _ticket("hybrid", endpoints["hybrid"], "r-release")
        t = transports["hybrid"]
        assert t.heartbeat(ticket, 30.0, timeout_s=5) > time.time() + 20
        t.release(ticket, timeout_s=5)
        spec = PullSpec(ticket, UNITS["hybrid"][1], (0, 0))
        _expect_error("unknown_lease", lambda: t.pull(spec, _storages("hybrid", None), 10))

    def timeout() -> None:
        spec = PullSpec(_ticket("silent", endpoints["silent"]), UNITS["silent"][1], (0,))
        start = time.monotonic()
        _expect_error("timeout", lambda: gqa.pull(spec, _storages("silent", None), 1.0))
        assert time.monotonic() - start < 5
        assert gqa.broken is not None
        spec = PullSpec(_ticket("paged_gqa", endpoints["paged_gqa"]), UNITS["paged_gqa"][1], (0,))
        _expect_error("group_broken", lambda: gqa.pull(spec, _storages("paged_gqa", None), 10))

    case("refused", refused)
    case("paged_gqa", lambda: _round_trip(transports, endpoints, "paged_gqa"))
    case("hybrid", lambda: _round_trip(transports, endpoints, "hybrid"))
    case("framed", lambda: _round_trip(transports, endpoints, "framed"))
    case("control", control)
    case("timeout", timeout)  # last: it leaves the group unusable
    results.put(out)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    endpoints, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_serve, args=(port, endpoints, done), daemon=True),
        ctx.Process(target=_pull_cases, args=(port, endpoints, results), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=90)
    except queue.Empty:
        pytest.fail(f"the puller reported nothing; exit codes {[p.exitcode for p in procs]}")
    finally:
        done.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _check(outcomes: dict[str, str], name: str) -> None:
    assert outcomes.get(name) == "ok", outcomes.get(name, f"case {name} did not run")


def test_refused_pull_leaves_the_group_usable(outcomes):
    """An Error reply means the source sends nothing by P2P; treating it as a broken group
    (or posting receives anyway) would wedge every later pull."""
    _check(outcomes, "refused")


def test_paged_gqa_round_trip_is_bitwise(outcomes):
    """Header order, byte counts, first_units offsets and the scatter at the puller's own
    (scattered) ids: every pulled unit equals its source bit for bit, NaN payloads included,
    and no other unit is written."""
    _check(outcomes, "paged_gqa")


def test_hybrid_round_trip_is_bitwise(outcomes):
    """Two groups with three tensors of two dtypes: frames must be matched to the right
    group and tensor, in the order both sides post them."""
    _check(outcomes, "hybrid")


def test_tensor_in_layer_frames_round_trip_is_bitwise(outcomes):
    """A big tensor goes as several frames of whole layers (packed one by one while the
    previous is sent); the puller accepts any in-order tiling of the layers and scatters
    each frame into its own layers."""
    _check(outcomes, "framed")


def test_release_and_heartbeat_reach_the_source_through_an_nccl_endpoint(outcomes):
    """Control calls go to the tcp part of `nccl+tcp://`; a released lease is not pulled."""
    _check(outcomes, "control")


def test_p2p_timeout_raises_and_marks_the_group_broken(outcomes):
    """A source that announces frames and never sends: the pull must end at its deadline
    with code "timeout", and later pulls must refuse at once instead of matching stale ops."""
    _check(outcomes, "timeout")


def test_puller_refuses_frames_that_do_not_tile_the_layers():
    """A source chooses how to split a tensor into layer frames, but not what it sends:
    a gap, an overlap, a wrong shape or byte count, or a frame too many is refused before
    anything is allocated."""
    from dataclasses import replace

    from pdserve.kvtransfer.transport_nccl import check_headers, frame_headers

    spec = PullSpec(_ticket("paged_gqa", "nccl+tcp://x:1"), UNITS["paged_gqa"][1], (2,))
    dst = _storages("paged_gqa", None)
    n = len(UNITS["paged_gqa"][1][0]) - 2
    for frame_bytes in (1, 10**9):  # per-layer frames, and one frame
        good = frame_headers("r", dst, [n], frame_bytes)
        check_headers(good, spec, dst)
    per_layer = frame_headers("r", dst, [n], 1)
    assert [(h.layer_start, h.layer_end) for h in per_layer] == [(0, 1), (1, 2), (2, 3)]
    layer_bytes, elems = per_layer[0].nbytes, per_layer[0].shape[2]
    bad = {
        "gap": [per_layer[0], per_layer[2]],
        "overlap": [per_layer[0], replace(per_layer[1], layer_start=0), per_layer[2]],
        "shape": [replace(per_layer[0], shape=[1, n + 1, elems]), *per_layer[1:]],
        "bytes": [replace(per_layer[0], nbytes=layer_bytes + 1), *per_layer[1:]],
        "extra": [*per_layer, per_layer[2]],
        "too few": per_layer[:2],
        "backwards": [per_layer[0], per_layer[1], per_layer[0]],
        "past the last layer": [
            *per_layer[:2],
            replace(per_layer[2], layer_end=4, shape=[2, n, elems], nbytes=2 * layer_bytes),
        ],
    }
    for name, headers in bad.items():
        with pytest.raises(TransferError, match="frame") as info:
            check_headers(headers, spec, dst)
        assert info.value.code == "bad_frame", name
