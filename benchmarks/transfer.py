"""Bandwidth and latency of the KV transports, each next to a raw copy of the same bytes.

Not a test. Requests of the Qwen3-0.6B shape (28 layers, 8 kv heads, head_dim 128, bf16,
block size 16: 1,835,008 B per block): 2,048 tokens (128 blocks, 235 MB) and 128 tokens
(8 blocks, 14.7 MB); layout `hybrid` adds a Mamba2-style state group (one request slot,
28 MB) to the same paged group. Blocks sit at scattered ids on both sides, so packing and
run merging are exercised as in a real cache. Each case runs a warm-up pull (whose result
is checked unit by unit), then `--reps` timed pulls; the median is reported.

| transport | processes | baseline, same bytes, same run |
|---|---|---|
| tcp | two, CPU, loopback | one pyzmq frame between the same two processes |
| local | one (GPU if present) | one `torch` copy of a contiguous buffer |
| cuda_ipc | two, one GPU | one device-to-device copy |
| cuda_ipc_peer | two, source on GPU 0, puller on GPU 1 | one peer copy GPU 0 -> 1 |
| nccl | two, two GPUs | one peer copy GPU 0 -> 1 (and `send_recv_*`: one `dist.send`/`recv`) |

cuda_ipc runs only with a GPU, cuda_ipc_peer and nccl only with two (skipped with a note
otherwise); their rows say `transport: cuda_ipc` / `nccl` with `src_device`/`dst_device`. Rows
(`transport, layout, tokens, bytes, GBps, baseline_GBps, latency_ms, device, commit,
command`, plus the baseline's name and latency) are printed one JSON object per line and
written as a list to `<out>/transfer_<device-kind>.json`. `latency_ms` / `GBps` are end to
end (the call, host work included, until the bytes have landed) and stay the headline:
the call alone for cuda_ipc, whose pull returns only once its copies are done (it polls
an event); for calls that return with work queued (the baseline copy, a local pull), the
call plus polling an event recorded after it. Until 2026-12-02 every call was followed by
a device synchronize instead, which charged a cuda_ipc pull a second, redundant wait
(10-15 us on the H200, `pull_timeline.py`); GPU rows keep those times as
`latency_with_sync_ms` and `baseline_latency_with_sync_ms`. Rows of local on a GPU and of
cuda_ipc add `device_ms` / `device_GBps`: the GPU time of the pull's device work alone
(ids upload and copy kernels), CUDA events around it while a GPU sleep holds it back until
it is all queued, so what `latency_ms` adds to it is the per-pull host cost; `host_ms`,
the host time of queueing that work (the part of that cost before the GPU can start); and
`baseline_device_ms` / `baseline_device_GBps`, the copy's own GPU time measured alike.

`--p2p-backend gloo` runs the nccl transport's path over gloo on the CPU (no GPU needed);
`--threads` pins torch's CPU threads per process. The layouts, requests and the source
process live in benchmarks/transfer_setup.py.

    python benchmarks/transfer.py [--transports tcp,local,cuda_ipc,cuda_ipc_peer,nccl] \
        [--layouts paged_gqa,hybrid] [--reps 5] [--p2p-backend nccl|gloo] [--threads N] \
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import zmq
from run_meta import device_kind, git_commit
from transfer_setup import (
    LAYOUTS,
    TIMEOUT_S,
    Run,
    allocate,
    free_port,
    init_group,
    plan,
    request_bytes,
    source_process,
    ticket,
    verify,
)

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec


def median_s(
    fn: Callable[[], object],
    reps: int,
    sync: Callable[[], None],
    wait: Callable[[], None] | None = None,
) -> float:
    """Median wall time of `fn` over `reps` calls, after one untimed warm-up call. Each
    call starts on an idle device (`sync`) and its time ends when `wait` returns (default
    `sync`: for a call that returns with its device work queued)."""
    wait = sync if wait is None else wait
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _landed_for(device: str) -> Callable[[], None]:
    """Waits for the work queued so far on the current stream of every GPU by recording
    an event on each and polling it, as a cuda_ipc pull polls its `done` event, so a
    queued copy and a pull are timed to their end the same way (a device synchronize
    took the H200 host 6 us to notice a copy's end where polling took 3.7,
    benchmarks/pull_timeline.py)."""
    if not device.startswith("cuda"):
        return lambda: None
    events = [torch.cuda.Event() for _ in range(torch.cuda.device_count())]
    # Looked up once (the benchmark never switches streams): `current_stream` costs the
    # H200 host ~7 us a call, which would count against the baseline.
    streams = [torch.cuda.current_stream(i) for i in range(len(events))]

    def landed() -> None:
        for event, stream in zip(events, streams, strict=True):
            event.record(stream)
        deadline = time.monotonic() + TIMEOUT_S
        for event in events:
            while not event.query():
                if time.monotonic() > deadline:
                    raise TimeoutError("queued device work did not complete")

    return landed


# (transport, spec, dst) -> a call that queues one pull's device work without waiting.
DeviceWork = Callable[[object, PullSpec, tuple], Callable[[], torch.cuda.Event | None]]


# ~1 ms at the H200's 1.98 GHz: queueing a pull's device work takes the host ~0.1 ms.
_HOLD_CYCLES = 2_000_000


def device_ms(enqueue: Callable[[], torch.cuda.Event | None], reps: int, device: str) -> float:
    """Median GPU time, first to last, of the work `enqueue` queues (it returns an event
    that completes with that work, or None when the work is on the current stream), after
    one untimed call. A GPU sleep holds the work back until all of it is queued, so the
    gaps between the host's launches are not counted; a rep where the sleep ran out first
    is measured again with a longer sleep."""
    enqueue()
    times: list[float] = []
    hold = _HOLD_CYCLES
    while len(times) < reps:
        torch.cuda.synchronize(device)
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device):
            torch.cuda._sleep(hold)
        start.record(stream)
        done = enqueue()
        if done is not None:
            stream.wait_event(done)
        end.record(stream)
        held = not start.query()  # the sleep still ran when everything was queued
        end.synchronize()
        if held:
            times.append(start.elapsed_time(end))
        elif hold >= 64 * _HOLD_CYCLES:
            raise RuntimeError(f"queueing the work outlasted a GPU sleep of {hold} cycles")
        else:
            hold *= 2
    return statistics.median(times)


def host_ms(enqueue: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    """Median host time of queueing one pull's device work (`enqueue` returns once it is
    queued), the GPU idle before each call: the part of `latency_ms` the host adds before
    the device can start."""
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        enqueue()
        times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times) * 1e3


def _sync_for(device: str) -> Callable[[], None]:
    """Waits for every GPU: a two-GPU case's work runs on both."""
    if not device.startswith("cuda"):
        return lambda: None

    def sync() -> None:
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)

    return sync


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


# --- the cases ------------------------------------------------------------------------------

BASELINES = {
    "tcp": "raw pyzmq frame",
    "local": "torch copy",
    "cuda_ipc": "device-to-device copy",
    "cuda_ipc_peer": "peer copy cuda:0 -> cuda:1",
    "nccl": "peer copy cuda:0 -> cuda:1",
}


def pull_cases(
    transport_name: str,
    make_transport: Callable[[KVLayout], object],
    endpoints: dict[str, str],
    run: Run,
    device: str,
    baseline: Callable[[int], None],
    device_work: DeviceWork | None = None,
    extra_baselines: dict[str, Callable[[int], None]] | None = None,
    baseline_name: str | None = None,
    pull_waits: bool = False,
) -> list[dict]:
    """Pull every request of every layout (one transport per layout) into `device`, and
    time `baseline(nbytes)` on the same byte count right after; with `device_work`, also
    the GPU time of the pull's device work (`device_ms`); each of `extra_baselines` adds
    `<name>_GBps` / `<name>_latency_ms`. A call is timed until its bytes have landed:
    `pull_waits` (cuda_ipc) says the transport's `pull` returns only once its copies
    have completed (it polls its `done` event), so its time is the call's alone; calls
    that return with work queued (the baselines, a local pull) are timed until an event
    recorded after them completes (`_landed_for`). On a GPU the rows also carry the times
    with a device synchronize after every call, pull included, as measured before
    2026-12-02: `latency_with_sync_ms`, `baseline_latency_with_sync_ms`."""
    rows = []
    sync, landed = _sync_for(device), _landed_for(device)
    for name in run.layout_names:
        layout = LAYOUTS[name]
        requests, sizes = plan(layout)
        dst = allocate(layout, sizes, device, fill=False)
        transport = make_transport(layout)
        for req in requests:
            progress(f"{transport_name} {name} {req.tokens} tokens")
            first = (0,) * len(req.src_ids)
            spec = PullSpec(ticket(layout, req, endpoints[name]), req.dst_ids, first)
            transport.pull(spec, dst, TIMEOUT_S)
            verify(dst, req)
            nbytes = request_bytes(layout, req)
            call = functools.partial(transport.pull, spec, dst, TIMEOUT_S)
            t = median_s(call, run.reps, sync, (lambda: None) if pull_waits else landed)
            if run.profile_pulls:
                profile_host(transport, spec, dst, run.profile_pulls, sync)
            t_base = median_s(functools.partial(baseline, nbytes), run.reps, sync, landed)
            with_sync = {}
            if device.startswith("cuda"):  # as measured before 2026-12-02 (see the docstring)
                t_sync = median_s(call, run.reps, sync)
                t_base_sync = median_s(functools.partial(baseline, nbytes), run.reps, sync)
                with_sync = {
                    "latency_with_sync_ms": t_sync * 1e3,
                    "baseline_latency_with_sync_ms": t_base_sync * 1e3,
                }
            extra = {}
            for key, fn in (extra_baselines or {}).items():
                t_extra = median_s(functools.partial(fn, nbytes), run.reps, sync, landed)
                extra[f"{key}_GBps"] = nbytes / t_extra / 1e9
                extra[f"{key}_latency_ms"] = t_extra * 1e3
            timed_device = {}
            if device_work is not None:
                enqueue = device_work(transport, spec, dst)
                if run.profile_pulls:
                    profile_enqueue(enqueue, run.profile_pulls, sync)
                ms = device_ms(enqueue, run.reps, device)
                base_ms = device_ms(functools.partial(baseline, nbytes), run.reps, device)
                timed_device = {
                    "host_ms": host_ms(enqueue, run.reps, sync),
                    "device_ms": ms,
                    "device_GBps": nbytes / ms / 1e6,
                    "baseline_device_ms": base_ms,
                    "baseline_device_GBps": nbytes / base_ms / 1e6,
                }
            rows.append(
                {
                    "transport": transport_name.removesuffix("_peer"),
                    "src_device": run.source_device(transport_name),
                    "dst_device": device,
                    "layout": name,
                    "tokens": req.tokens,
                    "bytes": nbytes,
                    "GBps": nbytes / t / 1e9,
                    "baseline": baseline_name or BASELINES[transport_name],
                    "baseline_GBps": nbytes / t_base / 1e9,
                    "latency_ms": t * 1e3,
                    "baseline_latency_ms": t_base * 1e3,
                    **timed_device,
                    **with_sync,
                    **extra,
                    "reps": run.reps,
                    "threads": torch.get_num_threads(),
                    "device": _device_name(device),
                }
            )
        transport.close()
    return rows


def profile_host(transport, spec: PullSpec, dst: tuple, n: int, sync) -> None:
    """Where a pull's host time goes: `n` pulls under cProfile, top functions to stderr."""
    import cProfile
    import pstats

    sync()
    with cProfile.Profile() as prof:
        for _ in range(n):
            transport.pull(spec, dst, TIMEOUT_S)
            sync()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def _pull_stages() -> list[tuple[object, str]]:
    """The functions a pull's host time is split over (`host_stages`)."""
    from pdserve.kernels import kv_copy
    from pdserve.kvtransfer import copy_graph, id_staging, pack, transport_cuda_ipc, transport_local

    ipc = transport_cuda_ipc.CudaIpcTransport
    return [
        (ipc, "_sources"), (ipc, "_ensure_peer"), (ipc, "_side_stream"), (ipc, "_replay"),
        (copy_graph.CopyGraphs, "get"), (copy_graph.GraphedCopy, "try_fill"),
        (copy_graph.GraphedCopy, "replay"), (transport_cuda_ipc, "verify_copies"),
        (transport_cuda_ipc, "copy_groups"), (transport_local, "copy_groups"),
        (pack, "_check_ids"), (pack, "_device_ids"),
        (id_staging.IdStaging, "stage"), (kv_copy.PairCache, "get"),
        (pack, "copy_units_joined"), (kv_copy._Pair, "launch"),
        (kv_copy._copy_units_kernel, "run"),
    ]  # fmt: skip


def profile_enqueue(enqueue: Callable[[], object], n: int, sync: Callable[[], None]) -> None:
    """Where the host time of queueing a pull goes: microseconds per enqueue in each of
    `_pull_stages` (wall clock), then down to the CUDA API calls (a call that blocks shows
    there, not in cProfile): `n` enqueues, the GPU idle before each, under torch's
    profiler; both to stderr."""
    from host_stages import stage_times
    from torch.profiler import ProfilerActivity, profile

    stages = stage_times(_pull_stages(), enqueue, n, between=sync)
    print(json.dumps({"host_us": {k: round(v, 1) for k, v in stages.items()}}), file=sys.stderr)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            enqueue()
            sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table, file=sys.stderr)


def local_device_work(transport, spec: PullSpec, dst: tuple) -> Callable[[], None]:
    """A local pull on a GPU queues its copies on the current stream and returns."""

    def enqueue() -> None:
        transport.pull(spec, dst, TIMEOUT_S)

    return enqueue


def ipc_device_work(transport, spec: PullSpec, dst: tuple) -> Callable[[], torch.cuda.Event]:
    """A cuda_ipc pull without its wait: the copies go on the transport's side stream."""
    return lambda: transport.enqueue_pull(spec, dst, time.monotonic() + TIMEOUT_S).done


def _request_socket(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1e3))
    sock.connect(endpoint)
    return sock


def zmq_baseline(endpoint: str) -> Callable[[int], None]:
    sock = _request_socket(endpoint)

    def fetch(nbytes: int) -> None:
        sock.send(str(nbytes).encode())
        frame = sock.recv(copy=False)
        assert len(frame) == nbytes, (len(frame), nbytes)

    return fetch


def p2p_baseline(endpoint: str, device: str) -> Callable[[int], None]:
    sock, bufs = _request_socket(endpoint), {}

    def fetch(nbytes: int) -> None:
        sock.send(str(nbytes).encode())
        assert sock.recv() == b"go"
        if nbytes not in bufs:
            bufs[nbytes] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.recv(bufs[nbytes], 0)

    return fetch


def copy_baseline(device: str, src_device: str | None = None) -> Callable[[int], None]:
    """One copy of a contiguous buffer into `device`, from `src_device` (default: the same
    device; another GPU makes it a peer copy, torch's copy-engine path)."""
    bufs: dict[int, tuple[torch.Tensor, ...]] = {}

    def copy(nbytes: int) -> None:
        if nbytes not in bufs:
            bufs[nbytes] = tuple(
                torch.ones(nbytes, dtype=torch.uint8, device=d)
                for d in (src_device or device, device)
            )
        src, dst = bufs[nbytes]
        dst.copy_(src)

    return copy


def run_tcp(run: Run) -> list[dict]:
    from pdserve.kvtransfer.transport_tcp import TcpTransport

    with source_process("tcp", run) as eps:
        return pull_cases(
            "tcp", lambda layout: TcpTransport("D", layout), eps["layouts"], run, "cpu",
            zmq_baseline(eps["raw"]),
        )  # fmt: skip


def run_local(run: Run) -> list[dict]:
    from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport

    device = run.source_device("local")  # one process: the pull's device too
    registry, endpoints = LocalRegistry(), {}
    for name in run.layout_names:
        layout = LAYOUTS[name]
        requests, sizes = plan(layout)
        leases = LeaseTable(3600.0)
        for req in requests:
            leases.add(req.request_id, [list(ids) for ids in req.src_ids], req.tokens)
        storages = allocate(layout, sizes, device, fill=True)
        endpoints[name] = registry.add(KVSource(f"P-{name}", layout, storages, leases))
    work = local_device_work if device.startswith("cuda") else None
    return pull_cases(
        "local", lambda layout: LocalTransport(registry, layout.compat_hash()), endpoints, run,
        device, copy_baseline(device), work,
    )  # fmt: skip


def run_cuda_ipc(run: Run) -> list[dict]:
    from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport

    with source_process("cuda_ipc", run) as eps:
        return pull_cases(
            "cuda_ipc", lambda layout: CudaIpcTransport("D", layout), eps["layouts"], run,
            "cuda:0", copy_baseline("cuda:0"), ipc_device_work, pull_waits=True,
        )  # fmt: skip


def run_cuda_ipc_peer(run: Run) -> list[dict]:
    """cuda_ipc between two GPUs: the source process's cache on cuda:0, this process pulls
    into cuda:1 (its copy kernel on cuda:1 reads cuda:0's memory over the link)."""
    from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport

    with source_process("cuda_ipc_peer", run) as eps:
        return pull_cases(
            "cuda_ipc_peer", lambda layout: CudaIpcTransport("D", layout), eps["layouts"], run,
            "cuda:1", copy_baseline("cuda:1", "cuda:0"), ipc_device_work, pull_waits=True,
        )  # fmt: skip


def run_nccl(run: Run) -> list[dict]:
    """Source rank 0 on GPU 0, puller rank 1 (this process) on GPU 1; with the gloo
    backend both on the CPU."""
    from pdserve.kvtransfer.transport_nccl import NcclTransport

    port = free_port()
    device = "cpu" if run.p2p_backend == "gloo" else "cuda:1"
    join_group = functools.partial(init_group, run.p2p_backend, port, 1, device)
    with source_process("nccl", run, port, join_group, dist.destroy_process_group) as eps:
        if device == "cpu":
            base, extra, name = p2p_baseline(eps["raw"], device), {}, "raw dist.send/recv"
        else:  # the headline baseline is a plain peer copy, send/recv rides along
            base, name = copy_baseline(device, "cuda:0"), None
            extra = {"send_recv": p2p_baseline(eps["raw"], device)}
        return pull_cases(
            "nccl", lambda layout: NcclTransport("D", layout), eps["layouts"], run, device,
            base, extra_baselines=extra, baseline_name=name,
        )  # fmt: skip


RUNNERS = {
    "tcp": run_tcp,
    "local": run_local,
    "cuda_ipc": run_cuda_ipc,
    "cuda_ipc_peer": run_cuda_ipc_peer,
    "nccl": run_nccl,
}


def progress(line: str) -> None:
    print(f"[transfer] {line}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transports", default="tcp,local,cuda_ipc,cuda_ipc_peer,nccl")
    ap.add_argument("--layouts", default="paged_gqa", help=f"of {sorted(LAYOUTS)}")
    ap.add_argument("--reps", type=int, default=5, help="timed pulls per case (median)")
    ap.add_argument(
        "--p2p-backend",
        choices=["nccl", "gloo"],
        default="nccl",
        help="backend of the nccl transport's group; gloo runs it on the CPU, without GPUs",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads per process (0: default)"
    )
    ap.add_argument("--profile-pulls", type=int, default=0, help="also profile N pulls per case")
    ap.add_argument(
        "--hang-dump-s", type=float, default=0.0,
        help="print every thread's stack in both processes after this many seconds (a hang)",
    )  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.hang_dump_s > 0:
        faulthandler.dump_traceback_later(args.hang_dump_s)
    transports = args.transports.split(",")
    layout_names = args.layouts.split(",")
    for bad, known in (
        (set(transports) - set(RUNNERS), RUNNERS),
        (set(layout_names) - set(LAYOUTS), LAYOUTS),
    ):
        if bad:
            ap.error(f"unknown {sorted(bad)}; known: {sorted(known)}")
    if args.reps < 1 or args.threads < 0:
        ap.error("--reps must be >= 1 and --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {"commit": git_commit(), "command": " ".join(["benchmarks/transfer.py", *sys.argv[1:]])}
    run = Run(
        tuple(layout_names), args.reps, args.p2p_backend, args.profile_pulls, args.hang_dump_s
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = []
    for name in transports:
        needs = {"cuda_ipc": 1, "cuda_ipc_peer": 2, "nccl": 2 if run.p2p_backend == "nccl" else 0}
        needs = needs.get(name, 0)
        if gpus < needs:
            progress(f"{name}: skipped, needs {needs} GPU(s), found {gpus}")
            continue
        for row in RUNNERS[name](run):
            if name == "nccl":
                row["p2p_backend"] = run.p2p_backend
            row["gpus"] = gpus
            row["device_kind"] = device_kind()
            row.update(meta)
            print(json.dumps(row), flush=True)
            rows.append(row)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"transfer_{device_kind()}.json"
    path.write_text(json.dumps(rows, indent=2) + "\n")
    progress(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
