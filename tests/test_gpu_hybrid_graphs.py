"""CUDA-only: hybrid Mamba models' decode steps in CUDA graphs (runner/mrv2/mamba_state.py:
the rows' state units in persistent buffers, pad rows on a scratch unit). conftest does
not collect this module without a GPU; the mixers' parity is in test_mamba_hybrid.py.

A graph replays one capture for every step: if the units were baked in at capture time,
or a pad row wrote a request's unit, the tokens would part from the eager engine's.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 990) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _run(model_dir: str, prompts, lengths, **kw):
    llm = LLM(model=model_dir, device="cuda", dtype="float32", **kw)
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "fixture", ["tiny_bamba_dir", "tiny_jamba_dir", "tiny_nemotron_h_dir", "tiny_qwen3_next_dir"]
)
@pytest.mark.parametrize("scope", ["step", "layers"])
def test_hybrid_decode_graphs_equal_the_eager_engine(fixture, scope, request):
    """7 prompts finishing at different steps: decode batches of 7 down to 1 rows, padded
    to capture sizes 8, 4, 2, 1 (pad rows on the scratch unit), units freed and reused as
    requests leave; tokens equal the eager engine's and most decode steps are graphs."""
    model_dir = request.getfixturevalue(fixture)
    prompts, lengths = _prompts(7, seed=3), [5, 30, 12, 30, 2, 21, 9]
    _, want = _run(model_dir, prompts, lengths, enforce_eager=True)
    llm, got = _run(model_dir, prompts, lengths, cuda_graph_scope=scope)
    assert got == want
    paths = llm.engine.runner.steps_by_path()
    graph_steps = paths["cuda_graph"] + paths["cuda_graph_whole_step"]
    assert graph_steps >= 25, paths
    assert llm.engine.execution_path["graph_scope"] == scope


def test_a_padded_replay_leaves_other_units_alone(tiny_bamba_dir):
    """Three requests decoding in size-4 graphs (one pad row): the units of no request
    keep their (random) states; only the three requests' units and the scratch unit
    change."""
    llm = LLM(model=tiny_bamba_dir, device="cuda", dtype="float32", max_num_seqs=8)
    runner = llm.engine.runner
    conv, ssm = runner.model.mamba_states
    torch.manual_seed(0)
    conv.copy_(torch.randn_like(conv))
    ssm.copy_(torch.randn_like(ssm))
    before = (conv.clone(), ssm.clone())
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(3)]
    llm.generate(prompts, params, use_tqdm=False)
    paths = runner.steps_by_path()
    assert paths["cuda_graph"] + paths["cuda_graph_whole_step"] >= 4, paths
    changed = [
        u for u in range(conv.shape[1])
        if not (torch.equal(conv[:, u], before[0][:, u]) and torch.equal(ssm[:, u], before[1][:, u]))
    ]  # fmt: skip
    scratch = runner.model_state.scratch_unit
    assert scratch in changed and len(changed) == 4, changed
