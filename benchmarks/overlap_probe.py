"""Would two decode micro-batches on two streams beat one batch? A probe, not a test.

    python benchmarks/overlap_probe.py [--rows 32] [--context 384] [--two-engines]

A 32-row decode forward is a chain of ~170 short kernels; most of each kernel's time is its
start and tail (benchmarks/grid_barrier_probe.py), not its bytes. Two independent chains
on two streams could fill each other's bubbles. Times with CUDA events (median of the
replays) after `--rows` requests of throughput.py's random Qwen3-0.6B shape reached
`--context` tokens (`--cuda-graph-scope layers`, so the graphs hold the layers only):
- the engine's own `--rows` graph, and its `rows/2` graph;
- default: one graph capturing the model's forward twice, on two streams, for rows
  [0, rows/2) and [rows/2, rows): the same weights (a second weight read can hit L2), a
  second KernelWorkspace for the second chain's split-K counters; `staggered`: the second
  chain starts once the first has finished layer 0. Their outputs are compared with the
  one-chain graph's;
- `--two-engines`: two engines (separate weights, so the weights are read twice: a
  pessimistic bound), their `rows/2` graphs replayed at once on two streams.
Prints one JSON line and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_graph import replay_ms  # noqa: E402
from run_meta import git_commit  # noqa: E402
from throughput import random_model_engine  # noqa: E402


def engine(util: float):
    return random_model_engine(gpu_memory_utilization=util, cuda_graph_scope="layers")


def fill(e, rows: int, prompt_len: int, context: int, seed: int) -> None:
    from pdserve.runner.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=context, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for r in range(rows):
        e.add_request(
            f"r{r}", torch.randint(0, 150_000, (prompt_len,), generator=g).tolist(), params
        )
    for _ in range(context - prompt_len + 1):
        e.step()


def timed(fn, n: int) -> float:
    """Median device ms of `n` back-to-back calls of `fn` (decode_graph.replay_ms)."""
    return statistics.median(replay_ms(fn, n))


def set_workspace(model, ws) -> None:
    for m in model.modules():
        if hasattr(m, "workspace"):
            m.workspace = ws


def two_chain_graph(graphs, rows: int, staggered: bool):
    """-> (graph, [rows, hidden] output): the forward of rows [0, h) on one stream and of
    [h, rows) on another, in one capture."""
    from pdserve.kernels.workspace import KernelWorkspace
    from pdserve.runner.models.attention_metadata import AttentionMetadata

    b, model, h = graphs.buffers, graphs.model, rows // 2
    qsl = torch.arange(h + 1, dtype=torch.int32, device="cuda")
    ws = [model.workspace, KernelWorkspace()]
    first_layer = torch.cuda.Event()

    def fwd(lo: int, hi: int, chain: int):
        set_workspace(model, ws[chain])
        attn = AttentionMetadata(
            qsl, b.seq_lens[lo:hi], b.block_tables[lo:hi], b.slot_mapping[lo:hi],
            max_query_len=1, max_seq_len=graphs.max_seq_len, decode_kernel=graphs.decode_kernel,
        )  # fmt: skip

        def hook(i: int) -> None:
            if chain == 0 and i == 0:
                first_layer.record()

        return model(b.input_ids[lo:hi], b.positions[lo:hi], graphs.kv_caches, attn, hook)

    with torch.inference_mode():
        fwd(0, h, 0), fwd(h, rows, 1)  # compiles, sizes the second workspace
        torch.cuda.synchronize()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cur = torch.cuda.current_stream()
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            with torch.cuda.stream(s1):
                out_a = fwd(0, h, 0)
            with torch.cuda.stream(s2):
                if staggered:
                    s2.wait_event(first_layer)
                out_b = fwd(h, rows, 1)
            cur.wait_stream(s1)
            cur.wait_stream(s2)
            out = torch.cat([out_a, out_b])
        set_workspace(model, ws[0])
    return graph, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--two-engines", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/overlap_probe.json")
    args = ap.parse_args()
    half = args.rows // 2
    a = engine(0.3 if args.two_engines else 0.8)
    fill(a, args.rows, 256, args.context, 0)
    ga = a.runner.graphs
    row = {
        "rows": args.rows,
        "context": args.context,
        "full_ms": timed(lambda: ga.replay(args.rows), args.replays),
        "half_ms": timed(lambda: ga.replay(half), args.replays),
    }
    if args.two_engines:
        b = engine(0.6)
        fill(b, args.rows, 256, args.context, 1)
        gb = b.runner.graphs
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both():
            cur = torch.cuda.current_stream()
            for s, g in ((s1, ga), (s2, gb)):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    g.replay(half)
            cur.wait_stream(s1)
            cur.wait_stream(s2)

        def serial():
            ga.replay(half)
            gb.replay(half)

        row["two_engines_serial_ms"] = timed(serial, args.replays)
        row["two_engines_concurrent_ms"] = timed(both, args.replays)
    else:
        ref = ga.replay(args.rows)[: args.rows].float().clone()
        for name, staggered in (("two_chains", False), ("two_chains_staggered", True)):
            graph, out = two_chain_graph(ga, args.rows, staggered)
            graph.replay()
            torch.cuda.synchronize()
            row[f"{name}_max_abs_diff"] = (out.float() - ref).abs().max().item()
            row[f"{name}_ms"] = timed(graph.replay, args.replays)
    row.update(
        device=torch.cuda.get_device_name(),
        commit=git_commit(),
        command="benchmarks/overlap_probe.py " + " ".join(sys.argv[1:]),
    )
    print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
