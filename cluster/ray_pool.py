"""Ray actors for the pools, and async handles the router drives them through.

An actor is a thin wrapper: `ray.remote(DecodeService)` / `ray.remote(PrefillService)`.
Payloads are msgpack bytes (cluster/wire.py). A worker-side ValueError (bad input that
slipped past the router) comes back as a 400; a dead actor as a 503.
`WorkerPool` starts actors, checks their health (forward progress, not just liveness),
restarts dead or stuck ones under the same worker id, and stops them all.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.services import DecodeService, PrefillService

logger = logging.getLogger(__name__)


class RayWorkerHandle:
    def __init__(self, worker_id: str, role: str, actor) -> None:
        self.worker_id, self.role, self.actor = worker_id, role, actor

    async def _await(self, ref):
        try:
            return await ref
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, ValueError | TypeError):
                raise ApiError(str(cause), 400) from None
            raise
        except RayActorError as e:
            raise ApiError(
                f"{self.role} worker {self.worker_id} is unavailable", 503, "server_error"
            ) from e

    async def submit(self, payload: bytes) -> None:
        await self._await(self.actor.submit.remote(payload))

    async def prefill(self, payload: bytes) -> bytes:
        return await self._await(self.actor.prefill.remote(payload))

    async def abort(self, request_id: str) -> bool:
        return await self._await(self.actor.abort.remote(request_id))

    async def stats(self) -> dict:
        return await self._await(self.actor.stats.remote())

    async def health(self) -> dict:
        return await self.actor.health.remote()


@dataclass
class PoolSpec:
    engine_kwargs: dict
    num_prefill: int
    num_decode: int
    stream_endpoint: str
    policy: str = "recompute"
    lease_s: float = 30.0
    gpus_per_worker: float = 0.0
    stuck_after_s: float = 60.0
    extra: dict = field(default_factory=dict)


class WorkerPool:
    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.decode: list[RayWorkerHandle] = []
        self.prefill: list[RayWorkerHandle] = []
        self.restarts = 0

    def _start(self, role: str, worker_id: str) -> RayWorkerHandle:
        s = self.spec
        opts = dict(num_cpus=0, num_gpus=s.gpus_per_worker, name=f"pdserve-{worker_id}")
        if role == "decode":
            actor = (
                ray.remote(DecodeService)
                .options(**opts)
                .remote(s.engine_kwargs, worker_id, s.stream_endpoint, s.policy)
            )
        else:
            actor = (
                ray.remote(PrefillService)
                .options(**opts)
                .remote(s.engine_kwargs, worker_id, "127.0.0.1", s.lease_s)
            )
        return RayWorkerHandle(worker_id, role, actor)

    def start(self, timeout_s: float = 600.0) -> None:
        self.decode = [self._start("decode", f"decode-{i}") for i in range(self.spec.num_decode)]
        self.prefill = [
            self._start("prefill", f"prefill-{i}") for i in range(self.spec.num_prefill)
        ]
        refs = [h.actor.info.remote() for h in [*self.decode, *self.prefill]]
        infos = ray.get(refs, timeout=timeout_s)
        hashes = {i["layout_hash"] for i in infos}
        if len(hashes) > 1:
            raise RuntimeError(f"workers disagree on the KV layout: {sorted(hashes)}")

    async def check_health(self, on_failure=None) -> list[str]:
        """Restart every worker that is dead or has made no progress for stuck_after_s;
        returns the restarted worker ids. `on_failure(worker_id)` runs as soon as a
        failure is seen (before the slow restart). The handles stay; their actor changes."""
        restarted = []
        for h in [*self.decode, *self.prefill]:
            try:
                state = await asyncio.wait_for(h.health(), 10.0)
                ok = state["alive"] and state["since_progress_s"] < self.spec.stuck_after_s
            except (RayActorError, asyncio.TimeoutError, ApiError) as e:
                logger.warning("%s worker %s failed its health check: %r", h.role, h.worker_id, e)
                ok = False
            if not ok:
                if on_failure is not None:
                    on_failure(h.worker_id)
                kill_quietly(h.actor)
                h.actor = self._start(h.role, h.worker_id).actor
                await asyncio.wrap_future(h.actor.info.remote().future())
                self.restarts += 1
                restarted.append(h.worker_id)
        return restarted

    def stop(self) -> None:
        for h in [*self.decode, *self.prefill]:
            kill_quietly(h.actor)


def kill_quietly(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # already gone
        logger.debug("kill: %r", e)
