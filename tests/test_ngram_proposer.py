"""NgramProposer against a brute-force reference written straight from the rule."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.runner.speculative.ngram import NgramProposer


def reference_propose(
    tokens: list[int], k: int, lo: int, hi: int, max_tokens: int | None = None
) -> list[int]:
    """The rule from the module docstring, one position at a time."""
    if max_tokens is not None:
        k = min(k, max_tokens)
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= length:
            continue
        pattern = tokens[length - n :]
        starts = [i for i in range(length - n) if tokens[i : i + n] == pattern]
        if not starts:
            continue
        i = starts[-1]
        pred: list[int] = []
        for j in range(k):
            if i + n + j < length:
                pred.append(tokens[i + n + j])
            else:
                pred.append(pred[j - (length - i - n)])
        return pred
    return []


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text.split()]


def test_loop_extension() -> None:
    p = NgramProposer(5, 1, 2)
    assert p.propose(_ids("a b c a b")) == _ids("c a b c a")


def test_single_repeated_token() -> None:
    x = ord("x")
    assert NgramProposer(4, 1, 1).propose([x] * 4) == [x] * 4
    assert NgramProposer(4, 1, 3).propose([x] * 4) == [x] * 4


def test_no_match() -> None:
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4, 5]) == []
    # n=1 would match but is below the minimum
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 2]) == []


def test_pattern_at_start_only() -> None:
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert NgramProposer(3, 2, 2).propose(tokens) == [3, 4, 5]
    assert NgramProposer(3, 2, 2).propose(tokens) == reference_propose(tokens, 3, 2, 2)


def test_prefers_longest_n() -> None:
    tokens = [1, 2, 9, 3, 2, 7, 1, 2]
    # n=2 ([1, 2]) last seen at the start, followed by 9; n=1 ([2]) last followed by 7
    assert NgramProposer(1, 1, 2).propose(tokens) == [9]
    assert NgramProposer(1, 1, 1).propose(tokens) == [7]
    assert NgramProposer(3, 1, 2).propose(tokens) == reference_propose(tokens, 3, 1, 2)


def test_prefers_most_recent_occurrence() -> None:
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert NgramProposer(2, 2, 2).propose(tokens) == [6, 1]


def test_max_tokens_caps() -> None:
    p = NgramProposer(5, 1, 2)
    tokens = _ids("a b c a b")
    assert p.propose(tokens, max_tokens=2) == _ids("c a")
    assert p.propose(tokens, max_tokens=9) == _ids("c a b c a")
    assert p.propose(tokens, max_tokens=0) == []
    assert p.propose(tokens, max_tokens=-3) == []


def test_short_sequences() -> None:
    p = NgramProposer(3, 2, 3)
    assert p.propose([]) == []
    assert p.propose([7]) == []
    assert p.propose([7, 7]) == []  # n must be < len, so n=2 is out
    assert p.propose([7, 7, 7]) == [7, 7, 7]
    assert NgramProposer(3, 1, 1).propose([7]) == []
    assert NgramProposer(3, 1, 1).propose([7, 7]) == [7, 7, 7]


def test_list_and_array_agree() -> None:
    rng = np.random.default_rng(0)
    p = NgramProposer(4, 1, 3)
    for dtype in (np.int32, np.int64):
        arr = rng.integers(0, 3, size=50).astype(dtype)
        out = p.propose(arr)
        assert out == p.propose(arr.tolist())
        assert all(type(t) is int for t in out)


def test_randomized_against_reference() -> None:
    rng = random.Random(1234)
    for _ in range(1000):
        # small alphabets: many earlier hits of the last token (the byte search); larger
        # ones: a few or none (extended one by one, or no draft)
        alphabet = rng.choice([2, 3, 5, 12, 40])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 120))]
        k = rng.randint(1, 8)
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        max_tokens = rng.choice([None, None, 0, 1, 3, 10])
        got = NgramProposer(k, lo, hi).propose(tokens, max_tokens=max_tokens)
        want = reference_propose(tokens, k, lo, hi, max_tokens)
        assert got == want, (tokens, k, lo, hi, max_tokens)


@pytest.mark.parametrize(
    ("k", "lo", "hi", "match"),
    [
        (0, 1, 2, "num_speculative_tokens"),
        (-1, 1, 2, "num_speculative_tokens"),
        (3, 0, 2, "prompt_lookup_min"),
        (3, 3, 2, "prompt_lookup_min=3, prompt_lookup_max=2"),
    ],
)
def test_bad_settings(k: int, lo: int, hi: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NgramProposer(k, lo, hi)


def test_a_match_inside_two_tokens_is_no_match() -> None:
    """The search runs over the tokens' int64 bytes: 256 then 0 hold token 1's eight bytes
    one byte in, which is no earlier 1. Guards a byte match taken off a token boundary."""
    assert NgramProposer(3, 1, 1).propose([256, 0, 5, 1]) == []
    assert NgramProposer(3, 1, 2).propose([1, 256, 0, 5, 1]) == [256, 0, 5]
    # the misaligned match is the last one: the aligned one before it is found
    assert NgramProposer(2, 1, 1).propose([1, 7, 256, 0, 1]) == [7, 256]
    # With many earlier hits of the last token the byte search runs: 1280 then 256 hold
    # [5, 1]'s sixteen bytes one byte in, and 256 then 0 hold [1]'s; the 1 at index 8 is
    # the last real one.
    tokens = [1] * 9 + [1280, 256, 0, 7, 5, 1]
    assert NgramProposer(2, 1, 2).propose(tokens) == [1280, 256]
    assert reference_propose(tokens, 2, 1, 2) == [1280, 256]
