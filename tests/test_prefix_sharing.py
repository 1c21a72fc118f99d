"""A prompt arriving beside the same prompt waits for it instead of computing it again
(runner/prefix_sharing.py): real engines on a tiny Llama, CPU float32."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams

PROMPT = list(range(3, 43))  # 40 tokens: 5 blocks of 8, the last token's block not a hit


def _engine(model_dir: str, **kw) -> Engine:
    kw = {"max_model_len": 128, "block_size": 8, "num_gpu_blocks": 64, **kw}
    return Engine.from_args(model=model_dir, device=DEVICE, dtype="float32", **kw)


def _run(eng: Engine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]) -> dict:
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params[rid])
    out: dict[str, list[int]] = {}
    for _ in range(500):
        if not eng.has_unfinished():
            return out
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    raise AssertionError("the requests did not finish in 500 steps")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_copies_of_a_prompt_compute_it_once(tiny_llama_dir, async_scheduling):
    """Four copies of one prompt (a request's n choices: seeded samples) sent together:
    the first computes its 40 tokens, the others wait and hit 32 of them (4 full blocks),
    computing 8 each: 64 prompt tokens, not 160. Every output equals the one an engine
    without a prefix cache gives (where each copy computes the whole prompt)."""
    prompts = {f"c{i}": PROMPT for i in range(4)}
    params = {f"c{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=6) for i in range(4)}
    eng = _engine(tiny_llama_dir, async_scheduling=async_scheduling)
    got = _run(eng, prompts, params)
    assert eng.scheduler.num_prompt_tokens_computed == 40 + 3 * 8
    assert eng.scheduler.num_prefix_waits >= 3
    plain = _engine(tiny_llama_dir, async_scheduling=async_scheduling,
                    enable_prefix_caching=False)  # fmt: skip
    assert got == _run(plain, prompts, params)
    assert plain.scheduler.num_prompt_tokens_computed == 160
    assert plain.scheduler.num_prefix_waits == 0


def test_only_a_prompt_sharing_most_of_its_tokens_waits_and_others_go_past_it(tiny_llama_dir):
    """A prompt sharing one block (8 of its 48 tokens) with the one in flight does not wait
    for it; an unrelated prompt queued behind a waiting copy is admitted in the same step,
    past it."""
    eng = _engine(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request("first", PROMPT, params)
    eng.add_request("copy", PROMPT, params)
    eng.add_request("one_block", PROMPT[:8] + list(range(100, 140)), params)
    eng.add_request("other", list(range(200, 230)), params)
    eng.step()
    running = {r.request_id for r in eng.scheduler.running}
    assert running == {"first", "one_block", "other"}
    assert [r.request_id for r in eng.scheduler.waiting] == ["copy"]
    assert eng.scheduler.num_prefix_waits == 1
    eng.step()  # the copy hits the first's 4 blocks now
    assert "copy" in {r.request_id for r in eng.scheduler.running}
    assert eng.scheduler.num_prompt_tokens_computed == 40 + 48 + 30 + 8


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tickets_for_one_prompt_pull_it_once(tiny_qwen3_dir, async_scheduling):
    """The decode side of a remotely prefilled request's n choices: four tickets for one
    53-token prompt (3 full blocks of 16) arrive together; one pull brings the prompt, the
    other three wait until it is cached and pull only the block they do not hit. Bytes
    pulled: one prompt and three blocks, not four prompts; the tokens equal an engine
    doing it all (seeded samples)."""
    from test_pd_engine import _colocated, _kw, _prompts, _run, wait_for_tickets

    from pdserve.decode.worker import DecodeWorker
    from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport
    from pdserve.prefill.worker import PrefillWorker

    prompt = _prompts(1, 990, seed=11, lo=53, hi=53)[0]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=5) for i in range(4)]
    extra = dict(async_scheduling=async_scheduling)
    registry = LocalRegistry()
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir, **extra)), "P0",
                            registry=registry)  # fmt: skip
    decode = DecodeWorker(_kw(tiny_qwen3_dir, **extra), "D0",
                          {"local": LocalTransport(registry, prefill.source.layout_hash)})  # fmt: skip
    try:
        for i, p in enumerate(params):
            prefill.submit(str(i), prompt, p)
        tickets = {r.request_id: r.ticket for r in wait_for_tickets(prefill, 4, 60)}
        for rid, ticket in tickets.items():
            decode.submit(rid, prompt, params[int(rid)], ticket)
        got = _run(decode.step, decode.has_work)
        stats = decode.loader.stats
        assert stats.loads == 4 and stats.recomputes == 0
        assert decode.engine.scheduler.num_prefix_waits >= 3
        block = prefill.source.layout.groups[0].unit_bytes()
        assert stats.bytes_pulled == (4 + 3) * block, stats.bytes_pulled / block
    finally:
        prefill.close()
        decode.close()
    want = {}
    for i, p in enumerate(params):
        want.update({str(i): v for v in _colocated(tiny_qwen3_dir, [prompt], p, **extra).values()})
    assert got == want


def test_prompts_in_flight_are_forgotten_once_cached(tiny_llama_dir):
    """The scheduler keeps no prompt in its in-flight set past the step that cached it,
    even when nothing waits afterwards (a burst, then quiet)."""
    eng = _engine(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPT, params)
    eng.step()
    assert len(eng.scheduler._in_flight) == 1  # the first copy; the others wait
    for _ in range(4):
        eng.step()
    assert not eng.scheduler.waiting and len(eng.scheduler._in_flight) == 0
