"""The folded-norm decode chain (runner/models/norm_fold.py) and its kernel epilogues.

Model level: a tiny random Qwen3 (q/k norm, tied head) and Qwen2 (q/k/v bias) with the
norm weights folded compute the same hidden states, KV cache and logits as the plain model
over a long prefill (the norm kernels with unit weights), a mixed prefill of three
prompts and two decode steps (the folded chain). In float32 the two differ only by the
folded weights' rounding (one fp32 rounding of W * g) and the order the squares are summed
in: relative 1e-5 at most, where a dropped row scale, residual or bias errs by O(1).

Kernel level, on Triton's interpreter without a GPU: the skinny linear's residual epilogue
(bitwise the plain output plus the residual, and its rows' sums of squares), its row-scale
epilogue, the q/k/v preparation with a row scale and a pending bias, and the layer-0
squares kernel, each against its spec.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_qkv_prep import _close_after_norm, _inputs, _run
from test_skinny_linear import ROUNDING, make

from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.qkv_prep import prepare_qkv_ref, prepare_qkv_triton
from pdserve.kernels.row_squares import (
    SQ_ROWS,
    RowSquares,
    ScaleRows,
    row_scale_ref,
    row_squares_ref,
    row_squares_triton,
)
from pdserve.kernels.skinny_linear import (
    SkinnyConfig,
    residual_linear_ref,
    scaled_linear_ref,
    skinny_linear_add_residual,
    skinny_linear_triton,
)
from pdserve.kernels.workspace import KernelWorkspace
from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.models.norm_fold import chain_applies, fold_norms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on CUDA only: the interpreter's bf16 casts truncate (test_skinny_linear).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
BLOCK = 16
BLOCKS_PER_ROW = 8


def _squares(parts: int, rows: int, dim: int, seed: int) -> RowSquares:
    """Random positive partial sums, as `parts` tiles of a [rows, dim] stream would give."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(parts * SQ_ROWS)
    view = buf.view(parts, SQ_ROWS)
    view[:, :rows] = torch.rand(parts, rows, generator=g) * dim / parts * 4
    return RowSquares(buf.to(DEVICE), parts, dim)


# ------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [1, 3])
def test_residual_epilogue_adds_and_writes_squares(dtype, split):
    """Guards the o/down epilogue: the output is the plain projection (same tiles, so
    bitwise) plus the residual, rounded once; each tile writes its features' share of the
    new stream's row sums of squares (not the projection's, not past N or M)."""
    m, n, k = 5, 70, 192
    x, w, b = make(m, n, k, dtype, True, seed=11)
    res = (3 * torch.randn(m, n, generator=torch.Generator().manual_seed(2))).to(dtype)
    res = res.to(DEVICE)
    cfg = SkinnyConfig(block_n=32, block_k=64, split_k=split, num_warps=4, num_stages=2)
    ws = KernelWorkspace()
    plain = skinny_linear_triton(x, w, b, ws, config=cfg)
    out, sq = skinny_linear_add_residual(x, w, b, res, ws, config=cfg)
    assert torch.equal(out, (plain.float() + res.float()).to(dtype))
    assert sq.parts == 3 and sq.dim == n  # ceil(70 / 32) tiles
    parts = sq.buf[: sq.parts * SQ_ROWS].view(sq.parts, SQ_ROWS)
    assert int((parts[:, m:] != 0).sum()) == 0, "rows past the batch written"
    of = out.float()
    expected = torch.stack([(of[:, j * 32 : (j + 1) * 32] ** 2).sum(-1) for j in range(3)])
    torch.testing.assert_close(parts[:, :m], expected, rtol=2**-20, atol=0.0)
    # Against the spec: the output and the full row sums, within the output's rounding
    # (twice: the projection and the sum; 2^-6 covers bf16 and the interpreter's truncation).
    ref_out, ref_sq = residual_linear_ref(x, w, b, res)
    rtol = 0.0 if dtype == torch.float32 else 2.0**-6
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=max(rtol, 1e-5), atol=1e-5)
    torch.testing.assert_close(parts[:, :m].sum(0), ref_sq, rtol=max(2 * rtol, 1e-5), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_scale_rows_epilogue(dtype, bias, split):
    """Guards the gate/up epilogue's row scale: each output row times rsqrt(the sum of its
    squares' parts / dim + eps), before the bias; parts past `parts` and rows past M left
    out; split over K, applied once, to the merged sums. Tolerance as test_skinny_linear's,
    on the scaled product."""
    m, n, k = 6, 40, 128
    x, w, b = make(m, n, k, dtype, bias, seed=7)
    scale = ScaleRows(_squares(3, m, k, seed=1), eps=1e-5)
    cfg = SkinnyConfig(block_n=16, block_k=64, split_k=split, num_warps=4, num_stages=2)
    y = skinny_linear_triton(x, w, b, KernelWorkspace(), config=cfg, scale_rows=scale)
    ref = scaled_linear_ref(x, w, b, scale).double().cpu()
    s = row_scale_ref(scale, m).double().cpu()
    bound = (
        (ROUNDING[dtype] + 2.0**-20) * ref.abs()
        + 2.0**-12 * s[:, None] * (x.double().cpu().abs() @ w.double().cpu().abs().T)
        + 1e-30
    )
    assert ((y.double().cpu() - ref).abs() <= bound).all()
    # SiLU-and-mul after the scale: the activation of the rounded scaled projections.
    x2, w2, b2 = make(m, 2 * n, k, dtype, bias, seed=8)
    gu = skinny_linear_triton(x2, w2, b2, KernelWorkspace(), config=cfg, scale_rows=scale)
    act = skinny_linear_triton(
        x2, w2, b2, KernelWorkspace(), silu_mul_output=True, config=cfg, scale_rows=scale
    )
    # The kernel's exp (numpy's under the interpreter) and torch's may differ by an fp32 ulp,
    # which can flip silu's rounding to the dtype: one ulp of silu (2 roundings) plus the
    # product's own rounding, 3 units of the dtype's rounding.
    rtol = 3 * max(ROUNDING[dtype], 2.0**-20)
    torch.testing.assert_close(act, silu_and_mul_ref(gu), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("bias", [False, True])
def test_prepare_qkv_scales_rows_and_adds_the_bias(dtype, with_norm, bias):
    """Guards the folded chain's q/k/v preparation: every value of a token's row (q, k and
    v: v has no norm to hide a missing scale) times the token's factor, plus the pending
    bias at the same column, rounded once; then the usual norm, rope and cache write."""
    t, hq, hkv, d = 7, 3, 1, 24
    inp = _inputs(t, hq, hkv, d, dtype, seed=21, with_norm=with_norm)
    g = torch.Generator().manual_seed(5)
    width = (hq + 2 * hkv) * d
    extra = {"scale_rows": ScaleRows(_squares(4, t, 1024, seed=3), eps=1e-6)}
    if bias:
        extra["bias"] = torch.randn(width, generator=g).to(dtype).to(DEVICE)
    q_ref, cache_ref = _run(prepare_qkv_ref, dict(inp, **extra))
    q, cache = _run(prepare_qkv_triton, dict(inp, **extra))
    _close_after_norm(q, q_ref)
    _close_after_norm(cache, cache_ref)
    # v is the scaled row (q and k may hide a missing scale in their norm): unscaled it
    # would be off by the factor (0.5-2 here), not an ulp.
    _, plain_cache = _run(prepare_qkv_ref, inp)
    written = cache_ref[:, 1] != inp["kv_cache"][:, 1]
    assert bool(written.any())
    assert not torch.allclose(cache_ref[:, 1][written], plain_cache[:, 1][written], rtol=0.05)
    with pytest.raises(AssertionError, match="bias comes with scale_rows"):
        prepare_qkv_ref(**dict(inp, bias=torch.zeros(width, dtype=dtype, device=DEVICE)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_squares_kernel(dtype):
    """Guards layer 0's squares: one part per row, over the full (non-power-of-two) width."""
    x = (5 * torch.randn(9, 100, generator=torch.Generator().manual_seed(4))).to(dtype)
    buf = torch.full((SQ_ROWS,), -1.0, device=DEVICE)
    sq = row_squares_triton(x.to(DEVICE), buf)
    assert sq.parts == 1 and sq.dim == 100
    torch.testing.assert_close(buf[:9].cpu(), row_squares_ref(x), rtol=2**-20, atol=0.0)
    assert bool((buf[9:] == -1).all()), "rows past the batch written"


# ------------------------------------------------------------------------------- model


def _load(path: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig

    from pdserve.runner.config import ModelConfig
    from pdserve.runner.models.loader import load_model

    cfg = AutoConfig.from_pretrained(path)
    mc = ModelConfig(path=path, hf_config=cfg, dtype=dtype, max_model_len=256)
    return load_model(mc, torch.device(DEVICE))


@torch.no_grad()
def _randomize_norms(model: torch.nn.Module) -> None:
    """transformers initialises norm weights to 1, which would make the fold a no-op."""
    g = torch.Generator().manual_seed(17)
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            w = norm.weight
            w.copy_((1 + 0.3 * torch.randn(w.shape, generator=g)).to(w.dtype))


def _step(model, caches, rows: dict[int, tuple[list[int], int]]) -> torch.Tensor:
    """One forward over `rows`: {row id: (new tokens, tokens already cached)}; row r owns
    cache blocks [8 r, 8 r + 8)."""
    ids, pos, slots, qsl, lens, tables = [], [], [], [0], [], []
    for r, (tokens, start) in rows.items():
        ids += tokens
        p = list(range(start, start + len(tokens)))
        pos += p
        slots += [r * BLOCKS_PER_ROW * BLOCK + i for i in p]
        qsl.append(qsl[-1] + len(tokens))
        lens.append(start + len(tokens))
        tables.append(list(range(r * BLOCKS_PER_ROW, (r + 1) * BLOCKS_PER_ROW)))

    def dev(v, dtype):
        return torch.tensor(v, dtype=dtype, device=DEVICE)

    attn = AttentionMetadata(
        query_start_loc=dev(qsl, torch.int32), seq_lens=dev(lens, torch.int32),
        block_tables=dev(tables, torch.int32), slot_mapping=dev(slots, torch.int64),
        max_query_len=max(len(t) for t, _ in rows.values()), max_seq_len=max(lens),
    )  # fmt: skip
    with torch.inference_mode():
        return model(dev(ids, torch.int64), dev(pos, torch.int64), caches, attn)


def _run_steps(model) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A 70-token prefill (row 0), three prompts in one 27-token step (rows 1-3), two
    decode steps of all four rows; -> (hidden per step, caches, last logits)."""
    a = model.layers[0].self_attn
    caches = [
        torch.zeros(
            4 * BLOCKS_PER_ROW,
            2,
            BLOCK,
            a.num_kv_heads,
            a.head_dim,
            dtype=model.embed_tokens.weight.dtype,
            device=DEVICE,
        )  # fmt: skip
        for _ in model.layers
    ]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (70, 5, 9, 13)]
    hidden = [_step(model, caches, {0: (prompts[0], 0)})]
    hidden.append(_step(model, caches, {r: (prompts[r], 0) for r in (1, 2, 3)}))
    done = {r: len(p) for r, p in enumerate(prompts)}
    for s in range(2):
        hidden.append(_step(model, caches, {r: ([10 + 7 * r + s], done[r] + s) for r in range(4)}))
    with torch.inference_mode():
        logits = model.compute_logits(hidden[-1])
    return hidden, caches, logits


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen2_dir", "tiny_smollm3_dir"])
def test_folded_model_matches_plain_model(fixture, request):
    """Guards fold_norms (each norm weight into its linear's columns, the norm reset to 1)
    and the chain: prefill over 64 tokens runs the norm kernels, the rest the folded
    chain; every step's hidden states, every KV slot and the logits match the plain model
    (SmolLM3's NoPE layer included: the chain must rotate each layer by its own table)."""
    plain = _load(request.getfixturevalue(fixture), torch.float32)
    _randomize_norms(plain)
    folded = copy.deepcopy(plain)
    fold_norms(folded)
    assert not chain_applies(plain, 4) and chain_applies(folded, 4)
    assert not chain_applies(folded, SQ_ROWS + 1)
    for layer in folded.layers:
        assert bool((layer.post_attention_layernorm.weight == 1).all())
    h_plain, c_plain, l_plain = _run_steps(plain)
    h_fold, c_fold, l_fold = _run_steps(folded)
    for step, (a, b) in enumerate(zip(h_fold, h_plain, strict=True)):
        torch.testing.assert_close(
            a, b, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}"
        )
    for layer, (a, b) in enumerate(zip(c_fold, c_plain, strict=True)):
        torch.testing.assert_close(
            a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=layer: f"layer {i}: {m}"
        )
    torch.testing.assert_close(l_fold, l_plain, rtol=1e-5, atol=1e-5)


def test_fold_changes_weights_by_the_norm_only():
    """Guards the fold itself on a hand-sized case: W' = W * g (columns), g := 1."""
    from pdserve.runner.models.norm_fold import _fold

    w = torch.randn(6, 4)
    g = torch.tensor([1.0, 2.0, 0.5, -1.0])
    w2, g2 = w.clone(), g.clone()
    _fold(g2, w2)
    assert torch.equal(w2, w * g[None, :]) and torch.equal(g2, torch.ones(4))
    assert torch.equal(F.linear(torch.ones(1, 4) * g, w), F.linear(torch.ones(1, 4), w2))
