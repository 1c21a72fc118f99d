"""Speculative decoding's cost and gain on the random-weight Qwen3-0.6B shape.

    python benchmarks/spec_decode_bench.py [--requests 32] [--prompt-len 256]
        [--output-len 256] [--k 1,3,5] [--pattern 16] [--profile N] [--sync-baseline]
        [--sync-drafts] [--temperature T] [--out benchmarks/results/DIR]

Greedy decoding of prompts that repeat a random `--pattern`-token phrase, once without
drafts and once per `--k` with n-gram drafts (`num_speculative_tokens` = k,
`prompt_lookup_max` 4). Per run: output tok/s, TPOT p50, steps by path, the drafts and how
many were kept, and the mean step time. A random model's text is not a real model's, so the
acceptance here is whatever its greedy loops give; what carries over is the step time of a
drafted batch against a plain one, i.e. the acceptance a workload needs before drafts pay
(every run keeps async scheduling, which waits for a step with drafts where it launches it
and overlaps the others; `--sync-baseline` and `--sync-drafts` add the runs without drafts
and with them under synchronous scheduling). `--pattern` equal to `--prompt-len` gives
prompts that do not repeat:

    gain = (1 + kept per drafted row-step) x (plain step time / drafted step time)

The random model's greedy replies loop, so they draft even then; `--temperature` above 0
samples every run instead, and with prompts that do not repeat no step drafts: what is
left is what drafting costs a workload it cannot help.

With `--profile N` each k runs once more under cProfile (times inflated by it, so apart from
the timed run) and its row gets `host_top`: the N functions with the most own time, and
`host_ms_per_step` by where the code lives (this repository, torch, the rest).

This is a benchmark, not a test: it measures and writes JSON; tests/ checks correctness.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
from pathlib import Path

import numpy as np
import torch
from run_meta import git_commit
from throughput import Workload, random_model_engine, run_engine


def prompts(n: int, length: int, pattern: int, vocab: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(0, vocab, size=pattern).tolist()
        out.append((phrase * (length // pattern + 1))[:length])
    return out


def run(engine, reqs: list[list[int]], output_len: int, temperature: float = 0.0) -> dict:
    """throughput.py's run (forced length) plus the drafts' counters."""
    s = engine.scheduler
    before = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
    stats = engine.stats
    waits = (stats.spec_sync_steps, stats.spec_drains)
    w = Workload("spec", len(reqs), len(reqs[0]), output_len, "output_tok_s")
    row = run_engine(engine, w, reqs, temperature)
    drafts, drafted, kept = (x - y for x, y in zip((s.num_drafts, s.num_draft_tokens,
                                                    s.num_accepted_tokens), before))  # fmt: skip
    return {
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
        "ms_per_step": round(1e3 * row["elapsed_s"] / max(row["steps"], 1), 3),
        "draft_steps": dict(getattr(engine.runner, "draft_steps", {})),
        # async scheduling with drafts: steps waited where launched, in-flight steps read early
        "spec_sync_steps": stats.spec_sync_steps - waits[0],
        "spec_drains": stats.spec_drains - waits[1],
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": kept,
        "acceptance_rate": round(kept / drafted, 4) if drafted else None,
        "mean_acceptance_length": round(1 + kept / drafts, 3) if drafts else None,
    }


def profiled(engine, reqs: list[list[int]], output_len: int, top: int, temperature: float) -> dict:
    """`run` under cProfile: the functions with the most own time, and the split."""
    prof = cProfile.Profile()
    prof.enable()
    row = run(engine, reqs, output_len, temperature)
    prof.disable()
    steps = max(row["steps"], 1)
    split = {"pdserve": 0.0, "torch": 0.0, "other": 0.0}
    funcs = []
    for (filename, line, name), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        kind = "pdserve" if "/pdserve/" in filename or "/work/" in filename else (
            "torch" if "torch" in filename or "torch" in name else "other")  # fmt: skip
        split[kind] += tottime
        funcs.append((tottime, f"{filename.rsplit('/', 2)[-1]}:{line}({name})", ncalls))
    funcs.sort(reverse=True)
    return {
        "host_ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in split.items()},
        "host_top": [
            {"function": f, "ncalls": n, "ms_per_step": round(1e3 * t / steps, 4)}
            for t, f, n in funcs[:top]
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--pattern", type=int, default=16)
    ap.add_argument("--k", default="1,3,5")
    ap.add_argument("--profile", type=int, default=0, help="top N host functions per k")
    ap.add_argument(
        "--temperature", type=float, default=0.0,
        help="sample every run at this temperature (0: greedy); with --pattern equal to "
        "--prompt-len the sampled text repeats nowhere, so no step drafts",
    )  # fmt: skip
    ap.add_argument(
        "--sync-baseline", action="store_true",
        help="also run without drafts under synchronous scheduling (as the drafting runs)",
    )  # fmt: skip
    ap.add_argument(
        "--sync-drafts", action="store_true",
        help="also run each k under synchronous scheduling (as the engine did before "
        "drafts ran beside async scheduling)",
    )  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("spec_decode_bench: needs a CUDA device", file=sys.stderr)
        return 2
    reqs = prompts(args.requests, args.prompt_len, args.pattern, 151_936)
    # The warm-up's prompts repeat whatever the timed ones do, so its greedy steps draft and
    # every drafted-row kernel compiles there: a timed run whose few drafts met a cold
    # Triton cache took 0.74 s, not 0.47 (the H100, sampled text that does not repeat).
    warm = prompts(args.requests, args.prompt_len, 16, 151_936, seed=99)
    warm_sampled = prompts(args.requests, args.prompt_len, args.pattern, 151_936, seed=98)
    rows = []
    # (k, synchronous): the engine's default is async scheduling, with or without drafts;
    # --sync-baseline and --sync-drafts add the synchronous loop, so a drafted step's cost
    # splits into the scheduling's and the drafts' own
    ks = [int(x) for x in args.k.split(",")]
    runs = [(0, False)] + ([(0, True)] if args.sync_baseline else [])
    runs += [(k, False) for k in ks] + ([(k, True) for k in ks] if args.sync_drafts else [])
    for k, sync in runs:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
        engine = random_model_engine(
            max_num_seqs=max(args.requests, 1), async_scheduling=False if sync else None,
            speculative_config=spec if k else None,
        )  # fmt: skip
        # warm-up at the timed shapes, on other prompts (no prefix-cache hits later): every
        # kernel variant (each k its own drafted-row runs) compiles here, not when timed
        run(engine, warm, 8)
        if args.temperature:  # and the sampler's kernels
            run(engine, warm_sampled, 8, args.temperature)
        row = {"k": k, "sync": sync, "temperature": args.temperature,
               **run(engine, reqs, args.output_len, args.temperature)}  # fmt: skip
        if args.profile:
            row.update(profiled(engine, reqs, args.output_len, args.profile, args.temperature))
        row["device"] = torch.cuda.get_device_name()
        row["commit"] = git_commit()
        row["command"] = " ".join(sys.argv)
        print(json.dumps(row), flush=True)
        rows.append(row)
        # the engine's graphs and callbacks hold cycles: without a collection its KV cache
        # stays allocated and the next engine's budget (a share of the card less what is
        # in use) comes out negative on an 80 GB card
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    base = rows[0]["ms_per_step"]
    for row in rows[1:]:
        row["step_time_vs_plain"] = round(row["ms_per_step"] / base, 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    path = out / f"spec_decode_bench_{name}.json"
    path.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
