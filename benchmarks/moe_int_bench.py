"""Benchmark of the packed integer MoE experts (kernels/moe_int.py) on a GPU; prints and
writes JSON.

Not a test. One sparse layer's experts as 4-bit GPTQ-style stacks (group 128) against the
same experts dequantized to bf16 through kernels/moe_triton.py, at decode and prefill
sizes, for moe_bench.py's shapes. As there, each case is a CUDA graph over LAYERS distinct
layers' weights (no expert read from L2 as it would not be in the model), replayed; per
layer: us and the packed bytes of the experts the batch touches over that time.
`--sweep` times other tiles at 32 and 512 tokens (small_batch's and decode_heavy's steps),
`--forms` int_linear's other tile forms there, `--sweep-long` block sizes at 2,048 and
8,192 (prefill chunks).

    python benchmarks/moe_int_bench.py [--tokens 1,32,512,2048] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from moe_bench import LAYERS, SHAPES
from run_meta import write_result
from skinny_bench import graph_us

from pdserve.kernels.moe import route_top_k
from pdserve.kernels.moe_int import (
    IntMoeTiles,
    PackedExperts,
    choose_int_tiles,
    moe_experts_int_triton,
)
from pdserve.kernels.moe_triton import moe_experts_triton

GROUP = 128


def random_packed(experts: int, n: int, k: int, g: torch.Generator) -> PackedExperts:
    words = torch.randint(-(2**31), 2**31, (experts, n, k // 8), device="cuda", generator=g,
                          dtype=torch.int64).to(torch.int32)  # fmt: skip
    groups = k // GROUP
    scales = torch.rand(experts, n, groups, device="cuda", generator=g) * 2e-3 + 1e-3
    zeros = torch.randint(0, 16, (experts, n, groups), device="cuda", generator=g).to(torch.uint8)
    return PackedExperts(words, scales, zeros, 4, GROUP, k)


def case(shape: str, tokens: int, tiles_list: list[IntMoeTiles | None]) -> list[dict]:
    hidden, inter, experts, picks = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        (random_packed(experts, 2 * inter, hidden, g), random_packed(experts, hidden, inter, g),
         torch.randn(experts, hidden, device="cuda", generator=g).bfloat16() * 0.02)
        for _ in range(LAYERS[shape])
    ]  # fmt: skip
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    routes = [route_top_k(x @ router.T, picks, True) for _, _, router in layers]
    touched = sum(int(torch.unique(ids).numel()) for _, ids in routes) / len(routes)
    packed_bytes = 3 * hidden * inter // 2 + 3 * hidden * inter // GROUP * 5  # codes, scales, zeros
    base = {"shape": shape, "tokens": tokens, "experts_touched": round(touched, 1)}
    gu0, d0, r0 = layers[0]
    w, ids = route_top_k(x @ r0.T, picks, True)
    dense = (gu0.dequantized(torch.bfloat16), d0.dequantized(torch.bfloat16))
    want = moe_experts_triton(x, *dense, ids, w).float()
    out = []

    def timed(name: str, fn, per_layer_weights, **extra) -> None:
        try:
            got = fn(x, *per_layer_weights[0], ids, w).float()
            err = float((got - want).abs().max()) / float(want.abs().max())

            def run_all():
                for (wgu, wd), (weights, idx) in zip(per_layer_weights, routes, strict=True):
                    fn(x, wgu, wd, idx, weights)

            us = graph_us([run_all]) / len(per_layer_weights)
        except Exception as exc:  # out of shared memory, unsupported, etc.: report, go on
            out.append({**base, "impl": name, **extra, "error": str(exc)[:200]})
            return
        out.append({**base, "impl": name, **extra, "us": round(us, 2),
                    "touched_packed_GBps": round(touched * packed_bytes / us / 1e3, 1),
                    "max_rel_diff_vs_bf16_twin": round(err, 5)})  # fmt: skip
        print(json.dumps(out[-1]), flush=True)

    packed = [(gu, d) for gu, d, _ in layers]
    for tiles in tiles_list:
        timed("packed" if tiles is None else "packed_sweep",
              lambda *a, t=tiles: moe_experts_int_triton(*a, t), packed,
              tiles=None if tiles is None else list(vars(tiles).values()))  # fmt: skip
    if tiles_list == [None]:
        del packed
        twins = [dense] + [(gu.dequantized(torch.bfloat16), d.dequantized(torch.bfloat16))
                           for gu, d, _ in layers[1:]]  # fmt: skip
        timed("bf16_twin", moe_experts_triton, twins)
    return out


def sweep_tiles(num_slots: int, num_experts: int) -> list[IntMoeTiles]:
    block_m = choose_int_tiles(num_slots, num_experts).block_m
    return [
        IntMoeTiles(bn, bk, warps, stages, block_m)
        for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3, 4))
        if warps == 4 or bn == 128
    ]


def form_tiles(num_slots: int, num_experts: int) -> list[IntMoeTiles]:
    """The tile form of 128 outputs by 64 inputs and int_linear's other forms of it: words
    loaded once per code, the scale and zero after the dot, both; a dot a field of the words
    (fields: tiles of 128 inputs), with the scale after and without; the tile form at that
    depth."""
    t = IntMoeTiles(128, 64, 4, 3, choose_int_tiles(num_slots, num_experts).block_m)
    forms = [{}, {"words_once": False}, {"scale_after": True},
             {"words_once": False, "scale_after": True}, {"fields": True, "block_k": 128},
             {"fields": True, "block_k": 128, "scale_after": True}, {"block_k": 128}]  # fmt: skip
    return [IntMoeTiles(**{**vars(t), **form}) for form in forms]


def long_tiles() -> list[IntMoeTiles]:
    """Prefill-sized runs: block sizes, in the tile form and the fields form, at 4 and 8
    warps (Triton 3.6 spills the 64-slot gate/up tile of 128 outputs at 4 warps:
    sm90_resources_packed_int_triton36_*.jsonl)."""
    return [IntMoeTiles(bn, 128 if fields else 64, warps, 3, bm, fields=fields)
            for bn, bm, fields, warps in itertools.product((64, 128), (32, 64, 128),
                                                           (False, True), (4, 8))]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,512,2048")
    parser.add_argument("--shapes", default="qwen3_30b_a3b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--sweep", action="store_true", help="time other tiles at 32 and 512")
    parser.add_argument(
        "--forms", action="store_true", help="time int_linear's other forms at 32 and 512"
    )
    parser.add_argument(
        "--sweep-long", action="store_true", help="time block sizes at 2,048 and 8,192"
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = []
    for shape in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            results += case(shape, tokens, [None])
        _, _, experts, picks = SHAPES[shape]
        if args.sweep:
            for tokens in (32, 512):
                results += case(shape, tokens, sweep_tiles(tokens * picks, experts))
        if args.forms:
            for tokens in (32, 512):
                results += case(shape, tokens, form_tiles(tokens * picks, experts))
        if args.sweep_long:
            for tokens in (2048, 8192):
                results += case(shape, tokens, long_tiles())
    write_result(args.out, "moe_int_bench", "benchmarks/moe_int_bench.py", sys.argv[1:],
                 {"rows": results})  # fmt: skip


if __name__ == "__main__":
    main()
