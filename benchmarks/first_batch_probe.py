"""What the first full prefill batch of a fresh worker pays, after the serving warm-up.

    python benchmarks/first_batch_probe.py [--no-warm-up] [--rounds 3] [--out DIR]

The engine a serving prefill worker runs on a big GPU (the random Qwen3-0.6B-shaped model,
8,192 batched tokens), `runner/warm_up.py` first unless told not to, then `--rounds`
batches of 15 random 512-token prompts (what `benchmarks/gpu_serve_log.sh` sends at
concurrency 16), one output token each. Per step: wall time (synchronized), scheduled
tokens, and every Triton kernel compiled during it (Triton's post-compile hook), so a
slow first batch shows whether it compiles and what. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import triton
from run_meta import git_commit
from throughput import random_model_engine

from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.warm_up import warm_up


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    compiles: list[str] = []

    def on_compile(*, repr: str, **_kwargs) -> None:  # noqa: A002 (Triton's keyword)
        compiles.append(repr)

    t = time.perf_counter()
    engine = random_model_engine(max_num_batched_tokens=8192, gpu_memory_utilization=0.4)
    startup = time.perf_counter() - t
    triton.knobs.runtime.jit_post_compile_hook = on_compile
    warm = warm_up(engine) if args.warm_up else 0.0
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rounds = []
    for r in range(args.rounds):
        for i in range(args.prompts):
            prompt = rng.integers(0, 151_936, args.prompt_len).tolist()
            engine.add_request(f"r{r}-{i}", prompt, params)
        steps = []
        while engine.has_unfinished():
            compiles.clear()
            t = time.perf_counter()
            out = engine.step()
            torch.cuda.synchronize()
            steps.append(
                {
                    "ms": round((time.perf_counter() - t) * 1e3, 2),
                    "finished": sum(o.finish_reason is not None for o in out),
                    "compiles": list(compiles),
                }
            )
        rounds.append(steps)
        print(json.dumps({"round": r, "steps": steps}), flush=True)
    result = {
        "probe": "first_batch",
        "warm_up": args.warm_up,
        "warm_up_s": round(warm, 3),
        "startup_s": round(startup, 2),
        "rounds": rounds,
        "device": torch.cuda.get_device_name(),
        "commit": git_commit(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"first_batch_probe_{'warm' if args.warm_up else 'cold'}_{result['commit'][:7]}.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
