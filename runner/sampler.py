"""The sampler: [R, V] logits and per-row settings in, one token (and logprobs) per row out.

Gumbel-max sampling: argmax(logits / T + g) with g ~ Gumbel(0, 1) draws exactly from
softmax(logits / T), and because g is a hash of (seed, position, vocab index) a seeded
request samples the same token whatever else shares its batch, with no torch.Generator
per request and no Python loop over rows.

What this module does not know: requests, stop conditions or tokenizers. The runner fills
`SamplingMetadata` (seeds for unseeded requests, positions, penalty tables, banned pairs
for min_tokens) and reads `SamplerOutput`; the ops live in `pdserve.kernels.sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.kernels.sampling import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    gumbel_noise,
    topk_logprobs,
)


@dataclass
class SamplingMetadata:
    """Per-step sampling settings, one row per sampled token, built by the runner."""

    temperature: Tensor  # [R] float32, 0 = greedy (exact argmax, no noise)
    top_k: Tensor  # [R] int32, 0 = off
    top_p: Tensor  # [R] float32, 1.0 = off
    min_p: Tensor  # [R] float32, 0.0 = off
    seeds: Tensor  # [R] int64
    positions: Tensor  # [R] int64, tokens before the one being sampled
    repetition_penalty: Tensor  # [R] float32, 1.0 = off
    presence_penalty: Tensor  # [R] float32, 0.0 = off
    frequency_penalty: Tensor  # [R] float32, 0.0 = off
    prompt_mask: Tensor | None  # [R, V] bool, None when no row uses penalties
    output_counts: Tensor | None  # [R, V] int32, None when no row uses penalties
    banned_rows: Tensor | None  # [K] int64, row of each (row, token) pair forced to -inf
    banned_tokens: Tensor | None  # [K] int64, token of each pair (min_tokens: EOS/stop ids)
    max_num_logprobs: int | None  # widest top-k any row asked for; None = no row wants any
    # CPU-side flags so the sampler skips work without reading device tensors.
    all_greedy: bool
    any_penalties: bool
    any_top_k_top_p: bool
    any_min_p: bool


@dataclass
class LogprobsTensors:
    """Raw logprobs (before penalties and temperature) of the sampled and top tokens."""

    token_ids: Tensor  # [R, k+1] int64, column 0 = the sampled token
    logprobs: Tensor  # [R, k+1] float32
    ranks: Tensor  # [R] int64, rank of the sampled token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # None when max_num_logprobs is None


class Sampler:
    """Order: float32 → banned tokens → penalties → greedy argmax | temperature → min_p →
    top-k/top-p → + Gumbel noise → argmax. Logprobs come from the float32 logits before
    any of it (vLLM's default "raw" logprobs); rows wanting fewer than `max_num_logprobs`
    are trimmed by the caller.
    """

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2, f"logits must be [R, V], got {tuple(logits.shape)}"
        assert meta.temperature.shape == logits.shape[:1], (
            f"temperature {tuple(meta.temperature.shape)} must be [R={logits.shape[0]}]"
        )
        # `.float()` is a no-op on float32 input; every op below returns a new tensor, so
        # the caller's logits and `raw` are never written.
        raw = logits.float()
        x = raw
        if meta.banned_rows is not None:
            assert meta.banned_tokens is not None, "banned_rows given without banned_tokens"
            x = x.index_put((meta.banned_rows, meta.banned_tokens), x.new_tensor(float("-inf")))
        if meta.any_penalties:
            assert meta.prompt_mask is not None and meta.output_counts is not None, (
                "any_penalties needs prompt_mask and output_counts"
            )
            x = apply_penalties(
                x,
                meta.prompt_mask,
                meta.output_counts,
                meta.repetition_penalty,
                meta.presence_penalty,
                meta.frequency_penalty,
            )
        greedy = x.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled = torch.where(meta.temperature == 0, greedy, self._sample_random(x, meta))
        logprobs = None
        if meta.max_num_logprobs is not None:
            ids, values, ranks = topk_logprobs(raw, meta.max_num_logprobs, sampled)
            logprobs = LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample_random(x: Tensor, meta: SamplingMetadata) -> Tensor:
        """Gumbel-max over every row; greedy rows' results are discarded by the caller."""
        # Greedy rows divide by 1 rather than 0 so no inf/nan is made, even transiently.
        temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
        x = x / temperature.to(x.dtype)[:, None]
        if meta.any_min_p:
            x = apply_min_p(x, meta.min_p)
        if meta.any_top_k_top_p:
            x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
        x = x + gumbel_noise(meta.seeds, meta.positions, x.shape[1])
        return x.argmax(dim=-1)
