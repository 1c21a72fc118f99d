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


# The GPU's float32 exp (Triton's: ex2.approx after a prescale, a few ulp) is less exact
# than torch's (about one ulp), and a recurrence over thousands of tokens compounds it: on an
# H100 Jamba's 2,048-token scan ended 1.6e-3 from the spec (1e-5 was asked). So outputs and
# float32 states are held to a float64 run of the spec: the kernel may stray from it up to
# DRIFT times as far as the float32 spec does, plus 2^-20 of the largest value (the exp's
# error ratio is ~4-8 for the |x| <= 2 these decays take; a wrong index or layout errs by
# O(|y|)). Under the interpreter numpy's exp is exact to rounding: there the two stray alike.
DRIFT = 16


def _float64(args: tuple) -> tuple:
    return tuple(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in args)  # fmt: skip


def assert_drift_bounded(got, want, exact, what: str) -> None:
    """`got` (the kernel's) strays from `exact` (float64) at most DRIFT times as far as `want`
    (the float32 spec's) does, plus 2^-20 of the largest exact value."""
    err_kernel = float((got.double() - exact).abs().max())
    err_spec = float((want.double() - exact).abs().max())
    floor = 2.0**-20 * float(exact.abs().max())
    assert err_kernel <= DRIFT * err_spec + floor, (
        f"{what}: the kernel strays {err_kernel:.3g} from float64, the float32 spec {err_spec:.3g}"
    )


def assert_kernel_matches_spec(spec, kernel, cache: torch.Tensor, args: tuple) -> None:
    """`kernel(cache, *args)` against `spec` on copies of the same cache (`args[0]` the rows'
    units) and against the spec in float64: outputs within `assert_drift_bounded`, the units
    it does not own bitwise as they were, its own within `assert_states_close`."""
    want_cache, got_cache, exact_cache = cache.clone(), cache.clone(), cache.double()
    want = spec(want_cache, *args)
    got = kernel(got_cache, *args)
    exact = spec(exact_cache, *_float64(args))
    assert_drift_bounded(got, want, exact, "outputs")
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    untouched[args[0]] = False
    assert torch.equal(got_cache[untouched], cache[untouched])
    units = args[0]
    assert_states_close(got_cache[units], want_cache[units], exact_cache[units])


def assert_states_close(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> None:
    """A kernel's stored states against the spec's: float32 ones within
    `assert_drift_bounded`; 16-bit ones, stored from float32 values that drift apart by a
    few float32 ulps of the terms that made them, at most one ulp of the dtype apart at the
    larger of the two values, plus one ulp (eps) of the row's scale (the largest exact
    state along the last dim), and at most 1% of them differ at all.

    Why the row's scale: an element whose terms nearly cancel is small next to them, and
    float32's drift is relative to the terms. On an H100 such elements moved 2-216 of
    their own 16-bit ulps (78 of 134M bf16 states, the spec's own error there thousands
    of ulps), all within one eps of their row's largest state; a wrong update moves most
    elements by far more."""
    if got.dtype == torch.float32:
        assert_drift_bounded(got, want, exact, "states")
        return
    larger = torch.maximum(got.abs(), want.abs())
    ulp = (torch.nextafter(larger, torch.full_like(larger, float("inf"))) - larger).float()
    scale = exact.abs().amax(-1, keepdim=True).float() * torch.finfo(got.dtype).eps
    bound = ulp + scale + torch.finfo(torch.float32).tiny
    diff = (got.float() - want.float()).abs()
    worst = (diff / bound).max().item()
    assert (diff <= bound).all(), f"a state is {worst:.2f}x its bound from the spec's"
    assert (got != want).float().mean() < 0.01
