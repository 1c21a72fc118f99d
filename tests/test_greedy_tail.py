"""The greedy tail a decode graph captures (`--cuda-graph-greedy-tail`), run eagerly on the
CPU over the runner's persistent buffers: the same tokens as the eager LM head + argmax,
written into the token history for kept rows only. The capture itself is GPU-only
(test_gpu_step_loop.py)."""

from __future__ import annotations

import torch

from pdserve.runner.config_resolve import resolve_engine_config
from pdserve.runner.engine import Engine


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
    mask = torch.tensor([True, False, True, True, True, False, False, False])  # 5..7: pads
    b.sample_mask[:size] = mask
    before = runner.state.token_ids.clone()

    sampled = runner._greedy_tail(hidden, size)

    expected = runner.model.compute_logits(hidden, float32=False).argmax(dim=-1)
    assert torch.equal(sampled, expected)
    after = before.clone()
    for row in range(real):
        if mask[row]:
            after[slots[row], positions[row]] = int(expected[row])
    assert torch.equal(runner.state.token_ids, after)


def test_greedy_tail_is_off_without_graphs(tiny_qwen3_dir):
    """The flag needs CUDA graphs: on the CPU (or with enforce_eager) it resolves to off,
    so the engine's log line never claims a path it does not run."""
    cfg = resolve_engine_config(model=tiny_qwen3_dir, device="cpu", cuda_graph_greedy_tail=True)
    assert cfg.runner.cuda_graph_greedy_tail is False
