"""Parity of the index and copy Triton kernels (`name_triton`) with their torch references
(`name_ref`): staged writes, input prep (prepare_inputs, post_update), block-table gather,
slot mapping and the KV write.

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernels run through Triton's
interpreter on CPU tensors at small sizes (the interpreter is NumPy, ~1 ms per program);
with CUDA they run compiled at the sizes the runner sees (4096 tokens, head_dim 128, 8 kv
heads, bf16). The CUDA-only checks (graph capture, no host syncs, offsets past int32) are
in `test_gpu_kernels.py`; the arithmetic kernels in `test_triton_layer_kernels.py`.

Copies, gathers and index math must be bit-exact (`torch.equal`). Every output buffer
starts filled with garbage, so a pad the kernel forgets to write shows up.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import attention, block_table, input_prep, kv_write, staged_write

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

# Shapes: the interpreter gets small awkward ones; the GPU adds the real ones.
SMALL = {
    "kv": [(1, 1, 24, 1), (7, 3, 80, 16), (33, 8, 128, 16)],  # (T, Hkv, D, block_size)
    "long_prefill": 300,  # > the 256-token loop block of the index kernels
}
REAL = {
    "kv": [(1, 1, 24, 1), (33, 3, 80, 16), (4096, 8, 128, 16), (16384, 8, 128, 16)],
    "long_prefill": 3000,
}
SIZES = REAL if ON_CUDA else SMALL


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _garbage(shape, dtype, seed: int) -> torch.Tensor:
    """An output buffer full of values no kernel would write (pads must be overwritten)."""
    return torch.randint(1000, 9000, shape, generator=_gen(seed), dtype=dtype).to(DEVICE)


# ---------------------------------------------------------------------- staged writes


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lens", [[1], [3, 0, 1, 5], [SIZES["long_prefill"], 2, 700]])
def test_apply_staged_writes_matches_ref(dtype, lens):
    """Guards a write landing in the wrong row/column, a write longer than the kernel's
    512-value block being cut short, and a zero-length write clobbering its neighbour."""
    g = _gen(0)
    num_rows, width = 9, max(lens) + 50
    # Writes go to distinct rows in shuffled order (rows must be read, not assumed).
    rows = torch.randperm(num_rows, generator=g)[: len(lens)]
    starts = torch.tensor([int(torch.randint(0, width - n + 1, (1,), generator=g)) for n in lens])
    cu_lens = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu_lens[1:] = torch.tensor(lens).cumsum(0)
    values = torch.randint(-(2**30), 2**30, (int(cu_lens[-1]),), generator=g, dtype=dtype)
    table = _garbage((num_rows, width), dtype, 1)
    args = [t.to(DEVICE) for t in (rows, starts, cu_lens, values)]
    expected = table.clone()
    staged_write.apply_staged_writes_ref(expected, *args)
    staged_write.apply_staged_writes_triton(table, *args)
    assert torch.equal(table, expected)


def test_apply_staged_writes_without_values_is_a_noop():
    """Guards a launch with an empty values buffer writing stale memory into the table."""
    table = _garbage((4, 8), torch.int32, 2)
    before = table.clone()
    rows = torch.tensor([1, 2], device=DEVICE)
    cu_lens = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int32, device=DEVICE)
    staged_write.apply_staged_writes_triton(table, rows, rows.clone(), cu_lens, empty)
    assert torch.equal(table, before)


# ------------------------------------------------------------------------ input prep


def _batch(num_scheduled, num_computed, num_slots=12, max_len=4000, seed=0):
    """idx_mapping (distinct, unsorted slots), query_start_loc, num_computed, token_ids."""
    g = _gen(seed)
    r = len(num_scheduled)
    idx = torch.randperm(num_slots, generator=g)[:r].to(torch.int32)
    qsl = torch.zeros(r + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(num_scheduled).cumsum(0)
    computed = torch.tensor(num_computed, dtype=torch.int32)
    token_ids = torch.randint(0, 150000, (num_slots, max_len), generator=g, dtype=torch.int32)
    return [t.to(DEVICE) for t in (idx, qsl, computed, token_ids)]


_BATCHES = {
    "one_decode": ([1], [5], 0, 0),
    "mixed_padded": ([1, 4, 1, 7, 2], [9, 0, 130, 17, 1], 5, 3),
    "long_prefill_padded": ([SIZES["long_prefill"], 1, 33], [40, 2, 0], 11, 1),
    "many_decodes": ([1] * 40, list(range(100, 140)), 24, 8),
}


@pytest.mark.parametrize("name", list(_BATCHES))
def test_prepare_inputs_matches_ref(name):
    """Guards tokens taken from the wrong slot or position (idx_mapping is unsorted), a row
    longer than the 256-token loop block being cut short, and pads left unwritten: input
    ids and positions past num_tokens and seq_lens past R must be zero."""
    num_scheduled, num_computed, pad_tokens, pad_rows = _BATCHES[name]
    idx, qsl, computed, token_ids = _batch(num_scheduled, num_computed, num_slots=48)
    t = sum(num_scheduled)
    outs = [
        _garbage((t + pad_tokens,), torch.int32, 3),
        _garbage((t + pad_tokens,), torch.int64, 4),
        _garbage((len(num_scheduled) + pad_rows,), torch.int32, 5),
    ]
    expected = [o.clone() for o in outs]
    input_prep.prepare_inputs_ref(idx, qsl, computed, token_ids, *expected, t)
    input_prep.prepare_inputs_triton(idx, qsl, computed, token_ids, *outs, t)
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)
    assert not outs[0][t:].any() and not outs[1][t:].any()
    assert not outs[2][len(num_scheduled) :].any()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32])
@pytest.mark.parametrize("num_reqs", [1, 7, 300])
def test_post_update_matches_ref(num_reqs, mask_dtype):
    """Guards a masked-out row (a partial prefill chunk) writing its sample into the token
    history, a sample landing at the wrong slot/position, and rows past the 256-row
    block being skipped."""
    g = _gen(num_reqs)
    num_slots, max_len = 320, 64
    idx = torch.randperm(num_slots, generator=g)[:num_reqs].to(torch.int32)
    sampled = torch.randint(0, 150000, (num_reqs,), generator=g)
    seq_lens = torch.randint(1, max_len, (num_reqs,), generator=g, dtype=torch.int32)
    mask = torch.rand(num_reqs, generator=g) < 0.6
    mask[0] = True
    if mask_dtype == torch.int32:  # the packed step buffer's mask: any nonzero keeps
        mask = mask.to(torch.int32) * torch.randint(1, 9, (num_reqs,), generator=g).int()
    args = [t.to(DEVICE) for t in (idx, sampled, seq_lens, mask)]
    token_ids = _garbage((num_slots, max_len), torch.int32, 6)
    expected = token_ids.clone()
    input_prep.post_update_ref(*args, expected)
    input_prep.post_update_triton(*args, token_ids)
    assert torch.equal(token_ids, expected)


@pytest.mark.parametrize("slot", [0, 1, 3])
@pytest.mark.parametrize("num_reqs", [1, 7, 300])
def test_post_update_mailbox_rows_and_count_match_ref(num_reqs, slot):
    """Guards a mailbox step's extras (runner/mrv2/step_mailbox.py): every row's sample
    (kept or not: the host's mask decides) lands in row `slot % 2` of the pinned buffer
    and nowhere else, the sequence number moves on by exactly one (not once per program:
    300 rows take two), and a post-update without rows only moves the count."""
    g = _gen(100 + num_reqs)
    num_slots, max_len = 320, 64
    idx = torch.randperm(num_slots, generator=g)[:num_reqs].to(torch.int32)
    sampled = torch.randint(0, 150000, (num_reqs,), generator=g)
    seq_lens = torch.randint(1, max_len, (num_reqs,), generator=g, dtype=torch.int32)
    mask = (torch.rand(num_reqs, generator=g) < 0.6).to(torch.int32)
    args = [t.to(DEVICE) for t in (idx, sampled, seq_lens, mask)]
    token_ids = _garbage((num_slots, max_len), torch.int32, 6)
    expected = token_ids.clone()
    rows = torch.randint(-9, -1, (2, num_reqs + 5), generator=g).pin_memory() if ON_CUDA else (
        torch.randint(-9, -1, (2, num_reqs + 5), generator=g)
    )  # fmt: skip
    want_rows = rows.clone()
    slot_t = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
    seq, want_seq = (torch.tensor([41], dtype=torch.int32, device=DEVICE) for _ in range(2))
    input_prep.post_update_ref(*args, expected, input_prep.MailOut(want_rows, slot_t, want_seq))
    input_prep.post_update_triton(*args, token_ids, input_prep.MailOut(rows, slot_t, seq))
    if ON_CUDA:
        torch.cuda.synchronize()
    assert torch.equal(token_ids, expected)
    assert torch.equal(rows, want_rows) and int(seq) == int(want_seq) == 42
    assert torch.equal(rows[slot % 2, :num_reqs], sampled)
    assert (rows[1 - slot % 2] < 0).all() and (rows[slot % 2, num_reqs:] < 0).all()
    input_prep.post_update_triton(*args, token_ids, input_prep.MailOut(None, slot_t, seq))
    assert int(seq) == 43 and torch.equal(token_ids, expected)


# ----------------------------------------------------------------------- block table


@pytest.mark.parametrize("max_blocks", [1, 7, 1100])
@pytest.mark.parametrize("pad_rows", [0, 3])
def test_gather_block_tables_matches_ref(max_blocks, pad_rows):
    """Guards rows copied from the wrong slot, tables wider than the kernel's 1024-column
    block being cut short, and pad rows left with stale block ids (they must be 0, the
    null block, or a padded decode would read another request's KV)."""
    g = _gen(max_blocks)
    num_slots, num_reqs = 10, 6
    table = torch.randint(0, 5000, (num_slots, max_blocks), generator=g, dtype=torch.int32)
    idx = torch.randperm(num_slots, generator=g)[:num_reqs].to(torch.int32)
    table, idx = table.to(DEVICE), idx.to(DEVICE)
    out = _garbage((num_reqs + pad_rows, max_blocks), torch.int32, 7)
    expected = out.clone()
    block_table.gather_block_tables_ref(table, idx, expected)
    block_table.gather_block_tables_triton(table, idx, out)
    assert torch.equal(out, expected)
    assert not out[num_reqs:].any()


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", list(_BATCHES))
def test_compute_slot_mapping_matches_ref(block_size, name):
    """Guards a token mapped through another row's block table, the offset within the
    block computed wrongly, and pad tokens left unmarked: they must be -1 so write_kv
    skips them instead of overwriting a real slot."""
    num_scheduled, num_computed, pad_tokens, _ = _BATCHES[name]
    g = _gen(block_size)
    idx, qsl, computed, token_ids = _batch(num_scheduled, num_computed, num_slots=48)
    t = sum(num_scheduled)
    positions = torch.zeros(t + pad_tokens, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.zeros(len(num_scheduled), dtype=torch.int32, device=DEVICE)
    input_ids = torch.zeros(t + pad_tokens, dtype=torch.int32, device=DEVICE)
    input_prep.prepare_inputs_ref(idx, qsl, computed, token_ids, input_ids, positions, seq_lens, t)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = torch.randint(1, 100000, (len(num_scheduled) + 2, max_blocks), generator=g)
    tables = tables.to(torch.int32).to(DEVICE)
    out = _garbage((t + pad_tokens,), torch.int64, 8)
    expected = out.clone()
    block_table.compute_slot_mapping_ref(tables, qsl, positions, block_size, expected, t)
    block_table.compute_slot_mapping_triton(tables, qsl, positions, block_size, out, t)
    assert torch.equal(out, expected)
    assert (out[t:] == -1).all()


# -------------------------------------------------------------------------- KV write


def _qkv_views(t, hq, hk, d, dtype, seed):
    """q, k, v as the model makes them: strided views of one fused projection output."""
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=_gen(seed)).to(dtype).to(DEVICE)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.reshape(t, hq, d), k.reshape(t, hk, d), v.reshape(t, hk, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SIZES["kv"])
def test_write_kv_matches_ref(case, dtype):
    """Guards K and V swapped or written to the wrong block/offset/head, a strided K view
    read as if contiguous or with V's strides, head dims that are not a power of two (24, 80) spilling into
    the next head, and pad tokens (slot -1, here interleaved and trailing) being written."""
    t, heads, d, block_size = case
    g = _gen(t)
    # K a strided view of the fused projection, V contiguous: the two strides differ.
    _, key, _ = _qkv_views(t, 2, heads, d, dtype, seed=t)
    value = torch.randn(t, heads, d, generator=g).to(dtype).to(DEVICE)
    num_blocks = -(-2 * t // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1
    slots[-1] = -1
    slot_mapping = slots.to(DEVICE)
    cache = torch.randn(num_blocks, 2, block_size, heads, d, generator=g).to(dtype).to(DEVICE)
    expected = cache.clone()
    attention.write_kv_ref(key, value, expected, slot_mapping)
    kv_write.write_kv_triton(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)
