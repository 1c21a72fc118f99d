"""GPU-path invariants of the step loop (collected only where a CUDA device exists; see
conftest.collect_ignore): no host sync inside steps, CUDA graphs replay over the same
persistent buffers, padded graph rows write nothing to the KV cache."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams


def _engine(model_dir: str, decode_attention: str = "auto") -> Engine:
    return Engine.from_args(
        model=model_dir,
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        decode_attention=decode_attention,
    )


@pytest.mark.parametrize("decode_attention", ["per_head", "packed", "flat"])
def test_step_loop_never_syncs_and_graphs_keep_their_buffers(qwen3_shaped_dir, decode_attention):
    eng = _engine(qwen3_shaped_dir, decode_attention)
    assert eng.config.runner.async_scheduling and eng.runner.graphs is not None
    buf = eng.runner.buffers
    ptrs = {
        name: getattr(buf, name).data_ptr()
        for name in (
            "step_inputs",
            "input_ids",
            "positions",
            "slot_mapping",
            "seq_lens",
            "block_tables",
        )
    }
    rng = random.Random(0)
    params = [
        SamplingParams(temperature=t, top_p=p, max_tokens=24, ignore_eos=True, seed=i)
        for i, (t, p) in enumerate([(0.0, 1.0), (0.8, 0.9), (1.0, 1.0)] * 4)
    ]
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", [rng.randrange(3, 150_000) for _ in range(rng.randint(5, 90))], p)
    for _ in range(3):  # prefill steps and the first decode (compiles what is left)
        eng.step()
    kv_before = eng.runner.kv_cache.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = 0
        while eng.scheduler.has_unfinished():
            eng.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps > 10
    while eng.has_unfinished():
        eng.step()
    assert {n: getattr(buf, n).data_ptr() for n in ptrs} == ptrs, "persistent buffers moved"
    # Pad rows (slot -1) wrote nothing: block 0 (the null block) is untouched by decoding.
    assert torch.equal(eng.runner.kv_cache[:, 0], kv_before[:, 0])
