"""The counted unit copy in CUDA C, compiled at first use by NVRTC: the copy graph's kernel.

Same contract as kernels/kv_copy.py `_copy_units_counted_kernel` (spec:
`copy_units_counted_ref`): `ids[count_offset]` holds n, then `capacity` source slots and
`capacity` destination slots; slots past n and out-of-range ids copy nothing. Why a
second implementation of one kernel: on the H200, for the scattered 2,048-token
Qwen3-0.6B-shaped pull, it takes 0.1244 ms where the Triton kernel takes 0.1275 and a
plain copy of the same bytes 0.1133 (benchmarks/copy_kernel_probe.py,
results/copy_kernel_probe_ed5a20f.json: 512 threads, four 16 B vectors a thread in flight
through the read-only path, 64 KB a block). The cuda_ipc pull is judged against that plain
copy end to end, and 3 us is a tenth of what separates them.

It applies to tables whose rows, unit and layer strides and base addresses are multiples
of 16 bytes (every bf16/fp16/fp32 KV layout of a head_dim that is a multiple of 8); other
tables, machines without NVRTC and CPU tensors use the Triton kernel. The grid is
(chunks of a row, layers, capacity): a block copies one chunk of one (unit, layer) row, so
a launch shape depends on the capacity, never on n, and can be graph-captured.

What this module does not know: which ids are valid for a request (the caller checks
them on the host while the copy runs), or streams beyond the current one.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pdserve.kernels.kv_pack import rows_tile_by

logger = logging.getLogger(__name__)

_THREADS = 512
_VEC = 16  # bytes a thread moves per load: one uint4
_CHUNK_BYTES = 64 * 1024  # a block's share of a row, at most
_MIN_BLOCKS_PER_SM = 4  # below this, chunks shrink to 16 KB so small pulls fill the GPU
_MAX_GRID_YZ = 65535

_SOURCE = r"""
#define THREADS 512
#define UNROLL 4

extern "C" __global__ void __launch_bounds__(THREADS) kv_copy_counted(
    const uint4* __restrict__ src, uint4* __restrict__ dst, const long long* __restrict__ ids,
    long long count_offset, long long capacity, long long src_units, long long dst_units,
    long long src_ls, long long src_us, long long dst_ls, long long dst_us,
    int row_vecs, int chunk_vecs)
{
  const long long* slots = ids + count_offset;
  const long long i = blockIdx.z;
  // The count and this slot's ids in one round trip; a slot past the count holds a stale
  // (or zero) pair, loaded in bounds and then not used.
  const long long n = slots[0];
  const long long s = slots[1 + i];
  const long long d = slots[1 + capacity + i];
  if (i >= n || s < 0 || s >= src_units || d < 0 || d >= dst_units) return;
  const long long layer = blockIdx.y;
  const uint4* sp = src + layer * src_ls + s * src_us;
  uint4* dp = dst + layer * dst_ls + d * dst_us;
  const int start = blockIdx.x * chunk_vecs;
  const int end = min(start + chunk_vecs, row_vecs);
  for (int base = start + threadIdx.x; base < end; base += THREADS * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k = base + u * THREADS;
      if (k < end) v[u] = __ldg(sp + k);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k = base + u * THREADS;
      if (k < end) dp[k] = v[u];
    }
  }
}
"""


def eligible(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether the CUDA kernel can copy between these `[L, NU, E]` tables: both CUDA on
    one device, rows, layer and unit strides and base addresses multiples of 16 bytes."""
    if not (src.is_cuda and dst.is_cuda and src.device == dst.device):
        return False
    return all(t.stride(2) == 1 and rows_tile_by(t, _VEC) for t in (src, dst))


@functools.cache
def _kernel(device_index: int) -> object | None:
    """The compiled kernel for one device (torch's NVRTC wrapper), or None where it cannot
    be compiled (no NVRTC in this torch build): callers then use the Triton kernel."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None:
        return None
    try:
        with torch.cuda.device(device_index):
            return compile_kernel(_SOURCE, "kv_copy_counted")
    except Exception as e:  # noqa: BLE001 - any compile failure means: use Triton
        logger.warning("CUDA copy kernel unavailable, the Triton one copies: %s", e)
        return None


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernel(device.index or 0) is not None


def chunk_vecs(rows: int, row_vecs: int, num_sms: int) -> int:
    """16 B vectors a block copies: 64 KB, or 16 KB when 64 KB chunks would give fewer
    than 4 blocks an SM (a 128-token pull is 224 rows)."""
    chunk = min(row_vecs, _CHUNK_BYTES // _VEC)
    if rows * -(-row_vecs // chunk) < _MIN_BLOCKS_PER_SM * num_sms:
        chunk = min(chunk, 16 * 1024 // _VEC)
    return max(chunk, 1)


def launch_counted(
    src: torch.Tensor,  # [L, NU_src, E] on a CUDA device, `eligible` with dst
    dst: torch.Tensor,  # [L, NU_dst, E]
    ids: torch.Tensor,  # int64 on the same device: count, capacity src slots, capacity dst
    count_offset: int,
    capacity: int,
    num_sms: int,
) -> None:
    """Queue the counted copy on the current stream (graph-capturable). The caller has
    checked `eligible` and `available`."""
    num_layers, _, num_elems = src.shape
    row_vecs = num_elems * src.element_size() // _VEC
    if capacity == 0 or row_vecs == 0 or num_layers == 0:
        return
    assert capacity <= _MAX_GRID_YZ and num_layers <= _MAX_GRID_YZ, "grid y/z limit"
    assert ids.dtype == torch.int64 and ids.device == src.device
    chunk = chunk_vecs(capacity * num_layers, row_vecs, num_sms)
    elem = src.element_size()
    kernel = _kernel(src.device.index or 0)
    assert kernel is not None, "launch_counted without an available kernel"
    args = [
        ctypes.c_void_p(src.data_ptr()),
        ctypes.c_void_p(dst.data_ptr()),
        ctypes.c_void_p(ids.data_ptr()),
        *(
            ctypes.c_longlong(v)
            for v in (
                count_offset, capacity, src.shape[1], dst.shape[1],
                src.stride(0) * elem // _VEC, src.stride(1) * elem // _VEC,
                dst.stride(0) * elem // _VEC, dst.stride(1) * elem // _VEC,
            )
        ),
        ctypes.c_int(row_vecs),
        ctypes.c_int(chunk),
    ]  # fmt: skip
    params = (ctypes.c_void_p * len(args))(
        *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args]
    )
    grid = (-(-row_vecs // chunk), num_layers, capacity)
    stream = torch.cuda.current_stream(src.device)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    err = lib.cuLaunchKernel(
        kernel.func, *grid, _THREADS, 1, 1, 0, ctypes.c_void_p(stream.cuda_stream), params, None
    )
    if err != 0:
        raise RuntimeError(f"cuLaunchKernel of the CUDA copy kernel failed with CUresult {err}")
