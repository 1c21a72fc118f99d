"""Structured output's two per-step ops: mask a batch's logits by each row's automaton
state, and move the states on by the sampled tokens (runner/structured/).

Both read one grammar's token table: `table[state, token_class[token]]` is the state the
token leads to, -1 where it is not allowed. Rows reach their state through their slot
(`states[slot]`, a persistent device tensor), so the host never needs a sampled token.

`grammar_mask` is one pass over [R, V] that writes a new tensor (the sampler's ops are
pure: its input may be the caller's logits); rows with `row_slot` -1 are copied as they
are. `grammar_advance` is one tiny program per grammar row. Torch code (`_ref`) is the
spec and the CPU path; `name` sends CUDA tensors to `name_triton` (which the tests run on
CPU tensors under TRITON_INTERPRET=1). They replace ~12 torch ops a step. On the H200 a
32-row step under a grammar then costs about what a sampled one does (1.6-1.9 ms against
1.55-1.8 at best); both are host-bound there, ±20% run to run, which is as large as the
difference between the torch and Triton forms (`benchmarks/structured_overhead.py`,
results/structured_overhead_ab_*_c1a39e2.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MASK_BLOCK = 2048


def grammar_mask_ref(
    logits: Tensor,  # [R, V] float
    row_slot: Tensor,  # [R] int64: the row's slot, -1 = no grammar (copied as is)
    states: Tensor,  # [max_num_reqs] int32: each slot's state
    table: Tensor,  # [S, C] int32: next state, -1 = not allowed
    token_class: Tensor,  # [V'] int64, V' >= V
) -> Tensor:
    """New [R, V] logits: -inf where a grammar row's state does not allow the token."""
    rows = torch.nonzero(row_slot >= 0).squeeze(1)
    state = states[row_slot[rows]].long()
    allowed = table[state][:, token_class[: logits.shape[1]]] >= 0
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


@triton.jit
def _grammar_mask_kernel(
    logits_ptr,  # [R, V] float, unit stride along V
    out_ptr,  # [R, V] same dtype, contiguous
    row_slot_ptr,  # [R] int64
    states_ptr,  # [max_num_reqs] int32
    table_ptr,  # [S, C] int32, contiguous
    token_class_ptr,  # [V'] int64
    vocab_size,
    row_stride,
    num_classes,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    x = tl.load(logits_ptr + row * row_stride + cols, mask=inside)
    slot = tl.load(row_slot_ptr + row)
    if slot >= 0:
        state = tl.load(states_ptr + slot).to(tl.int64)
        klass = tl.load(token_class_ptr + cols, mask=inside, other=0)
        nxt = tl.load(table_ptr + state * num_classes + klass, mask=inside, other=0)
        x = tl.where(nxt < 0, float("-inf"), x)
    tl.store(out_ptr + row * vocab_size + cols, x, mask=inside)


def grammar_mask(
    logits: Tensor, row_slot: Tensor, states: Tensor, table: Tensor, token_class: Tensor
) -> Tensor:
    if logits.is_cuda:
        return grammar_mask_triton(logits, row_slot, states, table, token_class)
    return grammar_mask_ref(logits, row_slot, states, table, token_class)


def grammar_mask_triton(
    logits: Tensor, row_slot: Tensor, states: Tensor, table: Tensor, token_class: Tensor
) -> Tensor:
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [R, V], unit stride"
    assert row_slot.shape == logits.shape[:1] and row_slot.dtype == torch.int64
    assert states.dtype == torch.int32 and table.dtype == torch.int32 and table.is_contiguous()
    assert token_class.dtype == torch.int64 and token_class.numel() >= logits.shape[1]
    num_rows, vocab = logits.shape
    out = torch.empty((num_rows, vocab), dtype=logits.dtype, device=logits.device)
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(vocab, MASK_BLOCK))
    _grammar_mask_kernel[grid](
        logits, out, row_slot, states, table, token_class, vocab, logits.stride(0),
        table.shape[1], BLOCK=MASK_BLOCK,
    )  # fmt: skip
    return out


def grammar_advance_ref(
    sampled: Tensor,  # [R] int64: the step's tokens
    rows: Tensor,  # [G] int64: grammar rows
    slots: Tensor,  # [G] int64: their slots
    keep: Tensor,  # [G] bool: the row's sample is kept
    states: Tensor,  # [max_num_reqs] int32, updated in place
    table: Tensor,
    token_class: Tensor,
) -> None:
    """states[slot] = the state the row's token leads to, for kept rows. A token that was
    not allowed (-1: only when every logit was -inf) leaves the state as it was."""
    current = states[slots]
    nxt = table[current.long(), token_class[sampled[rows]]]
    states.index_put_((slots,), torch.where(keep & (nxt >= 0), nxt, current))


@triton.jit
def _grammar_advance_kernel(
    sampled_ptr, rows_ptr, slots_ptr, keep_ptr, states_ptr, table_ptr, token_class_ptr,
    num_classes,
):  # fmt: skip
    g = tl.program_id(0)
    slot = tl.load(slots_ptr + g)
    token = tl.load(sampled_ptr + tl.load(rows_ptr + g))
    state = tl.load(states_ptr + slot).to(tl.int64)
    nxt = tl.load(table_ptr + state * num_classes + tl.load(token_class_ptr + token))
    if (tl.load(keep_ptr + g) != 0) & (nxt >= 0):
        tl.store(states_ptr + slot, nxt)


def grammar_advance(
    sampled: Tensor,
    rows: Tensor,
    slots: Tensor,
    keep: Tensor,
    states: Tensor,
    table: Tensor,
    token_class: Tensor,
) -> None:
    if sampled.is_cuda:
        return grammar_advance_triton(sampled, rows, slots, keep, states, table, token_class)
    return grammar_advance_ref(sampled, rows, slots, keep, states, table, token_class)


def grammar_advance_triton(
    sampled: Tensor,
    rows: Tensor,
    slots: Tensor,
    keep: Tensor,
    states: Tensor,
    table: Tensor,
    token_class: Tensor,
) -> None:
    assert rows.shape == slots.shape == keep.shape and keep.dtype == torch.bool
    assert states.dtype == torch.int32 and table.dtype == torch.int32 and table.is_contiguous()
    if rows.numel():
        _grammar_advance_kernel[(rows.numel(),)](
            sampled, rows, slots, keep, states, table, token_class, table.shape[1]
        )
    return None
