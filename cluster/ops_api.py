"""Operator endpoints: the pools' state, scaling, draining, the prefix-cache reset and the
dashboard page.

    GET  /ops/pools   every worker of each pool with its state, load and health, the
                      pools' bounds, latency since start, routing decisions, recent events
    POST /ops/scale   {"role": "decode" | "prefill", "replicas": N}
    POST /ops/drain   {"worker_id": "decode-1"}
    POST /ops/reset_prefix_cache   every worker, the KV tier and the router forget their
                      cached prefixes (cluster/prefix_reset.py); also vLLM's
                      POST /reset_prefix_cache
    GET  /dashboard   the page that shows /ops/pools and drives the POSTs above

Reads are open, like /metrics. The POSTs change the cluster, so they need the admin key
(`--admin-key`, Bearer) when one is set; without one they are allowed only when the
server listens on a loopback address, so the default local run can scale from its
dashboard and an exposed server cannot be resized by whoever reaches it; they also take
only application/json bodies, so another site's page cannot resize a local server
through the browser. The API key of /v1 does not open them: a client of the API is not
an operator.
"""

from __future__ import annotations

import ipaddress
import secrets
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from pdserve.cluster.autoscale import ROLES
from pdserve.cluster.http_app import json_object, read_body
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.pool_control import PoolControl
from pdserve.cluster.prefix_reset import reset_prefix_caches
from pdserve.cluster.ray_pool import worker_index

MAX_OPS_BODY = 4096
# Worker stats the page shows, as the worker reports them.
_WORKER_KEYS = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "num_free_blocks", "num_blocks", "prefix_cache_queries", "prefix_cache_hits",
    "num_preemptions", "leases", "transfer_bytes", "recompute_fallbacks", "error",
    "kernel_compiles", "execution_path",
)  # fmt: skip


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OpsState:
    def __init__(
        self, control: PoolControl, admin_key: str | None, listen_host: str,
        autoscaler: Any | None = None,
    ) -> None:  # fmt: skip
        self.control, self.admin_key = control, admin_key
        self.open_without_key = is_loopback(listen_host)
        self.autoscaler = autoscaler  # cluster/autoscale.py's Autoscaler, when on
        self.started = time.time()


def check_admin(ops: OpsState, request: Request) -> None:
    """Admin key, or a loopback listener without one. A JSON content type is required as
    well: a page of another site can send a plain-text POST to a local server without
    asking it first (no CORS preflight), but not an application/json one."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(f"Content-Type must be application/json, got {ctype or 'none'!r}", 415)
    if ops.admin_key is None:
        if not ops.open_without_key:
            raise ApiError(
                "the operator's POSTs (scaling, draining, the prefix-cache reset) are off on "
                "a non-loopback address without an admin key; start the server with "
                "--admin-key (or PDSERVE_ADMIN_KEY)",
                403, "permission_error",
            )  # fmt: skip
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given, f"Bearer {ops.admin_key}"):
        raise ApiError(
            "missing or wrong admin key", 401, "authentication_error", None, "invalid_admin_key"
        )


def pools_view(
    members: list[dict], controller_stats: dict, router: Any, metrics: Any, ops: OpsState
) -> dict:
    """The JSON of GET /ops/pools (no actor handles: plain data only)."""
    pools: dict[str, dict] = {}
    bounds = controller_stats.get("bounds", {})
    for role in ROLES:
        lo, hi = bounds.get(role, (0, 0))
        pools[role] = {"bounds": [lo, hi], "workers": [], "ready": 0, "starting": 0,
                       "draining": 0}  # fmt: skip
    # Requests waiting in the router for a decode slot (cluster/decode_admission.py), and
    # the slots a decode worker has (0: no limit).
    pools["decode"]["queued"] = router.queued()
    pools["decode"]["slots_per_worker"] = router.config.decode_capacity
    for m in sorted(members, key=lambda m: (m["role"], worker_index(m["worker_id"]))):
        stats = router.worker_stats.get(m["worker_id"], {})
        health = m.get("health") or {}
        load = router.load_of(m["worker_id"])
        worker = {
            "worker_id": m["worker_id"],
            "state": m["state"],
            "since": m["since"],
            "generation": m["generation"],
            "inflight": load["inflight"],
            "alive": health.get("alive"),
            "steps": health.get("steps"),
            "since_progress_s": health.get("since_progress_s"),
            "startup": m.get("startup"),  # cluster/startup_report.py, once it is up
            **{k: stats[k] for k in _WORKER_KEYS if k in stats},
        }
        if m["role"] == "prefill":
            worker["prompt_tokens_in_flight"] = load["prompt_tokens_in_flight"]
        pool = pools[m["role"]]
        pool["workers"].append(worker)
        pool[m["state"]] += 1
    return {
        "time": time.time(),
        "uptime_s": time.time() - ops.started,
        "mode": router.config.mode,
        "pools": pools,
        "restarts": controller_stats.get("restarts", 0),
        "events": controller_stats.get("events", []),
        "decisions": dict(router.decisions),
        "latency": metrics.latency_summary(),
        "totals": metrics.totals(),
        "tier": {k: v for k, v in router.tier_stats.items() if isinstance(v, int | float | str)},
        "autoscale": ops.autoscaler.view() if ops.autoscaler is not None else {"enabled": False},
        "admin_key_required": ops.admin_key is not None,
        "scaling_open": ops.admin_key is not None or ops.open_without_key,
    }


def add_ops_routes(app: FastAPI, ops: OpsState, router: Any, metrics: Any) -> None:
    page = resources.files("pdserve.cluster").joinpath("dashboard.html").read_text()

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/ops/pools")
    async def pools() -> dict:
        await router.poll_stats()
        members = await ops.control.members()
        stats = await ops.control.stats()
        return pools_view(members, stats, router, metrics, ops)

    @app.post("/ops/scale")
    async def scale(request: Request) -> dict:
        check_admin(ops, request)
        body = json_object(await read_body(request, MAX_OPS_BODY))
        role, replicas = body.get("role"), body.get("replicas")
        if role not in ROLES:
            raise ApiError(f"'role' must be one of {list(ROLES)}", param="role")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ApiError("'replicas' must be an integer", param="replicas")
        return await ops.control.scale(role, replicas)

    @app.post("/ops/drain")
    async def drain(request: Request) -> dict:
        check_admin(ops, request)
        body = json_object(await read_body(request, MAX_OPS_BODY))
        worker_id = body.get("worker_id")
        if not isinstance(worker_id, str):
            raise ApiError("'worker_id' must be a string", param="worker_id")
        return await ops.control.drain(worker_id)

    @app.post("/ops/reset_prefix_cache")
    @app.post("/reset_prefix_cache")  # vLLM's path (its dev mode's; here the admin's)
    async def reset_prefix_cache(request: Request) -> dict:
        check_admin(ops, request)
        return await reset_prefix_caches(router)
