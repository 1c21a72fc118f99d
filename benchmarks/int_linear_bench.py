"""Benchmark of the packed-integer linear (kernels/int_linear.py) against cuBLAS on the
same weights in bf16; writes JSON.

Not a test. Llama-3-8B's four decoder GEMMs (qkv 6144x4096, o 4096x4096, gate_up
28672x4096, down 4096x14336; `--shapes qwen3_0_6b` for the small model's) with 4-bit
codes in groups of 128, at decode and prefill row counts. Each case is a CUDA graph of
`--layers` calls on as many distinct weights (so no weight is read from L2 as it would
not be in the model), replayed; reported per call: us and the weight bytes read per
second (codes, scales and zeros for int4). Each int4 row is also checked against
F.linear on the dequantized bf16 weight (max error over 2^-7 of the output scale).
`--fp8`: the same GEMMs on an FP8 checkpoint's kept bytes instead (float8_e4m3fn codes, a
scale per 128 inputs, runner/models/fp8_kept.py), rows labelled fp8_*.

    python benchmarks/int_linear_bench.py [--rows 1,16,32,64,256,2048] [--sweep] [--fp8] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import torch
import torch.nn.functional as F
from run_meta import write_result
from skinny_bench import graph_us

from pdserve.kernels.int_linear import (
    IntLinearConfig,
    choose_config,
    dequantize_int,
    dequantize_int_triton,
    fields_apply,
    int_linear_triton,
)
from pdserve.kernels.workspace import KernelWorkspace

SHAPES = {
    "llama3_8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                  "down": (4096, 14336)},
    "qwen3_0_6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                   "down": (1024, 3072)},
}  # fmt: skip
GROUP = 128
TILES = ((32, 4), (64, 4), (128, 4), (128, 8), (256, 8))  # the sweep's (outputs, warps)
BITS = 4


def packed_weights(n: int, k: int, layers: int, gen: torch.Generator, fp8: bool = False):
    out = []
    for _ in range(layers):
        if fp8:  # float8_e4m3fn bytes without NaN (0x7F / 0xFF), no zero points
            b = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int64)
            q = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8).view(torch.int32)
            s = torch.rand(n, k // GROUP, generator=gen) / (64 * k**0.5) + 1e-4
            z = torch.zeros(n, k // GROUP, dtype=torch.uint8)
        else:
            q = torch.randint(-(2**31), 2**31 - 1, (n, k * BITS // 32), generator=gen,
                              dtype=torch.int64).to(torch.int32)  # fmt: skip
            s = torch.rand(n, k // GROUP, generator=gen) / (8 * k**0.5) + 1e-4
            z = torch.randint(0, 16, (n, k // GROUP), generator=gen).to(torch.uint8)
        out.append((q.cuda(), s.cuda(), z.cuda()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="llama3_8b")
    ap.add_argument("--rows", default="1,16,32,64,256,2048")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gemms", default=None, help="a comma list of the shape's GEMMs (default all)")
    ap.add_argument("--sweep", action="store_true", help="every tile config, not just the default")
    ap.add_argument("--splits", default="1", help="split-K values the sweep takes (e.g. 1,2,4,8)")
    ap.add_argument("--words-once-only", action="store_true", help="sweep: words loaded once")
    ap.add_argument("--zero-after", action="store_true", help="also zero_after=False (A/B)")
    ap.add_argument(
        "--fields", action="store_true", help="also the fields form (with --sweep: every tile)"
    )
    ap.add_argument("--tiles", type=int, default=len(TILES), help="sweep: the first N of TILES")
    ap.add_argument("--fp8", action="store_true", help="float8 bytes (kept FP8), not int4 codes")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("int_linear_bench: needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    work = KernelWorkspace()  # split-K partials and counters, as the model's
    fp8 = args.fp8
    bits, label = (8, "fp8") if fp8 else (BITS, "int4")
    rows_out = []
    for name, (n, k) in SHAPES[args.shapes].items():
        if args.gemms and name not in args.gemms.split(","):
            continue
        packed = packed_weights(n, k, args.layers, gen, fp8)
        dense = [dequantize_int(q, s, z, bits, k, GROUP, fp8).to(torch.bfloat16)
                 for q, s, z in packed]  # fmt: skip
        int_bytes = n * k * bits // 8 + n * (k // GROUP) * 5
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense])
            base = {"gemm": name, "n": n, "k": k, "rows": m}
            rows_out.append({**base, "impl": "cublas_bf16", "us": round(us, 2),
                             "GBps": round(n * k * 2 / us / 1e3, 1)})  # fmt: skip
            configs = [None]
            if args.zero_after:  # the default tiles with the zero point on each weight
                default = choose_config(m, n, GROUP, k // GROUP, k)
                configs.append(dataclasses.replace(default, zero_after=False))
            if args.fields:  # the default tiles 128 inputs deep, tile and fields forms
                default = choose_config(m, n, GROUP, k // GROUP, k)
                configs += [dataclasses.replace(default, block_k=128, fields=f)
                            for f in (False, True)]  # fmt: skip
            if args.sweep:
                onces = (True,) if args.words_once_only else (True, False)
                splits = [int(v) for v in args.splits.split(",")]
                fields = (False, True) if args.fields else (False,)
                configs += [IntLinearConfig(bn, bk, warps, 3, bm, once, split_k=sk, fields=f)
                            for (bn, warps), bk, bm, once, sk, f in itertools.product(
                                TILES[: args.tiles], (64, 128),
                                (0,) if m <= 64 else (64, 128), onces, splits, fields)
                            if not f or (once and fields_apply(bk, bits) and not fp8)]  # fmt: skip
            deq = [lambda q=q, s=s, z=z, x=x, k=k: F.linear(
                x, dequantize_int_triton(q, s, z, bits, k, GROUP, x.dtype, fp8))
                for q, s, z in packed]  # fmt: skip
            us = graph_us(deq)
            rows_out.append({**base, "impl": f"{label}_dequant_cublas", "us": round(us, 2),
                             "GBps": round(int_bytes / us / 1e3, 1)})  # fmt: skip
            ref = F.linear(x.float(), dense[0].float())
            for cfg in configs:
                try:
                    calls = [lambda q=q, s=s, z=z, x=x, c=cfg: int_linear_triton(
                        x, q, s, z, bits, GROUP, None, c, work, fp8) for q, s, z in packed]  # fmt: skip
                    us = graph_us(calls)
                except Exception as e:  # a config past the SM's shared memory: reported
                    rows_out.append(
                        {**base, "impl": f"{label}_triton", "cfg": str(cfg), "error": str(e)[:120]}
                    )
                    continue
                y = int_linear_triton(x, *packed[0], bits, GROUP, None, cfg, work, fp8).float()
                excess = ((y - ref).abs() - 2**-7 * ref.abs().max()).max().item()
                row = {**base, "impl": f"{label}_triton", "us": round(us, 2),
                       "GBps": round(int_bytes / us / 1e3, 1),
                       "max_err_over_bound": round(max(excess, 0.0), 5)}  # fmt: skip
                if cfg is not None:
                    row["cfg"] = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.block_m,
                                  cfg.words_once, cfg.split_k, cfg.fields]  # fmt: skip
                rows_out.append(row)
                print(row, flush=True)
        del packed, dense
        torch.cuda.empty_cache()
    best = {}
    for r in rows_out:
        if r["impl"] == f"{label}_triton" and "us" in r:
            key = (r["gemm"], r["rows"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    tag = f"{args.shapes}{'_fp8' if fp8 else ''}{'_sweep' if args.sweep else ''}"
    write_result(args.out, f"int_linear_bench_{tag}",
                 "benchmarks/int_linear_bench.py", sys.argv[1:],
                 {"results": rows_out, "best": list(best.values())})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
