"""What `pdserve serve` sizes for its workers before any starts: each local worker's KV
cache budget, and the tokens of an engine step when the flags leave it to the server.

A KV budget is checked against what the workers share (one GPU's memory beside their
weights and activation reserves, or this machine's memory for CPU workers), so a size
that cannot fit is a clear error before Ray starts instead of a worker killed mid-start.
Workers on a joined cluster size their own caches from their own GPUs: nothing here
applies to them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.cluster.serve_args import ServeConfig
from pdserve.cluster.serve_placement import Placement

ACTIVATION_RESERVE_BYTES = 2 << 30  # per worker: activations, graphs, sampler buffers


def _gpu_and_weight_bytes(model_dir: Path) -> tuple[int, int]:
    """GPU 0's memory and one worker's weights (their files' size)."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    return total, sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def kv_bytes_per_worker(model_dir: Path, num_workers: int, utilization: float) -> int:
    """Each worker's KV cache budget on one shared GPU: its share of `utilization` of the
    GPU's memory, less the weights (their file size) and an activation reserve."""
    total, weights = _gpu_and_weight_bytes(model_dir)
    budget = int(total * utilization / num_workers) - weights - ACTIVATION_RESERVE_BYTES
    if budget <= 0:
        raise ValueError(
            f"{num_workers} workers do not fit on one GPU of {total / 2**30:.0f} GiB with "
            f"{weights / 2**30:.1f} GiB of weights each; use fewer workers"
        )
    return budget


def check_kv_bytes_fit(model_dir: Path, num_workers: int, kv_bytes: int) -> None:
    """Refuse an explicit per-worker KV size that `num_workers` workers on one GPU cannot
    all allocate beside their weights and activation reserves."""
    total, weights = _gpu_and_weight_bytes(model_dir)
    need = num_workers * (kv_bytes + weights + ACTIVATION_RESERVE_BYTES)
    if need > total:
        raise ValueError(
            f"--kv-cache-memory-bytes {kv_bytes:,}: {num_workers} worker(s) on one GPU need "
            f"{need / 2**30:.1f} GiB with their weights ({weights / 2**30:.1f} GiB each) and "
            f"activation reserve ({ACTIVATION_RESERVE_BYTES / 2**30:.0f} GiB each); the GPU "
            f"has {total / 2**30:.1f} GiB"
        )


def check_kv_bytes_in_ram(num_workers: int, kv_bytes: int) -> None:
    """Refuse CPU workers' explicit KV sizes that this machine's memory cannot hold (the
    kernel would kill a worker mid-start instead)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_workers * kv_bytes > ram:
        raise ValueError(
            f"--kv-cache-memory-bytes {kv_bytes:,}: {num_workers} CPU worker(s) need "
            f"{num_workers * kv_bytes / 2**30:.1f} GiB of KV cache; this machine has "
            f"{ram / 2**30:.1f} GiB of memory"
        )


def local_kv_bytes(
    cfg: ServeConfig, model_dir: Path, local: Placement, num_workers: int
) -> int | None:
    """Each local worker's KV budget, checked against what it shares: the explicit
    `--kv-cache-memory-bytes` if it fits, on a GPU otherwise the worker's share of the
    memory fraction (a fraction read by each engine at its own start would count the
    others' allocations); None on the CPU without an explicit size (the engine's default)."""
    if cfg.kv_cache_memory_bytes is not None:
        if local.num_gpus:
            check_kv_bytes_fit(model_dir, local.workers_per_gpu, cfg.kv_cache_memory_bytes)
        else:
            check_kv_bytes_in_ram(num_workers, cfg.kv_cache_memory_bytes)
        return cfg.kv_cache_memory_bytes
    if local.num_gpus:
        return kv_bytes_per_worker(model_dir, local.workers_per_gpu, cfg.gpu_memory_utilization)
    return None


def default_batched_tokens(cfg: ServeConfig, ecfg) -> int:
    """vLLM's server default: 8,192 tokens per step on GPUs of >= 70 GiB (an H200 measured
    well with it: benchmarks/pd_vs_colocated.py), 2,048 elsewhere and on the CPU; without
    chunked prefill at least max_model_len, so that every prompt fits a step."""
    import torch

    if not ecfg.runner.device.startswith("cuda"):
        budget = 2048
    else:
        big = torch.cuda.get_device_properties(0).total_memory >= 70 * 2**30
        budget = 8192 if big else 2048
    if not cfg.enable_chunked_prefill:
        budget = max(budget, ecfg.model.max_model_len)
    return budget
