"""Parity of the arithmetic Triton kernels (`name_triton`: RMSNorm, RoPE, SiLU-and-mul)
with their torch references (`name_ref`), and the dispatch of every public kernel function
on CPU tensors to its reference.

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernels run through Triton's
interpreter on CPU tensors at small sizes (the interpreter is NumPy, ~1 ms per program);
with CUDA they run compiled at the sizes the runner sees (hidden 1024, 4096 tokens,
head_dim 128, 8 kv heads, bf16). The CUDA-only checks (dispatch to Triton, graph capture,
no host syncs) are in `test_gpu_kernels.py`; the index kernels in
`test_triton_index_kernels.py`, whose helpers this module shares.

Arithmetic gets a stated tolerance (see `_TOL`). bf16 arithmetic is checked on CUDA only:
the interpreter rounds fp32 -> bf16 by truncation where torch and the GPU round to nearest
even, so half its bf16 results sit one ulp off for a reason that is not in the kernel.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_index_kernels import DEVICE, ON_CUDA, _batch, _gen, _qkv_views

from pdserve.kernels import (
    activation,
    attention,
    block_table,
    input_prep,
    kv_write,
    norm,
    rope,
    staged_write,
)

# Shapes: the interpreter gets small awkward ones; the GPU adds the real ones.
SMALL = {
    "norm": [(1, 77), (7, 1000), (33, 128)],
    "rope": [(1, 2, 1, 24), (7, 3, 3, 80), (33, 16, 8, 128)],  # (T, Hq, Hk, D)
    "silu": [(1, 77), (7, 1000), (33, 130)],  # (rows, intermediate)
}
REAL = {
    "norm": [(1, 1024), (7, 1000), (4096, 1024), (16384, 1024), (33, 4096)],
    "rope": [(1, 16, 8, 128), (33, 3, 1, 80), (4096, 16, 8, 128), (16384, 16, 8, 128)],
    "silu": [(1, 77), (7, 1000), (4096, 3072), (16384, 3072)],
}
SIZES = REAL if ON_CUDA else SMALL
FLOAT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])

# Arithmetic tolerances, from where the kernels and torch legitimately differ:
# - float32: reduction order (RMSNorm's sum), approximate rsqrt/exp on the GPU and FMA
#   contraction each cost a few float32 ulps (~1e-7 relative); rtol 1e-6 leaves 4-8x room
#   and still fails an eps placed outside the rsqrt (the tests include rows whose variance
#   is ~eps) or a mean over BLOCK_D instead of D (>= 1e-2).
# - float16/bfloat16: the kernels round where the references round, so results are
#   bit-identical except where a float32 intermediate ~1e-7 apart lands on the other
#   side of a rounding boundary: then one rounded value moves one ulp, and a later
#   product can add one more, hence rtol 2 ulps; such elements are rare, so at most 1%
#   may differ at all. A kernel that skips one of the reference's roundings (e.g. RMSNorm
#   not rounding the normalised value) differs in far more than 1%; a wrong formula
#   exceeds 2 ulps. (RoPE has no such intermediate and is checked bit-exact.)
_TOL = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-6, "max_mismatch": 1.0},
    torch.float16: {"rtol": 2 * 2.0**-10, "atol": 1e-6, "max_mismatch": 0.01},
    torch.bfloat16: {"rtol": 2 * 2.0**-7, "atol": 1e-6, "max_mismatch": 0.01},
}


def _assert_close(
    actual, expected, rounded_through: torch.dtype | None = None, atol: float | None = None
) -> None:
    """`rounded_through`: the lowest precision any intermediate was rounded to; `atol`
    replaces the dtype's where a test states why."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = _TOL[rounded_through or expected.dtype]
    torch.testing.assert_close(
        actual, expected, rtol=tol["rtol"], atol=tol["atol"] if atol is None else atol
    )
    mismatch = (actual != expected).float().mean().item() if actual.numel() else 0.0
    assert mismatch <= tol["max_mismatch"], f"{mismatch:.2%} of elements differ"


# ---------------------------------------------------------------------------- norms


def _norm_input(rows, hidden, dtype, seed):
    """Rows at scales 1e-3 (variance ~ eps: eps placement matters), 1 and 30."""
    g = _gen(seed)
    scale = torch.tensor([1e-3, 1.0, 30.0]).repeat(rows)[:rows, None]
    x = (torch.randn(rows, hidden, generator=g) * scale).to(dtype).to(DEVICE)
    weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    return x, weight


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SIZES["norm"])
def test_rms_norm_matches_ref(shape, dtype):
    """Guards the mean taken over BLOCK_D instead of the hidden size (77, 1000 are not
    powers of two), masked lanes entering the sum, eps misplaced, and the numerics drifting
    from the reference (normalised value rounded to the input dtype before the weight)."""
    x, weight = _norm_input(*shape, dtype, seed=shape[0])
    _assert_close(norm.rms_norm_triton(x, weight, 1e-6), norm.rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_on_strided_heads(dtype):
    """Guards q/k-norm on a strided [T, H, D] view of the fused QKV output (Qwen3): each
    head is its own row, and reading the view as contiguous would normalise the wrong data."""
    t = 4096 if ON_CUDA else 9
    q, k, _ = _qkv_views(t, 16, 8, 128, dtype, seed=3)
    weight = (1 + 0.5 * torch.randn(128, generator=_gen(4))).to(dtype).to(DEVICE)
    for x in (q, k):
        assert not x.is_contiguous()
        _assert_close(norm.rms_norm_triton(x, weight, 1e-6), norm.rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SIZES["norm"])
def test_fused_add_rms_norm_matches_ref(shape, dtype):
    """Guards the new residual (must equal `x + residual` in the input dtype bit for bit,
    since it feeds the next layer) and the norm computed on the unrounded sum."""
    x, weight = _norm_input(*shape, dtype, seed=shape[1])
    residual, _ = _norm_input(*shape, dtype, seed=shape[1] + 1)
    normed, new_residual = norm.fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    want_normed, want_residual = norm.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, want_residual)
    _assert_close(normed, want_normed)


def test_rms_norm_float32_weight_keeps_the_input_dtype():
    """Guards the output dtype: a float32 weight on float16 activations (Gemma's `1 + w`,
    kernels/norm.py) gives float16, the product taken in float32 and rounded once, as the
    reference does (its numerics against transformers: test_gemma_norm.py)."""
    x, _ = _norm_input(7, 96, torch.float16, seed=5)
    weight = torch.randn(96, generator=_gen(6)).to(DEVICE)
    got, want = norm.rms_norm_triton(x, weight, 1e-6), norm.rms_norm_ref(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float16
    _assert_close(got, want)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SIZES["norm"])
def test_layer_norm_matches_ref(shape, dtype):
    """Cohere's LayerNorm (kernels/norm.py CENTER): guards the mean left in, the padded
    lanes' `0 - mean` entering the variance (77, 1000 are not powers of two), and a
    rounding the reference does not do (the normalised value stays float32). Rows are
    offset by up to 3x their spread, so a missing mean shows whatever the row."""
    x, weight = _norm_input(*shape, dtype, seed=shape[0] + 7)
    offset = torch.linspace(-3, 3, shape[0])[:, None].to(DEVICE)
    x = (x.float() + offset * x.float().std(-1, keepdim=True)).to(dtype)
    # float32: the mean of a row offset by up to 3 spreads is summed in another order than
    # torch's, off by a few ulps of (1 + 3) spreads; normalised, that is a few float32 eps
    # times the weight, absolute (H100: up to 1.24e-6 at 4096 x 1024 with |w| ~1, over the
    # plain 1e-6). 8 ulps of (1 + 3) spreads; a mean left in is off by ~1.
    atol = 8 * 4 * torch.finfo(torch.float32).eps * weight.float().abs().max().item()
    atol = atol if dtype == torch.float32 else None
    want = norm.layer_norm_ref(x, weight, 1e-5)
    _assert_close(norm.layer_norm_triton(x, weight, 1e-5), want, atol=atol)
    residual, _ = _norm_input(*shape, dtype, seed=shape[1] + 9)
    normed, new_residual = norm.fused_add_layer_norm_triton(x, residual, weight, 1e-5)
    want_normed, want_residual = norm.fused_add_layer_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, want_residual)
    _assert_close(normed, want_normed, atol=atol)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_with_a_weight_row_per_head(dtype):
    """Command R+'s q/k norms: x a strided [T, H, D] view of the fused QKV output, weight
    [H, D]. Guards every head taking row 0 (or the row of another head)."""
    t = 4096 if ON_CUDA else 9
    q, k, _ = _qkv_views(t, 16, 8, 128, dtype, seed=8)
    for x, heads in ((q, 16), (k, 8)):
        weight = (1 + 0.5 * torch.randn(heads, 128, generator=_gen(heads))).to(dtype).to(DEVICE)
        want = norm.layer_norm_ref(x, weight, 1e-5)
        _assert_close(norm.layer_norm_triton(x, weight, 1e-5), want)
        assert not torch.equal(want, norm.layer_norm_ref(x, weight[:1].expand_as(weight), 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_ref_is_transformers_cohere_layer_norm(dtype):
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    x, weight = _norm_input(9, 96, dtype, seed=21)
    hf = CohereLayerNorm(96, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(weight.cpu().float())
    hf = hf.to(dtype)
    assert torch.equal(norm.layer_norm_ref(x.cpu(), weight.cpu(), 1e-5), hf(x.cpu()))
    # Command R+'s q/k form: [T, H, D] with a weight row per head
    heads = CohereLayerNorm((3, 32), eps=1e-5)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(3, 32, generator=_gen(22)))
    heads = heads.to(dtype)
    xh = x.cpu().reshape(9, 3, 32)
    assert torch.equal(norm.layer_norm_ref(xh, heads.weight.data, 1e-5), heads(xh))


# ----------------------------------------------------------------------------- rope


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", SIZES["rope"])
def test_apply_rope_matches_ref(case, dtype):
    """Guards the halves rotated the wrong way (sign of rotate_half), cos/sin read from the
    wrong position (positions are shuffled), q and k head counts mixed up (GQA 16/8, 3/1),
    head dims that are not powers of two (24, 80), and the inputs being rotated in place
    (the caller's q/k views alias the QKV projection output). Exact, not a tolerance: every
    op is a product of two values of the input dtype or their sum, each rounded once as
    torch rounds it, so any difference is a bug, e.g. an FMA that skips a rounding."""
    t, hq, hk, d = case
    g = _gen(d)
    q, k, _ = _qkv_views(t, hq, hk, d, dtype, seed=t)
    q_before, k_before = q.clone(), k.clone()
    cos_sin = torch.randn(t + 50, d, generator=g).to(DEVICE)
    positions = torch.randperm(t + 50, generator=g)[:t].to(DEVICE)
    got_q, got_k = rope.apply_rope_triton(q, k, positions, cos_sin)
    want_q, want_k = rope.apply_rope_ref(q, k, positions, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_apply_rope_on_the_first_dims_of_each_head():
    """Guards partial RoPE (Bamba, GLM-4.5, Phi-4-mini): the rotated dims are a strided view
    of each head (`q[..., :rot]`), and the output, packed, must hold them in order (the
    kernel once wrote it with the view's head stride, on the GPU only)."""
    t, hq, hk, d, rot = 5, 4, 2, 16, 8
    q, k, _ = _qkv_views(t, hq, hk, d, torch.float32, seed=3)
    cos_sin = torch.randn(t + 9, rot, generator=_gen(4)).to(DEVICE)
    positions = torch.randperm(t + 9, generator=_gen(5))[:t].to(DEVICE)
    got_q, got_k = rope.apply_rope_triton(q[..., :rot], k[..., :rot], positions, cos_sin)
    want_q, want_k = rope.apply_rope_ref(q[..., :rot], k[..., :rot], positions, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


# ----------------------------------------------------------------------- activation


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SIZES["silu"])
def test_silu_and_mul_matches_ref(shape, dtype):
    """Guards gate and up swapped, the up half read at the wrong offset (intermediate 77
    and 1000 are not multiples of the 1024 block), and large-magnitude gates (|x| up to
    ~40, plus +-100 where exp(-x) overflows to inf) turning into NaN."""
    rows, inter = shape
    x = torch.randn(rows, 2 * inter, generator=_gen(inter)) * 8
    x[0, :4] = torch.tensor([-100.0, 100.0, -88.8, 0.0])
    x = x.to(dtype).to(DEVICE)
    _assert_close(activation.silu_and_mul_triton(x), activation.silu_and_mul_ref(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SIZES["silu"])
def test_gelu_tanh_and_mul_matches_ref(shape, dtype):
    """Guards Gemma's GeGLU: the cubic term, the sqrt(2/pi) factor, and the saturated ends
    (|x| = 100, where exp overflows or underflows, must give x and 0, not NaN).

    The kernel computes 0.5 x (1 + tanh(y)) as x * sigmoid(2y), which is accurate to a few
    float32 ulps of the value; torch's own float32 formula loses up to half an ulp of 1 in
    1 + tanh, i.e. |x| 2^-24 absolute, which is a large relative error in the negative
    tail (values ~1e-7). So the kernel is held to the float64 function, rounded where the
    kernel rounds (the gelu to the dtype, then the product), with `_assert_close`'s
    tolerances; torch's reference is then within its own |x up| 2^-23. The float64
    function is the sigmoid form too: float64's 1 + tanh(y) is exactly 0 below y ~ -19
    (x ~ -7.5), where the true value (~1e-20 at x = -8) is a normal bfloat16 number."""
    rows, inter = shape
    x = torch.randn(rows, 2 * inter, generator=_gen(inter + 1)) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, -8.0, 0.0])
    x = x.to(dtype).to(DEVICE)
    got = activation.gelu_tanh_and_mul_triton(x)
    gate, up = x[:, :inter].double(), x[:, inter:].double()
    y = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    act = (gate * torch.sigmoid(2 * y)).to(dtype).double()
    _assert_close(got, (act * up).to(dtype))
    torch_ref = activation.gelu_tanh_and_mul_ref(x).double()
    slack = (gate * up).abs() * 2.0**-23 + torch_ref.abs() * _TOL[dtype]["rtol"] + 1e-6
    assert ((got.double() - torch_ref).abs() <= slack).all()
    silu = activation.silu_and_mul_ref(x)
    assert (got.float() - silu.float()).abs().max() > 0.1, "gelu must not be silu"


# ------------------------------------------------------------------------- dispatch


def _cpu_calls():
    """(public, ref, args) for every dispatched kernel, on float32 CPU tensors."""
    idx, qsl, computed, token_ids = (t.cpu() for t in _batch([2, 1, 3], [4, 0, 7]))
    t = 6

    def prep_out():
        i32 = torch.int32
        return [torch.full((8,), 7, dtype=i32), torch.full((8,), 7), torch.full((4,), 7, dtype=i32)]

    x = torch.randn(5, 40, generator=_gen(1))
    w = torch.randn(40, generator=_gen(2))
    q = torch.randn(5, 4, 16, generator=_gen(3))
    k = torch.randn(5, 2, 16, generator=_gen(4))
    pos = torch.tensor([3, 0, 9, 4, 1])
    cos_sin = torch.randn(10, 16, generator=_gen(5))
    cache = torch.zeros(4, 2, 2, 2, 16)
    slots = torch.tensor([0, 5, -1, 3, 6])
    table = torch.zeros(4, 6, dtype=torch.int32)
    staged = (torch.tensor([2, 0]), torch.tensor([1, 3]), torch.tensor([0, 2, 5]))
    values = torch.arange(5, dtype=torch.int32)
    tables = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    slot_out = torch.full((8,), 7)
    positions = torch.tensor([4, 5, 0, 7, 8, 9, 0, 0])
    return [
        ("rms_norm", norm.rms_norm, norm.rms_norm_ref, (x, w, 1e-6)),
        ("layer_norm", norm.layer_norm, norm.layer_norm_ref, (x, w, 1e-6)),
        (
            "fused_add_layer_norm",
            norm.fused_add_layer_norm,
            norm.fused_add_layer_norm_ref,
            (x, x.flip(0), w, 1e-6),
        ),  # fmt: skip
        (
            "fused_add_rms_norm",
            norm.fused_add_rms_norm,
            norm.fused_add_rms_norm_ref,
            (x, x, w, 1e-6),
        ),
        ("apply_rope", rope.apply_rope, rope.apply_rope_ref, (q, k, pos, cos_sin)),
        ("silu_and_mul", activation.silu_and_mul, activation.silu_and_mul_ref, (x,)),
        (
            "gelu_tanh_and_mul",
            activation.gelu_tanh_and_mul,
            activation.gelu_tanh_and_mul_ref,
            (x,),
        ),
        ("write_kv", attention.write_kv, attention.write_kv_ref, (k, k, cache, slots)),
        (
            "apply_staged_writes",
            staged_write.apply_staged_writes,
            staged_write.apply_staged_writes_ref,
            (table, *staged, values),
        ),
        (
            "prepare_inputs",
            input_prep.prepare_inputs,
            input_prep.prepare_inputs_ref,
            (idx, qsl, computed, token_ids, *prep_out(), t),
        ),
        (
            "post_update",
            input_prep.post_update,
            input_prep.post_update_ref,
            (
                idx,
                torch.tensor([11, 12, 13]),
                torch.tensor([6, 1, 10]),
                torch.tensor([True, False, True]),
                token_ids,
            ),
        ),
        (
            "gather_block_tables",
            block_table.gather_block_tables,
            block_table.gather_block_tables_ref,
            (tables, idx.remainder(4), torch.full((5, 6), 7, dtype=torch.int32)),
        ),
        (
            "compute_slot_mapping",
            block_table.compute_slot_mapping,
            block_table.compute_slot_mapping_ref,
            (tables, qsl, positions, 2, slot_out, t),
        ),
    ]


_TRITON_LAUNCHERS = {
    "rms_norm": (norm, "rms_norm_triton"),
    "fused_add_rms_norm": (norm, "fused_add_rms_norm_triton"),
    "layer_norm": (norm, "layer_norm_triton"),
    "fused_add_layer_norm": (norm, "fused_add_layer_norm_triton"),
    "apply_rope": (rope, "apply_rope_triton"),
    "silu_and_mul": (activation, "silu_and_mul_triton"),
    "gelu_tanh_and_mul": (activation, "gelu_tanh_and_mul_triton"),
    "write_kv": (kv_write, "write_kv_triton"),
    "apply_staged_writes": (staged_write, "apply_staged_writes_triton"),
    "prepare_inputs": (input_prep, "prepare_inputs_triton"),
    "post_update": (input_prep, "post_update_triton"),
    "gather_block_tables": (block_table, "gather_block_tables_triton"),
    "compute_slot_mapping": (block_table, "compute_slot_mapping_triton"),
}


def _clone_args(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _results(ret, args):
    # In-place kernels return None: their result is the (mutated) tensor arguments.
    if ret is None:
        return [a for a in args if isinstance(a, torch.Tensor)]
    return list(ret) if isinstance(ret, tuple) else [ret]


def test_public_functions_on_cpu_run_the_reference(monkeypatch):
    """Guards CPU model runs silently switching to Triton (the interpreter is ~1000x slower
    and differs in rounding): with every `_triton` launcher made to raise, each public
    function on float32 CPU tensors must still succeed and equal its reference bit for bit."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton launcher ran on CPU tensors")

    for module, attr in _TRITON_LAUNCHERS.values():
        monkeypatch.setattr(module, attr, refuse)
    for name, public, ref, args in _cpu_calls():
        got_args, want_args = _clone_args(args), _clone_args(args)
        got = _results(public(*got_args), got_args)
        want = _results(ref(*want_args), want_args)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
