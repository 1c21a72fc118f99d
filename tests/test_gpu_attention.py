"""CUDA-only checks of the Triton paged attention (`kernels/paged_attention_triton.py`):
dispatch of CUDA tensors to the Triton kernels, no host syncs and CUDA-graph replay, and
cache offsets past int32. conftest does not collect this module without a GPU; the parity
tests, their batch builder and tolerances live in `test_paged_attention_triton.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_paged_attention_triton import DECODE_KERNELS, DEVICE, MIXED, PAD, check, make_batch

from pdserve.kernels.attention import paged_attention
from pdserve.kernels.paged_attention_triton import paged_attention_triton


def test_dispatch_cuda_runs_triton():
    """Guards the dispatch in `paged_attention`: CUDA tensors run the Triton kernels."""
    batch = make_batch(MIXED, 16, 8, 128, 16, dtype=torch.bfloat16)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(
        batch.q, batch.cache, batch.tables, batch.qsl, batch.seq_lens, batch.scale, out,
        batch.max_query_len, batch.max_seq_len,
    )  # fmt: skip
    assert torch.equal(out, batch.run_triton())


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_no_host_sync_and_cuda_graph_replay(kernel):
    """Guards capturability: the launcher never syncs (no .item()/.tolist() on the device),
    and a captured graph replayed on new seq_lens and block tables (same host bounds) gives
    the new answer, i.e. no grid size or split count was baked in from device data."""
    rows = [(2000, 1)] * 8 + [PAD] * 8
    batch = make_batch(rows, 16, 8, 128, 16, dtype=torch.bfloat16)
    out = torch.zeros_like(batch.q)
    args = (batch.q, batch.cache, batch.tables, batch.qsl, batch.seq_lens, batch.scale, out)
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_attention_triton(*args, 1, 2048, decode_kernel=kernel)  # warms up (compiles)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(*args, 1, 2048, decode_kernel=kernel)
    new_lens = torch.tensor([2000, 1, 700, 1999, 256, 257, 0, 1500] + [0] * 9, dtype=torch.int32)
    batch.seq_lens.copy_(new_lens)
    batch.tables[:8] = batch.tables[:8].flip(0).clone()
    batch.rows = [(int(c), 1) for c in new_lens[:-1]]
    graph.replay()
    torch.cuda.synchronize()
    check(batch, out)


def test_cache_offsets_past_int32():
    """Guards int64 cache offsets: blocks whose element offset exceeds 2^31 (a large cache)
    must be read where they are, not at a wrapped-around address."""
    hk, d, bs = 1, 128, 16
    small = make_batch([(300, 1), (200, 50), PAD], 4, hk, d, bs, dtype=torch.bfloat16)
    n = small.cache.shape[0]
    num_blocks = 2**31 // (2 * bs * hk * d) + n  # 4 GiB of bf16; ids >= 2^31 / block size
    cache = torch.full(
        (num_blocks, 2, bs, hk, d), float("nan"), dtype=torch.bfloat16, device=DEVICE
    )
    shift = num_blocks - n  # block b of the small cache lives at b + shift
    cache[shift + 1 :] = small.cache[1:]
    big = dataclasses.replace(
        small, cache=cache, tables=torch.where(small.tables > 0, small.tables + shift, 0)
    )
    check(small, big.run_triton())
