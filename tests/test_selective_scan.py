"""Mamba1's selective scan kernel (kernels/selective_scan.py) against its torch spec: rows
of several tokens beside one-token rows, the per-token (decode) form, channel and state
counts that are not powers of two or not multiples of the channel block, fresh rows
beside continuing ones, units that are not the row numbers, float32 and 16-bit caches.
Without CUDA through Triton's interpreter (float16 caches there: its bfloat16 stores
truncate where the GPU rounds, as in test_ssm_update); with CUDA also at Jamba's layer
size (8,192 channels, state 16) and a 2,048-token prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from test_ssm_update import assert_kernel_matches_spec

from pdserve.kernels.selective_scan import selective_scan_ref, selective_scan_triton

# (row lengths, or None for one token a row of `rows`; channels D; state N)
CASES = [
    ([5, 1, 3, 7], 40, 12),
    ([1, 1, 1], 24, 16),
    ([33], 70, 16),
    (None, 37, 16),
    (None, 8, 5),
]
CACHE_DTYPES = [torch.float32, torch.float16]
if DEVICE == "cuda":
    CASES += [([2048], 8192, 16), ([300, 1, 1, 700, 64], 8192, 16), (None, 8192, 16)]
    CACHE_DTYPES.append(torch.bfloat16)


def _inputs(lengths, channels, state, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 6 if lengths is None else len(lengths)
    tokens = rows if lengths is None else sum(lengths)
    units = torch.randperm(rows + 3, generator=g)[:rows]  # not the row numbers, 3 unused
    fresh = torch.rand(rows, generator=g) < 0.4
    fresh[0] = False  # a continuing row in every case
    cache = torch.randn(rows + 3, channels, state, generator=g).to(cache_dtype)
    f32 = dict(dtype=torch.float32)
    u = torch.randn(tokens, channels, generator=g, **f32)
    delta = torch.rand(tokens, channels, generator=g, **f32) * 0.5  # softplus: positive
    a = -torch.rand(channels, state, generator=g, **f32) * 4
    b = torch.randn(tokens, state, generator=g, **f32)
    c = torch.randn(tokens, state, generator=g, **f32)
    d_skip = torch.randn(channels, generator=g, **f32)
    qs = None
    if lengths is not None:
        qs = torch.cumsum(torch.tensor([0, *lengths]), 0).to(DEVICE)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    rest = tuple(map(on, (u, delta, a, b, c, d_skip)))
    return cache.to(DEVICE), (on(units), on(fresh), qs, *rest)


def _case_id(case) -> str:
    lengths, channels, state = case
    rows = "per_token" if lengths is None else "x".join(map(str, lengths))
    return f"{rows}-D{channels}-N{state}"


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_kernel_scans_as_the_spec_does(case, cache_dtype):
    """Guards a row's token range (query_start, or token r in the per-token form), a fresh
    row reading its unit, the decay's [D, N] layout, the masked tails of D and N, and a
    unit's tile at the wrong offset (untouched units must stay bitwise as they were)."""
    cache, args = _inputs(*case, cache_dtype, seed=len(case[0] or ()) + case[1] + case[2])
    assert_kernel_matches_spec(selective_scan_ref, selective_scan_triton, cache, args)


def test_the_specs_two_forms_agree():
    """One token a row: the spec's batched form (no query_start) equals its row loop."""
    cache, (units, fresh, _, *rest) = _inputs([1] * 6, 24, 16, torch.float32, seed=3)
    looped, batched = cache.clone(), cache.clone()
    qs = torch.arange(7, device=cache.device)
    want = selective_scan_ref(looped, units, fresh, qs, *rest)
    got = selective_scan_ref(batched, units, fresh, None, *rest)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batched, looped, rtol=1e-6, atol=1e-6)


def test_a_fresh_row_ignores_what_its_unit_holds():
    """A fresh row's unit may hold anything (a finished request's state, NaN): the scan
    starts from zero in both forms."""
    for qs in (None, torch.tensor([0, 3, 4, 6, 7, 9, 10])):
        lengths = None if qs is None else torch.diff(qs).tolist()
        cache, (units, fresh, _, *rest) = _inputs(lengths, 24, 16, torch.float32, seed=5)
        fresh[:] = True
        qs = None if qs is None else qs.to(cache.device)
        clean, poisoned = cache.clone(), cache.clone()
        clean[units] = 0.0
        poisoned[units] = float("nan")
        want = selective_scan_ref(clean, units, fresh, qs, *rest)
        for fn in (selective_scan_ref, selective_scan_triton):
            got_cache = poisoned.clone()
            got = fn(got_cache, units, fresh, qs, *rest)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_cache[units], clean[units], rtol=1e-5, atol=1e-5)
