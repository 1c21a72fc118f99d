"""Where a cuda_ipc pull's end-to-end time goes beyond its host and device work.

Not a test. transfer.py reports a 2,048-token cuda_ipc pull's end-to-end latency, the host
time of queueing it and the device time of its work held behind a GPU sleep; on the H200
the latency exceeds their sum by 0-23 us from run to run (and the plain copy's latency
exceeds its device time by 10-18 us), which decides whether a run reaches 80% of the
copy. This times one pull (and one plain copy of the same bytes) as a timeline, median
over `--reps`:

- `prelaunch_us`: host, call start to the return of `enqueue_pull` (the graph launched);
- `gpu_span_us`: CUDA events, one recorded on the side stream just before the call and
  one just after the launch, so: the host's pre-launch time + the graph's launch latency
  + its execution;
- `launch_and_run_us` = gpu_span - prelaunch: what the GPU adds after the launch call
  returns; minus the held device time, the launch latency;
- `detect_us`: host, call start to `done` seen complete (after the id check `pull` makes
  while the device copies), minus gpu_span: polling latency;
- `after_us`: host, from `done` seen to the end of `pull` and a device synchronize.

    python benchmarks/pull_timeline.py [--reps 50] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from run_meta import write_result
from transfer_setup import LAYOUTS, TIMEOUT_S, Run, allocate, plan, source_process, ticket

from pdserve.kvtransfer.pack import verify_copies
from pdserve.kvtransfer.transport import PullSpec
from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport


def _median(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}


def _times(t0: float, t1: float, t_end: float, span_us: float) -> dict:
    """A call's split: start `t0`, launch returned `t1`, bytes landed and seen `t_end`
    (host seconds); `span_us` the GPU span its events measured."""
    return {
        "prelaunch_us": (t1 - t0) * 1e6,
        "gpu_span_us": span_us,
        "launch_and_run_us": span_us - (t1 - t0) * 1e6,
        "end_to_end_us": (t_end - t0) * 1e6,
    }


def pull_timeline(transport, spec, dst, reps: int) -> dict:
    transport.pull(spec, dst, TIMEOUT_S)  # maps the source, captures the graph
    ((_, side),) = transport._side.__dict__["sides"].items()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        a.record(side.stream)
        t0 = time.perf_counter()
        queued = transport.enqueue_pull(spec, dst, time.monotonic() + TIMEOUT_S)
        t1 = time.perf_counter()
        b.record(side.stream)
        verify_copies(queued.unchecked)  # as `pull` does while the device copies
        deadline = time.monotonic() + TIMEOUT_S
        while not queued.done.query():  # `pull`'s polling, as it does it
            if time.monotonic() > deadline:
                raise TimeoutError("the pull's copy did not complete")
        t2 = time.perf_counter()
        if queued.graph is not None:
            queued.graph.idle = True
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        row = _times(t0, t1, t3, a.elapsed_time(b) * 1e3)
        row["detect_us"] = (t2 - t0) * 1e6 - row["gpu_span_us"]
        row["after_us"] = (t3 - t2) * 1e6
        rows.append(row)
    return _median(rows[1:])


def copy_timeline(nbytes: int, reps: int) -> dict:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        row = _times(t0, t1, t3, a.elapsed_time(b) * 1e3)
        row["sync_after_span_us"] = row["end_to_end_us"] - row["gpu_span_us"]
        rows.append(row)
    return _median(rows[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    run = Run(("paged_gqa",), args.reps, "nccl")
    layout = LAYOUTS["paged_gqa"]
    requests, sizes = plan(layout)
    out_rows = []
    with source_process("cuda_ipc", run) as eps:
        dst = allocate(layout, sizes, "cuda:0", fill=False)
        transport = CudaIpcTransport("D", layout)
        for req in requests:
            spec = PullSpec(
                ticket(layout, req, eps["layouts"]["paged_gqa"]),
                req.dst_ids,
                (0,) * len(req.src_ids),
            )
            nbytes = sum(len(ids) * g.unit_bytes() for ids, g in zip(req.src_ids, layout.groups))
            row = {
                "tokens": req.tokens,
                "bytes": nbytes,
                "pull": pull_timeline(transport, spec, dst, args.reps),
                "copy": copy_timeline(nbytes, args.reps),
            }
            print(json.dumps(row), flush=True)
            out_rows.append(row)
        transport.close()
    write_result(
        args.out, "pull_timeline", "benchmarks/pull_timeline.py", sys.argv[1:],
        {
            "what": "a cuda_ipc pull's and a plain copy's end-to-end time split into host "
            "pre-launch, GPU span (events), polling and synchronize; medians",
            "reps": args.reps,
            "rows": out_rows,
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
