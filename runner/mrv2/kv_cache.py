"""Allocate the paged KV cache as one tensor with the layer axis outside the block axis.

Shape `[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]` (paged GQA) or
`[num_layers, num_blocks, block_size, kv_lora_rank + rope_dim]` (MLA latents): one
allocation per worker, so a block's bytes across all layers are `num_layers` strided
chunks (few transfer descriptors, DESIGN §4). Each layer's view is `[num_blocks, ...]`.
"""

from __future__ import annotations

import math

import torch

# Host default when no budget is given: SmolLM2-135M takes 46 KB/token, so 512 MiB holds
# ~11k tokens (one full 8k context plus room). Zero-filling costs ~3.5 s/GiB of page
# faults on the 2-core CI machine, so a bigger default would slow every test start.
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
    cache = torch.zeros(num_layers, num_blocks, *block_shape, dtype=dtype, device=device)
    return cache, list(cache.unbind(0))
