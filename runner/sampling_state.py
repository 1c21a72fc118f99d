"""Per-slot sampling settings, kept on the host and gathered per step into `SamplingMetadata`.

Both runners use it: a slot's row is written once when its request is added, and each
step gathers the batch's rows (by `idx_mapping`) into fresh tensors, so the persistent
arrays are never the source of an in-flight copy. Penalty tensors are built only for
the rows that ask for penalties, from token histories the caller supplies.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pdserve.runner.bad_words import ban_values
from pdserve.runner.sampler import SamplingMetadata
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.structured.grammar_step import GrammarStep
from pdserve.runner.structured.token_table import TokenGrammar


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        n = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int32)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.seeds = np.zeros(n, dtype=np.int64)
        self.repetition_penalty = np.ones(n, dtype=np.float32)
        self.presence_penalty = np.zeros(n, dtype=np.float32)
        self.frequency_penalty = np.zeros(n, dtype=np.float32)
        self.min_tokens = np.zeros(n, dtype=np.int32)
        self.num_logprobs = np.full(n, -1, dtype=np.int32)  # -1: none asked
        self.num_prompt_logprobs = np.full(n, -1, dtype=np.int32)
        self.needs_penalties = np.zeros(n, dtype=bool)
        self.stop_ids: list[tuple[int, ...]] = [() for _ in range(n)]
        # logit_bias as (token ids, biases) and allowed_token_ids as ids, arrays made once
        # at `add` (a word list may hold thousands), read only for slots flagged in `has_*`.
        none_i, none_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        self.bias: list[tuple[np.ndarray, np.ndarray]] = [(none_i, none_f)] * n
        self.allowed: list[np.ndarray] = [none_i] * n
        self.has_bias = np.zeros(n, dtype=bool)
        self.has_allowed = np.zeros(n, dtype=bool)
        # bad_words as token sequences (runner/bad_words.py), read for `has_bad_words` slots.
        self.bad_words: list[tuple[tuple[int, ...], ...]] = [()] * n
        self.has_bad_words = np.zeros(n, dtype=bool)
        # Structured output: each slot's grammar (runner/structured/) and, on the device,
        # its automaton state, which the step advances after sampling (grammar_step.py).
        self.grammar: list[TokenGrammar | None] = [None] * n
        self.has_grammar = np.zeros(n, dtype=bool)
        self.grammar_state = torch.zeros(n, dtype=torch.int32, device=device)

    def add(
        self,
        slot: int,
        params: SamplingParams,
        seed: int,
        stop_ids: tuple[int, ...],
        bad_words: tuple[tuple[int, ...], ...] = (),
        grammar: TokenGrammar | None = None,
        output_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Overwrite every per-slot field (a reused slot must not inherit anything).
        `output_ids`: what the request has generated already (a resumed request, or a
        decode worker's whose first token came from prefill); its grammar starts after it."""
        self.temperature[slot] = params.temperature
        # int32 slots: a top_k of the vocabulary or more keeps every token, as 0 does, and
        # no sequence reaches 2**31 tokens, so neither substitution changes a sample.
        self.top_k[slot] = params.top_k if params.top_k < self.vocab_size else 0
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.seeds[slot] = _fold_seed(seed)
        self.repetition_penalty[slot] = params.repetition_penalty
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.min_tokens[slot] = min(params.min_tokens, np.iinfo(np.int32).max)
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[slot] = (
            -1 if params.prompt_logprobs is None else params.prompt_logprobs
        )
        self.needs_penalties[slot] = params.needs_penalties
        self.stop_ids[slot] = tuple(stop_ids)
        bias = params.logit_bias or {}
        self.bias[slot] = (
            np.fromiter(bias, dtype=np.int64, count=len(bias)),
            np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
        )
        self.allowed[slot] = np.asarray(params.allowed_token_ids or (), dtype=np.int64)
        self.has_bias[slot] = bool(bias)
        self.has_allowed[slot] = len(self.allowed[slot]) > 0
        self.bad_words[slot] = bad_words
        self.has_bad_words[slot] = bool(bad_words)
        self.grammar[slot] = grammar
        self.has_grammar[slot] = grammar is not None
        if grammar is not None:
            # fill_ is a kernel with the value as its argument: no blocking copy, and it
            # runs after every step already queued (which may still move the slot's last
            # owner's state).
            self.grammar_state[slot].fill_(grammar.state_after(list(output_ids)))

    def metadata(
        self,
        slots: np.ndarray,  # [R] int: batch row -> slot
        positions: np.ndarray,  # [R] int: absolute position of the token each row samples
        num_outputs: np.ndarray,  # [R] int: tokens generated so far (min_tokens, penalties)
        penalty_tokens: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        # ^ per penalty row (in the order of `penalty_rows`): (prompt ids, output ids) as
        #   device tensors, so building penalty tables never reads the device
        to_device: Callable[[np.ndarray], torch.Tensor] | None = None,
        recent_tokens: Callable[[np.ndarray, int], torch.Tensor] | None = None,
        # ^ (batch rows, W) -> [len(rows), W] device tensor: each row's last W tokens
        #   before the one it samples (read where bad_words need the output's tail)
        keep: np.ndarray | None = None,  # [R] bool: rows whose sample is kept (all if None)
    ) -> SamplingMetadata:
        """Gather the batch's rows; packed host->device copies (floats, ints, and where
        used banned pairs, logit_bias entries, allowed ids, bad-word sequences), never
        one per field."""
        dev = self.device
        to_device = to_device or (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev))
        temp = self.temperature[slots]
        top_k, top_p, min_p = self.top_k[slots], self.top_p[slots], self.min_p[slots]
        num_lp = self.num_logprobs[slots]
        pen_rows = self.penalty_rows(slots)
        blocked = np.nonzero(num_outputs < self.min_tokens[slots])[0]
        pairs = [(row, tok) for row in blocked.tolist() for tok in self.stop_ids[slots[row]]]
        biased = np.nonzero(self.has_bias[slots])[0].tolist()
        restricted = np.nonzero(self.has_allowed[slots])[0].tolist()
        # A sequence of k tokens needs k - 1 generated ones before it can complete.
        bad = [
            (row, seq)
            for row in np.nonzero(self.has_bad_words[slots])[0].tolist()
            for seq in self.bad_words[slots[row]]
            if len(seq) - 1 <= num_outputs[row]
        ]
        grammar_rows = np.nonzero(self.has_grammar[slots])[0]
        all_greedy = bool((temp == 0).all())
        extras = pairs or biased or restricted or bad or len(grammar_rows)
        if all_greedy and not len(pen_rows) and not extras:
            # Plain argmax reads none of the per-row settings: skip their two copies (a
            # greedy batch's host step is launch-bound; each copy costs tens of us there).
            return SamplingMetadata.greedy(
                len(slots), int(num_lp.max()) if (num_lp >= 0).any() else None
            )
        floats = to_device(
            np.stack(
                [
                    temp,
                    top_p,
                    min_p,
                    self.repetition_penalty[slots],
                    self.presence_penalty[slots],
                    self.frequency_penalty[slots],
                ]
            ).astype(np.float32)
        )
        ints = to_device(
            np.stack(
                [self.seeds[slots], np.asarray(positions, dtype=np.int64), top_k.astype(np.int64)]
            )
        )
        banned_rows = banned_tokens = None
        if pairs:
            packed = to_device(np.asarray(pairs, dtype=np.int64).T.copy())
            banned_rows, banned_tokens = packed[0], packed[1]
        bias = self._bias_triples(slots, biased, to_device) if biased else None
        allowed_mask = self._allowed_mask(slots, restricted, to_device) if restricted else None
        grammar = (
            self._grammar_step(slots, grammar_rows, keep, to_device) if len(grammar_rows) else None
        )
        bans = self._bad_word_bans(bad, recent_tokens, to_device) if bad else None
        prompt_mask = output_counts = None
        if len(pen_rows):
            assert penalty_tokens is not None and len(penalty_tokens) == len(pen_rows), (
                "penalty rows need their token histories"
            )
            r = len(slots)
            prompt_mask = torch.zeros(r, self.vocab_size, dtype=torch.bool, device=dev)
            output_counts = torch.zeros(r, self.vocab_size, dtype=torch.int32, device=dev)
            for row, (prompt_ids, output_ids) in zip(pen_rows, penalty_tokens, strict=True):
                prompt_mask[int(row)].index_fill_(0, prompt_ids.to(dev).long(), True)
                out = output_ids.to(dev).long()
                output_counts[int(row)].scatter_add_(
                    0, out, torch.ones_like(out, dtype=torch.int32)
                )
        # One unbind per packed tensor rather than one index op per field: each op costs
        # the host a few us of dispatch on a GPU.
        temperature_t, top_p_t, min_p_t, repetition_t, presence_t, frequency_t = floats.unbind(0)
        seeds_t, positions_t, top_k_t = ints.unbind(0)
        return SamplingMetadata(
            temperature=temperature_t,
            top_k=top_k_t.to(torch.int32),
            top_p=top_p_t,
            min_p=min_p_t,
            seeds=seeds_t,
            positions=positions_t,
            repetition_penalty=repetition_t,
            presence_penalty=presence_t,
            frequency_penalty=frequency_t,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            banned_rows=banned_rows,
            banned_tokens=banned_tokens,
            bias_rows=None if bias is None else bias[0],
            bias_tokens=None if bias is None else bias[1],
            bias_values=None if bias is None else bias[2],
            allowed_mask=allowed_mask,
            bad_word_rows=None if bans is None else bans[0],
            bad_word_tokens=None if bans is None else bans[1],
            bad_word_values=None if bans is None else bans[2],
            grammar=grammar,
            max_num_logprobs=int(num_lp.max()) if (num_lp >= 0).any() else None,
            all_greedy=all_greedy,
            any_penalties=bool(len(pen_rows)),
            any_top_k_top_p=bool(((top_k > 0) | (top_p < 1)).any()),
            any_min_p=bool((min_p > 0).any()),
            max_top_k=int(np.where(top_k < self.vocab_size, top_k, 0).max(initial=0)),
            any_top_p=bool((top_p < 1).any()),
        )

    def _bias_triples(
        self, slots: np.ndarray, rows: list[int], to_device: Callable[[np.ndarray], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, token ids, biases) of the batch's logit_bias entries, in one float32
        copy: ids and rows are exact in float32 (vocabularies stay far below 2**24)."""
        entries = [self.bias[slots[row]] for row in rows]
        packed = np.stack(
            [
                np.repeat(np.asarray(rows, dtype=np.float32), [len(ids) for ids, _ in entries]),
                np.concatenate([ids for ids, _ in entries]).astype(np.float32),
                np.concatenate([biases for _, biases in entries]),
            ]
        )
        t = to_device(packed)
        return t[0].long(), t[1].long(), t[2]

    def _allowed_mask(
        self, slots: np.ndarray, rows: list[int], to_device: Callable[[np.ndarray], torch.Tensor]
    ) -> torch.Tensor:
        """[R, V] bool, True where allowed_token_ids forbid the token (rows without a list
        forbid nothing), from one copy of the restricted rows and their (row, id) pairs."""
        lists = [self.allowed[slots[row]] for row in rows]
        pair_rows = np.repeat(np.asarray(rows, dtype=np.int64), [len(ids) for ids in lists])
        rows_np = np.asarray(rows, dtype=np.int64)
        packed = to_device(np.concatenate([rows_np, pair_rows, *lists]))
        a, k = len(rows), len(pair_rows)
        forbidden = torch.zeros(len(slots), self.vocab_size, dtype=torch.bool, device=self.device)
        forbidden.index_fill_(0, packed[:a], True)
        # A device scalar: a host one would be a blocking copy on a GPU.
        no = torch.zeros((), dtype=torch.bool, device=self.device)
        return forbidden.index_put_((packed[a : a + k], packed[a + k :]), no)

    def _grammar_step(
        self,
        slots: np.ndarray,
        rows: np.ndarray,
        keep: np.ndarray | None,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> GrammarStep:
        """The rows under a grammar, grouped by grammar, from one host copy."""
        by_grammar: dict[int, tuple[TokenGrammar, list[int]]] = {}
        for row in rows.tolist():
            g = self.grammar[slots[row]]
            by_grammar.setdefault(id(g), (g, []))[1].append(row)
        kept = np.ones(len(slots), dtype=bool) if keep is None else keep
        groups = []
        for grammar, group in by_grammar.values():
            r = np.asarray(group, dtype=np.int64)
            groups.append((grammar, r, slots[r].astype(np.int64), kept[r]))
        return GrammarStep.build(len(slots), groups, self.grammar_state, to_device)

    def _bad_word_bans(
        self,
        entries: list[tuple[int, tuple[int, ...]]],
        recent_tokens: Callable[[np.ndarray, int], torch.Tensor] | None,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(seq) for _, seq in entries) - 1
        if width == 0:  # one-token words only: nothing of the output is read
            recent = torch.zeros(len(entries), 0, dtype=torch.int64, device=self.device)
        else:
            assert recent_tokens is not None, "multi-token bad_words need the rows' tokens"
            rows = np.fromiter((row for row, _ in entries), dtype=np.int64, count=len(entries))
            recent = recent_tokens(rows, width)
        return ban_values(entries, recent, to_device)

    def penalty_rows(self, slots: np.ndarray) -> np.ndarray:
        """Batch rows (indices into `slots`) whose request uses any penalty."""
        return np.nonzero(self.needs_penalties[slots])[0]


def _fold_seed(seed: int) -> int:
    """Any Python int -> a signed int64 (the noise hash mixes both 32-bit halves)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= (1 << 63) else seed
