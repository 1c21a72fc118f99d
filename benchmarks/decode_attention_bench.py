"""Decode attention as a decode step runs it: one call per layer over that layer's own cache.

    python benchmarks/decode_attention_bench.py [--layers 28] [--sweep] [--sweep-per-head]
        [--sweep-long] [--sweep-deep] [--sweep-groups] [--no-cases] [--kernels per_head,packed,flat] \
        [--layouts nhd,hnd,h2nd [--block-sizes 16,64]] [--out DIR]

Not a test. attention_bench.py replays one call over one cache, so a cache under the L2's
50 MB (32 rows x 256 tokens is 34 MB) is read from L2 and looks fast. Here each of
`--layers` calls reads its own cache (Qwen3-0.6B shape: 16 q / 8 kv heads, head dim 128,
bf16, block size 16, blocks shuffled), captured as one CUDA graph with max_seq_len at the
model's 4,096 limit, as the engine's decode graph runs it; the time per call is the
replay's over the layers. The decode kernels named in `--kernels` (`per_head`, `packed`;
`flat`, the per-head kernel with one program per SM walking several pairs, is not in the
default list) at batch sizes 32 to 512; `--sweep` also times the packed kernel's tile and split settings at 32 rows, and
`--sweep-per-head` the per-head kernel's tiles (keys, warps, stages) at 1-8 slices per
context for 32 and 64 rows, `--sweep-long` a few of them at long contexts and big batches
with up to 16 slices, `--sweep-groups` the packed kernel with a program per group of 1, 2
or 4 kv heads at 32 rows (`--no-cases`: the sweeps alone; `--kernels per_head`: one kernel in
the cases). `--layouts` times the per-head kernel at 32 rows over caches whose blocks store
the same values in another order (LAYOUTS: heads outside tokens, or each head's K and V
together; the kernel reads any strides), at each of `--block-sizes`. Prints
one JSON object per line, and writes them to `<out>/decode_attention_<commit>.jsonl`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import git_commit  # noqa: E402

from pdserve.kernels import paged_attention_triton as pat  # noqa: E402
from pdserve.kernels import paged_decode_split as pds  # noqa: E402
from pdserve.kernels.attention_parts import TileConfig  # noqa: E402
from pdserve.kernels.paged_decode_packed import PackedConfig  # noqa: E402
from pdserve.kernels.workspace import KernelWorkspace  # noqa: E402

HQ, HKV, D, BS, LIMIT = 16, 8, 128, 16, 4096
KV_BYTES_PER_TOKEN = 2 * HKV * D * 2  # one layer's K and V


# --layouts: the order a block's bytes lie in. The kernels take the cache's strides, so a
# layout is a view with the engine's [block, 2, token, kv head, D] shape over another order.
LAYOUTS = {  # a block's storage order (dims of [2, tokens, kv heads, D]), its view's order
    "nhd": ((0, 1, 2, 3), (0, 1, 2, 3, 4)),  # the engine's: tokens outer, heads inner
    "hnd": ((0, 2, 1, 3), (0, 1, 3, 2, 4)),  # K/V outer, a head's tokens contiguous
    "h2nd": ((2, 0, 1, 3), (0, 2, 3, 1, 4)),  # a head's K then V contiguous
}


def layer_inputs(
    batch: int, ctx: int, layers: int, seed: int = 0, layout: str = "nhd", bs: int = BS
) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = math.ceil(ctx / bs)
    out = []
    dims, order = LAYOUTS[layout]
    for _ in range(layers):
        cache = torch.randn(1 + batch * nb, 2, bs, HKV, D, device="cuda", generator=g)
        cache = cache.to(torch.bfloat16)
        if layout != "nhd":  # the same values, stored in the other order
            shape = [(2, bs, HKV, D)[i] for i in dims]
            stored = torch.empty(1 + batch * nb, *shape, dtype=cache.dtype, device="cuda")
            cache = stored.permute(*order).copy_(cache)
        perm = (torch.randperm(batch * nb, device="cuda", generator=g) + 1).int()
        q = torch.randn(batch, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
        out.append(
            dict(
                q=q,
                kv_cache=cache,
                block_tables=perm.view(batch, nb).contiguous(),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
                scale=D**-0.5,
                out=torch.empty_like(q),
                max_query_len=1,
                max_seq_len=LIMIT,
            )  # fmt: skip
        )
    return out


def time_per_layer_us(inputs: list[dict], replays: int = 30, **kw) -> float:
    ws = KernelWorkspace()

    def step() -> None:
        for inp in inputs:
            pat.paged_attention_triton(**inp, workspace=ws, **kw)

    return graph_time_us(step, len(inputs), replays)


def time_split_per_layer_us(
    inputs: list[dict], replays: int = 30, tile: TileConfig | None = None
) -> float:
    """The per-head kernel through `decode_split` (which takes any cache strides), as
    `paged_attention_triton` plans it for a full-attention decode batch."""
    ws = KernelWorkspace()

    def step() -> None:
        for inp in inputs:
            q = inp["q"]
            plan = pds.split_plan(q.dtype, D, q.shape[0], HKV, LIMIT, None)
            plan = plan if tile is None else plan._replace(tile=tile)
            pds.decode_split(
                q, inp["kv_cache"], inp["block_tables"], inp["query_start_loc"],
                inp["seq_lens"], inp["scale"] * pat.LOG2E, inp["out"], plan, ws, "tf32", False,
            )  # fmt: skip

    return graph_time_us(step, len(inputs), replays)


def graph_time_us(step, layers: int, replays: int = 30) -> float:
    """`step` captured as one CUDA graph: the median replay's µs over `layers` calls."""
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / layers


def row(batch: int, ctx: int, kernel: str, us: float, **extra) -> dict:
    gbps = batch * ctx * KV_BYTES_PER_TOKEN / us / 1e3
    return {
        "batch": batch, "ctx": ctx, "kernel": kernel, "us_per_layer": round(us, 2),
        "kv_GBps": round(gbps, 1), **extra,
    }  # fmt: skip


# --sweep-per-head: short contexts, every tile; --sweep-long: long contexts and big batches,
# the few tiles that won the short sweep, more slices.
SHORT_SWEEP = (
    ((32, 256), (32, 384), (32, 512), (64, 384)),
    list(itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4, 5))),
    (1, 2, 3, 4, 6, 8),
)
# Deeper pipelines: with the block-id load feeding the K/V loads, Triton 3.6 gives the K/V
# tiles 2 buffers at 5-6 stages, 3 at 7, 4 at 9 (benchmarks/sm90_resources.py).
DEEP_SWEEP = (
    ((32, 256), (32, 384), (32, 512)),
    list(itertools.product((64,), (2, 4), (5, 7, 9))),
    (1,),
)
LONG_SWEEP = (
    ((8, 1024), (8, 4096), (32, 1024), (32, 2048), (32, 4096), (128, 384), (256, 384), (512, 256)),
    [(64, 2, 5), (64, 2, 4), (64, 2, 3), (64, 4, 3), (32, 4, 5), (64, 2, 6)],
    (1, 2, 4, 8, 16),
)


def sweep_per_head(layers: int, emit, cases, tiles, splits_list) -> None:
    """The per-head kernel's tile (keys a loop step, warps, pipeline stages) against the
    number of slices each row's context is cut into (explicit num_splits: every row takes
    them all), where the engine's heuristic only sets how many."""
    base = pds._DECODE_16BIT, pds._DECODE_16BIT_FEW
    for batch, ctx in cases:
        inputs = layer_inputs(batch, ctx, layers)
        for block_n, warps, stages in tiles:
            tile = TileConfig(0, block_n, warps, stages)
            pds._DECODE_16BIT = pds._DECODE_16BIT_FEW = tile
            for splits in splits_list:
                if splits * block_n > ctx:
                    continue
                cfg = [block_n, warps, stages, splits]
                try:
                    us = time_per_layer_us(inputs, 20, decode_kernel="per_head", num_splits=splits)
                    emit(row(batch, ctx, "per_head", us, cfg=cfg))
                except Exception as e:  # out of shared memory etc.: report, go on
                    emit({"batch": batch, "ctx": ctx, "cfg": cfg, "error": str(e)[:200]})
        del inputs
    pds._DECODE_16BIT, pds._DECODE_16BIT_FEW = base


def sweep_groups(layers: int, emit) -> None:
    """The packed kernel with a program per (row, slice, group of kv heads) at 32 rows:
    group size against its tile, stages and split target (whether one wave of programs
    that each stream a head pair beats the per-head kernel's two waves)."""
    base = pat.PACKED_16BIT
    for ctx in (384, 256, 512):
        inputs = layer_inputs(32, ctx, layers)
        emit(row(32, ctx, "per_head", time_per_layer_us(inputs, 20, decode_kernel="per_head")))
        grid = itertools.product((1, 2, 4), (32, 64, 128), (3, 4, 5), (128, 264))
        if ctx != 384:  # the other contexts: group sizes at the short sweep's likely tiles
            grid = itertools.product((1, 2, 4), (64,), (4, 5), (128,))
        for heads, keys, stages, target in grid:
            cfg = PackedConfig(keys, 32, target, 4, stages, heads)
            pat.PACKED_16BIT = cfg
            try:
                us = time_per_layer_us(inputs, 20, decode_kernel="packed")
                emit(row(32, ctx, "packed", us, cfg=list(cfg)))
            except Exception as e:  # out of shared memory etc.: report, go on
                emit({"batch": 32, "ctx": ctx, "cfg": list(cfg), "error": str(e)[:200]})
        del inputs
    pat.PACKED_16BIT = base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-per-head", action="store_true")
    ap.add_argument("--sweep-long", action="store_true")
    ap.add_argument("--sweep-deep", action="store_true", help="5 / 7 / 9 stages at 32 rows")
    ap.add_argument(
        "--sweep-groups",
        action="store_true",
        help="the packed kernel with a program per group of 1/2/4 kv heads at 32 rows",
    )
    ap.add_argument("--kernels", default="per_head,packed")
    ap.add_argument(
        "--layouts",
        default="",
        help="e.g. nhd,hnd,h2nd: the per-head kernel over each cache layout (LAYOUTS), 32 rows",
    )
    ap.add_argument("--block-sizes", default="16", help="with --layouts: e.g. 16,64")
    ap.add_argument("--no-cases", action="store_true", help="only the sweeps")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    commit = git_commit()
    rows = []

    def emit(r: dict) -> None:
        r["commit"] = commit
        rows.append(r)
        print(json.dumps(r), flush=True)

    cases = [(32, 256), (32, 384), (32, 512), (64, 384), (128, 384), (256, 384), (512, 256)]
    for batch, ctx in [] if args.no_cases else cases:
        inputs = layer_inputs(batch, ctx, args.layers)
        for kernel in args.kernels.split(","):
            emit(row(batch, ctx, kernel, time_per_layer_us(inputs, decode_kernel=kernel)))
        del inputs
    sizes = [int(b) for b in args.block_sizes.split(",")]
    variants = list(itertools.product(args.layouts.split(","), sizes)) if args.layouts else []
    for ctx in (256, 384, 512) if variants else ():
        for i, (layout, bs) in enumerate(variants * 2):  # twice, interleaved
            inputs = layer_inputs(32, ctx, args.layers, layout=layout, bs=bs)
            us = time_split_per_layer_us(inputs)
            emit(row(32, ctx, "per_head", us, layout=layout, block_size=bs))
            if ctx == 384 and i < len(variants):  # a few unsplit tiles (keys, warps, stages)
                for block_n, warps, stages in itertools.product((16, 32, 64), (2, 4), (3, 5)):
                    tile = TileConfig(0, block_n, warps, stages)
                    us = time_split_per_layer_us(inputs, 20, tile)
                    cfg = [block_n, warps, stages]
                    emit(row(32, ctx, "per_head", us, layout=layout, block_size=bs, cfg=cfg))
            del inputs
    if args.sweep:
        base = pat.PACKED_16BIT  # what paged_attention_triton reads for 16-bit inputs
        for ctx in (256, 384, 512):
            inputs = layer_inputs(32, ctx, args.layers)
            for keys, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
                for min_tokens, target in itertools.product((16, 32, 64), (132, 264, 528)):
                    cfg = PackedConfig(keys, min_tokens, target, warps, stages)
                    pat.PACKED_16BIT = cfg
                    try:
                        us = time_per_layer_us(inputs, decode_kernel="packed")
                        emit(row(32, ctx, "packed", us, cfg=list(cfg)))
                    except Exception as e:  # out of shared memory etc.: report, go on
                        emit({"batch": 32, "ctx": ctx, "cfg": list(cfg), "error": str(e)[:200]})
            del inputs
        pat.PACKED_16BIT = base
    if args.sweep_groups:
        sweep_groups(args.layers, emit)
    if args.sweep_per_head:
        sweep_per_head(args.layers, emit, *SHORT_SWEEP)
    if args.sweep_long:
        sweep_per_head(args.layers, emit, *LONG_SWEEP)
    if args.sweep_deep:
        sweep_per_head(args.layers, emit, *DEEP_SWEEP)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"decode_attention_{commit[:7]}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
