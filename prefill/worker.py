"""The prefill worker: an engine in prefill role that exports KV under leases.

Plain Python (a Ray actor wraps it in `cluster/`). `submit` queues a prompt; each `step`
runs the engine and turns every request that finished its prompt into a `Ticket` (where
the blocks are, until when, and the first token). The blocks stay referenced until the
decode side releases them, the request is aborted, or the lease expires; the lease
table only queues those events, and `step` frees the blocks on this thread, the only
one that touches the engine. With a tier, full prompt blocks are also written behind
into it (keyed by chain hash), so later requests can skip the transfer entirely.

Layer-wise early tickets (`early_tickets=True`, tcp): the engine tells the worker, before
the forward of the step that finishes a prompt, which prompts finish there
(`step_started`); the worker adds their leases with the step's `LayerMarks`, and the
ticket goes out at once, with no first token (`on_early_ticket`, or the next `step`'s
results). The source server streams each layer as the forward marks it done and ends
the pull with the first token, which `step` records on the lease when it is sampled.

A hybrid Mamba model's held prompt also keeps its state unit (runner/state_pool.py): its
ticket lists the blocks, then the unit, and the puller takes both. Such a model has no
tier (blocks without states) and no early tickets (the state is final only after the
whole forward): both are refused by name.

It knows nothing about routing or HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.layer_marks import LayerMarks
from pdserve.kvtransfer.layout import worker_storage
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.pack import pack
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.server import KVSourceServer
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.tier import HostKVTier
from pdserve.kvtransfer.transport_cuda_ipc import export_storages
from pdserve.kvtransfer.transport_local import LocalRegistry
from pdserve.runner.early_aborts import EarlyAborts
from pdserve.runner.engine import Engine
from pdserve.runner.hybrid import WHY, is_hybrid
from pdserve.runner.kv_hooks import KVPromptScheduled
from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.outputs import RequestDelta
from pdserve.runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# (request id, first token, its logprob rows, None) once sampled; (id, None, None, why)
# when the prompt ended without one.
FirstTokenHook = Callable[[str, int | None, list | None, str | None], None]


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


def packed_ready(buffers: list[torch.Tensor]) -> torch.cuda.Event | None:
    """A CUDA event after the pack kernels just queued on the current stream (the tier's
    writer waits for it, then copies the buffers to the host itself); None on the CPU."""
    if not buffers or not buffers[0].is_cuda:
        return None
    ready = torch.cuda.Event()
    ready.record()
    return ready


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
        early_tickets: bool = False,
    ) -> None:
        """Serve pulls over tcp at `bind` (or in-process through `registry`). `cuda_ipc`:
        also export the KV cache's CUDA IPC handles, and advertise `cuda_ipc+tcp://`.
        `nccl`: also send KV by torch.distributed P2P (the default process group, formed
        by the caller), and advertise `nccl+tcp://`. `early_tickets`: layer-wise early
        tickets (module docstring); tcp only, since only its stream carries the token."""
        engine.require_paged("a prefill worker")
        hybrid = is_hybrid(engine.config.model.hf_config)
        if hybrid and (early_tickets or tier is not None):
            what = "layer-wise early tickets" if early_tickets else "the KV tier"
            raise ValueError(f"{what} cannot serve {engine.config.model.architecture}: {WHY}")
        if early_tickets and (cuda_ipc or nccl or registry is not None):
            raise ValueError(
                "early tickets (layer-wise) stream KV over tcp; they cannot be combined "
                "with cuda_ipc, nccl or an in-process registry"
            )
        self.engine = engine
        self.worker_id = worker_id
        self.tier = tier
        self.early_aborts = EarlyAborts()  # aborts that came before their prompt
        layout, storages = worker_storage(
            engine.config.model.source or "model", engine.runner.kv_cache,
            getattr(engine.config.model.hf_config, "kv_lora_rank", None),
            getattr(engine.runner.model, "mamba_states", None),
        )  # fmt: skip
        self.source = KVSource(worker_id, layout, storages, LeaseTable(lease_s))
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
        # Early tickets: called with each one as it is issued (from inside the engine's
        # step, before the forward); without it they come with the next `step` results.
        self.on_early_ticket: Callable[[PrefillResult], None] | None = None
        # And with each early request's first token once sampled (token, logprob rows,
        # None), or (None, None, why) when its prompt ended without one: the service
        # relays the token to the decode side ahead of the KV stream, which ends with it.
        self.on_first_token: FirstTokenHook | None = None
        self._early_out: list[PrefillResult] = []
        self._early: dict[str, tuple[int, ...]] = {}  # ticketed early, not yet held: blocks
        self._free_when_held: set[str] = set()  # their leases ended before they were held
        self.num_early_tickets = 0
        if early_tickets:
            engine.kv_publisher = self

    @property
    def layout(self):
        return self.source.layout

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> bool:
        """`lora`: the adapter it runs with, loaded into a slot if it is not (None: the
        base model). False: its abort came first (runner/early_aborts.py), nothing runs."""
        if self.early_aborts.take(request_id):
            return False
        self.engine.add_request(
            request_id, prompt_token_ids, params, hold_kv=True, lora_request=lora
        )
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a prompt still running, or end the lease of one already exported."""
        if self.leases.release(request_id, "aborted"):
            self._free_released()
            return True
        if request_id in self.leases:
            return False  # ended, but a transfer still reads it: freed when that ends
        if self.engine.abort(request_id):
            return True
        self.early_aborts.add(request_id)  # not here yet (or finished)
        return False

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def stalled(self) -> bool:
        """The last step had nothing to run: its prompts wait for blocks that held prompts
        keep until the decode side releases them (or their leases expire)."""
        return self.engine.stalled

    def set_waker(self, wake: Callable[[], None]) -> None:
        """`wake` is called when a lease ends and its blocks can be freed."""
        self.leases.on_freeable = wake

    def idle(self) -> None:
        """Housekeeping with no prompt running: expire leases, free released blocks."""
        self.leases.expire()
        self._free_released()

    def step_started(self, scheduled: list[KVPromptScheduled]) -> Callable[[int], None]:
        """KVPublisher: these held prompts finish in the step about to run; lease their
        blocks with the step's layer marks and issue their early tickets now."""
        marks = LayerMarks(self.layout.groups[0].num_layers, self.engine.config.runner.torch_device)
        for s in scheduled:
            lease = self.leases.add(s.request_id, [list(s.block_ids)], s.num_tokens, marks)
            self._early[s.request_id] = s.block_ids
            self.num_early_tickets += 1
            ticket = self._ticket(
                s.request_id, [list(s.block_ids)], s.num_tokens, lease.expiry, None, None,
                s.num_cached_tokens, s.queue_s,
            )  # fmt: skip
            result = PrefillResult(s.request_id, ticket)
            if self.on_early_ticket is not None:
                self.on_early_ticket(result)
            else:
                self._early_out.append(result)
        return marks.done

    def step(self) -> list[PrefillResult]:
        self.idle()
        if not self.engine.has_unfinished():
            return []
        out = []
        for delta in self.engine.step():
            rid = delta.request_id
            if delta.kv_held is None:
                if delta.finished:
                    if self._early.pop(rid, None) is not None:
                        why = f"prompt ended: {delta.finish_reason}"
                        self.leases.fail_pending(rid, why)
                        if self.on_first_token is not None:
                            self.on_first_token(rid, None, None, why)
                    out.append(PrefillResult(rid, None, delta.finish_reason))
                continue
            held = delta.kv_held
            if self.tier is not None:
                self._write_behind(held.block_ids, held.block_hashes)
            early = self._early.pop(rid, None)
            if early is not None:  # its ticket went out before the forward
                assert early == held.block_ids, f"{rid}: held blocks differ from the ticket's"
                token, rows = delta.new_token_ids[0], ticket_logprobs(delta)
                self.leases.complete(rid, token, rows)
                if self.on_first_token is not None:
                    self.on_first_token(rid, token, rows, None)
                if rid in self._free_when_held:
                    self._free_when_held.discard(rid)
                    self.engine.release_held(rid)
                continue
            units = [list(held.block_ids)]
            if held.state_unit is not None:  # a hybrid's final Mamba state rides along
                units.append([held.state_unit])
            lease = self.leases.add(delta.request_id, units, held.num_tokens)
            ticket = self._ticket(
                rid, units, held.num_tokens, lease.expiry, delta.new_token_ids[0],
                ticket_logprobs(delta), delta.num_cached_tokens, delta.queue_s,
            )  # fmt: skip
            out.append(PrefillResult(rid, ticket))
        out += self._early_out  # issued inside this step, before its forward
        self._early_out = []
        return out

    def _ticket(
        self,
        request_id: str,
        group_unit_ids: list[list[int]],
        num_tokens: int,
        expiry: float,
        first_token: int | None,
        first_logprobs: list[list[float]] | None,
        num_cached_tokens: int,
        queue_s: float,
    ) -> Ticket:
        return Ticket(
            request_id=request_id,
            worker_id=self.worker_id,
            endpoint=self.endpoint,
            group_unit_ids=group_unit_ids,
            num_tokens=num_tokens,
            layout_hash=self.source.layout_hash,
            lease_expiry=expiry,
            first_token=first_token,
            first_logprobs=first_logprobs,
            finish_reason=None,
            num_cached_tokens=min(num_cached_tokens, num_tokens),
            queue_s=queue_s,
        )

    def _free_released(self) -> None:
        for request_id in self.leases.drain_freeable():
            if not self.engine.release_held(request_id) and request_id in self._early:
                # An early lease ended before its request was held (async scheduling:
                # the step that samples it has not been processed yet): free on arrival.
                self._free_when_held.add(request_id)

    def _write_behind(self, block_ids: tuple[int, ...], block_hashes: tuple[int, ...]) -> None:
        n = len(block_hashes)
        if n == 0 or not self.tier.admits(n * self.source.layout.groups[0].unit_bytes()):
            return
        buffers = pack(self.source.storages[0], list(block_ids[:n]))
        ready = packed_ready(buffers)
        blocks = [tuple(b[:, i] for b in buffers) for i in range(n)]
        self.num_tier_blocks += self.tier.put(
            self.source.layout_hash, list(block_hashes), blocks, ready
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        # The engine points back at this worker (its publisher): break the cycle, so the
        # engine and its CUDA graphs go when the last reference does, not at a GC pass.
        self.engine.kv_publisher = None
        self.on_early_ticket = self.on_first_token = None
