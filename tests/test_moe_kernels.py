"""MoE experts: the reference against a per-token spec, the slot alignment's invariants and
the Triton grouped GEMMs against the reference (under TRITON_INTERPRET=1 on CPU at small
awkward sizes; compiled at Qwen3-30B-A3B's sizes on a GPU). The CUDA-only checks (no host
sync, graph replay) are in `test_gpu_moe.py`; whole MoE models against transformers in
`test_parity_hf.py`.

Tolerances: in float32 the kernels and the reference differ only in summation order over
the hidden and intermediate features (<= 2,048 terms, each ~1e-7 relative), so 1e-5 of
the output's scale; a wrong expert, weight or activation is off by O(scale). In 16 bits
both round at the same points, so a difference is a float32 intermediate landing on the
other side of a rounding boundary: a few ulps of the scale (2^-8 for fp16 here) on few
elements.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_triton_index_kernels import DEVICE, ON_CUDA

from pdserve.kernels.moe import moe_experts, moe_experts_ref, route_top_k
from pdserve.kernels.moe_triton import (
    MoeTiles,
    align_slots,
    choose_tiles,
    max_blocks,
    moe_experts_triton,
)

# (tokens, hidden, intermediate, experts, picks)
# The last two have mean runs of 20 and 80 slots: 32- and 64-slot blocks (`choose_tiles`).
SMALL = [(1, 24, 40, 5, 2), (7, 80, 72, 8, 3), (33, 64, 48, 6, 2), (20, 48, 16, 3, 3),
         (30, 40, 24, 3, 2), (120, 48, 40, 3, 2)]  # fmt: skip
REAL = [(1, 2048, 768, 128, 8), (32, 2048, 768, 128, 8), (512, 2048, 768, 128, 8),
        (4096, 2048, 768, 128, 8), (7, 4096, 14336, 8, 2)]  # fmt: skip
SIZES = REAL if ON_CUDA else SMALL
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def make(tokens, hidden, inter, experts, picks, dtype, seed=0, renormalize=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = route_top_k(logits, picks, renormalize)
    cast = [t.to(DEVICE, dtype) for t in (x, w_gate_up, w_down)]
    return (*cast, ids.to(DEVICE), weights.to(DEVICE))


def per_token_spec(x, w_gate_up, w_down, ids, weights):
    """The definition, one token and one pick at a time, in float64."""
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w_gate_up[e].double() @ x[t].double()
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (w_down[e].double() @ h)
    return out


def test_route_top_k_matches_softmax_then_top_k():
    """Guards the router: softmax over all experts (not over the k picked), k largest,
    renormalised only when asked (Qwen2/3-MoE's norm_topk_prob False keeps mass < 1)."""
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0], [0.0, 3.0, 3.0, 1.0]])
    weights, ids = route_top_k(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids[0].tolist() == [0, 2] and set(ids[1].tolist()) == {1, 2}
    assert torch.allclose(weights, probs.gather(1, ids))
    assert float(weights[0].sum()) < 0.99
    weights, _ = route_top_k(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    assert weights.dtype == torch.float32


def test_reference_matches_the_per_token_definition():
    """Guards the reference's gather/scatter of slots: a token's k terms must come from its
    own experts with its own weights (a slot // k or order mix-up swaps tokens)."""
    x, wgu, wd, ids, weights = (t.cpu() for t in make(9, 24, 20, 5, 3, torch.float32, seed=3))
    got = moe_experts_ref(x, wgu, wd, ids, weights)
    want = per_token_spec(x, wgu, wd, ids, weights)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    "ids",
    [
        [[0]],  # one slot
        [[3, 1], [1, 3], [3, 0]],  # shared experts, unsorted picks
        [[2, 0, 1]] * 20,  # every expert run longer than a block (20 slots each)
        [[e % 40, (e + 7) % 40] for e in range(5)],  # more experts than slots
    ],
)
def test_align_slots_invariants(ids, block_m):
    """Guards the blocks the kernels trust blindly: every slot exactly once, a block's slots
    all routed to its expert, runs starting on block boundaries in slot order, padding = S
    and unused blocks -1 (a kernel would otherwise read a slot twice or another expert's)."""
    ids_t = torch.tensor(ids, device=DEVICE)
    num_experts = 40
    sorted_slots, block_expert = align_slots(ids_t, num_experts, block_m)
    num_slots = ids_t.numel()
    assert block_expert.shape == (max_blocks(num_slots, num_experts, block_m),)
    assert sorted_slots.shape == (block_expert.shape[0] * block_m,)
    flat = ids_t.reshape(-1).cpu()
    slots, experts = sorted_slots.cpu().view(-1, block_m), block_expert.cpu()
    seen = []
    for b in range(slots.shape[0]):
        real = [int(s) for s in slots[b] if s < num_slots]
        assert all(int(s) == num_slots for s in slots[b][len(real) :]), "padding at the end"
        if experts[b] < 0:
            assert not real, f"block {b} has no expert but holds slots"
            continue
        assert real, f"block {b} of expert {int(experts[b])} is empty"
        assert all(int(flat[s]) == int(experts[b]) for s in real)
        seen += real
    assert sorted(seen) == list(range(num_slots))
    used = experts[experts >= 0]
    assert torch.equal(used, used.sort().values), "runs in expert order"
    assert (experts[len(used) :] == -1).all(), "unused blocks come last"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SIZES)
def test_triton_matches_reference(shape, dtype):
    """Guards the grouped GEMMs: masked K and N tails (hidden/intermediate not multiples of
    the tiles), gathered token rows, padding slots never written, routing weights applied
    per slot, and 16-bit rounding points equal to the reference's."""
    tokens, hidden, inter, experts, picks = shape
    x, wgu, wd, ids, weights = make(*shape, dtype, seed=tokens)
    got = moe_experts_triton(x, wgu, wd, ids, weights)
    want = moe_experts_ref(x, wgu, wd, ids, weights)
    assert got.shape == want.shape and got.dtype == dtype
    assert_moe_close(got, want, dtype)


def assert_moe_close(got, want, dtype) -> None:
    """The module docstring's tolerances: 1e-5 of the output's scale in float32; in 16 bits
    at most 4 ulps of the scale, on at most 5% of the elements."""
    scale = float(want.float().abs().max())
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        assert float(diff.max()) <= 1e-5 * scale, f"max diff {float(diff.max()):.3g}"
    else:
        ulp = scale * (2**-10 if dtype == torch.float16 else 2**-7)
        assert float(diff.max()) <= 4 * ulp, f"max diff {float(diff.max()):.3g}"
        assert float((diff > 0).float().mean()) <= 0.05, "more than rare rounding flips"


def test_tiles_grow_with_the_mean_run_and_any_tile_is_correct():
    """Decode-sized runs take the 16-slot block, prefill-sized ones 64; and the kernels do
    not depend on the chosen tile (a sweep's tile must compute the same function)."""
    assert choose_tiles(32 * 8, 128, torch.bfloat16).block_m == 16
    assert choose_tiles(4096 * 8, 128, torch.bfloat16).block_m == 64
    x, wgu, wd, ids, weights = make(25, 56, 40, 4, 2, torch.float32, seed=9)
    want = moe_experts_ref(x, wgu, wd, ids, weights)
    for tiles in (MoeTiles(32, 32, 16, 4, 2), MoeTiles(16, 16, 64, 2, 1)):
        got = moe_experts_triton(x, wgu, wd, ids, weights, tiles)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), tiles


def test_public_function_dispatches_by_device():
    """On CPU tensors `moe_experts` is the reference, bit for bit (the CPU path and the
    spec are one)."""
    x, wgu, wd, ids, weights = (t.cpu() for t in make(5, 32, 24, 4, 2, torch.float32))
    assert torch.equal(
        moe_experts(x, wgu, wd, ids, weights), moe_experts_ref(x, wgu, wd, ids, weights)
    )
