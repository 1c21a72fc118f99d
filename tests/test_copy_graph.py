"""The graph path's host-side rules (kvtransfer/copy_graph.py) that hold without a GPU:
which capacity a pull of n ids replays, what the id packing lets through, and what the
graph cache does when a capture fails. The captured graphs themselves are tested on the
GPU (tests/test_gpu_cuda_ipc.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pdserve.kernels.kv_copy import PairCache
from pdserve.kvtransfer.copy_graph import MAX_CAPACITY, CopyGraphs, _int64s, capacity_for
from pdserve.kvtransfer.layout import PagedGQAGroup
from pdserve.kvtransfer.pack import UnitCopy


def test_capacity_is_the_next_power_of_two_from_eight_and_none_past_the_max():
    """Guards the graph count and the skipped-slot bound: n ids replay the graph of the
    next power of two (never below 8, so tiny pulls share one), never one smaller than n
    (its buffer would overflow), and past MAX_CAPACITY the eager path takes over."""
    assert [capacity_for(n) for n in (0, 1, 8, 9, 16, 17, 128, 129)] == [
        8, 8, 8, 16, 16, 32, 128, 256
    ]  # fmt: skip
    for n in range(1, MAX_CAPACITY + 1, 37):
        cap = capacity_for(n)
        assert n <= cap < 2 * max(n, 8)
    assert capacity_for(MAX_CAPACITY) == MAX_CAPACITY
    assert capacity_for(MAX_CAPACITY + 1) is None


def test_id_packing_is_exact_and_refuses_what_cannot_be_an_int64():
    """Guards `try_fill`: ids are packed straight into the pinned buffer as int64, so a
    float or an int past int64 must raise (struct.error: the transport then takes the
    eager path, whose check names the id) rather than be truncated or wrapped into
    another unit's id."""
    buf = np.zeros(6, dtype=np.int64)
    _int64s(3).pack_into(buf, 8, 5, 2**40, 0)
    assert buf.tolist() == [0, 5, 2**40, 0, 0, 0]
    for bad in (2.5, 2**63, -(2**63) - 1, "3"):
        with pytest.raises(struct.error):
            _int64s(1).pack_into(buf, 0, bad)
    assert buf.tolist() == [0, 5, 2**40, 0, 0, 0], "a refused pack wrote nothing"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("operation not permitted when stream is capturing"),
        ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)"),
    ],
)
def test_a_failed_capture_is_not_retried_until_the_cache_is_cleared(caplog, error):
    """Guards the fallback: a capture that raises a CUDA error (RuntimeError), or Triton's
    refusal of a pinned id buffer the GPU cannot address (ValueError, from the staging
    kernel's first launch), must not fail the pull, nor be tried again on every pull of
    the same tables and capacity (each try costs a capture and a warning): `get` answers
    None (the caller goes eager), the failure is logged once, other capacities still
    capture, and `clear` (a source forgotten) gives the tables another try. The capture
    itself is the CUDA graph (GPU-tested); here a stand-in that fails or succeeds is
    passed in its place."""
    group = PagedGQAGroup("kv", 2, 4, 1, 8, "bfloat16")
    src, dst = group.allocate(40), group.allocate(40)
    tries = []

    class Captured:
        keep: list = []

    def capture(tables, capacities, stream, pairs):
        tries.append(tuple(capacities))
        if capacities == [8]:
            raise error
        return Captured()

    graphs = CopyGraphs(stream=None, capture=capture)
    small = [UnitCopy(src, [1, 2, 3], dst, [4, 5, 6])]
    with caplog.at_level("WARNING", logger="pdserve.kvtransfer.copy_graph"):
        assert graphs.get(small, PairCache()) is None
        assert graphs.get(small, PairCache()) is None
    assert tries == [(8,)]
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    big = [UnitCopy(src, list(range(9)), dst, list(range(10, 19)))]
    assert isinstance(graphs.get(big, PairCache()), Captured)
    assert tries == [(8,), (16,)]
    graphs.clear()
    assert graphs.get(small, PairCache()) is None
    assert tries == [(8,), (16,), (8,)]
