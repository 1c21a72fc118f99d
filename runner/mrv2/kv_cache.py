"""Allocate the paged KV cache as one tensor with the layer axis outside the block axis.

Shape `[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]` (paged GQA) or
`[num_layers, num_blocks, block_size, kv_lora_rank + rope_dim]` (MLA latents): one
allocation per worker, so a block's bytes across all layers are `num_layers` strided
chunks (few transfer descriptors, DESIGN §4). Each layer's view is `[num_blocks, ...]`.
"""

from __future__ import annotations

import math
import mmap

import torch

# Host default when no budget is given: SmolLM2-135M takes 46 KB/token, so 512 MiB holds
# ~11k tokens (one full 8k context plus room). A host cache's pages are the OS's zero
# pages until first written (`host_zeros`), so the size costs no start-up time.
DEFAULT_CPU_KV_BYTES = 512 << 20
# Activation/workspace headroom kept free on a GPU beyond the model and the cache.
GPU_ACTIVATION_RESERVE_BYTES = 4 << 30


def block_bytes(num_layers: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, for one layer's block of `block_shape` (the
    model's `kv_block_shape`: paged GQA's `[2, bs, H, D]` or MLA's `[bs, r + rope]`)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * math.prod(block_shape) * elem


def choose_num_blocks(
    per_block: int,
    device: torch.device,
    budget: int | None,
    gpu_memory_utilization: float,
    max_useful_blocks: int,
) -> int:
    """Blocks that fit the budget, capped at what max_num_seqs full-length requests can use."""
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            budget = int(total * gpu_memory_utilization) - used - GPU_ACTIVATION_RESERVE_BYTES
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num_blocks = min(budget // per_block, max_useful_blocks + 1)  # +1: the null block
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) does not hold one block of "
            f"{per_block} bytes; raise kv_cache_memory_bytes or "
            "gpu_memory_utilization, or lower max_model_len"
        )
    return int(num_blocks)


def allocate_blocks(
    num_layers: int,
    num_blocks: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`[num_layers, num_blocks, *block_shape]` zeros and its per-layer views."""
    shape = (num_layers, num_blocks, *block_shape)
    if device.type == "cpu":
        cache = host_zeros(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return cache, list(cache.unbind(0))


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host zeros in an anonymous mapping: the kernel hands out a zeroed page where one is
    first written, so only the blocks a worker uses ever take memory. `torch.zeros` wrote
    every page up front: 0.5 GiB took 0.3-10 s of page faults per worker start on the
    2-core dev machine (the second of two workers starting at once the slowest)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping (its buffer export) until the tensor itself is freed.
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
