"""Triton paged attention: varlen causal prefill and split-K decode over the paged KV cache.

`paged_attention_triton` has the signature of `attention.paged_attention_ref` (the spec)
plus an optional `num_splits` and the model's `workspace`. It checks the inputs and
launches at most two kernels, each on a grid sized from host ints only (shapes,
`max_query_len`, `max_seq_len`), so a call never syncs with the device and can be
captured in a CUDA graph:

- the prefill kernel (kernels/paged_prefill.py) for rows with two or more queries
  (prefill chunks, with or without a cached prefix), launched when `max_query_len > 1`;
- a decode kernel for rows with exactly one query: the per-head split-K kernel
  (kernels/paged_decode_split.py) by default, the packed one
  (kernels/paged_decode_packed.py) where `choose_decode_kernel` says so.

Asked for the "flat" decode kernel, an unsplit decode grid runs kernels/paged_decode_flat.py
instead of the per-head kernel: at most one program per SM, each walking the key tiles
of several (row, kv head) pairs in one loop.

A mixed step (`max_query_len > 1`) launches both paths; each kernel exits at once on the
rows that belong to the other, so no host-side split of the batch is needed.

What this module does not know: which rows are real. Pad rows (`seq_len == 0`) get zeros;
rows with no queries are left untouched. `max_seq_len` only bounds the number of decode
splits (a CUDA graph captures it as the model's limit).
"""

from __future__ import annotations

import torch
import triton

from pdserve.kernels.attention_parts import tile_for
from pdserve.kernels.fp8_kv import FORMATS as FP8_DTYPES
from pdserve.kernels.paged_decode_flat import decode_flat, flat_programs
from pdserve.kernels.paged_decode_packed import DEFAULT_CONFIG as PACKED_16BIT
from pdserve.kernels.paged_decode_packed import PackedConfig, decode_packed
from pdserve.kernels.paged_decode_split import decode_split, decode_tiles, split_plan
from pdserve.kernels.paged_prefill import prefill
from pdserve.kernels.sm_count import num_sms as _num_sms  # tests set it to size a flat grid
from pdserve.kernels.workspace import KernelWorkspace

LOG2E = 1.4426950408889634

# The packed decode kernel (kernels/paged_decode_packed.py) for fp32 or head dim 256: half
# the keys per tile, two stages.
PACKED_WIDE = PackedConfig(
    keys=32, min_split_tokens=32, target_programs=264, num_warps=4, num_stages=2
)
# Batches with fewer (row, kv head) pairs than this take the packed kernel. 0: measured on
# the H200 (decode_attention_bench.py, results/decode_attention_56e7efb.jsonl) it is slower
# than the per-head kernel at 32-256 rows (27.0 against 16.5 us a layer at 32 rows of 256
# tokens, 148.5 against 103.9 at 256 rows of 384), ahead only at 512 rows of 256 (129.7
# against 138.4), with its tile config still the unswept first guess.
PACKED_BELOW_PAIRS = 0


def decode_span(max_seq_len: int, window: int) -> int:
    """The most keys a decode row reads: at most `window` (or a chunk's), which bounds the
    splits as the context does."""
    return min(max_seq_len, abs(window)) if window else max_seq_len


def choose_decode_kernel(num_rows: int, num_kv_heads: int) -> str:
    """The packed kernel for batches of fewer (row, kv head) pairs than PACKED_BELOW_PAIRS."""
    return "packed" if num_rows * num_kv_heads < PACKED_BELOW_PAIRS else "per_head"


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] out
    max_query_len: int,
    max_seq_len: int,
    *,
    num_splits: int | None = None,  # decode splits per (row, kv head); None = heuristic
    workspace: KernelWorkspace | None = None,  # the model's; None: counters for this call
    decode_kernel: str | None = None,  # per_head | packed | flat (| per_head_prep); None: choose
    window: int = 0,  # kernels/attention.py's: > 0 sliding, < 0 chunked
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score * scale / softcap)
    sinks: torch.Tensor | None = None,  # [Hq] float32: a sink logit per query head (gpt-oss)
    row_slots: torch.Tensor | None = None,  # [R_pad] int32 each row's request slot
    max_run: int = 1,  # speculative decoding's k + 1: runs of drafted rows share K/V reads
) -> None:
    """`paged_attention_ref` on the GPU (or Triton's interpreter); see the module docstring."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, two, block_size, num_kv_heads, cache_dim = kv_cache.shape
    num_rows = query_start_loc.numel() - 1
    assert two == 2 and cache_dim == head_dim, "cache is [num_blocks, 2, block_size, Hkv, D]"
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert out.shape == q.shape and out.stride(-1) == 1 and q.stride(-1) == 1, (
        "q and out are [T, Hq, D] with unit stride on D"
    )
    assert kv_cache.is_contiguous(), "the cache is one contiguous tensor per layer"
    assert q.dtype.is_floating_point and kv_cache.dtype in (q.dtype, *FP8_DTYPES), (
        f"the cache is in q's float dtype or FP8 (got {q.dtype}, {kv_cache.dtype})"
    )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc)):
        assert t.dtype == torch.int32 and t.stride(-1) == 1, f"{name} is int32, unit stride"
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), "seq_lens is int32"
    assert scale > 0, "softmax scale must be positive (the kernels take max before scaling)"
    assert softcap >= 0, "softcap is a logit bound, 0 for none"
    assert sinks is None or (
        sinks.shape == (num_q_heads,) and sinks.dtype == torch.float32 and sinks.is_contiguous()
    ), "sinks are one float32 logit per query head"
    assert seq_lens.numel() >= num_rows and block_tables.shape[0] >= num_rows, (
        "seq_lens and block_tables hold a row for every query row"
    )
    if num_tokens == 0 or num_rows <= 0 or max_query_len <= 0:
        return

    d_pad = max(16, triton.next_power_of_2(head_dim))
    qk_scale = scale * LOG2E
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit
    # CPU tensors only reach here under TRITON_INTERPRET=1 (see attention_dot).
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16

    if max_query_len > 1:
        prefill(
            q, kv_cache, block_tables, query_start_loc, seq_lens, qk_scale, out, dot_precision,
            upcast, window, softcap, sinks,
        )  # fmt: skip

    # Decode rows (and one-query pad rows), also inside a mixed step.
    span = decode_span(max_seq_len, window)
    kernel = decode_kernel or choose_decode_kernel(num_rows, num_kv_heads)
    # the preparation fused in is the caller's (kernels/qkv_attend.py); alone it is per_head
    kernel = "per_head" if kernel == "per_head_prep" else kernel
    if kernel == "packed":
        packed_cfg = tile_for(q.dtype, d_pad, PACKED_16BIT, PACKED_WIDE)
        decode_packed(
            q, kv_cache, block_tables, query_start_loc, seq_lens, qk_scale, out, span,
            num_splits, workspace, dot_precision, upcast, packed_cfg, window, softcap, sinks,
        )  # fmt: skip
        return
    assert kernel in ("per_head", "flat"), f"unknown decode kernel {kernel!r}"
    plan = split_plan(q.dtype, d_pad, num_rows, num_kv_heads, span, num_splits)
    # Runs of drafted rows (kernels/paged_decode_split.py) where the per-head plan is unsplit
    # (graphs of >= 32 rows at 8 kv heads), full attention and no sinks; the tile is chosen
    # for the programs that do the work, one a request at full runs.
    run = max_run if (
        max_run > 1 and row_slots is not None and kernel == "per_head" and plan.num_splits == 1
        and not window and sinks is None
    ) else 1  # fmt: skip
    if run > 1:
        requests = -(-num_rows // run)
        plan = plan._replace(tile=decode_tiles(q.dtype, d_pad, requests * num_kv_heads, 1))
    # The flat kernel serves unsplit grids of at most MAX_PAIRS pairs a program; otherwise
    # the per-head kernel runs, as asked for "per_head".
    programs = None
    if kernel == "flat" and plan.num_splits == 1:
        programs = flat_programs(num_rows * num_kv_heads, _num_sms(q.device))
    if programs is not None:
        cfg = plan.tile
        decode_flat(
            q, kv_cache, block_tables, query_start_loc, seq_lens, qk_scale, out, programs,
            (cfg.block_n, cfg.num_warps, cfg.num_stages), dot_precision, upcast, window,
            softcap, sinks,
        )  # fmt: skip
        return
    decode_split(
        q, kv_cache, block_tables, query_start_loc, seq_lens, qk_scale, out, plan, workspace,
        dot_precision, upcast, window, softcap, sinks, row_slots, run,
    )  # fmt: skip
