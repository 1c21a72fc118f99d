"""Benchmark of the Triton paged attention at the Qwen3-0.6B shape; prints JSON.

Not a test. Shapes: 16 q heads, 8 kv heads, head_dim 128, bf16, block size 16, blocks
shuffled over the cache. Reported per case:

- decode (one query per row, split-K): GB/s of K/V bytes read (`rows * ctx * Hkv * D * 2
  tensors * 2 B`) over time, and the fraction of the H200's 4.28 TB/s read+write copy rate;
- prefill (fresh causal prompts, or a chunk after a cached prefix): TFLOP/s counting the
  causal half only (`4 * Hq * D * sum over queries of visible keys`), and the fraction of
  the ~790 TFLOP/s bf16 GEMM rate; torch's dense SDPA (flash) on the same prompts, unpaged,
  is printed beside it as the bar for a tensor-core kernel;
- mixed: one 2048-token prompt with 255 decode rows, as chunked prefill schedules them.

Times are CUDA-graph replays (`triton.testing.do_bench_cudagraph`), so launch overhead is
excluded as it is in the engine's graphed decode. `--sweep` also times alternative tile
configs by patching the kernel modules' constants, to choose them on the real GPU.

    python benchmarks/attention_bench.py [--sweep decode|prefill|all] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.testing

from pdserve.kernels import paged_attention_triton as pat
from pdserve.kernels import paged_decode_split as pds
from pdserve.kernels import paged_prefill as ppf
from pdserve.kernels.attention_parts import TileConfig

HQ, HKV, D, BS = 16, 8, 128, 16
DTYPE = torch.bfloat16
HBM_BYTES_PER_S = 4.28e12
BF16_FLOPS = 790e12


def make_inputs(rows: list[tuple[int, int]], seed: int = 0) -> dict:
    """rows: (context length, query length); queries are the last q_len positions."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [math.ceil(ctx / BS) for ctx, _ in rows]
    num_blocks = 1 + sum(blocks)
    cache = torch.randn(num_blocks, 2, BS, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    perm = (torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1).int()
    tables = torch.zeros(len(rows), max(blocks), dtype=torch.int32, device="cuda")
    cursor = 0
    for r, nb in enumerate(blocks):
        tables[r, :nb] = perm[cursor : cursor + nb]
        cursor += nb
    qlens = torch.tensor([q for _, q in rows])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)]).int().cuda()
    seq_lens = torch.tensor([c for c, _ in rows], dtype=torch.int32, device="cuda")
    q = torch.randn(int(qlens.sum()), HQ, D, device="cuda", dtype=DTYPE, generator=g)
    return dict(
        q=q, kv_cache=cache, block_tables=tables, query_start_loc=qsl, seq_lens=seq_lens,
        scale=D**-0.5, out=torch.empty_like(q), max_query_len=int(qlens.max()),
        max_seq_len=max(c for c, _ in rows),
    )  # fmt: skip


def time_ms(fn) -> float:
    fn()  # compile outside the graph
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200)


def bench_decode(batch: int, ctx: int) -> dict:
    inp = make_inputs([(ctx, 1)] * batch)
    ms = time_ms(lambda: pat.paged_attention_triton(**inp))
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    gbs = kv_bytes / ms / 1e6
    return {
        "case": "decode", "batch": batch, "ctx": ctx, "ms": round(ms, 4),
        "splits": pds.decode_num_splits(batch, HKV, ctx), "kv_GBps": round(gbs, 1),
        "frac_hbm": round(gbs * 1e9 / HBM_BYTES_PER_S, 3),
    }  # fmt: skip


def bench_decode_in_graph(batch: int, ctx: int, limit: int = 4096) -> list[dict]:
    """Decode as a CUDA graph runs it: max_seq_len fixed at the model's limit, not the live
    context; one row per `MIN_SPLIT_KEYS` candidate (each row slices its own context)."""
    inp = make_inputs([(ctx, 1)] * batch)
    inp["max_seq_len"] = limit
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    base, rows = pds.MIN_SPLIT_KEYS, []
    for min_keys in (64, 128, 256, 512):
        pds.MIN_SPLIT_KEYS = min_keys
        ms = time_ms(lambda: pat.paged_attention_triton(**inp))
        rows.append({
            "case": "decode_graph", "batch": batch, "ctx": ctx, "limit": limit,
            "min_split_keys": min_keys, "splits": pds.decode_num_splits(batch, HKV, limit),
            "ms": round(ms, 4), "kv_GBps": round(kv_bytes / ms / 1e6, 1),
        })  # fmt: skip
    pds.MIN_SPLIT_KEYS = base
    return rows


def causal_flops(rows: list[tuple[int, int]]) -> float:
    # Query i of a row (position ctx - q + i) sees ctx - q + i + 1 keys; QK^T and PV: 4*D each.
    keys = sum(q * (ctx - q) + q * (q + 1) / 2 for ctx, q in rows)
    return 4.0 * HQ * D * keys


def bench_prefill(num_prompts: int, prompt: int, prefix: int = 0, with_sdpa: bool = True) -> dict:
    rows = [(prefix + prompt, prompt)] * num_prompts
    inp = make_inputs(rows)
    ms = time_ms(lambda: pat.paged_attention_triton(**inp))
    tflops = causal_flops(rows) / ms / 1e9
    res = {
        "case": "prefill", "prompts": num_prompts, "q_len": prompt, "prefix": prefix,
        "ms": round(ms, 4), "TFLOPs": round(tflops, 1), "frac_peak": round(tflops / 790, 3),
    }  # fmt: skip
    if with_sdpa and prefix == 0:  # dense flash SDPA on the same prompts: the tensor-core bar
        q = torch.randn(num_prompts, HQ, prompt, D, device="cuda", dtype=DTYPE)
        k = torch.randn(num_prompts, HKV, prompt, D, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        try:
            res["sdpa_TFLOPs"] = round(causal_flops(rows) / time_ms(sdpa) / 1e9, 1)
        except RuntimeError as exc:  # GQA flash may be missing from a torch build
            res["sdpa_error"] = str(exc)[:200]
    return res


def bench_mixed(prompt: int = 2048, decodes: int = 255, ctx: int = 1024) -> dict:
    rows = [(prompt, prompt)] + [(ctx, 1)] * decodes
    inp = make_inputs(rows)
    ms = time_ms(lambda: pat.paged_attention_triton(**inp))
    return {"case": "mixed", "prompt": prompt, "decodes": decodes, "ctx": ctx, "ms": round(ms, 4)}


def sweep(which: str) -> list[dict]:
    """Alternative tile configs, one module constant at a time (restored afterwards)."""
    results = []
    base_decode, base_prefill = pds._DECODE_16BIT, ppf._PREFILL_16BIT
    for block_n in (32, 64, 128) if which in ("decode", "all") else ():
        for warps in (4, 8):
            for stages in (2, 3, 4):
                pds._DECODE_16BIT = TileConfig(0, block_n, warps, stages)
                for batch, ctx in ((256, 2048), (512, 256), (32, 2048)):
                    try:
                        r = bench_decode(batch, ctx)
                    except Exception as exc:  # out of shared memory etc.: report, go on
                        r = {"case": "decode", "error": str(exc)[:200]}
                    results.append({**r, "cfg": list(pds._DECODE_16BIT)})
    pds._DECODE_16BIT = base_decode
    for block_m in (64, 128) if which in ("prefill", "all") else ():
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    ppf._PREFILL_16BIT = TileConfig(block_m, block_n, warps, stages)
                    try:
                        r = bench_prefill(8, 2048, with_sdpa=False)
                    except Exception as exc:
                        r = {"case": "prefill", "error": str(exc)[:200]}
                    results.append({**r, "cfg": list(ppf._PREFILL_16BIT)})
    ppf._PREFILL_16BIT = base_prefill
    return results


def sweep_small_batch() -> list[dict]:
    """Decode tiles x minimum split length at 32 rows, as the small_batch graph runs them
    (max_seq_len at the model's 4,096 limit): the in-kernel split merge changed the cost
    of a split, so the 256-key minimum chosen with a reduce launch is re-measured."""
    results = []
    base_cfg, base_keys = pds._DECODE_16BIT, pds.MIN_SPLIT_KEYS
    for block_n, warps, stages in itertools.product((32, 64), (4, 8), (2, 3, 4)):
        pds._DECODE_16BIT = TileConfig(0, block_n, warps, stages)
        for min_keys in (64, 128, 256):
            pds.MIN_SPLIT_KEYS = min_keys
            for ctx in (256, 384, 512):
                inp = make_inputs([(ctx, 1)] * 32)
                inp["max_seq_len"] = 4096
                ms = time_ms(lambda inp=inp: pat.paged_attention_triton(**inp))
                results.append({
                    "case": "decode_small", "ctx": ctx, "cfg": [block_n, warps, stages],
                    "min_split_keys": min_keys, "us": round(ms * 1e3, 2),
                })  # fmt: skip
    pds._DECODE_16BIT, pds.MIN_SPLIT_KEYS = base_cfg, base_keys
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sweep", choices=("decode", "prefill", "all"), help="also time alternative tiles"
    )
    parser.add_argument("--small-batch", action="store_true", help="only the 32-row sweep")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.small_batch:
        for r in sweep_small_batch():
            print(json.dumps(r))
        return
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "block_size": BS, "dtype": "bf16"},
        "config": {"decode": list(pds._DECODE_16BIT), "prefill": list(ppf._PREFILL_16BIT)},
        "decode": [bench_decode(b, c) for b in (1, 32, 256, 512) for c in (256, 1024, 2048)],
        "prefill": [
            bench_prefill(1, 2048),
            bench_prefill(8, 2048),
            bench_prefill(4, 512, prefix=1536),
        ],
        "mixed": [bench_mixed()],
        "decode_graph": [
            r for b, c in ((32, 384), (128, 2112), (512, 384)) for r in bench_decode_in_graph(b, c)
        ],
    }
    if args.sweep:
        results["sweep"] = sweep(args.sweep)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
