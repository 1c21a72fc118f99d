"""Which GPUs a worker actor sees: its own first, then the node's others.

Ray gives each whole-GPU actor `CUDA_VISIBLE_DEVICES=<its GPU>`, so `cuda:0` is its own
GPU, which is what the engine assumes. But a process that cannot see a GPU cannot map
another process's memory on it, and the `cuda_ipc` transport between two GPUs needs
exactly that (the decode worker maps the prefill worker's KV). So, for whole-GPU workers,
`pdserve serve` asks Ray not to set the variable (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)
and each actor sets it itself before CUDA starts: its assigned GPU first (still `cuda:0`,
in every thread), then the node's other GPUs. CUDA IPC exports name their GPU by UUID, so
the differing index orders of two workers do not matter (kvtransfer/transport_cuda_ipc.py).
"""

from __future__ import annotations

import os

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NODE_GPUS_ENV = "PDSERVE_NODE_GPUS"


def node_gpu_ids(num_gpus: int) -> list[str]:
    """The GPUs this (driver) process sees, as Ray names them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()][:num_gpus]
    return [str(i) for i in range(num_gpus)]


def actor_env(node_gpus: list[str]) -> dict[str, str]:
    """Environment for whole-GPU worker actors: Ray leaves CUDA_VISIBLE_DEVICES alone and
    `bind_visible_gpus` orders it."""
    return {NOSET_ENV: "1", NODE_GPUS_ENV: ",".join(node_gpus)}


def visible_order(assigned: list[str], node: list[str]) -> list[str]:
    """The assigned GPUs first (in Ray's order), then the node's others."""
    return [*assigned, *(g for g in node if g not in assigned)]


def bind_visible_gpus() -> None:
    """In a worker actor started with `actor_env`: set CUDA_VISIBLE_DEVICES to its GPUs
    first, the node's others after. Anywhere else (tests, fractional GPUs), a no-op. Must
    run before the process first touches CUDA."""
    node = os.environ.get(NODE_GPUS_ENV)
    if not node:
        return
    import ray

    assigned = [str(g) for g in ray.get_gpu_ids()]
    if not assigned:
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_order(assigned, node.split(",")))
