"""The serve log's stats lines (cluster/stats_log.py) and the engine counters they read:
prompt tokens computed (prefix-cache hits not counted) and tokens sampled."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from pdserve.cluster.stats_log import StatsLog
from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_counts_computed_prompt_tokens_and_sampled_tokens(tiny_qwen3_dir, async_scheduling):
    """Chunked prefill (8 tokens a step), then the same prompt again: its full blocks are
    prefix hits and only the rest is computed. Every sampled token is counted once."""
    engine = Engine.from_args(
        async_scheduling=async_scheduling, model=tiny_qwen3_dir, device=DEVICE, dtype="float32",
        max_model_len=128, block_size=4, num_gpu_blocks=64, max_num_seqs=4,
        max_num_batched_tokens=8,
    )  # fmt: skip
    prompt = list(range(30, 60))  # 30 tokens: 7 full blocks of 4, 2 over

    def run(rid: str, max_tokens: int) -> int:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(d.new_token_ids) for d in engine.step())
        return tokens

    assert run("a", 5) == 5
    assert engine.scheduler.num_prompt_tokens_computed == 30
    assert engine.stats.generation_tokens == 5
    assert run("b", 3) == 3
    hits = engine.kv.prefix_cache_hits
    assert hits == 28  # the 7 full blocks
    assert engine.scheduler.num_prompt_tokens_computed == 30 + (30 - hits)
    assert engine.stats.generation_tokens == 8


def _worker(**kw) -> dict:
    base = {
        "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
        "prompt_tokens_computed": 0, "generation_tokens": 0, "prefix_cache_queries": 0,
        "prefix_cache_hits": 0, "num_preemptions": 0, "steps_by_path": {},
    }  # fmt: skip
    return {**base, **kw}


ROLES = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}


def test_lines_carry_interval_rates_pool_sums_and_step_paths():
    log = StatsLog(start=100.0)
    first = {
        "prefill-0": _worker(prompt_tokens_computed=400, generation_tokens=2,
                             prefix_cache_queries=400, prefix_cache_hits=100),
        "decode-0": _worker(generation_tokens=30, num_requests_running=2, kv_cache_usage_perc=0.2,
                            steps_by_path={"cuda_graph": 27, "eager": 3}),
        "decode-1": _worker(generation_tokens=10, num_requests_waiting=1, kv_cache_usage_perc=0.1,
                            steps_by_path={"cuda_graph": 10}),
    }  # fmt: skip
    lines = log.lines(110.0, ROLES, first)
    assert lines == [
        "prefill pool (1 worker): Avg prompt throughput: 40.0 tokens/s, Avg generation "
        "throughput: 0.2 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
        "Prefix cache hit rate: 25.0%",
        "decode pool (2 workers): Avg prompt throughput: 0.0 tokens/s, Avg generation "
        "throughput: 4.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 15.0% "
        "(max 20.0%), Steps: 92% cuda_graph, 8% eager",
    ]
    # Five seconds later: only what changed since, per second of those five.
    second = {
        **first,
        "decode-0": _worker(generation_tokens=80, num_requests_running=2, kv_cache_usage_perc=0.3,
                            num_preemptions=1, kernel_compiles=2,
                            steps_by_path={"cuda_graph": 77, "eager": 3}),
    }  # fmt: skip
    lines = log.lines(115.0, ROLES, second)
    assert lines[0].startswith("prefill pool (1 worker): Avg prompt throughput: 0.0 tokens/s")
    assert lines[1] == (
        "decode pool (2 workers): Avg prompt throughput: 0.0 tokens/s, Avg generation "
        "throughput: 10.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 20.0% "
        "(max 30.0%), Preemptions: 1, Kernel compiles: 2, Steps: 100% cuda_graph"
    )


def test_an_idle_pool_prints_one_line_of_zeros_then_nothing():
    log = StatsLog(start=0.0)
    busy = {"decode-0": _worker(generation_tokens=50)}
    roles = {"decode-0": "decode"}
    assert len(log.lines(10.0, roles, busy)) == 1
    idle = log.lines(20.0, roles, busy)  # nothing new: the zeros, once
    assert idle == [
        "decode pool (1 worker): Avg prompt throughput: 0.0 tokens/s, Avg generation "
        "throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%"
    ]
    assert log.lines(30.0, roles, busy) == []
    waiting = {"decode-0": _worker(generation_tokens=50, num_requests_waiting=3)}
    assert "Waiting: 3 reqs" in log.lines(40.0, roles, waiting)[0]  # work again: it speaks


def test_requests_queued_in_the_router_make_the_decode_pool_speak():
    """Guards the queue on the log: requests waiting in the router for a decode slot are
    on the decode pool's line (only there), and are work: an idle pool with a queue
    speaks."""
    log = StatsLog(start=0.0)
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    idle = {w: _worker() for w in roles}
    assert log.lines(10.0, roles, idle) == []  # nothing has happened yet
    assert log.lines(20.0, roles, idle, queued=4) == [
        "decode pool (1 worker): Avg prompt throughput: 0.0 tokens/s, Avg generation "
        "throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, Queued in router: 4 "
        "reqs, KV cache usage: 0.0%"
    ]


def test_a_restarted_worker_counts_from_zero_and_a_silent_one_is_named():
    log = StatsLog(start=0.0)
    roles = {"decode-0": "decode"}
    log.lines(10.0, roles, {"decode-0": _worker(generation_tokens=500)})
    # Its counters went back: a new process, whose 20 tokens are all since the last line.
    restarted = {"decode-0": _worker(generation_tokens=20, error="TimeoutError()")}
    (line,) = log.lines(20.0, roles, restarted)
    assert "Avg generation throughput: 2.0 tokens/s" in line
    assert line.endswith("not answering: decode-0")
    # A drained worker is forgotten; one added later counts from its own zero.
    assert log.lines(30.0, {}, {}) == []
    (line,) = log.lines(40.0, roles, {"decode-0": _worker(generation_tokens=30)})
    assert "Avg generation throughput: 3.0 tokens/s" in line


def test_warm_up_leaves_no_trace(tiny_qwen3_dir):
    """runner/warm_up.py (run by serving workers on a GPU): afterwards nothing is queued or
    held, the prefix cache is empty, every counter the log and /metrics read is zero, and
    an unseeded sampled request gets the same tokens as on a fresh engine (its seed comes
    from the arrival count)."""
    from pdserve.runner.warm_up import warm_up

    def engine() -> Engine:
        return Engine.from_args(
            model=tiny_qwen3_dir, device=DEVICE, dtype="float32", max_model_len=128,
            block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
        )  # fmt: skip

    def sample(e: Engine) -> list[int]:
        e.add_request("r", list(range(13)), SamplingParams(temperature=1.0, max_tokens=6))
        out = []
        while e.has_unfinished():
            out += [t for d in e.step() for t in d.new_token_ids]
        return out

    warm, fresh = engine(), engine()
    assert warm_up(warm) > 0
    assert not warm.scheduler.requests and warm.kv.num_free_blocks == fresh.kv.num_free_blocks
    assert (warm.stats.num_steps, warm.stats.generation_tokens) == (0, 0)
    assert warm.scheduler.num_prompt_tokens_computed == warm.kv.prefix_cache_queries == 0
    assert set(warm.steps_by_path().values()) == {0}
    assert sample(warm) == sample(fresh)
    assert warm.kv.prefix_cache_hits == 0  # the first warm-up prompt starts 0, 1, 2, ...: gone
    assert warm.stats.generation_tokens == 6


def test_the_warm_up_reaches_every_decode_attention_variant(tiny_qwen3_dir):
    """An eager worker must not compile the decode attention's split or wide-tile variant
    in a request (seen on the H200: 402 ms): where the engine's limits allow those shapes,
    the warm-up runs a split context (past MIN_SPLIT_KEYS) and more rows than fit
    FEW_DECODE_PAIRS pairs (this model has one kv head), and still leaves nothing behind;
    where they do not (a short model length, few slots or blocks) it skips them. Where the
    fused preparation may run (auto, per_head_prep) it also runs the fused kernel's unscaled
    variant (past the folded chain's rows)."""
    from pdserve.kernels.paged_decode_split import FEW_DECODE_PAIRS, MIN_SPLIT_KEYS
    from pdserve.kernels.row_squares import SQ_ROWS
    from pdserve.runner.warm_up import decode_variant_batches, warm_up

    def engine(**kw) -> Engine:
        return Engine.from_args(model=tiny_qwen3_dir, device=DEVICE, dtype="float32", **kw)

    big = engine(max_model_len=512, max_num_seqs=FEW_DECODE_PAIRS + 8, decode_attention="per_head")
    assert decode_variant_batches(big) == [(MIN_SPLIT_KEYS + 16,), (3,) * (FEW_DECODE_PAIRS + 1)]
    assert warm_up(big) > 0
    assert not big.scheduler.requests and big.kv.num_free_blocks == big.kv.num_blocks - 1
    assert decode_variant_batches(engine(max_model_len=128, max_num_seqs=64)) == []
    # Only what the cache holds at once: 40 blocks of 16 take the long prompt, not 257 rows.
    few_blocks = engine(max_model_len=512, max_num_seqs=FEW_DECODE_PAIRS + 8, num_gpu_blocks=40)
    assert decode_variant_batches(few_blocks) == [(MIN_SPLIT_KEYS + 16,)]
    assert warm_up(few_blocks) > 0
    # auto and per_head_prep: also the fused kernel past the folded chain's rows (65 rows,
    # 65 pairs)
    for kernel in ("auto", "per_head_prep"):
        prep = engine(max_model_len=128, max_num_seqs=FEW_DECODE_PAIRS + 8, decode_attention=kernel)
        fused_then_wide = [(3,) * (SQ_ROWS + 1), (3,) * (FEW_DECODE_PAIRS + 1)]
        assert decode_variant_batches(prep) == fused_then_wide, kernel
    assert warm_up(prep) > 0


def test_speculative_decoding_adds_its_acceptance_over_the_interval():
    """vLLM's SpecDecoding numbers for the interval: kept / drafted tokens, and 1 + kept
    per draft (the tokens a drafted step yields on average)."""
    log = StatsLog(start=0.0)
    before = {"decode-0": _worker(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                                  spec_decode_num_accepted_tokens=3,
                                  spec_decode_accepted_by_position={"0": 2, "1": 1, "2": 0})}  # fmt: skip
    log.lines(10.0, ROLES, before)
    after = {"decode-0": _worker(spec_decode_num_drafts=30, spec_decode_num_draft_tokens=90,
                                 spec_decode_num_accepted_tokens=33,
                                 spec_decode_accepted_by_position={"0": 20, "1": 9, "2": 4})}  # fmt: skip
    line = log.lines(20.0, ROLES, after)[-1]
    assert line.endswith(
        "Draft acceptance rate: 50.0%, Mean acceptance length: 2.50, "
        "Per-position acceptance rate: 0.90, 0.40, 0.20"
    )
    quiet = log.lines(30.0, ROLES, after)  # nothing drafted since: no acceptance part
    assert all("acceptance" not in x for x in quiet)
