"""Serving side of tests/test_gpu_cuda_ipc.py, in its own process: CUDA KV storages filled
from a seed, a lease on given units, a KVSourceServer exporting CUDA IPC handles. Prints
the endpoint, serves until stdin closes. Usage: gpu_ipc_source_proc.py LAYOUT [DEVICE]."""

from __future__ import annotations

import sys

import torch

from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.server import KVSourceServer
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport_cuda_ipc import export_storages

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_ipc_layouts import LAYOUTS, UNITS, fill  # noqa: E402


def main() -> None:
    name = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"  # the storages' device
    layout, sizes = LAYOUTS[name]
    storages = tuple(g.allocate(n, device) for g, n in zip(layout.groups, sizes))
    fill(storages, seed=7)
    leases = LeaseTable(60.0)
    leases.add("r", [list(u) for u in UNITS[name][0]], 100)
    source = KVSource("P", layout, storages, leases)
    server = KVSourceServer(source, "tcp://127.0.0.1:0", ipc_export=export_storages(storages))
    print(server.endpoint, flush=True)
    sys.stdin.read()
    torch.cuda.synchronize()
    server.close()


if __name__ == "__main__":
    main()
