"""Parity of the fused attention-input kernel (`prepare_qkv_triton`: q/k RMSNorm, RoPE, KV
write in one launch) with its spec (`prepare_qkv_ref`, the three reference steps the model
ran before), and the model's use of it.

Without CUDA the kernel runs under Triton's interpreter at small awkward sizes (head dims
24 and 80: halves that are not a power of two; 3 q heads over 1 kv head); with CUDA at
the real ones too, in bf16. Tolerances are those of `test_triton_layer_kernels` (the
norm's float32 sum of squares may round differently; everything after it rounds where the
reference rounds).
"""

from __future__ import annotations

import pytest
import torch
from test_triton_index_kernels import DEVICE, ON_CUDA, _gen
from test_triton_layer_kernels import _assert_close

from pdserve.kernels.qkv_prep import prepare_qkv_ref, prepare_qkv_triton

SMALL = [(1, 2, 1, 24), (7, 3, 1, 80), (33, 4, 2, 128)]  # (T, Hq, Hkv, D)
REAL = SMALL + [(32, 16, 8, 128), (8192, 16, 8, 128)]
CASES = REAL if ON_CUDA else SMALL
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
BLOCK_SIZE = 16


def _inputs(t, hq, hkv, d, dtype, seed, with_norm=True, short_slots=False):
    g = _gen(seed)
    qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, generator=g)).to(dtype)
    num_blocks = t // BLOCK_SIZE + 3
    cache = torch.randn(num_blocks, 2, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1  # pads, interleaved
    if short_slots:  # a slot mapping shorter than the tokens: the rest write nothing
        slots = slots[: max(1, t // 2)]
    positions = torch.randint(0, 4096, (t,), generator=g)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    qw = kw = None
    if with_norm:
        qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
        kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return dict(
        qkv=to(qkv), num_q_heads=hq, num_kv_heads=hkv, q_norm_weight=to(qw),
        k_norm_weight=to(kw), eps=1e-6, positions=to(positions), cos_sin_cache=to(cos_sin),
        kv_cache=to(cache), slot_mapping=to(slots),
    )  # fmt: skip


def _close_after_norm(actual, expected):
    """`_assert_close`, plus, for 16-bit dtypes, an absolute slack of 2 ulps at the
    largest magnitude: the norm's float32 sum of squares may round one normed value the
    other way (see `_assert_close`), and rope's `x1 c - x2 s` then carries that ulp of x
    into an output that cancellation may have made far smaller than x (seen on the H200:
    7 of 16.7M bf16 outputs, 0.0078 apart at |x| ~ 4). The at-most-1% rule still holds."""
    if actual.dtype == torch.float32:
        return _assert_close(actual, expected)
    slack = 2 * torch.finfo(actual.dtype).eps * expected.float().abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=2 * torch.finfo(actual.dtype).eps, atol=slack)
    mismatch = (actual != expected).float().mean().item()
    assert mismatch <= 0.01, f"{mismatch:.2%} of elements differ"


def _run(fn, inp):
    inp = dict(inp, kv_cache=inp["kv_cache"].clone())
    return fn(**inp), inp["kv_cache"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
def test_prepare_qkv_matches_ref(case, dtype, with_norm):
    """Guards q/k/v taken from the wrong part of the fused row, the norm over half a head
    or without its weight, rope halves swapped, k written before its norm/rope, v rotated,
    pads (slot -1) written, and a head dim whose half is not a power of two spilling into
    the next head."""
    inp = _inputs(*case, dtype, seed=sum(case), with_norm=with_norm)
    q_ref, cache_ref = _run(prepare_qkv_ref, inp)
    q, cache = _run(prepare_qkv_triton, inp)
    _close_after_norm(q, q_ref)
    _close_after_norm(cache, cache_ref)
    assert torch.equal(cache[:, 1], cache_ref[:, 1]), "v is a copy: bit-exact"
    if not with_norm:  # no reduction left: every rounding point is the reference's
        assert torch.equal(q, q_ref) and torch.equal(cache, cache_ref)


def test_slot_mapping_shorter_than_tokens():
    """Guards tokens past the slot mapping (a padded token buffer): q is still computed,
    nothing is written for them, and no slot is read past the mapping's end."""
    inp = _inputs(9, 2, 1, 24, torch.float32, seed=4, short_slots=True)
    q_ref, cache_ref = _run(prepare_qkv_ref, inp)
    q, cache = _run(prepare_qkv_triton, inp)
    _assert_close(q, q_ref)
    _assert_close(cache, cache_ref)
    assert torch.equal(cache[:, 1], cache_ref[:, 1])


def test_cpu_dispatch_runs_the_reference(monkeypatch):
    """Guards the dispatch: CPU tensors take the reference (the CPU model path must not
    depend on Triton's interpreter)."""
    import pdserve.kernels.qkv_prep as qkv_prep

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU tensors")

    monkeypatch.setattr(qkv_prep, "prepare_qkv_triton", refuse)
    inp = {
        k: v.cpu() if torch.is_tensor(v) else v
        for k, v in _inputs(5, 2, 1, 24, torch.float32, seed=9).items()
    }
    q_a, c_a = _run(qkv_prep.prepare_qkv, inp)
    q_b, c_b = _run(prepare_qkv_ref, inp)
    assert torch.equal(q_a, q_b) and torch.equal(c_a, c_b)


def test_bad_shapes_are_refused():
    inp = _inputs(3, 2, 1, 24, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="qkv is"):
        prepare_qkv_triton(**dict(inp, num_q_heads=3))
    with pytest.raises(AssertionError, match="come together"):
        prepare_qkv_triton(**dict(inp, k_norm_weight=None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled_rows"])
def test_head_split_grid_equals_token_grid(monkeypatch, dtype, scaled):
    """Guards the decode grid (one program per head, tokens <= SPLIT_HEADS_MAX_TOKENS): the
    same math as one program per token, so bitwise the same q and cache, pads included."""
    import pdserve.kernels.qkv_prep as qkv_prep
    from pdserve.kernels.row_squares import SQ_ROWS, RowSquares, ScaleRows

    inp = _inputs(9, 4, 2, 24, dtype, seed=31)
    if scaled:
        sq = torch.rand(3 * SQ_ROWS, generator=_gen(2)).to(DEVICE) * 100
        inp = dict(inp, scale_rows=ScaleRows(RowSquares(sq, 3, 96), 1e-6))
    split_q, split_cache = _run(prepare_qkv_triton, inp)
    monkeypatch.setattr(qkv_prep, "SPLIT_HEADS_MAX_TOKENS", 0)
    token_q, token_cache = _run(prepare_qkv_triton, inp)
    assert torch.equal(split_q, token_q) and torch.equal(split_cache, token_cache)
    assert not torch.equal(split_cache, inp["kv_cache"]), "nothing written"
