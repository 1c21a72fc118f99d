"""Property test of the whole engine (real scheduler, KV manager and MRV2 runner on a tiny
model): random add / abort / step sequences under a tiny KV cache never double-allocate
a block, never leak one, and leave no runner slot behind."""

from __future__ import annotations

import itertools

import pytest
from conftest import DEVICE
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams

NUM_BLOCKS = 16
_ids = itertools.count()

op = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(1, 40),
        st.integers(1, 16),
        st.integers(0, 2),
        st.sampled_from([0.0, 1.0]),
    ),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(tiny_qwen3_dir, request) -> Engine:
    return Engine.from_args(
        async_scheduling=request.param,
        model=tiny_qwen3_dir,
        device=DEVICE,
        dtype="float32",
        max_model_len=56,
        block_size=4,
        num_gpu_blocks=NUM_BLOCKS,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )


def _check(engine: Engine) -> None:
    pool = engine.kv.block_pool
    holders: dict[int, int] = {}
    for rid in engine.scheduler.requests:
        blocks = engine.kv.get_block_ids(rid)
        assert len(blocks) == len(set(blocks)), f"{rid} holds a block twice"
        for b in blocks:
            holders[b] = holders.get(b, 0) + 1
    for b in range(1, NUM_BLOCKS):
        assert pool.ref_cnt(b) == holders.get(b, 0), f"block {b}: ref_cnt != holders"
    assert pool.num_free_blocks + len(holders) == NUM_BLOCKS - 1
    assert engine.scheduler.num_running <= 4


# Two prompts that fill most of the 15 usable blocks, then decode growth: preemption is
# certain, whatever the random examples do (the test below checks it happened).
FORCED_PREEMPTION = [("add", 20, 16, 0, 0.0), ("add", 20, 16, 1, 1.0)] + [("step", 3)] * 12


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(op, min_size=1, max_size=25))
@example(ops=FORCED_PREEMPTION)
def test_random_add_abort_step_never_leaks(engine, ops):
    live: list[str] = []
    try:
        _run_ops(engine, ops, live)
    finally:  # a failing example must not leave requests behind for the next one
        for rid in list(engine.scheduler.requests):
            engine.abort(rid)
        engine.step()


def _run_ops(engine, ops, live) -> None:
    base = next(_ids)
    for i, o in enumerate(ops):
        if o[0] == "add":
            _, n, max_tokens, shared, temperature = o
            prompt = [7 + shared] * 8 + list(range(20, 20 + n))  # shared heads -> prefix hits
            rid = f"r{base}-{i}"
            engine.add_request(
                rid,
                prompt,
                SamplingParams(temperature=temperature, max_tokens=max_tokens),
            )
            live.append(rid)
        elif o[0] == "abort" and live:
            engine.abort(live.pop(o[1] % len(live)))
        else:
            for _ in range(o[1]):
                for d in engine.step():
                    if d.finished and d.request_id in live:
                        live.remove(d.request_id)
        _check(engine)
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    engine.step()  # hands the last finished ids to the runner
    _check(engine)
    assert engine.kv.num_free_blocks == NUM_BLOCKS - 1, "blocks leaked"
    assert engine.runner.state.num_live == 0, "runner slots leaked"


def test_the_property_run_exercised_preemption(engine):
    """The property test above is only meaningful if its tiny cache forced preemptions and
    prefix hits (runs after it in this module, on the same engine)."""
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.prefix_cache_hits > 0
