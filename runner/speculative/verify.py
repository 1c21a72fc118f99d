"""A verification step's sample rows, and what a row keeps of its draft.

A request with draft tokens d_1..d_k is scheduled as k + 1 tokens: its last token and the
draft, at positions N-1 .. N+k-1 (N: the tokens it has). The step samples every one of
those positions as it would sample a lone decode step at that place, with the request's
settings, seed and position (the noise is a hash of the two: runner/sampler.py), giving
s_0..s_k, where s_j is the token at position N + j. The row keeps s_0..s_a, where a is the
number of leading drafts equal to their sample (d_j == s_{j-1} for j <= a).

Why this is exact, for every temperature: each kept s_j is the sample a one-token step
would have drawn at its place, because every token before it is what that step would
have seen (d_j == s_{j-1}). So a request's tokens are the same with and without drafts,
and only how many a step yields changes. (For a draft that names one token, the usual
accept-with-probability-p(d) rule gives the same distribution: sampling p and comparing
accepts d with probability p(d), and on a mismatch the sample is p restricted to the
other tokens.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SampleRows:
    """Sample rows of a step with drafts: row r of the batch owns `counts[r]` of them, in
    order (1 + its draft length, or 1)."""

    counts: np.ndarray  # [R] int64
    slots: np.ndarray  # [S] int64: the slot each sample row belongs to
    positions: np.ndarray  # [S] int64: where its token goes (tokens before it)
    logits_indices: np.ndarray  # [S] int64: the hidden row that scores it
    keep: np.ndarray  # [S] bool
    offsets: np.ndarray  # [R + 1] int64: row r's sample rows are offsets[r]:offsets[r+1]
    drafts: dict[int, list[int]]  # batch row -> its draft

    @property
    def num_rows(self) -> int:
        return len(self.slots)


def sample_rows(
    slots: np.ndarray,
    seq_lens: np.ndarray,
    query_ends: np.ndarray,
    sample_mask: np.ndarray,
    drafts: dict[int, list[int]],
) -> SampleRows:
    """The sample rows of a batch whose rows `drafts` (batch row -> draft) scheduled their
    last token and their draft; every other row samples at its end as usual. `query_ends`:
    [R] each row's end in the flat token batch (the cumulative scheduled counts)."""
    counts = np.ones(len(slots), dtype=np.int64)
    for row, draft in drafts.items():
        counts[row] += len(draft)
    offsets = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    # j-th sample row of a row of count c: j - (c - 1) places before the row's end.
    back = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[1:] - 1, counts)
    return SampleRows(
        counts=counts,
        slots=np.repeat(slots, counts),
        positions=np.repeat(np.asarray(seq_lens, dtype=np.int64), counts) + back,
        logits_indices=np.repeat(np.asarray(query_ends, dtype=np.int64) - 1, counts) + back,
        keep=np.repeat(sample_mask, counts),
        offsets=offsets,
        drafts=drafts,
    )


def accepted_length(draft: list[int], samples: list[int]) -> int:
    """Leading drafts equal to the sample drawn at their place (samples[j] is the token
    after the row's j-th input, so draft[j] is checked against samples[j])."""
    a = 0
    for d, s in zip(draft, samples, strict=False):
        if d != s:
            break
        a += 1
    return a
