"""Client side of test_gpu_cuda_ipc's dead-source test, in a process of its own: a fault
through a dead exporter's mapping would poison this process's CUDA context, not the test
runner's. Pulls once (the mapping is cached), kills the source process, then pulls a
ticket whose lease still has time left (so no round trip precedes the copy), releases,
pulls again, and prints one JSON line saying what each step did.
Usage: gpu_ipc_dead_source_proc.py LAYOUT."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.transport import PullSpec, TransferError
from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_ipc_layouts import LAYOUTS, UNITS  # noqa: E402


def _step(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
        outcome = "ok"
    except TransferError as e:
        outcome = f"TransferError:{e.code}"
    except Exception as e:  # reported, not raised: the test reads what happened
        outcome = f"{type(e).__name__}:{str(e)[:160]}"
    return outcome, round(time.monotonic() - start, 3)


def main() -> None:
    name = sys.argv[1]
    layout, sizes = LAYOUTS[name]
    src_units, dst_units = UNITS[name]
    source = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "gpu_ipc_source_proc.py"), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    endpoint = "cuda_ipc+" + source.stdout.readline().strip()
    transport = CudaIpcTransport("D", layout)
    dst = tuple(g.allocate(n + 3, "cuda") for g, n in zip(layout.groups, sizes))
    ticket = Ticket(
        "r", "P", endpoint, [list(u) for u in src_units], 100, layout.compat_hash(),
        time.time() + 60, 1, None, None,
    )  # fmt: skip
    spec = PullSpec(ticket, dst_units, (0,) * len(src_units))

    def pull() -> None:
        transport.pull(spec, dst, timeout_s=5)
        torch.cuda.synchronize()

    report = {"first_pull": _step(pull)}
    source.kill()
    source.wait(30)
    report["second_pull"] = _step(pull)  # through the cached mapping, no round trip
    report["release"] = _step(lambda: transport.release(ticket, 3.0))
    report["mapping_kept"] = transport.forget(endpoint)  # False: the timeout dropped it
    report["third_pull"] = _step(pull)  # must map afresh from a source that is gone
    ones = torch.ones(1024, device="cuda")
    report["context_ok"] = float(ones.sum()) == 1024.0
    transport.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
