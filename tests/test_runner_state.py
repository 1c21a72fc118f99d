"""MRV2 runner state: staged writes, slot reuse, fixed-address input buffers."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.runner.mrv2.input_batch import InputBuffers
from pdserve.runner.mrv2.request_state import RequestState
from pdserve.runner.mrv2.staged_writes import StagedWrites
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.scheduler_output import NewRequestData

ROWS, WIDTH = 5, 24

write = st.integers(0, ROWS - 1).flatmap(
    lambda row: st.integers(0, WIDTH - 1).flatmap(
        lambda start: st.tuples(
            st.just(row),
            st.just(start),
            st.lists(st.integers(-1000, 1000), min_size=0, max_size=WIDTH - start),
        )
    )
)


@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.lists(write, max_size=12), min_size=1, max_size=4))
def test_staged_writes_then_apply_equals_direct_writes(batches):
    """Guards merge of overlapping writes (later values win) and the packed apply kernel."""
    staged = torch.zeros(ROWS, WIDTH, dtype=torch.int32)
    direct = torch.zeros(ROWS, WIDTH, dtype=torch.int32)
    sw = StagedWrites(staged)
    for batch in batches:
        for row, start, values in batch:
            sw.stage(row, start, values)
            direct[row, start : start + len(values)] = torch.tensor(values, dtype=torch.int32)
        sw.apply()
        assert sw.num_pending == 0, "apply clears the staged writes"
        assert torch.equal(staged, direct)


def _new(req_id: str, n: int, params: SamplingParams, seed: int, blocks: list[int]):
    return NewRequestData(
        req_id, list(range(100, 100 + n)), n, blocks, 0, params, seed, stop_ids=(2, 9)
    )


def test_reused_slot_has_every_field_overwritten():
    """Guards state leaking from a finished request into the next one that takes its slot:
    after A leaves and B reuses the slot, the slot equals a fresh state holding only B."""
    odd = SamplingParams(
        temperature=0.3,
        top_k=7,
        top_p=0.5,
        min_p=0.2,
        seed=1,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_tokens=3,
        max_tokens=9,
        logprobs=4,
        prompt_logprobs=2,
    )
    plain = SamplingParams()
    used = RequestState(2, 40, 6, 50, torch.device("cpu"))
    used.add(_new("a", 30, odd, 11, [1, 2, 3, 4, 5]))
    used.apply_staged_writes()
    used.num_computed_tokens[0] = 17
    used.remove("a")
    used.add(_new("b", 4, plain, 22, [6]))
    used.apply_staged_writes()
    fresh = RequestState(2, 40, 6, 50, torch.device("cpu"))
    fresh.add(_new("b", 4, plain, 22, [6]))
    fresh.apply_staged_writes()
    assert used.req_to_slot == fresh.req_to_slot == {"b": 0}
    for obj_used, obj_fresh in ((used, fresh), (used.sampling, fresh.sampling)):
        for name, value in vars(obj_fresh).items():
            other = getattr(obj_used, name)
            if isinstance(value, np.ndarray):
                assert np.array_equal(other[0], value[0]), name
            elif isinstance(value, list) and name == "stop_ids":
                assert other[0] == value[0], name
    # Token history and block table beyond B's length still hold A's stale values; they are
    # never read because num_tokens / num_blocks bound every gather. Check those bounds:
    assert used.num_tokens[0] == 4 and used.num_blocks[0] == 1
    assert torch.equal(used.token_ids[0, :4], fresh.token_ids[0, :4])
    assert torch.equal(used.block_table[0, :1], fresh.block_table[0, :1])


def test_input_buffers_keep_their_addresses():
    """CUDA graphs replay on fixed addresses: building steps of different sizes must never
    reallocate the persistent input buffers."""
    buf = InputBuffers(max_num_reqs=4, max_num_tokens=32, max_blocks=3, device=torch.device("cpu"))
    ptrs = [
        t.data_ptr()
        for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens, buf.block_tables)
    ]
    tokens = torch.arange(4 * 40, dtype=torch.int32).reshape(4, 40)
    table = torch.arange(1, 13, dtype=torch.int32).reshape(4, 3)
    for slots, sched, comp in [  # the step buffer packs the sample mask too
        ([0, 3], [5, 1], [0, 9]),
        ([1], [20], [3]),
        ([2, 1, 0], [1, 1, 1], [4, 23, 30]),
    ]:
        keep = np.arange(len(slots)) % 2 == 0
        batch = buf.build(np.array(slots), np.array(sched), np.array(comp), tokens, table, 16, keep)
        assert batch.input_ids.data_ptr() == ptrs[0]
        assert batch.slot_mapping.data_ptr() == ptrs[2]
        assert batch.block_tables.data_ptr() == ptrs[4]
        assert batch.logits_indices.tolist() == (np.cumsum(sched) - 1).tolist()
        assert batch.sample_mask.tolist() == keep.astype(int).tolist()
    assert [
        t.data_ptr()
        for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens, buf.block_tables)
    ] == ptrs


def test_capture_sizes_never_exceed_the_token_buffers():
    """Guards an illegal memory access on the GPU: with max_num_batched_tokens (128)
    below max_num_seqs (256), a 256-row graph ran over a 128-token input buffer."""
    from pdserve.runner.mrv2.cuda_graphs import capture_sizes

    sizes = capture_sizes(None, max_num_seqs=256, max_num_batched_tokens=128)
    assert max(sizes) == 128 and 1 in sizes
    assert capture_sizes([1, 8, 300, 512], 512, 8192) == (1, 8, 300, 512)
    assert capture_sizes([1, 8, 300, 512], 512, 256) == (1, 8)
    assert capture_sizes(None, 3, 8192) == (1, 2)  # 3 rows run eagerly


def test_take_appends_hands_over_only_single_block_appends_of_the_batch():
    """Guards the step-scope graph's block appends: only a step whose every pending write is
    one value in a row of the batch hands them over (and then none is applied twice);
    anything else (a new request's whole table, a row outside the batch) stays staged."""
    table = torch.zeros(4, 6, dtype=torch.int32)
    sw = StagedWrites(table)
    sw.stage(1, 3, [70])
    sw.stage(2, 0, [5, 6])  # a whole new row: not an append
    assert sw.take_appends({1, 2}) is None and sw.num_pending == 2
    sw.apply()
    sw.stage(1, 4, [71])
    sw.stage(3, 2, [72])
    assert sw.take_appends({1, 2}) is None and sw.num_pending == 2  # row 3 not in the batch
    assert sw.take_appends({1, 3}) == {1: (4, 71), 3: (2, 72)}
    assert sw.num_pending == 0
    sw.apply()  # nothing left: the taken values are the caller's to write
    assert table[1].tolist() == [0, 0, 0, 70, 0, 0] and not table[3].any()
