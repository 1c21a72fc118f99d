"""Device time of one decode step's forward, the host out of the loop.

    python benchmarks/decode_graph.py [--rows 32] [--context 384] [--replays 200]

Builds throughput.py's engine (random bf16 Qwen3-0.6B shape, CUDA graphs), runs `--rows`
requests of 256 prompt tokens until their contexts reach `--context`, then replays the
decode graph of that batch size back to back over the last step's inputs and times the
replays with CUDA events. What throughput.py's TPOT cannot show on a host too slow to keep
the GPU fed (a host-bound step hides a faster forward): the GPU side alone. The replays
rewrite the same KV slots with the same values, so nothing changes between them. Prints
one JSON line (and writes it to `--out`/decode_graph_<rows>_<kernel>[_step].json). A
benchmark, not a test.

With `--cuda-graph-scope step` the graph also holds the input prep, and `step_ms_p50` times
the greedy-tail graph as well: prep, layers, final norm, LM head, argmax and post-update,
i.e. the whole device side of a greedy step (its replays rewrite the same tokens too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import git_commit  # noqa: E402
from throughput import random_model_engine  # noqa: E402

from pdserve.runner.config import DECODE_ATTENTION_KERNELS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--context", type=int, default=384, help="tokens per row when timed")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--decode-attention", choices=DECODE_ATTENTION_KERNELS, default="auto")
    ap.add_argument("--cuda-graph-scope", choices=("layers", "step"), default="step")
    args = ap.parse_args()
    if args.context <= args.prompt_len:
        ap.error("--context must exceed --prompt-len (decode steps reach it)")

    from pdserve.runner.sampling_params import SamplingParams

    engine = random_model_engine(
        decode_attention=args.decode_attention, cuda_graph_scope=args.cuda_graph_scope
    )
    graphs = engine.runner.graphs
    if graphs is None or args.rows not in graphs.graphs:
        raise SystemExit(
            f"no decode graph of {args.rows} rows (captured: {graphs and graphs.sizes})"
        )
    params = SamplingParams(temperature=0.0, max_tokens=args.context, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for r in range(args.rows):
        prompt = torch.randint(0, 150_000, (args.prompt_len,), generator=g).tolist()
        engine.add_request(f"r{r}", prompt, params)
    for _ in range(args.context - args.prompt_len + 1):
        engine.step()
    ms = replay_ms(lambda: graphs.replay(args.rows), args.replays)
    step_ms = None
    if graphs.has_greedy_tail:
        step_ms = statistics.median(
            replay_ms(lambda: graphs.replay_greedy(args.rows), args.replays)
        )
    row = {
        "rows": args.rows,
        "context": args.context,
        "decode_attention": args.decode_attention,
        "cuda_graph_scope": args.cuda_graph_scope,
        "replays": len(ms),
        "forward_ms_p50": statistics.median(ms),
        "forward_ms_min": min(ms),
        "step_ms_p50": step_ms,
        "device": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "command": "benchmarks/decode_graph.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_step" if args.cuda_graph_scope == "step" else ""
    (out / f"decode_graph_{args.rows}_{args.decode_attention}{suffix}.json").write_text(
        json.dumps(row, indent=2) + "\n"
    )
    return 0


def replay_ms(replay, n: int) -> list[float]:
    """Device ms of each of `n` back-to-back replays (CUDA events), the first 10 dropped:
    they warm the clocks."""
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times[10:]]


if __name__ == "__main__":
    raise SystemExit(main())
