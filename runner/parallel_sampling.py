"""n > 1: one request fans out into n independent n=1 children with derived seeds."""

from __future__ import annotations

import dataclasses

from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.seeding import derive_seed


def child_params(params: SamplingParams, base_seed: int) -> list[SamplingParams]:
    """Child 0 keeps `base_seed` (n=2 does not change the first completion); child i > 0
    samples with `derive_seed(base_seed, i)`. Greedy children are identical by design."""
    return [
        dataclasses.replace(params, n=1, seed=base_seed if i == 0 else derive_seed(base_seed, i))
        for i in range(params.n)
    ]
