"""Per-step block-table gather and slot mapping.

`gather_block_tables` copies the batch's rows out of the persistent per-slot table into
a fixed-address buffer (pad rows zeroed, so they point at the reserved null block 0);
`compute_slot_mapping` turns each token's position into its KV-cache slot
(`block * block_size + offset`), -1 for pad tokens so the KV write skips them.
"""

from __future__ import annotations

import torch


def gather_block_tables_ref(
    block_table: torch.Tensor,  # [max_num_reqs, max_blocks] int32: per-slot table
    idx_mapping: torch.Tensor,  # [R] int32
    out: torch.Tensor,  # [R_pad, max_blocks] int32 out
) -> None:
    num_reqs = idx_mapping.numel()
    out[:num_reqs] = block_table[idx_mapping.long()]
    out[num_reqs:] = 0


def gather_block_tables(block_table, idx_mapping, out) -> None:
    assert out.shape[0] >= idx_mapping.numel() and out.shape[1] == block_table.shape[1], (
        "out is [R_pad >= R, max_blocks]"
    )
    gather_block_tables_ref(block_table, idx_mapping, out)


def compute_slot_mapping_ref(
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32: this step's gathered rows
    query_start_loc: torch.Tensor,  # [R + 1] int32
    positions: torch.Tensor,  # [T_pad] int64
    block_size: int,
    out: torch.Tensor,  # [T_pad] int64 out: -1 for pad tokens
    num_tokens: int,  # query_start_loc[R], known on the host
) -> None:
    tok = torch.arange(num_tokens, device=positions.device)
    row = torch.searchsorted(query_start_loc[1:].long(), tok, right=True)
    pos = positions[:num_tokens]
    block = block_tables[row, pos // block_size].long()
    out[:num_tokens] = block * block_size + pos % block_size
    out[num_tokens:] = -1


def compute_slot_mapping(
    block_tables, query_start_loc, positions, block_size, out, num_tokens: int
) -> None:
    assert out.numel() == positions.numel(), "slot mapping is one slot per (padded) token"
    compute_slot_mapping_ref(block_tables, query_start_loc, positions, block_size, out, num_tokens)
