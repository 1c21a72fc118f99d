"""Benchmark of the MoE experts (kernels/moe_triton.py) on a GPU; prints and writes JSON.

Not a test. One sparse layer's experts (routing, slot alignment, gate/up with SiLU, down,
the weighted sum) at decode and prefill sizes, in bf16, for two shapes:
  qwen3_30b_a3b: hidden 2048, 128 experts of intermediate 768, 8 picks
  mixtral_8x7b:  hidden 4096, 8 experts of intermediate 14336, 2 picks
Each case is a CUDA graph over LAYERS distinct layers' weights (so no expert is read from
L2 as it would not be in the model), replayed; reported per layer: us, the bytes of the
experts the batch touches over that time, and the floor max(touched bytes / 4.28 TB/s,
FLOPs / 789 TFLOP/s) (the H200's measured ceilings, ../shared/GPU.md). Peers at the same
sizes: torch's `F.grouped_mm` on the same aligned slots (CUTLASS on sm90; bf16 only) and,
eagerly, the reference loop (`moe_experts_ref`, which syncs once a layer).
Routing is from random router logits: near-uniform, so about min(E, T*k) experts are hit.

    python benchmarks/moe_bench.py [--tokens 1,8,32,128,512,2048,8192] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F
from run_meta import write_result
from skinny_bench import graph_us

from pdserve.kernels.moe import moe_experts_ref, route_top_k
from pdserve.kernels.moe_triton import MoeTiles, choose_tiles, moe_experts_triton

SHAPES = {  # hidden, intermediate, experts, picks
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "mixtral_8x7b": (4096, 14336, 8, 2),
    # intermediate sizes between those two, for kernels/moe_grouped.py's rule (--shapes)
    "olmoe_1b_7b": (2048, 1024, 64, 8),
    "deepseek_v2_lite": (2048, 1408, 64, 6),
    "phi3_5_moe": (4096, 6400, 16, 2),
    "llama4_scout": (5120, 8192, 16, 1),
}
DEFAULT_SHAPES = ("qwen3_30b_a3b", "mixtral_8x7b")
# ~9.7 / 5.6 / 6.4 / 8.9 / 10.1 / 8.1 GB of experts
LAYERS = {
    "qwen3_30b_a3b": 8, "mixtral_8x7b": 2, "olmoe_1b_7b": 8, "deepseek_v2_lite": 8,
    "phi3_5_moe": 2, "llama4_scout": 2,
}  # fmt: skip
HBM_BPS, TFLOPS = 4.28e12, 789e12


def grouped_mm_experts(x, w_gate_up, w_down, ids, weights):
    """The same function with torch's grouped GEMM over expert-sorted slots."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w_gate_up.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // top_k]
    gate_up = F.grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)
    inter = w_down.shape[2]
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = F.grouped_mm(h, w_down.transpose(1, 2), offs=offs)
    y = (y.float() * weights.reshape(-1)[order, None]).to(x.dtype)
    terms = torch.empty_like(y)
    terms[order] = y
    return terms.view(num_tokens, top_k, -1).sum(dim=1)


def case(shape: str, tokens: int, tiles_list: list[MoeTiles | None], peers: bool) -> list[dict]:
    hidden, inter, experts, picks = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        (
            torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g).bfloat16() * 0.02,
            torch.randn(experts, hidden, inter, device="cuda", generator=g).bfloat16() * 0.02,
            torch.randn(experts, hidden, device="cuda", generator=g).bfloat16() * 0.02,
        )
        for _ in range(LAYERS[shape])
    ]
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    routes = [route_top_k(x @ router.T, picks, True) for _, _, router in layers]
    touched = sum(int(torch.unique(ids).numel()) for _, ids in routes) / len(routes)
    expert_bytes = 3 * hidden * inter * 2
    floor_us = max(touched * expert_bytes / HBM_BPS, 6 * tokens * picks * hidden * inter / TFLOPS)
    floor_us *= 1e6
    base = {"shape": shape, "tokens": tokens, "experts_touched": round(touched, 1),
            "floor_us": round(floor_us, 2)}  # fmt: skip
    w0, d0, r0 = layers[0]
    w, ids = route_top_k(x @ r0.T, picks, True)
    want = moe_experts_ref(x, w0, d0, ids, w).float()
    bound = 4 * float(want.abs().max()) * 2**-7
    out = []

    def timed(name: str, fn, **extra) -> None:
        try:
            err = float((fn(x, w0, d0, ids, w).float() - want).abs().max())

            def run_all():
                for wgu, wd, router in layers:
                    weights, idx = route_top_k(x @ router.T, picks, True)
                    fn(x, wgu, wd, idx, weights)

            us = graph_us([run_all]) / len(layers)
        except Exception as exc:  # out of shared memory, unsupported, etc.: report, go on
            out.append({**base, "impl": name, **extra, "error": str(exc)[:200]})
            return
        out.append({
            **base, "impl": name, **extra, "us": round(us, 2),
            "touched_GBps": round(touched * expert_bytes / us / 1e3, 1),
            "vs_floor": round(floor_us / us, 3), "max_err_over_bound": round(err - bound, 5),
        })  # fmt: skip
        print(json.dumps(out[-1]), flush=True)

    for tiles in tiles_list:
        chosen = tiles or choose_tiles(tokens * picks, experts, torch.bfloat16)
        timed(
            "triton" if tiles is None else "triton_sweep",
            lambda *a, t=chosen: moe_experts_triton(*a, t),
            tiles=list(vars(chosen).values()),
        )
    if peers:
        timed("grouped_mm", grouped_mm_experts)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for wgu, wd, router in layers:
            weights, idx = route_top_k(x @ router.T, picks, True)
            moe_experts_ref(x, wgu, wd, idx, weights)
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) * 1e6 / len(layers)
        out.append({**base, "impl": "reference_loop_eager", "us": round(us, 2)})
        print(json.dumps(out[-1]), flush=True)
    return out


def sweep_tiles() -> list[MoeTiles]:
    return [
        MoeTiles(bm, bn, bk, warps, stages)
        for bm, bn, bk, warps, stages in itertools.product(
            (16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    parser.add_argument(
        "--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}"
    )
    parser.add_argument("--sweep", action="store_true", help="time other tiles at 32 and 2048")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = []
    for shape in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            results += case(shape, tokens, [None], peers=True)
        if args.sweep:
            for tokens in (32, 2048):
                results += case(shape, tokens, sweep_tiles(), peers=False)
    write_result(args.out, "moe_bench", "benchmarks/moe_bench.py", sys.argv[1:], {"rows": results})


if __name__ == "__main__":
    main()
