"""The fused uniform-decode input prep (kernels/decode_prep.py) a graph replays before its
layers: its torch spec equals the three per-step kernels' specs it replaces
(prepare_inputs, gather_block_tables, compute_slot_mapping) at one token a row, and the
Triton kernel equals the spec bit for bit. Outputs start as garbage, so a pad or a row
the kernel forgets shows up.

Without CUDA the kernel runs in Triton's interpreter at small sizes; with CUDA at the
runner's (512 slots, 257-entry block tables, 4,097-token histories)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import block_table, decode_prep, input_prep

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# (slots, max_len, max_blocks): the interpreter gets small ones, and one table wider than
# the gather's 1,024-entry loop block; the GPU the runner's.
SHAPES = [(8, 40, 5), (6, 70, 1100)] + ([(512, 4097, 257)] if ON_CUDA else [])


def _case(n: int, max_len: int, max_blocks: int, r: int, size: int, block_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 150_000, (n, max_len), generator=g, dtype=torch.int32)
    table = torch.randint(1, 10_000, (n, max_blocks), generator=g, dtype=torch.int32)
    slots = torch.randperm(n, generator=g)[:r].to(torch.int32)
    # Positions at block edges and at the table's last usable block, as well as random.
    top = min(max_len - 1, max_blocks * block_size - 1)
    edges = torch.tensor([0, block_size - 1, block_size, top], dtype=torch.int32)
    pos = torch.randint(0, top + 1, (r,), generator=g, dtype=torch.int32)
    pos[: min(r, 4)] = edges[: min(r, 4)]
    step = torch.zeros(decode_prep.step_buffer_size(n), dtype=torch.int32)
    step[:r] = slots
    step[n : n + size + 1] = torch.arange(size + 1, dtype=torch.int32)  # one token a row
    step[2 * n + 1 : 2 * n + 1 + r] = pos
    step[3 * n + 1] = r
    # Block appends on every other row: at the token's own block (the real case, which its
    # slot must then use) or, every fourth row, at some other column.
    for row in range(0, r, 2):
        col = int(pos[row]) // block_size if row % 4 == 0 else (row * 7) % max_blocks
        step[4 * n + 2 + row] = min(col, max_blocks - 1) + 1
        step[5 * n + 2 + row] = 20_000 + row
    return [t.to(DEVICE) for t in (step, token_ids, table)]


def _appended(step: torch.Tensor, table: torch.Tensor, r: int) -> torch.Tensor:
    """The per-slot table after the step's block appends: what the eager path's staged
    writes would have made it."""
    n = table.shape[0]
    out = table.clone()
    for row in range(r):
        col = int(step[4 * n + 2 + row]) - 1
        if col >= 0:
            out[int(step[row]), col] = step[5 * n + 2 + row]
    return out


def _outputs(n: int, max_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def garbage(shape, dtype):
        return torch.randint(1000, 9000, shape, generator=g, dtype=dtype).to(DEVICE)

    return [
        garbage((n,), torch.int32),  # input_ids
        garbage((n,), torch.int64),  # positions
        garbage((n,), torch.int32),  # seq_lens
        garbage((n, max_blocks), torch.int32),  # block_tables
        garbage((n,), torch.int64),  # slot_mapping
    ]


def _three_kernels(step, n, r, size, token_ids, table, max_blocks, block_size):
    """What the eager path's three prep kernels' specs make of the step buffer's first r
    rows, on garbage outputs -> input_ids, positions, seq_lens, block_tables, slot_mapping."""
    ids, positions, seq_lens, tables, slot_mapping = _outputs(n, max_blocks, 1)
    idx, qsl, computed = step[:r], step[n : n + r + 1], step[2 * n + 1 : 2 * n + 1 + r]
    input_prep.prepare_inputs_ref(
        idx, qsl, computed, token_ids, ids[:size], positions[:size], seq_lens[:size], r
    )
    block_table.gather_block_tables_ref(table, idx, tables[:size])
    block_table.compute_slot_mapping_ref(
        tables[:size], qsl, positions[:size], block_size, slot_mapping[:size], r
    )
    return ids, positions, seq_lens, tables, slot_mapping


def _rows(n: int) -> list[tuple[int, int]]:
    """(real rows, graph size) pairs: none real, one, some padded, all real."""
    return sorted({(0, 1), (1, 1), (1, min(4, n)), (3, min(5, n)), (n, n), (n - 2, n)})


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prepare_decode_spec_is_the_three_prep_kernels_at_one_token_a_row(shape, block_size):
    """Guards the fused spec drifting from what the eager path computes for a decode step:
    the same input ids, positions, seq_lens, block tables and slots, pads included."""
    n, max_len, max_blocks = shape
    for r, size in _rows(n):
        step, token_ids, table = _case(n, max_len, max_blocks, r, size, block_size, r + size)
        eager_table = _appended(step, table, r)  # staged writes, then the three kernels
        fused = _outputs(n, max_blocks, 1)
        decode_prep.prepare_decode_ref(step, token_ids, table, *fused, size, block_size)
        assert torch.equal(table, eager_table), f"block appends differ at r={r}"
        ids, positions, seq_lens, tables, slot_mapping = _three_kernels(
            step, n, r, size, token_ids, eager_table, max_blocks, block_size
        )
        for name, a, b in zip(
            ("input_ids", "positions", "seq_lens", "block_tables", "slot_mapping"),
            fused,
            (ids, positions, seq_lens, tables, slot_mapping),
        ):
            assert torch.equal(a[:size], b[:size]), f"{name} differs at r={r}, size={size}"
            assert torch.equal(a[size:], b[size:]), f"{name} written past size={size}"


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prepare_decode_kernel_matches_its_spec(shape, block_size):
    """Guards the kernel reading num_reqs from the wrong entry, a pad row left unwritten, a
    block-table row cut at the loop block, a slot from the wrong block, a block append
    lost (from the per-slot table, the gathered row or the slot) and writes past the
    graph size."""
    n, max_len, max_blocks = shape
    for r, size in _rows(n):
        step, token_ids, table = _case(n, max_len, max_blocks, r, size, block_size, 7 * r + size)
        expected = _outputs(n, max_blocks, 2)
        got = [t.clone() for t in expected]
        expected_table = table.clone()
        decode_prep.prepare_decode_ref(step, token_ids, expected_table, *expected, size, block_size)
        decode_prep.prepare_decode_triton(step, token_ids, table, *got, size, block_size)
        assert torch.equal(table, expected_table), f"r={r}, size={size}: per-slot table"
        for a, b in zip(got, expected):
            assert torch.equal(a, b), f"r={r}, size={size}"


def _mailbox(step: torch.Tensor, seq: int, seed: int) -> torch.Tensor:
    """A [2, L] mailbox (pinned on CUDA) holding `step` in slot seq % 2, garbage in the
    other, so a read of the wrong slot shows up."""
    g = torch.Generator().manual_seed(seed)
    box = torch.randint(1000, 9000, (2, step.numel()), generator=g, dtype=torch.int32)
    box[seq % 2] = step.cpu()
    box[seq % 2, -1] = seq % 2
    return box.pin_memory() if ON_CUDA else box


@pytest.mark.parametrize("seq", [0, 1, 6])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prepare_decode_from_a_mailbox_is_the_device_buffer_step(shape, seq):
    """Guards the mailbox read (runner/mrv2/step_mailbox.py): the slot is `seq % 2`, the
    outputs and block appends are those of the same buffer on the device, and exactly the
    entries the rest of the graph reads (row ids, query_start_loc, num_computed, the
    sample mask, num_reqs, the slot) are copied to the device buffer, for the graph's
    rows only; the kernel and its spec agree."""
    n, max_len, max_blocks = shape
    block_size = 16
    for r, size in _rows(n):
        step, token_ids, table = _case(n, max_len, max_blocks, r, size, block_size, 3 * r + size)
        step[3 * n + 2 : 3 * n + 2 + r] = 1  # the sample mask, copied for post-update
        expected = _outputs(n, max_blocks, 4)
        expected_table = table.clone()
        decode_prep.prepare_decode_ref(step, token_ids, expected_table, *expected, size, block_size)
        box = _mailbox(step, seq, seed=r + size)
        seq_t = torch.tensor([seq], dtype=torch.int32, device=DEVICE)
        garbage = _outputs(n, max_blocks, 5)[0].repeat(7)[: step.numel()].to(torch.int32)
        for impl in (decode_prep.prepare_decode_ref, decode_prep.prepare_decode_triton):
            got, got_table, dev = [t.clone() for t in expected], table.clone(), garbage.clone()
            for t in got:
                t.fill_(-5)
            impl(dev, token_ids, got_table, *got, size, block_size, box, seq_t)
            assert torch.equal(got_table, expected_table), f"{impl.__name__} r={r} size={size}"
            for a, b in zip(got, expected):
                assert torch.equal(a[:size], b[:size]), f"{impl.__name__} r={r} size={size}"
            copied = torch.zeros(step.numel(), dtype=torch.bool)
            for start in (0, n + 1, 2 * n + 1, 3 * n + 2):
                copied[start : start + size] = True
            copied[[n, 3 * n + 1, step.numel() - 1]] = True
            want = torch.where(copied, box[seq % 2], garbage.cpu())
            assert torch.equal(dev.cpu(), want), f"{impl.__name__}: the copied entries"


def test_prepare_decode_refuses_a_step_buffer_without_the_count():
    """A buffer of another layout would put the count somewhere else: refused."""
    n = 4
    step, token_ids, table = _case(n, 40, 5, 2, 4, 16, 0)
    with pytest.raises(AssertionError, match="entries"):
        decode_prep.prepare_decode_triton(step[:-1], token_ids, table, *_outputs(n, 5, 3), 4, 16)


@pytest.mark.parametrize("mailbox", [False, True])
def test_a_step_buffer_of_more_rows_than_slots(mailbox):
    """With k-token drafts each drafted position is a decode row of its own, so the packed
    buffer holds max_num_seqs x (1 + k) rows over max_num_seqs slots (runner/mrv2/
    model_runner.py). Guards the kernel and its spec reading the buffer's offsets from the
    slot count (they broke on the H100 at 32 slots and 96 rows): both equal the three
    per-step prep kernels on rows that repeat a slot at consecutive positions."""
    slots, k, max_len, max_blocks, block_size = 5, 2, 70, 5, 16
    n = slots * (1 + k)
    g = torch.Generator().manual_seed(11)
    token_ids = torch.randint(0, 150_000, (slots, max_len), generator=g, dtype=torch.int32)
    table = torch.randint(1, 10_000, (slots, max_blocks), generator=g, dtype=torch.int32)
    # Rows: slots 3, 0, 4 with 3 / 2 / 3 drafted positions, one crossing a block edge.
    row_slots = torch.tensor([3, 3, 3, 0, 0, 4, 4, 4], dtype=torch.int32)
    pos = torch.tensor([14, 15, 16, 40, 41, 60, 61, 62], dtype=torch.int32)
    r, size = len(row_slots), n - 2
    step = torch.zeros(decode_prep.step_buffer_size(n), dtype=torch.int32)
    step[:r] = row_slots
    step[n : n + size + 1] = torch.arange(size + 1, dtype=torch.int32)
    step[2 * n + 1 : 2 * n + 1 + r] = pos
    step[3 * n + 1] = r
    step, token_ids, table = (t.to(DEVICE) for t in (step, token_ids, table))
    ids, positions, seq_lens, tables, slot_mapping = _three_kernels(
        step, n, r, size, token_ids, table, max_blocks, block_size
    )
    box = _mailbox(step, 1, seed=3) if mailbox else None
    seq = torch.tensor([1], dtype=torch.int32, device=DEVICE) if mailbox else None
    for impl in (decode_prep.prepare_decode_ref, decode_prep.prepare_decode_triton):
        got = _outputs(n, max_blocks, 2)
        impl(step.clone(), token_ids, table.clone(), *got, size, block_size, box, seq)
        for name, a, b in zip(
            ("input_ids", "positions", "seq_lens", "block_tables", "slot_mapping"),
            got,
            (ids, positions, seq_lens, tables, slot_mapping),
        ):
            assert torch.equal(a[:size], b[:size]), f"{impl.__name__}: {name}"
