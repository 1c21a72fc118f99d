"""The sampler: [R, V] logits and per-row settings in, one token (and logprobs) per row out.

Gumbel-max sampling: argmax(logits / T + g) with g ~ Gumbel(0, 1) draws exactly from
softmax(logits / T), and because g is a hash of (seed, position, vocab index) a seeded
request samples the same token whatever else shares its batch, with no torch.Generator
per request and no Python loop over rows.

What this module does not know: requests, stop conditions or tokenizers. The runner fills
`SamplingMetadata` (seeds for unseeded requests, positions, penalty tables, banned pairs
for min_tokens) and reads `SamplerOutput`; the ops live in `pdserve.kernels.sampling`
(Triton on CUDA, torch on CPU). Nothing here reads a device value on the host: every
decision that skips work is a host field of `SamplingMetadata`, so on CUDA the sampler
only enqueues kernels and the step loop never waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.kernels.sampling import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    gumbel_argmax,
    topk_logprobs,
)
from pdserve.runner.structured.grammar_step import GrammarStep


@dataclass
class SamplingMetadata:
    """Per-step sampling settings, one row per sampled token, built by the runner. The
    per-row tensors are None only in a `greedy` batch (plain argmax reads none of them)."""

    temperature: Tensor | None  # [R] float32, 0 = greedy (exact argmax, no noise)
    top_k: Tensor | None  # [R] int32, 0 = off
    top_p: Tensor | None  # [R] float32, 1.0 = off
    min_p: Tensor | None  # [R] float32, 0.0 = off
    seeds: Tensor | None  # [R] int64
    positions: Tensor | None  # [R] int64, tokens before the one being sampled
    repetition_penalty: Tensor | None  # [R] float32, 1.0 = off
    presence_penalty: Tensor | None  # [R] float32, 0.0 = off
    frequency_penalty: Tensor | None  # [R] float32, 0.0 = off
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
    max_top_k: int  # largest top_k with 0 < k < V over the rows; 0 = no row uses top-k
    any_top_p: bool  # some row has top_p < 1

    num_rows: int | None = None  # set by `greedy`, where no tensor gives R
    # logit_bias: bias_values[i] is added to the logit of (bias_rows[i], bias_tokens[i]).
    bias_rows: Tensor | None = None  # [B] int64
    bias_tokens: Tensor | None = None  # [B] int64
    bias_values: Tensor | None = None  # [B] float32
    allowed_mask: Tensor | None = None  # [R, V] bool, True = forbidden by allowed_token_ids
    # bad_words: bad_word_values[i] (-inf where the row's output ends with a banned
    # sequence's start, else 0) is added at (bad_word_rows[i], bad_word_tokens[i]).
    bad_word_rows: Tensor | None = None  # [E] int64
    bad_word_tokens: Tensor | None = None  # [E] int64
    bad_word_values: Tensor | None = None  # [E] float32
    # Structured output: the rows under a grammar, masked here by their automaton states;
    # the runner advances the states with the sampled tokens (`grammar.advance`).
    grammar: GrammarStep | None = None

    @classmethod
    def greedy(cls, num_rows: int, max_num_logprobs: int | None) -> SamplingMetadata:
        """Every row greedy, no penalties, nothing banned: argmax needs no per-row tensor."""
        return cls(
            *([None] * 9), prompt_mask=None, output_counts=None, banned_rows=None,
            banned_tokens=None, max_num_logprobs=max_num_logprobs, all_greedy=True,
            any_penalties=False, any_top_k_top_p=False, any_min_p=False, max_top_k=0,
            any_top_p=False, num_rows=num_rows,
        )  # fmt: skip

    @property
    def rows(self) -> int:
        return self.num_rows if self.temperature is None else self.temperature.shape[0]

    def __post_init__(self) -> None:
        assert self.max_top_k >= 0, f"max_top_k must be >= 0, got {self.max_top_k}"
        assert self.temperature is not None or (
            self.num_rows is not None and self.all_greedy and not self.any_penalties
        ), "only an all-greedy batch without penalties may leave the per-row tensors out"
        assert self.any_top_k_top_p or (self.max_top_k == 0 and not self.any_top_p), (
            "max_top_k > 0 or any_top_p needs any_top_k_top_p: the sampler would skip the mask"
        )


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
    """Order: float32 → allowed_token_ids → structured output's grammar → banned tokens
    (min_tokens, then bad_words; each yields on a grammar or allowed_token_ids row it would
    leave with no token) → logit_bias → penalties → greedy argmax | temperature →
    min_p → top-k/top-p → + Gumbel noise → argmax (vLLM's order: its logits processors
    before its penalties). Logprobs come from the float32 logits before any of it (vLLM's
    default "raw" logprobs); rows wanting fewer than `max_num_logprobs` are trimmed by the
    caller.
    """

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2, f"logits must be [R, V], got {tuple(logits.shape)}"
        assert meta.rows == logits.shape[0], (
            f"sampling settings for {meta.rows} rows, logits [R={logits.shape[0]}, V]"
        )
        plain_argmax = (
            meta.all_greedy
            and meta.banned_rows is None
            and meta.bias_rows is None
            and meta.allowed_mask is None
            and meta.bad_word_rows is None
            and meta.grammar is None
            and not meta.any_penalties
        )
        if plain_argmax and meta.max_num_logprobs is None:
            # A plain argmax on the model's dtype: converting to float32 is exact and keeps
            # the order, so the token is the same, without a [R, V] float32 copy (at 512
            # rows of a 151,936 vocab, 311 MB written a step).
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)
        # `.float()` is a no-op on float32 input; every op below returns a new tensor, so
        # the caller's logits and `raw` are never written.
        raw = logits.float()
        x = raw
        if meta.allowed_mask is not None:
            x = x.masked_fill(meta.allowed_mask, float("-inf"))
        if meta.grammar is not None:
            x = meta.grammar.mask(x)
        # A ban yields where a restricted row (a grammar, allowed_token_ids) would be left
        # with no token: the restriction is the promise kept, then min_tokens, then
        # bad_words. An unrestricted row always keeps some token.
        restricted = meta.grammar is not None or meta.allowed_mask is not None
        if meta.banned_rows is not None:
            assert meta.banned_tokens is not None, "banned_rows given without banned_tokens"
            # torch.full, not new_tensor: a host scalar copied to the GPU is a blocking copy.
            minus_inf = torch.full((), float("-inf"), device=x.device)
            banned = x.index_put((meta.banned_rows, meta.banned_tokens), minus_inf)
            # min_tokens on a grammar whose only way on is EOS, or allowed_token_ids of stop
            # ids only: the row keeps its stop tokens and ends there (runner/stop_checker.py).
            x = _unless_emptied(banned, x) if restricted else banned
        if meta.bad_word_rows is not None:
            # Accumulated: two sequences ending in one token, one matched and one not, add
            # -inf and 0, where a plain write would keep either.
            banned = x.index_put(
                (meta.bad_word_rows, meta.bad_word_tokens), meta.bad_word_values, accumulate=True
            )
            # A bad word that is every token the grammar or allowed ids leave: the row
            # samples it rather than a token outside them.
            x = _unless_emptied(banned, x) if restricted else banned
        if meta.bias_rows is not None:
            assert meta.bias_tokens is not None and meta.bias_values is not None
            # Each (row, token) once per request; a banned one stays -inf (-inf + b).
            x = x.index_put((meta.bias_rows, meta.bias_tokens), meta.bias_values, accumulate=True)
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
        if meta.all_greedy:
            sampled = x.argmax(dim=-1)
        else:
            sampled = self._sample(x, meta)
        logprobs = None
        if meta.max_num_logprobs is not None:
            ids, values, ranks = topk_logprobs(raw, meta.max_num_logprobs, sampled)
            logprobs = LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample(x: Tensor, meta: SamplingMetadata) -> Tensor:
        """Gumbel-max for T > 0 rows, exact argmax for T = 0 rows, in one `gumbel_argmax`."""
        if not (meta.any_min_p or meta.any_top_k_top_p):
            # Fused: x / T + noise and the argmax in one pass, no [R, V] temporaries.
            return gumbel_argmax(x, meta.temperature, meta.seeds, meta.positions)
        # The masks act on the tempered distribution, so divide first; greedy rows divide
        # by 1 rather than 0 so no inf/nan is made, even transiently.
        is_random = meta.temperature != 0
        x = x / torch.where(is_random, meta.temperature, 1.0).to(x.dtype)[:, None]
        if meta.any_min_p:
            x = apply_min_p(x, meta.min_p)
        if meta.any_top_k_top_p:
            x = apply_top_k_top_p(x, meta.top_k, meta.top_p, meta.max_top_k, meta.any_top_p)
        # x is tempered already, so random rows get temperature 1 (x / 1 is exact) and
        # greedy rows keep 0. Every mask keeps the tokens tied with the row max, so a
        # greedy row's argmax is the same as on the unmasked logits.
        return gumbel_argmax(x, is_random.to(x.dtype), meta.seeds, meta.positions)


def _unless_emptied(banned: Tensor, before: Tensor) -> Tensor:
    """`banned` where a row keeps some finite logit, else the row as it was `before` the
    ban (one amax and one where, no host sync)."""
    alive = banned.amax(dim=-1, keepdim=True) > float("-inf")
    return torch.where(alive, banned, before)
