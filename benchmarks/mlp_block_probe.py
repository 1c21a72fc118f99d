"""The CUDA MLP block (kernels/mlp_block_cuda.py: o / gate-up / down in one launch, weights
streamed from the start) against the three Triton skinny launches it replaces.

Not a test. Qwen3-0.6B shapes (o 1024x2048, gate/up 6144x1024, down 1024x3072), 28
distinct layers chained in one CUDA graph (no weight read from L2), replayed; per layer:
us. Also the largest difference of the final stream from the chain's and from the fp32
spec's (`mlp_block_ref`), and whether two launches agree bitwise.

    python benchmarks/mlp_block_probe.py [--rows 1,8,32] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from run_meta import device_kind, git_commit
from skinny_bench import graph_us

from pdserve.kernels.mlp_block_cuda import config_for, mlp_block_cuda, mlp_block_ref
from pdserve.kernels.row_squares import ScaleRows
from pdserve.kernels.skinny_linear import skinny_linear_add_residual, skinny_linear_triton
from pdserve.kernels.sm_count import num_sms
from pdserve.kernels.workspace import KernelWorkspace

LAYERS, HIDDEN, ATTN, INTER, EPS = 28, 1024, 2048, 3072, 1e-6


def chain(attn, r, layer, ws):
    wo, wgu, wd = layer
    r1, sq = skinny_linear_add_residual(attn, wo, None, r, ws)
    act = skinny_linear_triton(
        r1, wgu, None, ws, silu_mul_output=True, scale_rows=ScaleRows(sq, EPS)
    )
    return skinny_linear_add_residual(act, wd, None, r1, ws)


STAMP_NAMES = [
    "start", "o_inputs", "o_weights", "o_product", "o_splits_in", "o_done", "gu_start",
    "gu_inputs", "gu_weights", "gu_product", "gu_done", "d_start", "d_inputs", "d_weights",
    "d_splits_in", "end",
]  # fmt: skip


def stamp_profile(attn, r0, layers, cfg) -> dict:
    """Per phase point, the median over programs and layers of ns since the launch's first
    program started (globaltimer), from one replay of the 28 chained launches; and the gap
    from one launch's last program end to the next one's first start."""
    ws = KernelWorkspace()
    stamps = torch.zeros(LAYERS, cfg.grid, 16, dtype=torch.int64, device=r0.device)

    def forward():
        r = r0
        for i in range(LAYERS):
            r, _ = mlp_block_cuda(attn[i], r, *layers[i], EPS, ws, cfg, stamps=stamps[i])

    graph_us([forward], reps=3)
    st = stamps.cpu().double()
    start = st[:, :, 0].min(1).values[:, None]
    rel = st - start[:, :, None]
    out = {n: round(rel[:, :, i].median().item()) for i, n in enumerate(STAMP_NAMES)}
    out["end_max"] = round(rel[:, :, 15].max(1).values.median().item())
    gaps = start[1:, 0] - st[:-1, :, 15].max(1).values
    out["gap_between_launches"] = round(gaps.median().item())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("mlp_block_probe needs a GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, torch.device("cuda")

    def w(n, k):
        return (torch.randn(n, k, device=dev) / k**0.5).to(dt)

    layers = [(w(HIDDEN, ATTN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER)) for _ in range(LAYERS)]
    rows_out = []
    for rows in (int(v) for v in args.rows.split(",")):
        attn = [torch.randn(rows, ATTN, device=dev).to(dt) for _ in range(LAYERS)]
        r0 = torch.randn(rows, HIDDEN, device=dev).to(dt)
        cfg = config_for(attn[0], *layers[0], num_sms(dev))
        row = {"rows": rows, "config": None if cfg is None else cfg.__dict__}
        if cfg is None:
            row["error"] = "no config / kernel"
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            continue

        def run(step, attn=attn, r0=r0):
            ws = KernelWorkspace()
            state = {}

            def forward():
                r = r0
                for i in range(LAYERS):
                    r, sq = step(attn[i], r, layers[i], ws)
                state["r"], state["sq"] = r, sq

            return forward, state

        fwd_chain, got_chain = run(chain)
        fwd_block, got_block = run(
            lambda a, r, layer, ws, cfg=cfg: mlp_block_cuda(a, r, *layer, EPS, ws, cfg)
        )
        row["chain_us_per_layer"] = round(graph_us([fwd_chain], reps=50) / LAYERS, 3)
        row["block_us_per_layer"] = round(graph_us([fwd_block], reps=50) / LAYERS, 3)
        # One layer against the fp32 spec and the chain, and two launches against each other.
        ws = KernelWorkspace()
        one = mlp_block_cuda(attn[0], r0, *layers[0], EPS, ws, cfg)[0].clone()
        two = mlp_block_cuda(attn[0], r0, *layers[0], EPS, ws, cfg)[0]
        ref = mlp_block_ref(attn[0], r0, *layers[0], EPS)[0]
        ch = chain(attn[0], r0, layers[0], KernelWorkspace())[0]
        row["max_diff_vs_ref"] = (one.float() - ref.float()).abs().max().item()
        row["max_diff_chain_vs_ref"] = (ch.float() - ref.float()).abs().max().item()
        row["repeatable"] = bool(torch.equal(one, two))
        row["max_diff_28_layers_vs_chain"] = (
            (got_block["r"].float() - got_chain["r"].float()).abs().max().item()
        )
        row["phase_ns"] = stamp_profile(attn, r0, layers, cfg)
        variants = (
            ("plain", {"cluster": False, "gu_multicast": False}),
            ("plain_no_weights", {"cluster": False, "gu_multicast": False, "weights_mode": 2}),
            ("cluster_no_multicast", {"gu_multicast": False}),
            ("release_barrier", {"barrier_mode": 1}),
            ("no_weights", {"weights_mode": 2}),
            ("cluster_gu_split2", {"gu_features": 2 * cfg.gu_features, "gu_splits": 2,
                                   "gu_multicast": False}),
        )  # fmt: skip
        for name, change in variants:
            var = dataclasses.replace(cfg, **change)

            def fwd(var=var, attn=attn, r0=r0, ws=ws):
                r = r0
                for i in range(LAYERS):
                    r, _ = mlp_block_cuda(attn[i], r, *layers[i], EPS, ws, var)

            try:
                row[f"{name}_us_per_layer"] = round(graph_us([fwd], reps=50) / LAYERS, 3)
                row[f"{name}_phase_ns"] = stamp_profile(attn, r0, layers, var)
                got = mlp_block_cuda(attn[0], r0, *layers[0], EPS, ws, var)[0]
                row[f"{name}_max_diff_vs_ref"] = (got.float() - ref.float()).abs().max().item()
                row[f"{name}_equal_to_default"] = bool(torch.equal(got, one))
            except Exception as e:  # a variant that does not launch here
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.synchronize()
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "device": torch.cuda.get_device_name(0),
        "commit": git_commit(),
        "command": " ".join(["benchmarks/mlp_block_probe.py", *sys.argv[1:]]),
        "rows": rows_out,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"mlp_block_probe_cuda_{device_kind()}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
