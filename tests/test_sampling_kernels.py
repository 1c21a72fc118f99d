"""Tests for the plain-torch sampling ops in `pdserve.kernels.sampling`.

These functions are the spec the Triton kernels must match, so each is checked against an
independent reference: Python integers for the hash, transformers for the repetition
penalty, per-row Python loops in float64 for the masks, log_softmax for logprobs.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pdserve.kernels.sampling import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    gumbel_noise,
    noise_hash,
    topk_logprobs,
)

M32 = 0xFFFFFFFF
EULER_GAMMA = 0.5772156649015329
V_AWKWARD = 1003  # not a multiple of any block size a kernel would use


def _py_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _py_hash(seed: int, position: int, v: int) -> int:
    """The module docstring's recipe, in unbounded Python integers (no overflow possible)."""
    s64 = seed & 0xFFFFFFFFFFFFFFFF
    seed_key = _py_fmix32((s64 & M32) ^ _py_fmix32((s64 >> 32) ^ 0x9E3779B9))
    row_key = _py_fmix32(seed_key ^ _py_fmix32((position & M32) ^ 0x85EBCA77))
    return _py_fmix32(row_key ^ _py_fmix32(v ^ 0xC2B2AE3D))


def _i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_noise_hash_matches_python_integer_spec() -> None:
    """Guards against int64 pitfalls in the tensor hash (a multiply overflowing past 2**63,
    a missing `& M` letting high bits leak, a negative seed's sign-extended high word) and
    against the recipe drifting from the documented one the Triton kernel re-implements."""
    seeds = [0, 1, -1, 2**32, 2**63 - 1, -(2**63), 123456789012345, -987654321]
    positions = [0, 1, 7, 2**31 - 1, 4096, 2**32 + 5, 17, 100000]
    vocab = 300
    got = noise_hash(_i64(seeds), _i64(positions), vocab)
    noise = gumbel_noise(_i64(seeds), _i64(positions), vocab)
    for r, (seed, pos) in enumerate(zip(seeds, positions)):
        for v in (0, 1, 2, 151, vocab - 1):
            h = _py_hash(seed, pos, v)
            assert got[r, v].item() == h, (seed, pos, v)
            expected = torch.tensor(-math.log(-math.log((h + 0.5) * 2.0**-32)), dtype=torch.float32)
            assert noise[r, v].item() == expected.item(), (seed, pos, v)


def test_noise_row_is_pure_function_of_seed_and_position() -> None:
    """Guards against noise that depends on the batch (row index, batch size, RNG state
    advanced by other rows) or on vocab size: a seeded request would then sample
    differently depending on what it is batched with or on the vocab padding."""
    seeds = _i64([11, -5, 2**40 + 3, 11, 0])
    positions = _i64([3, 900, 17, 4, 0])
    batch = gumbel_noise(seeds, positions, V_AWKWARD)
    for r in range(len(seeds)):
        alone = gumbel_noise(seeds[r : r + 1], positions[r : r + 1], V_AWKWARD)
        assert torch.equal(alone[0], batch[r])
    narrower = gumbel_noise(seeds, positions, 257)
    assert torch.equal(narrower, batch[:, :257])
    assert torch.equal(gumbel_noise(seeds.flip(0), positions.flip(0), V_AWKWARD), batch.flip(0))


def test_noise_differs_across_seeds_and_positions() -> None:
    """Guards against a seed fold that drops a word (seeds differing only above bit 32
    colliding) and against position being ignored (every step of a request drawing the
    same noise, i.e. always the same token for flat logits)."""
    seeds = _i64([0, 1, 2**32, 2**33, -1, 2**32 - 1, 0, 0, 1])
    positions = _i64([0, 0, 0, 0, 0, 0, 1, 2, 1])
    noise = gumbel_noise(seeds, positions, 4096)
    for a in range(len(seeds)):
        for b in range(a + 1, len(seeds)):
            same = (noise[a] == noise[b]).float().mean().item()
            # Independent float32 rows coincide on ~0 of 4096 entries; allow a handful.
            assert same < 0.005, (a, b, same)


def test_noise_is_finite_and_gumbel_distributed() -> None:
    """Guards against a wrong uniform->Gumbel map (u reaching 0 or 1 gives inf; a
    log(-log) sign slip gives the reflected distribution) and a weak hash whose
    neighbouring positions are correlated."""
    num_rows, vocab = 64, 16384  # 2**20 values
    noise = gumbel_noise(
        torch.full((num_rows,), 42, dtype=torch.int64),
        torch.arange(num_rows, dtype=torch.int64),
        vocab,
    ).double()
    assert torch.isfinite(noise).all()
    assert noise.min() > -3.2 and noise.max() < 23.0
    # Sample mean has std sqrt(pi^2/6 / 2**20) = 0.0013; 0.008 is ~6 sigma.
    assert abs(noise.mean().item() - EULER_GAMMA) < 0.008
    # Sample variance has std ~sigma^2 * sqrt((kurtosis - 1) / n) = 0.0034 (kurtosis 5.4).
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.02
    # P(g <= 0) = exp(-1); binomial std 0.0005.
    assert abs((noise <= 0).double().mean().item() - math.exp(-1)) < 0.003
    # Correlation of adjacent positions over 2**14-value pairs: std 0.0078 per pair.
    corr = torch.corrcoef(noise)
    adjacent = corr.diagonal(offset=1)
    assert adjacent.abs().max() < 0.05 and abs(adjacent.mean().item()) < 0.01


def _penalty_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rows = 5
    logits = torch.randn(rows, V_AWKWARD, generator=g) * 4
    logits[:, :10] = 0.0  # zero logits: neither the multiply nor the divide branch moves them
    prompt_ids = torch.randint(0, V_AWKWARD, (rows, 60), generator=g)
    output_ids = torch.randint(0, V_AWKWARD, (rows, 40), generator=g)
    prompt_mask = torch.zeros(rows, V_AWKWARD, dtype=torch.bool).scatter(1, prompt_ids, True)
    counts = torch.zeros(rows, V_AWKWARD, dtype=torch.int32)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.int32))
    return logits, prompt_ids, output_ids, prompt_mask, counts


def test_repetition_penalty_matches_transformers() -> None:
    """Guards against the wrong branch for negative logits (dividing makes a seen negative
    token *more* likely) and against applying it only to output tokens (HF/vLLM also
    penalise prompt tokens)."""
    logits, prompt_ids, output_ids, prompt_mask, counts = _penalty_inputs()
    penalties = [1.0, 1.3, 0.7, 2.9, 1.17]
    zeros = torch.zeros(len(penalties))
    got = apply_penalties(logits, prompt_mask, counts, torch.tensor(penalties), zeros, zeros)
    for r, p in enumerate(penalties):
        seen = torch.cat([prompt_ids[r], output_ids[r]])[None]
        expected = RepetitionPenaltyLogitsProcessor(penalty=p)(seen, logits[r : r + 1].clone())
        assert torch.equal(got[r], expected[0]), r
    assert torch.equal(got[0], logits[0]), "penalty 1.0 must leave the row bit-identical"


def test_presence_and_frequency_penalties_match_formula() -> None:
    """Guards against penalising prompt tokens with presence/frequency (OpenAI applies them
    to generated tokens only), against presence scaling with count, and against the
    penalties being applied before the repetition penalty instead of after."""
    logits, _, _, prompt_mask, counts = _penalty_inputs(seed=1)
    rep = torch.tensor([1.0, 1.5, 1.0, 0.8, 1.0])
    presence = torch.tensor([0.0, 0.5, -1.0, 2.0, 0.0])
    frequency = torch.tensor([0.0, 0.25, 1.5, -0.5, 0.0])
    got = apply_penalties(logits, prompt_mask, counts, rep, presence, frequency)
    seen = prompt_mask | (counts > 0)
    r = rep[:, None]
    after_rep = torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)
    c = counts.float()
    expected = after_rep - (frequency[:, None] * c + presence[:, None] * (c > 0).float())
    assert torch.equal(got, expected)
    prompt_only = prompt_mask & (counts == 0)
    assert torch.equal(got[2][prompt_only[2]], logits[2][prompt_only[2]])
    assert torch.equal(got[4], logits[4]) and torch.equal(got[0], logits[0])


def _ref_min_p(row: list[float], min_p: float) -> list[bool]:
    peak = max(row)
    probs = [math.exp(x - peak) for x in row]  # relative to the max: p / p_max
    return [p >= min_p for p in probs]


def _ref_top_k_top_p(row: list[float], k: int, p: float) -> list[bool]:
    vocab = len(row)
    keep = [True] * vocab
    if 0 < k < vocab:
        kth = sorted(row, reverse=True)[k - 1]
        keep = [x >= kth for x in row]
    if p < 1.0:
        peak = max(row)
        weights = [math.exp(x - peak) if keep[i] else 0.0 for i, x in enumerate(row)]
        total = sum(weights)
        # A token survives when the mass of strictly larger logits is < p (ties all kept).
        mass_above = [sum(w for w, y in zip(weights, row) if y > x) / total for x in row]
        keep = [keep[i] and (mass_above[i] < p or row[i] == peak) for i in range(vocab)]
    return keep


def _awkward_logits(seed: int) -> torch.Tensor:
    return torch.randn(7, V_AWKWARD, generator=torch.Generator().manual_seed(seed)) * 3


def test_min_p_matches_reference() -> None:
    """Guards against comparing logits instead of probabilities (or log(min_p) with the
    wrong sign), and against min_p = 0 masking anything."""
    logits = _awkward_logits(2)
    min_p = [0.0, 0.05, 0.5, 1.0, 0.001, 0.2, 0.0]
    got = apply_min_p(logits, torch.tensor(min_p))
    for r in range(7):
        keep = torch.tensor(_ref_min_p(logits[r].double().tolist(), min_p[r]))
        assert torch.equal(torch.isfinite(got[r]), keep), r
        assert torch.equal(got[r][keep], logits[r][keep])
    assert torch.equal(got[0], logits[0])
    assert torch.isfinite(got[3]).sum() == 1


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [
        ([0, 1, 5, 50, V_AWKWARD + 10, V_AWKWARD, 37], [1.0, 0.9, 1.0, 0.5, 1e-6, 0.95, 0.3]),
        ([3, 0, 1000, 2, 0, V_AWKWARD - 1, 0], [1.0] * 7),  # no top-p: the sort is skipped
        ([0] * 7, [0.999, 1e-6, 0.1, 1.0, 0.6, 0.75, 0.0]),  # no top-k; p=0 keeps the top
    ],
)
def test_top_k_top_p_match_reference(top_k: list[int], top_p: list[float]) -> None:
    """Guards against top-k off-by-one (k-1 vs k), top_k > V indexing out of range,
    top-p computed on the unmasked distribution instead of the top-k-renormalised one,
    top-p dropping the top token when p is tiny, and rows with settings off being masked."""
    logits = _awkward_logits(3)
    got = apply_top_k_top_p(
        logits,
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p),
        max((k for k in top_k if k < V_AWKWARD), default=0),
        min(top_p) < 1.0,
    )
    for r in range(7):
        keep = torch.tensor(_ref_top_k_top_p(logits[r].double().tolist(), top_k[r], top_p[r]))
        assert torch.equal(torch.isfinite(got[r]), keep), (r, top_k[r], top_p[r])
        assert torch.equal(got[r][keep], logits[r][keep])
        if top_p[r] <= 1e-6 or top_k[r] == 1:
            assert keep.sum() == 1 and got[r].argmax() == logits[r].argmax()
        if top_p[r] >= 1.0 and not 0 < top_k[r] < V_AWKWARD:
            assert torch.equal(got[r], logits[r])


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    """Guards against the documented tie rule silently changing (e.g. a sort-and-cut that
    keeps exactly k and drops tied tokens by index order)."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.5, 2.0]])
    got = apply_top_k_top_p(
        logits, torch.tensor([2], dtype=torch.int32), torch.tensor([1.0]), 2, False
    )
    assert torch.isfinite(got[0]).tolist() == [True, False, True, True, False, True]


def test_top_p_keeps_every_token_tied_at_the_boundary() -> None:
    """Guards against the top-p cut splitting tied tokens by sort order, which is not
    stable: the mask (and a seeded sample) would then differ between CPU and CUDA, and
    between the torch spec and the Triton kernel. p = 0 must keep every tied maximum."""
    logits = torch.tensor([[2.0, 1.0, 2.0, 1.0, 1.0, 0.0], [2.0, 1.0, 2.0, 1.0, 1.0, 0.0]])
    # Softmax mass: each 2.0 holds 0.309, each 1.0 0.114. A sort-order cut would keep one
    # 2.0 at p = 0.2 (0.309 >= 0.2 before the second) and two of the 1.0s at p = 0.7
    # (0.617 + 0.114 >= 0.7 before the third); the tie rule keeps all of each group.
    top_p = torch.tensor([0.2, 0.7])
    got = apply_top_k_top_p(logits, torch.zeros(2, dtype=torch.int32), top_p, 0, True)
    assert torch.isfinite(got).tolist() == [[True, False, True, False, False, False]] + [
        [True, True, True, True, True, False]
    ]
    got = apply_top_k_top_p(logits[:1], torch.zeros(1, dtype=torch.int32), torch.zeros(1), 0, True)
    assert torch.isfinite(got[0]).tolist() == [True, False, True, False, False, False]


def test_top_p_off_rows_keep_their_tail_when_cumsum_saturates() -> None:
    """Guards against `cumsum >= top_p` alone deciding the mask: with one dominant logit
    the float32 cumsum hits 1.0 after the first token (tail probs ~e**-30 < 2**-24), so a
    top_p = 1.0 row batched with a top-p row would silently lose every other token."""
    logits = torch.zeros(2, V_AWKWARD)
    logits[:, 0] = 30.0
    got = apply_top_k_top_p(
        logits, torch.zeros(2, dtype=torch.int32), torch.tensor([1.0, 0.5]), 0, True
    )
    assert torch.equal(got[0], logits[0])
    assert torch.isfinite(got[1]).sum() == 1


def test_topk_logprobs_match_log_softmax() -> None:
    """Guards against logprobs normalised over the top-k only, ranks counted with >=
    (ties pushing rank past 1) and the sampled token missing when it is outside top-k."""
    logits = _awkward_logits(4).double().float()
    logits[0, 5] = logits[0].max() + 1  # row 0 samples its argmax: rank 1
    order = logits.argsort(dim=-1, descending=True)
    sampled = torch.stack(
        [
            order[0, 0],
            order[1, 3],
            order[2, 500],
            order[3, -1],
            order[4, 1],
            order[5, 20],
            order[6, 7],
        ]
    )
    k = 5
    ids, logprobs, ranks = topk_logprobs(logits, k, sampled)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert ids.shape == (7, k + 1) and logprobs.dtype == torch.float32
    assert torch.equal(ids[:, 0], sampled)
    assert torch.equal(ids[:, 1:], reference.topk(k, dim=-1).indices)
    torch.testing.assert_close(logprobs.double(), reference.gather(1, ids), atol=1e-5, rtol=0)
    assert ranks.tolist() == [1, 4, 501, V_AWKWARD, 2, 21, 8]


def test_topk_logprobs_with_zero_k_and_ties() -> None:
    """Guards against num_logprobs = 0 returning an empty or [R, 1]-less result, and
    against rank counting tied tokens as better than the sampled one."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ids, logprobs, ranks = topk_logprobs(logits, 0, torch.tensor([2, 3]))
    assert ids.tolist() == [[2], [3]]
    assert ranks.tolist() == [1, 1]
    torch.testing.assert_close(logprobs[1, 0], torch.tensor(-math.log(4.0)))
