"""Parity of structured output's Triton kernels (`pdserve.kernels.grammar`) with their
torch specs: exact, since both only copy values and -inf. Without CUDA they run under
TRITON_INTERPRET=1 (conftest) at a vocabulary that is not a multiple of the tile."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.grammar import (
    MASK_BLOCK,
    grammar_advance_ref,
    grammar_advance_triton,
    grammar_mask_ref,
    grammar_mask_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = MASK_BLOCK + 1003 if DEVICE == "cpu" else 151_936


def _grammar(num_states: int, num_classes: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(-1, num_states, (num_states, num_classes), generator=g)
    table[torch.rand(table.shape, generator=g) < 0.5] = -1  # half the entries forbidden
    # The token class table may be longer than the logits (a model padded past its vocab).
    token_class = torch.randint(0, num_classes, (vocab + 5,), generator=g)
    return table.to(torch.int32).to(DEVICE), token_class.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7])
def test_mask_equals_the_spec_and_leaves_its_input(dtype, num_rows):
    """Guards the mask pass: a wrong class or state index, a row without a grammar that
    is masked anyway, or a ragged last tile, each changes which logits are -inf."""
    table, token_class = _grammar(13, 40, VOCAB, 0)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(num_rows, VOCAB, generator=g).to(dtype).to(DEVICE)
    before = logits.clone()
    states = torch.randint(0, 13, (9,), generator=g, dtype=torch.int32).to(DEVICE)
    row_slot = torch.randint(-1, 9, (num_rows,), generator=g).to(DEVICE)
    if num_rows > 1:
        row_slot[0], row_slot[1] = -1, 4  # one row of each kind at least
    got = grammar_mask_triton(logits, row_slot, states, table, token_class)
    want = grammar_mask_ref(logits, row_slot, states, table, token_class)
    assert torch.equal(got, want)
    assert torch.equal(logits, before)
    masked = torch.isinf(got).sum(dim=1)
    for r in range(num_rows):
        assert (masked[r] > 0) == bool(row_slot[r] >= 0)


def test_advance_equals_the_spec():
    """Guards the state update: kept rows move to their token's next state, discarded
    rows (a prompt chunk's sample) and tokens that were not allowed leave it as it was,
    and slots outside the batch are never written."""
    table, token_class = _grammar(11, 30, VOCAB, 2)
    g = torch.Generator().manual_seed(3)
    states = torch.randint(0, 11, (16,), generator=g, dtype=torch.int32).to(DEVICE)
    sampled = torch.randint(0, VOCAB, (12,), generator=g).to(DEVICE)
    rows = torch.tensor([0, 2, 3, 5, 8, 9, 11], device=DEVICE)
    slots = torch.tensor([4, 1, 15, 7, 0, 9, 12], device=DEVICE)
    keep = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.bool, device=DEVICE)
    a, b = states.clone(), states.clone()
    grammar_advance_triton(sampled, rows, slots, keep, a, table, token_class)
    grammar_advance_ref(sampled, rows, slots, keep, b, table, token_class)
    assert torch.equal(a, b)
    nxt = table[states[slots].long(), token_class[sampled[rows]]]
    moved = keep & (nxt >= 0)
    assert moved.any() and (~moved).any(), "the case must have both kinds of row"
    untouched = torch.ones(16, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(a[untouched], states[untouched])
