"""Which side of an NVLink should run the KV copy kernel: a probe for the cuda_ipc path
between two GPUs. Not a test.

One process, the Qwen3-0.6B-shaped paged cache of benchmarks/transfer_setup.py on GPU 0
(source) and GPU 1 (destination), units scattered on both sides. For the 2,048- and
128-token requests it times, median of `--reps` after a warm-up, both GPUs synchronized:
- `peer_copy`: one contiguous torch copy of the same bytes GPU 0 -> 1 (copy engines);
- `kernel_reads_remote`: the copy kernel on GPU 1 loading GPU 0's memory;
- `kernel_writes_remote`: the same kernel on GPU 0 storing into GPU 1's memory (what the
  cuda_ipc transport does: a mapping of another process's memory is usable only from its
  own device, so the kernel runs on the source's GPU).
Each kernel result is checked unit by unit. Prints one JSON object per case and writes
them to `<out>/peer_copy_<device-kind>.json`.

    python benchmarks/peer_copy.py [--reps 20] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
from run_meta import device_kind, git_commit
from transfer import median_s
from transfer_setup import LAYOUTS, allocate, plan, request_bytes, verify

from pdserve.kernels.kv_copy import copy_units_triton
from pdserve.kvtransfer.transport_cuda_ipc import enable_peer_access


def sync_all() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def kernel_copy(src: tuple, dst: tuple, req, on: str):
    """All tensors of the request's units, the kernel launched on device `on`."""
    s_ids = torch.tensor(req.src_ids[0], dtype=torch.int32, device=on)
    d_ids = torch.tensor(req.dst_ids[0], dtype=torch.int32, device=on)

    def run() -> None:
        with torch.cuda.device(on):
            for s, d in zip(src[0].flat(), dst[0].flat(), strict=True):
                copy_units_triton(s, s_ids, d, d_ids)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("peer_copy needs two GPUs")
    a, b = torch.device("cuda:0"), torch.device("cuda:1")
    enable_peer_access(a, b)
    layout = LAYOUTS["paged_gqa"]
    requests, sizes = plan(layout)
    src = allocate(layout, sizes, "cuda:0", fill=True)
    rows = []
    for req in requests:
        nbytes = request_bytes(layout, req)
        flat_src = torch.ones(nbytes, dtype=torch.uint8, device=a)
        flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=b)
        cases = {"peer_copy": functools.partial(flat_dst.copy_, flat_src)}
        for name, on in (("kernel_reads_remote", "cuda:1"), ("kernel_writes_remote", "cuda:0")):
            dst = allocate(layout, sizes, "cuda:1", fill=False)
            kernel_copy(src, dst, req, on)()
            sync_all()
            verify(dst, req)
            cases[name] = kernel_copy(src, dst, req, on)
        for name, fn in cases.items():
            ms = median_s(fn, args.reps, sync_all) * 1e3
            row = {
                "case": name, "tokens": req.tokens, "bytes": nbytes, "ms": ms,
                "GBps": nbytes / ms / 1e6, "device": torch.cuda.get_device_name(a),
                "gpus": torch.cuda.device_count(), "device_kind": device_kind(),
                "commit": git_commit(),
                "command": " ".join(["benchmarks/peer_copy.py", *sys.argv[1:]]),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"peer_copy_{device_kind()}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
