"""One step's rows under a grammar: their mask before sampling, their advance after.

The per-slot automaton state lives in a device tensor (`SamplingState.grammar_state`),
so a step reads it, masks, samples and writes it back all in stream order: the next
step's mask, queued by the host before this step's token is known, reads the advanced
state. A row whose sample is discarded (a prompt chunk before its last) keeps its state.
The ops are `pdserve.kernels.grammar` (one mask pass and one advance launch per grammar
in the batch, usually one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from pdserve.kernels.grammar import grammar_advance, grammar_mask
from pdserve.runner.structured.token_table import TokenGrammar


@dataclass
class GrammarGroup:
    """The batch's rows under one grammar."""

    grammar: TokenGrammar
    row_slot: Tensor  # [R] int64: the row's slot for this grammar's rows, -1 elsewhere
    rows: Tensor  # [G] int64
    slots: Tensor  # [G] int64
    keep: Tensor  # [G] bool: the row's sample is kept this step


@dataclass
class GrammarStep:
    groups: list[GrammarGroup]
    states: Tensor  # [max_num_reqs] int32, persistent: each slot's automaton state

    @classmethod
    def build(
        cls,
        num_rows: int,
        groups: list[tuple[TokenGrammar, np.ndarray, np.ndarray, np.ndarray]],
        # ^ each grammar with its rows, their slots and keep flags (host arrays)
        states: Tensor,
        to_device: Callable[[np.ndarray], Tensor],
    ) -> GrammarStep:
        """Every group's index arrays in one host copy."""
        parts = []
        for _, rows, slots, keep in groups:
            row_slot = np.full(num_rows, -1, dtype=np.int64)
            row_slot[rows] = slots
            parts += [row_slot, rows, slots, keep.astype(np.int64)]
        packed = to_device(np.concatenate(parts))
        out, at = [], 0
        for grammar, rows, _, _ in groups:
            g = len(rows)
            row_slot, rest = (
                packed[at : at + num_rows],
                packed[at + num_rows : at + num_rows + 3 * g],
            )
            out.append(
                GrammarGroup(grammar, row_slot, rest[:g], rest[g : 2 * g], rest[2 * g :].bool())
            )
            at += num_rows + 3 * g
        return cls(out, states)

    def mask(self, logits: Tensor) -> Tensor:
        """New logits, -inf where a row's grammar does not allow the token."""
        for g in self.groups:
            logits = grammar_mask(
                logits, g.row_slot, self.states, g.grammar.table, g.grammar.token_class
            )
        return logits

    def advance(self, sampled: Tensor) -> None:
        """Move each kept row to the state its sampled token leads to."""
        for g in self.groups:
            grammar_advance(
                sampled, g.rows, g.slots, g.keep, self.states, g.grammar.table,
                g.grammar.token_class,
            )  # fmt: skip
