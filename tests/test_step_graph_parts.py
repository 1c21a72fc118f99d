"""What a step-scope decode graph holds beyond the layers (`--cuda-graph-scope step`), run
eagerly on the CPU over the runner's persistent buffers: the input prep gives the inputs
the eager prep gives, and the greedy tail the tokens of the eager LM head + argmax,
written into the token history for kept rows only. The capture itself is GPU-only
(test_gpu_step_loop.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.runner.config_resolve import resolve_engine_config
from pdserve.runner.engine import Engine
from pdserve.runner.mrv2.input_batch import InputBuffers


def test_greedy_tail_samples_the_argmax_and_updates_kept_rows_only(tiny_qwen3_dir):
    """Guards the tail's operands: ids from the packed idx_mapping, positions from
    seq_lens, and sample_mask gating the write, so pad rows (mask False) and discarded
    samples write nothing, and every kept row writes its own slot."""
    eng = Engine.from_args(model=tiny_qwen3_dir, device="cpu", dtype="float32", max_num_seqs=8)
    runner, b = eng.runner, eng.runner.buffers
    size, real = 8, 5
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(size, runner.model.embed_tokens.weight.shape[1], generator=gen)
    slots = torch.randperm(8, generator=gen)[:size].to(torch.int32)
    b.step_inputs[:size] = slots
    positions = torch.randint(0, runner.state.token_ids.shape[1], (size,), generator=gen)
    b.seq_lens[:size] = positions.to(torch.int32)
    mask = torch.tensor([1, 0, 1, 1, 1, 0, 0, 0], dtype=torch.int32)  # 5..7: pads
    b.step_inputs[b.mask_offset : b.mask_offset + size] = mask
    before = runner.state.token_ids.clone()

    sampled = runner._greedy_tail(hidden, size)

    expected = runner.model.compute_logits(hidden, float32=False).argmax(dim=-1)
    assert torch.equal(sampled, expected)
    after = before.clone()
    for row in range(real):
        if mask[row]:
            after[slots[row], positions[row]] = int(expected[row])
    assert torch.equal(runner.state.token_ids, after)


def test_graph_prep_gives_the_eager_prep_inputs(tiny_qwen3_dir):
    """Guards the step buffer's real-row count (written by `build`, read by the graph's
    prep) and the build that skips the eager prep: a padded decode step's inputs through
    `build(prep_in_graph=True)` + `prepare_decode` equal those of the eager build."""
    eng = Engine.from_args(model=tiny_qwen3_dir, device="cpu", dtype="float32", max_num_seqs=8)
    st, bs = eng.runner.state, eng.runner.block_size
    gen = torch.Generator().manual_seed(1)
    st.token_ids.copy_(torch.randint(0, 900, st.token_ids.shape, generator=gen))
    st.block_table.copy_(torch.randint(1, 50, st.block_table.shape, generator=gen))
    slots = np.array([6, 1, 3], dtype=np.int64)
    computed = np.array([0, 17, 40], dtype=np.int64)
    size = 4
    outs = []
    for in_graph in (False, True):
        b = InputBuffers(8, 64, st.block_table.shape[1], torch.device("cpu"))
        for t in (b.input_ids, b.positions, b.seq_lens, b.block_tables, b.slot_mapping):
            t.fill_(77)  # garbage a forgotten pad would leave
        b.build(slots, np.ones(3, dtype=np.int64), computed, st.token_ids, st.block_table,
                bs, np.ones(3, dtype=bool), size, prep_in_graph=in_graph)  # fmt: skip
        if in_graph:
            b.prepare_decode(size, st.token_ids, st.block_table, bs)
        outs.append(
            [b.input_ids[:size], b.positions[:size], b.seq_lens[:size], b.block_tables[:size],
             b.slot_mapping[:size]]
        )  # fmt: skip
    for eager, graph in zip(*outs):
        assert torch.equal(eager, graph)
    assert outs[1][2].tolist() == [1, 18, 41, 0]  # seq_lens; the pad row 0


def test_a_graph_scope_that_does_not_exist_is_refused(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="cuda_graph_scope must be one of"):
        resolve_engine_config(model=tiny_qwen3_dir, device="cpu", cuda_graph_scope="full")
