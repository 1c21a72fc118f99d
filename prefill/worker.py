"""The prefill worker: an engine in prefill role that exports KV under leases.

Plain Python (a Ray actor wraps it in `cluster/`). `submit` queues a prompt; each `step`
runs the engine and turns every request that finished its prompt into a `Ticket` (where
the blocks are, until when, and the first token). The blocks stay referenced until the
decode side releases them, the request is aborted, or the lease expires; the lease
table only queues those events, and `step` frees the blocks on this thread, the only
one that touches the engine. With a tier, full prompt blocks are also written behind
into it (keyed by chain hash), so later requests can skip the transfer entirely.

It knows nothing about routing or HTTP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.layout import paged_cache_storage
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.pack import pack
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.server import KVSourceServer
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.tier import HostKVTier
from pdserve.kvtransfer.transport_cuda_ipc import export_storages
from pdserve.kvtransfer.transport_local import LocalRegistry
from pdserve.runner.engine import Engine
from pdserve.runner.outputs import RequestDelta
from pdserve.runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    """A request leaving the prefill worker: with a ticket, or ended here (abort)."""

    request_id: str
    ticket: Ticket | None
    finish_reason: str | None = None


def ticket_logprobs(delta: RequestDelta) -> list[list[float]] | None:
    """The first token's logprobs as ticket rows [token_id, logprob, rank]."""
    lp = delta.first_top_logprobs
    if lp is None:
        return None
    rows = [[lp.token_ids[0], lp.logprobs[0], lp.rank]]
    rows += [[t, v, r] for r, (t, v) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), 1)]
    return rows


def host_copies(buffers: list[torch.Tensor]) -> tuple[list[torch.Tensor], object | None]:
    """Host copies of packed buffers, without waiting: on a GPU, copies into pinned memory
    queued on the current stream and a CUDA event after them (the step loop goes on; the
    tier waits for the event before it reads); on the CPU, the buffers themselves."""
    if not buffers or not buffers[0].is_cuda:
        return buffers, None
    host = [torch.empty(b.shape, dtype=b.dtype, pin_memory=True) for b in buffers]
    for h, b in zip(host, buffers):
        h.copy_(b, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class PrefillWorker:
    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        lease_s: float = 30.0,
        bind: str | None = "tcp://127.0.0.1:0",
        registry: LocalRegistry | None = None,
        tier: HostKVTier | None = None,
        cuda_ipc: bool = False,
        nccl: bool = False,
    ) -> None:
        """Serve pulls over tcp at `bind` (or in-process through `registry`). `cuda_ipc`:
        also export the KV cache's CUDA IPC handles, and advertise `cuda_ipc+tcp://`.
        `nccl`: also send KV by torch.distributed P2P (the default process group, formed
        by the caller), and advertise `nccl+tcp://`."""
        engine.require_paged("a prefill worker")
        self.engine = engine
        self.worker_id = worker_id
        self.tier = tier
        layout, storage = paged_cache_storage(
            engine.config.model.source or "model", engine.runner.kv_cache
        )
        self.source = KVSource(worker_id, layout, (storage,), LeaseTable(lease_s))
        self.leases = self.source.leases
        self.server: KVSourceServer | None = None
        if registry is not None:
            self.endpoint = registry.add(self.source)
        else:
            assert bind is not None, "a prefill worker needs a bind address or a local registry"
            if nccl:
                from pdserve.kvtransfer.transport_nccl import NcclSourceServer

                self.server = NcclSourceServer(self.source, bind)
                self.endpoint = self.server.ticket_endpoint
            else:
                export = export_storages(self.source.storages) if cuda_ipc else None
                self.server = KVSourceServer(self.source, bind, ipc_export=export)
                self.endpoint = ("cuda_ipc+" if cuda_ipc else "") + self.server.endpoint
        self.num_tier_blocks = 0

    @property
    def layout(self):
        return self.source.layout

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params, hold_kv=True)

    def abort(self, request_id: str) -> bool:
        """Stop a prompt still running, or end the lease of one already exported."""
        if self.leases.release(request_id, "aborted"):
            self._free_released()
            return True
        if request_id in self.leases:
            return False  # ended, but a transfer still reads it: freed when that ends
        return self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def idle(self) -> None:
        """Housekeeping with no prompt running: expire leases, free released blocks."""
        self.leases.expire()
        self._free_released()

    def step(self) -> list[PrefillResult]:
        self.idle()
        if not self.engine.has_unfinished():
            return []
        out = []
        for delta in self.engine.step():
            if delta.kv_held is None:
                if delta.finished:
                    out.append(PrefillResult(delta.request_id, None, delta.finish_reason))
                continue
            held = delta.kv_held
            if self.tier is not None:
                self._write_behind(held.block_ids, held.block_hashes)
            lease = self.leases.add(delta.request_id, [list(held.block_ids)], held.num_tokens)
            ticket = Ticket(
                request_id=delta.request_id,
                worker_id=self.worker_id,
                endpoint=self.endpoint,
                group_unit_ids=[list(held.block_ids)],
                num_tokens=held.num_tokens,
                layout_hash=self.source.layout_hash,
                lease_expiry=lease.expiry,
                first_token=delta.new_token_ids[0],
                first_logprobs=ticket_logprobs(delta),
                finish_reason=None,
            )
            out.append(PrefillResult(delta.request_id, ticket))
        return out

    def _free_released(self) -> None:
        for request_id in self.leases.drain_freeable():
            self.engine.release_held(request_id)

    def _write_behind(self, block_ids: tuple[int, ...], block_hashes: tuple[int, ...]) -> None:
        n = len(block_hashes)
        if n == 0 or not self.tier.admits(n * self.source.layout.groups[0].unit_bytes()):
            return
        buffers, ready = host_copies(pack(self.source.storages[0], list(block_ids[:n])))
        blocks = [tuple(b[:, i] for b in buffers) for i in range(n)]
        self.num_tier_blocks += self.tier.put(
            self.source.layout_hash, list(block_hashes), blocks, ready
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
