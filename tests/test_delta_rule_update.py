"""The gated delta rule's decode-step kernel (kernels/delta_rule_update.py) against its
torch spec: dims not powers of two, dv split over several programs, fresh rows beside
continuing ones, units that are not the row numbers, float32 and 16-bit caches (bfloat16
on CUDA only: Triton's interpreter truncates bfloat16 stores, see test_ssm_update)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from test_ssm_update import assert_kernel_matches_spec

from pdserve.kernels.delta_rule_update import delta_rule_decode_ref, delta_rule_decode_triton

# (rows, heads, dk, dv)
CASES = [(5, 3, 12, 20), (3, 4, 8, 16), (2, 2, 128, 128)]
CACHE_DTYPES = [torch.float32, torch.float16]
if DEVICE == "cuda":
    CASES.append((256, 32, 128, 128))
    CACHE_DTYPES.append(torch.bfloat16)


def _inputs(rows, heads, dk, dv, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    units = torch.randperm(rows + 3, generator=g)[:rows]
    fresh = torch.rand(rows, generator=g) < 0.4
    cache = (0.3 * torch.randn(rows + 3, heads, dk, dv, generator=g)).to(cache_dtype)
    q = torch.randn(rows, heads, dk, generator=g) * dk**-0.5
    k = torch.randn(rows, heads, dk, generator=g)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(rows, heads, dv, generator=g)
    beta = torch.rand(rows, heads, generator=g)
    log_decay = -torch.rand(rows, heads, generator=g)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return cache.to(DEVICE), tuple(map(on, (units, fresh, q, k, v, beta, log_decay)))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_kernel_updates_states_as_the_spec_does(case, cache_dtype):
    """Guards the decay before the read (S^T k of the decayed state), beta on the error
    not the state, the rank-one update's orientation (k rows, u columns), a fresh row
    reading its stale state, a unit's tile at the wrong offset (untouched units stay
    bitwise), and masked dk/dv tails."""
    cache, args = _inputs(*case, cache_dtype, seed=sum(case))
    assert_kernel_matches_spec(delta_rule_decode_ref, delta_rule_decode_triton, cache, args)
