"""Where a worker's CUDA graph capture spends its seconds.

    python benchmarks/capture_probe.py [--max-num-seqs 64] [--engines 2] [--out DIR]

Not a test. A serving worker on the H200 reports "16 CUDA graphs in 8-9 s" (64 slots:
8 sizes, each a plain and a greedy-tail graph), about half of its start. This builds the
engine `--engines` times in one process (the first pays the process's first use of each
kernel, later ones what every capture costs) on a random Qwen3-0.6B-shaped model, timing
on the host: each size's warm-up forward, the time inside `torch.cuda.graph`'s enter and
exit (capture begin / end and instantiation), and the forwards recorded during capture.
Writes `<out>/capture_probe_<commit>.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import git_commit  # noqa: E402
from throughput import random_model_engine  # noqa: E402

from pdserve.runner.mrv2 import cuda_graphs  # noqa: E402


def timed(table: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.perf_counter() - t

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    runs = []
    for i in range(args.engines):
        table: dict[str, float] = defaultdict(float)
        graph_cls = torch.cuda.graph
        saved = (graph_cls.__enter__, graph_cls.__exit__, cuda_graphs.CudaGraphs._forward)
        graph_cls.__enter__ = timed(table, "graph_enter", graph_cls.__enter__)
        graph_cls.__exit__ = timed(table, "graph_exit", graph_cls.__exit__)
        cuda_graphs.CudaGraphs._forward = timed(table, "forward_host", saved[2])
        capture = cuda_graphs.CudaGraphs.capture
        cuda_graphs.CudaGraphs.capture = timed(table, "capture_total", capture)
        t = time.perf_counter()
        try:
            engine = random_model_engine(max_num_seqs=args.max_num_seqs)
        finally:
            graph_cls.__enter__, graph_cls.__exit__, cuda_graphs.CudaGraphs._forward = saved
            cuda_graphs.CudaGraphs.capture = capture
        total = time.perf_counter() - t
        graphs = engine.runner.graphs
        run = {
            "engine": i,
            "engine_s": round(total, 2),
            "capture_seconds_reported": round(graphs.capture_seconds, 2),
            "graphs": len(graphs.graphs) + len(graphs.tail_graphs),
            **{k: round(v, 3) for k, v in table.items()},
        }
        print(json.dumps(run), flush=True)
        runs.append(run)
        del engine, graphs
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    commit = git_commit()
    row = {"runs": runs, "commit": commit, "device": torch.cuda.get_device_name(),
           "command": " ".join(sys.argv)}  # fmt: skip
    (args.out / f"capture_probe_{commit[:7]}.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
