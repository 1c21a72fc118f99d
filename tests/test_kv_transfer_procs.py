"""Bit-exact KV round trips: `tcp` between two processes, and `local` in one.

The serving side runs in its own process (tests/kv_source_proc.py): it fills every
layout kind (`paged_gqa` bf16, `paged_mla` fp16, `mamba_state` bf16 conv + fp32 ssm, a
GQA + Mamba hybrid) with random bits and NaN patterns from a seed, leases some units and
serves them with a real `KVSourceServer`. This process rebuilds the same bits from the
same seed, pulls with `TcpTransport` into other unit ids of a zeroed storage, and compares
integer views, so a frame scattered to the wrong unit, layer or tensor, a float path that
quiets a NaN, or a write outside the destination ids fails.
"""

from __future__ import annotations

import time

import kv_source_proc as sp
import pytest
import torch

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.layout import GroupStorage, KVLayout, PagedGQAGroup
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.pack import unit_runs
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport
from pdserve.kvtransfer.transport_tcp import TcpTransport

NAMES = tuple(sp.LAYOUTS)
SEED = {name: 100 + i for i, name in enumerate(NAMES)}
# Source ids: unsorted, one run of three, the last unit; a Mamba request has one slot.
SRC_IDS = {"paged_gqa": [9, 2, 3, 4, 12], "paged_mla": [9, 2, 3, 4, 12], "mamba_state": [7]}
DST_IDS = {"paged_gqa": [0, 10, 11, 5, 1], "paged_mla": [0, 10, 11, 5, 1], "mamba_state": [3]}
# first_units of the "skip" pull: leading blocks the receiver already has; a lone Mamba
# group skips its one slot (nothing at all to send), in a hybrid it skips nothing.
SKIP = {"paged_gqa": [2], "paged_mla": [3], "mamba_state": [1], "hybrid": [2, 0]}
LEASES = ("whole-0", "whole-1", "skip")
TIMEOUT_S = 20.0


def ids_of(layout: KVLayout, table: dict) -> list[list[int]]:
    return [list(table[g.kind]) for g in layout.groups]


def source_spec(name: str) -> dict:
    layout = sp.LAYOUTS[name]
    leases = {rid: ids_of(layout, SRC_IDS) for rid in LEASES}
    return {"layout": name, "num_units": sp.NUM_UNITS, "seed": SEED[name], "leases": leases}


def ticket_for(name: str, request_id: str, endpoint: str, layout_hash: str) -> Ticket:
    layout = sp.LAYOUTS[name]
    return Ticket(
        request_id, "P", endpoint, ids_of(layout, SRC_IDS), 1, layout_hash, time.time() + 3600,
        first_token=0, first_logprobs=None, finish_reason=None,
    )  # fmt: skip


def spec_for(ticket: Ticket, name: str, first_units: list[int] | None = None) -> PullSpec:
    layout = sp.LAYOUTS[name]
    first = first_units or [0] * len(layout.groups)
    return PullSpec(ticket, tuple(map(tuple, ids_of(layout, DST_IDS))), tuple(first))


def assert_pulled(
    name: str, dst: tuple[GroupStorage, ...], first_units: list[int] | None = None
) -> None:
    """Destination units `DST_IDS[first:]` hold the source's `SRC_IDS[first:]` bit for bit;
    every other destination unit is still zero."""
    layout = sp.LAYOUTS[name]
    src = sp.fill_storages(layout, sp.NUM_UNITS, SEED[name])
    first = first_units or [0] * len(layout.groups)
    for g, group in enumerate(layout.groups):
        src_ids, dst_ids = SRC_IDS[group.kind][first[g] :], DST_IDS[group.kind][first[g] :]
        others = [u for u in range(sp.NUM_UNITS) if u not in dst_ids]
        for t, (s, d) in enumerate(zip(src[g].tensors, dst[g].tensors, strict=True)):
            got, want = bitwise_view(d), bitwise_view(s)
            where = f"{name} group {g} tensor {t}"
            assert torch.equal(got[:, dst_ids], want[:, src_ids]), f"{where}: pulled bits differ"
            assert not got[:, others].any(), f"{where}: a unit outside the pull was written"


def expected_bytes(name: str, first_units: list[int] | None = None) -> int:
    layout = sp.LAYOUTS[name]
    first = first_units or [0] * len(layout.groups)
    return sum((len(SRC_IDS[g.kind]) - f) * g.unit_bytes() for g, f in zip(layout.groups, first))


def zeroed(name: str) -> tuple[GroupStorage, ...]:
    return tuple(g.allocate(sp.NUM_UNITS) for g in sp.LAYOUTS[name].groups)


@pytest.fixture(scope="module")
def source_proc():
    """One serving process, one `KVSourceServer` per layout; it must exit 0 when told."""
    spec = {"mode": "serve", "sources": [source_spec(name) for name in NAMES]}
    proc, info = sp.start(spec)
    try:
        yield {name: (info["endpoints"][i], info["hashes"][i]) for i, name in enumerate(NAMES)}
    finally:
        assert sp.stop(proc) == 0, "the source process must exit cleanly when its stdin closes"


@pytest.mark.parametrize("name", NAMES)
def test_source_bits_carry_nan_payloads(name):
    """Guards the test itself: the source bits must hold NaNs (so a float path would be
    caught) and differ from the zeroed destination everywhere that is compared."""
    for storage in sp.fill_storages(sp.LAYOUTS[name], sp.NUM_UNITS, SEED[name]):
        for t in storage.tensors:
            assert torch.isnan(t.float()).sum() >= 3 * t.shape[0] * t.shape[1]
            assert bitwise_view(t).flatten(2).ne(0).any(dim=2).all()


@pytest.mark.parametrize("layer_wise", [False, True], ids=["whole", "layer_wise"])
@pytest.mark.parametrize("name", NAMES)
def test_tcp_pull_between_processes_is_bitwise_then_release_ends_the_lease(
    source_proc, name, layer_wise
):
    """Guards the tcp path end to end across a process boundary: frames scattered to the
    wrong unit/layer/tensor, a NaN payload changed in transit, a write outside the
    destination ids, a byte count that disagrees with the units moved, and a Release that
    leaves the lease alive (a second pull must be refused as unknown_lease)."""
    endpoint, layout_hash = source_proc[name]
    transport = TcpTransport("D", sp.LAYOUTS[name], layer_wise=layer_wise)
    try:
        ticket = ticket_for(name, f"whole-{int(layer_wise)}", endpoint, layout_hash)
        dst = zeroed(name)
        moved = transport.pull(spec_for(ticket, name), dst, TIMEOUT_S)
        assert moved == expected_bytes(name)
        assert_pulled(name, dst)
        transport.release(ticket, TIMEOUT_S)
        with pytest.raises(TransferError) as err:
            transport.pull(spec_for(ticket, name), zeroed(name), TIMEOUT_S)
        assert err.value.code == "unknown_lease"
    finally:
        transport.close()


@pytest.mark.parametrize("name", NAMES)
def test_tcp_pull_skips_units_the_receiver_has(source_proc, name):
    """Guards `first_units`: units before it must neither be sent nor written (the decode
    side's prefix-cache hits live there), and the rest must land on the matching ids."""
    endpoint, layout_hash = source_proc[name]
    transport = TcpTransport("D", sp.LAYOUTS[name], layer_wise=True)
    try:
        ticket = ticket_for(name, "skip", endpoint, layout_hash)
        dst = zeroed(name)
        moved = transport.pull(spec_for(ticket, name, SKIP[name]), dst, TIMEOUT_S)
        assert moved == expected_bytes(name, SKIP[name])
        assert_pulled(name, dst, SKIP[name])
    finally:
        transport.close()


def test_tcp_handshake_refuses_another_layout(source_proc):
    """Guards the handshake across processes: a puller whose layout differs in one field
    (block size) is refused with an error naming that field, before any byte moves."""
    endpoint, layout_hash = source_proc["paged_gqa"]
    other = KVLayout("m", (PagedGQAGroup("kv", 3, 8, 2, 5, "bfloat16"),))
    transport = TcpTransport("D", other)
    try:
        ticket = ticket_for("paged_gqa", "skip", endpoint, layout_hash)
        with pytest.raises(TransferError) as err:
            transport.pull(spec_for(ticket, "paged_gqa"), zeroed("paged_gqa"), TIMEOUT_S)
        assert err.value.code == "layout_mismatch"
        assert "block_size" in str(err.value)
    finally:
        transport.close()


@pytest.mark.parametrize("name", NAMES)
def test_local_pull_is_bitwise_skips_and_release_ends_the_lease(name):
    """Guards the in-process path on the same data: direct unit copies (runs of
    consecutive ids) must land bit for bit with few descriptors, honour `first_units`,
    and a released lease must refuse a later pull."""
    spec = source_spec(name)
    source = KVSource(
        "P", sp.LAYOUTS[name], sp.fill_storages(sp.LAYOUTS[name], sp.NUM_UNITS, SEED[name]),
        LeaseTable(3600.0),
    )  # fmt: skip
    for rid, ids in spec["leases"].items():
        source.leases.add(rid, ids, 1)
    registry = LocalRegistry()
    endpoint = registry.add(source)
    transport = LocalTransport(registry, source.layout_hash)

    ticket = ticket_for(name, "whole-0", endpoint, source.layout_hash)
    dst = zeroed(name)
    assert transport.pull(spec_for(ticket, name), dst, TIMEOUT_S) == expected_bytes(name)
    assert_pulled(name, dst)
    runs = sum(
        len(unit_runs(SRC_IDS[g.kind], DST_IDS[g.kind])) * len(g.unit_shapes())
        for g in sp.LAYOUTS[name].groups
    )
    assert transport.descriptors == runs, "one copy per run of consecutive ids and tensor"

    skip = ticket_for(name, "skip", endpoint, source.layout_hash)
    dst = zeroed(name)
    assert transport.pull(spec_for(skip, name, SKIP[name]), dst, TIMEOUT_S) == expected_bytes(
        name, SKIP[name]
    )
    assert_pulled(name, dst, SKIP[name])

    transport.release(ticket, TIMEOUT_S)
    assert source.leases.drain_freeable() == ["whole-0"]
    with pytest.raises(TransferError) as err:
        transport.pull(spec_for(ticket, name), zeroed(name), TIMEOUT_S)
    assert err.value.code == "unknown_lease"
