"""A prefill worker's write-behind from GPU blocks through the real tier actor
(cluster/tier_actor.py): the worker hands the writer thread its packed copies still on
the GPU with an event after the pack, and the writer copies them to the host itself.

Collected only where a GPU exists (tests/conftest.py)."""

from __future__ import annotations

import torch
from test_tier_actor import _blocks, _tier_on_ray

from pdserve.kernels.kv_pack import bitwise_view


def test_gpu_blocks_land_in_the_tier_bit_for_bit_once_their_pack_is_done():
    """Guards the hand-over: the writer may read the GPU blocks only after the `ready`
    event (the pack kernels' end on the worker's stream), on a stream of its own. The
    blocks are written on the current stream behind a ~10 ms GPU sleep, so a writer that
    read before `ready`, or on a stream that did not wait for it, would send the old
    bytes (zeros); every block must come back from the actor equal to its source."""
    want = _blocks(5, 3)
    gpu = [tuple(torch.zeros_like(t, device="cuda") for t in b) for b in want]
    torch.cuda.synchronize()
    with _tier_on_ray() as (_actor, client):
        torch.cuda._sleep(10_000_000)  # the "pack" is still queued when the put is made
        for dst, src in zip(gpu, want, strict=True):
            for d, s in zip(dst, src, strict=True):
                bitwise_view(d).copy_(bitwise_view(s), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        client.put("layout", [1, 2, 3, 4, 5], gpu, ready)
        assert client.writer.flush(30.0), "the write-behind did not finish"
        assert client.failed_puts == 0 and client.dropped_puts == 0
        assert client.lookup("layout", [1, 2, 3, 4, 5]) == 5
        back = client.get("layout", [1, 2, 3, 4, 5])
    for got, src in zip(back, want, strict=True):
        assert all(not t.is_cuda for t in got)
        for g, s in zip(got, src, strict=True):
            assert torch.equal(bitwise_view(g), bitwise_view(s))
