"""What a prefill worker exposes to pullers: its layout, its KV storages and its leases.

Shared by every transport's serving side (the in-process `local` transport reads it
directly; `KVSourceServer` serves it over ZMQ). It does not know about engines or
sockets: the worker fills the lease table and frees blocks the table hands back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kvtransfer.layout import GroupStorage, KVLayout
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.pack import pack


@dataclass
class KVSource:
    worker_id: str
    layout: KVLayout
    storages: tuple[GroupStorage, ...]  # one per layout group, in layout order
    leases: LeaseTable
    layout_hash: str = field(init=False)

    def __post_init__(self) -> None:
        if len(self.storages) != len(self.layout.groups):
            raise ValueError(
                f"{len(self.storages)} storages for a layout of {len(self.layout.groups)} groups"
            )
        for g, (storage, group) in enumerate(zip(self.storages, self.layout.groups)):
            if storage.group != group:
                raise ValueError(f"storage {g} is for {storage.group}, the layout says {group}")
        self.layout_hash = self.layout.compat_hash()

    def pack_request(
        self,
        group_unit_ids: tuple[tuple[int, ...], ...],
        first_units: list[int],
        on_host: bool = True,
    ) -> list[list[torch.Tensor]]:
        """[group][tensor] buffers `[L, n, E]` of the units from `first_units[g]` on: on the
        host for socket transports, on the storage's device when `on_host` is False."""
        out = []
        for storage, ids, first in zip(self.storages, group_unit_ids, first_units, strict=True):
            buffers = pack(storage, list(ids[first:])) if first < len(ids) else []
            out.append([b.cpu() for b in buffers] if on_host else buffers)
        return out
