"""One step's rows under a grammar: their mask before sampling, their advance after.

The per-slot automaton state lives in a device tensor (`SamplingState.grammar_state`),
so a step reads it, masks, samples and writes it back all in stream order: the next
step's mask, queued by the host before this step's token is known, reads the advanced
state. A row whose sample is discarded (a prompt chunk before its last) keeps its state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.runner.structured.token_table import TokenGrammar


@dataclass
class GrammarStep:
    rows: Tensor  # [G] int64: batch rows under a grammar
    slots: Tensor  # [G] int64: their request slots
    keep: Tensor  # [G] bool: the row's sample is kept this step
    next_states: Tensor  # [G, V] int32: state after each token, -1 = not allowed
    states: Tensor  # [max_num_reqs] int32, persistent: each slot's automaton state

    @classmethod
    def build(
        cls,
        groups: list[tuple[TokenGrammar, slice]],  # each grammar and its span of `index`
        index: Tensor,  # [3, G] int64: rows, slots, keep
        states: Tensor,
    ) -> GrammarStep:
        rows, slots, keep = index[0], index[1], index[2].bool()
        parts = []
        for grammar, span in groups:
            current = states[slots[span]].long()
            parts.append(grammar.table[current][:, grammar.token_class])
        return cls(rows, slots, keep, torch.cat(parts), states)

    def forbidden(self, num_rows: int) -> Tensor:
        """[R, V] bool: True where a row's grammar forbids the token (other rows: none)."""
        out = torch.zeros(
            num_rows, self.next_states.shape[1], dtype=torch.bool, device=self.rows.device
        )
        out[self.rows] = self.next_states < 0
        return out

    def advance(self, sampled: Tensor) -> None:
        """Move each kept row to the state its sampled token leads to."""
        token = sampled[self.rows].long()
        new = self.next_states.gather(1, token[:, None]).squeeze(1)
        current = self.states[self.slots]
        # -1 only if every logit was -inf (nothing allowed was sampled): stay put.
        moved = torch.where(self.keep & (new >= 0), new, current)
        self.states.index_put_((self.slots,), moved)
