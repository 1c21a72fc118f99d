"""Tests for `pdserve.runner.sampler.Sampler`: distributions, determinism, greedy, bans.

The chi-squared tests are deterministic (the noise is a hash of seed and position), so
they cannot flake: a pass means these 20,000 draws fit at p = 0.001, every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.kernels import sampling_triton, top_k_top_p_triton
from pdserve.runner import sampler as sampler_module
from pdserve.runner.sampler import Sampler, SamplingMetadata

# An awkward small vocab: 13 tokens, no two logits equal.
LOGITS_13 = [1.2, -0.3, 0.8, 2.1, -1.5, 0.0, 1.7, -0.9, 0.4, 2.4, -2.0, 1.0, 0.6]
NUM_DRAWS = 20_000
Z_999 = 3.090232306167813  # standard normal quantile at 0.999


def make_meta(rows: int, vocab: int, **settings: object) -> SamplingMetadata:
    """Scalars broadcast to every row; lists and tensors are per row."""

    def per_row(name: str, default: float, dtype: torch.dtype) -> torch.Tensor:
        value = settings.get(name, default)
        if isinstance(value, (int, float)):
            return torch.full((rows,), value, dtype=dtype)
        return torch.as_tensor(value, dtype=dtype)

    temperature = per_row("temperature", 1.0, torch.float32)
    top_k = per_row("top_k", 0, torch.int32)
    top_p = per_row("top_p", 1.0, torch.float32)
    min_p = per_row("min_p", 0.0, torch.float32)
    rep = per_row("repetition_penalty", 1.0, torch.float32)
    presence = per_row("presence_penalty", 0.0, torch.float32)
    frequency = per_row("frequency_penalty", 0.0, torch.float32)
    any_penalties = bool((rep != 1).any() or (presence != 0).any() or (frequency != 0).any())
    banned = settings.get("banned")  # list of (row, token)
    bad = settings.get("bad")  # list of (row, token): a bad word's last token, matched
    bias = settings.get("bias")  # list of (row, token, bias)
    allowed = settings.get("allowed")  # {row: allowed token ids}
    allowed_mask = None
    if allowed:
        allowed_mask = torch.zeros(rows, vocab, dtype=torch.bool)
        for row, ids in allowed.items():
            allowed_mask[row] = True
            allowed_mask[row, ids] = False
    return SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=per_row("seeds", 0, torch.int64),
        positions=per_row("positions", 0, torch.int64),
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
        prompt_mask=settings.get("prompt_mask") if any_penalties else None,
        output_counts=settings.get("output_counts") if any_penalties else None,
        banned_rows=torch.tensor([r for r, _ in banned]) if banned else None,
        banned_tokens=torch.tensor([t for _, t in banned]) if banned else None,
        bad_word_rows=torch.tensor([r for r, _ in bad]) if bad else None,
        bad_word_tokens=torch.tensor([t for _, t in bad]) if bad else None,
        bad_word_values=torch.full((len(bad),), float("-inf")) if bad else None,
        bias_rows=torch.tensor([r for r, _, _ in bias]) if bias else None,
        bias_tokens=torch.tensor([t for _, t, _ in bias]) if bias else None,
        bias_values=torch.tensor([b for _, _, b in bias], dtype=torch.float32) if bias else None,
        allowed_mask=allowed_mask,
        max_num_logprobs=settings.get("max_num_logprobs"),
        all_greedy=bool((temperature == 0).all()),
        any_penalties=any_penalties,
        any_top_k_top_p=bool(((top_k > 0) & (top_k < vocab)).any() or (top_p < 1).any()),
        any_min_p=bool((min_p > 0).any()),
        max_top_k=int(torch.where(top_k < vocab, top_k, 0).max()) if rows else 0,
        any_top_p=bool((top_p < 1).any()),
    )


def expected_probs(
    temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    """softmax(LOGITS_13 / T), then min_p, top-k, top-p masks, renormalised (float64)."""
    scaled = [x / temperature for x in LOGITS_13]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    weights = [w if w >= min_p * 1.0 else 0.0 for w in weights]  # w is p / p_max
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    if top_k > 0:
        for i in order[top_k:]:
            weights[i] = 0.0
    if top_p < 1.0:
        total, mass = sum(weights), 0.0
        for rank, i in enumerate(order):
            share = weights[i] / total
            if rank > 0 and mass >= top_p:
                weights[i] = 0.0
            mass += share
    total = sum(weights)
    return [w / total for w in weights]


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-squared quantile at p = 0.001.

    Within 1% of the exact value for df >= 3 (df=4: 18.72 vs 18.47) and conservative at
    df=1 (11.16 vs 10.83)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


def draw(vary: str = "positions", **settings: object) -> torch.Tensor:
    """NUM_DRAWS samples from LOGITS_13, one per row, varying positions or seeds."""
    logits = torch.tensor(LOGITS_13).expand(NUM_DRAWS, -1)
    index = torch.arange(NUM_DRAWS, dtype=torch.int64)
    if vary == "positions":
        settings.update(seeds=1234, positions=index)
    else:
        settings.update(seeds=index * 7919 - 10**12, positions=77)
    out = Sampler()(logits, make_meta(NUM_DRAWS, len(LOGITS_13), **settings))
    return torch.bincount(out.sampled_token_ids, minlength=len(LOGITS_13))


def chi2_statistic(counts: torch.Tensor, probs: list[float]) -> tuple[float, int]:
    kept = [i for i, p in enumerate(probs) if p > 0]
    stat = sum(
        (counts[i].item() - NUM_DRAWS * probs[i]) ** 2 / (NUM_DRAWS * probs[i]) for i in kept
    )
    return stat, len(kept) - 1


@pytest.mark.parametrize(
    ("vary", "settings"),
    [
        ("positions", {"temperature": 0.7}),
        ("positions", {"temperature": 1.5}),
        ("seeds", {"temperature": 1.0}),
        ("positions", {"temperature": 1.0, "top_k": 5}),
        ("positions", {"temperature": 1.0, "top_p": 0.8}),
        ("positions", {"temperature": 1.0, "min_p": 0.1}),
        ("seeds", {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "min_p": 0.05}),
    ],
)
def test_samples_fit_masked_softmax(vary: str, settings: dict[str, float]) -> None:
    """Guards against any bias in the sampling path: temperature applied as a multiply,
    noise that is not Gumbel (e.g. uniform added to logits), masks computed on the wrong
    distribution, correlated noise across positions or seeds, masked tokens drawn."""
    counts = draw(vary, **settings)
    probs = expected_probs(**settings)
    assert all(counts[i] == 0 for i, p in enumerate(probs) if p == 0), counts.tolist()
    stat, df = chi2_statistic(counts, probs)
    assert df >= 2, "the setting must leave at least 3 tokens to test anything"
    assert stat < chi2_critical(df), (stat, df, counts.tolist())


def test_chi2_detects_a_wrong_distribution() -> None:
    """Negative control: guards against a chi-squared check too weak to fail (few draws,
    a loose critical value): T=1.5 draws must be rejected against the T=0.7 law."""
    counts = draw(temperature=1.5)
    stat, df = chi2_statistic(counts, expected_probs(temperature=0.7))
    assert stat > chi2_critical(df), (stat, df)


def test_greedy_rows_are_exact_argmax_in_mixed_batch() -> None:
    """Guards against noise or temperature leaking into temperature-0 rows (near-ties
    would flip) and against the all-greedy shortcut disagreeing with the mixed path."""
    rows, vocab = 64, 1003
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 0.01
    temperature = torch.where(torch.arange(rows) % 2 == 0, 0.0, 1.0)
    meta = make_meta(
        rows,
        vocab,
        temperature=temperature,
        top_p=0.95,
        seeds=torch.arange(rows),
        positions=torch.arange(rows) * 3,
    )
    sampled = Sampler()(logits, meta).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    greedy = temperature == 0
    assert torch.equal(sampled[greedy], argmax[greedy])
    # With logits this flat the random rows must mostly leave the argmax.
    assert (sampled[~greedy] != argmax[~greedy]).sum() > 25
    all_greedy = Sampler()(logits, make_meta(rows, vocab, temperature=0.0))
    assert torch.equal(all_greedy.sampled_token_ids, argmax)


def test_seeded_row_is_batch_invariant() -> None:
    """Guards against sampling that depends on batch composition (a shared generator, a
    row-index-dependent hash, flags such as any_penalties changing a row's path): a
    seeded request must reproduce wherever the scheduler puts it."""
    vocab, targets = 1003, 40
    g = torch.Generator().manual_seed(6)
    target_logits = torch.randn(targets, vocab, generator=g)
    settings = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.02}
    seeds = torch.arange(targets) * 1_000_003 + 9
    positions = torch.arange(targets) + 100
    alone = [
        Sampler()(
            target_logits[i : i + 1],
            make_meta(
                1,
                vocab,
                seeds=seeds[i : i + 1],
                positions=positions[i : i + 1],
                **settings,
            ),
        ).sampled_token_ids.item()
        for i in range(targets)
    ]
    assert len(set(alone)) > 10, "tokens must vary with the seed for the test to mean much"
    others = torch.randn(targets, vocab, generator=g)
    logits = torch.stack([target_logits, others], dim=1).reshape(2 * targets, vocab)
    is_target = torch.arange(2 * targets) % 2 == 0

    def mix(target: object, other: object) -> torch.Tensor:
        t = torch.as_tensor(target).expand(targets)
        return torch.stack([t, torch.as_tensor(other).expand(targets).to(t.dtype)], 1).flatten()

    output_counts = torch.zeros(2 * targets, vocab, dtype=torch.int32)
    output_counts[~is_target, :30] = 2
    meta = make_meta(
        2 * targets,
        vocab,
        temperature=mix(0.8, torch.tensor([0.0, 1.3]).repeat(targets // 2)),
        top_k=mix(50, 0),
        top_p=mix(0.9, 1.0),
        min_p=mix(0.02, 0.0),
        seeds=mix(seeds, seeds + 1),
        positions=mix(positions, 5),
        repetition_penalty=mix(1.0, 1.2),
        frequency_penalty=mix(0.0, 0.5),
        prompt_mask=torch.zeros(2 * targets, vocab, dtype=torch.bool),
        output_counts=output_counts,
        max_num_logprobs=3,
    )
    batched = Sampler()(logits, meta).sampled_token_ids[is_target]
    assert batched.tolist() == alone


def test_banned_tokens_are_never_sampled() -> None:
    """Guards against min_tokens suppression failing: a banned EOS holding the max logit
    must not be drawn (greedy or random), and a ban must not leak into other rows."""
    rows, vocab, eos = 2000, 97, 13
    # Every other logit ~ -1000: a ban that writes any finite value instead of -inf loses.
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) - 1000.0
    logits[:, eos] = 50.0
    temperature = torch.where(torch.arange(rows) % 4 == 0, 0.0, 2.0)
    banned = [(r, eos) for r in range(rows - 1)] + [(r, eos + 1) for r in range(0, rows, 3)]
    meta = make_meta(
        rows,
        vocab,
        temperature=temperature,
        seeds=torch.arange(rows),
        positions=torch.arange(rows),
        banned=banned,
    )
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert (sampled[:-1] != eos).all()
    assert (sampled[0 : rows - 1 : 3] != eos + 1).all()
    assert sampled[-1] == eos, "the unbanned last row must still pick the dominant token"


def test_a_ban_yields_only_where_a_restricted_row_has_nothing_else() -> None:
    """Guards min_tokens against allowed_token_ids (the grammar mask is the same case):
    a row allowed only its stop tokens keeps them under the ban and samples one; a row
    allowed a stop and another token samples the other; an unrestricted row's ban holds
    even where its other logits are all -inf but one."""
    rows, vocab, eos = 60, 31, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    logits[:, eos] = 20.0
    temperature = torch.where(torch.arange(rows) % 2 == 0, 0.0, 1.0)
    allowed = {r: [eos] if r % 3 == 0 else [eos, 7] for r in range(rows - 1)}
    meta = make_meta(rows, vocab, temperature=temperature, seeds=torch.arange(rows),
                     positions=torch.arange(rows), allowed=allowed,
                     banned=[(r, eos) for r in range(rows)])  # fmt: skip
    sampled = Sampler()(logits, meta).sampled_token_ids
    for r in range(rows - 1):
        assert int(sampled[r]) == (eos if r % 3 == 0 else 7), r
    assert int(sampled[-1]) != eos


def test_bad_words_yield_only_where_a_restricted_row_has_nothing_else() -> None:
    """Guards bad_words against allowed_token_ids (the grammar mask is the same case): a
    row whose allowed tokens are all bad words samples among them rather than a token
    outside them (it sampled token 0 before); a row with one good token left samples it;
    with min_tokens too, the stop stays banned and the bad word is what yields; an
    unrestricted row's bad word holds."""
    rows, vocab, eos = 48, 29, 3
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(8))
    logits[:, 0] = 30.0  # the token an emptied row's argmax would fall on
    temperature = torch.where(torch.arange(rows) % 2 == 0, 0.0, 1.0)
    allowed, bad, banned = {}, [], []
    for r in range(rows - 1):
        kind = r % 3
        allowed[r] = [5, 6] if kind < 2 else [eos, 6]
        bad += [(r, 6)] + ([(r, 5)] if kind == 0 else [])
        banned += [(r, eos)] if kind == 2 else []
    bad += [(rows - 1, 0)]
    meta = make_meta(rows, vocab, temperature=temperature, seeds=torch.arange(rows),
                     positions=torch.arange(rows), allowed=allowed, bad=bad,
                     banned=banned)  # fmt: skip
    sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
    for r in range(rows - 1):
        want = {0: {5, 6}, 1: {5}, 2: {6}}[r % 3]
        assert sampled[r] in want, (r, sampled[r])
    assert sampled[-1] != 0


def test_logit_bias_and_allowed_ids_equal_the_logits_changed_by_hand() -> None:
    """Guards logit_bias and allowed_token_ids: sampling with them equals sampling the same
    rows (same seeds, so the same noise) from logits biased and masked by hand, token for
    token, greedy and random rows alike; a ban still wins over a bias; rows without them
    are untouched; logprobs stay the model's raw ones."""
    rows, vocab = 40, 503
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.where(torch.arange(rows) % 2 == 0, 0.0, 1.1)
    seeds, positions = torch.arange(rows) * 7919 + 3, torch.arange(rows) + 17
    bias = [(r, (r * 37) % vocab, 6.0) for r in range(0, rows, 3)]
    bias += [(r, (r * 11) % vocab, -100.0) for r in range(1, rows, 4)]
    bias += [(4, 9, 100.0)]  # banned below: must stay unsampled
    allowed = {r: [(r * 5 + j * 13) % vocab for j in range(6)] for r in range(2, rows, 5)}
    banned = [(4, 9)]
    by_hand = logits.clone()
    for r, ids in allowed.items():
        keep = by_hand[r, ids].clone()
        by_hand[r] = float("-inf")
        by_hand[r, ids] = keep
    by_hand[4, 9] = float("-inf")
    for r, t, b in bias:
        by_hand[r, t] += b
    common = dict(temperature=temperature, top_p=0.9, seeds=seeds, positions=positions)
    meta = make_meta(rows, vocab, bias=bias, allowed=allowed, banned=banned,
                     max_num_logprobs=2, **common)  # fmt: skip
    out = Sampler()(logits, meta)
    want = Sampler()(by_hand, make_meta(rows, vocab, **common)).sampled_token_ids
    assert torch.equal(out.sampled_token_ids, want)
    assert out.sampled_token_ids[4] != 9
    for r, ids in allowed.items():
        assert int(out.sampled_token_ids[r]) in ids
    # The test has teeth: the bias and the masks change many of the tokens drawn.
    plain = Sampler()(logits, make_meta(rows, vocab, **common)).sampled_token_ids
    assert (plain != want).sum() >= 10
    reference = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(
        out.logprobs.logprobs.double(), reference.gather(1, out.logprobs.token_ids),
        atol=1e-5, rtol=0,
    )  # fmt: skip


def test_bad_words_ban_a_last_token_only_after_the_rest_of_its_word() -> None:
    """Guards bad_words in SamplingState and the sampler: each row equals sampling the
    logits banned by hand, greedy and random rows alike (same seeds, same noise). A
    one-token word is banned outright; a longer one only where the output's last tokens
    are the rest of it; two words ending in one token, one matched and one not, still
    ban it; the prompt's tokens never count toward a match; rows sit out of slot order."""
    from pdserve.runner.sampling_params import SamplingParams
    from pdserve.runner.sampling_state import SamplingState

    vocab, hot = 40, 9  # token 9 is every row's favourite
    # slot: (prompt, output so far, bad words as token sequences, banned by hand?)
    rows = {
        0: ([3, 4], [5], ((hot,),), True),  # one token: always
        1: ([3], [8, 5], ((5, hot), (6, hot)), True),  # matched, then an unmatched twin
        2: ([3], [8, 6, 4], ((5, hot),), False),  # the output ends elsewhere
        3: ([3, 1], [2], ((1, 2, hot),), False),  # 1 is the prompt's: no match
        4: ([3], [1, 2], ((1, 2, hot),), True),  # the output ends with 1, 2
        5: ([3], [2, 7, 2], ((7, 1, hot), (2, 2, hot)), False),  # near misses
    }
    state = SamplingState(8, vocab, torch.device("cpu"))
    slots = np.array([5, 3, 1, 0, 4, 2])
    for slot in rows:
        temperature = 0.0 if slot % 2 == 0 else 0.8
        state.add(slot, SamplingParams(temperature=temperature, seed=slot), slot, (), rows[slot][2])
    history = [rows[s][0] + rows[s][1] for s in slots.tolist()]

    def recent_tokens(batch_rows: np.ndarray, width: int) -> torch.Tensor:
        return torch.tensor([([-1] * width + history[r])[-width:] for r in batch_rows.tolist()])

    logits = torch.randn(len(slots), vocab, generator=torch.Generator().manual_seed(5))
    logits[:, hot] = 8.0
    positions = np.array([len(h) for h in history])
    outputs = np.array([len(rows[s][1]) for s in slots.tolist()])
    meta = state.metadata(slots, positions, outputs, recent_tokens=recent_tokens)
    got = Sampler()(logits, meta).sampled_token_ids
    by_hand = logits.clone()
    for row, slot in enumerate(slots.tolist()):
        if rows[slot][3]:
            by_hand[row, hot] = float("-inf")
    plain = state.metadata(slots, positions, outputs, recent_tokens=recent_tokens)
    plain.bad_word_rows = plain.bad_word_tokens = plain.bad_word_values = None
    want = Sampler()(by_hand, plain).sampled_token_ids
    assert torch.equal(got, want)
    banned = [rows[s][3] for s in slots.tolist()]
    assert [int(t) != hot for t in got] == banned
    # A reused slot forgets its words, and a plain greedy batch is argmax-only again.
    state.add(0, SamplingParams(temperature=0.0), 0, ())
    again = state.metadata(np.array([0]), np.array([3]), np.array([1]))
    assert again.temperature is None and int(Sampler()(logits[3:4], again).sampled_token_ids) == hot


def test_sampling_state_ships_each_rows_bias_and_allowed_ids() -> None:
    """Guards SamplingState's side: a slot's logit_bias / allowed_token_ids reach the batch
    row the slot sits in (rows out of slot order), a reused slot forgets them, and an
    all-greedy batch with one of them leaves the argmax-only fast path."""
    from pdserve.runner.sampling_params import SamplingParams
    from pdserve.runner.sampling_state import SamplingState

    vocab = 50
    state = SamplingState(6, vocab, torch.device("cpu"))
    greedy = dict(temperature=0.0)
    state.add(0, SamplingParams(**greedy, logit_bias={3: 100.0}), 0, ())
    state.add(1, SamplingParams(**greedy, allowed_token_ids=[40, 41]), 1, ())
    state.add(2, SamplingParams(**greedy), 2, ())
    state.add(3, SamplingParams(**greedy, logit_bias={44: 100.0}, allowed_token_ids=[44, 5]), 3, ())
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    logits[:, 7] = 30.0  # the plain argmax everywhere
    slots = np.array([3, 2, 1, 0])
    meta = state.metadata(slots, np.array([1, 1, 1, 1]), np.array([0, 0, 0, 0]))
    assert meta.temperature is not None, "bias rows must not take the argmax-only path"
    got = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert got[0] == 44 and got[1] == 7 and got[3] == 3
    assert got[2] == 40 + int(logits[2, 41] > logits[2, 40])
    state.add(0, SamplingParams(**greedy), 0, ())  # slot 0 reused by a plain request
    state.add(1, SamplingParams(**greedy), 1, ())
    state.add(3, SamplingParams(**greedy), 3, ())
    meta = state.metadata(slots, np.array([1, 1, 1, 1]), np.array([0, 0, 0, 0]))
    assert (
        meta.temperature is None and Sampler()(logits, meta).sampled_token_ids.tolist() == [7] * 4
    )


def test_penalties_apply_before_greedy_argmax() -> None:
    """Guards against penalties being skipped for greedy rows (the greedy shortcut taken
    on the raw logits) or applied to the wrong rows."""
    logits = torch.tensor([[1.0, 0.8, -2.0, 0.1], [1.0, 0.8, -2.0, 0.1]])
    counts = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    meta = make_meta(
        2,
        4,
        temperature=0.0,
        repetition_penalty=[2.0, 1.0],
        prompt_mask=torch.zeros(2, 4, dtype=torch.bool),
        output_counts=counts,
    )
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1, 0]


def test_logprobs_are_raw_and_inputs_untouched() -> None:
    """Guards against logprobs taken after temperature/penalties/bans (vLLM's default is
    raw), column 0 not being the sampled token, and the sampler writing the caller's
    logits in place (which would corrupt logits reused for prompt logprobs)."""
    rows, vocab = 6, 1003
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(8)) * 2
    before = logits.clone()
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    counts[:, :100] = 1
    meta = make_meta(
        rows,
        vocab,
        temperature=[0.0, 2.0, 0.5, 1.0, 3.0, 0.7],
        top_k=20,
        min_p=0.01,
        presence_penalty=1.0,
        repetition_penalty=1.5,
        prompt_mask=torch.ones(rows, vocab, dtype=torch.bool),
        output_counts=counts,
        banned=[(1, 5), (2, 7)],
        max_num_logprobs=4,
        seeds=torch.arange(rows),
        positions=torch.arange(rows),
    )
    out = Sampler()(logits, meta)
    assert torch.equal(logits, before)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (rows, 5)
    assert torch.equal(out.logprobs.token_ids[:, 0], out.sampled_token_ids)
    reference = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(
        out.logprobs.logprobs.double(),
        reference.gather(1, out.logprobs.token_ids),
        atol=1e-5,
        rtol=0,
    )
    assert torch.equal(out.logprobs.token_ids[:, 1:], reference.topk(4, dim=-1).indices)
    no_logprobs = make_meta(rows, vocab, temperature=0.0)
    assert Sampler()(logits.bfloat16(), no_logprobs).logprobs is None


aten = torch.ops.aten
# aten ops that make the host wait for the GPU: a value read back (item, bool(), int(),
# float() all end in _local_scalar_dense) or an output sized by the data.
_SYNCING_OPS = {
    aten._local_scalar_dense,
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.repeat_interleave,
    aten.bincount,
}
_INDEXING_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class _RaiseOnHostSync(TorchDispatchMode):
    """CPU stand-in for torch.cuda.set_sync_debug_mode("error"): raises on every aten op
    that syncs on CUDA, including boolean-mask indexing (a hidden `nonzero`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _SYNCING_OPS:
            raise AssertionError(f"host sync in the sampler: {func}")
        if func.overloadpacket in _INDEXING_OPS:
            masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
            assert not masks, f"boolean-mask indexing syncs (a hidden nonzero): {func}"
        return func(*args, **(kwargs or {}))


def _raise_on_read(*args: object, **kwargs: object) -> None:
    raise AssertionError("tensor read on the host inside the sampler")


@contextlib.contextmanager
def _no_host_sync(device: str) -> Iterator[None]:
    """Make every host read of device data raise: CUDA's own sync checker on CUDA; on CPU
    the dispatch mode plus `tolist`/`numpy`, which read memory without an aten op."""
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "__array__")}
    try:
        for name in saved:
            setattr(torch.Tensor, name, _raise_on_read)
        with _RaiseOnHostSync():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _meta_to(meta: SamplingMetadata, device: str) -> SamplingMetadata:
    moved = {
        f.name: getattr(meta, f.name).to(device)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    return dataclasses.replace(meta, **moved)


def _sync_test_cases() -> list[tuple[torch.Tensor, SamplingMetadata]]:
    """Every path of Sampler.__call__: all greedy, fused (no masks), and every op at once."""
    rows, vocab = 24, 1003
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=g) * 2
    temperature = torch.where(torch.arange(rows) % 3 == 0, 0.0, 0.9)
    seeds, positions = torch.arange(rows) * 1_000_003 - 5, torch.arange(rows) + 40
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    counts[:, 100:140] = 3
    everything = make_meta(
        rows,
        vocab,
        temperature=temperature,
        top_k=torch.where(torch.arange(rows) % 2 == 0, 40, 0),
        top_p=torch.where(torch.arange(rows) % 4 == 1, 1.0, 0.85),
        min_p=0.02,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        prompt_mask=torch.rand(rows, vocab, generator=g) < 0.05,
        output_counts=counts,
        banned=[(r, 7) for r in range(0, rows, 2)],
        bias=[(r, 11 + r, 4.0) for r in range(1, rows, 3)] + [(0, 7, 50.0)],
        allowed={2: [7, 300, 301], 5: list(range(0, vocab, 2))},
        max_num_logprobs=4,
        seeds=seeds,
        positions=positions,
    )
    fused = make_meta(rows, vocab, temperature=temperature, seeds=seeds, positions=positions)
    greedy = make_meta(rows, vocab, temperature=0.0, max_num_logprobs=0)
    return [(logits, everything), (logits, fused), (logits, greedy)]


@pytest.mark.parametrize("case", range(3))
def test_sampler_never_reads_the_device_on_the_host(case: int, monkeypatch) -> None:
    """Guards against a host sync creeping into the sampler (`int(max k)` to size a topk,
    `if mask.any()`, boolean-mask indexing, `.item()`, a host scalar copied to the GPU):
    on CUDA each one stalls the async step loop until the GPU drains. On CUDA the whole
    call runs under CUDA's sync checker and must also sample the CPU's tokens. On CPU it
    runs under `_no_host_sync` twice: on the torch path, and with the Triton launchers
    (interpreted) patched in, the CUDA path's code, which must equal the torch path."""
    logits, meta = _sync_test_cases()[case]
    with _no_host_sync("cpu"):
        expected = Sampler()(logits, meta)
    if torch.cuda.is_available():
        cuda_logits, cuda_meta = logits.cuda(), _meta_to(meta, "cuda")
        Sampler()(cuda_logits, cuda_meta)  # warm-up: Triton compiles on the first call
        torch.cuda.synchronize()
        with _no_host_sync("cuda"):
            got = Sampler()(cuda_logits, cuda_meta)
        torch.cuda.synchronize()
    else:
        launchers = {
            "gumbel_argmax": sampling_triton.gumbel_argmax,
            "apply_top_k_top_p": top_k_top_p_triton.apply_top_k_top_p,
            "topk_logprobs": sampling_triton.topk_logprobs,
        }
        for name, launcher in launchers.items():
            monkeypatch.setattr(sampler_module, name, launcher)
        with _no_host_sync("cpu"):
            got = Sampler()(logits, meta)
    assert torch.equal(got.sampled_token_ids.cpu(), expected.sampled_token_ids)
    assert (got.logprobs is None) == (expected.logprobs is None)
    if expected.logprobs is not None:
        assert torch.equal(got.logprobs.token_ids.cpu(), expected.logprobs.token_ids)
        assert torch.equal(got.logprobs.ranks.cpu(), expected.logprobs.ranks)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: int(t.max()),
        lambda t: bool((t > 0).any()),
        lambda t: t[t > 0],
        lambda t: t.nonzero(),
        lambda t: t.tolist(),
        lambda t: t.topk(int(t.argmax()) % 5 + 1),
    ],
    ids=["int", "bool", "mask_index", "nonzero", "tolist", "topk_of_device_k"],
)
def test_host_sync_guard_catches_syncs(read) -> None:
    """Negative control: guards against `_no_host_sync` being too weak to fail, which
    would let the test above pass with syncs in the sampler."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.randn(50, device=device)
    with pytest.raises((AssertionError, RuntimeError)), _no_host_sync(device):
        read(t)


def test_all_greedy_batch_skips_the_per_row_copies() -> None:
    """Guards the greedy fast path of `SamplingState.metadata`: an all-greedy batch with no
    penalties and nothing banned ships no per-row tensors (and samples the exact argmax,
    with logprobs when asked); one random row, one penalty row or one min_tokens row takes
    the full path again."""
    from pdserve.runner.sampling_params import SamplingParams
    from pdserve.runner.sampling_state import SamplingState

    copies: list[np.ndarray] = []

    def to_device(a: np.ndarray) -> torch.Tensor:
        copies.append(a)
        return torch.from_numpy(np.ascontiguousarray(a))

    state = SamplingState(8, 50, torch.device("cpu"))
    for slot in range(4):
        state.add(
            slot, SamplingParams(temperature=0.0, logprobs=2 if slot == 1 else None), slot, (7,)
        )
    slots = np.array([2, 0, 1])
    meta = state.metadata(slots, np.array([5, 6, 7]), np.array([3, 3, 3]), to_device=to_device)
    assert copies == [] and meta.all_greedy and meta.temperature is None and meta.rows == 3
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (3, 3)

    for slot, params in (
        (3, SamplingParams(temperature=0.7)),
        (3, SamplingParams(temperature=0.0, repetition_penalty=1.2)),
        (3, SamplingParams(temperature=0.0, min_tokens=5)),
    ):
        state.add(slot, params, slot, (7,))
        copies.clear()
        histories = (
            [(torch.tensor([1, 2]), torch.tensor([3]))]
            if params.repetition_penalty != 1.0
            else None
        )
        meta = state.metadata(
            np.array([0, 3]), np.array([5, 6]), np.array([0, 0]), histories, to_device=to_device
        )
        assert copies and meta.temperature is not None and meta.rows == 2, params


def test_plain_argmax_reads_model_dtype_logits_without_a_float32_copy() -> None:
    """Guards the plain-argmax path: bf16 logits (the runner no longer converts them) give
    the same tokens as their exact float32 conversion, including ties to the first index,
    with no float32 [R, V] tensor made; asking for logprobs still converts and returns raw
    float32 logprobs."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 97, generator=g) * 4).bfloat16()
    logits[2, 10] = logits[2, 40] = logits[2].max() + 1  # a tie: the first index wins
    meta = SamplingMetadata.greedy(6, None)

    class NoFloat32(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                assert not (isinstance(t, torch.Tensor) and t.dtype == torch.float32), func
            return out

    with NoFloat32():
        out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert int(out.sampled_token_ids[2]) == 10 and out.logprobs is None
    with_lp = Sampler()(logits, SamplingMetadata.greedy(6, 2))
    assert torch.equal(with_lp.sampled_token_ids, out.sampled_token_ids)
    assert with_lp.logprobs is not None and with_lp.logprobs.logprobs.dtype == torch.float32
