"""CUDA-only checks of MLA's device path: no host sync in the latent write and attention
(the async step loop would stall every layer), a CUDA-graph replay that follows new
contexts written into the captured buffers (the decode graph replays one capture for
every step), and DeepSeek-V2-Lite's widths (16 heads, r 512, rope 64, bf16) against the
reference. conftest does not collect this module without a GPU; the interpreter-size
parity is in `test_mla.py`.
"""

from __future__ import annotations

import torch
from test_mla import _mla_batch

from pdserve.kernels.mla_attention import (
    paged_mla_attention,
    paged_mla_attention_ref,
    write_latent,
)

LITE = (16, 512, 64, 16)  # heads, kv_lora_rank, rope, block size


def _decode_batch(seed: int):
    heads, rank, rope, bs = LITE
    rows = [(ctx, 1) for ctx in (1, 17, 300, 1000, 64, 2047, 5, 128)]
    return _mla_batch(heads, rank, rope, bs, rows, torch.bfloat16, seed)


def _step(q, cache, tables, qsl, seq_lens, out, latent, slots):
    write_latent(latent, cache, slots)
    paged_mla_attention(q, cache, tables, qsl, seq_lens, 0.1, LITE[1], out, 1)


def _buffers():
    q, cache, tables, qsl, seq_lens = _decode_batch(0)
    out = torch.empty(q.shape[0], LITE[0], LITE[1], dtype=q.dtype, device="cuda")
    latent = torch.randn(q.shape[0], LITE[1] + LITE[2], device="cuda").bfloat16()
    slots = torch.full((q.shape[0],), -1, dtype=torch.int64, device="cuda")
    return q, cache, tables, qsl, seq_lens, out, latent, slots


def test_mla_kernels_never_sync_with_the_host():
    bufs = _buffers()
    _step(*bufs)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(*bufs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_mla_replays_new_contexts_in_a_cuda_graph_at_lite_widths():
    """Guards contexts baked in at capture: after capture, other rows' lengths, tables and
    queries are copied into the same buffers, and the replay must match the reference at
    DeepSeek-V2-Lite's widths (bf16: both accumulate in fp32 and round once at the end)."""
    q, cache, tables, qsl, seq_lens, out, latent, slots = bufs = _buffers()
    _step(*bufs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(*bufs)
    q2, cache2, tables2, _, lens2 = _decode_batch(1)
    for dst, src in ((q, q2), (tables, tables2), (seq_lens, lens2)):
        dst.copy_(src)
    cache.copy_(cache2)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros_like(out)
    paged_mla_attention_ref(q, cache, tables, qsl, seq_lens, 0.1, LITE[1], want)
    scale = float(want.float().abs().max())
    assert float((out.float() - want.float()).abs().max()) <= 4 * scale * 2**-7
