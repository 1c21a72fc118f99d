"""Where a decode step's time goes on the GPU: per-kernel device time and host time.

    python benchmarks/profile_step.py [--num-requests 512] [--prompt-len 256] [--steps 12]
                                      [--phase decode|prefill]

Same model and engine settings as throughput.py (random bf16 Qwen3-0.6B shape, CUDA
graphs, async scheduling). `--phase decode`: runs the prefill untimed, then profiles
`--steps` full decode steps. `--phase prefill`: runs the same shapes once with other prompts
(so every kernel variant is compiled), then profiles the first `--steps` steps of the
requests, which are chunked-prefill steps (eager, with the decode rows that finished their
prompts). Writes `profile_step_<n>[_prefill].json` (top kernels by device time per step,
top host ops by CPU time, host ms per step split into schedule+launch and waiting) and the
profiler's table as text. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import git_commit  # noqa: E402
from throughput import Workload, make_prompts, random_model_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    ap.add_argument(
        "--python-profile",
        action="store_true",
        help="also run --steps more steps under cProfile and print the top functions",
    )
    ap.add_argument("--cuda-graph-scope", choices=("layers", "step"), default="step")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    from pdserve.runner.sampling_params import SamplingParams

    engine = random_model_engine(cuda_graph_scope=args.cuda_graph_scope)
    w = Workload("profile", args.num_requests, args.prompt_len, 10_000, "output_tok_s")
    params = SamplingParams(temperature=0.0, max_tokens=64 + args.steps, ignore_eos=True)
    if args.phase == "prefill":
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        for i, p in enumerate(make_prompts(w, 151_936, seed=99)):
            engine.add_request(f"w{i}", p, warm)
        while engine.has_unfinished():
            engine.step()
    for i, p in enumerate(make_prompts(w, 151_936)):
        engine.add_request(f"p{i}", p, params)
    for _ in range(40 if args.phase == "decode" else 1):  # settle into the profiled phase
        engine.step()
    torch.cuda.synchronize()
    s0 = (engine.stats.num_steps, engine.stats.cpu_s, engine.stats.wait_s)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = engine.stats.num_steps - s0[0]
    rows, host = [], []
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            host.append(
                {"name": e.key[:120], "calls": e.count, "cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
            )  # fmt: skip
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev > 0:
            rows.append(
                {"name": e.key[:120], "calls": e.count, "device_ms_per_step": dev / 1e3 / steps}
            )
    rows.sort(key=lambda r: -r["device_ms_per_step"])
    result = {
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "cuda_graph_scope": args.cuda_graph_scope,
        "steps": steps,
        "wall_ms_per_step_profiled": 1e3 * wall / steps,
        "host_ms_per_step": 1e3 * (engine.stats.cpu_s - s0[1]) / steps,
        "wait_ms_per_step": 1e3 * (engine.stats.wait_s - s0[2]) / steps,
        "device_ms_per_step": sum(r["device_ms_per_step"] for r in rows),
        "top_kernels": rows[:25],
        "top_host_ops": sorted(host, key=lambda r: -r["cpu_ms_per_step"])[:25],
        "device": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.python_profile:  # where the host's Python goes (cProfile inflates it ~2x)
        import cProfile
        import pstats

        t0, c0 = time.perf_counter(), engine.stats.cpu_s
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        print(
            f"unprofiled: {1e3 * (time.perf_counter() - t0) / args.steps:.2f} ms/step wall, "
            f"{1e3 * (engine.stats.cpu_s - c0) / args.steps:.2f} ms/step host"
        )
        with cProfile.Profile() as py_prof:
            for _ in range(args.steps):
                engine.step()
        pstats.Stats(py_prof).sort_stats("tottime").print_stats(40)
    stem = f"profile_step_{args.num_requests}" + ("_prefill" if args.phase == "prefill" else "")
    stem += "_step_graphs" if args.cuda_graph_scope == "step" else ""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    (out / f"{stem}.txt").write_text(table)
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("top_")}))
    for r in rows[:15]:
        print(f"{r['device_ms_per_step']:8.3f} ms/step {r['calls']:6d} calls  {r['name']}")
    for r in result["top_host_ops"][:15]:
        print(f"{r['cpu_ms_per_step']:8.3f} host ms/step {r['calls']:6d} calls  {r['name']}")
    os._exit(0)  # skip teardown of graphs and the profiler (seconds) — nothing is left to write


if __name__ == "__main__":
    raise SystemExit(main())
