"""What a kernel boundary costs a decode layer, next to a grid barrier inside one kernel.

Not a test. A question for the small_batch TPOT target (issue #3): the 32-row decode
layer is six kernels of 4-7 us each where their bytes alone would take ~1-3 us, and
programmatic dependent launch did not help (results/decode_graph_ab_pdl_prefetch_*.json).
Would one persistent kernel per layer (phases separated by grid barriers, the next
phase's weights loaded before the barrier) do better? This measures the pattern on
synthetic work shaped like a decode linear's weight stream:

- every phase streams PHASE_MB of bf16 "weights" (one slice per program), sums each
  program's slice, adds one value another program wrote in the phase before (so a phase
  depends on the previous one, as a layer's kernels do) and stores its result;
- `graph`: one launch per phase, PHASES launches captured in one CUDA graph;
- `barrier`: one persistent launch (one program per SM), a grid barrier (an arrival
  counter, release/acquire atomics) between phases, weights loaded after the barrier;
- `barrier+prefetch`: the same, with each phase's weight slice loaded before the barrier
  that guards the previous phase's results (weights never depend on them).

Each is timed over 50 graph replays between CUDA events (skinny_bench.graph_us) and checked against a torch
reference of the same sums (a broken barrier reads a stale value and fails the check).

    python benchmarks/grid_barrier_probe.py [--phases 24] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from run_meta import device_kind, git_commit
from skinny_bench import graph_us

_WARPS = 8


@triton.jit
def _phase_kernel(w_ptr, out_ptr, phase, n_prog, CH: tl.constexpr):
    pid = tl.program_id(0)
    w = tl.load(w_ptr + (phase * n_prog + pid).to(tl.int64) * CH + tl.arange(0, CH))
    acc = tl.sum(w.to(tl.float32), axis=0)
    if phase > 0:
        acc += tl.load(out_ptr + (phase - 1) * n_prog + (pid + 1) % n_prog)
    tl.store(out_ptr + phase * n_prog + pid, acc)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Arrive, then wait until `target` programs have arrived in all (the counter only
    grows within a launch: phase k waits for k * n_prog arrivals)."""
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _persistent_kernel(
    w_ptr, out_ptr, counter_ptr, n_prog, PHASES: tl.constexpr, CH: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = tl.arange(0, CH)
    w = tl.load(w_ptr + pid.to(tl.int64) * CH + offs)
    for phase in range(PHASES):
        if not PREFETCH:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if phase > 0:
                w = tl.load(w_ptr + (phase * n_prog + pid).to(tl.int64) * CH + offs)
        acc = tl.sum(w.to(tl.float32), axis=0)
        if phase > 0:
            acc += tl.load(out_ptr + (phase - 1) * n_prog + (pid + 1) % n_prog)
        tl.store(out_ptr + phase * n_prog + pid, acc)
        if phase + 1 < PHASES:
            if PREFETCH:  # the next phase's weights, before waiting for this phase
                w = tl.load(w_ptr + ((phase + 1) * n_prog + pid).to(tl.int64) * CH + offs)
            _grid_barrier(counter_ptr, (phase + 1) * n_prog)


def reference(w: torch.Tensor, phases: int, n_prog: int) -> torch.Tensor:
    sums = w.view(phases, n_prog, -1).float().sum(-1)
    out = torch.empty_like(sums)
    for p in range(phases):
        out[p] = sums[p]
        if p:
            out[p] += out[p - 1].roll(-1)
    return out


def run(phases: int, phase_mb: float) -> list[dict]:
    n_prog = torch.cuda.get_device_properties(0).multi_processor_count
    ch = triton.next_power_of_2(int(phase_mb * 2**20 / 2 / n_prog))
    w = torch.randn(phases * n_prog * ch, device="cuda").to(torch.bfloat16)
    want = reference(w, phases, n_prog)
    out = torch.zeros(phases * n_prog, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def graph_case():
        for p in range(phases):
            _phase_kernel[(n_prog,)](w, out, p, n_prog, CH=ch, num_warps=_WARPS)

    def persistent(prefetch: bool):
        def launch():
            counter.zero_()
            _persistent_kernel[(n_prog,)](
                w, out, counter, n_prog, PHASES=phases, CH=ch, PREFETCH=prefetch,
                num_warps=_WARPS,
            )  # fmt: skip

        return launch

    def zero_only():
        counter.zero_()

    rows = []
    phase_bytes = n_prog * ch * 2
    for name, fn in (
        ("graph", graph_case),
        ("barrier", persistent(False)),
        ("barrier+prefetch", persistent(True)),
        ("counter zero_ alone", zero_only),
    ):
        out.zero_()
        ms = graph_us([fn], reps=50) / 1e3  # one replay: all phases
        ok = name.startswith("counter") or torch.allclose(
            out.view(phases, n_prog), want, rtol=1e-4, atol=1e-2
        )
        rows.append(
            {
                "case": name, "phases": phases, "phase_bytes": phase_bytes,
                "ms": round(ms, 5), "us_per_phase": round(ms * 1e3 / phases, 3),
                "bytes_floor_us_per_phase": round(phase_bytes / 4.28e12 * 1e6, 3),
                "correct": bool(ok),
            }
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", type=int, default=24)
    ap.add_argument("--phase-mb", default="1,4,8", help="MB streamed per phase, comma list")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("grid_barrier_probe needs a GPU", file=sys.stderr)
        return 2
    rows = []
    for mb in args.phase_mb.split(","):
        rows += run(args.phases, float(mb))
    result = {
        "device": torch.cuda.get_device_name(0),
        "commit": git_commit(),
        "command": " ".join(["benchmarks/grid_barrier_probe.py", *sys.argv[1:]]),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"grid_barrier_probe_{device_kind()}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
