"""Benchmark of one recurrent mixer's prompt step; prints and writes JSON.

Not a test. `--mixer mamba2` (the default): a Granite-4.0-H-Tiny-shaped Mamba2 mixer
(runner/models/mamba2.py; hidden 1536, 48 heads of 64, state 128, one group, conv 4, scan
chunks of 256). `--mixer gated_deltanet`: a Qwen3-Next-80B-shaped Gated DeltaNet
(runner/models/gated_deltanet.py; hidden 2048, 16 key heads and 32 value heads of 128,
conv 4). `--mixer mamba1`: a Jamba-1.5-Mini-shaped Mamba1 mixer (runner/models/mamba1.py;
hidden 4096, 8,192 channels, state 16, dt rank 256, conv 4). Random weights; one step of R prompt chunks of the given lengths, fresh or
continuing from a state, and, for the mixed case, decode rows beside them. Reported per
case: milliseconds per forward (median of `--reps`), on the CPU or the GPU it finds.

    python benchmarks/mamba_prefill_bench.py [--mixer gated_deltanet|mamba1] [--dtype bfloat16]
        [--reps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from run_meta import write_result

from pdserve.runner.models.gated_deltanet import GatedDeltaNet
from pdserve.runner.models.mamba1 import Mamba1Mixer
from pdserve.runner.models.mamba2 import Mamba2Mixer, MambaStep

# name -> (prompt chunk lengths, decode rows)
CASES = {
    "1x2048": ([2048], 0),
    "8x512": ([512] * 8, 0),
    "32x256": ([256] * 32, 0),
    "16_mixed_lengths": (
        [37, 600, 256, 1024, 5, 90, 300, 700, 12, 256, 512, 64, 128, 40, 900, 333],
        0,
    ),  # fmt: skip
    "4x512+60_decode": ([512] * 4, 60),
}


class _Cfg:
    model_type = "bamba"
    hidden_size, rms_norm_eps = 1536, 1e-5
    mamba_n_heads, mamba_d_head, mamba_n_groups, mamba_d_state = 48, 64, 1, 128
    mamba_d_conv, mamba_chunk_size = 4, 256
    time_step_limit = (0.0, float("inf"))


class _DeltaCfg:
    hidden_size, rms_norm_eps = 2048, 1e-6
    linear_num_key_heads, linear_num_value_heads = 16, 32
    linear_key_head_dim = linear_value_head_dim = 128
    linear_conv_kernel_dim = 4


class _JambaCfg:
    hidden_size, rms_norm_eps = 4096, 1e-6
    mamba_expand, mamba_d_state, mamba_dt_rank, mamba_d_conv = 2, 16, 256, 4
    mamba_proj_bias, mamba_conv_bias = False, True


MIXERS = {
    "mamba2": lambda: Mamba2Mixer(_Cfg(), 0),
    "gated_deltanet": lambda: GatedDeltaNet(_DeltaCfg(), 0),
    "mamba1": lambda: Mamba1Mixer(_JambaCfg(), 0),
}


def run(case: str, mixer_name: str, dtype: torch.dtype, device: torch.device, reps: int) -> dict:
    lengths, decodes = CASES[case]
    counts = np.array(lengths + [1] * decodes)
    rows = len(counts)
    mixer = MIXERS[mixer_name]().to(device)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.02)
        a = torch.linspace(0.5, 8, mixer.A_log.numel()).view_as(mixer.A_log)
        mixer.A_log.copy_(torch.log(a))
    mixer = mixer.to(dtype)
    conv_shape, ssm_shape = mixer.state_shapes
    conv = torch.zeros(rows, *conv_shape, dtype=dtype, device=device)
    ssm = torch.zeros(rows, *ssm_shape, dtype=torch.float32, device=device)
    qs = np.concatenate([[0], np.cumsum(counts)])
    fresh = np.array([True] * len(lengths) + [False] * decodes)
    step = MambaStep(torch.arange(rows, device=device), qs, fresh,
                     torch.from_numpy(fresh).to(device))  # fmt: skip
    hidden = mixer.out_proj.out_features
    x = torch.randn(int(qs[-1]), hidden, dtype=dtype, device=device)
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            mixer(x, step, conv, ssm)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is warm-up
                times.append((time.perf_counter() - start) * 1e3)
    return {"case": case, "rows": rows, "tokens": int(qs[-1]), "ms": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixer", choices=sorted(MIXERS), default="mamba2")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rows = [run(c, args.mixer, dtype, device, args.reps) for c in args.cases.split(",")]
    for r in rows:
        print(f"{r['case']:>18}: {r['ms']:9.2f} ms ({r['rows']} rows, {r['tokens']} tokens)")
    if args.out:
        stem = "mamba_prefill" if args.mixer == "mamba2" else f"{args.mixer}_prefill"
        write_result(args.out, stem, __file__, sys.argv,
                     {"dtype": str(dtype).removeprefix("torch."), "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
