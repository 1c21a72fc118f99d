"""Parity of the sampler's Triton kernels (`pdserve.kernels.sampling_triton`) with their
torch specs (`pdserve.kernels.sampling`, the `_ref` functions).

Without CUDA, conftest sets TRITON_INTERPRET=1 and the launchers run through Triton's
interpreter on CPU tensors at small sizes (V = 1003, not a multiple of any tile: 8 tiles
of 128 with a ragged last one); with CUDA they also run at Qwen's V = 151,936 and 256 rows.

Noise and samples must be bit-exact (`torch.equal`): a seeded request must draw the same
token on CPU and GPU. Masks must be equal; the one stated exception is top-p at large V,
where the spec's float32 cumsum drifts ~1e-5 and tokens whose mass-above lies that close
to top_p may go either way (see `_assert_top_p_masks_agree`). Logprobs get atol 1e-5,
ranks are exact.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import row_scan, sampling_triton, top_k_top_p_triton
from pdserve.kernels.sampling import (
    apply_top_k_top_p_ref,
    gumbel_argmax_ref,
    gumbel_noise_ref,
    topk_logprobs_ref,
)

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
V_AWKWARD = 1003
V_QWEN = 151_936
# The interpreter runs each program in NumPy (~1 s for a dozen rows of 1003): stay small.
VOCABS = [V_AWKWARD, V_QWEN] if ON_CUDA else [V_AWKWARD]
ROWS = 256 if ON_CUDA else 10


@pytest.fixture(params=["split", "whole"])
def chunking(request, monkeypatch) -> str:
    """Run a row scan both ways: split over many programs (the launchers' default for
    these sizes, combined in torch) and whole, one program walking every tile of its row,
    so the in-kernel carry between tiles (running max, rescaled sum, first index) is
    tested too."""
    if request.param == "whole":
        monkeypatch.setattr(row_scan, "TARGET_PROGRAMS", 1)
    return request.param


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=_generator(seed), device=DEVICE) * scale


def _seeds_positions(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, device=DEVICE)
    positions = torch.randint(0, 2**40, (rows,), generator=g, device=DEVICE)
    extremes = [0, -1, 2**63 - 1, -(2**63), 2**32]
    n = min(rows, len(extremes))
    seeds[:n] = torch.tensor(extremes[:n], device=DEVICE)
    return seeds, positions


@pytest.mark.parametrize("vocab", VOCABS)
def test_gumbel_noise_is_bit_exact(vocab: int) -> None:
    """Guards against the uint32 hash drifting from the spec's int64 one (an arithmetic
    shift on a signed word, a multiply that does not wrap mod 2**32, the seed's high word
    dropped or sign-extended differently) and against a float32 log, which differs
    between backends and would make seeded sampling device-dependent."""
    rows = 64 if vocab == V_AWKWARD else 8
    seeds, positions = _seeds_positions(rows, 1)
    got = sampling_triton.gumbel_noise(seeds, positions, vocab)
    assert torch.equal(got, gumbel_noise_ref(seeds, positions, vocab))
    if ON_CUDA:  # also against the CPU spec: same bits on both devices
        cpu = gumbel_noise_ref(seeds[:4].cpu(), positions[:4].cpu(), vocab)
        assert torch.equal(got[:4].cpu(), cpu)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, ROWS])
def test_gumbel_argmax_equals_spec(vocab: int, rows: int, chunking: str) -> None:
    """Guards against the fused sampler drawing a different token than
    argmax(logits / T + gumbel_noise) (approximate fp32 division, noise at the wrong vocab
    offset in a later tile or chunk, the per-chunk partials combined in the wrong order),
    and against noise or temperature leaking into greedy (T = 0) rows. Rows = 1 spreads
    one row over many chunks; flat logits (scale 0.05) make every row a near-tie."""
    logits = _logits(rows, vocab, seed=2, scale=0.05)
    g = _generator(3)
    temperature = torch.rand(rows, generator=g, device=DEVICE) * 2 + 0.05
    temperature[::4] = 0.0
    temperature[1::7] = 1.0
    logits[2::5, ::3] = float("-inf")  # masked tokens: -inf + noise must never win
    seeds, positions = _seeds_positions(rows, 4)
    got = sampling_triton.gumbel_argmax(logits, temperature, seeds, positions)
    # The spec written out here, not through gumbel_argmax_ref, so both are checked.
    divisor = torch.where(temperature == 0, 1.0, temperature)[:, None]
    noisy = logits / divisor + gumbel_noise_ref(seeds, positions, vocab)
    expected = torch.where(temperature == 0, logits.argmax(-1), noisy.argmax(-1))
    assert torch.equal(got, expected)
    assert torch.equal(got, gumbel_argmax_ref(logits, temperature, seeds, positions))
    assert bool(torch.isfinite(logits.gather(1, got[:, None])).all())
    if rows > 4:  # flat logits: random rows must mostly leave the argmax
        random = temperature != 0
        assert (got[random] != logits.argmax(-1)[random]).float().mean() > 0.5


def test_gumbel_argmax_ties_and_degenerate_rows(chunking: str) -> None:
    """Guards against tie-breaking that differs from torch.argmax (a later tile or chunk
    with an equal value winning), an all -inf row returning garbage instead of 0, a row
    with one finite token drawing a masked one, and bf16 input not being cast."""
    vocab = V_AWKWARD
    logits = torch.zeros(6, vocab, device=DEVICE)
    logits[1, [7, 130, 500, 1002]] = 4.0  # ties across tiles (of 128) and chunks: 7 wins
    logits[2] = float("-inf")  # all masked: torch.argmax says 0
    logits[3] = float("-inf")
    logits[3, 999] = -50.0  # one finite token in the ragged last tile
    logits[4, [1000, 1002]] = 1.0  # tie inside the ragged last tile
    logits[5, 0] = 1.0
    seeds, positions = _seeds_positions(6, 5)
    greedy = torch.zeros(6, device=DEVICE)
    got = sampling_triton.gumbel_argmax(logits, greedy, seeds, positions)
    assert got.tolist() == [0, 7, 0, 999, 1000, 0]
    hot = torch.full((6,), 1.0, device=DEVICE)
    got = sampling_triton.gumbel_argmax(logits, hot, seeds, positions)
    assert torch.equal(got, gumbel_argmax_ref(logits, hot, seeds, positions))
    assert got[2] == 0 and got[3] == 999
    half = logits.bfloat16()
    got = sampling_triton.gumbel_argmax(half, hot, seeds, positions)
    assert torch.equal(got, gumbel_argmax_ref(half.float(), hot, seeds, positions))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, ROWS])
def test_greedy_argmax_equals_torch_argmax(vocab: int, rows: int, dtype, chunking: str) -> None:
    """Guards the greedy tail's argmax (a step graph's): a row's max in a later tile or
    chunk lost, chunks combined out of order (a later equal max winning), bf16 read as
    anything but its exact value, and -inf / all -inf rows. bf16 logits at scale 0.05 tie
    often, so the lowest-index rule is exercised on every row."""
    logits = _logits(rows, vocab, seed=6, scale=0.05).to(dtype)
    logits[2::5, ::3] = float("-inf")
    if rows > 3:
        logits[3] = float("-inf")  # all masked: torch.argmax says 0
        logits[1, [5, vocab // 2, vocab - 1]] = 9.0  # equal maxima in far chunks: 5 wins
    got = sampling_triton.greedy_argmax(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))
    if dtype == torch.bfloat16 and rows > 3:
        assert (logits == logits.max(dim=-1, keepdim=True).values).sum(-1).max() > 1, (
            "no row has tied maxima: the tie rule went untested"
        )


def test_gumbel_argmax_exact_ties_after_noise() -> None:
    """Guards against any rounding difference from the spec in `x / T + noise`: Triton's
    plain `/` on fp32 is an approximate division (up to 2 ulp), and an fma of the noise
    add would also change the last bit. Each row holds two finite tokens, a and b < a,
    whose x / T + noise are engineered equal in float32 (or 1 ulp apart), so the winner
    flips on any 1-ulp change. (The interpreter divides in NumPy: this bites on CUDA.)"""
    rows, vocab = ROWS, V_AWKWARD
    g = _generator(12)
    temperature = torch.rand(rows, generator=g, device=DEVICE) * 1.5 + 0.2
    seeds, positions = _seeds_positions(rows, 13)
    noise = gumbel_noise_ref(seeds, positions, vocab)
    index = torch.arange(rows, device=DEVICE)
    a, b = vocab - 1 - (index * 37) % 400, (index * 13) % 500
    x_a = torch.randn(rows, generator=g, device=DEVICE) * 3
    target = x_a / temperature + noise[index, a]
    # x_b near (target - g_b) * T, then the float32 neighbour whose sum lands closest.
    guess = ((target.double() - noise[index, b].double()) * temperature.double()).float()
    candidates = [guess]
    for direction in (float("inf"), float("-inf")):
        step = guess
        for _ in range(4):
            step = torch.nextafter(step, torch.full_like(step, direction))
            candidates.append(step)
    candidates = torch.stack(candidates, dim=1)  # [R, 9]
    sums = candidates / temperature[:, None] + noise[index, b][:, None]
    x_b = candidates.gather(1, (sums - target[:, None]).abs().argmin(1, keepdim=True))
    logits = torch.full((rows, vocab), float("-inf"), device=DEVICE)
    logits[index, a] = x_a
    logits[index, b] = x_b.squeeze(1)
    exact_ties = (x_b.squeeze(1) / temperature + noise[index, b]) == target
    assert int(exact_ties.sum()) >= rows // 2, "the test needs exact ties to bite"
    got = sampling_triton.gumbel_argmax(logits, temperature, seeds, positions)
    assert torch.equal(got, gumbel_argmax_ref(logits, temperature, seeds, positions))
    assert torch.equal(got[exact_ties], b[exact_ties])


def _top_k_top_p_cases(rows: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(top_k, top_p) settings: mixed, top-k only, top-p only; edge values in each."""
    g = torch.Generator().manual_seed(6)
    k = torch.randint(1, 200, (rows,), generator=g, dtype=torch.int32)
    p = torch.rand(rows, generator=g) * 0.98 + 0.01
    edge_k = torch.tensor([0, 1, vocab, vocab - 1, vocab + 10, 2, 0, 37], dtype=torch.int32)
    edge_p = torch.tensor([1.0, 0.9, 1e-6, 0.0, 1.0, 0.5, 0.999, 0.3])
    k[: len(edge_k)], p[: len(edge_p)] = edge_k[:rows], edge_p[:rows]
    mixed_k = torch.where(torch.arange(rows) % 3 == 0, 0, k)
    return [
        (mixed_k, torch.where(torch.arange(rows) % 4 == 1, 1.0, p)),
        (k, torch.ones(rows)),
        (torch.zeros(rows, dtype=torch.int32), p),
    ]


def _host_flags(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> tuple[int, bool]:
    active = (top_k > 0) & (top_k < vocab)
    return int(top_k[active].max()) if bool(active.any()) else 0, bool((top_p < 1).any())


def _assert_top_p_masks_agree(
    got: torch.Tensor,
    expected: torch.Tensor,
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_top_k: int,
) -> None:
    """Equal masks, except on tokens whose float64 mass-above (after the top-k cut) lies
    within 1e-4 of top_p: there the spec's float32 cumsum (error ~1e-5 at V = 150k) and
    the kernel's float64 sums may round to different sides. At V = 1003 there is no
    exception: the float32 error is ~1e-7 and the masks must be equal."""
    differ = torch.isfinite(got) != torch.isfinite(expected)
    if not bool(differ.any()):
        return
    assert logits.shape[1] > V_AWKWARD, f"{int(differ.sum())} mask entries differ at small V"
    no_top_p = torch.ones_like(top_p)
    after_k = apply_top_k_top_p_ref(logits, top_k, no_top_p, max_top_k, False).double()
    sorted_logits, order = after_k.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    mass_above = torch.empty_like(mass_before).scatter(1, order, mass_before)
    near = (mass_above - top_p.double()[:, None]).abs() < 1e-4
    assert bool((~differ | near).all()), "masks differ away from the top-p boundary"


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("case", range(3))
def test_top_k_top_p_masks_equal_spec(vocab: int, case: int) -> None:
    """Guards against the threshold search missing the k-th value (off-by-one, a pivot
    interval that skips a key, negative logits ordered wrongly as raw float bits), top-p
    measured on the unmasked rather than the top-k-renormalised distribution, the top
    token dropped at p = 0 or 1e-6, rows with k >= V or p >= 1 masked, -inf entries
    (a min_p mask upstream) miscounted, and masses overflowing for large logits."""
    rows = ROWS
    logits = _logits(rows, vocab, seed=7)
    logits[3, : vocab // 2] = float("-inf")  # min_p-style mask: top-k must still count
    logits[6] += 100.0  # exp(logit) overflows fp32: the mass must be taken relative to the max
    top_k, top_p = (t.to(DEVICE) for t in _top_k_top_p_cases(rows, vocab)[case])
    max_top_k, any_top_p = _host_flags(top_k, top_p, vocab)
    got = top_k_top_p_triton.apply_top_k_top_p(logits, top_k, top_p, max_top_k, any_top_p)
    expected = apply_top_k_top_p_ref(logits, top_k, top_p, max_top_k, any_top_p)
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], logits[kept]), "kept logits must pass through unchanged"
    if any_top_p:
        _assert_top_p_masks_agree(got, expected, logits, top_k, top_p, max_top_k)
    else:
        assert torch.equal(got, expected)
    off = ~(((top_k > 0) & (top_k < vocab)) | (top_p < 1))
    assert torch.equal(got[off], logits[off])
    assert torch.equal(got.argmax(-1), logits.argmax(-1))


def test_top_k_top_p_ties_equal_spec() -> None:
    """Guards against tie handling that differs from the spec's: every token equal to the
    k-th value kept, every token tied at the top-p boundary kept, all tied maxima kept.
    Logits on a coarse grid make ties everywhere; row 0's maximum is 0 as both -0.0 and
    +0.0, which compare equal and must be kept together."""
    rows, vocab = 8, V_AWKWARD
    g = _generator(8)
    logits = torch.randint(-6, 4, (rows, vocab), generator=g, device=DEVICE).float() * 0.5
    logits[0] = -logits[0].abs()  # values <= 0, the max 0 held as -0.0 and +0.0
    logits[0, ::2] += 0.0  # -0.0 + 0.0 = +0.0
    top_k = torch.tensor([3, 50, 1, 0, 0, 400, 10, 2], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.3, 0.0, 0.8, 0.5, 0.9], device=DEVICE)
    max_top_k, any_top_p = _host_flags(top_k, top_p, vocab)
    got = top_k_top_p_triton.apply_top_k_top_p(logits, top_k, top_p, max_top_k, any_top_p)
    expected = apply_top_k_top_p_ref(logits, top_k, top_p, max_top_k, any_top_p)
    assert torch.equal(got, expected)
    assert int(torch.isfinite(got[2]).sum()) == int((logits[2] == logits[2].max()).sum())


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, ROWS])
def test_topk_logprobs_equal_spec(vocab: int, rows: int, chunking: str) -> None:
    """Guards against a logsumexp lost to overflow or to partials combined without
    rescaling (logprobs off by the chunk's max), float32 sums drifting past 1e-5 at large
    V, ranks counting ties or the token itself (>= instead of >), and ids/top-k columns
    that differ from the spec's."""
    logits = _logits(rows, vocab, seed=9, scale=4.0) + 100.0  # exp(x) alone overflows fp32
    logits[:, 1::2] = (logits[:, 1::2] * 2).round() / 2  # half the row on a tie grid
    order = logits.argsort(dim=-1, descending=True)
    pick = torch.randint(0, vocab, (rows,), generator=_generator(10), device=DEVICE)
    pick[0] = 0  # the argmax
    token_ids = order.gather(1, pick[:, None]).squeeze(1)
    k = 5
    ids, logprobs, ranks = sampling_triton.topk_logprobs(logits, k, token_ids)
    ref_ids, ref_logprobs, ref_ranks = topk_logprobs_ref(logits, k, token_ids)
    assert torch.equal(ids, ref_ids) and torch.equal(ranks, ref_ranks)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    exact = torch.log_softmax(logits.double(), dim=-1).gather(1, ids)
    torch.testing.assert_close(logprobs.double(), exact, atol=1e-5, rtol=0)
    assert ranks[0] == 1
    ids0, logprobs0, ranks0 = sampling_triton.topk_logprobs(logits.bfloat16(), 0, token_ids)
    ref0 = topk_logprobs_ref(logits.bfloat16().float(), 0, token_ids)
    assert torch.equal(ids0, ref0[0]) and torch.equal(ranks0, ref0[2])
    torch.testing.assert_close(logprobs0, ref0[1], atol=1e-5, rtol=0)


def test_launchers_accept_an_empty_batch() -> None:
    """Guards against a zero-row step (every request finished or preempted) launching a
    kernel with an empty grid or reducing over an empty partials tensor."""
    logits = torch.empty(0, V_AWKWARD, device=DEVICE)
    empty_i64 = torch.empty(0, dtype=torch.int64, device=DEVICE)
    empty_f32 = torch.empty(0, device=DEVICE)
    assert sampling_triton.gumbel_noise(empty_i64, empty_i64, V_AWKWARD).shape == (0, V_AWKWARD)
    assert sampling_triton.gumbel_argmax(logits, empty_f32, empty_i64, empty_i64).shape == (0,)
    assert sampling_triton.greedy_argmax(logits).shape == (0,)
    masked = top_k_top_p_triton.apply_top_k_top_p(logits, empty_i64.int(), empty_f32, 5, True)
    assert masked.shape == (0, V_AWKWARD)
    ids, logprobs, ranks = sampling_triton.topk_logprobs(logits, 3, empty_i64)
    assert ids.shape == (0, 4) and logprobs.shape == (0, 4) and ranks.shape == (0,)
