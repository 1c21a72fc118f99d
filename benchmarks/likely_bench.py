"""Host time of async scheduling's early-read judge (`Drafter.likely`) against the n-gram
search it replaced, per step, over requests that grow by a token a step. Prints JSON. Not
a test (tests/test_speculative.py checks the two agree).

    python benchmarks/likely_bench.py [--requests 32] [--prompt 256] [--steps 256]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from run_meta import git_commit

from pdserve import SamplingParams
from pdserve.runner.config import SpeculativeConfig
from pdserve.runner.request import Request
from pdserve.runner.speculative.drafter import Drafter
from pdserve.runner.speculative.ngram import NgramProposer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=150_000)
    args = ap.parse_args()
    rng = random.Random(0)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), 1 << 20)
    search = NgramProposer(1, drafter.shortest, drafter.config.prompt_lookup_max)
    params = SamplingParams(max_tokens=args.steps + 8)
    reqs = [Request(f"r{i}", [rng.randrange(args.vocab) for _ in range(args.prompt)], params,
                    seed=0) for i in range(args.requests)]  # fmt: skip
    runs, searched = [], []
    for _ in range(args.steps):
        for r in reqs:
            r.append_output_token(rng.randrange(args.vocab))
        t0 = time.perf_counter()
        said = [drafter.likely(r) for r in reqs]
        t1 = time.perf_counter()
        want = [bool(search.propose(drafter.tokens(r), 1)) for r in reqs]
        t2 = time.perf_counter()
        assert said == want
        runs.append(t1 - t0)
        searched.append(t2 - t1)
    print(json.dumps({
        "requests": args.requests, "tokens": [args.prompt, args.prompt + args.steps],
        "likely_us_per_step_p50": round(statistics.median(runs) * 1e6, 1),
        "search_us_per_step_p50": round(statistics.median(searched) * 1e6, 1),
        "commit": git_commit(), "command": "python benchmarks/likely_bench.py",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
