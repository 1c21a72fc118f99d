"""Probe: the decode MLP (gate/up, SiLU-and-mul, down + residual) as one launch, split over
the intermediate features, against today's two skinny launches. Prints JSON. Not a test.

Program p owns S intermediate features: it computes their gate and up rows over the whole
hidden size, applies SiLU-and-mul (rounded as kernels/activation.py rounds), multiplies
the [S, rows] result by the down projection's S input columns (stored transposed, [I, H],
so a program's slice is contiguous) and adds its [H, rows] fp32 partial into an
accumulator with atomics, one output tile of BLOCK_H features at a time. The last program
to count itself in on a tile rounds the sum, adds the residual, writes the tile and its
rows' sums of squares, and zeroes the tile's accumulator for the next launch. The
intermediate never leaves the SM and the down projection waits on no other program: one
dependent phase a layer fewer. The atomics make the fp32 sum's order vary from run to run
(reported: `repeatable`).

Result (H100, results/mlp_fused_probe_h100_131a7cf.json): 35.9-67.8 us a layer against
13.2 for the two skinny launches. Every program adds rows x hidden fp32 values (1.5-6.3 M
atomics a layer over the variants), and those cost far more than the dependent phase they
remove. Kept as the record of that measurement; nothing in the model uses it.

    python benchmarks/mlp_fused_probe.py [--rows 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from run_meta import git_commit
from skinny_bench import graph_us

from pdserve.kernels import skinny_linear as sl
from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.row_squares import SQ_ROWS
from pdserve.kernels.workspace import KernelWorkspace

HIDDEN, INTER, LAYERS = 1024, 3072, 28


@triton.jit(do_not_specialize=["num_rows"])
def _fused_mlp_kernel(
    x_ptr,  # [M, H]
    wgu_ptr,  # [2I, H]: gate rows, then up rows
    wdt_ptr,  # [I, H]: the down projection transposed
    res_ptr,  # [M, H]
    out_ptr,  # [M, H]
    acc_ptr,  # [H, M_PAD] fp32, zero between launches
    count_ptr,  # [H // BLOCK_H] int32, zero between launches
    sq_ptr,  # [H // BLOCK_H, SQ_STRIDE] fp32 row sums of squares of the output
    num_rows,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    S: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SQ_STRIDE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = INTER // S
    tiles = HIDDEN // BLOCK_H
    offs_s = pid * S + tl.arange(0, S)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    offs_h = tl.arange(0, BLOCK_H)
    m_mask = offs_m < num_rows
    dtype = out_ptr.dtype.element_ty
    g_ptrs = wgu_ptr + offs_s[:, None] * HIDDEN + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * HIDDEN + offs_k[None, :]
    acc_g = tl.zeros([S, M_PAD], dtype=tl.float32)
    acc_u = tl.zeros([S, M_PAD], dtype=tl.float32)
    for _ in range(HIDDEN // BLOCK_K):
        xs = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        wg = tl.load(g_ptrs)
        wu = tl.load(g_ptrs + INTER * HIDDEN)
        acc_g = sl.swap_ab_dot(wg, xs, acc_g, IEEE_DOT)
        acc_u = sl.swap_ab_dot(wu, xs, acc_u, IEEE_DOT)
        g_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gate = acc_g.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (silu * acc_u.to(dtype).to(tl.float32)).to(dtype)  # [S, M_PAD]
    for j in range(tiles):
        t = (pid + j) % tiles  # programs start on different tiles: the counters spread
        cols = t * BLOCK_H + offs_h
        wd = tl.load(wdt_ptr + offs_s[:, None] * HIDDEN + cols[None, :])  # [S, BLOCK_H]
        if IEEE_DOT:
            part = tl.dot(tl.trans(wd.to(tl.float32)), h.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(tl.trans(wd), h)  # [BLOCK_H, M_PAD]
        acc_ptrs = acc_ptr + cols[:, None] * M_PAD + offs_m[None, :]
        tl.atomic_add(acc_ptrs, part, mask=m_mask[None, :], sem="relaxed")
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
        if arrived == programs - 1:
            total = tl.load(acc_ptrs, mask=m_mask[None, :], other=0.0, cache_modifier=".cg")
            res_ptrs = res_ptr + offs_m[None, :] * HIDDEN + cols[:, None]
            res = tl.load(res_ptrs, mask=m_mask[None, :], other=0.0).to(tl.float32)
            y = (total.to(dtype).to(tl.float32) + res).to(dtype)
            yf = tl.where(m_mask[None, :], y.to(tl.float32), 0.0)
            tl.store(sq_ptr + t * SQ_STRIDE + offs_m, tl.sum(yf * yf, 0), mask=m_mask)
            tl.store(out_ptr + offs_m[None, :] * HIDDEN + cols[:, None], y, mask=m_mask[None, :])
            tl.store(acc_ptrs, tl.zeros([BLOCK_H, M_PAD], dtype=tl.float32))
            tl.store(count_ptr + t, 0)


def fused_mlp(x, wgu, wdt, residual, ws: KernelWorkspace, s: int, block_h: int, warps: int,
              stages: int, block_k: int = 128):  # fmt: skip
    rows = x.shape[0]
    m_pad = max(16, triton.next_power_of_2(rows))
    out = torch.empty_like(residual)
    acc = ws.scratch("fused_mlp_acc", HIDDEN * m_pad, x.device)
    count = ws.counters("fused_mlp", HIDDEN // block_h, x.device)
    sq = ws.scratch("fused_mlp_sq", (HIDDEN // block_h) * SQ_ROWS, x.device)
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"
    _fused_mlp_kernel[(INTER // s,)](
        x, wgu, wdt, residual, out, acc, count, sq, rows, HIDDEN=HIDDEN, INTER=INTER, S=s,
        M_PAD=m_pad, BLOCK_K=block_k, BLOCK_H=block_h, SQ_STRIDE=SQ_ROWS, IEEE_DOT=ieee,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def reference(x, wgu, wdt, residual):
    h = silu_and_mul_ref(F.linear(x, wgu))
    return (F.linear(h.float(), wdt.t().float()).to(x.dtype) + residual).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [
        (torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt, generator=g) * 0.03,
         torch.randn(INTER, HIDDEN, device=dev, dtype=dt, generator=g) * 0.02)
        for _ in range(LAYERS)
    ]  # fmt: skip
    wd = [wdt.t().contiguous() for _, wdt in layers]  # [H, I] for the skinny down launch
    x = torch.randn(args.rows, HIDDEN, device=dev, dtype=dt, generator=g)
    res = torch.randn(args.rows, HIDDEN, device=dev, dtype=dt, generator=g)
    ws = KernelWorkspace()

    def pair(i):
        h = sl.skinny_linear_triton(x, layers[i][0], None, ws, True)
        return sl.skinny_linear_add_residual(h, wd[i], None, res, ws)[0]

    ref = reference(x, *layers[0], res)
    bound = lambda y: ((y.float() - ref).abs() - ref.abs() * 2**-7 - 2**-7).max().item()  # noqa: E731
    results = [{"impl": "skinny_pair", "us": round(graph_us([lambda i=i: pair(i) for i in range(LAYERS)]), 2),
                "max_err_over_bound": round(bound(pair(0)), 5)}]  # fmt: skip
    print(json.dumps(results[-1]), flush=True)
    for s, bh, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 3)):
        call = lambda i, s=s, bh=bh, w=warps, st=stages: fused_mlp(  # noqa: E731
            x, *layers[i], res, ws, s, bh, w, st
        )
        try:
            y1, y2 = call(0), call(0)
            row = {"impl": "fused", "S": s, "block_h": bh, "warps": warps, "stages": stages,
                   "max_err_over_bound": round(bound(y1), 5), "repeatable": bool(torch.equal(y1, y2)),
                   "us": round(graph_us([lambda i=i, c=call: c(i) for i in range(LAYERS)]), 2)}  # fmt: skip
        except Exception as exc:  # out of shared memory or registers: report, go on
            row = {"impl": "fused", "S": s, "block_h": bh, "warps": warps, "stages": stages,
                   "error": str(exc)[:200]}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
    doc = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
           "commit": git_commit(), "rows": args.rows,
           "command": " ".join(["benchmarks/mlp_fused_probe.py", *sys.argv[1:]]), "results": results}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
