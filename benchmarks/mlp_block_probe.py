"""The decode layer's o / gate-up / down as one persistent launch (kernels/mlp_block.py)
against the three skinny-linear launches it replaces; prints JSON lines.

Not a test. Qwen3-0.6B shapes in bf16 (o 1024x2048, gate/up 6144x1024, down 1024x3072),
32 rows, 28 distinct layers in one CUDA graph (no weight read from L2), replayed; reported
per layer: us. Each config's final residual stream and row squares are compared bitwise
with the chain's (the same tiles, so they must match).

    python benchmarks/mlp_block_probe.py [--rows 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from run_meta import device_kind, git_commit
from skinny_bench import graph_us

from pdserve.kernels.mlp_block import MlpBlockConfig, mlp_block
from pdserve.kernels.row_squares import SQ_ROWS, ScaleRows
from pdserve.kernels.skinny_linear import skinny_linear_add_residual, skinny_linear_triton
from pdserve.kernels.workspace import KernelWorkspace

LAYERS, HIDDEN, ATTN, INTER, EPS = 28, 1024, 2048, 3072, 1e-6


def chain(attn, r, layer, ws):
    wo, wgu, wd = layer
    r1, sq = skinny_linear_add_residual(attn, wo, None, r, ws)
    act = skinny_linear_triton(
        r1, wgu, None, ws, silu_mul_output=True, scale_rows=ScaleRows(sq, EPS)
    )
    return skinny_linear_add_residual(act, wd, None, r1, ws)


def block(attn, r, layer, ws, cfg):
    wo, wgu, wd = layer
    return mlp_block(attn, r, (wo, None), (wgu, None), (wd, None), EPS, ws, cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("mlp_block_probe needs a GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"

    def w(n, k):
        return (torch.randn(n, k, device=dev) / k**0.5).to(dt)

    layers = [(w(HIDDEN, ATTN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER)) for _ in range(LAYERS)]
    attn = [torch.randn(args.rows, ATTN, device=dev).to(dt) for _ in range(LAYERS)]
    r0 = torch.randn(args.rows, HIDDEN, device=dev).to(dt)
    configs = [
        MlpBlockConfig(bn, per_sm, warps, stages, coop)
        for bn, per_sm, warps, stages, coop in [
            (32, 1, 4, 4, True), (32, 1, 4, 4, False), (64, 1, 4, 4, True),
            (16, 1, 4, 4, True), (32, 1, 4, 3, True), (32, 1, 8, 4, True), (32, 2, 4, 2, True),
            (16, 2, 4, 2, True),
        ]
    ]  # fmt: skip

    def run(step):
        ws = KernelWorkspace()
        state = {}

        def forward():
            r = r0
            for i in range(LAYERS):
                r, sq = step(attn[i], r, layers[i], ws)
            state["r"], state["sq"] = r, sq

        return forward, state

    rows = []
    fwd, ref = run(chain)
    us = graph_us([fwd], reps=50) / LAYERS
    rows.append({"case": "chain (3 launches a layer)", "us_per_layer": round(us, 3)})
    print(json.dumps(rows[-1]), flush=True)
    for cfg in configs:
        fwd, got = run(lambda a, r, layer, ws, cfg=cfg: block(a, r, layer, ws, cfg))
        row = {"case": "mlp_block", "config": cfg.__dict__}
        try:
            row["us_per_layer"] = round(graph_us([fwd], reps=50) / LAYERS, 3)
            parts = got["sq"].parts * SQ_ROWS
            row["bitwise_equal"] = bool(
                torch.equal(got["r"], ref["r"])
                and torch.equal(got["sq"].buf[:parts], ref["sq"].buf[:parts])
            )
        except Exception as e:  # a config that cannot launch (shared memory, residency)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "device": torch.cuda.get_device_name(0),
        "commit": git_commit(),
        "command": " ".join(["benchmarks/mlp_block_probe.py", *sys.argv[1:]]),
        "rows_in_batch": args.rows,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"mlp_block_probe_{device_kind()}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
