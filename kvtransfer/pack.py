"""Request-level pack/unpack and direct unit copies over a `GroupStorage`.

`pack` gathers a request's units (its blocks, or its Mamba slot) into one contiguous
`[L, n, E]` buffer per tensor of the group, layer-major so a layer-wise sender can ship
`buf[l]` as soon as layer l is done; `unpack` scatters such buffers into another
storage at that side's own unit ids. `copy_units` skips the buffers when one `copy_`
reaches both storages (same process, or two devices of one process): each run of ids
consecutive on both sides is one strided copy covering every layer, so a transfer costs
runs x tensors descriptors, not units x layers (descriptor count, not bandwidth, is what
makes small blocks slow). `as_byte_view` / `from_bytes` turn CPU buffers into socket
frames and back without copying.

What this module does not know: which units belong to a request, how bytes travel, or
whether the peer's layout matches (`KVLayout.check_compatible` settles that at handshake).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from pdserve.kernels.kv_copy import copy_units_direct
from pdserve.kernels.kv_pack import bitwise_view, pack_units, unpack_units
from pdserve.kvtransfer.layout import GroupStorage


def _check_ids(storage: GroupStorage, unit_ids: Sequence[int], side: str, distinct: bool) -> None:
    num_units = storage.num_units
    for uid in unit_ids:
        if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < num_units:
            raise ValueError(f"{side} unit id {uid!r} is not an int in [0, {num_units})")
    # Written ids must be distinct: with a duplicate, which write survives is unspecified.
    if distinct and len(set(unit_ids)) != len(unit_ids):
        raise ValueError(f"{side} unit ids must be distinct, got {list(unit_ids)}")


def _ids_tensor(storage: GroupStorage, unit_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(unit_ids), dtype=torch.int64, device=storage.device)


def pack(storage: GroupStorage, unit_ids: Sequence[int]) -> list[torch.Tensor]:
    """One new `[L, n, E]` buffer per tensor of the group: `buf[l, i]` is unit `unit_ids[i]`."""
    _check_ids(storage, unit_ids, "source", distinct=False)
    ids = _ids_tensor(storage, unit_ids)
    buffers = []
    for table in storage.flat():
        num_layers, _, num_elems = table.shape
        buf = torch.empty(
            (num_layers, len(unit_ids), num_elems), dtype=table.dtype, device=table.device
        )
        pack_units(table, ids, buf)
        buffers.append(buf)
    return buffers


def unpack(storage: GroupStorage, unit_ids: Sequence[int], buffers: Sequence[torch.Tensor]) -> None:
    """Write `buffers` (as `pack` made them) into units `unit_ids` of `storage`."""
    tables = storage.flat()
    if len(buffers) != len(tables):
        raise ValueError(
            f"{storage.group.kind} group {storage.group.name!r} has {len(tables)} tensor(s), "
            f"got {len(buffers)} buffer(s)"
        )
    _check_ids(storage, unit_ids, "destination", distinct=True)
    for i, (table, buf) in enumerate(zip(tables, buffers, strict=True)):
        want = (table.shape[0], len(unit_ids), table.shape[2])
        if tuple(buf.shape) != want:
            raise ValueError(f"buffer {i}: shape {tuple(buf.shape)}, expected [L, n, E] = {want}")
        if buf.dtype != table.dtype:
            raise ValueError(f"buffer {i}: dtype {buf.dtype}, expected {table.dtype}")
        if buf.device != table.device:
            raise ValueError(f"buffer {i} is on {buf.device}, the storage on {table.device}")
        if buf.numel() and buf.stride(2) != 1:
            raise ValueError(f"buffer {i}: the E axis must be contiguous, strides {buf.stride()}")
    ids = _ids_tensor(storage, unit_ids)
    for table, buf in zip(tables, buffers, strict=True):
        unpack_units(table, ids, buf)


def unit_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge (src, dst) id pairs into `(src_start, dst_start, length)` runs, consecutive on
    both sides: [3, 4, 5, 9] -> [10, 11, 12, 2] is [(3, 10, 3), (9, 2, 1)]."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_units(
    src: GroupStorage,
    src_ids: Sequence[int],
    dst: GroupStorage,
    dst_ids: Sequence[int],
) -> int:
    """Copy units `src_ids` of `src` into units `dst_ids` of `dst` (any devices); returns the
    number of copy descriptors used, runs x tensors."""
    if src.group != dst.group:
        raise ValueError(f"storages of different groups: {src.group} vs {dst.group}")
    _check_ids(src, src_ids, "source", distinct=False)
    _check_ids(dst, dst_ids, "destination", distinct=True)
    tables = list(zip(src.flat(), dst.flat(), strict=True))
    if src.device.type == "cuda" and src.device == dst.device:
        # One gather/scatter kernel per tensor, however scattered the units are.
        ids = torch.tensor([list(src_ids), list(dst_ids)], dtype=torch.int64, device=src.device)
        s_ids, d_ids = ids[0], ids[1]  # one small host-to-device copy for both
        for src_table, dst_table in tables:
            copy_units_direct(src_table, s_ids, dst_table, d_ids)
        return len(tables)
    runs = unit_runs(src_ids, dst_ids)
    for s, d, n in runs:
        for src_table, dst_table in tables:
            # One strided copy covers all layers; integer views keep NaN payloads intact.
            bitwise_view(dst_table)[:, d : d + n].copy_(bitwise_view(src_table)[:, s : s + n])
    return len(runs) * len(tables)


def as_byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype (bf16 and float8 included), no copy.
    The view keeps the tensor's memory alive."""
    if t.device.type != "cpu":
        raise ValueError(f"as_byte_view needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"as_byte_view needs a contiguous tensor, strides {t.stride()}")
    # numpy has no bf16/float8: go through uint8, which every dtype can be viewed as.
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def from_bytes(buf: object, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the bytes of `buf` (bytes, bytearray, memoryview, zmq frame buffer),
    no copy: the caller keeps `buf` alive, and must not write the tensor if `buf` is
    read-only (bytes)."""
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    view = memoryview(buf)  # type: ignore[arg-type]
    if view.nbytes != nbytes:
        raise ValueError(
            f"buffer holds {view.nbytes} bytes, shape {list(shape)} of {dtype} needs {nbytes}"
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # Received frames are read-only bytes; torch warns about that on every call.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
    return raw.view(dtype).view(shape)
