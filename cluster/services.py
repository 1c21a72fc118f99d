"""Prefill and decode services: a worker + its loop + its outputs, behind plain methods.

A service is what a Ray actor wraps (cluster/pool_actors.py) and what tests can run
in-process. Methods take and return msgpack bytes or plain values. The decode service
publishes token deltas over ZMQ to the router; the prefill service answers `prefill`
with the ticket once the prompt has run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Any

from pdserve.cluster.gpu_binding import bind_visible_gpus
from pdserve.cluster.startup_report import startup_report
from pdserve.cluster.tier_actor import TierClient
from pdserve.cluster.token_stream import TokenPublisher, delta_from_engine
from pdserve.cluster.wire import FirstToken, WorkRequest
from pdserve.cluster.worker_loop import WorkerLoop
from pdserve.decode.worker import DecodeWorker
from pdserve.kvtransfer import pack
from pdserve.kvtransfer.layout import GroupStorage
from pdserve.kvtransfer.protocol import encode, ticket_from_wire
from pdserve.kvtransfer.transport_cuda_ipc import CudaIpcTransport
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillResult, PrefillWorker
from pdserve.runner.compile_watch import CompileWatch
from pdserve.runner.engine import Engine
from pdserve.runner.warm_up import warm_up

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0


def _engine_stats(engine: Engine, compiles: CompileWatch | None) -> dict[str, Any]:
    s = engine.scheduler
    return {
        "num_requests_running": len(s.running),
        "num_requests_waiting": len(s.waiting) + len(s.loading),
        "kv_cache_usage_perc": engine.kv.usage,
        "num_free_blocks": engine.kv.num_free_blocks,
        "num_blocks": engine.kv.num_blocks,
        "prefix_cache_queries": engine.kv.prefix_cache_queries,
        "prefix_cache_hits": engine.kv.prefix_cache_hits,
        "num_preemptions": s.num_preemptions,
        "prompt_tokens_computed": s.num_prompt_tokens_computed,
        "prefix_waits": s.num_prefix_waits,
        "generation_tokens": engine.stats.generation_tokens,
        "runner": engine.runner_name,
        "execution_path": engine.execution_path,
        "steps_by_path": engine.steps_by_path(),
        "kernel_compiles": compiles.count if compiles is not None else 0,
        "structured_requests": engine.grammars.requests,
        "grammar_compiles": engine.grammars.compiles,
        "grammar_compile_seconds": engine.grammars.compile_seconds,
        "lora_requests": engine.lora_requests(),
        # speculative decoding (runner/speculative/): vLLM's counters
        "spec_decode_num_drafts": s.num_drafts,
        "spec_decode_num_draft_tokens": s.num_draft_tokens,
        "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
        "spec_decode_accepted_by_position": {
            str(i): n for i, n in enumerate(s.num_accepted_per_pos)
        },
        # beside async scheduling: the steps drafts made wait (runner/engine.py `step`)
        "spec_sync_steps": engine.stats.spec_sync_steps,
        "spec_drains": engine.stats.spec_drains,
    }


class _PhaseClock:
    """Seconds of a worker's start by phase, for its startup report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now


def _warm_up_engine(engine: Engine, clock: _PhaseClock) -> None:
    """On a GPU, the engine's warm-up: before the first request, not in its TTFT."""
    if engine.config.runner.torch_device.type == "cuda":
        warm_up(engine)
        clock.done("warm-up")


def join_kv_group(dist_spec: dict | None) -> bool:
    """Join the KV-transfer process group (`--kv-transport nccl`); False if there is none
    or it cannot be formed in time (a restarted worker whose peers are not re-joining):
    the worker then pulls and serves over tcp only, and nccl tickets to or from it fail
    over to recompute."""
    if not dist_spec:
        return False
    import datetime

    import torch
    import torch.distributed as dist

    kwargs = {}
    if dist_spec["backend"] == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    try:
        dist.init_process_group(
            dist_spec["backend"],
            init_method=dist_spec["init_method"],
            world_size=dist_spec["world_size"],
            rank=dist_spec["rank"],
            timeout=datetime.timedelta(seconds=dist_spec.get("timeout_s", 120)),
            **kwargs,
        )
    except Exception as e:  # degrade to tcp rather than take the worker down
        logger.warning("could not join the KV transfer group: %r; using tcp only", e)
        return False
    return True


class _Service:
    loop: WorkerLoop
    tier: TierClient | None
    compiles: CompileWatch | None  # on a GPU, from the end of the warm-up
    startup: dict[str, Any]  # cluster/startup_report.py, sent with `info`

    def _ready(
        self, engine: Engine, worker_id: str, storages: tuple[GroupStorage, ...], clock: _PhaseClock
    ) -> None:
        """The end of a worker's start: its transfer path's kernels compiled (tcp pulls
        and the tier pack and unpack; a no-op off the GPU), its startup report, and on a
        GPU its Triton compiles counted and logged from here on."""
        pack.warm_up(storages)
        clock.done("transfer set-up")
        self.startup = startup_report(engine, clock.seconds)
        on_gpu = engine.config.runner.torch_device.type == "cuda"
        self.compiles = CompileWatch(worker_id).install() if on_gpu else None

    async def _call(self, fn) -> Any:
        """`fn(worker)` on the loop thread, between steps. Awaited, not waited on: the
        actor's event loop stays free, so calls arriving during a step queue up and the
        next step admits them together (a blocking wait let one submit in per step, and a
        prefill worker under 16 concurrent prompts ran batches of one)."""
        return await asyncio.wait_for(asyncio.wrap_future(self.loop.call(fn)), CALL_TIMEOUT_S)

    async def reset_prefix_cache(self) -> bool:
        """Forget the engine's cached prefixes, between steps; False while any request
        holds blocks (a prefill worker's leased prompts too)."""
        return await self._call(lambda w: w.engine.kv.reset_prefix_cache())

    def health(self) -> dict[str, Any]:
        return {
            "alive": self.loop.alive,
            "steps": self.loop.num_steps,
            "since_progress_s": time.monotonic() - self.loop.last_progress,
        }

    def shutdown(self) -> None:
        self.loop.stop()
        if self.tier is not None:
            self.tier.close()


class DecodeService(_Service):
    def __init__(
        self,
        engine_kwargs: dict,
        worker_id: str,
        stream_endpoint: str,
        policy: str = "recompute",
        transfer_timeout_s: float = 30.0,
        tier_actor=None,
        kv_transport: str = "tcp",
        dist_spec: dict | None = None,
        kv_layer_wise: bool = False,
    ) -> None:
        self.worker_id = worker_id
        bind_visible_gpus()  # before CUDA starts (a no-op outside whole-GPU actors)
        in_group = join_kv_group(dist_spec)
        tier = self.tier = TierClient(tier_actor) if tier_actor is not None else None
        clock = _PhaseClock()
        self.worker = DecodeWorker(engine_kwargs, worker_id, {}, policy, transfer_timeout_s, tier)
        clock.done("engine")
        _warm_up_engine(self.worker.engine, clock)
        layout = self.worker.layout
        if layout is not None:  # tickets name their transport by endpoint scheme
            tcp = TcpTransport(worker_id, layout, layer_wise=kv_layer_wise)
            self.worker.loader.transports["tcp"] = tcp
            if kv_transport == "cuda_ipc":
                ipc = CudaIpcTransport(worker_id, layout)
                ipc.prepare(self.worker.storages)
                self.worker.loader.transports["cuda_ipc"] = ipc
            if in_group:
                from pdserve.kvtransfer.transport_nccl import NcclTransport

                self.worker.loader.transports["nccl"] = NcclTransport(worker_id, layout)
        self._ready(self.worker.engine, worker_id, self.worker.storages, clock)
        self.publisher = TokenPublisher(stream_endpoint, worker_id)
        self.loop = WorkerLoop(self.worker, self._publish, name=f"decode-{worker_id}").start()

    def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "layout_hash": self.worker.loader.layout_hash,
            "startup": self.startup,
        }

    def _publish(self, deltas: list) -> None:
        self.publisher.publish([delta_from_engine(d) for d in deltas])

    async def submit(self, payload: bytes) -> None:
        """Queue a request; raises ValueError (bad input) before anything is queued."""
        req = WorkRequest.decode(payload)
        ticket = ticket_from_wire(req.ticket) if req.ticket is not None else None
        await self._call(
            lambda w: w.submit(
                req.request_id,
                req.prompt_token_ids,
                req.params,
                ticket,
                req.lora_request(),
                req.embed,
            )
        )

    async def first_token(self, payload: bytes) -> bool:
        """An early ticket's first token, relayed by the router ahead of the KV
        (`wire.FirstToken`); False when the pull brought it first (or the request is gone)."""
        msg = FirstToken.decode(payload)
        return await self._call(lambda w: w.first_token(msg.request_id, msg.token, msg.logprobs))

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda w: w.abort(request_id))

    async def stats(self) -> dict[str, Any]:
        def read(w: DecodeWorker) -> dict[str, Any]:
            out = _engine_stats(w.engine, self.compiles)
            ls = w.loader.stats
            out.update(
                transfer_bytes=ls.bytes_pulled,
                transfer_seconds=ls.seconds,
                recompute_fallbacks=ls.recomputes,
                transfer_failures=ls.fails,
                lease_extensions=w.lease_keeper.extended,
                lease_extension_failures=w.lease_keeper.num_errors(),
                pulls_by_transport=dict(ls.pulls),
                first_tokens_by_source=dict(w.engine.first_tokens_by_source),
            )
            return out

        return await self._call(read)


class PrefillService(_Service):
    def __init__(
        self,
        engine_kwargs: dict,
        worker_id: str,
        host: str | None = "127.0.0.1",  # None: this node's address (a joined cluster)
        lease_s: float = 30.0,
        tier_actor=None,
        cuda_ipc: bool = False,
        dist_spec: dict | None = None,
        early_tickets: bool = False,
    ) -> None:
        self.worker_id = worker_id
        bind_visible_gpus()  # before CUDA starts (a no-op outside whole-GPU actors)
        in_group = join_kv_group(dist_spec)
        clock = _PhaseClock()
        # A prefill worker samples one token a request (runner/speculative/ drafts none),
        # so it runs without speculation and keeps async scheduling
        engine = Engine.from_args(**{**engine_kwargs, "speculative_config": None})
        clock.done("engine")
        _warm_up_engine(engine, clock)
        tier = self.tier = TierClient(tier_actor) if tier_actor is not None else None
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.worker = PrefillWorker(
            engine, worker_id, lease_s, bind=f"tcp://{host}:0", tier=tier, cuda_ipc=cuda_ipc,
            nccl=in_group, early_tickets=early_tickets,
        )  # fmt: skip
        self._ready(engine, worker_id, self.worker.source.storages, clock)
        self._waiters: dict[str, Future] = {}
        # Early tickets are answered from inside the step, before its forward runs; their
        # first tokens wait here for the router's `first_token` call (by request id, with
        # when they were made: ones nobody asked for go after two leases).
        self._lease_s = lease_s
        self._firsts: dict[str, tuple[Future, float]] = {}
        self.worker.on_early_ticket = self._early_ticket
        self.worker.on_first_token = self._first_token_known
        self.loop = WorkerLoop(self.worker, self._resolve, name=f"prefill-{worker_id}").start()

    def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "layout_hash": self.worker.source.layout_hash,
            "startup": self.startup,
        }

    def _resolve(self, results: list[PrefillResult]) -> None:
        for r in results:
            fut = self._waiters.pop(r.request_id, None)
            if fut is None:
                if r.ticket is not None:  # nobody waits (aborted): free it now
                    self.worker.leases.release(r.request_id, "aborted")
                continue
            if r.ticket is None:
                fut.set_exception(RuntimeError(f"prefill ended: {r.finish_reason}"))
            else:
                fut.set_result(encode(r.ticket))

    def _early_ticket(self, result: PrefillResult) -> None:
        now = time.monotonic()
        for rid, (_, made) in list(self._firsts.items()):
            if now - made > 2 * self._lease_s:
                del self._firsts[rid]
        self._firsts[result.request_id] = (Future(), now)
        self._resolve([result])

    def _first_token_known(
        self, request_id: str, token: int | None, rows: list | None, why: str | None
    ) -> None:
        entry = self._firsts.get(request_id)
        if entry is None or entry[0].done():
            return
        if token is None:
            entry[0].set_exception(RuntimeError(why))
        else:
            entry[0].set_result(FirstToken(request_id, token, rows).encode())

    async def first_token(self, request_id: str) -> bytes:
        """An early ticket's first token (`wire.FirstToken`), once its prompt's forward
        has sampled it: the router relays it to the decode worker, whose KV is still on its
        way (`--kv-layer-wise`). Raises if the prompt ended without one, or had no early
        ticket here."""
        entry = await self._call(lambda w: self._firsts.get(request_id))
        if entry is None:
            raise ValueError(f"no early ticket of {request_id!r} on {self.worker_id}")
        try:  # the forward samples it within the lease, or the lease ends the stream
            return await asyncio.wait_for(asyncio.wrap_future(entry[0]), 2 * self._lease_s)
        finally:
            await self._call(lambda w: self._firsts.pop(request_id, None))

    async def prefill(self, payload: bytes) -> bytes:
        """Run the prompt; returns the ticket (protocol-encoded msgpack)."""
        req = WorkRequest.decode(payload)
        fut: Future = Future()

        def submit(w: PrefillWorker) -> None:
            if w.submit(req.request_id, req.prompt_token_ids, req.params, req.lora_request()):
                self._waiters[req.request_id] = fut
            else:  # its abort came first: no prompt runs, and nobody waits for a ticket
                fut.set_exception(RuntimeError(f"{req.request_id} was aborted before it ran"))

        await self._call(submit)
        return await asyncio.wrap_future(fut)

    async def abort(self, request_id: str) -> bool:
        def stop(w: PrefillWorker) -> bool:
            fut = self._waiters.pop(request_id, None)
            if fut is not None:
                fut.cancel()
            first = self._firsts.pop(request_id, None)
            if first is not None:
                first[0].cancel()
            return w.abort(request_id)

        return await self._call(stop)

    async def stats(self) -> dict[str, Any]:
        def read(w: PrefillWorker) -> dict[str, Any]:
            out = _engine_stats(w.engine, self.compiles)
            out.update(
                lease_expiries=w.leases.counts["expired"],
                leases=len(w.leases),
                early_tickets=w.num_early_tickets,
            )
            return out

        return await self._call(read)
