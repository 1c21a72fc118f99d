"""The Mamba2 decode step's state update kernel (kernels/ssm_update.py) against its torch
spec: awkward sizes (head and state dims not powers of two, heads sharing groups), fresh
rows beside continuing ones, units that are not the row numbers, float32 and bfloat16
and 16-bit caches. Without CUDA through Triton's interpreter (float16: its bfloat16 stores
truncate, where the GPU rounds to nearest, so bfloat16 runs on CUDA only, as in
test_qkv_prep); with CUDA also at Granite-4.0-H's layer size."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from pdserve.kernels.ssm_update import ssm_decode_ref, ssm_decode_triton

# (rows, heads, groups, head_dim, state)
CASES = [(5, 6, 2, 24, 20), (3, 4, 1, 8, 16), (2, 48, 1, 64, 128)]
CACHE_DTYPES = [torch.float32, torch.float16]
if DEVICE == "cuda":
    CASES.append((256, 48, 1, 64, 128))
    CACHE_DTYPES.append(torch.bfloat16)


def _inputs(rows, heads, groups, head_dim, state, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    units = torch.randperm(rows + 3, generator=g)[:rows]  # not the row numbers, 3 unused
    fresh = torch.rand(rows, generator=g) < 0.4
    cache = torch.randn(rows + 3, heads, head_dim, state, generator=g).to(cache_dtype)
    f32 = dict(dtype=torch.float32)
    x = torch.randn(rows, heads, head_dim, generator=g, **f32)
    dt = torch.rand(rows, heads, generator=g, **f32) * 0.5  # a softplus output: positive
    a = -torch.rand(heads, generator=g, **f32) * 4
    b = torch.randn(rows, groups, state, generator=g, **f32)
    c = torch.randn(rows, groups, state, generator=g, **f32)
    d_skip = torch.randn(heads, generator=g, **f32)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return cache.to(DEVICE), tuple(map(on, (units, fresh, x, dt, a, b, c, d_skip)))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_kernel_updates_states_as_the_spec_does(case, cache_dtype):
    """Guards the group of a head (h // heads per group), a fresh row reading its stale
    state, the decay on the wrong axis, a unit's tile at the wrong offset (the untouched
    units must stay bitwise as they were), and masked tails of P and N."""
    cache, args = _inputs(*case, cache_dtype, seed=sum(case))
    assert_kernel_matches_spec(ssm_decode_ref, ssm_decode_triton, cache, args)


def assert_kernel_matches_spec(spec, kernel, cache: torch.Tensor, args: tuple) -> None:
    """`kernel(cache, *args)` against `spec` on a copy of the same cache (`args[0]` the
    rows' units): outputs to 1e-5, the units it does not own bitwise as they were, its
    own within `assert_states_close`."""
    want_cache, got_cache = cache.clone(), cache.clone()
    want = spec(want_cache, *args)
    got = kernel(got_cache, *args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    untouched[args[0]] = False
    assert torch.equal(got_cache[untouched], cache[untouched])
    assert_states_close(got_cache, want_cache)


def assert_states_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """A kernel's stored states against the spec's: float32 to 1e-6; in 16 bits, float32
    states a rounding apart may round one ulp apart (at most 1% of them)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * torch.finfo(got.dtype).eps + 1e-30).all()
    assert (got != want).float().mean() < 0.01
