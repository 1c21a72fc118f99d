"""Does a CUDA C copy kernel (NVRTC) get closer to the plain copy than the Triton one?

Not a test. The cuda_ipc pull's copy (kernels/kv_copy.py) runs at ~87-89% of a plain
device-to-device copy of the same bytes on the H200 (0.125 vs 0.113 ms for the scattered
2,048-token Qwen3-0.6B-shaped request), whatever its Triton tile, warp or hint settings
(benchmarks/kv_copy_sweep.py). This probe compiles the same gather/scatter in CUDA C with
`torch.cuda._compile_kernel` (NVRTC) at several block sizes, chunk sizes and unroll depths,
with 16 B vector loads through the read-only path, the ids either from a device buffer
(as the Triton kernel) or in the kernel's parameters (`__grid_constant__`, no id upload),
and times each next to the plain copy and the shipped Triton launch: mean of 50 back-to-back
launches between CUDA events, every case checked bitwise against the torch reference.

    python benchmarks/copy_kernel_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import json
import sys

import torch
from kv_copy_sweep import events_ms
from run_meta import write_result
from transfer_setup import LAYOUTS, plan

from pdserve.kernels import kv_copy
from pdserve.kernels.kv_pack import bitwise_view

_CAP = 256  # id pairs the parameter variant holds

_SOURCE = r"""
struct Ids { int n; int src[CAP]; int dst[CAP]; };

__device__ __forceinline__ void copy_span(
    const uint4* __restrict__ sp, uint4* __restrict__ dp, int start, int end)
{
  for (int base = start + threadIdx.x; base < end; base += THREADS * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      int k = base + u * THREADS;
      if (k < end) v[u] = LOAD(sp + k);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      int k = base + u * THREADS;
      if (k < end) STORE(dp + k, v[u]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) copy_dev(
    const uint4* __restrict__ src, uint4* __restrict__ dst, const long long* __restrict__ ids,
    int n, long long src_ls, long long src_us, long long dst_ls, long long dst_us,
    int row_vecs, int chunk_vecs)
{
  const int chunk = blockIdx.x, layer = blockIdx.y, i = blockIdx.z;
  const long long s = ids[i], d = ids[n + i];
  const int start = chunk * chunk_vecs;
  const int end = min(start + chunk_vecs, row_vecs);
  copy_span(src + layer * src_ls + s * src_us, dst + layer * dst_ls + d * dst_us, start, end);
}

extern "C" __global__ void __launch_bounds__(THREADS) copy_param(
    const uint4* __restrict__ src, uint4* __restrict__ dst,
    long long src_ls, long long src_us, long long dst_ls, long long dst_us,
    int row_vecs, int chunk_vecs, const __grid_constant__ Ids ids)
{
  const int chunk = blockIdx.x, layer = blockIdx.y, i = blockIdx.z;
  if (i >= ids.n) return;
  const long long s = ids.src[i], d = ids.dst[i];
  const int start = chunk * chunk_vecs;
  const int end = min(start + chunk_vecs, row_vecs);
  copy_span(src + layer * src_ls + s * src_us, dst + layer * dst_ls + d * dst_us, start, end);
}
"""

_LOADS = {"ldg": "__ldg", "plain": "*", "ldcs": "__ldcs"}
_STORES = {"plain": "(*(p) = (v))", "stcs": "__stcs(p, v)"}


def compile_variant(threads: int, unroll: int, load: str, store: str) -> dict:
    load_expr = "(*(p))" if load == "plain" else f"{_LOADS[load]}(p)"
    store_expr = _STORES[store]
    src = (
        f"#define THREADS {threads}\n#define UNROLL {unroll}\n#define CAP {_CAP}\n"
        f"#define LOAD(p) {load_expr}\n#define STORE(p, v) {store_expr}\n" + _SOURCE
    )
    return {name: torch.cuda._compile_kernel(src, name) for name in ("copy_dev", "copy_param")}


_VOIDP = ctypes.c_void_p


def _launch(func, grid, *, threads: int, params: list, stream) -> None:
    lib = torch.cuda._utils._get_gpu_runtime_library()
    arr = (_VOIDP * len(params))(*[ctypes.cast(ctypes.byref(p), _VOIDP) for p in params])
    err = lib.cuLaunchKernel(
        func, grid[0], grid[1], grid[2], threads, 1, 1, 0, stream._as_parameter_, arr, None
    )
    assert err == 0, f"cuLaunchKernel: {err}"


class IdsParam(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("src", ctypes.c_int * _CAP), ("dst", ctypes.c_int * _CAP)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dev = "cuda:0"
    layout = LAYOUTS["paged_gqa"]
    requests, sizes = plan(layout)
    req = requests[0]
    g = layout.groups[0]
    src_st, dst_st = g.allocate(sizes[0], dev), g.allocate(sizes[0], dev)
    src_t, dst_t = src_st.flat()[0], dst_st.flat()[0]
    src_b, dst_b = bitwise_view(src_t, 1), bitwise_view(dst_t, 1)  # [L, NU, row bytes]
    torch.manual_seed(0)
    src_b.copy_(torch.randint(-128, 128, src_b.shape, dtype=src_b.dtype, device=dev))
    s_ids, d_ids = req.src_ids[0], req.dst_ids[0]
    n = len(s_ids)
    L, _, row_bytes = src_b.shape
    assert row_bytes % 16 == 0 and n <= _CAP
    nbytes = n * L * row_bytes
    ids_dev = torch.tensor(list(s_ids) + list(d_ids), dtype=torch.int64, device=dev)
    # What every case must leave in dst, zeroed before it: the source rows at the
    # destination ids, zeros elsewhere.
    expect = torch.zeros_like(dst_b)
    expect[:, torch.tensor(d_ids, device=dev)] = src_b[:, torch.tensor(s_ids, device=dev)]
    flat_src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    stream = torch.cuda.current_stream()
    rows = []

    def record(case: str, fn, check: bool = True) -> None:
        dst_b.zero_()
        ms = events_ms(fn)
        row = {"case": case, "ms": round(ms, 5), "GBps": round(nbytes / ms / 1e6, 1),
               "correct": bool(torch.equal(dst_b, expect)) if check else None}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)

    record("plain copy (same bytes, contiguous)", lambda: flat_dst.copy_(flat_src), check=False)
    pair = kv_copy.PairCache().get(src_t, dst_t)
    record("triton grid (shipped)", lambda: pair.launch(ids_dev, 0, n))

    vec = 16
    su, sl = src_b.stride(1) // vec, src_b.stride(0) // vec
    du, dl = dst_b.stride(1) // vec, dst_b.stride(0) // vec
    row_vecs = row_bytes // vec
    ids_param = IdsParam()
    ids_param.n = n
    for k, (s, d) in enumerate(zip(s_ids, d_ids)):
        ids_param.src[k], ids_param.dst[k] = s, d
    for threads, unroll, load, store in itertools.chain(
        itertools.product((128, 256, 512), (4, 8), ("ldg",), ("plain",)),
        itertools.product((256,), (4,), ("plain", "ldcs"), ("plain", "stcs")),
    ):
        try:
            kernels = compile_variant(threads, unroll, load, store)
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            print(json.dumps({"case": f"t{threads} u{unroll} {load}/{store}", "error": str(e)}))
            continue
        for chunk_kb in (16, 32, 64):
            chunk_vecs = chunk_kb * 1024 // vec
            chunks = -(-row_vecs // chunk_vecs)
            name = f"t{threads} u{unroll} {load}/{store} chunk{chunk_kb}K"
            p_src, p_dst = _VOIDP(src_b.data_ptr()), _VOIDP(dst_b.data_ptr())
            common = [ctypes.c_longlong(x) for x in (sl, su, dl, du)]
            shape = [ctypes.c_int(row_vecs), ctypes.c_int(chunk_vecs)]
            dev_params = [p_src, p_dst, _VOIDP(ids_dev.data_ptr()), ctypes.c_int(n),
                          *common, *shape]  # fmt: skip
            par_params = [p_src, p_dst, *common, *shape, ids_param]
            f_dev, f_par = kernels["copy_dev"].func, kernels["copy_param"].func
            launch = functools.partial(_launch, threads=threads, stream=stream)
            record(
                f"cuda ids-in-memory {name}",
                functools.partial(launch, f_dev, (chunks, L, n), params=dev_params),
            )
            record(
                f"cuda ids-in-params {name}",
                functools.partial(launch, f_par, (chunks, L, n), params=par_params),
            )
    write_result(
        args.out, "copy_kernel_probe", "benchmarks/copy_kernel_probe.py", sys.argv[1:],
        {
            "what": "device time of the 2,048-token scattered cuda_ipc copy: CUDA C (NVRTC) "
            "variants vs the shipped Triton kernel vs a plain copy of the same bytes",
            "bytes": nbytes,
            "rows": rows,
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
