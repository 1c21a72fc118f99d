"""Per-step block-table gather and slot mapping.

`gather_block_tables` copies the batch's rows out of the persistent per-slot table into
a fixed-address buffer (pad rows zeroed, so they point at the reserved null block 0);
`compute_slot_mapping` turns each token's position into its KV-cache slot
(`block * block_size + offset`), -1 for pad tokens so the KV write skips them.

Device path: one Triton program per (padded) row for the gather; one program per batch
row plus one for the pads for the slot mapping. Grids come from shapes and the host-known
`num_tokens`, so nothing reads the device and both can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _is_index(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int32, torch.int64)


def gather_block_tables_ref(
    block_table: torch.Tensor,  # [max_num_reqs, max_blocks] int32: per-slot table
    idx_mapping: torch.Tensor,  # [R] int32
    out: torch.Tensor,  # [R_pad, max_blocks] int32 out
) -> None:
    num_reqs = idx_mapping.numel()
    out[:num_reqs] = block_table[idx_mapping.long()]
    out[num_reqs:] = 0


# Per-step sizes and slices of the packed step buffer: not specialised on (see input_prep).
@triton.jit(do_not_specialize=["num_reqs"], do_not_specialize_on_alignment=["idx_mapping_ptr"])
def _gather_block_tables_kernel(
    block_table_ptr,
    idx_mapping_ptr,
    out_ptr,
    block_table_row_stride,
    out_row_stride,
    num_reqs,
    max_blocks,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    dst_ptr = out_ptr + r.to(tl.int64) * out_row_stride
    if r < num_reqs:
        slot = tl.load(idx_mapping_ptr + r).to(tl.int64)
        src_ptr = block_table_ptr + slot * block_table_row_stride
        for off in range(0, max_blocks, BLOCK):
            col = off + tl.arange(0, BLOCK)
            mask = col < max_blocks
            tl.store(dst_ptr + col, tl.load(src_ptr + col, mask=mask), mask=mask)
    else:
        # Pad rows point at the reserved null block 0.
        for off in range(0, max_blocks, BLOCK):
            col = off + tl.arange(0, BLOCK)
            zeros = tl.zeros([BLOCK], out_ptr.dtype.element_ty)
            tl.store(dst_ptr + col, zeros, mask=col < max_blocks)


def gather_block_tables_triton(
    block_table: torch.Tensor,  # [max_num_reqs, max_blocks] int32
    idx_mapping: torch.Tensor,  # [R] int32
    out: torch.Tensor,  # [R_pad, max_blocks] int32 out
) -> None:
    assert block_table.dim() == 2 and out.dim() == 2, "block tables are 2-D [rows, max_blocks]"
    assert out.shape[0] >= idx_mapping.numel() and out.shape[1] == block_table.shape[1], (
        "out is [R_pad >= R, max_blocks]"
    )
    assert out.dtype == block_table.dtype, f"out {out.dtype} must match {block_table.dtype}"
    assert block_table.stride(1) == 1 and out.stride(1) == 1, "block-table rows are contiguous"
    assert _is_index(idx_mapping) and idx_mapping.is_contiguous(), "idx_mapping: int32/64, 1-D"
    if out.shape[0] == 0:
        return
    max_blocks = block_table.shape[1]
    # <= 1024 int32 (4 KB) per iteration; 513 blocks (8k tokens / 16) take one.
    block = min(1024, triton.next_power_of_2(max(1, max_blocks)))
    _gather_block_tables_kernel[(out.shape[0],)](
        block_table,
        idx_mapping,
        out,
        block_table.stride(0),
        out.stride(0),
        idx_mapping.numel(),
        max_blocks,
        BLOCK=block,
    )


def gather_block_tables(block_table, idx_mapping, out) -> None:
    assert out.shape[0] >= idx_mapping.numel() and out.shape[1] == block_table.shape[1], (
        "out is [R_pad >= R, max_blocks]"
    )
    if out.is_cuda:
        gather_block_tables_triton(block_table, idx_mapping, out)
    else:
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


@triton.jit(
    do_not_specialize=["num_reqs", "num_tokens", "num_tokens_padded"],
    do_not_specialize_on_alignment=["query_start_loc_ptr"],
)
def _compute_slot_mapping_kernel(
    block_tables_ptr,
    query_start_loc_ptr,
    positions_ptr,
    out_ptr,
    block_tables_row_stride,
    max_blocks,
    block_size,
    num_reqs,
    num_tokens,
    num_tokens_padded,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if r < num_reqs:
        q_start = tl.load(query_start_loc_ptr + r)
        q_end = tl.load(query_start_loc_ptr + r + 1)
        row_ptr = block_tables_ptr + r.to(tl.int64) * block_tables_row_stride
        for off in range(0, q_end - q_start, BLOCK):
            tok = q_start + off + tl.arange(0, BLOCK)
            mask = (tok < q_end) & (tok < num_tokens)
            pos = tl.load(positions_ptr + tok, mask=mask, other=0).to(tl.int64)
            block_idx = pos // block_size
            block = tl.load(row_ptr + block_idx, mask=mask & (block_idx < max_blocks), other=0)
            # int64: num_blocks * block_size can pass 2^31 on a large cache.
            slot = block.to(tl.int64) * block_size + pos % block_size
            tl.store(out_ptr + tok, slot, mask=mask)
    else:
        # The last program marks pad tokens [num_tokens, T_pad) with -1: the KV write skips them.
        for off in range(num_tokens, num_tokens_padded, BLOCK):
            tok = off + tl.arange(0, BLOCK)
            pad = tl.full([BLOCK], -1, out_ptr.dtype.element_ty)
            tl.store(out_ptr + tok, pad, mask=tok < num_tokens_padded)


def compute_slot_mapping_triton(
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    positions: torch.Tensor,  # [T_pad] int64
    block_size: int,
    out: torch.Tensor,  # [T_pad] int64 out: -1 for pad tokens
    num_tokens: int,
) -> None:
    num_reqs = query_start_loc.numel() - 1
    assert num_reqs >= 0, "query_start_loc is [R + 1]"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, (
        "block_tables is [R_pad, max_blocks] with contiguous rows"
    )
    assert block_tables.shape[0] >= num_reqs, "block_tables holds a row per batch row"
    assert out.numel() == positions.numel() >= num_tokens, (
        f"slot mapping is one slot per (padded) token and holds num_tokens={num_tokens}"
    )
    assert out.dtype == torch.int64, f"slot mapping must be int64, got {out.dtype}"
    assert _is_index(block_tables) and _is_index(query_start_loc) and _is_index(positions), (
        "block_tables, query_start_loc and positions must be int32/int64"
    )
    assert all(t.dim() == 1 and t.is_contiguous() for t in (query_start_loc, positions, out)), (
        "query_start_loc, positions and out must be contiguous 1-D tensors"
    )
    assert block_size >= 1, f"block_size must be >= 1, got {block_size}"
    # Programs 0..R-1 fill the rows, program R writes the pads.
    _compute_slot_mapping_kernel[(num_reqs + 1,)](
        block_tables,
        query_start_loc,
        positions,
        out,
        block_tables.stride(0),
        block_tables.shape[1],
        block_size,
        num_reqs,
        num_tokens,
        out.numel(),
        BLOCK=256,
    )


def compute_slot_mapping(
    block_tables, query_start_loc, positions, block_size, out, num_tokens: int
) -> None:
    assert out.numel() == positions.numel(), "slot mapping is one slot per (padded) token"
    impl = compute_slot_mapping_triton if out.is_cuda else compute_slot_mapping_ref
    impl(block_tables, query_start_loc, positions, block_size, out, num_tokens)
