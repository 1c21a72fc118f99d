"""The controller actor: pool membership, health, restarts, draining and scaling.

It starts the pools from a `PoolSpec`, then checks every worker each interval for
forward progress (a loop that is alive but has not advanced for `stuck_after_s` is as
bad as a dead one). A failed worker's generation is bumped at once (the router reads
`members()` and fails the requests it had there), then it is restarted under the same
worker id. `drain` takes a worker out of routing, waits for its requests (and, for a
prefill worker, its leases) to finish, then stops it.

`scale(role, replicas)` sets a pool's size within its bounds and returns at once: new
workers join as "starting" (not routed to) and become ready once they answer `info` with
the pool's KV layout; surplus ones are drained, the ones still starting first, then the
newest. Worker ids are never reused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.cluster.ray_pool import PoolSpec, kill_quietly, start_worker, worker_index

logger = logging.getLogger(__name__)


@dataclass
class Member:
    worker_id: str
    role: str  # "prefill" | "decode"
    actor: object
    generation: int = 0
    draining: bool = False
    ready: bool = True  # False while a worker added by `scale` is starting
    since: float = field(default_factory=time.time)  # when it entered its current state
    health: dict | None = None  # its last health answer
    startup: dict | None = None  # its startup report (cluster/startup_report.py), once up


MAX_EVENTS = 50  # the newest pool events kept for the dashboard


class Controller:
    def __init__(
        self,
        spec: PoolSpec,
        health_interval_s: float = 2.0,
        bounds: dict[str, tuple[int, int]] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.spec = spec
        self.health_interval_s = health_interval_s
        # role -> (min, max) workers that `scale` accepts; a colocated pool has no prefill
        self.bounds = bounds or {
            "decode": (1, 64),
            "prefill": (1, 64) if spec.num_prefill else (0, 0),
        }
        self.start_timeout_s = start_timeout_s
        self.members_: dict[str, Member] = {}
        self.restarts = 0
        self.layout_hash: str | None = None
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._next_index = {"decode": spec.num_decode, "prefill": spec.num_prefill}
        self._health: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # bring-ups and drains; cancelled by stop

    async def start(self, timeout_s: float = 600.0) -> list[dict]:
        ids = [("decode", f"decode-{i}") for i in range(self.spec.num_decode)]
        ids += [("prefill", f"prefill-{i}") for i in range(self.spec.num_prefill)]
        for role, wid in ids:
            self.members_[wid] = Member(wid, role, start_worker(self.spec, role, wid))
        infos = await asyncio.wait_for(
            asyncio.gather(*(m.actor.info.remote() for m in self.members_.values())), timeout_s
        )
        now = time.time()  # "ready N s" counts from here, not from the actor's creation
        for m, info in zip(self.members_.values(), infos, strict=True):
            m.startup, m.since = info.get("startup"), now
        hashes = {i["layout_hash"] for i in infos}
        if len(hashes) > 1:
            raise RuntimeError(f"workers disagree on the KV layout: {sorted(hashes)}")
        self.layout_hash = hashes.pop() if hashes else None
        self._event(f"started {len(ids)} worker(s)")
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
                "state": "draining" if m.draining else "ready" if m.ready else "starting",
                "since": m.since,
                "health": m.health,
                "startup": m.startup,
            }
            for m in self.members_.values()
        ]

    def stats(self) -> dict:
        return {
            "restarts": self.restarts,
            "members": len(self.members_),
            "bounds": {role: list(b) for role, b in self.bounds.items()},
            "events": list(self.events),
        }

    def _event(self, text: str) -> None:
        self.events.append({"time": time.time(), "text": text})

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._event(f"failed: {task.exception()!r}")
            logger.error("controller task failed: %r", task.exception())

    # ---- scaling ------------------------------------------------------------------------

    async def scale(self, role: str, replicas: int) -> dict:
        """Set the number of `role` workers (not counting ones draining). Returns at once
        with the ids started and the ids being drained; raises ValueError for a role or
        count outside the bounds."""
        if role not in self.bounds:
            raise ValueError(f"role must be one of {sorted(self.bounds)}, got {role!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ValueError(f"replicas must be an integer, got {replicas!r}")
        lo, hi = self.bounds[role]
        if not lo <= replicas <= hi:
            raise ValueError(f"{role} replicas must be in [{lo}, {hi}], got {replicas}")
        if self.spec.kv_transport == "nccl":
            raise ValueError("an nccl KV group has a fixed size; scaling needs tcp or cuda_ipc")
        pool = [m for m in self.members_.values() if m.role == role and not m.draining]
        started, drained = [], []
        for _ in range(replicas - len(pool)):
            wid = f"{role}-{self._next_index[role]}"
            self._next_index[role] += 1
            m = Member(wid, role, start_worker(self.spec, role, wid), ready=False)
            self.members_[wid] = m
            self._spawn(self._bring_up(m))
            started.append(wid)
        # Surplus: ones still starting first, then the newest.
        surplus = sorted(pool, key=lambda m: (m.ready, -worker_index(m.worker_id)))
        for m in surplus[: max(0, len(pool) - replicas)]:
            m.draining, m.since = True, time.time()
            self._spawn(self.drain(m.worker_id))
            drained.append(m.worker_id)
        if started or drained:
            self._event(f"scale {role} to {replicas}: +{len(started)} -{len(drained)}")
        return {"role": role, "replicas": replicas, "started": started, "draining": drained}

    async def _bring_up(self, m: Member) -> None:
        try:
            info = await asyncio.wait_for(m.actor.info.remote(), self.start_timeout_s)
            if self.layout_hash is not None and info["layout_hash"] != self.layout_hash:
                raise RuntimeError(
                    f"its KV layout {info['layout_hash']} is not the pool's {self.layout_hash}"
                )
        except Exception as e:
            if m.draining:
                return  # drained before it was up: `drain` has stopped it
            if self.members_.get(m.worker_id) is m:
                del self.members_[m.worker_id]
            kill_quietly(m.actor)
            self._event(f"{m.worker_id} failed to start: {e!r}")
            logger.error("new worker %s failed to start: %r", m.worker_id, e)
            return
        if not m.draining:
            m.ready, m.since, m.startup = True, time.time(), info.get("startup")
            self._event(f"{m.worker_id} ready")

    # ---- health -------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for m in list(self.members_.values()):
                if m.draining or not m.ready or await self._healthy(m):
                    continue
                if self.members_.get(m.worker_id) is not m or m.draining:
                    continue  # drained while its check was in flight: do not bring it back
                m.generation += 1  # seen by the router before the (slow) restart
                m.startup = None  # the new generation's comes with its info
                kill_quietly(m.actor)
                try:
                    m.actor = start_worker(self.spec, m.role, m.worker_id)
                    m.startup = (await asyncio.wait_for(m.actor.info.remote(), 600)).get("startup")
                except Exception:
                    logger.exception("restart of %s failed; will retry", m.worker_id)
                    continue
                self.restarts += 1
                m.since = time.time()
                self._event(f"restarted {m.worker_id}")
                logger.warning("restarted %s worker %s", m.role, m.worker_id)

    async def _healthy(self, m: Member) -> bool:
        try:
            state = await asyncio.wait_for(m.actor.health.remote(), 10.0)
        except Exception as e:  # dead actor, timeout: both mean restart
            logger.warning("%s worker %s failed its health check: %r", m.role, m.worker_id, e)
            m.health = {"alive": False, "error": repr(e)}
            return False
        m.health = state
        return bool(state["alive"]) and state["since_progress_s"] < self.spec.stuck_after_s

    async def start_drain(self, worker_id: str) -> dict:
        """`drain` in the background: the worker leaves routing now; returns at once."""
        m = self.members_.get(worker_id)
        if m is None:
            raise ValueError(f"no worker {worker_id!r}")
        if m.draining:
            raise ValueError(f"{worker_id} is already draining")
        lo = self.bounds[m.role][0]
        # Only ready workers count: one still starting cannot take this one's requests yet.
        rest = [o for o in self.members_.values()
                if o.role == m.role and o.ready and not o.draining and o is not m]  # fmt: skip
        if m.ready and len(rest) < lo:
            raise ValueError(
                f"draining {worker_id} would leave fewer ready {m.role} workers than the "
                f"minimum {lo}"
            )
        m.draining, m.since = True, time.time()
        self._spawn(self.drain(worker_id))
        return {"worker_id": worker_id, "draining": True}

    async def drain(self, worker_id: str, timeout_s: float = 120.0) -> dict:
        """Stop routing to a worker, let its work finish, stop it, forget it."""
        m = self.members_.get(worker_id)
        if m is None:
            raise ValueError(f"no worker {worker_id!r}")
        if not m.draining:
            m.draining, m.since = True, time.time()
        start = time.monotonic()
        while m.ready:  # a worker still starting has no work to finish
            if time.monotonic() - start >= timeout_s:
                logger.warning("drain of %s timed out after %.0f s", worker_id, timeout_s)
                break
            try:
                s = await asyncio.wait_for(m.actor.stats.remote(), 10.0)
            except Exception as e:  # dead or hung: nothing left to wait for
                logger.warning("drain of %s: stats failed (%r); stopping it", worker_id, e)
                break
            busy = s["num_requests_running"] + s["num_requests_waiting"] + s.get("leases", 0)
            if busy == 0:
                break
            await asyncio.sleep(0.2)
        kill_quietly(m.actor)
        if self.members_.get(worker_id) is m:
            del self.members_[worker_id]
        self._event(f"drained {worker_id} in {time.monotonic() - start:.1f} s")
        return {"worker_id": worker_id, "seconds": time.monotonic() - start}

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the health loop, the bring-ups and drains, and every worker; the tasks get
        `timeout_s` to unwind."""
        tasks = {*self._tasks, *([self._health] if self._health is not None else [])}
        for t in tasks:
            t.cancel()
        for m in self.members_.values():
            kill_quietly(m.actor)
        if not tasks:
            return
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        if pending:
            logger.warning(
                "%d controller task(s) did not stop within %.0f s", len(pending), timeout_s
            )
        health = self._health
        if health in done and not health.cancelled() and health.exception() is not None:
            logger.error("health loop had failed: %r", health.exception())  # others log own
