"""Parity of the decode attention with the q/k/v preparation folded in
(`decode_prep_attention`) with its spec: `prepare_qkv_ref` (the cache write, q) then
`paged_attention_ref`, over the same inputs.

Without CUDA the kernel runs under Triton's interpreter at small awkward sizes (head dims 24
and 80, 3 query heads over 1 kv head, block size 4); with CUDA at the Qwen3-0.6B shape too,
in bf16. Rows of every kind: a pad row (no context), a row whose only key is the newest
token, rows ending inside and at the end of a key tile, and, with splits, a row whose
last slice holds only the newest token (an empty loop). The cache is compared with the
preparation's tolerance (`test_qkv_prep._close_after_norm`: the norm's sum of squares is
reduced in another order), v bit-exactly; the output with the attention tests' bound,
plus the q ulp that the same norm order may move.
"""

from __future__ import annotations

import pytest
import torch
from test_qkv_prep import _close_after_norm
from test_triton_index_kernels import DEVICE, ON_CUDA, _gen

import pdserve.kernels.decode_prep_attention as dpa
import pdserve.kernels.paged_attention_triton as pat
from pdserve.kernels.attention import paged_attention_ref
from pdserve.kernels.qkv_prep import prepare_qkv_ref
from pdserve.kernels.row_squares import SQ_ROWS, RowSquares, ScaleRows
from pdserve.kernels.workspace import KernelWorkspace

# (contexts, Hq, Hkv, D, block size); a context of 0 is a pad row.
SMALL = [
    ([5, 1, 0, 8, 3], 4, 2, 24, 4),
    ([2, 9, 4], 3, 1, 80, 4),
]
REAL = [([256 + 3 * r for r in range(32)], 16, 8, 128, 16), ([1, 64, 65, 0, 200], 16, 8, 128, 16)]
CASES = SMALL + (REAL if ON_CUDA else [])
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def _inputs(contexts, hq, hkv, d, bs, dtype, seed, with_norm=True, scaled=False, bias=False):
    g = _gen(seed)
    rows = len(contexts)
    per_row = max(-(-c // bs) for c in contexts) + 1
    num_blocks = rows * per_row + 1
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=g).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: rows * per_row] + 1).view(rows, -1)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    positions = (seq_lens.long() - 1).clamp(min=0)
    slots = tables[torch.arange(rows), positions // bs] * bs + positions % bs
    slots[seq_lens == 0] = -1
    qkv = (3 * torch.randn(rows, (hq + 2 * hkv) * d, generator=g)).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    qw = kw = None
    if with_norm:
        qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
        kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    scale_rows = b = None
    if scaled:  # the folded chain: squares in 3 parts of a 96-wide stream, an unadded bias
        sq = torch.rand(3 * SQ_ROWS, generator=g) * 100
        scale_rows = ScaleRows(RowSquares(sq.to(DEVICE), 3, 96), 1e-6)
        if bias:
            b = (0.5 * torch.randn(qkv.shape[1], generator=g)).to(dtype).to(DEVICE)
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return dict(
        qkv=to(qkv), num_q_heads=hq, num_kv_heads=hkv, q_norm_weight=to(qw),
        k_norm_weight=to(kw), eps=1e-6, positions=to(positions), cos_sin_cache=to(cos_sin),
        kv_cache=to(cache), slot_mapping=to(slots), block_tables=to(tables.int()),
        seq_lens=to(seq_lens), scale=d**-0.5, max_seq_len=max(contexts),
        scale_rows=scale_rows, bias=b,
    )  # fmt: skip


def _reference(inp):
    """The two-kernel path's spec: the preparation (writes the cache), then attention."""
    cache = inp["kv_cache"].clone()
    q = prepare_qkv_ref(
        inp["qkv"], inp["num_q_heads"], inp["num_kv_heads"], inp["q_norm_weight"],
        inp["k_norm_weight"], inp["eps"], inp["positions"], inp["cos_sin_cache"], cache,
        inp["slot_mapping"], inp["scale_rows"], inp["bias"],
    )  # fmt: skip
    out = torch.empty_like(q)
    rows = q.shape[0]
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=q.device)
    paged_attention_ref(
        q, cache, inp["block_tables"], qsl, inp["seq_lens"], inp["scale"], out, 1,
        inp["max_seq_len"],
    )  # fmt: skip
    return out, cache


def _fused(inp, **kwargs):
    inp = dict(inp, kv_cache=inp["kv_cache"].clone(), workspace=KernelWorkspace(), **kwargs)
    return dpa.decode_prep_attention(**inp), inp["kv_cache"]


def _check(inp, out, cache):
    ref_out, ref_cache = _reference(inp)
    _close_after_norm(cache, ref_cache)
    assert torch.equal(cache[:, 1], ref_cache[:, 1]), "v is a copy: bit-exact"
    pad = inp["seq_lens"] == 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "pad rows get zeros"
    out, ref = out[~pad].double(), ref_out[~pad].double()
    assert not out.isnan().any()
    if out.dtype == torch.float32 or inp["qkv"].dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
        return
    # The attention tests' bound u (|ref| + max |V|), doubled: q itself may sit an ulp away
    # (the norm's sum order), which moves each score by ~u |s|.
    u = 2.0**-8 if inp["qkv"].dtype == torch.bfloat16 else 2.0**-11
    v_max = ref_cache[:, 1].double().abs().max().item()
    err, bound = (out - ref).abs(), 2 * u * (ref.abs() + v_max)
    assert (err <= bound).all(), f"max excess {float((err - bound).max()):.3g}"
    assert float(err.mean()) < u / 2, f"mean error {float(err.mean()):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}rows-{c[1]}q{c[2]}kv-d{c[3]}")
@pytest.mark.parametrize("q_in_loop", [True, False], ids=["q_in_loop", "q_before_loop"])
def test_matches_prepare_then_attend(case, dtype, q_in_loop):
    inp = _inputs(*case, dtype, seed=len(case[0]))
    _check(inp, *_fused(inp, q_in_loop=q_in_loop))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gathered_cos_sin_rows_give_the_same_bits(dtype):
    """Guards `cos_sin_rows`: the rows' cos/sin gathered once (`cache[positions]`) and read
    by row instead of by position: the same values, so bitwise the same output and cache."""
    inp = _inputs([5, 1, 0, 8, 3], 4, 2, 24, 4, dtype, seed=8, scaled=True)
    out, cache = _fused(inp)
    rows = inp["cos_sin_cache"].index_select(0, inp["positions"])
    out_rows, cache_rows = _fused(dict(inp, cos_sin_cache=rows), cos_sin_rows=True)
    assert torch.equal(out, out_rows) and torch.equal(cache, cache_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("variant", ["no_norm", "scaled", "scaled_bias"])
def test_norm_scale_and_bias_variants(dtype, variant):
    """Llama (no q/k norm) and the folded-norm chain (rows scaled by their RMSNorm factor,
    the projection's bias added after it)."""
    inp = _inputs([6, 1, 0, 13], 4, 2, 24, 4, dtype, seed=3, with_norm=variant != "no_norm",
                  scaled=variant != "no_norm", bias=variant == "scaled_bias")  # fmt: skip
    _check(inp, *_fused(inp))


@pytest.mark.parametrize("q_in_loop", [True, False], ids=["q_in_loop", "q_before_loop"])
def test_split_slices_and_merge(monkeypatch, q_in_loop):
    """Several slices per row (slices of 64 keys, as the 16-bit tile has): a row ending one
    past a slice boundary has a last slice with no cached key at all (65, 129), a row of
    one key only the newest token; the last arriver merges, and leaves its counter at 0."""
    monkeypatch.setattr(pat, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(dpa, "MIN_SPLIT_KEYS", 16)
    inp = _inputs([65, 1, 129, 0, 130, 64, 100], 4, 2, 24, 4, torch.float16, seed=5)
    inp["max_seq_len"] = 256  # a graph's bound: more slices than most rows fill
    work = KernelWorkspace()
    out, cache = _fused(dict(inp), q_in_loop=q_in_loop)
    _check(inp, out, cache)
    inp2 = dict(inp, kv_cache=inp["kv_cache"].clone(), workspace=work, q_in_loop=q_in_loop)
    dpa.decode_prep_attention(**inp2)
    counters = work.counters("decode_attention", 7 * 2, torch.device(DEVICE))
    assert int(counters.abs().sum()) == 0, "the merging program resets its counter"


def test_model_dispatch():
    """Which batches the model sends to the fused kernel: decode rows of 16-bit heads up
    to 128 through the per-head kernel, no prefill rows, nothing past 64 rows."""
    qkv = torch.zeros(32, 4096, dtype=torch.bfloat16)
    assert dpa.fused_prep_applies(qkv, 8, 128, 1, None)
    assert dpa.fused_prep_applies(qkv, 8, 128, 1, "per_head")
    assert not dpa.fused_prep_applies(qkv, 8, 128, 2, None), "prefill rows"
    assert not dpa.fused_prep_applies(qkv, 8, 128, 1, "flat")
    assert not dpa.fused_prep_applies(qkv, 8, 256, 1, None), "head dim 256"
    assert not dpa.fused_prep_applies(qkv.float(), 8, 128, 1, None), "float32"
    assert not dpa.fused_prep_applies(torch.zeros(65, 4096, dtype=torch.bfloat16), 8, 128, 1, None)


def test_bad_shapes_are_refused():
    inp = _inputs([3, 2], 2, 1, 24, 4, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="qkv is"):
        _fused(dict(inp, num_q_heads=3))
    with pytest.raises(AssertionError, match="come together"):
        _fused(dict(inp, k_norm_weight=None))
