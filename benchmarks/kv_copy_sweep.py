"""Device time of unit-copy kernel shapes, and the host cost of the calls a pull makes.

Not a test. The copy is the cuda_ipc pull's: a scattered Qwen3-0.6B-shaped request (28
layers, 64 KB block-layers of int64 words) at the ids benchmarks/transfer_setup.py uses,
2,048 tokens (128 blocks, 235 MB) and 128 tokens (8 blocks, 14.7 MB), next to one
contiguous device-to-device copy of the same bytes. Candidates:

- `grid`: kernels/kv_copy.py's kernel (one program per chunk of a row) at several tile,
  chunk and warp counts;
- `persistent`: kernels/kv_copy.py's persistent kernel (a fixed grid of programs per SM
  looping over the chunks, the id count read on the device) at several shapes.

Each is timed as the mean of 50 back-to-back launches between two CUDA events (the host
queues a launch in far less than the 0.1 ms a launch runs, so the GPU never waits), then
checked against the torch reference. `--host` adds the host time of each call a pull
makes (streams, events, a graph replay, a Triton launch, the id checks), mean of 2,000.

    python benchmarks/kv_copy_sweep.py [--host] [--out DIR]
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
from run_meta import device_kind, git_commit
from transfer_setup import LAYOUTS, plan

from pdserve.kernels import kv_copy
from pdserve.kernels.kv_pack import bitwise_view

_REPS = 50


def _events_ms(fn, reps: int = _REPS) -> float:
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


def _persistent_case(pair, ids, n, block, chunk, warps, per_sm):
    programs = pair.num_sms * per_sm
    chunks_per_row = -(-pair.num_words // chunk)

    def launch():
        kv_copy._copy_units_loop_kernel[(programs,)](
            pair.src_words, pair.dst_words, ids, 0, 1, 1 + n, pair.src_words.shape[1],
            pair.dst_words.shape[1], *pair.strides,
            pair.num_layers, pair.num_words, chunks_per_row,
            CHUNK=chunk, BLOCK=block, EVEN=pair.num_words % chunk == 0, num_warps=warps,
        )  # fmt: skip

    return launch


class _CopyEngineBatch:
    """cuMemcpyBatchAsync (CUDA >= 12.8) through ctypes: one call queues every row copy
    on the copy engines; the candidate with no kernel at all."""

    def __init__(self, device: int) -> None:
        import ctypes

        class Loc(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        class Attrs(ctypes.Structure):
            _fields_ = [
                ("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc),
                ("flags", ctypes.c_uint),
            ]  # fmt: skip

        lib = ctypes.CDLL("libcuda.so.1")
        self.v2 = hasattr(lib, "cuMemcpyBatchAsync_v2")
        self.fn = lib.cuMemcpyBatchAsync_v2 if self.v2 else lib.cuMemcpyBatchAsync
        self.fn.restype = ctypes.c_int
        self.attrs = Attrs(1, Loc(1, device), Loc(1, device), 0)  # order STREAM, on device
        self.idx = (ctypes.c_size_t * 1)(0)
        self.fail = ctypes.c_size_t(0)
        self.ctypes = ctypes

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> None:
        c = self.ctypes
        args = [
            c.c_void_p(dsts.ctypes.data), c.c_void_p(srcs.ctypes.data),
            c.c_void_p(sizes.ctypes.data), c.c_size_t(dsts.size), c.byref(self.attrs),
            self.idx, c.c_size_t(1),
        ]  # fmt: skip
        if not self.v2:
            args.append(c.byref(self.fail))
        err = self.fn(*args, c.c_void_p(stream.cuda_stream))
        if err != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {err}")


def _ce_case(ce, pair, s_ids, d_ids):
    src, dst = pair.src_words, pair.dst_words
    row = pair.num_words * 8
    layers = np.arange(pair.num_layers, dtype=np.uint64)

    def launch():
        s = np.asarray(s_ids, dtype=np.uint64)
        d = np.asarray(d_ids, dtype=np.uint64)
        srcs = (src.data_ptr() + layers[None, :] * (src.stride(0) * 8)) + s[:, None] * (
            src.stride(1) * 8
        )
        dsts = (dst.data_ptr() + layers[None, :] * (dst.stride(0) * 8)) + d[:, None] * (
            dst.stride(1) * 8
        )
        sizes = np.full(srcs.size, row, dtype=np.uint64)
        ce(dsts.reshape(-1), srcs.reshape(-1), sizes, torch.cuda.current_stream())

    return launch


def _held_ms(fn, reps: int = 20) -> float:
    """GPU time of the work `fn` queues, a GPU sleep holding it back until it is queued."""
    fn()
    times = []
    while len(times) < reps:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000)
        start.record()
        fn()
        end.record()
        held = not start.query()
        end.synchronize()
        if held:
            times.append(start.elapsed_time(end))
    return float(np.median(times))


def _call_us(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return float(np.median(times)) * 1e6


def sweep(device: str) -> list[dict]:
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
        base = _events_ms(functools.partial(flat_dst.copy_, flat_src))
        base_held = _held_ms(functools.partial(flat_dst.copy_, flat_src))
        dst.zero_()
        want = dst.clone()
        kv_copy.copy_units_ref(
            src, torch.tensor(s_ids, device=device), want, torch.tensor(d_ids, device=device)
        )
        cases = []
        for warps in (4, 8):
            for block in (1024, 2048, 4096):
                for tiles in (1, 2, 4, 8):
                    chunk = block * tiles
                    if chunk > 4 * pair.num_words:
                        continue
                    cases.append(
                        (f"grid b{block} t{tiles} w{warps}",
                         _grid_case(pair, joined, n, block, chunk, warps))
                    )  # fmt: skip
                    for per_sm in (2, 4, 8, 16):
                        cases.append(
                            (f"persistent b{block} t{tiles} w{warps} p{per_sm}",
                             _persistent_case(pair, counted, n, block, chunk, warps, per_sm))
                        )  # fmt: skip
        try:
            ce = _CopyEngineBatch(torch.device(device).index or 0)
            cases.append(("copy engines (cuMemcpyBatchAsync)", _ce_case(ce, pair, s_ids, d_ids)))
        except (OSError, AttributeError, RuntimeError) as e:
            rows.append({"tokens": req.tokens, "case": "copy engines", "error": repr(e)[:200]})
        for name, launch in cases:
            dst.zero_()
            try:
                ms = _events_ms(launch)
            except Exception as e:  # a shape Triton cannot compile is reported, not fatal
                rows.append({"tokens": req.tokens, "case": name, "error": repr(e)[:200]})
                continue
            ok = bool(torch.equal(bitwise_view(dst), bitwise_view(want)))
            held = _held_ms(launch) if name.startswith(("copy", "grid b2048 t4 w4")) else None
            rows.append(
                {
                    "tokens": req.tokens, "case": name, "ms": round(ms, 5), "held_ms": held,
                    "call_us": _call_us(launch),
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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kv_copy_sweep needs a GPU", file=sys.stderr)
        return 2
    result = {
        "device": torch.cuda.get_device_name(0),
        "commit": git_commit(),
        "command": " ".join(["benchmarks/kv_copy_sweep.py", *sys.argv[1:]]),
    }
    # Not the legacy default stream: cuMemcpyBatchAsync refuses it (CUDA_ERROR_INVALID_VALUE),
    # and a pull's copies run on a side stream anyway.
    with torch.cuda.stream(torch.cuda.Stream()):
        result["rows"] = sweep("cuda:0")
    if args.host:
        result["host_us"] = host_costs("cuda:0")
        print(json.dumps(result["host_us"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kv_copy_sweep_{device_kind()}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
