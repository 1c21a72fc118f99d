"""The runner's CUDA-graph path on the CPU: `EagerReplayGraphs` "replays" a graph by
running the function a capture would record, eagerly, over the same persistent buffers.
So the path's host logic runs here with real weights and async scheduling, with both
scopes: padding to a capture size, the packed step buffer (row count, sample mask, new
blocks), the build that leaves the input prep to the graph, the greedy tail and the
fall-back to the eager tail. The capture itself (addresses, no syncs) is GPU-only: test_gpu_step_loop.py.
"""

from __future__ import annotations

import random

import pytest

from pdserve.kernels.decode_prep import step_buffer_size
from pdserve.runner.engine import Engine
from pdserve.runner.mrv2.cuda_graphs import CudaGraphs
from pdserve.runner.mrv2.step_mailbox import StepMailbox
from pdserve.runner.sampling_params import SamplingParams

SIZES = [1, 2, 4, 8, 16]


class EagerReplayGraphs(CudaGraphs):
    """CudaGraphs without CUDA: each replay runs what the capture would have recorded."""

    def capture(self, progress=None) -> None:
        self.graphs = dict.fromkeys(self.sizes)
        if self.tail is not None:
            self.tail_graphs = dict.fromkeys(self.sizes)

    def replay(self, size: int):
        self.replays += 1
        return self._forward(size)

    def replay_greedy(self, size: int):
        self.tail_replays += 1
        hidden = self._forward(size)
        return hidden, self.tail(hidden, size)


def _run(model_dir: str, scope: str | None) -> tuple[dict[str, list[int]], Engine]:
    """12 requests of mixed lengths (the batch shrinks through padded sizes): greedy ones,
    one wanting logprobs and one seeded sampler, both finishing early, so later steps
    take the greedy tail. `scope` None: no graphs (every step eager). Also checks each
    request's token history on the device: its prompt then its outputs, so a pad row
    (which points at slot 0, position 0) or a discarded sample wrote nothing."""
    eng = Engine.from_args(
        model=model_dir, device="cpu", dtype="float32", max_num_seqs=16,
        max_num_batched_tokens=64, async_scheduling=True,
    )  # fmt: skip
    r = eng.runner
    if scope == "step":  # as on CUDA: the step's buffer and samples go through the mailbox
        r.mailbox = r.buffers.mailbox = StepMailbox(
            step_buffer_size(r.buffers.max_num_reqs), r.buffers.max_num_reqs, r.device
        )
    if scope is not None:
        parts = r._step_parts() if scope.startswith("step") else {}
        r.graphs = EagerReplayGraphs(
            r.model, r.buffers, r.kv_caches, SIZES, r.config.model.max_model_len + 1, **parts
        )
        r.graphs.capture()
    execute = r.execute

    def counting_execute(so, *args, **kwargs):
        eng.token_steps += bool(so.num_scheduled_tokens)
        return execute(so, *args, **kwargs)

    eng.token_steps = 0  # steps with tokens, whatever ran them
    r.execute = counting_execute
    rng = random.Random(3)
    prompts: dict[str, list[int]] = {}
    for i in range(12):
        params = SamplingParams(
            temperature=0.7 if i == 5 else 0.0,
            seed=11 if i == 5 else None,
            max_tokens=6 if i in (2, 5) else rng.randint(10, 24),
            ignore_eos=True,
            logprobs=1 if i == 2 else None,
        )
        prompts[f"r{i}"] = [rng.randrange(3, 990) for _ in range(rng.randint(3, 40))]
        eng.add_request(f"r{i}", prompts[f"r{i}"], params)
    out: dict[str, list[int]] = {}
    slot_of: dict[str, int] = {}
    for _ in range(200):
        for delta in eng.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        slot_of.update(r.state.req_to_slot)  # no slot is reused: 12 requests, 16 slots
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    for req_id, prompt in prompts.items():
        history = r.state.token_ids[slot_of[req_id], : len(prompt) + len(out[req_id])]
        assert history.tolist() == prompt + out[req_id], f"{req_id}'s token history"
    return out, eng


@pytest.mark.parametrize("scope", ["layers", "step", "step_ring"])
def test_graph_path_gives_the_eager_tokens(tiny_qwen3_dir, scope):
    """Guards the graph path's host logic: a pad row or a wrong row count in the step
    buffer, a sample mask at the wrong offset, a graph step built without its prep, or the
    greedy tail writing the wrong token history would each change the tokens (and the
    next step's inputs) against the eager path. `step` reads each step's buffer from the
    step mailbox and its greedy samples from there (a wrong slot, or a count that moves
    other than once a graph step, gives another step's inputs or tokens); `step_ring`
    copies them as the layer scope does."""
    eager, eager_eng = _run(tiny_qwen3_dir, None)
    got, eng = _run(tiny_qwen3_dir, scope)
    graphs = eng.runner.graphs
    # What the workers' stats (and /metrics' engine_steps) report: every step with tokens
    # under exactly one path.
    assert eager_eng.steps_by_path() == {
        "eager": eager_eng.token_steps, "cuda_graph": 0, "cuda_graph_whole_step": 0,
    }  # fmt: skip
    by_path = eng.steps_by_path()
    assert sum(by_path.values()) == eng.token_steps
    assert by_path["cuda_graph"] == graphs.replays
    assert by_path["cuda_graph_whole_step"] == graphs.tail_replays
    assert 0 < by_path["eager"] < eng.token_steps  # the prefills, and the mixed steps
    assert graphs.replays + graphs.tail_replays > 10, "the decode steps did not take graphs"
    if scope.startswith("step"):
        assert graphs.tail_replays > 5, "all-greedy steps must take the greedy tail"
        assert graphs.replays > 0, "steps with logprobs or sampling take the eager tail"
        assert eng.runner.graph_block_appends > 3, "new blocks must ride in the step buffer"
        mailbox = eng.runner.mailbox
        if scope == "step":  # every graph step went through it, the count moved once each
            assert mailbox.steps == int(mailbox.seq) == graphs.replays + graphs.tail_replays
        else:
            assert mailbox is None
    else:
        assert graphs.tail_replays == 0 and eng.runner.graph_block_appends == 0
    assert got.keys() == eager.keys()
    for req_id, tokens in eager.items():
        assert got[req_id] == tokens, f"{req_id} differs on the {scope} graph path"
