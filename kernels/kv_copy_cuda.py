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
import struct
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

_THREADS = 512
_VEC = 16  # bytes a thread moves per load: one uint4
_CHUNK_BYTES = 64 * 1024  # a block's share of a row, at most
_MIN_BLOCKS_PER_SM = 4  # below this, chunks shrink to 16 KB so small pulls fill the GPU
_MAX_GRID_YZ = 65535

# Id pairs the parameter kernel takes in one launch: its parameter block is 2,064 bytes of
# ids, within the 4 KB every CUDA driver accepts. A 2,048-token pull at block size 16 is
# 128 pairs; larger ones take the graph (counted kernel).
PARAM_CAPACITY = 256
_PARAM_HEADER = struct.Struct("4i")  # n, source units, destination units, padding

_SOURCE = r"""
#define THREADS 512
#define UNROLL 4
#define CAP 256

struct Ids { int n; int src_units; int dst_units; int pad; int src[CAP]; int dst[CAP]; };

__device__ __forceinline__ void copy_chunk(
    const uint4* __restrict__ sp, uint4* __restrict__ dp, int start, int end)
{
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
  const int start = blockIdx.x * chunk_vecs;
  copy_chunk(src + layer * src_ls + s * src_us, dst + layer * dst_ls + d * dst_us,
             start, min(start + chunk_vecs, row_vecs));
}

// The ids in the launch's parameters (constant memory, no upload): grid z is the pair
// count itself, so every block copies.
extern "C" __global__ void __launch_bounds__(THREADS) kv_copy_params(
    const uint4* __restrict__ src, uint4* __restrict__ dst,
    long long src_ls, long long src_us, long long dst_ls, long long dst_us,
    int row_vecs, int chunk_vecs, const __grid_constant__ Ids ids)
{
  const int i = blockIdx.z;
  const long long s = ids.src[i], d = ids.dst[i];
  if (i >= ids.n || s < 0 || s >= ids.src_units || d < 0 || d >= ids.dst_units) return;
  const long long layer = blockIdx.y;
  const int start = blockIdx.x * chunk_vecs;
  copy_chunk(src + layer * src_ls + s * src_us, dst + layer * dst_ls + d * dst_us,
             start, min(start + chunk_vecs, row_vecs));
}
"""


def eligible(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether the CUDA kernel can copy between these `[L, NU, E]` tables: both CUDA on
    one device, rows, layer and unit strides and base addresses multiples of 16 bytes."""
    if not (src.is_cuda and dst.is_cuda and src.device == dst.device):
        return False
    elem = src.element_size()
    return all(
        (t.shape[2] * elem) % _VEC == 0
        and (t.stride(0) * elem) % _VEC == 0
        and (t.stride(1) * elem) % _VEC == 0
        and t.data_ptr() % _VEC == 0
        and t.stride(2) == 1
        for t in (src, dst)
    )


@functools.cache
def _kernels(device_index: int) -> dict[str, object] | None:
    """The compiled kernels for one device (torch's NVRTC wrapper), or None where they
    cannot be compiled (no NVRTC in this torch build): callers then use Triton."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None:
        return None
    try:
        with torch.cuda.device(device_index):
            return {
                name: compile_kernel(_SOURCE, name)
                for name in ("kv_copy_counted", "kv_copy_params")
            }
    except Exception as e:  # noqa: BLE001 - any compile failure means: use Triton
        logger.warning("CUDA copy kernels unavailable, the Triton one copies: %s", e)
        return None


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernels(device.index or 0) is not None


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
    kernels = _kernels(src.device.index or 0)
    assert kernels is not None, "launch_counted without available kernels"
    args = [
        ctypes.c_void_p(src.data_ptr()),
        ctypes.c_void_p(dst.data_ptr()),
        ctypes.c_void_p(ids.data_ptr()),
        *(ctypes.c_longlong(v) for v in (count_offset, capacity, src.shape[1], dst.shape[1])),
        *_vec_strides(src, dst),
        ctypes.c_int(row_vecs),
        ctypes.c_int(chunk),
    ]
    grid = (-(-row_vecs // chunk), num_layers, capacity)
    stream = torch.cuda.current_stream(src.device).cuda_stream
    _launch(kernels["kv_copy_counted"].func, grid, _param_array(args), stream)


def _vec_strides(src: torch.Tensor, dst: torch.Tensor) -> list[ctypes.c_longlong]:
    """Layer and unit strides of both tables in 16 B vectors."""
    elem = src.element_size()
    return [ctypes.c_longlong(t.stride(k) * elem // _VEC) for t in (src, dst) for k in (0, 1)]


def _param_array(args: list) -> ctypes.Array:
    """cuLaunchKernel's `kernelParams`: a pointer to each argument's value."""
    return (ctypes.c_void_p * len(args))(
        *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args]
    )


def _launch(func: ctypes.c_void_p, grid: tuple[int, int, int], params, stream: int) -> None:
    lib = torch.cuda._utils._get_gpu_runtime_library()
    err = lib.cuLaunchKernel(func, *grid, _THREADS, 1, 1, 0, ctypes.c_void_p(stream), params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernel of a CUDA copy kernel failed with CUresult {err}")


@functools.cache
def _int32s(n: int) -> struct.Struct:
    return struct.Struct(f"{n}i")


class ParamCopy:
    """One (source, destination) table pair's launches of the parameter-id kernel: the
    arguments are built once; `fill` writes a pull's ids into the parameter block and
    `launch` queues the kernel (the driver copies the block at the launch, so the next
    fill may rewrite it at once). The caller checks `eligible` and `available`; ids are
    not checked here (out-of-range pairs are skipped on the device, the caller checks them
    on the host while the copy runs)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, num_sms: int) -> None:
        kernels = _kernels(src.device.index or 0)
        assert kernels is not None, "ParamCopy without available kernels"
        self._func = kernels["kv_copy_params"].func
        self.tables = (src, dst)  # held: the pointers below are theirs
        self.num_layers = src.shape[0]
        self.row_vecs = src.shape[2] * src.element_size() // _VEC
        self._units = (src.shape[1], dst.shape[1])
        self._num_sms = num_sms
        self._chunk = ctypes.c_int(0)
        self._ids = ctypes.create_string_buffer(_PARAM_HEADER.size + 8 * PARAM_CAPACITY)
        self._args = [
            ctypes.c_void_p(src.data_ptr()),
            ctypes.c_void_p(dst.data_ptr()),
            *_vec_strides(src, dst),
            ctypes.c_int(self.row_vecs),
            self._chunk,
            self._ids,
        ]
        self._params = _param_array(self._args)
        self._lib = torch.cuda._utils._get_gpu_runtime_library()
        self._n = 0  # pairs in the parameter block

    def fill(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Write the pairs (src_ids[i], dst_ids[i]) into the parameter block for the next
        `launch`. Raises struct.error for an id that is not an int32 (the caller's other
        paths name it); at most PARAM_CAPACITY pairs."""
        n = len(src_ids)
        assert n == len(dst_ids) and n <= PARAM_CAPACITY, f"{n} pairs"
        pack = _int32s(n).pack_into
        pack(self._ids, _PARAM_HEADER.size, *src_ids)
        pack(self._ids, _PARAM_HEADER.size + 4 * PARAM_CAPACITY, *dst_ids)
        _PARAM_HEADER.pack_into(self._ids, 0, n, *self._units, 0)
        self._n = n

    def launch(self, stream: int) -> None:
        """Queue the copy of the pairs last filled on the raw `stream`."""
        n = self._n
        if n == 0 or self.row_vecs == 0 or self.num_layers == 0:
            return
        chunk = chunk_vecs(n * self.num_layers, self.row_vecs, self._num_sms)
        self._chunk.value = chunk
        err = self._lib.cuLaunchKernel(
            self._func, -(-self.row_vecs // chunk), self.num_layers, n, _THREADS, 1, 1, 0,
            ctypes.c_void_p(stream), self._params, None,
        )  # fmt: skip
        if err != 0:
            raise RuntimeError(f"cuLaunchKernel of the CUDA copy kernel failed with CUresult {err}")
