"""Which requests get draft tokens, and how many: the scheduler's side of speculation.

A step verifies a request's draft by sampling every drafted position with the request's
own sampler and keeping the drafts up to the first one the sample disagrees with, then
that sample (runner/speculative/verify.py). That is exact while each position is sampled
as a step without drafts would sample it there: with its seed and position, and with the
drafts before it counted as output, which the runner does for penalties, bad_words and
min_tokens (runner/mrv2/model_runner.py `within`); logit_bias and allowed_token_ids read
no history. Structured output is the exception: its automaton state would have to step
through each draft on the device. So every generating request on this engine drafts
except those under a grammar (and held prefills and embeddings, which sample once); they
decode one token a step beside the drafting ones, in the same batch.
"""

from __future__ import annotations

import weakref

import numpy as np

from pdserve.runner.config import SpeculativeConfig
from pdserve.runner.request import Request
from pdserve.runner.speculative.ngram import NgramProposer


def can_draft(req: Request) -> bool:
    return not (req.hold_kv or req.pooling is not None or req.grammar is not None)


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        # `likely`'s lookup: an earlier occurrence of the last two tokens at least (one
        # where the lookup allows two). A lone earlier occurrence of the last token is how
        # sampled text that never repeats matches by chance (~0.3% of steps a request at a
        # 150k vocabulary and a few hundred tokens), and each such guess cost async
        # scheduling an overlapped step for a draft the next token then rarely made.
        self.shortest = max(config.prompt_lookup_min, min(2, config.prompt_lookup_max))
        # Each request's `shortest`-token runs that end before its last token, and how many
        # there are: `likely` adds the runs of its new tokens only. A longer pattern that
        # matches ends in a run of `shortest` that matches, so a lookup from `shortest` up
        # finds something exactly when the last run was seen before. Asking the proposer
        # instead searched every request's whole text each async step (3% of sampled
        # text's throughput at 32 requests on an H100). 32 requests of 256-512 random
        # tokens on this project's 2-core dev box: 105 us a step against the search's 205.
        self._runs: weakref.WeakKeyDictionary[Request, list] = weakref.WeakKeyDictionary()
        # Each request's tokens as an array that grows by its new tokens only: rebuilding
        # prompt + output each step costs ~60-170 us at 4-8k tokens, the lookup itself 5-26.
        # Weak keys: a request's array goes with it.
        self._tokens: weakref.WeakKeyDictionary[Request, tuple[np.ndarray, int]] = (
            weakref.WeakKeyDictionary()
        )

    def drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens to follow `req`'s last token, none past its token limit, the model
        length or `budget - 1` (the step's tokens left, its last token included)."""
        room = min(
            budget - 1,
            req.max_new_tokens - req.num_output_tokens - 1,  # the step samples one more
            self.max_model_len - req.num_tokens,  # the last sample's place in the table
        )
        if room <= 0 or not can_draft(req):
            return []
        return self.proposer.propose(self.tokens(req), room)

    def likely(self, req: Request) -> bool:
        """Whether `req` will likely draft once its newest token is known, judged by the
        tokens known so far (the scheduler's `drafts_due`, one token short): text that
        repeats matches from either."""
        room = min(  # `drafts`' room once the token in flight is known
            req.max_new_tokens - req.num_output_tokens - 2,
            self.max_model_len - req.num_tokens - 1,
        )
        if room <= 0 or not can_draft(req):
            return False
        size = self.shortest
        starts = req.num_tokens - size  # runs starting before this end before the last token
        if starts <= 0:
            return False
        state = self._runs.get(req)
        if state is None:
            state = self._runs[req] = [set(), 0]
        seen, done = state
        fresh = starts - done  # runs not yet seen: a step's new tokens make a few
        out = req.output_token_ids
        # The text from the first fresh run on: the output's tail where it holds it.
        if len(out) >= fresh + size:
            tail = out[len(out) - fresh - size :]
        else:
            tail = self.tokens(req)[done:].tolist()
        seen.update(zip(*(tail[j : j + fresh] for j in range(size))))
        state[1] = starts
        return tuple(tail[fresh:]) in seen

    def tokens(self, req: Request) -> np.ndarray:
        """`req`'s prompt + output as an int64 array (a view of a buffer kept per request)."""
        n, p = req.num_tokens, req.num_prompt_tokens
        buf, have = self._tokens.get(req, (None, 0))
        if buf is None or n > len(buf):
            grown = np.empty(2 * n + 64, dtype=np.int64)
            if buf is None:
                grown[:p] = req.prompt_token_ids
                have = p
            else:
                grown[:have] = buf[:have]
            buf = grown
        buf[have:n] = req.output_token_ids[have - p :]
        self._tokens[req] = (buf, n)
        return buf[:n]
