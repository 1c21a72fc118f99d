"""Beam search, as vLLM runs it (`LLM.beam_search`, the OpenAI server's `use_beam_search`):
on top of the engine, one token at a time.

Each step asks for one token after every live beam, with the top `2 * beam_width`
logprobs of that position; the prompt of each ask is the beam's whole text, so all but
its last token are prefix-cache hits. Every (beam, candidate token) pair is a candidate
with the beam's cumulative logprob plus the token's. A candidate ending in an EOS token
(unless `ignore_eos`) is complete; the `beam_width` best of the others are the next live
beams. After `max_tokens` steps (or when no beam is left, or at the model's length) the
complete and the live beams are ranked by

    cumulative logprob / length ** length_penalty

(length: prompt and generated tokens, less a final EOS: vLLM's score), and the best
`beam_width` are the answer. Ties keep the order candidates were made in (beam order,
then the position's own ranking).

Candidates are the position's top `2 * beam_width` tokens by rank; the token the ask
sampled, which its logprobs also carry, counts only when it is among them (so a
temperature above 0 changes nothing). `BeamSearch` is the state of one prompt's search;
the drivers (runner/llm.py offline,
cluster/beam_routes.py over HTTP) ask the engine and feed it the answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.runner.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step reads 2 * beam_width logprobs a beam


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's fields. `temperature` picks the token each one-token ask samples, which beam
    search does not use: the candidates are ranked by logprob whatever it is."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        w = self.beam_width
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (got {w!r})")
        if isinstance(self.max_tokens, bool) or not (
            isinstance(self.max_tokens, int) and self.max_tokens >= 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite (got {self.length_penalty!r})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (got {self.temperature!r})")

    def step_params(self) -> SamplingParams:
        """What each one-token ask runs with."""
        return SamplingParams(
            max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
            ignore_eos=True,
        )  # fmt: skip


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the generated tokens (vLLM's layout);
    `text` (set on the answer) is the generated part, a final EOS left out unless
    `include_stop_str_in_output`."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # each generated token's
    finish_reason: str | None = None  # "stop" (EOS) or "length" on the answer
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(seq: BeamSearchSequence, length_penalty: float) -> float:
    """cum / length ** length_penalty; a beam that completed ("stop") ends in its EOS,
    which the length does not count."""
    length = len(seq.tokens) - (seq.finish_reason == "stop")
    return seq.cum_logprob / (length**length_penalty)


class BeamSearch:
    """One prompt's search: `live` are the beams the next step extends; `advance` takes,
    per live beam, the (token, logprob) candidates of its next position."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("beam search needs a prompt of at least one token")
        self.params = params
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        n = len(prompt_token_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids), n)]
        self.complete: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def advance(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> None:
        assert len(candidates) == len(self.live), (len(candidates), len(self.live))
        grown: list[BeamSearchSequence] = []
        for beam, options in zip(self.live, candidates, strict=True):
            for token, logprob in options:
                seq = BeamSearchSequence(
                    beam.tokens + [token], beam.num_prompt_tokens, beam.cum_logprob + logprob,
                    beam.logprobs + [logprob],
                )  # fmt: skip
                if token in self.eos_ids and not self.params.ignore_eos:
                    seq.finish_reason = "stop"
                    self.complete.append(seq)
                else:
                    grown.append(seq)
        grown.sort(key=lambda s: s.cum_logprob, reverse=True)  # stable: ties keep order
        self.live = grown[: self.params.beam_width]
        self.steps += 1
        # A beam at the model's length cannot take another token.
        full = [s for s in self.live if len(s.tokens) >= self.max_model_len]
        if full:
            self.live = [s for s in self.live if len(s.tokens) < self.max_model_len]
            for seq in full:
                seq.finish_reason = "length"
            self.complete += full

    def answer(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        for seq in self.live:
            seq.finish_reason = "length"
        ranked = sorted(
            self.complete + self.live,
            key=lambda s: beam_score(s, self.params.length_penalty),
            reverse=True,
        )[: self.params.beam_width]
        for seq in ranked:  # every beam has its finish_reason now
            out = seq.output_token_ids
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                out = out[:-1]
            seq.text = decode(out)
        return BeamSearchOutput(ranked)


def top_candidates(rows: Sequence[tuple[int, float, int]], k: int) -> list[tuple[int, float]]:
    """(token, logprob) of a position's rows (token, logprob, rank) ranked 1..k."""
    return [(int(t), float(lp)) for t, lp, rank in sorted(rows, key=lambda r: r[2]) if rank <= k]


def pending(searches: list[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]]]:
    """The searches not done, and the token lists of their live beams, in order: one
    step's asks."""
    live = [s for s in searches if not s.done]
    return live, [b.tokens for s in live for b in s.live]


def advance_all(live: list[BeamSearch], rows: Sequence[Sequence[tuple[int, float, int]]]) -> None:
    """Feed each live beam its next position's rows (token, logprob, rank), in the order
    `pending` gave the asks."""
    it = iter(rows)
    for s in live:
        k = 2 * s.params.beam_width
        s.advance([top_candidates(next(it), k) for _ in s.live])


def run_searches(
    searches: list[BeamSearch],
    ask: Callable[[list[list[int]]], list[list[tuple[int, float, int]]]],
    progress: Callable[[], None] | None = None,
) -> None:
    """Step every search until all are done; `ask` answers one step's asks."""
    while True:
        live, asks = pending(searches)
        if not live:
            return
        advance_all(live, ask(asks))
        if progress is not None:
            progress()
