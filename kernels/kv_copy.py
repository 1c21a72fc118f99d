"""Copy KV units between two paged storages in one launch: dst[:, d_i] = src[:, s_i].

The direct transfer path (local and cuda_ipc transports) with no staging buffer: a
request's blocks are usually scattered on both sides, so a copy per run of consecutive
blocks costs one launch per run: on the H200 a scattered 2,048-token Qwen3-0.6B-shaped
request took 2.97 ms per cuda_ipc pull that way, 0.41 ms with this kernel, against
0.13 ms for one contiguous copy of the same bytes (benchmarks/transfer.py). One kernel
over (unit, layer, tile) moves them all.
Source and destination may be different allocations on one device (a CUDA IPC mapping of
another process's cache included). Words are copied as integers: bitwise for any dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_pack import TILE_BYTES, bitwise_view

_MAX_GRID_YZ = 65_535


def copy_units_ref(
    src: torch.Tensor,  # [L, NU_src, E]
    src_ids: torch.Tensor,  # [n] int32/int64
    dst: torch.Tensor,  # [L, NU_dst, E], units dst_ids written in place
    dst_ids: torch.Tensor,  # [n] int32/int64, distinct
) -> None:
    rows = bitwise_view(src).index_select(1, src_ids.long())
    bitwise_view(dst).index_copy_(1, dst_ids.long(), rows)


@triton.jit
def _copy_units_kernel(
    src_ptr,
    src_ids_ptr,
    dst_ptr,
    dst_ids_ptr,
    src_layer_stride,
    src_unit_stride,
    dst_layer_stride,
    dst_unit_stride,
    num_elems,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2).to(tl.int64)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elems
    src = src_ptr + layer * src_layer_stride + s * src_unit_stride
    dst = dst_ptr + layer * dst_layer_stride + d * dst_unit_stride
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy_units_triton(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    _check(src, src_ids, dst, dst_ids)
    num_layers, _, num_elems = src.shape
    n = src_ids.numel()
    if n == 0 or num_elems == 0:
        return
    block = min(triton.next_power_of_2(num_elems), TILE_BYTES // src.element_size())
    num_tiles = triton.cdiv(num_elems, block)
    assert num_layers <= _MAX_GRID_YZ and num_tiles <= _MAX_GRID_YZ, "grid y/z over 65,535"
    _copy_units_kernel[(n, num_layers, num_tiles)](
        bitwise_view(src), src_ids, bitwise_view(dst), dst_ids,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), num_elems, BLOCK=block,
    )  # fmt: skip


def copy_units_direct(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """CUDA tensors on one device -> the Triton kernel; otherwise the torch reference."""
    _check(src, src_ids, dst, dst_ids)
    if src.is_cuda and src.device == dst.device:
        copy_units_triton(src, src_ids, dst, dst_ids)
    else:
        copy_units_ref(src, src_ids, dst, dst_ids)


def _check(src, src_ids, dst, dst_ids) -> None:
    assert src.dim() == 3 and dst.dim() == 3, "storages are [L, NU, E]"
    assert src.dtype == dst.dtype, f"dtypes differ: {src.dtype} vs {dst.dtype}"
    assert src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2], (
        f"[L, *, E] differ: {tuple(src.shape)} vs {tuple(dst.shape)}"
    )
    assert src.stride(2) == 1 and dst.stride(2) == 1, "the E axis must be contiguous"
    assert src_ids.shape == dst_ids.shape and src_ids.dim() == 1, "one source id per destination"
    assert src_ids.is_contiguous() and dst_ids.is_contiguous(), "ids must be contiguous"
