"""Device time of unit-copy kernel shapes, and the host cost of the calls a pull makes.

Not a test. The copy is the cuda_ipc pull's: a scattered Qwen3-0.6B-shaped request (28
layers, 64 KB block-layers of int64 words) at the ids benchmarks/transfer_setup.py uses,
2,048 tokens (128 blocks, 235 MB) and 128 tokens (8 blocks, 14.7 MB), next to one
contiguous device-to-device copy of the same bytes. Candidates:

- `grid`: kernels/kv_copy.py's kernel (one program per chunk of a row) at several tile,
  chunk and warp counts;
- `counted`: the graph path's kernel (the id count read on the device);
- `hint`: the grid kernel with other cache hints;
- `counted-const`: the counted kernel with the chunks per row and the capacity as
  compile-time constants;
- `tma`: a copy through Hopper's tensor memory accelerator (host tensor descriptors over
  [L, NU, R, C] int32 words, a [1, 1, BR, C] box at a time);
- `graph`: the shipped GraphedCopy replayed on the measuring stream and on a side stream;
- `part`: graphs of its parts (the kernel alone, + the id upload as a memcpy node or as
  a one-program staging kernel, + the event nodes), to see which node costs what.

At `4d81a20` / `1c26a68` (H200, 2,048 tokens, held device time; results/
kv_copy_sweep_graph_parts_1c26a68.json): every kernel variant is 0.1252-0.1259 ms against
0.1136 for the copy, constants included; TMA is slower (0.129-0.133 ms); in a graph the
memcpy upload node adds ~8 us (0.1341) and a staging kernel ~2.6 (0.1287), the event
nodes nothing measurable. So GraphedCopy uploads with the staging kernel.

Measured with earlier versions and dropped (H200, 2,048-token request): a persistent
kernel, a fixed grid of 2-16 programs per SM looping over the chunks, was 1-3% slower
than one program per chunk at every shape (0.131-0.135 ms; the plain copy 0.114); ids
0..n-1 on both sides (contiguous per layer) copied no faster than scattered ones (0.130
ms), so the scatter is not what costs; evict_first hints cost 4% (0.131 vs 0.126 ms).

A first version also tried the copy engines, all rows in one cuMemcpyBatchAsync call
(ctypes): its host call outlasted a 2 ms GPU sleep at 3,584 rows, far past a kernel
launch, so it was dropped.

Each is timed as the mean of 50 back-to-back launches between two CUDA events, then
checked against the torch reference. For the 2,048-token request the host queues a launch
in less than the 0.13 ms it runs, so the GPU never waits; the 128-token rows are bound by
the launches' host time instead, and `held_ms` (transfer.py's `device_ms`: the work held
behind a GPU sleep until it is queued) gives every case's GPU time next to the copy's.
`--host` adds the host time of each call a pull makes (streams, events, a graph replay,
a Triton launch, the id checks), mean of 2,000.

    python benchmarks/kv_copy_sweep.py [--host] [--only PREFIX,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
from run_meta import device_kind, git_commit
from transfer import device_ms, host_ms, median_s
from transfer_setup import LAYOUTS, plan

from pdserve.kernels import kv_copy
from pdserve.kernels.kv_pack import bitwise_view

_REPS = 50


@triton.jit
def _hinted_copy_kernel(
    src_ptr, dst_ptr, ids_ptr, n, src_ls, src_us, dst_ls, dst_us, num_layers, chunks_per_row,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, HINT: tl.constexpr,
):  # fmt: skip
    """kv_copy's grid kernel with other cache hints (HINT 0: none, 1: evict_first both
    ways, as shipped, 2: streaming `.cs` stores, 3: `.cg` loads and `.cs` stores); rows
    are whole multiples of CHUNK here."""
    pid = tl.program_id(0)
    row = pid // chunks_per_row
    chunk = pid - row * chunks_per_row
    i = row // num_layers
    layer = (row - i * num_layers).to(tl.int64)
    s = tl.load(ids_ptr + i)
    d = tl.load(ids_ptr + n + i)
    src = src_ptr + layer * src_ls + s * src_us
    dst = dst_ptr + layer * dst_ls + d * dst_us
    start = chunk.to(tl.int64) * CHUNK
    for k in tl.static_range(0, CHUNK, BLOCK):
        offs = start + k + tl.arange(0, BLOCK)
        if HINT == 0:
            tl.store(dst + offs, tl.load(src + offs))
        elif HINT == 1:
            w = tl.load(src + offs, eviction_policy="evict_first")
            tl.store(dst + offs, w, eviction_policy="evict_first")
        elif HINT == 2:
            w = tl.load(src + offs, eviction_policy="evict_first")
            tl.store(dst + offs, w, cache_modifier=".cs")
        else:
            w = tl.load(src + offs, cache_modifier=".cg")
            tl.store(dst + offs, w, cache_modifier=".cs")


@triton.jit
def _counted_spec_kernel(
    src_ptr, dst_ptr, ids_ptr, src_units, dst_units, src_ls, src_us, dst_ls, dst_us,
    num_layers, chunks_per_row: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """kv_copy's counted kernel with the chunks per row and the capacity as constants
    (the ids at offset 0: count, CAP source slots, CAP destination slots)."""
    pid = tl.program_id(0)
    row = pid // chunks_per_row
    chunk = pid - row * chunks_per_row
    i = row // num_layers
    n = tl.load(ids_ptr)
    s = tl.load(ids_ptr + 1 + i)
    d = tl.load(ids_ptr + 1 + CAP + i)
    if i < n:
        layer = (row - i * num_layers).to(tl.int64)
        if (s >= 0) & (s < src_units) & (d >= 0) & (d < dst_units):
            src = src_ptr + layer * src_ls + s * src_us
            dst = dst_ptr + layer * dst_ls + d * dst_us
            start = chunk.to(tl.int64) * CHUNK
            for k in tl.static_range(0, CHUNK, BLOCK):
                offs = start + k + tl.arange(0, BLOCK)
                tl.store(dst + offs, tl.load(src + offs))


@triton.jit
def _tma_copy_kernel(
    src_desc, dst_desc, ids_ptr, n, num_layers, chunks_per_row,
    ROWS: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """One program copies ROWS sub-rows of a (unit, layer) row, BR at a time, through
    Hopper's tensor memory accelerator (host descriptors over [L, NU, R, C] words)."""
    pid = tl.program_id(0)
    row = pid // chunks_per_row
    chunk = pid - row * chunks_per_row
    i = row // num_layers
    layer = row - i * num_layers
    s = tl.load(ids_ptr + i).to(tl.int32)
    d = tl.load(ids_ptr + n + i).to(tl.int32)
    for k in tl.static_range(0, ROWS, BR):
        r = chunk * ROWS + k
        x = src_desc.load([layer, s, r, 0])
        dst_desc.store([layer, d, r, 0], x)


def _spec_case(pair, counted, n, block, chunk, warps):
    chunks_per_row = pair.num_words // chunk

    def launch():
        _counted_spec_kernel[(n * pair.num_layers * chunks_per_row,)](
            pair.src_words, pair.dst_words, counted, pair.src_words.shape[1],
            pair.dst_words.shape[1], *pair.strides, pair.num_layers,
            chunks_per_row=chunks_per_row, CAP=n, CHUNK=chunk, BLOCK=block, num_warps=warps,
        )  # fmt: skip

    return launch


def _tma_case(pair, ids, n, cols, br, rows_per_program, warps, stages):
    """The TMA kernel over int32 words: a row of W int32 words is R sub-rows of `cols`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    src, dst = bitwise_view(pair.src, 4), bitwise_view(pair.dst, 4)
    num_layers, _, words = src.shape
    sub_rows = words // cols

    def desc(t):
        return TensorDescriptor(
            t, [t.shape[0], t.shape[1], sub_rows, cols],
            [t.stride(0), t.stride(1), cols, 1], [1, 1, br, cols],
        )  # fmt: skip

    sd, dd = desc(src), desc(dst)
    chunks_per_row = sub_rows // rows_per_program

    def launch():
        _tma_copy_kernel[(n * num_layers * chunks_per_row,)](
            sd, dd, ids, n, num_layers, chunks_per_row, ROWS=rows_per_program, BR=br,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return launch


def _hinted_case(pair, ids, n, block, chunk, warps, hint):
    chunks_per_row = pair.num_words // chunk

    def launch():
        _hinted_copy_kernel[(n * pair.num_layers * chunks_per_row,)](
            pair.src_words, pair.dst_words, ids, n, *pair.strides, pair.num_layers,
            chunks_per_row, CHUNK=chunk, BLOCK=block, HINT=hint, num_warps=warps,
        )  # fmt: skip

    return launch


def _queued(fn):
    """`fn` as transfer.device_ms's enqueue: its work goes on the current stream."""

    def enqueue() -> None:
        fn()

    return enqueue


def events_ms(fn, reps: int = _REPS) -> float:
    """Mean device time of `fn`'s work over `reps` back-to-back calls (CUDA events), after
    one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _tables(device: str):
    layout = LAYOUTS["paged_gqa"]
    requests, sizes = plan(layout)
    group = layout.groups[0]
    src = group.allocate(sizes[0], device).flat()[0]
    dst = group.allocate(sizes[0], device).flat()[0]
    bitwise_view(src).copy_(
        torch.randint(-(2**15), 2**15, src.shape, dtype=torch.int16, device=device)
    )
    return src, dst, requests


def _grid_case(pair, ids, n, block, chunk, warps):
    chunks_per_row = -(-pair.num_words // chunk)

    def launch():
        kv_copy._copy_units_kernel[(n * pair.num_layers * chunks_per_row,)](
            pair.src_words, pair.dst_words, ids, 0, n, *pair.strides,
            pair.num_layers, pair.num_words, chunks_per_row,
            CHUNK=chunk, BLOCK=block, EVEN=pair.num_words % chunk == 0, num_warps=warps,
        )  # fmt: skip

    return launch


def _counted_case(pair, ids, n):
    """The graph path's kernel (count read on the device), capacity n: ids are
    [n, n source ids, n destination ids]."""
    return functools.partial(pair.launch_counted, ids, 0, n)


def _graph_cases(src, dst, s_ids, d_ids) -> list:
    """The shipped GraphedCopy (id upload, event nodes, counted kernel) replayed on the
    measuring stream and on a side stream, as a pull replays it (the measuring stream then
    waits for its `done`)."""
    from pdserve.kvtransfer.copy_graph import GraphedCopy, capacity_for

    cur = torch.cuda.current_stream()
    cases = []
    for name, stream in (("graph same stream", cur), ("graph side stream", torch.cuda.Stream())):
        graph = GraphedCopy([[(src, dst)]], [capacity_for(len(s_ids))], stream, kv_copy.PairCache())
        assert graph.try_fill([(list(s_ids), list(d_ids))])

        def launch(graph=graph, stream=stream) -> None:
            graph.replay(stream, cur)
            if stream is not cur:
                cur.wait_event(graph.done)

        cases.append((name, launch))
    return cases + _part_graph_cases(src, dst, s_ids, d_ids)


def _part_graph_cases(src, dst, s_ids, d_ids) -> list:
    """Graphs of parts of GraphedCopy, captured on the measuring stream: which node costs
    the graph its time over the kernel alone. `kernel`: the counted kernel over ids already
    on the device; `+upload`: the pinned-to-device id copy first; `+events`: an external
    event wait before and record after; `+stage`: the ids copied by a one-program kernel
    reading the pinned buffer through unified addressing (kernels/kv_copy.py `stage_ids`,
    what GraphedCopy ships) instead of the upload."""
    from pdserve.kvtransfer.copy_graph import capacity_for

    cur = torch.cuda.current_stream()
    cap = capacity_for(len(s_ids))
    n = len(s_ids)
    slots = [n, *s_ids, *([0] * (cap - n)), *d_ids, *([0] * (cap - n))]
    host = torch.tensor(slots, dtype=torch.int64).pin_memory()
    pair = kv_copy.PairCache().get(src, dst)
    cases = []
    for upload, events in (
        ("", False), ("upload", False), ("stage", False), ("", True), ("upload", True),
        ("stage", True),
    ):  # fmt: skip
        device = host.to(src.device)
        ready, done = torch.cuda.Event(external=True), torch.cuda.Event(external=True)
        pair.launch_counted(device, 0, cap)
        kv_copy.stage_ids(host, device)
        ready.record(cur)
        done.record(cur)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            if events:
                cur.wait_event(ready)
            if upload == "upload":
                device.copy_(host, non_blocking=True)
            elif upload == "stage":
                kv_copy.stage_ids(host, device)
            pair.launch_counted(device, 0, cap)
            if events:
                done.record(cur)
        finally:
            graph.capture_end()
        name = "part kernel" + (f"+{upload}" if upload else "") + ("+events" if events else "")

        # The graph holds raw addresses and event handles, not references.
        def launch(graph=graph, ready=ready, events=events, keep=(device, done, host)) -> None:
            if events:
                ready.record(cur)
            graph.replay()

        cases.append((name, launch))
    return cases


def sweep(device: str, only: list[str] | None = None) -> list[dict]:
    src, dst, requests = _tables(device)
    pair = kv_copy._Pair(src, dst)
    rows = []
    for req in requests:
        s_ids, d_ids = req.src_ids[0], req.dst_ids[0]
        n = len(s_ids)
        nbytes = n * pair.num_layers * pair.num_words * 8
        joined = torch.tensor([*s_ids, *d_ids], dtype=torch.int64, device=device)
        counted = torch.tensor([n, *s_ids, *d_ids], dtype=torch.int64, device=device)
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        base = events_ms(functools.partial(flat_dst.copy_, flat_src))
        base_held = device_ms(_queued(functools.partial(flat_dst.copy_, flat_src)), 20, device)
        dst.zero_()
        want = dst.clone()
        kv_copy.copy_units_ref(
            src, torch.tensor(s_ids, device=device), want, torch.tensor(d_ids, device=device)
        )
        cases = []
        for block, tiles in ((2048, 1), (2048, 4), (4096, 2)):
            chunk = block * tiles
            cases.append(
                (f"grid b{block} t{tiles} w4", _grid_case(pair, joined, n, block, chunk, 4))
            )
            for hint in (0, 2, 3):
                cases.append(
                    (f"hint{hint} b{block} t{tiles} w4",
                     _hinted_case(pair, joined, n, block, chunk, 4, hint))
                )  # fmt: skip
        cases.append(("counted (graph path's kernel, capacity n)", _counted_case(pair, counted, n)))
        for block, tiles in ((2048, 1), (2048, 4), (4096, 2)):
            chunk = block * tiles
            cases.append(
                (f"counted-const b{block} t{tiles} w4",
                 _spec_case(pair, counted, n, block, chunk, 4))
            )  # fmt: skip
        for cols, br, rpp, warps, stages in (
            (256, 8, 8, 4, 1),
            (256, 8, 32, 4, 1),
            (256, 16, 16, 4, 1),
            (256, 16, 64, 4, 1),
            (256, 32, 32, 4, 1),
            (256, 32, 64, 8, 1),
            (128, 32, 32, 4, 1),
            (256, 8, 64, 4, 1),
        ):
            cases.append(
                (f"tma c{cols} br{br} rows{rpp} w{warps}",
                 _tma_case(pair, joined, n, cols, br, rpp, warps, stages))
            )  # fmt: skip
        cases += _graph_cases(src, dst, s_ids, d_ids)
        if only:
            cases = [c for c in cases if any(c[0].startswith(o) for o in only)]
        for name, launch in cases:
            dst.zero_()
            try:
                ms = events_ms(launch)
            except Exception as e:  # a shape Triton cannot compile is reported, not fatal
                rows.append({"tokens": req.tokens, "case": name, "error": repr(e)[:200]})
                continue
            ok = bool(torch.equal(bitwise_view(dst), bitwise_view(want)))
            held = device_ms(_queued(launch), 20, device)
            rows.append(
                {
                    "tokens": req.tokens, "case": name, "ms": round(ms, 5), "held_ms": held,
                    "call_us": host_ms(launch, 20, torch.cuda.synchronize) * 1e3,
                    "GBps": round(nbytes / ms / 1e6, 1), "of_copy": round(base / ms, 4),
                    "copy_ms": round(base, 5), "copy_held_ms": base_held, "correct": ok,
                }
            )  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _host_us(fn, reps: int = 2000) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def _poll(event: torch.cuda.Event) -> None:
    while not event.query():
        pass


def replay_e2e(device: str) -> list[dict]:
    """End to end (host call to completion seen by the host, median of 30, GPU idle
    before each) of a filled `GraphedCopy` replayed through torch and through the driver's
    cuGraphLaunch on its raw exec handle, next to one contiguous copy of the same bytes."""
    import ctypes

    from pdserve.kernels.kv_copy import PairCache
    from pdserve.kvtransfer.copy_graph import GraphedCopy, capacity_for

    cuda = ctypes.CDLL("libcuda.so.1")
    src, dst, requests = _tables(device)
    side, cur = torch.cuda.Stream(), torch.cuda.current_stream()
    done = torch.cuda.Event()
    rows = []
    for req in requests:
        s_ids, d_ids = list(req.src_ids[0]), list(req.dst_ids[0])
        graph = GraphedCopy([[(src, dst)]], [capacity_for(len(s_ids))], side, PairCache())
        assert graph.try_fill([(s_ids, d_ids)])
        exec_handle = ctypes.c_void_p(graph.graph.raw_cuda_graph_exec())
        stream_handle = ctypes.c_void_p(side.cuda_stream)

        def torch_replay():
            torch.cuda.set_stream(side)
            graph.graph.replay()  # noqa: B023 (called in this iteration)
            torch.cuda.set_stream(cur)
            done.record(side)
            _poll(done)

        def raw_replay():
            err = cuda.cuGraphLaunch(exec_handle, stream_handle)  # noqa: B023 (called in this iteration)
            assert err == 0, f"cuGraphLaunch: CUresult {err}"
            done.record(side)
            _poll(done)

        nbytes = len(s_ids) * src.shape[0] * src.shape[2] * src.element_size()
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat)

        def copy():
            flat_dst.copy_(flat)  # noqa: B023 (called in this iteration)
            torch.cuda.current_stream().synchronize()

        row = {"tokens": req.tokens}
        for name, fn in (
            ("torch_replay", torch_replay),
            ("raw_replay", raw_replay),
            ("copy", copy),
        ):
            row[f"{name}_us"] = median_s(fn, 30, torch.cuda.synchronize) * 1e6
        row["fill_us"] = _host_us(lambda: graph.try_fill([(s_ids, d_ids)]), 200)  # noqa: B023
        rows.append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def host_costs(device: str) -> dict[str, float]:
    from pdserve.kvtransfer import pack

    dev = torch.device(device)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    ids_host = torch.zeros(257, dtype=torch.int64, pin_memory=True)
    ids_dev = torch.zeros(257, dtype=torch.int64, device=dev)
    src = torch.zeros(2, 4, 64, dtype=torch.int64, device=dev)
    dst = torch.zeros_like(src)
    pair = kv_copy._Pair(src, dst)
    graph = torch.cuda.CUDAGraph()
    ids_dev[0] = 0
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        ids_dev.copy_(ids_host, non_blocking=True)
    cur = torch.cuda.current_stream(dev)

    def in_side_stream():
        with torch.cuda.stream(side):
            pass

    def set_stream_pair():
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(cur)

    def replay():
        with torch.cuda.stream(side):
            graph.replay()

    storage = LAYOUTS["paged_gqa"].groups[0].allocate(300, "cpu")
    ids_list = list(range(0, 256, 2))
    out = {
        "current_stream(device)": _host_us(lambda: torch.cuda.current_stream(dev)),
        "current_stream()": _host_us(torch.cuda.current_stream),
        "event.record(stream)": _host_us(lambda: ev.record(side)),
        "stream.wait_event": _host_us(lambda: side.wait_event(ev)),
        "event.query": _host_us(ev.query),
        "with torch.cuda.stream": _host_us(in_side_stream),
        "set_stream x2": _host_us(set_stream_pair),
        "graph.replay in stream ctx": _host_us(replay),
        "h2d copy_ 2 KB non_blocking": _host_us(lambda: ids_dev.copy_(ids_host, non_blocking=True)),
        "triton launch (8 rows)": _host_us(lambda: pair.launch(ids_dev, 0, 2)),
        "_check_ids 128 ids": _host_us(
            lambda: pack._check_ids(storage, ids_list, "destination", True)
        ),
        "numpy fill 2 x 128": _host_us(lambda: _fill(ids_host.numpy(), ids_list)),
    }
    torch.cuda.synchronize()
    return {k: round(v, 2) for k, v in out.items()}


def _fill(host: np.ndarray, ids: list[int]) -> None:
    host[0] = len(ids)
    host[1 : 1 + len(ids)] = ids
    host[129 : 129 + len(ids)] = ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", action="store_true", help="also time the host calls of a pull")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", default="", help="comma-separated case-name prefixes to run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kv_copy_sweep needs a GPU", file=sys.stderr)
        return 2
    result = {
        "device": torch.cuda.get_device_name(0),
        "commit": git_commit(),
        "command": " ".join(["benchmarks/kv_copy_sweep.py", *sys.argv[1:]]),
    }
    # On a side stream, as a pull's copies run (the copy-engine candidate dropped since
    # also refused the legacy default stream).
    with torch.cuda.stream(torch.cuda.Stream()):
        result["rows"] = sweep("cuda:0", [o for o in args.only.split(",") if o])
    result["replay_e2e"] = replay_e2e("cuda:0")
    if args.host:
        result["host_us"] = host_costs("cuda:0")
        print(json.dumps(result["host_us"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kv_copy_sweep_{device_kind()}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
