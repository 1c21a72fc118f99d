"""Where `pdserve serve` runs its pools: a Ray instance of its own, or a running cluster.

Local (the default): Ray starts here with this machine's GPUs; workers take whole GPUs
where there are enough, else equal shares of them, and bind their sockets to 127.0.0.1.

Joined (`--ray-address`, as in the Helm chart's head pod): the GPUs are the cluster's,
each worker takes whole GPUs (or none), every socket binds to its own node's address,
and with `--pool-resources` each worker asks for its pool's custom resource so the
cluster's node groups decide where it runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.serve_args import ServeConfig

POOL_RESOURCES = {"prefill": "pdserve_prefill", "decode": "pdserve_decode", "tier": "pdserve_tier"}
_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# A Ray of our own starts no idle Python workers: by default its raylet starts one a CPU
# when the first driver connects (two on a 2-core machine, sixteen on a 16-core GPU host),
# each ~80 MB and a Ray import of CPU, and none of them ever runs an actor here (every
# actor asks for a process of its own, with the job's environment).
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


@dataclass(frozen=True)
class Placement:
    joined: bool  # a running cluster, not a Ray of our own
    num_gpus: int  # GPUs the pools may use
    gpus_per_worker: float
    host: str  # the driver's address: what its sockets bind to and advertise
    workers_per_gpu: int  # local only: workers sharing one GPU (their KV budgets split it)


def _per_worker(cfg: ServeConfig, num_gpus: int, num_workers: int) -> float:
    if cfg.gpus_per_worker is not None:
        return cfg.gpus_per_worker
    return min(1.0, num_gpus / num_workers) if num_gpus else 0.0


def local_placement(cfg: ServeConfig, local_gpus: int, num_workers: int) -> Placement:
    """Where the workers of a Ray of our own go, known before it starts (so that sizes
    that cannot fit are refused before it does). `local_gpus`: this machine's GPUs the
    workers may use (0 on the CPU)."""
    per = _per_worker(cfg, local_gpus, num_workers)
    if local_gpus and per <= 0:
        raise ValueError("--gpus-per-worker 0 on a GPU machine: use --device cpu instead")
    shared = -(-num_workers // local_gpus) if local_gpus and per < 1 else 1
    return Placement(False, local_gpus, per, "127.0.0.1", shared)


def start_ray(cfg: ServeConfig, local: Placement | None) -> Placement:
    """`ray.init` for this run and where its workers go: `local` (from `local_placement`)
    for a Ray of our own, None to join `cfg.ray_address`. Every refusal comes before Ray
    starts."""
    import ray

    if local is not None:
        assert cfg.ray_address is None, "a local placement is for a Ray of our own"
        ray.init(
            include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
            num_gpus=local.num_gpus, runtime_env={"env_vars": dict(_ENV)},
            _system_config=LOCAL_RAY_SYSTEM_CONFIG,
        )  # fmt: skip
        return local
    if cfg.gpus_per_worker is not None and 0 < cfg.gpus_per_worker < 1:
        raise ValueError(
            "with --ray-address each worker takes whole GPUs or none (--gpus-per-worker "
            f"{cfg.gpus_per_worker}): workers sharing a GPU need the budgets a local run "
            "splits for them"
        )
    ray.init(
        address=cfg.ray_address, logging_level=logging.WARNING, log_to_driver=True,
        runtime_env={"env_vars": dict(_ENV)},
    )  # fmt: skip
    gpus = 0 if cfg.device == "cpu" else int(ray.cluster_resources().get("GPU", 0))
    per = cfg.gpus_per_worker if cfg.gpus_per_worker is not None else (1.0 if gpus else 0.0)
    return Placement(True, gpus, per, ray.util.get_node_ip_address(), 1)


def join_auth_env(cfg: ServeConfig, env) -> None:
    """Before Ray is imported (it reads its auth mode then): a cluster with token
    authentication (Ray 2.60's `ray start` turns it on when no mode is set, as seen here
    and on the H200) refuses a driver whose mode is unset, since a joining driver does not
    turn it on by itself; with a token at hand and no mode chosen, use it."""
    if cfg.ray_address is not None and "RAY_AUTH_MODE" not in env and ray_token_available(env):
        env["RAY_AUTH_MODE"] = "token"


def ray_token_available(env) -> bool:
    """Whether Ray's auth token is set or on disk where Ray looks for it."""
    if env.get("RAY_AUTH_TOKEN"):
        return True
    path = env.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).is_file()


def pool_bounds(cfg: ServeConfig, placement: Placement) -> dict[str, tuple[int, int]]:
    """The sizes `scale` (and the autoscaler) may give each pool. Local workers sharing a
    GPU got KV budgets for the count they started with, so those pools stay that size."""
    bounds = {
        "decode": (cfg.min_decode_workers, cfg.max_decode_workers),
        "prefill": (max(1, cfg.min_prefill_workers), cfg.max_prefill_workers),
    }
    if cfg.mode == "colocated":
        bounds["prefill"] = (0, 0)
    if not placement.joined and placement.num_gpus and placement.gpus_per_worker < 1:
        bounds["decode"] = (cfg.decode_workers, cfg.decode_workers)
        if cfg.mode == "pd":
            bounds["prefill"] = (cfg.prefill_workers, cfg.prefill_workers)
    # The pools start at their configured size even where it lies outside the bounds.
    lo, hi = bounds["decode"]
    bounds["decode"] = (min(lo, cfg.decode_workers), max(hi, cfg.decode_workers))
    if cfg.mode == "pd":
        lo, hi = bounds["prefill"]
        bounds["prefill"] = (min(lo, cfg.prefill_workers), max(hi, cfg.prefill_workers))
    return bounds


def actor_resources(pool_resources: bool, role: str) -> dict[str, float]:
    """The custom Ray resources a `role` actor asks for (none unless --pool-resources)."""
    return {POOL_RESOURCES[role]: 1.0} if pool_resources else {}


def kv_transport(cfg: ServeConfig, local_gpu: bool) -> str:
    """`--kv-transport auto`: cuda_ipc when Ray runs here and the workers sit on this node's
    GPUs (the pull is a device copy, ~1,400 GB/s on one H200 against ~1.5 GB/s over tcp
    loopback), else tcp (CPU workers, a joined cluster whose pools may be on other nodes,
    layer-wise streaming, or colocated mode, which moves no KV). A named transport is kept."""
    if cfg.kv_transport != "auto":
        return cfg.kv_transport
    if local_gpu and cfg.mode == "pd" and not cfg.kv_layer_wise:
        return "cuda_ipc"
    return "tcp"
