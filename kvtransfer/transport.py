"""The decode side's view of a transport: pull a ticket's units into local storage.

Every transport (local, tcp, cuda_ipc, nccl) implements `Transport`; the protocol
(ticket, pull, release, heartbeat, abort, error) is the same whichever moves the bytes.
Every call takes a timeout and raises `TransferError` (never hangs, never half-succeeds
silently): after an error the destination units hold garbage and must be recomputed or
freed, which is the caller's policy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels.kv_pack import bitwise_view, unpack_units
from pdserve.kvtransfer.layout import DTYPES, GroupStorage
from pdserve.kvtransfer.protocol import DataHeader, Ticket


class TransferError(RuntimeError):
    """A pull or control call failed; `code` is short and stable (for counters)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class PullSpec:
    ticket: Ticket
    dst_unit_ids: tuple[tuple[int, ...], ...]  # [group][unit], parallel to the ticket's
    first_units: tuple[int, ...]  # per group: units before this are already local

    def __post_init__(self) -> None:
        src = self.ticket.group_unit_ids
        if len(self.dst_unit_ids) != len(src) or len(self.first_units) != len(src):
            raise ValueError(
                f"pull spec has {len(self.dst_unit_ids)} destination groups and "
                f"{len(self.first_units)} offsets for a ticket of {len(src)} groups"
            )
        for g, (s, d, f) in enumerate(zip(src, self.dst_unit_ids, self.first_units)):
            if len(s) != len(d) or not 0 <= f <= len(s):
                raise ValueError(
                    f"group {g}: {len(s)} source units, {len(d)} destination units, first {f}"
                )


class Transport(Protocol):
    name: str
    # A pull over this transport is faster than reading the host tier (a device path:
    # local, cuda_ipc, nccl). With a ticket for it, the decode loader skips the tier: the
    # ticket's blocks sit pinned on the prefill GPU, and the tier's copy would cross host
    # memory (and a Ray call) for nothing. Over tcp the tier's shared memory is faster.
    beats_tier: bool
    # The pull reads the source's memory directly (cuda_ipc): nothing on the wire shows
    # the source was alive and still held the blocks while the copy ran. The release's
    # Ack does; the loader counts a failed release as a failed load.
    release_confirms_copy: bool

    def pull(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> int:
        """Copy the ticket's units into `dst`; returns the bytes moved."""

    def release(self, ticket: Ticket, timeout_s: float) -> None:
        """Tell the source the blocks may be freed."""

    def abort(self, ticket: Ticket, timeout_s: float) -> None:
        """Tell the source we gave up (same effect as release, counted apart)."""

    def heartbeat(self, ticket: Ticket, extend_s: float, timeout_s: float) -> float:
        """Extend the lease; returns its new expiry (unix time)."""

    def close(self) -> None: ...


def expected_parts(spec: PullSpec, dst: Sequence[GroupStorage]) -> set[tuple[int, int, int]]:
    """(group, tensor, layer) of every part a pull must deliver exactly once: all layers of
    all tensors of each group with units after `first_units`, nothing of the others. A
    stream is complete only when it covered this set, so a peer that skips or repeats a
    part cannot end a pull "successfully" with stale KV in the destination."""
    return {
        (g, t, layer)
        for g, storage in enumerate(dst)
        if spec.first_units[g] < len(spec.dst_unit_ids[g])
        for t in range(len(storage.tensors))
        for layer in range(storage.group.num_layers)
    }


def unpack_frame(
    header: DataHeader, frame: torch.Tensor, spec: PullSpec, dst: Sequence[GroupStorage]
) -> None:
    """Check a received frame against what this pull expects and scatter it into `dst`.
    `frame` is a flat uint8 tensor (host or device)."""
    g, t = header.group, header.tensor
    if not (0 <= g < len(dst) and 0 <= t < len(dst[g].flat())):
        raise TransferError("bad_frame", f"frame for group {g} tensor {t} does not exist here")
    table = dst[g].flat()[t]
    ids = spec.dst_unit_ids[g][spec.first_units[g] :]
    layers = header.layer_end - header.layer_start
    want = [layers, len(ids), table.shape[2]]
    dtype = DTYPES.get(header.dtype)
    if header.shape != want or dtype != table.dtype or header.layer_end > table.shape[0]:
        raise TransferError(
            "bad_frame",
            f"frame shape {header.shape} {header.dtype} layers {header.layer_start}:"
            f"{header.layer_end}; expected {want} {table.dtype} within {table.shape[0]} layers",
        )
    if frame.numel() != header.nbytes or header.nbytes != layers * len(ids) * table.shape[2] * (
        table.element_size()
    ):
        raise TransferError("bad_frame", f"frame has {frame.numel()} bytes, header {header.nbytes}")
    buf = frame.to(table.device, non_blocking=False).view(table.dtype).view(want)
    index = torch.tensor(ids, dtype=torch.int64, device=table.device)
    part = table[header.layer_start : header.layer_end]
    unpack_units(bitwise_view(part), index, bitwise_view(buf))
