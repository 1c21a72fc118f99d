"""The fused q/k/v preparation and decode attention (kernels/qkv_attend.py) against the two
launches it replaces (`prepare_qkv_triton`, then the per-head decode attention) and the
spec (`prepare_qkv_ref`, then `paged_attention_ref`).

Under Triton's interpreter the fused kernel must be bitwise the two launches (the same
ops in the same order, numpy rounding each); on a GPU within the two launches' own
tolerance against the spec (its norm sums over other warps, FP fusion is off). Each batch
has pad rows (no context, no slot) beside rows whose newest key is the token prepared.
"""

from __future__ import annotations

import pytest
import torch
from test_qkv_prep import _close_after_norm
from test_triton_index_kernels import DEVICE, ON_CUDA, _gen

from pdserve.kernels.attention import paged_attention_ref
from pdserve.kernels.paged_attention_triton import paged_attention_triton
from pdserve.kernels.qkv_attend import applies, qkv_attend_triton
from pdserve.kernels.qkv_prep import prepare_qkv_ref, prepare_qkv_triton
from pdserve.kernels.row_squares import SQ_ROWS, RowSquares, ScaleRows

BLOCK = 16
# (Hq, Hkv, D): a group of 2 in a 24-dim head, 3 q heads over one kv head in 80 dims
# (halves and groups not powers of two), 2 groups of 2 at 128
SMALL = [(2, 1, 24), (3, 1, 80), (4, 2, 128)]
CASES = SMALL + ([(16, 8, 128)] if ON_CUDA else [])
LENS = [17, 0, 1, 40, 33, 0, 64]  # keys a row attends to, the prepared token's included


def _batch(hq, hkv, d, dtype, seed, lens=LENS, with_norm=True, fp8=False):
    g = _gen(seed)
    rows = len(lens)
    per_row = max(lens) // BLOCK + 1
    num_blocks = rows * per_row + 2
    cache = torch.randn(num_blocks, 2, BLOCK, hkv, d, generator=g).to(dtype)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    tables = torch.randperm(num_blocks, generator=g)[: rows * per_row].view(rows, per_row)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor([int(tables[r, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                          if n else -1 for r, n in enumerate(lens)])  # fmt: skip
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.arange(256, dtype=torch.float32)[:, None] * inv_freq[None, :]
    weights = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)]
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return dict(
        qkv=to((3 * torch.randn(rows, (hq + 2 * hkv) * d, generator=g)).to(dtype)),
        num_q_heads=hq, num_kv_heads=hkv, q_norm_weight=to(weights[0]) if with_norm else None,
        k_norm_weight=to(weights[1]) if with_norm else None, eps=1e-6,
        positions=to((seq_lens - 1).clamp(min=0).long()),
        cos_sin_cache=to(torch.cat([angles.cos(), angles.sin()], dim=-1)), kv_cache=to(cache),
        slot_mapping=to(slots), block_tables=to(tables.int()),
        query_start_loc=to(torch.arange(rows + 1, dtype=torch.int32)),
        seq_lens=to(seq_lens), scale=d**-0.5, max_seq_len=max(lens),
    )  # fmt: skip


PREP = ("qkv", "num_q_heads", "num_kv_heads", "q_norm_weight", "k_norm_weight", "eps",
        "positions", "cos_sin_cache", "kv_cache", "slot_mapping", "scale_rows", "bias",
        "scales")  # fmt: skip


def _two_launches(b: dict, prepare) -> tuple[torch.Tensor, torch.Tensor]:
    """prepare (the kernel or its spec), then the attention (the per-head kernel, or the
    spec after the spec) -> (out [R, Hq, D], the cache)."""
    b = dict(b, kv_cache=b["kv_cache"].clone())
    q = prepare(**{k: b[k] for k in PREP if k in b})
    out = torch.empty_like(q)
    extra = {k: b[k] for k in ("window", "softcap", "sinks") if k in b}
    scale = b["scale"]
    args = (q, b["kv_cache"], b["block_tables"], b["query_start_loc"], b["seq_lens"], scale)
    if prepare is prepare_qkv_ref:
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        ref_out = out.cpu()
        paged_attention_ref(*(a.cpu() for a in args[:5]), scale, ref_out, 1, b["max_seq_len"],
                            **cpu)  # fmt: skip
        out = ref_out.to(out.device)
    else:
        paged_attention_triton(*args, out, 1, b["max_seq_len"], decode_kernel="per_head",
                               **extra)  # fmt: skip
    return out, b["kv_cache"]


def _fused(b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    b = dict(b, kv_cache=b["kv_cache"].clone())
    return qkv_attend_triton(**b), b["kv_cache"]


def _check(b: dict) -> None:
    out, cache = _fused(b)
    want, want_cache = _two_launches(b, prepare_qkv_triton)
    assert not torch.equal(cache, b["kv_cache"]), "no K/V written"
    if not ON_CUDA:
        assert torch.equal(cache, want_cache) and torch.equal(out, want)
    else:
        _close_after_norm(cache, want_cache)  # in the cache's dtype: its ulps
        _close_after_norm(out, want)
    spec, spec_cache = _two_launches(b, prepare_qkv_ref)
    _close_after_norm(cache.cpu(), spec_cache.cpu())
    pads = b["seq_lens"].cpu() == 0  # the spec leaves pad rows as they were
    _close_to_spec(out.cpu()[~pads], spec.cpu()[~pads], spec_cache.float().cpu())
    assert torch.all(out.cpu()[pads] == 0), "pad rows get zeros"


def _close_to_spec(out, spec, cache) -> None:
    """The attention's own tolerance against its spec (test_paged_attention_triton's
    `check`): fp32 to 1e-5; 16-bit within u (|ref| + max |V|), u the dtype's unit
    roundoff, with a mean error under u / 2."""
    u = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[out.dtype]
    out, spec = out.double(), spec.double()
    if u == 0.0:
        torch.testing.assert_close(out, spec, rtol=1e-5, atol=1e-5)
        return
    err = (out - spec).abs()
    assert (err <= u * (spec.abs() + float(cache[:, 1].abs().max()))).all()
    assert float(err.mean()) < u / 2


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
def test_fused_equals_two_launches(case, dtype, with_norm):
    """Guards the program's heads (a group's q heads, its one kv head), the prepared token
    (the row's query), the barrier's reads of q and the newest key, pad rows."""
    _check(_batch(*case, dtype, seed=sum(case), with_norm=with_norm))


@pytest.mark.parametrize("extra", ["scaled_rows", "scaled_rows_bias", "window", "softcap", "sinks"])
def test_fused_forms(extra):
    """The folded-norm chain's scaled rows (with a bias added after the scale), a sliding
    window shorter than most rows, softcapped scores, attention sinks."""
    hq, hkv, d = 4, 2, 128
    b = _batch(hq, hkv, d, torch.float32, seed=5)
    if extra.startswith("scaled_rows"):
        sq = torch.rand(3 * SQ_ROWS, generator=_gen(2)).to(DEVICE) * 100
        b["scale_rows"] = ScaleRows(RowSquares(sq, 3, 96), 1e-6)
        if extra.endswith("bias"):
            b["bias"] = torch.randn(b["qkv"].shape[1], generator=_gen(3)).to(DEVICE)
    elif extra == "window":
        b["window"] = 20
    elif extra == "softcap":
        b["softcap"] = 5.0
    else:
        b["sinks"] = torch.randn(hq, generator=_gen(4)).to(DEVICE)
    _check(b)


def test_fp8_cache():
    """An FP8 cache takes k / k_scale and v / v_scale as float8 bytes, and the attention
    reads them back with the scale folded into the softmax's (as `Attention.attend`)."""
    b = _batch(4, 2, 128, torch.float16, seed=8, fp8=True)
    b["scales"] = (0.5, 2.0)
    out, cache = _fused(b)
    want, want_cache = _two_launches(b, prepare_qkv_triton)
    if ON_CUDA:  # the norm's sum over other warps may round a value to the next FP8 code
        got_f, want_f = cache.float(), want_cache.float()
        assert float((got_f != want_f).float().mean()) <= 0.01
        torch.testing.assert_close(got_f, want_f, rtol=2**-3, atol=2**-9)  # e4m3: 3 bits
    else:
        assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    if ON_CUDA:
        _close_after_norm(out, want)
    else:
        assert torch.equal(out, want)


def test_split_plans_are_refused():
    """Few rows of long contexts split their keys: the fused form does not apply there, nor
    to grids of more than FEW_DECODE_PAIRS pairs (where it measured slower)."""
    assert applies(torch.bfloat16, 128, 32, 8, 512, 0)
    assert not applies(torch.bfloat16, 128, 33, 8, 512, 0)  # 264 pairs
    assert applies(torch.bfloat16, 128, 256, 1, 512, 0)
    assert not applies(torch.bfloat16, 128, 2, 8, 4096, 0)
    assert applies(torch.bfloat16, 128, 2, 8, 4096, 128)  # a 128-key window: one slice
    b = _batch(4, 2, 128, torch.float32, seed=1, lens=[1000, 3])
    with pytest.raises(AssertionError, match="unsplit"):
        qkv_attend_triton(**b)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen2_dir"])
def test_attention_layer_passes_its_own_parameters(fixture, request, monkeypatch):
    """`Attention.prepare_attend`'s fused branch hands the kernel the layer's own q/k norms
    (Qwen3) or none, its softmax scale and its cache's scales, on the interpreter, and
    equals the layer's two-step path (`attend(prepare(...))`, the specs on the CPU) for a
    decode batch with a pad row. The CPU never takes the branch by itself (the test opens
    the device check, nothing else); a GPU does."""
    from test_norm_fold import _load

    from pdserve.runner.models.attention_metadata import AttentionMetadata

    model = _load(request.getfixturevalue(fixture), torch.float32)
    a = model.layers[0].self_attn
    g = _gen(14)
    for norm in (a.q_norm, a.k_norm):  # transformers' are ones: make them tell q from k
        if norm is not None:
            w = 1 + 0.3 * torch.randn(norm.weight.shape, generator=g)
            norm.weight.data = w.to(norm.weight.device)
    lens = [5, 0, 23, 40]
    b = _batch(a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, seed=12, lens=lens)
    attn = AttentionMetadata(
        query_start_loc=b["query_start_loc"], seq_lens=b["seq_lens"],
        block_tables=b["block_tables"], slot_mapping=b["slot_mapping"], max_query_len=1,
        max_seq_len=max(lens), decode_kernel="per_head_prep",
    )  # fmt: skip
    qkv, positions = b["qkv"], b["positions"]
    cos_sin = model.layer_cos_sin(0)
    assert a._fuses_prepare(qkv, attn) == qkv.is_cuda, "only a GPU takes the branch itself"
    cache = b["kv_cache"].clone()
    with torch.inference_mode():
        want = a.attend(a.prepare(qkv, positions, cos_sin, cache, attn), cache, attn)
    monkeypatch.setattr(a, "_fuses_prepare", lambda qkv, attn: True)
    fused_cache = b["kv_cache"].clone()
    with torch.inference_mode():
        got = a.prepare_attend(qkv, positions, cos_sin, fused_cache, attn)
    live = torch.tensor(lens) > 0
    assert got.shape == want.shape == (len(lens), a.q_size)
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_cache, cache, rtol=1e-5, atol=1e-5)
    assert torch.all(got[~live] == 0)


@pytest.mark.parametrize(
    "fixture,fused",
    [
        ("tiny_qwen3_dir", True),
        # RoPE over a quarter of each head: the preparation is not the fused kernel's
        ("tiny_qwen3_next_dir", False),
        ("tiny_deepseek_v2_dir", None),  # MLA
    ],
)
def test_the_execution_path_says_which_decode_attention_runs(fixture, fused, request):
    """The execution path (start-up log, stats, /metrics) names the decode attention that
    runs, not the flag: `per_head_prep` on a model none of whose attention layers prepares
    q/k/v with the fused kernel runs the per-head kernel, `auto` says which it takes, MLA
    models run their own, the CPU the torch reference and the reference runner
    transformers'. Each layer's `prepare_fusable` decides; the CUDA answers are asked of
    the same model (the path reads the layers, not the device)."""
    from pdserve import LLM
    from pdserve.runner.runner_select import _decode_attention_path

    llm = LLM(model=request.getfixturevalue(fixture), device=DEVICE, dtype="float32",
              decode_attention="per_head_prep")  # fmt: skip
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if hasattr(m, "prepare_fusable")]
    assert all(m.prepare_fusable == bool(fused) for m in layers)
    assert layers or fused is None
    want = {  # (requested, device) -> path
        ("per_head_prep", "cuda"): "per_head_prep" if fused else "per_head (per_head_prep does not apply)",
        ("auto", "cuda"): "auto (per_head_prep where it applies, else per_head)" if fused else "auto (per_head)",
        ("per_head", "cuda"): "per_head",
        ("flat", "cuda:1"): "flat",
        ("auto", "cpu"): "torch",
        ("per_head_prep", "cpu"): "torch",
    }  # fmt: skip
    for (requested, device), path in want.items():
        got = _decode_attention_path(requested, "mrv2", model, device)
        assert got == ("mla" if fused is None else path), (requested, device)
        assert _decode_attention_path(requested, "reference", model, device) == "transformers"
    assert llm.engine.execution_path["decode_attention"] == _decode_attention_path(
        "per_head_prep", "mrv2", model, DEVICE
    )
