"""Request-level pack/unpack and direct unit copies over a `GroupStorage`.

`pack` gathers a request's units (its blocks, or its Mamba slot) into one contiguous
`[L, n, E]` buffer per tensor of the group, layer-major so a layer-wise sender can ship
`buf[l]` as soon as layer l is done; `unpack` scatters such buffers into another
storage at that side's own unit ids. `copy_units` / `copy_groups` skip the buffers when
one copy reaches both storages: on one CUDA device, one kernel launch per tensor moves
every unit and layer (the ids travel to the device through an `IdStaging`, one
asynchronous copy for all groups of a pull); otherwise (CPU, two devices) each run of ids
consecutive on both sides is one strided copy covering every layer, so a transfer costs
runs x tensors descriptors, not units x layers. `as_byte_view` / `from_bytes` turn CPU
buffers into socket frames and back without copying.

Unit ids are checked on the host (ints in range, destinations distinct) before anything
moves: the kernels trust them. The checks run as C loops (set, numpy) over the id list;
a Python loop per id runs only to name the first bad id.

What this module does not know: which units belong to a request, how bytes travel, or
whether the peer's layout matches (`KVLayout.check_compatible` settles that at handshake).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pdserve.kernels.kv_copy import PairCache, copy_units_joined
from pdserve.kernels.kv_pack import bitwise_view, pack_units, unpack_units
from pdserve.kvtransfer.id_staging import IdStaging
from pdserve.kvtransfer.layout import GroupStorage


def _check_ids(
    storage: GroupStorage, unit_ids: Sequence[int], side: str, distinct: bool
) -> np.ndarray:
    """`unit_ids` as an int64 array, once `_verify_ids` has accepted them."""
    _verify_ids(storage, unit_ids, side, distinct)
    return _as_int64(unit_ids)


def _as_int64(unit_ids: Sequence[int]) -> np.ndarray:
    """Ids `_verify_ids` accepted (ints, int subclasses among them, all in range)."""
    return np.array(unit_ids, dtype=np.int64)


def _verify_ids(storage: GroupStorage, unit_ids: Sequence[int], side: str, distinct: bool) -> None:
    """ValueError unless each id is an int (not a bool) in [0, num_units) and, if
    `distinct`, no id repeats. Builtins over the list, not numpy: numpy costs a few
    microseconds a call whatever the length, and the graph path runs this on the host while
    the device copies (a 128-token pull's 8 ids a side: 2.4 us, 7.7 with numpy)."""
    num_units = storage.num_units
    # Types first: a float or a bool must not pass as the int it compares equal to.
    plain = set(map(type, unit_ids)) <= {int}
    if not plain or (unit_ids and (min(unit_ids) < 0 or max(unit_ids) >= num_units)):
        for uid in unit_ids:  # name the first bad id (int subclasses in range are fine)
            if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < num_units:
                raise ValueError(f"{side} unit id {uid!r} is not an int in [0, {num_units})")
    # Written ids must be distinct: with a duplicate, which write survives is unspecified.
    if distinct and len(set(unit_ids)) != len(unit_ids):
        raise ValueError(f"{side} unit ids must be distinct, got {list(unit_ids)}")


def _ids_tensor(storage: GroupStorage, ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(ids).to(storage.device)


def pack(
    storage: GroupStorage, unit_ids: Sequence[int], layers: tuple[int, int] | None = None
) -> list[torch.Tensor]:
    """One new `[L, n, E]` buffer per tensor of the group: `buf[l, i]` is unit `unit_ids[i]`;
    with `layers = (start, end)`, only those layers (`[end - start, n, E]`)."""
    ids = _ids_tensor(storage, _check_ids(storage, unit_ids, "source", distinct=False))
    buffers = []
    for table in storage.flat():
        if layers is not None:
            if not 0 <= layers[0] <= layers[1] <= table.shape[0]:
                raise ValueError(f"layers {layers} outside [0, {table.shape[0]}]")
            table = table[layers[0] : layers[1]]
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
    checked = _check_ids(storage, unit_ids, "destination", distinct=True)
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
    ids = _ids_tensor(storage, checked)
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


class UnitCopy(NamedTuple):
    """One group's part of a direct copy: units `src_ids` of `src` into `dst_ids` of `dst`.
    A named tuple, not a frozen dataclass: a pull builds one per group on its critical path,
    and a frozen dataclass's `__init__` costs ~1 us more per instance."""

    src: GroupStorage
    src_ids: Sequence[int]
    dst: GroupStorage
    dst_ids: Sequence[int]
    # src and dst on two CUDA devices whose peer access the caller has enabled: the kernel
    # runs on src's device and writes dst across the link (cuda_ipc between two GPUs).
    peer: bool = False

    def on_gpu(self) -> bool:
        """Copied by the kernel: both on one CUDA device, or on two peers."""
        src, dst = self.src.device, self.dst.device
        return src.type == "cuda" and (src == dst or (self.peer and dst.type == "cuda"))


def copy_units(
    src: GroupStorage,
    src_ids: Sequence[int],
    dst: GroupStorage,
    dst_ids: Sequence[int],
    staging: IdStaging | None = None,
) -> int:
    """Copy units `src_ids` of `src` into units `dst_ids` of `dst` (any devices); returns the
    number of copy descriptors used, runs x tensors (tensors, on one CUDA device)."""
    return copy_groups([UnitCopy(src, src_ids, dst, dst_ids)], staging)


def check_copies(copies: Sequence[UnitCopy]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each copy's (source ids, destination ids) as int64 arrays, once `verify_copies` has
    accepted them."""
    verify_copies(copies)
    return [(_as_int64(c.src_ids), _as_int64(c.dst_ids)) for c in copies]


def verify_copies(copies: Sequence[UnitCopy]) -> None:
    """ValueError unless both storages of each copy are of one group, it has as many
    source as destination ids, and every id is an int in range (destinations distinct).
    The graph path calls this alone, on the host while the device copies."""
    for c in copies:
        if c.src.group != c.dst.group:
            raise ValueError(f"storages of different groups: {c.src.group} vs {c.dst.group}")
        if len(c.src_ids) != len(c.dst_ids):
            raise ValueError(f"{len(c.src_ids)} source ids but {len(c.dst_ids)} destination ids")
        _verify_ids(c.src, c.src_ids, "source", distinct=False)
        _verify_ids(c.dst, c.dst_ids, "destination", distinct=True)


def copy_groups(
    copies: Sequence[UnitCopy],
    staging: IdStaging | None = None,
    pairs: PairCache | None = None,
) -> int:
    """`copy_units` for several groups at once; returns the descriptors used. With
    `staging` (whose stream must be the current one), the ids of every group on its device
    reach the GPU in one asynchronous copy; without, each such group's ids are one
    synchronous copy. Every group's ids are checked before anything is queued. `pairs`
    keeps the kernel's per-table-pair launch set-up across calls (a transport holds one)."""
    checked = check_copies(copies)
    device_ids = _device_ids(copies, checked, staging)
    pairs = pairs if pairs is not None else PairCache()
    descriptors = 0
    for k, c in enumerate(copies):
        tables = list(zip(c.src.flat(), c.dst.flat(), strict=True))
        if k in device_ids:
            # One gather/scatter kernel per tensor, however scattered the units are.
            ids, offset = device_ids[k]
            n = len(checked[k][0])
            if n == 0:  # nothing launched, nothing to count
                continue
            for src_table, dst_table in tables:
                copy_units_joined(pairs.get(src_table, dst_table), ids, offset, n, c.peer)
            descriptors += len(tables)
            continue
        runs = unit_runs(c.src_ids, c.dst_ids)
        for s, d, n in runs:
            for src_table, dst_table in tables:
                # One strided copy covers all layers; integer views keep NaN payloads intact.
                bitwise_view(dst_table)[:, d : d + n].copy_(bitwise_view(src_table)[:, s : s + n])
        descriptors += len(runs) * len(tables)
    return descriptors


def _device_ids(
    copies: Sequence[UnitCopy],
    checked: list[tuple[np.ndarray, np.ndarray]],
    staging: IdStaging | None,
) -> dict[int, tuple[torch.Tensor, int]]:
    """By index, for the copies the kernel does: an int64 buffer on the source's device
    (where the kernel runs) holding that copy's source ids at the offset, its destination
    ids right after."""
    direct = [k for k, c in enumerate(copies) if c.on_gpu()]
    staged = [k for k in direct if staging is not None and copies[k].src.device == staging.device]
    out = {}
    if staged:
        assert staging is not None
        current = torch.cuda.current_stream(staging.device)
        assert current.stream_id == staging.stream.stream_id, (
            "the kernels must run on the staging's stream, or they may read ids not yet copied"
        )
        ids, offsets = staging.stage([ids for k in staged for ids in checked[k]])
        out = {k: (ids, offsets[2 * j]) for j, k in enumerate(staged)}
    for k in direct:
        if k not in out:
            joined = torch.from_numpy(np.concatenate(checked[k])).to(copies[k].src.device)
            out[k] = (joined, 0)  # one small synchronous copy for both
    return out


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


def warm_up(storages: Sequence[GroupStorage]) -> None:
    """Compile the pack and unpack kernels before the first request would: unit 0 of each
    GPU group packed and written back onto itself (its bytes unchanged). Call it before
    the worker serves: nothing else may write unit 0 meanwhile."""
    for storage in storages:
        if storage.device.type == "cuda" and storage.num_units > 0:
            unpack(storage, [0], pack(storage, [0]))
    for device in {s.device for s in storages if s.device.type == "cuda"}:
        torch.cuda.synchronize(device)
