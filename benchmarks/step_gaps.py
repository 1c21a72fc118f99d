"""What the GPU does between two decode steps: the device timeline at step boundaries.

    python benchmarks/step_gaps.py [--num-requests 32] [--prompt-len 256] [--steps 12]
                                   [--out benchmarks/results]

Same model and engine as throughput.py (random bf16 Qwen3-0.6B shape, step-scope CUDA
graphs, async scheduling). After 40 settling steps it profiles `--steps` decode steps with
the torch profiler and reads its trace: the device operations (kernels, copies, sets) in
time order and the host's graph launches. A step starts at its first kernel after a
launch of the step graph (its input prep kernel); for each boundary it reports the time
from one step's last kernel to the next step's first, what ran in between (copies, sets),
and how far ahead of the device the host launched the graph (negative: the device waited
for the host). Writes `step_gaps_<n>_<commit>.json` and the timeline
(`..._timeline.json`). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import git_commit  # noqa: E402
from throughput import Workload, make_prompts, random_model_engine  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_ops(trace: dict) -> tuple[list[dict], list[float]]:
    """-> (device operations sorted by start, host start times of graph launches)."""
    ops, launches = [], []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat", "")
        if cat in DEVICE_CATS and "dur" in e:
            ops.append({"name": e["name"], "cat": cat, "ts": e["ts"], "end": e["ts"] + e["dur"]})
        elif cat == "cuda_runtime" and "GraphLaunch" in e.get("name", ""):
            launches.append(e["ts"])
    ops.sort(key=lambda o: o["ts"])
    launches.sort()
    return ops, launches


def boundaries(ops: list[dict], launches: list[float], first_kernel: str) -> list[dict]:
    """One row per step boundary: a step starts at its `first_kernel` (the graph's input
    prep). Reports the device's idle time from the previous step's last operation to it,
    the operations after the previous step's last kernel (copies, sets), and how long
    before it the host had launched the graph."""
    starts = [i for i, o in enumerate(ops) if o["cat"] == "kernel" and first_kernel in o["name"]]
    rows = []
    for a, b in zip(starts, starts[1:]):
        step = ops[a:b]
        last_kernel = max(o["end"] for o in step if o["cat"] == "kernel")
        prior = [t for t in launches if t <= ops[b]["ts"]]
        rows.append(
            {
                "idle_us": round(ops[b]["ts"] - max(o["end"] for o in step), 2),
                "last_kernel_to_next_step_us": round(ops[b]["ts"] - last_kernel, 2),
                "step_device_us": round(last_kernel - ops[a]["ts"], 1),
                "host_launch_lead_us": round(ops[b]["ts"] - prior[-1], 1) if prior else None,
                "after_last_kernel": [
                    f"{o['cat']}:{o['name'][:60]} {o['end'] - o['ts']:.1f}us "
                    f"at +{o['ts'] - last_kernel:.1f}"
                    for o in step
                    if o["ts"] >= last_kernel or o["cat"] != "kernel"
                ],
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--first-kernel", default="_prepare_decode_kernel", help="a step's start")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    from pdserve.runner.sampling_params import SamplingParams

    engine = random_model_engine()
    w = Workload("gaps", args.num_requests, args.prompt_len, 10_000, "output_tok_s")
    params = SamplingParams(temperature=0.0, max_tokens=64 + args.steps, ignore_eos=True)
    for i, p in enumerate(make_prompts(w, 151_936)):
        engine.add_request(f"p{i}", p, params)
    for _ in range(40):
        engine.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    ops, launches = device_ops(json.loads(path.read_text()))
    rows = boundaries(ops, launches, args.first_kernel)
    idle = [r["last_kernel_to_next_step_us"] for r in rows]
    busy = [r["step_device_us"] for r in rows]
    kinds: dict[str, int] = {}
    for o in ops:
        if o["cat"] != "kernel":
            kinds[o["name"][:60]] = kinds.get(o["name"][:60], 0) + 1
    result = {
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "last_kernel_to_next_step_us_median": statistics.median(idle) if idle else None,
        "step_busy_us_median": statistics.median(busy) if busy else None,
        "non_kernel_ops": kinds,
        "boundaries": rows,
        "device": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"step_gaps_{args.num_requests}_{result['commit']}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    timeline = {
        "ops": [[o["cat"], o["name"][:80], o["ts"], o["end"]] for o in ops],
        "launches": launches,
    }
    (out / f"{stem}_timeline.json").write_text(json.dumps(timeline) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "boundaries"}, indent=1))
    for r in rows[:6]:
        print(r)
    os._exit(0)  # skip teardown of graphs and the profiler


if __name__ == "__main__":
    raise SystemExit(main())
