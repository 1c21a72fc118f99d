"""Build a step's flat inputs on the device from per-slot state (DESIGN §3, InputBatch).

The CPU ships only `idx_mapping` (batch row -> slot), `query_start_loc` and each row's
`num_computed_tokens`; token ids come from the device-side token history, which the
post-update kernel has already extended with the last sampled token. So a token sampled
at step N reaches step N+1's `input_ids` without a round trip through the CPU.
Padding (CUDA graph sizes): input ids 0, positions 0, seq_lens 0.
"""

from __future__ import annotations

import torch


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
    prepare_inputs_ref(
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
    sample_mask: torch.Tensor,  # [R] bool: the row caught up, so its sample is kept
    token_ids: torch.Tensor,  # [max_num_reqs, max_len] int32, updated in place
) -> None:
    rows = sample_mask.nonzero().squeeze(1)
    token_ids[idx_mapping.long()[rows], seq_lens.long()[rows]] = sampled[rows].to(token_ids.dtype)


def post_update(idx_mapping, sampled, seq_lens, sample_mask, token_ids) -> None:
    assert sampled.numel() == idx_mapping.numel() == sample_mask.numel(), "one value per row"
    post_update_ref(idx_mapping, sampled, seq_lens, sample_mask, token_ids)
