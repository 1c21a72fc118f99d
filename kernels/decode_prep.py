"""A uniform-decode step's inputs in one kernel whose grid and arguments never change, so a
CUDA graph can hold it: the input prep a decode graph replays before its layers.

For a step where every row computes one token it does what `prepare_inputs`,
`gather_block_tables` and `compute_slot_mapping` do together (kernels/input_prep.py,
block_table.py), but the number of real rows is read from the device, from the last
entry of the packed step buffer the host copies each step, instead of being a launch
argument. So the launch is the same for every step of a graph size, and the host launches
nothing for it: the graph does.

Packed step buffer (int32, runner/mrv2/input_batch.py), n = the step's row capacity
(max_num_reqs, or max_num_reqs x (1 + k) with k-token speculative drafts, whose drafted
positions are rows of their own; the per-slot tables keep max_num_reqs rows):
idx_mapping [0, n) | query_start_loc [n, 2n + 1) | num_computed [2n + 1, 3n + 1) |
num_reqs [3n + 1] | sample_mask [3n + 2, 4n + 2) (post-update's; only copied here) |
append_col [4n + 2, 5n + 2) | append_block [5n + 2, 6n + 2) | mailbox slot [6n + 2].

From a mailbox (`mailbox`, `mail_seq` given; runner/mrv2/step_mailbox.py): the host wrote
the packed buffer into slot `mail_seq % 2` of a pinned [2, 6n + 3] buffer instead of
copying it to the device, and the kernel reads it there, across PCIe, and copies what the
rest of the graph reads (idx_mapping, query_start_loc, num_computed, num_reqs, the sample
mask and the slot) into `step_inputs`. A step whose graph runs this way has no copy-engine
operation between it and the previous step: on the H200 the copy and the two switches
between the copy engine and the graph cost ~20 us a step (benchmarks/step_gaps.py).

Block appends: a decode row whose token starts a new block has the block's id appended to
its slot's row of the block table (column append_col - 1; 0 = no append). The prep
writes it into the per-slot table for later steps and uses it for this step's gathered
row and slot, so such a step needs no staged-write launch and no copies of its own. A
decode row's one token sits at position num_computed: its input id is
the token history there, its seq_len num_computed + 1, its KV slot
`block_table[slot, pos // block_size] * block_size + pos % block_size`. Rows past num_reqs
are pads: input id 0, position 0, seq_len 0, a zero block-table row, slot -1.

Device path: one Triton program per row of the graph size; the torch reference below is
the spec and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def step_buffer_size(max_num_reqs: int) -> int:
    """int32 entries of the packed step buffer (module docstring)."""
    return 6 * max_num_reqs + 3


def step_buffer_rows(step_inputs: torch.Tensor) -> int:
    """The row capacity n of a packed step buffer [6n + 3]. With speculative drafts it
    exceeds the slot count: each drafted position is a row of its own."""
    n, rest = divmod(step_inputs.numel() - 3, 6)
    assert n >= 1 and rest == 0, (
        f"step_inputs holds {step_inputs.numel()} entries, not 6n + 3 for a row capacity n"
    )
    return n


def mailbox_slot_index(max_num_reqs: int) -> int:
    """Where the packed buffer names the mailbox slot it was written to."""
    return 6 * max_num_reqs + 2


def _from_mailbox(step_inputs, mailbox, mail_seq, n: int, size: int) -> torch.Tensor:
    """The spec of the mailbox read -> the slot's buffer (on the device); the entries the
    graph reads are copied into `step_inputs` (rows past `size` are left as they were)."""
    src = mailbox[int(mail_seq[0]) % 2].to(step_inputs.device)
    for start in (0, n + 1, 2 * n + 1, 3 * n + 2):  # idx, qsl[1:], computed, mask
        step_inputs[start : start + size] = src[start : start + size]
    for i in (n, 3 * n + 1, mailbox_slot_index(n)):  # qsl[0], num_reqs, slot
        step_inputs[i] = src[i]
    return src


def prepare_decode_ref(
    step_inputs: torch.Tensor,  # [6n + 3] int32 packed (module docstring)
    token_ids: torch.Tensor,  # [slots, max_len] int32: per-slot token history
    block_table: torch.Tensor,  # [slots, max_blocks] int32: per-slot table, appends written
    input_ids: torch.Tensor,  # [>= size] int32 out
    positions: torch.Tensor,  # [>= size] int64 out
    seq_lens: torch.Tensor,  # [>= size] int32 out
    block_tables: torch.Tensor,  # [>= size, max_blocks] int32 out
    slot_mapping: torch.Tensor,  # [>= size] int64 out
    size: int,  # rows written: the graph size
    block_size: int,
    mailbox: torch.Tensor | None = None,  # [2, 6n + 3] int32 (pinned): the step's source
    mail_seq: torch.Tensor | None = None,  # [1] int32: the slot is mail_seq % 2
) -> None:
    n = step_buffer_rows(step_inputs)
    if mailbox is not None:
        step_inputs = _from_mailbox(step_inputs, mailbox, mail_seq, n, size)
    r = min(int(step_inputs[3 * n + 1]), size)
    slots = step_inputs[:r].long()
    cols = step_inputs[4 * n + 2 : 4 * n + 2 + r].long() - 1
    appends = cols >= 0
    block_table[slots[appends], cols[appends]] = step_inputs[5 * n + 2 : 5 * n + 2 + r][appends]
    pos = step_inputs[2 * n + 1 : 2 * n + 1 + r].long()
    input_ids[:r] = token_ids[slots, pos.clamp(max=token_ids.shape[1] - 1)] * (
        pos < token_ids.shape[1]
    ).to(input_ids.dtype)
    positions[:r] = pos
    seq_lens[:r] = (pos + 1).to(seq_lens.dtype)
    block_tables[:r] = block_table[slots]
    block_idx = pos // block_size
    block = block_table[slots, block_idx.clamp(max=block_table.shape[1] - 1)].long()
    block = block * (block_idx < block_table.shape[1])
    slot_mapping[:r] = block * block_size + pos % block_size
    input_ids[r:size] = 0
    positions[r:size] = 0
    seq_lens[r:size] = 0
    block_tables[r:size] = 0
    slot_mapping[r:size] = -1


@triton.jit
def _prepare_decode_kernel(
    step_inputs_ptr,
    token_ids_ptr,
    block_table_ptr,
    input_ids_ptr,
    positions_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    slot_mapping_ptr,
    max_num_reqs,
    token_ids_row_stride,
    max_len,
    block_table_row_stride,
    block_tables_row_stride,
    max_blocks,
    block_size,
    mailbox_ptr,  # [2, 6n + 3] int32, pinned host memory (MAILBOX)
    mail_seq_ptr,  # [1] int32 (MAILBOX)
    BLOCK: tl.constexpr,
    MAILBOX: tl.constexpr,
):
    row = tl.program_id(0)
    n = max_num_reqs
    src = step_inputs_ptr
    if MAILBOX:
        src = mailbox_ptr + (tl.load(mail_seq_ptr) % 2).to(tl.int64) * (6 * n + 3)
    # The row's entries, loaded at once (from the mailbox: one PCIe round trip).
    num_reqs = tl.load(src + 3 * n + 1)
    idx = tl.load(src + row)
    qsl_next = tl.load(src + n + 1 + row)
    computed = tl.load(src + 2 * n + 1 + row)
    keep = tl.load(src + 3 * n + 2 + row)
    col = tl.load(src + 4 * n + 2 + row) - 1
    new_block = tl.load(src + 5 * n + 2 + row)
    if MAILBOX:  # what the rest of the graph reads from the device buffer
        tl.store(step_inputs_ptr + row, idx)
        tl.store(step_inputs_ptr + n + 1 + row, qsl_next)
        tl.store(step_inputs_ptr + 2 * n + 1 + row, computed)
        tl.store(step_inputs_ptr + 3 * n + 2 + row, keep)
        if row == 0:
            tl.store(step_inputs_ptr + n, tl.load(src + n))
            tl.store(step_inputs_ptr + 3 * n + 1, num_reqs)
            tl.store(step_inputs_ptr + 6 * n + 2, tl.load(src + 6 * n + 2))
    dst_ptr = block_tables_ptr + row.to(tl.int64) * block_tables_row_stride
    if row < num_reqs:
        slot = idx.to(tl.int64)
        pos = computed.to(tl.int64)
        # The appended block (col -1: none) goes to the per-slot table for later steps and
        # is used from registers below: the table's own loads may not see this store.
        src_ptr = block_table_ptr + slot * block_table_row_stride
        tl.store(src_ptr + col, new_block.to(block_table_ptr.dtype.element_ty), mask=col >= 0)
        # int64: slots * max_len can pass 2^31 (256 slots x 8M tokens).
        token = tl.load(token_ids_ptr + slot * token_ids_row_stride + pos, mask=pos < max_len)
        tl.store(input_ids_ptr + row, tl.where(pos < max_len, token, 0))
        tl.store(positions_ptr + row, pos)
        tl.store(seq_lens_ptr + row, (pos + 1).to(seq_lens_ptr.dtype.element_ty))
        for off in range(0, max_blocks, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < max_blocks
            blocks = tl.load(src_ptr + cols, mask=mask)
            blocks = tl.where(cols == col, new_block.to(blocks.dtype), blocks)
            tl.store(dst_ptr + cols, blocks, mask=mask)
        block_idx = pos // block_size
        block = tl.load(src_ptr + block_idx, mask=block_idx < max_blocks, other=0)
        block = tl.where(block_idx == col, new_block.to(block.dtype), block)
        # int64: num_blocks * block_size can pass 2^31 on a large cache.
        tl.store(slot_mapping_ptr + row, block.to(tl.int64) * block_size + pos % block_size)
    else:
        tl.store(input_ids_ptr + row, 0)
        tl.store(positions_ptr + row, 0)
        tl.store(seq_lens_ptr + row, 0)
        tl.store(slot_mapping_ptr + row, -1)  # the KV write skips it
        for off in range(0, max_blocks, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            zeros = tl.zeros([BLOCK], block_tables_ptr.dtype.element_ty)
            tl.store(dst_ptr + cols, zeros, mask=cols < max_blocks)


def prepare_decode_triton(
    step_inputs: torch.Tensor,
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    size: int,
    block_size: int,
    mailbox: torch.Tensor | None = None,
    mail_seq: torch.Tensor | None = None,
) -> None:
    assert step_inputs.dtype == torch.int32 and step_inputs.is_contiguous(), (
        "step_inputs is the packed int32 step buffer"
    )
    n = step_buffer_rows(step_inputs)
    assert (mailbox is None) == (mail_seq is None), "a mailbox comes with its sequence number"
    if mailbox is not None:
        assert mailbox.shape == (2, step_buffer_size(n)) and mailbox.dtype == torch.int32, (
            f"the mailbox is [2, {step_buffer_size(n)}] int32, got {tuple(mailbox.shape)} "
            f"{mailbox.dtype}"
        )
        assert mailbox.is_contiguous() and mail_seq.dtype == torch.int32, (
            "a contiguous mailbox and an int32 sequence number"
        )
    assert token_ids.dim() == 2 and token_ids.stride(1) == 1, "token_ids is [slots, max_len]"
    assert block_table.dim() == 2 and block_table.stride(1) == 1, "block_table is [slots, B]"
    assert block_table.shape[0] == token_ids.shape[0], "one block-table row per slot"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, "block_tables is [rows, B]"
    assert block_tables.shape[1] == block_table.shape[1], "block-table widths differ"
    assert block_tables.dtype == block_table.dtype, "block tables' dtypes differ"
    assert positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64, (
        "positions and slot_mapping are int64"
    )
    assert all(t.dtype in (torch.int32, torch.int64) for t in (token_ids, input_ids, seq_lens)), (
        "token ids and seq_lens are int32/int64"
    )
    assert all(
        t.dim() == 1 and t.is_contiguous() and t.numel() >= size
        for t in (input_ids, positions, seq_lens, slot_mapping)
    ), f"per-row outputs are contiguous 1-D tensors of >= {size} rows"
    assert 1 <= size <= n and block_tables.shape[0] >= size, f"size {size} must be in 1..{n}"
    assert block_size >= 1, f"block_size must be >= 1, got {block_size}"
    max_blocks = block_table.shape[1]
    _prepare_decode_kernel[(size,)](
        step_inputs,
        token_ids,
        block_table,
        input_ids,
        positions,
        seq_lens,
        block_tables,
        slot_mapping,
        n,
        token_ids.stride(0),
        token_ids.shape[1],
        block_table.stride(0),
        block_tables.stride(0),
        max_blocks,
        block_size,
        mailbox if mailbox is not None else step_inputs,
        mail_seq if mail_seq is not None else step_inputs,
        # <= 1024 int32 (4 KB) per iteration; 513 blocks (8k tokens / 16) take one.
        BLOCK=min(1024, triton.next_power_of_2(max(1, max_blocks))),
        MAILBOX=mailbox is not None,
    )


def prepare_decode(
    step_inputs,
    token_ids,
    block_table,
    input_ids,
    positions,
    seq_lens,
    block_tables,
    slot_mapping,
    size: int,
    block_size: int,
    mailbox: torch.Tensor | None = None,
    mail_seq: torch.Tensor | None = None,
) -> None:
    impl = prepare_decode_triton if input_ids.is_cuda else prepare_decode_ref
    impl(
        step_inputs,
        token_ids,
        block_table,
        input_ids,
        positions,
        seq_lens,
        block_tables,
        slot_mapping,
        size,
        block_size,
        mailbox,
        mail_seq,
    )
