"""Resetting the prefix caches of a running server (`POST /ops/reset_prefix_cache`, also
at vLLM's `POST /reset_prefix_cache`): for benchmarks that must start cold, or after the
cached prefixes stopped being worth their blocks.

Every worker forgets its cached prefixes between two of its steps, the KV tier drops its
blocks, and the router forgets what it knew each reset worker to hold (its prefix-aware
routing would otherwise send requests after prefixes that are gone). A worker with
requests holding blocks refuses, changing nothing, as vLLM's engine does: its answer says
`busy`, and the reset can be asked again once it is idle. Each worker is asked at once and
waited for at most RESET_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
from typing import Any

RESET_TIMEOUT_S = 10.0


async def reset_prefix_caches(router: Any) -> dict[str, Any]:
    """-> {"reset": every worker reset, "workers": {worker id: "reset" | "busy" | "error:
    ..."}, "tier": "cleared" | "none" | "error: ..."}."""
    workers = [*router.decode_workers, *router.prefill_workers]

    async def ask(worker) -> str:
        try:
            done = await asyncio.wait_for(worker.reset_prefix_cache(), RESET_TIMEOUT_S)
        except Exception as e:  # a dead or slow worker: said, not raised
            return f"error: {e!r}"
        if done:
            router.prefix_index.forget(worker.worker_id)
            return "reset"
        return "busy"

    async def clear_tier() -> str:
        if router.tier is None:
            return "none"
        try:
            await asyncio.wait_for(router.tier.clear.remote(), RESET_TIMEOUT_S)
        except Exception as e:
            return f"error: {e!r}"
        return "cleared"

    *answers, tier = await asyncio.gather(*(ask(w) for w in workers), clear_tier())
    by_worker = {w.worker_id: a for w, a in zip(workers, answers, strict=True)}
    return {
        "reset": all(a == "reset" for a in answers) and not tier.startswith("error"),
        "workers": by_worker,
        "tier": tier,
    }
