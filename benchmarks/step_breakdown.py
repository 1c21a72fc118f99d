"""Where the host's time goes in a throughput workload: cumulative time per engine phase.

    python benchmarks/step_breakdown.py [--workload decode_heavy]

Runs one throughput.py workload with timers wrapped around the engine's phases
(schedule, runner execute, waiting for outputs, output processing) and around the
places that can block the host on the device (host-ring slot reuse, event waits), and
prints milliseconds per step for each. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_stages import timed_functions  # noqa: E402
from throughput import WORKLOADS, Workload, make_prompts, random_model_engine, run_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="decode_heavy", choices=list(WORKLOADS))
    ap.add_argument("--cuda-graph-scope", choices=("layers", "step"), default="step")
    args = ap.parse_args()

    from pdserve.runner.engine import Engine
    from pdserve.runner.mrv2 import host_ring, model_runner
    from pdserve.runner.scheduler import Scheduler

    engine = random_model_engine(cuda_graph_scope=args.cuda_graph_scope)
    w = WORKLOADS[args.workload]
    prompts = make_prompts(w, 151_936)
    # Warm-up on the workload's own shapes with other prompts, as throughput.py does: an
    # 8-request warm-up left the timed run to compile the batch's kernel variants.
    run_engine(
        engine,
        Workload(w.name, w.num_requests, w.prompt_len, 4, w.metric),
        make_prompts(w, 151_936, seed=99),
    )
    from pdserve.runner import sampler, sampling_state
    from pdserve.runner.mrv2 import cuda_graphs, input_batch, request_state

    targets = [
        (Scheduler, "schedule", "schedule"),
        (model_runner.MRV2ModelRunner, "execute", "runner.execute"),
        (model_runner.StepHandle, "get", "handle.get (wait + fetch)"),
        (Engine, "_process", "engine._process"),
        (host_ring.HostRing, "_slot", "host_ring._slot (may wait on an event)"),
        (torch.cuda.Event, "synchronize", "cuda.Event.synchronize"),
        (torch.cuda, "synchronize", "cuda.synchronize"),
        (cuda_graphs.CudaGraphs, "replay", "  execute: graph replay"),
        (cuda_graphs.CudaGraphs, "replay_greedy", "  execute: greedy-tail graph replay"),
        (input_batch.InputBuffers, "build", "  execute: buffers.build"),
        (request_state.RequestState, "apply_staged_writes", "  execute: staged writes"),
        (sampler.Sampler, "__call__", "  execute: sampler"),
        (sampling_state.SamplingState, "metadata", "  execute: sampling metadata"),
        (type(engine.runner.model), "compute_logits", "  execute: lm head"),
        (model_runner, "post_update", "  execute: post_update"),
    ]
    s0 = engine.stats.num_steps
    with timed_functions(targets) as timings:
        t = time.perf_counter()
        row = run_engine(engine, w, prompts)
        wall = time.perf_counter() - t
    steps = engine.stats.num_steps - s0
    out = {
        "workload": w.name,
        "cuda_graph_scope": args.cuda_graph_scope,
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "output_tok_s": row["output_tok_s"],
        "ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in timings.seconds.items()},
        "calls_per_step": {k: round(v / steps, 2) for k, v in timings.calls.items()},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
