"""Parity of every Triton kernel (`name_triton`) with its torch reference (`name_ref`).

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernels run through Triton's
interpreter on CPU tensors at small sizes (the interpreter is NumPy, ~1 ms per program);
with CUDA they run compiled at the sizes the runner sees (hidden 1024, 4096 tokens,
head_dim 128, 8 kv heads, bf16) and the CUDA-only tests check graph capture and the
absence of host syncs.

Copies, gathers and index math must be bit-exact (`torch.equal`). Arithmetic gets a
stated tolerance (see `_TOL`). bf16 arithmetic is checked on CUDA only: the interpreter
rounds fp32 -> bf16 by truncation where torch and the GPU round to nearest even, so half
its bf16 results sit one ulp off for a reason that is not in the kernel. Every output
buffer starts filled with garbage, so a pad the kernel forgets to write shows up.
"""

from __future__ import annotations

import pytest
import torch

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

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")

# Shapes: the interpreter gets small awkward ones; the GPU adds the real ones.
SMALL = {
    "norm": [(1, 77), (7, 1000), (33, 128)],
    "rope": [(1, 2, 1, 24), (7, 3, 3, 80), (33, 16, 8, 128)],  # (T, Hq, Hk, D)
    "silu": [(1, 77), (7, 1000), (33, 130)],  # (rows, intermediate)
    "kv": [(1, 1, 24, 1), (7, 3, 80, 16), (33, 8, 128, 16)],  # (T, Hkv, D, block_size)
    "long_prefill": 300,  # > the 256-token loop block of the index kernels
}
REAL = {
    "norm": [(1, 1024), (7, 1000), (4096, 1024), (16384, 1024), (33, 4096)],
    "rope": [(1, 16, 8, 128), (33, 3, 1, 80), (4096, 16, 8, 128), (16384, 16, 8, 128)],
    "silu": [(1, 77), (7, 1000), (4096, 3072), (16384, 3072)],
    "kv": [(1, 1, 24, 1), (33, 3, 80, 16), (4096, 8, 128, 16), (16384, 8, 128, 16)],
    "long_prefill": 3000,
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


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_close(actual, expected, rounded_through: torch.dtype | None = None) -> None:
    """`rounded_through`: the lowest precision any intermediate was rounded to."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = _TOL[rounded_through or expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"], atol=tol["atol"])
    mismatch = (actual != expected).float().mean().item() if actual.numel() else 0.0
    assert mismatch <= tol["max_mismatch"], f"{mismatch:.2%} of elements differ"


def _garbage(shape, dtype, seed: int) -> torch.Tensor:
    """An output buffer full of values no kernel would write (pads must be overwritten)."""
    return torch.randint(1000, 9000, shape, generator=_gen(seed), dtype=dtype).to(DEVICE)


# ---------------------------------------------------------------------- staged writes


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lens", [[1], [3, 0, 1, 5], [SIZES["long_prefill"], 2, 700]])
def test_apply_staged_writes_matches_ref(dtype, lens):
    """Guards a write landing in the wrong row/column, a write longer than the kernel's
    512-value block being cut short, and a zero-length write clobbering its neighbour."""
    g = _gen(0)
    num_rows, width = 9, max(lens) + 50
    # Writes go to distinct rows in shuffled order (rows must be read, not assumed).
    rows = torch.randperm(num_rows, generator=g)[: len(lens)]
    starts = torch.tensor([int(torch.randint(0, width - n + 1, (1,), generator=g)) for n in lens])
    cu_lens = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu_lens[1:] = torch.tensor(lens).cumsum(0)
    values = torch.randint(-(2**30), 2**30, (int(cu_lens[-1]),), generator=g, dtype=dtype)
    table = _garbage((num_rows, width), dtype, 1)
    args = [t.to(DEVICE) for t in (rows, starts, cu_lens, values)]
    expected = table.clone()
    staged_write.apply_staged_writes_ref(expected, *args)
    staged_write.apply_staged_writes_triton(table, *args)
    assert torch.equal(table, expected)


def test_apply_staged_writes_without_values_is_a_noop():
    """Guards a launch with an empty values buffer writing stale memory into the table."""
    table = _garbage((4, 8), torch.int32, 2)
    before = table.clone()
    rows = torch.tensor([1, 2], device=DEVICE)
    cu_lens = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int32, device=DEVICE)
    staged_write.apply_staged_writes_triton(table, rows, rows.clone(), cu_lens, empty)
    assert torch.equal(table, before)


# ------------------------------------------------------------------------ input prep


def _batch(num_scheduled, num_computed, num_slots=12, max_len=4000, seed=0):
    """idx_mapping (distinct, unsorted slots), query_start_loc, num_computed, token_ids."""
    g = _gen(seed)
    r = len(num_scheduled)
    idx = torch.randperm(num_slots, generator=g)[:r].to(torch.int32)
    qsl = torch.zeros(r + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(num_scheduled).cumsum(0)
    computed = torch.tensor(num_computed, dtype=torch.int32)
    token_ids = torch.randint(0, 150000, (num_slots, max_len), generator=g, dtype=torch.int32)
    return [t.to(DEVICE) for t in (idx, qsl, computed, token_ids)]


_BATCHES = {
    "one_decode": ([1], [5], 0, 0),
    "mixed_padded": ([1, 4, 1, 7, 2], [9, 0, 130, 17, 1], 5, 3),
    "long_prefill_padded": ([SIZES["long_prefill"], 1, 33], [40, 2, 0], 11, 1),
    "many_decodes": ([1] * 40, list(range(100, 140)), 24, 8),
}


@pytest.mark.parametrize("name", list(_BATCHES))
def test_prepare_inputs_matches_ref(name):
    """Guards tokens taken from the wrong slot or position (idx_mapping is unsorted), a row
    longer than the 256-token loop block being cut short, and pads left unwritten: input
    ids and positions past num_tokens and seq_lens past R must be zero."""
    num_scheduled, num_computed, pad_tokens, pad_rows = _BATCHES[name]
    idx, qsl, computed, token_ids = _batch(num_scheduled, num_computed, num_slots=48)
    t = sum(num_scheduled)
    outs = [
        _garbage((t + pad_tokens,), torch.int32, 3),
        _garbage((t + pad_tokens,), torch.int64, 4),
        _garbage((len(num_scheduled) + pad_rows,), torch.int32, 5),
    ]
    expected = [o.clone() for o in outs]
    input_prep.prepare_inputs_ref(idx, qsl, computed, token_ids, *expected, t)
    input_prep.prepare_inputs_triton(idx, qsl, computed, token_ids, *outs, t)
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)
    assert not outs[0][t:].any() and not outs[1][t:].any()
    assert not outs[2][len(num_scheduled) :].any()


@pytest.mark.parametrize("num_reqs", [1, 7, 300])
def test_post_update_matches_ref(num_reqs):
    """Guards a masked-out row (a partial prefill chunk) writing its sample into the token
    history, a sample landing at the wrong slot/position, and rows past the 256-row
    block being skipped."""
    g = _gen(num_reqs)
    num_slots, max_len = 320, 64
    idx = torch.randperm(num_slots, generator=g)[:num_reqs].to(torch.int32)
    sampled = torch.randint(0, 150000, (num_reqs,), generator=g)
    seq_lens = torch.randint(1, max_len, (num_reqs,), generator=g, dtype=torch.int32)
    mask = torch.rand(num_reqs, generator=g) < 0.6
    mask[0] = True
    args = [t.to(DEVICE) for t in (idx, sampled, seq_lens, mask)]
    token_ids = _garbage((num_slots, max_len), torch.int32, 6)
    expected = token_ids.clone()
    input_prep.post_update_ref(*args, expected)
    input_prep.post_update_triton(*args, token_ids)
    assert torch.equal(token_ids, expected)


# ----------------------------------------------------------------------- block table


@pytest.mark.parametrize("max_blocks", [1, 7, 1100])
@pytest.mark.parametrize("pad_rows", [0, 3])
def test_gather_block_tables_matches_ref(max_blocks, pad_rows):
    """Guards rows copied from the wrong slot, tables wider than the kernel's 1024-column
    block being cut short, and pad rows left with stale block ids (they must be 0, the
    null block, or a padded decode would read another request's KV)."""
    g = _gen(max_blocks)
    num_slots, num_reqs = 10, 6
    table = torch.randint(0, 5000, (num_slots, max_blocks), generator=g, dtype=torch.int32)
    idx = torch.randperm(num_slots, generator=g)[:num_reqs].to(torch.int32)
    table, idx = table.to(DEVICE), idx.to(DEVICE)
    out = _garbage((num_reqs + pad_rows, max_blocks), torch.int32, 7)
    expected = out.clone()
    block_table.gather_block_tables_ref(table, idx, expected)
    block_table.gather_block_tables_triton(table, idx, out)
    assert torch.equal(out, expected)
    assert not out[num_reqs:].any()


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", list(_BATCHES))
def test_compute_slot_mapping_matches_ref(block_size, name):
    """Guards a token mapped through another row's block table, the offset within the
    block computed wrongly, and pad tokens left unmarked: they must be -1 so write_kv
    skips them instead of overwriting a real slot."""
    num_scheduled, num_computed, pad_tokens, _ = _BATCHES[name]
    g = _gen(block_size)
    idx, qsl, computed, token_ids = _batch(num_scheduled, num_computed, num_slots=48)
    t = sum(num_scheduled)
    positions = torch.zeros(t + pad_tokens, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.zeros(len(num_scheduled), dtype=torch.int32, device=DEVICE)
    input_ids = torch.zeros(t + pad_tokens, dtype=torch.int32, device=DEVICE)
    input_prep.prepare_inputs_ref(idx, qsl, computed, token_ids, input_ids, positions, seq_lens, t)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = torch.randint(1, 100000, (len(num_scheduled) + 2, max_blocks), generator=g)
    tables = tables.to(torch.int32).to(DEVICE)
    out = _garbage((t + pad_tokens,), torch.int64, 8)
    expected = out.clone()
    block_table.compute_slot_mapping_ref(tables, qsl, positions, block_size, expected, t)
    block_table.compute_slot_mapping_triton(tables, qsl, positions, block_size, out, t)
    assert torch.equal(out, expected)
    assert (out[t:] == -1).all()


# -------------------------------------------------------------------------- KV write


def _qkv_views(t, hq, hk, d, dtype, seed):
    """q, k, v as the model makes them: strided views of one fused projection output."""
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=_gen(seed)).to(dtype).to(DEVICE)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.reshape(t, hq, d), k.reshape(t, hk, d), v.reshape(t, hk, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SIZES["kv"])
def test_write_kv_matches_ref(case, dtype):
    """Guards K and V swapped or written to the wrong block/offset/head, a strided K view
    read as if contiguous or with V's strides, head dims that are not a power of two (24, 80) spilling into
    the next head, and pad tokens (slot -1, here interleaved and trailing) being written."""
    t, heads, d, block_size = case
    g = _gen(t)
    # K a strided view of the fused projection, V contiguous: the two strides differ.
    _, key, _ = _qkv_views(t, 2, heads, d, dtype, seed=t)
    value = torch.randn(t, heads, d, generator=g).to(dtype).to(DEVICE)
    num_blocks = -(-2 * t // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1
    slots[-1] = -1
    slot_mapping = slots.to(DEVICE)
    cache = torch.randn(num_blocks, 2, block_size, heads, d, generator=g).to(dtype).to(DEVICE)
    expected = cache.clone()
    attention.write_kv_ref(key, value, expected, slot_mapping)
    kv_write.write_kv_triton(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)


@cuda_only
def test_write_kv_offsets_past_int32():
    """Guards 32-bit cache offsets: slots in a cache of more than 2^31 elements (4.3 GB of
    bf16) must land at their true address, not wrap into the start of the cache."""
    heads, d, block_size = 8, 128, 16
    num_blocks = 2**31 // (2 * block_size * heads * d) + 2
    cache = torch.zeros(num_blocks, 2, block_size, heads, d, dtype=torch.bfloat16, device=DEVICE)
    key = torch.randn(3, heads, d, device=DEVICE).to(torch.bfloat16)
    value = torch.randn(3, heads, d, device=DEVICE).to(torch.bfloat16)
    last = num_blocks * block_size - 1
    slot_mapping = torch.tensor([last, last - block_size - 3, 5], device=DEVICE)
    kv_write.write_kv_triton(key, value, cache, slot_mapping)
    for i, slot in enumerate(slot_mapping.tolist()):
        assert torch.equal(cache[slot // block_size, 0, slot % block_size], key[i])
        assert torch.equal(cache[slot // block_size, 1, slot % block_size], value[i])
    assert int(torch.count_nonzero(cache[:2])) == 2 * heads * d  # only slot 5's K and V
    del cache
    torch.cuda.empty_cache()


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


def test_rms_norm_promotes_like_ref():
    """Guards the output dtype: a float32 weight on float16 activations gives float32, as
    `weight * normed.to(float16)` does in the reference. The float16 tolerance applies:
    the normalised value is rounded to float16 before the float32 product."""
    x, _ = _norm_input(7, 96, torch.float16, seed=5)
    weight = torch.randn(96, generator=_gen(6)).to(DEVICE)
    got, want = norm.rms_norm_triton(x, weight, 1e-6), norm.rms_norm_ref(x, weight, 1e-6)
    assert got.dtype == torch.float32
    _assert_close(got, want, rounded_through=torch.float16)


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
        (
            "fused_add_rms_norm",
            norm.fused_add_rms_norm,
            norm.fused_add_rms_norm_ref,
            (x, x, w, 1e-6),
        ),
        ("apply_rope", rope.apply_rope, rope.apply_rope_ref, (q, k, pos, cos_sin)),
        ("silu_and_mul", activation.silu_and_mul, activation.silu_and_mul_ref, (x,)),
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
    "apply_rope": (rope, "apply_rope_triton"),
    "silu_and_mul": (activation, "silu_and_mul_triton"),
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


@cuda_only
def test_public_functions_on_cuda_run_triton(monkeypatch):
    """Guards a public function that keeps calling the torch reference on CUDA tensors
    (correct, but with host syncs that break CUDA-graph capture and the async loop)."""
    called = []
    for name, (module, attr) in _TRITON_LAUNCHERS.items():
        original = getattr(module, attr)

        def spy(*args, _name=name, _original=original, **kwargs):
            called.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attr, spy)
    for name, public, _, args in _cpu_calls():
        public(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
        assert called and called[-1] == name, name


# ---------------------------------------------------------------- CUDA-only invariants


def _step(bufs):
    """One decode-like step's device work, launched only through the `_triton` launchers."""
    input_prep.prepare_inputs_triton(*bufs["prep_in"], *bufs["prep_out"], bufs["num_tokens"])
    block_table.gather_block_tables_triton(bufs["table"], bufs["prep_in"][0], bufs["tables"])
    block_table.compute_slot_mapping_triton(
        bufs["tables"],
        bufs["prep_in"][1],
        bufs["prep_out"][1],
        16,
        bufs["slots"],
        bufs["num_tokens"],
    )
    x, w = bufs["x"], bufs["w"]
    normed, residual = norm.fused_add_rms_norm_triton(x, x, w, 1e-6)
    q, k, v = bufs["q"], bufs["k"], bufs["v"]
    q, k = rope.apply_rope_triton(q, k, bufs["prep_out"][1], bufs["cos_sin"])
    kv_write.write_kv_triton(k, v, bufs["cache"], bufs["slots"])
    act = activation.silu_and_mul_triton(torch.cat([normed, residual], dim=-1))
    input_prep.post_update_triton(
        bufs["prep_in"][0],
        bufs["sampled"],
        bufs["prep_out"][2][:8],
        bufs["mask"],
        bufs["prep_in"][3],
    )
    return normed, q, k, act


def _step_buffers():
    idx, qsl, computed, token_ids = _batch([1] * 8, list(range(20, 28)), num_slots=16, max_len=64)
    num_tokens = 8
    prep_out = [
        torch.zeros(12, dtype=torch.int32, device=DEVICE),
        torch.zeros(12, dtype=torch.int64, device=DEVICE),
        torch.zeros(10, dtype=torch.int32, device=DEVICE),
    ]
    q, k, v = _qkv_views(12, 16, 8, 128, torch.bfloat16, seed=9)
    return {
        "prep_in": [idx, qsl, computed, token_ids],
        "prep_out": prep_out,
        "num_tokens": num_tokens,
        "table": torch.randint(1, 60, (16, 4), dtype=torch.int32, device=DEVICE),
        "tables": torch.zeros(10, 4, dtype=torch.int32, device=DEVICE),
        "slots": torch.zeros(12, dtype=torch.int64, device=DEVICE),
        "x": torch.randn(12, 1024, device=DEVICE).to(torch.bfloat16),
        "w": torch.randn(1024, device=DEVICE).to(torch.bfloat16),
        "q": q,
        "k": k,
        "v": v,
        "cos_sin": torch.randn(64, 128, device=DEVICE),
        "cache": torch.zeros(64, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE),
        "sampled": torch.randint(0, 1000, (8,), device=DEVICE),
        "mask": torch.ones(8, dtype=torch.bool, device=DEVICE),
    }


@cuda_only
def test_launchers_never_sync_with_the_host():
    """Guards a `.item()`/`.tolist()`/`nonzero()` slipping into a launcher: the async step
    loop would stall on every step, and CUDA-graph capture would fail."""
    bufs = _step_buffers()
    _step(bufs)  # compile outside the check (compilation itself may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(bufs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@cuda_only
def test_launchers_replay_in_a_cuda_graph():
    """Guards launchers that cannot be captured (a sync or a value-dependent allocation) or
    that bake device values in at capture time: after capture, new slot/position inputs
    written into the same buffers must give the reference's results on replay."""
    bufs = _step_buffers()
    _step(bufs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(bufs)
    idx, qsl, computed, token_ids = bufs["prep_in"]
    idx.copy_(torch.randperm(16, device=DEVICE)[:8].to(torch.int32))
    computed.copy_(torch.arange(30, 38, dtype=torch.int32, device=DEVICE))
    bufs["cache"].zero_()
    token_ids_before = token_ids.clone()
    graph.replay()
    torch.cuda.synchronize()
    want_prep = [torch.zeros_like(t) for t in bufs["prep_out"]]
    input_prep.prepare_inputs_ref(idx, qsl, computed, token_ids_before, *want_prep, 8)
    for got, want in zip(bufs["prep_out"], want_prep):
        assert torch.equal(got, want)
    want_tables = torch.zeros_like(bufs["tables"])
    block_table.gather_block_tables_ref(bufs["table"], idx, want_tables)
    assert torch.equal(bufs["tables"], want_tables)
    want_slots = torch.zeros_like(bufs["slots"])
    block_table.compute_slot_mapping_ref(want_tables, qsl, want_prep[1], 16, want_slots, 8)
    assert torch.equal(bufs["slots"], want_slots)
    want_q, want_k = rope.apply_rope_ref(bufs["q"], bufs["k"], want_prep[1], bufs["cos_sin"])
    assert torch.equal(outs[1], want_q) and torch.equal(outs[2], want_k)
    want_cache = torch.zeros_like(bufs["cache"])
    attention.write_kv_ref(outs[2], bufs["v"], want_cache, want_slots)
    assert torch.equal(bufs["cache"], want_cache)
    want_tokens = token_ids_before.clone()
    input_prep.post_update_ref(idx, bufs["sampled"], want_prep[2][:8], bufs["mask"], want_tokens)
    assert torch.equal(token_ids, want_tokens)
