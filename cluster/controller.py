"""The controller actor: pool membership, health, restarts and draining.

It starts the pools from a `PoolSpec`, then checks every worker each interval for
forward progress (a loop that is alive but has not advanced for `stuck_after_s` is as
bad as a dead one). A failed worker's generation is bumped at once (the router reads
`members()` and fails the requests it had there), then it is restarted under the same
worker id. `drain` takes a worker out of routing, waits for its requests (and, for a
prefill worker, its leases) to finish, then stops it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdserve.cluster.ray_pool import PoolSpec, kill_quietly, start_worker

logger = logging.getLogger(__name__)


@dataclass
class Member:
    worker_id: str
    role: str  # "prefill" | "decode"
    actor: object
    generation: int = 0
    draining: bool = False


class Controller:
    def __init__(self, spec: PoolSpec, health_interval_s: float = 2.0) -> None:
        self.spec = spec
        self.health_interval_s = health_interval_s
        self.members_: dict[str, Member] = {}
        self.restarts = 0
        self._health: asyncio.Task | None = None

    async def start(self, timeout_s: float = 600.0) -> list[dict]:
        ids = [("decode", f"decode-{i}") for i in range(self.spec.num_decode)]
        ids += [("prefill", f"prefill-{i}") for i in range(self.spec.num_prefill)]
        for role, wid in ids:
            self.members_[wid] = Member(wid, role, start_worker(self.spec, role, wid))
        infos = await asyncio.wait_for(
            asyncio.gather(*(m.actor.info.remote() for m in self.members_.values())), timeout_s
        )
        hashes = {i["layout_hash"] for i in infos}
        if len(hashes) > 1:
            raise RuntimeError(f"workers disagree on the KV layout: {sorted(hashes)}")
        self._health = asyncio.get_running_loop().create_task(self._health_loop())
        return self.members()

    def members(self) -> list[dict]:
        return [
            {
                "worker_id": m.worker_id,
                "role": m.role,
                "actor": m.actor,
                "generation": m.generation,
                "draining": m.draining,
            }
            for m in self.members_.values()
        ]

    def stats(self) -> dict:
        return {"restarts": self.restarts, "members": len(self.members_)}

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for m in list(self.members_.values()):
                if m.draining or await self._healthy(m):
                    continue
                if self.members_.get(m.worker_id) is not m or m.draining:
                    continue  # drained while its check was in flight: do not bring it back
                m.generation += 1  # seen by the router before the (slow) restart
                kill_quietly(m.actor)
                try:
                    m.actor = start_worker(self.spec, m.role, m.worker_id)
                    await asyncio.wait_for(m.actor.info.remote(), 600)
                except Exception:
                    logger.exception("restart of %s failed; will retry", m.worker_id)
                    continue
                self.restarts += 1
                logger.warning("restarted %s worker %s", m.role, m.worker_id)

    async def _healthy(self, m: Member) -> bool:
        try:
            state = await asyncio.wait_for(m.actor.health.remote(), 10.0)
        except Exception as e:  # dead actor, timeout: both mean restart
            logger.warning("%s worker %s failed its health check: %r", m.role, m.worker_id, e)
            return False
        return bool(state["alive"]) and state["since_progress_s"] < self.spec.stuck_after_s

    async def drain(self, worker_id: str, timeout_s: float = 120.0) -> dict:
        """Stop routing to a worker, let its work finish, stop it, forget it."""
        m = self.members_.get(worker_id)
        if m is None:
            raise ValueError(f"no worker {worker_id!r}")
        m.draining = True
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            try:
                s = await asyncio.wait_for(m.actor.stats.remote(), 10.0)
            except Exception as e:  # dead or hung: nothing left to wait for
                logger.warning("drain of %s: stats failed (%r); stopping it", worker_id, e)
                break
            busy = s["num_requests_running"] + s["num_requests_waiting"] + s.get("leases", 0)
            if busy == 0:
                break
            await asyncio.sleep(0.2)
        else:
            logger.warning("drain of %s timed out after %.0f s", worker_id, timeout_s)
        kill_quietly(m.actor)
        del self.members_[worker_id]
        return {"worker_id": worker_id, "seconds": time.monotonic() - start}

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the health loop and every worker; the loop gets `timeout_s` to unwind."""
        if self._health is not None:
            self._health.cancel()
        for m in self.members_.values():
            kill_quietly(m.actor)
        if self._health is not None:
            done, _ = await asyncio.wait({self._health}, timeout=timeout_s)
            if not done:
                logger.warning("health loop did not stop within %.0f s", timeout_s)
            elif not self._health.cancelled() and self._health.exception() is not None:
                logger.error("health loop had failed: %r", self._health.exception())
