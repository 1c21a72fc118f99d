"""Gather KV units into a contiguous buffer and scatter them back, bit for bit.

A table is `[L, NU, E]`: L layers, NU units (paged blocks or Mamba request slots), E
elements of one unit in one layer (a paged_gqa block of 2 x 16 x 8 heads x 128 is 32,768
elements, 64 KB in bf16). A buffer is `[L, n, E]`, layer-major, so a layer-wise sender
can ship `buf[l]` as soon as layer l is written. `pack_units` does
`out[l, i] = src[l, unit_ids[i]]`; `unpack_units` does `dst[l, unit_ids[i]] = buf[l, i]`.

Data moves as same-width integers (`bitwise_view`): a float load/store path may
canonicalise NaN payloads, and float8 has no arithmetic to trust, so both the reference
and the kernel copy int8/16/32/64 words.

Device path: one program per (unit, layer, tile of TILE_BYTES). Layer and unit strides
are runtime arguments, so a table may be a strided view (a range of the units of a larger
cache, whose layer stride is the parent's). Offsets are int64: a real cache passes 2^31
elements (28 layers x 4096 blocks x 32,768 = 3.8e9).

What this module does not know: layouts, requests, transports. Unit ids are trusted to be
in range and, for unpack, distinct (with duplicates the surviving write is unspecified);
`kvtransfer.pack` checks both on the host. The kernels drop an out-of-range id rather
than touch memory outside the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Bytes one program moves: 8 KB with 4 warps is 64 B (four 16 B vectors) per thread. A
# bf16 GQA block layer (64 KB) takes 8 programs, a small Mamba conv state one.
TILE_BYTES = 8192
# CUDA caps grid dims y and z at 65,535 (layers and tiles; units ride on x).
_MAX_GRID_YZ = 65_535


def bitwise_view(t: torch.Tensor, word_bytes: int | None = None) -> torch.Tensor:
    """`t` reinterpreted as integers of `word_bytes` (default: its element size), same
    memory. A wider word needs the last dim's bytes, the other strides' bytes and the
    offset to be multiples of it (torch's `view(dtype)` checks)."""
    word_bytes = t.element_size() if word_bytes is None else word_bytes
    int_dtype = _INT_OF_SIZE.get(word_bytes)
    assert int_dtype is not None, f"no integer dtype of {word_bytes} bytes for {t.dtype}"
    return t if t.dtype == int_dtype else t.view(int_dtype)


def rows_tile_by(t: torch.Tensor, word_bytes: int) -> bool:
    """Whether words of `word_bytes` tile every row of the `[L, NU, E]` table `t`: its row
    bytes, layer and unit strides in bytes, and its base address are multiples of it."""
    elem = t.element_size()
    return (
        (t.shape[2] * elem) % word_bytes == 0
        and (t.stride(0) * elem) % word_bytes == 0
        and (t.stride(1) * elem) % word_bytes == 0
        and t.data_ptr() % word_bytes == 0
    )


def pack_units_ref(
    src: torch.Tensor,  # [L, NU, E]
    unit_ids: torch.Tensor,  # [n] int32/int64
    out: torch.Tensor,  # [L, n, E] same dtype as src, written
) -> None:
    dst = bitwise_view(out)
    if out.is_contiguous():  # gather straight into `out`: no 235 MB temporary per pull
        torch.index_select(bitwise_view(src), 1, unit_ids.long(), out=dst)
    else:
        dst.copy_(bitwise_view(src).index_select(1, unit_ids.long()))


def unpack_units_ref(
    dst: torch.Tensor,  # [L, NU, E], units unit_ids written in place
    unit_ids: torch.Tensor,  # [n] int32/int64, distinct
    buf: torch.Tensor,  # [L, n, E] same dtype as dst
) -> None:
    bitwise_view(dst).index_copy_(1, unit_ids.long(), bitwise_view(buf))


@triton.jit
def _units_copy_kernel(
    table_ptr,
    unit_ids_ptr,
    buf_ptr,
    table_layer_stride,
    table_unit_stride,
    buf_layer_stride,
    buf_unit_stride,
    num_units,
    num_elems,
    TO_BUF: tl.constexpr,  # pack (table -> buffer), else unpack (buffer -> table)
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2).to(tl.int64)
    unit = tl.load(unit_ids_ptr + i).to(tl.int64)
    # An out-of-range id sees zero elements (a scalar bool & a tensor mask would do the
    # same, but Triton's interpreter turns that mask into int64).
    limit = tl.where((unit >= 0) & (unit < num_units), num_elems, 0)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < limit
    in_table = table_ptr + layer * table_layer_stride + unit * table_unit_stride
    in_buf = buf_ptr + layer * buf_layer_stride + i * buf_unit_stride
    if TO_BUF:
        tl.store(in_buf + offs, tl.load(in_table + offs, mask=mask), mask=mask)
    else:
        tl.store(in_table + offs, tl.load(in_buf + offs, mask=mask), mask=mask)


def _check_args(table: torch.Tensor, unit_ids: torch.Tensor, buf: torch.Tensor) -> None:
    assert table.dim() == 3 and buf.dim() == 3, (
        f"table is [L, NU, E] and buffer [L, n, E], got {tuple(table.shape)} and {tuple(buf.shape)}"
    )
    assert table.dtype == buf.dtype, f"buffer {buf.dtype} must match table {table.dtype}"
    assert unit_ids.dim() == 1 and unit_ids.dtype in (torch.int32, torch.int64), (
        f"unit_ids must be 1-D int32/int64, got {unit_ids.dtype} {tuple(unit_ids.shape)}"
    )
    want = (table.shape[0], unit_ids.numel(), table.shape[2])
    assert tuple(buf.shape) == want, f"buffer must be [L, n, E] = {want}, got {tuple(buf.shape)}"
    # Units are copied as runs of E words: only the last dim must be dense.
    assert table.stride(2) == 1 and buf.stride(2) == 1, "the E axis must be contiguous"
    assert table.device == buf.device == unit_ids.device, (
        f"table {table.device}, buffer {buf.device} and unit_ids {unit_ids.device} differ"
    )


def _launch(to_buf: bool, table: torch.Tensor, unit_ids: torch.Tensor, buf: torch.Tensor) -> None:
    _check_args(table, unit_ids, buf)
    assert unit_ids.is_contiguous(), "unit_ids must be contiguous"
    num_layers, num_units, num_elems = table.shape
    num_ids = unit_ids.numel()
    if num_ids == 0 or num_elems == 0:
        return
    table_bits, buf_bits = bitwise_view(table), bitwise_view(buf)
    block = min(triton.next_power_of_2(num_elems), TILE_BYTES // table.element_size())
    num_tiles = triton.cdiv(num_elems, block)
    assert num_layers <= _MAX_GRID_YZ and num_tiles <= _MAX_GRID_YZ, (
        f"grid ({num_ids}, {num_layers}, {num_tiles}) passes CUDA's 65,535 on y/z"
    )
    _units_copy_kernel[(num_ids, num_layers, num_tiles)](
        table_bits,
        unit_ids,
        buf_bits,
        table.stride(0),
        table.stride(1),
        buf.stride(0),
        buf.stride(1),
        num_units,
        num_elems,
        TO_BUF=to_buf,
        BLOCK=block,
    )


def pack_units_triton(
    src: torch.Tensor,  # [L, NU, E]
    unit_ids: torch.Tensor,  # [n] int32/int64
    out: torch.Tensor,  # [L, n, E] same dtype as src, written
) -> None:
    _launch(True, src, unit_ids, out)


def unpack_units_triton(
    dst: torch.Tensor,  # [L, NU, E], units unit_ids written in place
    unit_ids: torch.Tensor,  # [n] int32/int64, distinct
    buf: torch.Tensor,  # [L, n, E] same dtype as dst
) -> None:
    _launch(False, dst, unit_ids, buf)


def pack_units(src: torch.Tensor, unit_ids: torch.Tensor, out: torch.Tensor) -> None:
    _check_args(src, unit_ids, out)
    if src.is_cuda:
        pack_units_triton(src, unit_ids, out)
    else:
        pack_units_ref(src, unit_ids, out)


def unpack_units(dst: torch.Tensor, unit_ids: torch.Tensor, buf: torch.Tensor) -> None:
    _check_args(dst, unit_ids, buf)
    if dst.is_cuda:
        unpack_units_triton(dst, unit_ids, buf)
    else:
        unpack_units_ref(dst, unit_ids, buf)
