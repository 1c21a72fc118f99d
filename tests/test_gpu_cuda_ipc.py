"""cuda_ipc between two processes on one GPU: bitwise round-trip for every layout.

Collected only where a GPU exists (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_ipc_layouts import LAYOUTS, UNITS, fill, source_process

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.id_staging import IdStaging
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cuda_ipc_round_trip_two_processes(name):
    """Guards the IPC mapping (handles, offsets, strides as plain msgpack values) and the
    side-stream copy: every destination unit must equal its source unit bit for bit, and
    every other destination unit stays zero."""
    layout, sizes = LAYOUTS[name]
    src_units, dst_units = UNITS[name]
    with source_process(name) as endpoint:
        expect = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
        fill(expect, seed=7)
        dst = tuple(g.allocate(n + 3, "cuda") for g, n in zip(layout.groups, sizes))
        transport = CudaIpcTransport("D", layout)
        ticket = Ticket(
            "r", "P", endpoint, [list(u) for u in src_units], 100, layout.compat_hash(),
            time.time() + 60, 1, None, None,
        )  # fmt: skip
        first = (1,) + (0,) * (len(src_units) - 1)
        spec = PullSpec(ticket, dst_units, first)
        moved = transport.pull(spec, dst, timeout_s=30)
        assert moved == sum(
            (len(u) - f) * g.unit_bytes() for u, f, g in zip(src_units, first, layout.groups)
        )
        torch.cuda.synchronize()
        for g, (e, d) in enumerate(zip(expect, dst)):
            written = set(dst_units[g][first[g] :])
            for te, td in zip(e.flat(), d.flat()):
                _assert_landed(td, te, src_units[g][first[g] :], dst_units[g][first[g] :])
                for u in set(range(td.shape[1])) - written:
                    assert not bitwise_view(td[:, u]).any(), f"unit {u} was written"
        transport.release(ticket, 5.0)
        # A ticket near its expiry makes the pull ask the source, which knows it is gone.
        late = dataclasses.replace(ticket, lease_expiry=time.time())
        with pytest.raises(TransferError, match="unknown_lease"):
            transport.pull(PullSpec(late, dst_units, first), dst, timeout_s=5)
        transport.close()


def test_cuda_ipc_pulls_from_two_threads_at_once():
    """Guards the per-thread side streams, events and pinned id buffers: the decode
    loader pulls on two threads through one transport, so a buffer shared by the threads
    would land one thread's units at the other's ids. The threads map the same source
    units to different destination ids (in their own storages), and pull a different tail
    of the ticket each time, so the buffers are refilled at different lengths."""
    layout, sizes = LAYOUTS["paged_gqa"]
    (src_units,), (dst_units,) = UNITS["paged_gqa"]
    maps = (tuple(dst_units), tuple(reversed(dst_units)))
    with source_process("paged_gqa") as endpoint:
        expect = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
        fill(expect, seed=7)
        transport = CudaIpcTransport("D", layout)
        ticket = Ticket(
            "r", "P", endpoint, [list(src_units)], 100, layout.compat_hash(),
            time.time() + 60, 1, None, None,
        )  # fmt: skip
        dsts = [tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes)) for _ in maps]
        errors: list[BaseException] = []

        def puller(k: int) -> None:
            try:
                for i in range(30):
                    first = (k + i) % len(src_units)
                    spec = PullSpec(ticket, (maps[k],), (first,))
                    transport.pull(spec, dsts[k], timeout_s=30)
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=puller, args=(k,)) for k in range(len(maps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        torch.cuda.synchronize()
        (want,) = expect[0].flat()
        for dst, units in zip(dsts, maps):
            (got,) = dst[0].flat()
            _assert_landed(got, want, src_units, units)
        transport.release(ticket, 5.0)
        transport.close()


def test_id_staging_never_refills_a_buffer_a_queued_copy_reads():
    """Guards the pinned buffer's reuse: while the stream is busy (a decode step, or a
    pull that timed out), the next `stage` must take another host buffer, not refill the
    one the queued copy has yet to read. Also covers growing past the first buffers."""
    stream = torch.cuda.Stream()
    staging = IdStaging(stream)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~25 ms: the first copy stays queued meanwhile
    seen = []
    for arrays in (
        [np.arange(5), np.arange(100, 103)],
        [np.arange(200, 208)],  # fits the first host buffer, whose copy is still queued
        [np.full(7, -1), np.arange(10_000)[::-1].copy()],  # past the initial 4,096 ids
    ):
        with torch.cuda.stream(stream):  # `stage` runs on its stream, as copy_groups calls it
            ids, offsets = staging.stage(arrays)
            total = sum(a.size for a in arrays)
            assert offsets == [sum(a.size for a in arrays[:i]) for i in range(len(arrays))]
            seen.append(ids[:total].clone())  # what a copy kernel reads
    torch.cuda.synchronize()
    assert seen[0].tolist() == [0, 1, 2, 3, 4, 100, 101, 102]
    assert seen[1].tolist() == list(range(200, 208))
    assert seen[2].tolist() == [-1] * 7 + list(range(9_999, -1, -1))


def test_a_dead_source_fails_the_release_not_the_process():
    """Guards the cuda_ipc failure path (DESIGN §2, release confirms the copy): a prefill
    process that dies after a first pull leaves a cached mapping behind, and a ticket whose
    lease still has time left is copied through it without a round trip. Whatever that
    copy reads, it must not fault the puller's CUDA context; the release that follows must
    fail within its timeout (so the loader counts the load failed and recomputes), drop
    the mapping, and a later pull must fail cleanly instead of reusing it. Run in a child
    process, which a fault would kill instead of this one."""
    script = Path(__file__).parent / "gpu_ipc_dead_source_proc.py"
    proc = subprocess.run(
        [sys.executable, str(script), "paged_gqa"], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report)  # the log records what the copy through a dead mapping did
    assert report["first_pull"][0] == "ok", report
    second = report["second_pull"][0]
    assert second == "ok" or second.startswith("TransferError:"), report
    assert report["release"][0] == "TransferError:timeout" and report["release"][1] < 10, report
    assert report["mapping_kept"] is False, report
    assert report["third_pull"][0].startswith("TransferError:"), report
    assert report["third_pull"][1] < 10, report
    assert report["context_ok"] is True, report


def _gqa_pull_setup(endpoint: str):
    layout, sizes = LAYOUTS["paged_gqa"]
    (src_units,), _ = UNITS["paged_gqa"]
    expect = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
    fill(expect, seed=7)
    ticket = Ticket(
        "r", "P", endpoint, [list(src_units)], 100, layout.compat_hash(),
        time.time() + 60, 1, None, None,
    )  # fmt: skip
    return layout, sizes, src_units, expect, ticket


def _assert_landed(got: torch.Tensor, want: torch.Tensor, src_units, dst_units) -> None:
    """Unit dst_units[i] of `got` holds unit src_units[i] of `want`, bit for bit."""
    for s, u in zip(src_units, dst_units):
        assert torch.equal(bitwise_view(got[:, u]), bitwise_view(want[:, s])), (s, u)


def _side(transport: CudaIpcTransport):
    ((_, side),) = transport._side.__dict__["sides"].items()
    return side


def test_graph_path_captures_once_per_capacity_and_lands_every_count():
    """Guards the replayed pull (kvtransfer/copy_graph.py): the captured kernel reads the
    id count from the uploaded buffer, so pulls of 7, 6, ..., 1 units replay the one graph
    of capacity 8 (no second capture), each landing exactly its units; slots left from a
    longer earlier pull must not be copied again (every other destination unit is zeroed
    and checked before each pull)."""
    with source_process("paged_gqa") as endpoint:
        layout, sizes, src_units, expect, ticket = _gqa_pull_setup(endpoint)
        _, (dst_units,) = UNITS["paged_gqa"]
        dst = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
        transport = CudaIpcTransport("D", layout)
        (want,) = expect[0].flat()
        (got,) = dst[0].flat()
        for first in range(len(src_units)):
            got.zero_()
            queued = transport.enqueue_pull(
                PullSpec(ticket, (tuple(dst_units),), (first,)), dst, time.monotonic() + 30
            )
            assert queued.unchecked, "same-device pulls take the graph path"
            queued.done.synchronize()
            for u in range(got.shape[1]):
                pairs = dict(zip(dst_units[first:], src_units[first:]))
                expected = want[:, pairs[u]] if u in pairs else torch.zeros_like(got[:, u])
                assert torch.equal(bitwise_view(got[:, u]), bitwise_view(expected)), (first, u)
        assert len(_side(transport).graphs._graphs) == 1
        transport.release(ticket, 5.0)
        transport.close()


def test_graph_path_checks_ids_while_copying_and_fails_after():
    """Guards the late id check: the graph path queues the copy before checking the ids
    on the host, so a bad destination id (out of range, or a repeat) must still fail the
    pull with the eager path's ValueError, only once the copy is done (the caller frees
    the units next); the kernel skips the out-of-range pair, and the transport keeps
    working for the next, good pull."""
    with source_process("paged_gqa") as endpoint:
        layout, sizes, src_units, expect, ticket = _gqa_pull_setup(endpoint)
        _, (dst_units,) = UNITS["paged_gqa"]
        dst = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
        transport = CudaIpcTransport("D", layout)
        bad = list(dst_units)
        bad[2] = 10**6
        with pytest.raises(ValueError, match="destination unit id 1000000"):
            transport.pull(PullSpec(ticket, (tuple(bad),), (0,)), dst, timeout_s=30)
        graphs = _side(transport).graphs._graphs.values()
        assert all(g.done.query() for g in graphs), "the error came before the copy ended"
        boolean = list(dst_units)
        boolean[0] = True  # packs as unit 1 into the graph's buffer; the check refuses it
        # (a ticket's source ids cannot be bools: its schema refuses them on arrival)
        with pytest.raises(ValueError, match="destination unit id True"):
            transport.pull(PullSpec(ticket, (tuple(boolean),), (0,)), dst, timeout_s=30)
        repeat = list(dst_units)
        repeat[1] = repeat[0]
        with pytest.raises(ValueError, match="distinct"):
            transport.pull(PullSpec(ticket, (tuple(repeat),), (0,)), dst, timeout_s=30)
        (got,) = dst[0].flat()
        got.zero_()
        transport.pull(PullSpec(ticket, (tuple(dst_units),), (0,)), dst, timeout_s=30)
        (want,) = expect[0].flat()
        _assert_landed(got, want, src_units, dst_units)
        transport.release(ticket, 5.0)
        transport.close()


def test_a_replayed_copy_waits_for_the_work_the_caller_queued_before_the_pull():
    """Guards the graph's event wait node: the destination units were just allocated on
    the caller's stream, and what it queued on them before the pull (here a fill behind a
    ~50 ms sleep) must land before the copy, not after it, or the pulled units end up
    holding the fill."""
    with source_process("paged_gqa") as endpoint:
        layout, sizes, src_units, expect, ticket = _gqa_pull_setup(endpoint)
        _, (dst_units,) = UNITS["paged_gqa"]
        dst = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
        transport = CudaIpcTransport("D", layout)
        spec = PullSpec(ticket, (tuple(dst_units),), (0,))
        transport.pull(spec, dst, timeout_s=30)  # captures the graph
        (got,) = dst[0].flat()
        (want,) = expect[0].flat()
        for _ in range(3):
            torch.cuda._sleep(100_000_000)
            got.fill_(7)
            transport.pull(spec, dst, timeout_s=30)
            torch.cuda.synchronize()
            _assert_landed(got, want, src_units, dst_units)
        assert len(_side(transport).graphs._graphs) == 1, "the pulls replayed the graph"
        transport.release(ticket, 5.0)
        transport.close()


def test_a_replay_still_queued_sends_the_next_pull_down_the_eager_path():
    """Guards the pinned id buffer of a graph: while its last replay has not run (the
    compute stream is busy, or a pull timed out), refilling it would change the ids that
    replay copies. The second pull must take the eager path, and both must land their
    own units."""
    with source_process("paged_gqa") as endpoint:
        layout, sizes, src_units, expect, ticket = _gqa_pull_setup(endpoint)
        _, (dst_units,) = UNITS["paged_gqa"]
        other = (20, 21, 22, 23, 24, 25, 26)  # disjoint from dst_units, same table
        dst = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
        transport = CudaIpcTransport("D", layout)
        warm = transport.enqueue_pull(
            PullSpec(ticket, (tuple(dst_units),), (0,)), dst, time.monotonic() + 30
        )
        warm.done.synchronize()  # captured; the graph's replayed event has completed
        torch.cuda._sleep(100_000_000)  # the caller stream busy for ~50 ms
        first = transport.enqueue_pull(
            PullSpec(ticket, (tuple(dst_units),), (0,)), dst, time.monotonic() + 30
        )
        second = transport.enqueue_pull(
            PullSpec(ticket, (other,), (0,)), dst, time.monotonic() + 30
        )
        assert first.unchecked and not second.unchecked
        torch.cuda.synchronize()
        (want,) = expect[0].flat()
        (got,) = dst[0].flat()
        for units in (dst_units, other):
            _assert_landed(got, want, src_units, units)
        transport.release(ticket, 5.0)
        transport.close()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_transfer_warm_up_changes_no_byte_and_leaves_nothing_to_compile(name):
    """Guards the workers' transfer warm-up (cluster/services.py: `CudaIpcTransport.prepare`
    and `pack.warm_up`), which runs on the cache a worker is about to serve from: no byte
    of it may change (unit 0 is packed and written back onto itself, and the warm-up
    graph's eager pass copies nothing). And afterwards a copy graph of any capacity must
    compile no Triton kernel: the id staging kernel has one variant for every length (one
    per capacity made a fresh H200's first pulls wait ~0.6 s each)."""
    import triton

    from pdserve.kernels.kv_copy import PairCache
    from pdserve.kvtransfer import pack
    from pdserve.kvtransfer.copy_graph import GraphedCopy

    layout, sizes = LAYOUTS[name]
    storages = tuple(g.allocate(n, "cuda") for g, n in zip(layout.groups, sizes))
    fill(storages, seed=3)
    before = [bitwise_view(t).clone() for s in storages for t in s.tensors]
    transport = CudaIpcTransport("D", layout)
    try:
        transport.prepare(storages)
    finally:
        transport.close()
    pack.warm_up(storages)
    after = [bitwise_view(t) for s in storages for t in s.tensors]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))

    compiled: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
    try:
        stream = torch.cuda.Stream()
        tables = [list(zip(s.flat(), s.flat(), strict=True)) for s in storages]
        for capacity in (16, 64, 512, 8192):
            GraphedCopy(tables, [capacity] * len(tables), stream, PairCache())
        stream.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
