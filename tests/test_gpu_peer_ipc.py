"""cuda_ipc between two processes on two GPUs (peer access): bitwise round-trip.

Collected only where two GPUs exist (tests/conftest.py). The source process may see the
GPUs in another order than the puller (as `pdserve serve`'s whole-GPU workers do: each
sees its own GPU as cuda:0), so the export's device index means nothing here and the
importer must find the GPU by its UUID.
"""

from __future__ import annotations

import time

import pytest
import torch
from gpu_ipc_layouts import LAYOUTS, UNITS, fill, source_process

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.transport import PullSpec
from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport

# (source's CUDA_VISIBLE_DEVICES, source's device, puller's destination device): the
# source's storages are on physical GPU 0 in the first case, on physical GPU 1 (its own
# cuda:0, as a serve worker sees it) in the second.
CASES = {
    "same_order": ("0,1", "cuda:0", "cuda:1"),
    "source_reordered": ("1,0", "cuda:0", "cuda:0"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cuda_ipc_round_trip_between_two_gpus(name, case):
    """Every destination unit equals its source unit bit for bit after a pull whose copy
    kernel runs on the source's GPU and writes the other's memory; other units stay zero."""
    visible, src_device, dst_device = CASES[case]
    layout, sizes = LAYOUTS[name]
    src_units, dst_units = UNITS[name]
    with source_process(name, src_device, visible) as endpoint:
        expect = tuple(g.allocate(n, "cpu") for g, n in zip(layout.groups, sizes))
        fill(expect, seed=7)
        dst = tuple(g.allocate(n + 3, dst_device) for g, n in zip(layout.groups, sizes))
        transport = CudaIpcTransport("D", layout)
        ticket = Ticket(
            "r", "P", endpoint, [list(u) for u in src_units], 100, layout.compat_hash(),
            time.time() + 60, 1, None, None,
        )  # fmt: skip
        first = (0,) * len(src_units)
        transport.pull(PullSpec(ticket, dst_units, first), dst, timeout_s=30)
        mapped = transport._mapped[endpoint]
        assert mapped[0].device != dst[0].device, "the source must be on the other GPU"
        torch.cuda.synchronize()
        for g, (e, d) in enumerate(zip(expect, dst)):
            for te, td in zip(e.flat(), d.flat()):
                got = bitwise_view(td).cpu()
                want = bitwise_view(te)
                for s, u in zip(src_units[g], dst_units[g]):
                    assert torch.equal(got[:, u], want[:, s]), f"group {g} unit {u}"
                for u in set(range(td.shape[1])) - set(dst_units[g]):
                    assert not got[:, u].any(), f"unit {u} was written"
        transport.release(ticket, 5.0)
        transport.close()
