"""The tier actor's wire format and service (what crosses the Ray boundary is one flat
uint8 array and a spec)."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from pdserve.cluster.serve_placement import LOCAL_RAY_SYSTEM_CONFIG
from pdserve.cluster.tier_actor import TierService, blocks_from_wire, blocks_to_wire
from pdserve.kernels.kv_pack import bitwise_view


def _blocks(n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = torch.randint(-(2**15), 2**15, (3, 40), generator=gen, dtype=torch.int16)
        b = torch.randint(-(2**31), 2**31 - 1, (3, 7), generator=gen, dtype=torch.int32)
        out.append((a.view(torch.bfloat16), b.view(torch.float32)))  # NaN payloads included
    return out


@pytest.fixture(scope="module")
def ray_local():
    """One real Ray instance for the module's actors (a start and stop cost CI ~6 s)."""
    import ray

    ray.init(
        num_cpus=1, include_dashboard=False, logging_level="ERROR",
        _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )  # fmt: skip
    yield
    ray.shutdown()


@contextmanager
def _tier_on_ray(service: type = TierService, **client_kwargs):
    """A tier actor running `service` on the module's Ray, and a `TierClient` on it;
    yields (actor, client), then closes the client and ends the actor."""
    import ray

    from pdserve.cluster.tier_actor import TierClient

    actor = ray.remote(service).options(num_cpus=0).remote(1 << 20)
    try:
        client = TierClient(actor, **client_kwargs)
        try:
            yield actor, client
        finally:
            client.close()
    finally:
        ray.kill(actor, no_restart=True)


def test_blocks_round_trip_bitwise_through_the_wire():
    """Guards the tier actor's boundary: blocks become one flat uint8 array plus a spec of
    shapes and dtypes (no pickled tensors) and come back bit for bit, from the array, from
    a read-only copy (what Ray's object store hands over) or from bytes; a blob of the
    wrong size is refused."""
    blocks = _blocks(4, 0)
    blob, spec = blocks_to_wire(blocks)
    assert blob.dtype == np.uint8 and blob.ndim == 1 and blob.size == 4 * (3 * 40 * 2 + 3 * 7 * 4)
    assert spec == [([3, 40], "bfloat16"), ([3, 7], "float32")]
    read_only = blob.copy()
    read_only.flags.writeable = False
    for wire in (blob, read_only, blob.tobytes()):
        back = blocks_from_wire(wire, spec, 4)
        for want, got in zip(blocks, back):
            for w, g in zip(want, got):
                assert torch.equal(bitwise_view(w), bitwise_view(g))
    back[0][0].zero_()  # the blocks own their memory: the wire buffer is untouched
    assert torch.equal(
        blocks_from_wire(blob, spec, 4)[0][0].view(torch.int16), blocks[0][0].view(torch.int16)
    )
    with pytest.raises(ValueError, match="blocks need"):
        blocks_from_wire(blob[:-1], spec, 4)
    assert blocks_from_wire(*blocks_to_wire([]), 0) == []


def test_tier_service_put_lookup_get():
    """Guards the service the actor runs: write-behind then read-through by chain hash."""
    svc = TierService(byte_budget=1 << 20)
    blocks = _blocks(3, 1)
    blob, spec = blocks_to_wire(blocks)
    assert svc.put("layout-a", [11, 12, 13], blob, spec) == 3
    assert svc.lookup("layout-a", [11, 12, 99]) == 2
    assert svc.lookup("layout-b", [11]) == 0
    got = blocks_from_wire(*svc.get("layout-a", [11, 12]), 2)
    assert torch.equal(bitwise_view(got[1][0]), bitwise_view(blocks[1][0]))


def test_client_drops_write_behinds_past_its_byte_cap(ray_local):
    """Guards the prefill worker's step loop: `put` returns at once (a writer thread
    serializes and submits), a put that would take the bytes queued or in flight past the
    cap is refused before anything is packed (and counted), and the cap frees again once
    the actor has taken the bytes (seen without a flush)."""
    import threading
    import time

    class SlowTier(TierService):  # keeps a put in flight long enough to ask meanwhile
        def put(self, *args):
            time.sleep(1.0)
            return super().put(*args)

    blocks = _blocks(3, 2)
    blob, _ = blocks_to_wire(blocks)
    with _tier_on_ray(SlowTier, max_pending_bytes=len(blob)) as (_, client):
        gate = threading.Event()  # holds the writer thread inside its first submit
        submit = client.writer._submit

        def held_submit(*args):
            gate.wait(30)
            return submit(*args)

        client.writer._submit = held_submit
        assert not client.admits(len(blob) + 1) and client.dropped_puts == 1
        assert client.put("layout-a", [1, 2, 3], blocks) == 0  # returns while held
        assert not client.admits(1), "the first put's bytes are still queued"
        assert client.dropped_puts == 2
        gate.set()
        time.sleep(0.3)  # submitted by now; the actor holds it for a second
        assert not client.admits(1), "the first put's bytes are still in flight"
        assert client.dropped_puts == 3
        deadline = time.monotonic() + 10
        while client.writer.pending_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.writer.pending_bytes == 0, "the writer did not free a finished put"
        assert client.admits(len(blob)) and client.dropped_puts == 3
        assert client.lookup("layout-a", [1, 2, 3]) == 3
        # Back through Ray (a read-only array out of its object store), bit for bit.
        for want, got in zip(blocks, client.get("layout-a", [1, 2, 3])):
            for w, g in zip(want, got):
                assert torch.equal(bitwise_view(w), bitwise_view(g))
        client.close()
        assert not client.writer._thread.is_alive()
        client.put("layout-a", [4], blocks[:1])  # after close: dropped, not hung
        assert client.dropped_puts == 4


def test_writer_submits_only_once_the_blocks_are_ready(ray_local):
    """Guards the prefill worker's asynchronous host copies: the writer thread must not
    serialize blocks whose device-to-host copies are still queued. On a GPU `ready` is a
    CUDA event; CI has none, so a flag with the same `query()` stands in for it."""
    import threading
    import time

    class Ready:
        def __init__(self) -> None:
            self.done = threading.Event()

        def query(self) -> bool:
            return self.done.is_set()

    with _tier_on_ray() as (_, client):
        submitted = []
        submit = client.writer._submit
        client.writer._submit = lambda *a: submitted.append(a[1]) or submit(*a)
        ready = Ready()
        client.put("layout-a", [7, 8], _blocks(2, 3), ready)
        time.sleep(0.3)
        assert submitted == [], "submitted before its host copies completed"
        ready.done.set()
        client.flush()
        assert submitted == [[7, 8]] and client.lookup("layout-a", [7, 8]) == 2


def test_a_failed_put_is_counted_and_frees_its_bytes(ray_local):
    """Guards the write-behind's books: a put the tier actor fails (here it raises) is
    counted once, frees its share of the cap, and leaves the worker unharmed."""

    class BrokenTier(TierService):
        def put(self, *args):
            raise RuntimeError("tier disk full")

    blocks = _blocks(2, 2)
    blob, _ = blocks_to_wire(blocks)
    with _tier_on_ray(BrokenTier, max_pending_bytes=len(blob)) as (_, client):
        client.put("layout-a", [1, 2], blocks)
        # A generous budget: the failed call's error comes back through Ray, which took
        # over 10 s on a loaded 2-core CI machine; a pass returns as soon as it is reaped.
        assert client.writer.flush(60.0), "a failed put was never reaped"
        assert client.failed_puts == 1 and client.dropped_puts == 0
        assert client.writer.pending_bytes == 0 and client.admits(len(blob))
        assert client.lookup("layout-a", [1, 2]) == 0


def test_a_dead_tier_is_a_miss_not_a_failure(ray_local):
    """Guards the decode loader against a tier actor that died: a lookup is a miss (0)
    and a get a KeyError (the loader then pulls from the ticket), both within the call
    timeout, not a hang or a crash."""
    import time

    import ray

    from pdserve.cluster.tier_actor import CALL_TIMEOUT_S

    with _tier_on_ray() as (actor, client):
        assert client.lookup("layout-a", [1]) == 0  # alive, empty
        ray.kill(actor, no_restart=True)
        start = time.monotonic()
        assert client.lookup("layout-a", [1]) == 0
        with pytest.raises(KeyError, match="tier get failed"):
            client.get("layout-a", [1])
        assert time.monotonic() - start < 2 * CALL_TIMEOUT_S
