"""cuda_ipc between two processes on one GPU: bitwise round-trip for every layout.

Collected only where a GPU exists (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_ipc_layouts import LAYOUTS, UNITS, fill

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport

HERE = Path(__file__).parent


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cuda_ipc_round_trip_two_processes(name):
    """Guards the IPC mapping (handles, offsets, strides as plain msgpack values) and the
    side-stream copy: every destination unit must equal its source unit bit for bit, and
    every other destination unit stays zero."""
    layout, sizes = LAYOUTS[name]
    src_units, dst_units = UNITS[name]
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "gpu_ipc_source_proc.py"), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        endpoint = "cuda_ipc+" + proc.stdout.readline().strip()
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
                for s, u in zip(src_units[g][first[g] :], dst_units[g][first[g] :]):
                    assert torch.equal(bitwise_view(td[:, u]), bitwise_view(te[:, s]))
                for u in set(range(td.shape[1])) - written:
                    assert not bitwise_view(td[:, u]).any(), f"unit {u} was written"
        transport.release(ticket, 5.0)
        # A ticket near its expiry makes the pull ask the source, which knows it is gone.
        late = dataclasses.replace(ticket, lease_expiry=time.time())
        with pytest.raises(TransferError, match="unknown_lease"):
            transport.pull(PullSpec(late, dst_units, first), dst, timeout_s=5)
        transport.close()
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0
