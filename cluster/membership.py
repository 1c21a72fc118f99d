"""Keep the router's worker lists in step with the controller's membership."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter

from pdserve.cluster.ray_pool import RayWorkerHandle

logger = logging.getLogger(__name__)


def sync_members(router, members: list[dict]) -> list[str]:
    """Apply the controller's member list to the router; returns the ids of workers whose
    generation changed (restarted: their requests on the router were failed)."""
    known = {h.worker_id: h for h in [*router.decode_workers, *router.prefill_workers]}
    failed = []
    decode, prefill = [], []
    for m in members:
        h = known.get(m["worker_id"])
        if h is None:
            h = RayWorkerHandle(m["worker_id"], m["role"], m["actor"])
            h.generation = m["generation"]
        elif m["generation"] != h.generation:
            h.actor, h.generation = m["actor"], m["generation"]
            router.worker_failed(h.worker_id)
            failed.append(h.worker_id)
        if m.get("state", "ready") == "ready":  # starting and draining ones get no requests
            (decode if m["role"] == "decode" else prefill).append(h)
    router.decode_workers[:] = decode
    router.prefill_workers[:] = prefill
    router.pool_states = Counter((m["role"], m.get("state", "ready")) for m in members)
    current = {m["worker_id"] for m in members}
    for gone in [w for w in router.worker_stats if w not in current]:  # drained: no stale series
        del router.worker_stats[gone]
        router.prefix_index.forget(gone)
    router.workers_changed()  # a new worker's slots go to requests queued in the router
    return failed


async def membership_loop(controller, router, interval_s: float, announced) -> None:
    """Follow the controller: restarted workers fail their requests here and get their
    new actor; drained ones leave routing; new and restarted ones get their startup line."""
    while True:
        await asyncio.sleep(interval_s / 2)
        try:
            members = await asyncio.wait_for(controller.members.remote(), 10)
        except Exception:  # a slow or failing read must not end the loop
            logger.exception("reading pool membership failed")
            continue
        for worker_id in sync_members(router, members):
            print(f"pdserve: {worker_id} failed; restarting it", file=sys.stderr, flush=True)
        announced.update(members)
