"""Per-step timeline of one throughput.py workload: which steps take the time.

    python benchmarks/step_trace.py [--workload long_prefill] [--out benchmarks/results]

Runs the workload as throughput.py does (random bf16 Qwen3-0.6B shape, CUDA graphs, async
scheduling, a warm-up on the same shapes first) and records, per engine step, the wall
time of `step()` and what the scheduler put in it (prefill tokens, decode rows). With
async scheduling a step's wall time is mostly the wait for the previous step's outputs,
so the time is attributed to the step that was in flight. Steps are grouped by kind
(pure decode by row-count bucket, steps with prefill by prefill-token bucket) and written
to `step_trace_<workload>.json`. A benchmark, not a test.
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
from throughput import WORKLOADS, Workload, make_prompts, random_model_engine, run_engine  # noqa: E402


def bucket(prefill_tokens: int, decode_rows: int) -> str:
    if prefill_tokens == 0:
        top = 1 << max(0, (decode_rows - 1).bit_length())
        return f"decode rows <= {top}"
    top = 1 << max(0, (prefill_tokens - 1).bit_length())
    return f"prefill tokens <= {top}" + (" + decode" if decode_rows else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="long_prefill", choices=sorted(WORKLOADS))
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    engine = random_model_engine(args.max_num_batched_tokens)
    w = WORKLOADS[args.workload]
    run_engine(engine, Workload(w.name, w.num_requests, w.prompt_len, 4, w.metric),
               make_prompts(w, 151_936, seed=99))  # fmt: skip

    records: list[tuple[int, int, float]] = []  # (prefill tokens, decode rows, wall s)
    schedule = engine.scheduler.schedule
    step = engine.step
    scheduled: list[tuple[int, int]] = []

    def traced_schedule():
        so = schedule()
        counts = list(so.num_scheduled_tokens.values())
        scheduled.append((sum(c for c in counts if c > 1), sum(1 for c in counts if c == 1)))
        return so

    def traced_step():
        start = time.perf_counter()
        out = step()
        records.append((*scheduled[-1], time.perf_counter() - start))
        return out

    engine.scheduler.schedule = traced_schedule
    engine.step = traced_step
    result = run_engine(engine, w, make_prompts(w, 151_936))
    # Async: step k's wall is mostly the wait for step k-1 (in flight) -> shift by one.
    kinds = [(p, d) for p, d, _ in records]
    walls = [s for _, _, s in records]
    shifted = list(zip(kinds[:-1], walls[1:], strict=True))
    groups: dict[str, list[float]] = defaultdict(list)
    for (p, d), s in shifted:
        groups[bucket(p, d)].append(s)
    summary = {
        k: {"steps": len(v), "total_ms": round(1e3 * sum(v), 1), "ms_per_step": round(1e3 * sum(v) / len(v), 3)}
        for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    }  # fmt: skip
    row = {
        "workload": w.name,
        **{k: result[k] for k in ("elapsed_s", "output_tok_s", "total_tok_s", "steps")},
        "by_kind": summary,
        "timeline": [[p, d, round(1e3 * s, 3)] for (p, d), s in shifted],
        "device": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step_trace_{w.name}.json").write_text(json.dumps(row, indent=1))
    print(json.dumps({k: v for k, v in row.items() if k != "timeline"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
