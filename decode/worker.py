"""The decode worker: an engine in decode role that imports KV and streams tokens.

Plain Python (a Ray actor wraps it in `cluster/`). `submit` takes a request with the
ticket its prefill produced: the first token is emitted on the next `step` (stop checks
apply to it here), the KV is loaded in the background by a `TransferLoader` while other
requests keep decoding, and decoding continues from the ticket's first token. A request
whose first token already ends it releases the ticket without loading anything. An early
ticket (layer-wise mode) has no first token yet: the load brings it.

It knows nothing about routing or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.decode.kv_loader import TransferLoader, logprobs_from_rows
from pdserve.decode.lease_keeper import EVERY_S, LeaseKeeper
from pdserve.kvtransfer.layout import GroupStorage, worker_storage
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.tier import HostKVTier
from pdserve.kvtransfer.transport import Transport
from pdserve.runner.early_aborts import EarlyAborts
from pdserve.runner.engine import Engine
from pdserve.runner.hybrid import WHY, is_hybrid
from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.outputs import RequestDelta
from pdserve.runner.pooling import pooling_from_wire
from pdserve.runner.sampling_params import SamplingParams

TIER_ONLY = "tier-only"  # a load with no prefill worker behind it: the tier or nothing


class DecodeWorker:
    def __init__(
        self,
        engine_kwargs: dict,
        worker_id: str,
        transports: dict[str, Transport],
        policy: str = "recompute",
        timeout_s: float = 30.0,
        tier: HostKVTier | None = None,
        engine: Engine | None = None,
        keep_leases_s: float | None = EVERY_S,
    ) -> None:
        """`transports` maps an endpoint scheme ("tcp", "local", ...) to a transport built
        for this worker's layout (`self.layout`, known once the engine exists).
        `keep_leases_s`: how often the leases of queued requests' tickets are extended
        (decode/lease_keeper.py); None leaves them to expire."""
        self.worker_id = worker_id
        # aborts that came before their submit, which is then dropped (runner/early_aborts.py)
        self.early_aborts = EarlyAborts()
        self.loader = TransferLoader(transports, "", policy, timeout_s, tier)
        self.lease_keeper = LeaseKeeper(transports, keep_leases_s)
        self.engine = engine or Engine.from_args(kv_loader=self.loader, **engine_kwargs)
        # A runner without a paged cache (the reference runner) can still decode what it
        # prefills itself (colocated mode); it only cannot import KV.
        self.imports_kv = self.engine.config.runner.runner == "mrv2"
        self.layout = None
        self.storages: tuple[GroupStorage, ...] = ()  # what pulls and tier loads write
        if tier is not None and is_hybrid(self.engine.config.model.hf_config):
            arch = self.engine.config.model.architecture
            raise ValueError(f"the KV tier cannot serve {arch}: {WHY}")
        if self.imports_kv:
            self.engine.kv_loader = self.loader
            self.layout, self.storages = worker_storage(
                self.engine.config.model.source or "model", self.engine.runner.kv_cache,
                getattr(self.engine.config.model.hf_config, "kv_lora_rank", None),
                getattr(self.engine.runner.model, "mamba_states", None),
            )  # fmt: skip
            self.loader.layout_hash = self.layout.compat_hash()
            self.loader.attach(self.storages)
        else:
            self.engine.kv_loader = None
            self.loader.tier = None

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        ticket: Ticket | None,
        lora: LoRARequest | None = None,
        embed: dict | None = None,
    ) -> None:
        """Queue a prefilled request. With `ticket=None` only the tier (and the local
        prefix cache) can supply KV, and the engine computes the rest itself. `lora`: the
        adapter it runs with, loaded into a slot if it is not (None: the base model). `embed`
        (runner/pooling.py `pooling_to_wire`): a pooling request instead, an embedding or
        a classification."""
        if self.early_aborts.take(request_id):  # its abort came first
            if ticket is not None:  # the prefill side frees the prompt's blocks now
                self.loader.abort_ticket(ticket)
            return
        if embed is not None:  # a pooling request: pooled here, never prefilled apart
            task, pooling = pooling_from_wire(embed)
            self.engine.add_pooling_request(request_id, prompt_token_ids, pooling, lora, task)
            return
        if ticket is not None and not self.imports_kv:
            raise ValueError(
                f"decode worker {self.worker_id} runs the {self.engine.runner_name} runner, "
                "which cannot import KV; prefill colocated (no ticket)"
            )
        if ticket is not None and ticket.layout_hash != self.loader.layout_hash:
            raise ValueError(
                f"ticket {ticket.request_id!r} is for KV layout {ticket.layout_hash[:12]}, "
                f"this worker has {self.loader.layout_hash[:12]}"
            )
        if ticket is None:
            # Prompt logprobs need the forward over every prompt position: no cached KV,
            # neither the tier's nor the local prefix cache's (the load path takes both).
            cacheable = self.loader.tier is not None and params.prompt_logprobs is None
            tier_only = TIER_ONLY if cacheable else None
            self.engine.add_request(
                request_id, prompt_token_ids, params, kv_ticket=tier_only, lora_request=lora
            )
            return
        continues = self.engine.add_prefilled_request(
            request_id,
            prompt_token_ids,
            params,
            ticket.first_token,
            logprobs_from_rows(ticket.first_logprobs),
            ticket,
            ticket.num_cached_tokens,
            ticket.queue_s,
            lora,
        )
        if not continues:
            self.loader.finish_ticket(ticket, release=True)

    def first_token(self, request_id: str, token: int, rows: list | None) -> bool:
        """An early ticket's first token relayed from the prefill worker ahead of its KV
        (`Engine.add_first_token`); False when it came too late to be the first."""
        return self.engine.add_first_token(request_id, token, logprobs_from_rows(rows))

    def abort(self, request_id: str) -> bool:
        # A load, once started, ends its ticket itself (cancelled: abort). A request still
        # waiting for admission holds its ticket unused: abort that lease here, or the
        # prefill side keeps the blocks until it expires.
        scheduler = self.engine.scheduler
        req = scheduler.requests.get(request_id)
        unused = req.kv_ticket if req is not None and request_id not in scheduler.loading else None
        if not self.engine.abort(request_id):
            self.early_aborts.add(request_id)  # not here yet (or finished)
            return False
        if isinstance(unused, Ticket):
            self.loader.abort_ticket(unused)
        return True

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def stalled(self) -> bool:
        """The last step had nothing to run: the requests left wait on KV loads."""
        return self.engine.stalled

    def set_waker(self, wake: Callable[[], None]) -> None:
        """`wake` is called when a KV load ends (what a stalled engine waits for)."""
        self.loader.on_done = wake

    def step(self) -> list[RequestDelta]:
        if self.lease_keeper.due():  # queued requests' tickets (a load pins its own lease)
            self.lease_keeper.start([r.kv_ticket for r in self.engine.scheduler.waiting])
        return self.engine.step()

    def close(self) -> None:
        self.lease_keeper.close()
        self.loader.close()
