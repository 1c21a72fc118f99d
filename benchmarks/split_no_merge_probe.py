"""How fast could split decode attention be if its merge moved out of the kernel?

    python benchmarks/split_no_merge_probe.py [--layers 28] [--out DIR]

Not a test, and not a kernel the engine runs. A probe for #3 (small_batch TPOT): the
per-head decode kernel at 32 rows of 256-512 tokens reads its K/V at ~3 TB/s with one
program per (row, kv head), and cutting contexts into slices (more programs in flight)
loses to the in-kernel merge (`decode_attention_sweep_short_56e7efb.jsonl`: 18.9 µs a
layer at 2 slices against 16.7 unsplit at 384 tokens). Here a copy of the decode loop
writes each slice's normalised output (bf16) and log-sum-exp and stops: no arrival
counter, no merge. If that is much faster than the unsplit kernel, the merge could ride
on the o projection's input load instead. Times are per layer over `--layers` distinct
caches in one CUDA graph, as decode_attention_bench.py measures them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from decode_attention_bench import (  # noqa: E402
    HKV,
    HQ,
    D,
    graph_time_us,
    layer_inputs,
    row,
    time_per_layer_us,
)
from run_meta import git_commit  # noqa: E402

from pdserve.kernels import paged_attention_triton as pat  # noqa: E402
from pdserve.kernels.attention_parts import attend_tile, decode_slice  # noqa: E402


@triton.jit
def _slices_kernel(
    q_ptr, kv_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, qk_scale,
    num_splits, num_rows, stride_bt, stride_cb, stride_ckv, stride_ct, stride_ch,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start, seq_len, split_len, key_start, key_end, skip = decode_slice(
        qsl_ptr, seq_lens_ptr, row, split, BLOCK_N, num_splits, BLOCK_N, False, 0
    )
    if skip:
        return
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * (GROUP * HEAD_DIM * tl.num_programs(1))
        + heads[:, None] * HEAD_DIM + offs_d[None, :],
        mask=g_mask[:, None], other=0.0,
    )  # fmt: skip
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt
    for n0 in range(key_start, key_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, offs_g, kv_ptr, bt_row_ptr, kv_head * stride_ch, n0, key_end,
            offs_n, offs_d, d_mask, stride_cb, stride_ckv, stride_ct, qk_scale,
            BLOCK_SIZE, True, False, 0, 0.0, "tf32", UPCAST_DOT,
        )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    # [split, row, Hq, D]: the layout an o projection would read its x slices in.
    base = (split * num_rows + row).to(tl.int64) * (GROUP * tl.num_programs(1)) + heads
    tl.store(
        part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :],
        o.to(tl.bfloat16),
        mask=g_mask[:, None],
    )
    tl.store(part_lse_ptr + base, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _o_proj_kernel(
    x_ptr,  # [M, K] bf16 (X_SLICES == 1) or [X_SLICES, M, K] normalised slice outputs
    lse_ptr,  # [X_SLICES, M, K // HEAD_DIM] fp32, log2 domain (X_SLICES > 1)
    w_ptr, out_ptr, part_ptr, count_ptr, num_rows, n, k, k_per_split,
    X_SLICES: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_K: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # A minimal split-K skinny projection (no bias, residual or squares), so that the two
    # x forms differ only in their loads: BLOCK_K == HEAD_DIM, a K step is one head.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    k_start = pid_k * k_per_split
    heads = k // HEAD_DIM
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for step in range(k_per_split // BLOCK_K):
        k0 = k_start + step * BLOCK_K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * k + (k0 + offs_k)[None, :])
        x_off = offs_m[:, None].to(tl.int64) * k + (k0 + offs_k)[None, :]
        if X_SLICES == 1:
            xs = tl.load(x_ptr + x_off, mask=m_mask[:, None], other=0.0)
        else:
            head = k0 // HEAD_DIM
            m = tl.full([M_PAD], float("-inf"), tl.float32)
            for s in tl.static_range(X_SLICES):
                lse = tl.load(lse_ptr + (s * num_rows + offs_m) * heads + head, mask=m_mask,
                              other=0.0)  # fmt: skip
                m = tl.maximum(m, lse)
            den = tl.zeros([M_PAD], tl.float32)
            xf = tl.zeros([M_PAD, BLOCK_K], tl.float32)
            for s in tl.static_range(X_SLICES):
                lse = tl.load(lse_ptr + (s * num_rows + offs_m) * heads + head, mask=m_mask,
                              other=0.0)  # fmt: skip
                wgt = tl.exp2(lse - m)
                den += wgt
                xv = tl.load(x_ptr + s * num_rows * k + x_off, mask=m_mask[:, None], other=0.0)
                xf += wgt[:, None] * xv.to(tl.float32)
            xs = (xf / den[:, None]).to(w.dtype)
        acc = tl.dot(w, tl.trans(xs), acc)
    tile = offs_m[None, :].to(tl.int64) * n + offs_n[:, None]
    tl.store(part_ptr + pid_k * M_PAD * n + tile, acc)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") != SPLIT_K - 1:
        return
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * M_PAD * n + tile, cache_modifier=".cg")
    tl.store(count_ptr + pid_n, 0)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * n + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :])


def chain_us(inputs: list[dict], splits: int, tile: tuple[int, int, int]) -> float:
    """Attention then the o projection, per layer over the layers: `splits == 1` the
    engine's unsplit kernel and a plain x load; more, the slices kernel and the merge in
    the projection's x load."""
    from pdserve.kernels.workspace import KernelWorkspace

    block_n, warps, stages = tile
    batch = inputs[0]["q"].shape[0]
    n, k = 1024, HQ * D
    g = torch.Generator(device="cuda").manual_seed(1)
    weights = [
        (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in inputs
    ]
    part_o = torch.empty(max(splits, 1), batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    part_lse = torch.empty(max(splits, 1), batch, HQ, dtype=torch.float32, device="cuda")
    proj_part = torch.empty(4 * 32 * n, dtype=torch.float32, device="cuda")
    counters = torch.zeros(n // 32, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, n, dtype=torch.bfloat16, device="cuda")
    ws = KernelWorkspace()

    def step() -> None:
        for inp, w in zip(inputs, weights):
            if splits == 1:
                pat.paged_attention_triton(**inp, workspace=ws)
                x, lse = inp["out"], inp["out"]
            else:
                cache = inp["kv_cache"]
                _slices_kernel[(batch, HKV, splits)](
                    inp["q"], cache, inp["block_tables"], inp["query_start_loc"],
                    inp["seq_lens"], part_o, part_lse, inp["scale"] * pat.LOG2E, splits, batch,
                    inp["block_tables"].stride(0), cache.stride(0), cache.stride(1),
                    cache.stride(2), cache.stride(3), GROUP=HQ // HKV, GROUP_PAD=16,
                    HEAD_DIM=D, BLOCK_SIZE=cache.shape[2], BLOCK_N=block_n, UPCAST_DOT=False,
                    num_warps=warps, num_stages=stages,
                )  # fmt: skip
                x, lse = part_o, part_lse
            _o_proj_kernel[(n // 32, 4)](
                x, lse, w, out, proj_part, counters, batch, n, k, k // 4, X_SLICES=splits,
                HEAD_DIM=D, SPLIT_K=4, M_PAD=32, BLOCK_N=32, BLOCK_K=128,
                num_warps=4, num_stages=4,
            )  # fmt: skip

    return graph_time_us(step, len(inputs))


def time_slices_us(inputs: list[dict], splits: int, tile: tuple[int, int, int]) -> float:
    block_n, warps, stages = tile
    batch = inputs[0]["q"].shape[0]
    part_o = torch.empty(splits, batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    part_lse = torch.empty(splits, batch, HQ, dtype=torch.float32, device="cuda")

    def call(inp: dict) -> None:
        cache = inp["kv_cache"]
        _slices_kernel[(batch, HKV, splits)](
            inp["q"], cache, inp["block_tables"], inp["query_start_loc"], inp["seq_lens"],
            part_o, part_lse, inp["scale"] * pat.LOG2E, splits, batch,
            inp["block_tables"].stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
            cache.stride(3), GROUP=HQ // HKV, GROUP_PAD=16, HEAD_DIM=D, BLOCK_SIZE=cache.shape[2],
            BLOCK_N=block_n, UPCAST_DOT=False, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    def step() -> None:
        for inp in inputs:
            call(inp)

    return graph_time_us(step, len(inputs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    commit = git_commit()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"split_no_merge_probe_{commit[:7]}.jsonl"
    with path.open("w") as f:

        def emit(r: dict) -> None:
            r["commit"] = commit
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")

        tiles = list(itertools.product((32, 64), (2, 4), (3, 4, 5)))
        for ctx in (256, 384, 512):
            inputs = layer_inputs(32, ctx, args.layers)
            for splits in (1, 2):
                us = time_per_layer_us(inputs, num_splits=splits)
                emit(row(32, ctx, "per_head_engine", us, splits=splits))
            for splits in (1, 2, 3, 4):
                for tile in tiles:
                    try:
                        us = time_slices_us(inputs, splits, tile)
                        emit(row(32, ctx, "slices_no_merge", us, splits=splits, tile=tile))
                    except Exception as e:  # a tile that does not fit: noted, not fatal
                        emit({"ctx": ctx, "splits": splits, "tile": tile, "error": str(e)[:200]})
            for splits in (1, 2, 3, 4):
                for tile in ((64, 2, 5), (64, 2, 4), (32, 2, 4), (32, 4, 3), (64, 4, 3)):
                    us = chain_us(inputs, splits, tile)
                    emit(row(32, ctx, "attention_then_o", us, splits=splits, tile=tile))
                    if splits == 1:
                        break  # the engine's kernel: its tile is its own


if __name__ == "__main__":
    main()
