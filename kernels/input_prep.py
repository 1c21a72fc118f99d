"""Build a step's flat inputs on the device from per-slot state (DESIGN §3, InputBatch).

The CPU ships only `idx_mapping` (batch row -> slot), `query_start_loc` and each row's
`num_computed_tokens`; token ids come from the device-side token history, which the
post-update kernel has already extended with the last sampled token. So a token sampled
at step N reaches step N+1's `input_ids` without a round trip through the CPU.
Padding (CUDA graph sizes): input ids 0, positions 0, seq_lens 0.

Device path: `prepare_inputs` runs one Triton program per batch row (looping over the
row's query tokens) plus one program that writes the pads; `post_update` is one
vectorised program per 256 rows. Grids come from shapes and the host-known `num_tokens`,
so both launch without reading the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Query tokens handled per loop iteration of a row's program: a decode row uses 1 lane,
# a 2k-token prefill chunk takes 8 iterations.
_TOKEN_BLOCK = 256


def _row_of_token(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    # [T] int64: which batch row owns each flat token.
    tok = torch.arange(num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].long(), tok, right=True)


def prepare_inputs_ref(
    idx_mapping: torch.Tensor,  # [R] int32: batch row -> slot
    query_start_loc: torch.Tensor,  # [R + 1] int32
    num_computed_tokens: torch.Tensor,  # [R] int32
    token_ids: torch.Tensor,  # [max_num_reqs, max_len] int32: per-slot token history
    input_ids: torch.Tensor,  # [T_pad] int32 out
    positions: torch.Tensor,  # [T_pad] int64 out
    seq_lens: torch.Tensor,  # [R_pad] int32 out
    num_tokens: int,  # query_start_loc[R], known on the host (no device read)
) -> None:
    num_reqs = idx_mapping.numel()
    row = _row_of_token(query_start_loc, num_tokens)
    qsl = query_start_loc.long()
    pos = num_computed_tokens.long()[row] + (torch.arange(num_tokens, device=row.device) - qsl[row])
    slots = idx_mapping.long()[row]
    input_ids[:num_tokens] = token_ids[slots, pos]
    input_ids[num_tokens:] = 0
    positions[:num_tokens] = pos
    positions[num_tokens:] = 0
    seq_lens[:num_reqs] = num_computed_tokens + (query_start_loc[1:] - query_start_loc[:-1])
    seq_lens[num_reqs:] = 0


def _is_index(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int32, torch.int64)


# Sizes change every step and the per-row inputs are slices of one packed buffer, so
# specialising on their values (== 1, % 16) or alignment would compile new variants
# mid-serving; none of them affects vectorisation here.
@triton.jit(
    do_not_specialize=["num_reqs", "num_tokens", "num_tokens_padded", "num_reqs_padded"],
    do_not_specialize_on_alignment=[
        "idx_mapping_ptr",
        "query_start_loc_ptr",
        "num_computed_tokens_ptr",
    ],
)
def _prepare_inputs_kernel(
    idx_mapping_ptr,
    query_start_loc_ptr,
    num_computed_tokens_ptr,
    token_ids_ptr,
    input_ids_ptr,
    positions_ptr,
    seq_lens_ptr,
    token_ids_row_stride,
    max_len,
    num_reqs,
    num_tokens,
    num_tokens_padded,
    num_reqs_padded,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if r < num_reqs:
        slot = tl.load(idx_mapping_ptr + r).to(tl.int64)
        q_start = tl.load(query_start_loc_ptr + r)
        q_end = tl.load(query_start_loc_ptr + r + 1)
        computed = tl.load(num_computed_tokens_ptr + r)
        seq_len = computed + (q_end - q_start)
        tl.store(seq_lens_ptr + r, seq_len.to(seq_lens_ptr.dtype.element_ty))
        # int64: num_reqs * max_len can pass 2^31 (256 slots x 8M tokens).
        history_ptr = token_ids_ptr + slot * token_ids_row_stride
        for off in range(0, q_end - q_start, BLOCK):
            i = off + tl.arange(0, BLOCK)
            tok = q_start + i
            pos = computed.to(tl.int64) + i
            # `tok < num_tokens` keeps the row writes and the pad writes disjoint.
            mask = (tok < q_end) & (tok < num_tokens)
            ids = tl.load(history_ptr + pos, mask=mask & (pos < max_len), other=0)
            tl.store(input_ids_ptr + tok, ids.to(input_ids_ptr.dtype.element_ty), mask=mask)
            tl.store(positions_ptr + tok, pos.to(positions_ptr.dtype.element_ty), mask=mask)
    else:
        # The last program zeroes the pads: tokens [num_tokens, T_pad), rows [R, R_pad).
        for off in range(num_tokens, num_tokens_padded, BLOCK):
            tok = off + tl.arange(0, BLOCK)
            mask = tok < num_tokens_padded
            tl.store(
                input_ids_ptr + tok, tl.zeros([BLOCK], input_ids_ptr.dtype.element_ty), mask=mask
            )
            tl.store(
                positions_ptr + tok, tl.zeros([BLOCK], positions_ptr.dtype.element_ty), mask=mask
            )
        for off in range(num_reqs, num_reqs_padded, BLOCK):
            row = off + tl.arange(0, BLOCK)
            zeros = tl.zeros([BLOCK], seq_lens_ptr.dtype.element_ty)
            tl.store(seq_lens_ptr + row, zeros, mask=row < num_reqs_padded)


def prepare_inputs_triton(
    idx_mapping: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    num_computed_tokens: torch.Tensor,  # [R] int32
    token_ids: torch.Tensor,  # [max_num_reqs, max_len] int32
    input_ids: torch.Tensor,  # [T_pad] int32 out
    positions: torch.Tensor,  # [T_pad] int64 out
    seq_lens: torch.Tensor,  # [R_pad] int32 out
    num_tokens: int,
) -> None:
    num_reqs = idx_mapping.numel()
    assert query_start_loc.numel() == num_reqs + 1, "query_start_loc is [R + 1]"
    assert num_computed_tokens.numel() == num_reqs, "one num_computed per row"
    assert all(_is_index(t) for t in (idx_mapping, query_start_loc, num_computed_tokens)), (
        "idx_mapping, query_start_loc and num_computed_tokens must be int32/int64"
    )
    assert token_ids.dim() == 2 and token_ids.stride(1) == 1, "token_ids is [slots, max_len]"
    assert _is_index(token_ids) and _is_index(input_ids), "token ids are int32/int64"
    assert positions.dtype == torch.int64, f"positions must be int64, got {positions.dtype}"
    assert _is_index(seq_lens), f"seq_lens must be int32/int64, got {seq_lens.dtype}"
    assert all(
        t.dim() == 1 and t.is_contiguous()
        for t in (idx_mapping, query_start_loc, num_computed_tokens, input_ids, positions, seq_lens)
    ), "index inputs and outputs must be contiguous 1-D tensors"
    assert input_ids.numel() == positions.numel() >= num_tokens, (
        f"input_ids/positions [T_pad] must hold num_tokens={num_tokens}"
    )
    assert seq_lens.numel() >= num_reqs, "seq_lens is [R_pad >= R]"
    # Programs 0..R-1 fill the rows, program R writes the pads.
    _prepare_inputs_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        token_ids,
        input_ids,
        positions,
        seq_lens,
        token_ids.stride(0),
        token_ids.shape[1],
        num_reqs,
        num_tokens,
        input_ids.numel(),
        seq_lens.numel(),
        BLOCK=_TOKEN_BLOCK,
    )


def prepare_inputs(
    idx_mapping,
    query_start_loc,
    num_computed_tokens,
    token_ids,
    input_ids,
    positions,
    seq_lens,
    num_tokens: int,
) -> None:
    assert query_start_loc.numel() == idx_mapping.numel() + 1, "query_start_loc is [R + 1]"
    assert num_computed_tokens.numel() == idx_mapping.numel(), "one num_computed per row"
    impl = prepare_inputs_triton if input_ids.is_cuda else prepare_inputs_ref
    impl(
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        token_ids,
        input_ids,
        positions,
        seq_lens,
        num_tokens,
    )


def post_update_ref(
    idx_mapping: torch.Tensor,  # [R] int32
    sampled: torch.Tensor,  # [R] int64: token sampled for each row
    seq_lens: torch.Tensor,  # [R] int32: tokens in context after this step
    sample_mask: torch.Tensor,  # [R] bool or int32 (nonzero): the row caught up, keep its sample
    token_ids: torch.Tensor,  # [max_num_reqs, max_len] int32, updated in place
    mail: MailOut | None = None,
) -> None:
    rows = sample_mask.nonzero().squeeze(1)
    token_ids[idx_mapping.long()[rows], seq_lens.long()[rows]] = sampled[rows].to(token_ids.dtype)
    if mail is not None:
        if mail.rows is not None:
            mail.rows[int(mail.slot[0]) % 2, : sampled.numel()] = sampled.to(mail.rows.device)
        mail.seq.add_(1)


class MailOut(NamedTuple):
    """A step-mailbox step's post-update extras (runner/mrv2/step_mailbox.py): every row's
    sample also goes to `rows[slot % 2]` (pinned host memory: no copy-engine operation
    after the graph), and the mailbox's sequence number moves on by one (the next step's
    prep reads the other slot)."""

    rows: torch.Tensor | None  # [2, >= R] int64 pinned, or None: the samples are copied
    slot: torch.Tensor  # [1] int32 (device): the slot this step's buffer named
    seq: torch.Tensor  # [1] int32 (device): the mailbox's sequence number, += 1


@triton.jit(
    do_not_specialize=["num_reqs"],
    do_not_specialize_on_alignment=[
        "idx_mapping_ptr",
        "sampled_ptr",
        "seq_lens_ptr",
        "sample_mask_ptr",
    ],
)
def _post_update_kernel(
    idx_mapping_ptr,
    sampled_ptr,
    seq_lens_ptr,
    sample_mask_ptr,
    token_ids_ptr,
    token_ids_row_stride,
    max_len,
    num_reqs,
    mail_rows_ptr,  # [2, mail_row_len] int64, pinned (MAIL_ROWS)
    mail_row_len,
    mail_slot_ptr,  # [1] int32 (MAIL_ROWS)
    mail_seq_ptr,  # [1] int32 (MAIL_SEQ)
    BLOCK: tl.constexpr,
    MAIL_ROWS: tl.constexpr,
    MAIL_SEQ: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = r < num_reqs
    keep = tl.load(sample_mask_ptr + r, mask=in_range, other=0) != 0
    slot = tl.load(idx_mapping_ptr + r, mask=in_range, other=0).to(tl.int64)
    pos = tl.load(seq_lens_ptr + r, mask=in_range, other=0).to(tl.int64)
    token = tl.load(sampled_ptr + r, mask=in_range, other=0)
    mask = in_range & keep & (pos >= 0) & (pos < max_len)
    dst = token_ids_ptr + slot * token_ids_row_stride + pos
    tl.store(dst, token.to(token_ids_ptr.dtype.element_ty), mask=mask)
    if MAIL_ROWS:  # posted writes across PCIe; the step's event makes them visible
        out = mail_rows_ptr + (tl.load(mail_slot_ptr) % 2).to(tl.int64) * mail_row_len
        tl.store(out + r, token.to(tl.int64), mask=in_range)
    if MAIL_SEQ:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if pid == 0:  # no program reads it: the next step's prep does
            tl.store(mail_seq_ptr, tl.load(mail_seq_ptr) + 1)


def post_update_triton(
    idx_mapping: torch.Tensor,  # [R] int32
    sampled: torch.Tensor,  # [R] int64
    seq_lens: torch.Tensor,  # [R] int32
    sample_mask: torch.Tensor,  # [R] bool or int32 (nonzero = keep)
    token_ids: torch.Tensor,  # [max_num_reqs, max_len] int32, updated in place
    mail: MailOut | None = None,
) -> None:
    num_reqs = idx_mapping.numel()
    assert sampled.numel() == num_reqs == sample_mask.numel(), "one value per row"
    assert seq_lens.numel() >= num_reqs, "seq_lens holds at least one value per row"
    assert sample_mask.dtype in (torch.bool, torch.int32), (
        f"sample_mask must be bool or int32, got {sample_mask.dtype}"
    )
    assert all(_is_index(t) for t in (idx_mapping, sampled, seq_lens, token_ids)), (
        "idx_mapping, sampled, seq_lens and token_ids must be int32/int64"
    )
    assert all(t.is_contiguous() for t in (idx_mapping, sampled, seq_lens, sample_mask)), (
        "per-row inputs must be contiguous"
    )
    assert token_ids.dim() == 2 and token_ids.stride(1) == 1, "token_ids is [slots, max_len]"
    rows = mail.rows if mail is not None else None
    if mail is not None:
        assert mail.slot.dtype == mail.seq.dtype == torch.int32, "int32 slot and sequence"
        assert rows is None or (
            rows.dim() == 2 and rows.shape[0] == 2 and rows.shape[1] >= num_reqs
            and rows.dtype == torch.int64 and rows.is_contiguous()
        ), f"mail rows are [2, >= {num_reqs}] int64"  # fmt: skip
    if num_reqs == 0 and mail is None:
        return
    block = 256
    _post_update_kernel[(max(1, triton.cdiv(num_reqs, block)),)](
        idx_mapping,
        sampled,
        seq_lens,
        # A bool mask as uint8 (same bytes): a plain integer load, no i1 pointers.
        sample_mask.view(torch.uint8) if sample_mask.dtype == torch.bool else sample_mask,
        token_ids,
        token_ids.stride(0),
        token_ids.shape[1],
        num_reqs,
        rows if rows is not None else sampled,
        rows.shape[1] if rows is not None else 0,
        mail.slot if mail is not None else sampled,
        mail.seq if mail is not None else sampled,
        BLOCK=block,
        MAIL_ROWS=rows is not None,
        MAIL_SEQ=mail is not None,
    )


def post_update(idx_mapping, sampled, seq_lens, sample_mask, token_ids, mail=None) -> None:
    assert sampled.numel() == idx_mapping.numel() == sample_mask.numel(), "one value per row"
    impl = post_update_triton if token_ids.is_cuda else post_update_ref
    impl(idx_mapping, sampled, seq_lens, sample_mask, token_ids, mail)
