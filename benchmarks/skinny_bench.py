"""Benchmark of the skinny linear (kernels/skinny_linear.py) against cuBLAS; prints JSON.

Not a test. The four decoder GEMMs of the Qwen3-0.6B shape (qkv 4096x1024, o 1024x2048,
gate_up 6144x1024, down 1024x3072) in bf16, at decode batch sizes. Each case is a CUDA
graph of 28 calls on 28 distinct weights (one per layer, 0.9 GB in all, so no weight is
read from the 50 MB L2 as it would not be in the model), replayed; reported per call: us
and the weight bytes read per second. Every Triton config is also checked against
F.linear (max error over the bf16 rounding bound) and for bitwise repeatability.

    python benchmarks/skinny_bench.py [--sweep] [--rows 1,8,16,32,64] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
from run_meta import git_commit

from pdserve.kernels import skinny_linear as sl
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.workspace import KernelWorkspace

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
SILU = {"gate_up_silu": "gate_up"}  # SiLU-and-mul as the gate/up projection's epilogue
LAYERS = 28


def graph_us(calls, reps: int = 20) -> float:
    for fn in calls:  # compile and size workspaces outside the graph
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def check(x, w, cfg, ws, silu: bool) -> dict:
    ref = F.linear(x.float(), w.float())
    ref = silu_and_mul(ref) if silu else ref
    y1 = sl.skinny_linear_triton(x, w, None, ws, silu, cfg)
    y2 = sl.skinny_linear_triton(x, w, None, ws, silu, cfg)
    # bf16 keeps 8 significant bits: a correctly rounded fp32 sum is within 2^-8 relative.
    excess = ((y1.float() - ref).abs() - ref.abs() * 2**-8).max().item()
    return {"max_err_over_bound": round(excess, 5), "repeatable": bool(torch.equal(y1, y2))}


def bench_shape(
    name: str, rows: int, configs: list[sl.SkinnyConfig | None], echo: bool = False
) -> list[dict]:
    """One GEMM at one row count: cuBLAS, then each config (None: choose_config's). With
    `echo` each case is printed as it completes (a long sweep cut by a timeout keeps its
    finished cases)."""
    silu = name in SILU
    n, k = SHAPES[SILU.get(name, name)]
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        for _ in range(LAYERS)
    ]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    mb = n * k * 2 / 1e6
    # With SILU the cuBLAS column is the unfused pair: the GEMM, then a silu_and_mul launch.
    cublas = graph_us([lambda w=w: (silu_and_mul if silu else _same)(F.linear(x, w)) for w in ws])
    out = [{"gemm": name, "rows": rows, "impl": "cublas", "us": round(cublas, 2),
            "GBps": round(mb * 1e3 / cublas, 1)}]  # fmt: skip
    work = KernelWorkspace()
    for cfg in configs:
        chosen = cfg or sl.choose_config(n // 2 if silu else n, k, silu)
        try:
            ok = check(x, ws[0], chosen, work, silu)
            us = graph_us(
                [
                    lambda w=w, c=chosen: sl.skinny_linear_triton(x, w, None, work, silu, c)
                    for w in ws
                ]
            )
        except Exception as exc:  # out of shared memory etc.: report, go on
            out.append(
                {
                    "gemm": name,
                    "rows": rows,
                    "cfg": list(vars(chosen).values()),
                    "error": str(exc)[:200],
                }
            )
            continue
        out.append({
            "gemm": name, "rows": rows, "impl": "skinny" if cfg else "skinny_default",
            "cfg": list(vars(chosen).values()), "us": round(us, 2), "GBps": round(mb * 1e3 / us, 1),
            "vs_cublas": round(cublas / us, 3), **ok,
        })  # fmt: skip
        if echo:
            print("sweep", json.dumps(out[-1]), flush=True)
    return out


def _same(y: torch.Tensor) -> torch.Tensor:
    return y


def sweep_configs() -> list[sl.SkinnyConfig]:
    return [
        sl.SkinnyConfig(bn, bk, split, warps, stages)
        for bn, bk, split, warps, stages in itertools.product(
            (16, 32, 64), (64, 128, 256), (1, 2, 3, 4, 8), (4,), (3, 4)
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time alternative tiles at 32 rows")
    parser.add_argument("--rows", default="1,8,16,32,64")
    parser.add_argument("--gemms", default=",".join([*SHAPES, *SILU]), help="which to sweep")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in [*SHAPES, *SILU]:
            results += bench_shape(name, rows, [None])
    if args.sweep:
        for name in args.gemms.split(","):
            results += bench_shape(name, 32, sweep_configs(), echo=True)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "commit": git_commit(),
           "command": " ".join(["benchmarks/skinny_bench.py", *sys.argv[1:]]), "results": results}  # fmt: skip
    for r in results:  # one line per case; the JSON holds the same
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
