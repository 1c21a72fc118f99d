"""Ray actors for the pools, and async handles the router drives them through.

An actor is a thin wrapper: `ray.remote(DecodeActor)` / `ray.remote(PrefillActor)`
(cluster/pool_actors.py), which build their service in the worker's process.
Payloads are msgpack bytes (cluster/wire.py). A worker-side ValueError (bad input that
slipped past the router) comes back as a 400; a dead actor as a 503.
Membership, health and restarts live in the controller actor (cluster/controller.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError, RayTaskError

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.pool_actors import DecodeActor, PrefillActor
from pdserve.cluster.serve_placement import actor_resources

logger = logging.getLogger(__name__)


class RayWorkerHandle:
    def __init__(self, worker_id: str, role: str, actor) -> None:
        self.worker_id, self.role, self.actor = worker_id, role, actor
        self.generation = 0  # bumped by the controller on each restart

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

    async def first_token(self, request_id: str) -> bytes:
        return await self._await(self.actor.first_token.remote(request_id))

    async def deliver_first_token(self, payload: bytes) -> bool:
        return await self._await(self.actor.first_token.remote(payload))

    async def abort(self, request_id: str) -> bool:
        return await self._await(self.actor.abort.remote(request_id))

    async def stats(self) -> dict:
        return await self._await(self.actor.stats.remote())

    async def reset_prefix_cache(self) -> bool:
        return await self._await(self.actor.reset_prefix_cache.remote())


def worker_role(worker_id: str) -> str:
    """Worker ids are "<role>-<n>" ("decode-0", "prefill-3")."""
    return worker_id.rsplit("-", 1)[0]


def worker_index(worker_id: str) -> int:
    return int(worker_id.rsplit("-", 1)[1])


def actor_options(spec: PoolSpec, worker_id: str) -> dict:
    """Ray options of a worker actor: its GPU share, name and extra environment."""
    opts = dict(num_cpus=0, num_gpus=spec.gpus_per_worker, name=f"pdserve-{worker_id}")
    if spec.pool_resources:
        opts["resources"] = actor_resources(True, worker_role(worker_id))
    if spec.actor_env:
        opts["runtime_env"] = {"env_vars": dict(spec.actor_env)}
    return opts


def start_worker(spec: PoolSpec, role: str, worker_id: str):
    """A new worker actor (not waited for: await its `info` to know it is up)."""
    opts = actor_options(spec, worker_id)
    dist_spec = spec.dist_spec(role, worker_id)
    if role == "decode":
        actor = (
            ray.remote(DecodeActor)
            .options(**opts)
            .remote(
                spec.engine_kwargs,
                worker_id,
                spec.stream_endpoint,
                policy=spec.policy,
                tier_actor=spec.tier,
                kv_transport=spec.kv_transport,
                dist_spec=dist_spec,
                kv_layer_wise=spec.kv_layer_wise,
            )
        )
    else:
        actor = (
            ray.remote(PrefillActor)
            .options(**opts)
            .remote(
                spec.engine_kwargs,
                worker_id,
                lease_s=spec.lease_s,
                host=None if spec.bind_node_ip else "127.0.0.1",
                tier_actor=spec.tier,
                cuda_ipc=spec.kv_transport == "cuda_ipc",
                dist_spec=dist_spec,
                early_tickets=spec.kv_layer_wise,
            )
        )
    return actor


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
    tier: object | None = None  # the KV tier actor's handle, if there is one
    kv_transport: str = "tcp"  # "tcp" | "cuda_ipc" | "nccl"
    kv_layer_wise: bool = False  # tcp: early tickets, KV streamed layer by layer
    dist_init_method: str | None = None  # nccl: where the KV transfer group meets
    actor_env: dict | None = None  # extra environment of worker actors (gpu_binding)
    pool_resources: bool = False  # actors ask for pdserve_prefill / pdserve_decode
    bind_node_ip: bool = False  # prefill KV servers bind their node's address, not loopback

    def dist_spec(self, role: str, worker_id: str) -> dict | None:
        """nccl: this worker's place in the KV transfer group (decode workers first)."""
        if self.kv_transport != "nccl" or self.dist_init_method is None:
            return None
        index = worker_index(worker_id)
        rank = index if role == "decode" else self.num_decode + index
        return {
            "backend": "nccl" if self.gpus_per_worker > 0 else "gloo",
            "init_method": self.dist_init_method,
            "world_size": self.num_decode + self.num_prefill,
            "rank": rank,
        }


def kill_quietly(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # already gone
        logger.debug("kill: %r", e)
