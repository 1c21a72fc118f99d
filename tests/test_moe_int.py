"""Packed integer MoE experts (`kernels/moe_int.py`): the spec against an independent
per-token loop, and the Triton grouped GEMMs against the spec (under TRITON_INTERPRET=1 on
CPU at small awkward sizes, on CUDA where there is one).

Weights are random codes, zero points and scales, packed into words by
tests/test_int_linear.py's loop (independent of the kernels' unpacking). Tolerances are
tests/test_moe_kernels.py's, and its dtypes (bf16 on CUDA only: Triton's interpreter
truncates float32 to bf16): both sides dequantize each weight to the dtype the same way,
so they differ in summation order only (1e-5 of the output's scale in float32; in 16 bits
a few ulps on rare elements). A code from the wrong field, a zero point or scale from the
wrong group, an expert's rows taken from another expert or the gate and up halves swapped
err by O(scale).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fp8_linear import fp8_bytes, words_of
from test_int_linear import pack_words, reference_weight
from test_moe_kernels import DTYPES, assert_moe_close
from test_triton_index_kernels import DEVICE

from pdserve.kernels.int_linear import fields_apply
from pdserve.kernels.moe import route_top_k
from pdserve.kernels.moe_int import (
    IntMoeTiles,
    PackedExperts,
    choose_int_tiles,
    moe_experts_int,
    moe_experts_int_ref,
    moe_experts_int_triton,
)


def packed_experts(experts, n, k, bits, group_size, gen) -> tuple[PackedExperts, torch.Tensor]:
    """Random packed experts and their float32 weights [E, N, K] (dequantized by a loop)."""
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    qs, ss, zs, ws = [], [], [], []
    for _ in range(experts):
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
        zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(torch.uint8)
        scales = torch.rand(n, groups, generator=gen) / (k**0.5 * (1 << bits)) + 1e-3
        qs.append(pack_words(codes, bits))
        ss.append(scales)
        zs.append(zeros)
        ws.append(reference_weight(codes, scales, zeros, size))
    packed = PackedExperts(torch.stack(qs).to(DEVICE), torch.stack(ss).to(DEVICE),
                           torch.stack(zs).to(DEVICE), bits, size, k)  # fmt: skip
    return packed, torch.stack(ws)


def make(tokens, hidden, inter, experts, top_k, bits, group_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up, w_gu = packed_experts(experts, 2 * inter, hidden, bits, group_size, gen)
    down, w_d = packed_experts(experts, hidden, inter, bits, group_size, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    weights, ids = route_top_k(logits, top_k, renormalize=True)
    return x, gate_up, down, ids, weights, w_gu.to(dtype), w_d.to(dtype)


def test_spec_is_the_per_token_sum_of_dequantized_experts():
    """moe_experts_int_ref against a loop over tokens and picks on the loop-dequantized
    weights (float32: only summation order differs)."""
    x, gate_up, down, ids, weights, w_gu, w_d = make(6, 40, 24, 5, 2, 4, 8, torch.float32)
    got = moe_experts_int_ref(x.cpu(), *(_cpu(gate_up), _cpu(down)), ids.cpu(), weights.cpu())
    want = torch.zeros_like(got, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = F.linear(x[t].cpu().double(), w_gu[e].double())
            h = F.silu(gu[:24]) * gu[24:]
            want[t] += float(weights[t, j]) * F.linear(h, w_d[e].double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _cpu(p: PackedExperts) -> PackedExperts:
    return PackedExperts(p.qweight.cpu(), p.scales.cpu(), p.zeros.cpu(), p.bits, p.group_size,
                         p.in_features, p.fp8)  # fmt: skip


SHAPES = [
    # (tokens, hidden, inter, experts, top_k, bits, group_size): hidden off the words
    # (44: the last 4-bit word half full) and off the tiles, groups a tile holds whole,
    # groups that span tiles (24), one group a row (-1), 8-bit codes, experts left unused
    (7, 44, 40, 6, 2, 4, 16),
    (19, 64, 72, 4, 3, 4, 24),
    (5, 96, 48, 8, 2, 8, 32),
    (3, 48, 32, 3, 1, 4, -1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_the_spec(shape, dtype):
    x, gate_up, down, ids, weights, _, _ = make(*shape, dtype, seed=shape[0])
    got = moe_experts_int_triton(x, gate_up, down, ids, weights)
    want = moe_experts_int_ref(x.cpu(), _cpu(gate_up), _cpu(down), ids.cpu(), weights.cpu())
    assert got.shape == want.shape and got.dtype == dtype
    assert_moe_close(got.cpu(), want, dtype)
    # the dispatcher: the kernels on CUDA, the spec elsewhere
    dispatched = moe_experts_int(x, gate_up, down, ids, weights).cpu()
    assert torch.equal(dispatched, got.cpu() if x.is_cuda else want)


def test_any_tile_matches_the_spec():
    """A sweep's tile computes the same function: narrow and wide outputs, tiles deeper than
    a group (a scale a weight) and within one, decode blocks and 128-slot ones."""
    x, gate_up, down, ids, weights, _, _ = make(21, 72, 48, 5, 2, 4, 24, torch.float32, seed=3)
    want = moe_experts_int_ref(x.cpu(), _cpu(gate_up), _cpu(down), ids.cpu(), weights.cpu())
    for tiles in (IntMoeTiles(16, 16, 4, 2, 16), IntMoeTiles(32, 64, 4, 3, 128),
                  choose_int_tiles(21 * 2, 5)):  # fmt: skip
        got = moe_experts_int_triton(x, gate_up, down, ids, weights, tiles)
        assert_moe_close(got.cpu(), want, torch.float32)
    assert choose_int_tiles(32 * 8, 128).block_m == 16
    assert choose_int_tiles(16384 * 8, 128).block_m == 64


def test_decode_blocks_take_the_fields_form():
    """The fields form where it was timed faster (16-slot blocks of 4-bit codes, 16-bit
    activations), the tile form elsewhere."""
    decode = choose_int_tiles(32 * 8, 128, torch.bfloat16, 4)
    assert decode.fields and decode.block_k == 128 and fields_apply(decode.block_k, 4)
    assert choose_int_tiles(32 * 8, 128, torch.float16, 4).fields
    for other in (choose_int_tiles(512 * 8, 128, torch.bfloat16, 4),
                  choose_int_tiles(32 * 8, 128, torch.float32, 4),
                  choose_int_tiles(32 * 8, 128, torch.bfloat16, 8)):  # fmt: skip
        assert not other.fields and other.block_k == 64


def _spec(args) -> torch.Tensor:
    return moe_experts_int_ref(*(_cpu(a) if isinstance(a, PackedExperts) else a.cpu()
                                 for a in args))  # fmt: skip


def _with(tiles: IntMoeTiles, **form) -> IntMoeTiles:
    return IntMoeTiles(**{**vars(tiles), **form})


def test_int_linear_forms_compute_the_experts():
    """int_linear's other tile forms. Each word loaded once per code, and a dot a field of
    the words (`fields`, tiles of 128 inputs: within one group, and across groups of 24 with
    a scale a weight): the spec's function, as close as the default. 4-bit codes as fp16
    floats with the scale and zero after the dot (checked in fp16, the bit form the
    interpreter runs right), in the tile form and the fields form: each weight's rounding
    to fp16 is skipped, so outputs move by up to half an ulp of a weight a term, within the
    16-bit tolerance's 4 ulps of the output's scale but on more elements, and the form must
    differ from the rounded tiles (or it did not run)."""
    assert fields_apply(128, 4)
    # groups of 16: words once per code (16-input tiles); one group a row and groups of 24
    # (no tile depth within one): the fields form's 128-input tiles
    for group, seed in ((16, 4), (-1, 6), (24, 5)):
        args = make(21, 136, 48, 5, 2, 4, group, torch.float32, seed=seed)[:5]
        tiles = choose_int_tiles(21 * 2, 5)
        # (fp32 fields tiles overflow an H100's shared memory at 3 stages)
        fields = {"fields": True, "block_k": 128, "num_stages": 1}
        forms = [{"words_once": False}] if group == 16 else [fields]
        for form in forms:
            assert_moe_close(moe_experts_int_triton(*args, _with(tiles, **form)).cpu(),
                             _spec(args), torch.float32)  # fmt: skip
    for group, form in ((16, {"block_k": 16}), (-1, {"block_k": 128, "fields": True})):
        x, *rest = make(21, 136, 48, 5, 2, 4, group, torch.float32, seed=7)[:5]
        args = (x.half(), *rest)
        want = _spec(args)
        tiles = choose_int_tiles(21 * 2, 5)
        rounded = moe_experts_int_triton(*args, tiles).cpu()
        got = moe_experts_int_triton(*args, _with(tiles, scale_after=True, **form)).cpu()
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= 4 * scale * 2**-10
        assert not torch.equal(got, rounded)


def test_shapes_are_checked():
    x, gate_up, down, ids, weights, _, _ = make(4, 44, 40, 6, 2, 4, 16, torch.float32)
    with pytest.raises(AssertionError, match="must be \\[T, 44\\]"):
        moe_experts_int(x[:, :40], gate_up, down, ids, weights)
    with pytest.raises(AssertionError, match="must be \\[6, 80, 3\\]"):
        PackedExperts(gate_up.qweight, gate_up.scales[:, :, :2], gate_up.zeros[:, :, :2], 4, 16,
                      44)  # fmt: skip
    with pytest.raises(AssertionError, match="dense"):
        PackedExperts(gate_up.qweight[:, ::2], gate_up.scales[:, ::2], gate_up.zeros[:, ::2], 4,
                      16, 44)  # fmt: skip


def fp8_experts(experts, n, k, group_size, gen) -> tuple[PackedExperts, torch.Tensor]:
    """Random FP8-kept experts (float8_e4m3fn bytes as words, a scale per group) and their
    float32 weights [E, N, K], decoded by torch's float8 conversion."""
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    qs, ss, ws = [], [], []
    for _ in range(experts):
        b = fp8_bytes(n, k, gen)
        scales = torch.rand(n, groups, generator=gen) / (k**0.5 * 64) + 1e-4
        qs.append(words_of(b))
        ss.append(scales)
        ws.append(b.view(torch.float8_e4m3fn).float() * scales[:, torch.arange(k) // size])
    zeros = torch.zeros(experts, n, groups, dtype=torch.uint8)
    packed = PackedExperts(torch.stack(qs).to(DEVICE), torch.stack(ss).to(DEVICE),
                           zeros.to(DEVICE), 8, size, k, fp8=True)  # fmt: skip
    return packed, torch.stack(ws)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [16, -1, 24])
def test_fp8_experts_match_the_per_token_loop(group_size, dtype):
    """An FP8 checkpoint's kept experts (PackedExperts.fp8): the spec against a loop over
    tokens and picks on torch-decoded weights, and the kernels against the spec (groups a
    tile holds whole, one group a row, groups that span tiles). Codes read as integers, a
    scale from the wrong group or an expert's rows from another err by O(scale)."""
    gen = torch.Generator().manual_seed(11)
    tokens, hidden, inter, experts, top_k = 9, 48, 40, 5, 2
    gate_up, w_gu = fp8_experts(experts, 2 * inter, hidden, group_size, gen)
    down, w_d = fp8_experts(experts, hidden, inter, group_size, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weights, ids = route_top_k(torch.randn(tokens, experts, generator=gen).to(DEVICE), top_k, True)
    spec = moe_experts_int_ref(x.cpu(), _cpu(gate_up), _cpu(down), ids.cpu(), weights.cpu())
    if dtype == torch.float32:
        want = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(top_k):
                e = int(ids[t, j])
                gu = F.linear(x[t].cpu().double(), w_gu[e].double())
                h = F.silu(gu[:inter]) * gu[inter:]
                want[t] += float(weights[t, j]) * F.linear(h, w_d[e].double())
        torch.testing.assert_close(spec.double(), want, rtol=1e-5,
                                   atol=1e-5 * float(want.abs().max()))  # fmt: skip
    got = moe_experts_int_triton(x, gate_up, down, ids, weights)
    assert_moe_close(got.cpu(), spec, dtype)


def test_the_fields_depth_only_where_the_form_runs():
    """Guards the tile depth (kernels/moe_int.py `_depth`): 128 inputs for the fields form
    with 16-bit activations and tiles of whole groups; the tile form's 64 for fp32
    activations or groups that span tiles, whose 128-deep tiles overflowed sm_90's shared
    memory (three OutOfResources failures on an H100)."""
    from pdserve.kernels.moe_int import _depth

    fields = choose_int_tiles(32 * 8, 128, torch.bfloat16, 4)
    assert fields.fields and fields.block_k == 128
    for group_size, dtype, want in ((128, torch.bfloat16, 128), (-1, torch.float16, 128),
                                    (24, torch.float16, 64), (128, torch.float32, 64)):  # fmt: skip
        gate_up = make(4, 256, 128, 4, 2, 4, group_size, dtype)[1]
        x = torch.zeros(1, 256, dtype=dtype)
        assert _depth(fields, gate_up, x) == want, (group_size, dtype)
    plain = choose_int_tiles(512 * 8, 128, torch.bfloat16, 4)
    assert _depth(plain, gate_up, x) == plain.block_k == 64
