"""The fused qkv projection + preparation (kernels/qkv_linear.py) against the pair it
replaces (cuBLAS qkv, then kernels/qkv_prep.py), per layer; prints JSON lines.

Not a test. Qwen3-0.6B shape (hidden 1024, 16 q / 8 kv heads of 128, q/k norm), bf16, a
32-row decode batch at 384 tokens of context: each case is a CUDA graph of 28 calls on
28 distinct weights and caches (0.2 GB of weights, so none is read from L2 as it would not
be in the model), replayed; reported per call. `--sweep` also times other tiles.

    python benchmarks/qkv_linear_bench.py [--rows 32] [--sweep] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import git_commit  # noqa: E402
from skinny_bench import LAYERS, graph_us  # noqa: E402

from pdserve.kernels.qkv_linear import qkv_linear_triton  # noqa: E402
from pdserve.kernels.qkv_prep import prepare_qkv_triton  # noqa: E402
from pdserve.kernels.row_squares import SQ_ROWS, RowSquares, ScaleRows  # noqa: E402
from pdserve.kernels.workspace import KernelWorkspace  # noqa: E402

HIDDEN, HQ, HKV, D, BLOCK, CONTEXT = 1024, 16, 8, 128, 16, 384


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt, m = torch.device("cuda"), torch.bfloat16, args.rows
    g = torch.Generator(device=dev).manual_seed(0)
    width = (HQ + 2 * HKV) * D
    ws = [torch.randn(width, HIDDEN, device=dev, dtype=dt, generator=g) * 0.02
          for _ in range(LAYERS)]  # fmt: skip
    blocks = m * CONTEXT // BLOCK + 1
    caches = [torch.zeros(blocks, 2, BLOCK, HKV, D, device=dev, dtype=dt) for _ in range(LAYERS)]
    x = torch.randn(m, HIDDEN, device=dev, dtype=dt, generator=g)
    norm_w = torch.ones(D, device=dev, dtype=dt)
    positions = torch.full((m,), CONTEXT - 1, device=dev, dtype=torch.int64)
    slots = torch.arange(m, device=dev, dtype=torch.int64) * (CONTEXT // BLOCK) * BLOCK
    cos_sin = torch.randn(4096, D, device=dev, dtype=torch.float32, generator=g)
    buf = torch.zeros(32 * SQ_ROWS, device=dev)
    buf.view(32, SQ_ROWS)[:, :m] = 32.0
    scale = ScaleRows(RowSquares(buf, 32, HIDDEN), 1e-6)
    work = KernelWorkspace()

    def pair(w, cache):
        qkv = F.linear(x, w)
        prepare_qkv_triton(qkv, HQ, HKV, norm_w, norm_w, 1e-6, positions, cos_sin, cache,
                           slots, scale)  # fmt: skip

    def fused(w, cache, **cfg):
        qkv_linear_triton(x, w, None, scale, HQ, HKV, norm_w, norm_w, 1e-6, positions,
                          cos_sin, cache, slots, work, **cfg)  # fmt: skip

    rows = [{"impl": "cublas+prepare", "us": round(graph_us(
        [lambda w=w, c=c: pair(w, c) for w, c in zip(ws, caches, strict=True)]), 2)}]  # fmt: skip
    configs = [{}]
    if args.sweep:
        configs += [
            {"split_k": s, "block_k": bk, "num_warps": nw, "num_stages": st}
            for s, bk, nw, st in itertools.product((1, 2, 4, 8), (64, 128), (4, 8), (2, 3))
        ]
    for cfg in configs:
        try:
            us = graph_us(
                [lambda w=w, c=c, k=cfg: fused(w, c, **k) for w, c in zip(ws, caches, strict=True)]
            )
            rows.append({"impl": "fused", **cfg, "us": round(us, 2)})
        except Exception as exc:  # out of shared memory etc.: report, go on
            rows.append({"impl": "fused", **cfg, "error": str(exc)[:200]})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(rows[0]), flush=True)
    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "rows_in_batch": m,
           "command": " ".join(["benchmarks/qkv_linear_bench.py", *sys.argv[1:]]),
           "results": rows}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
