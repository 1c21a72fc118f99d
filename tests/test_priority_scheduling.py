"""`scheduling_policy="priority"` in the engine's scheduler (vLLM's policy): waiting
requests run by (priority, arrival), lower first; when blocks run out the running request
last in that order is preempted; an fcfs engine refuses a priority other than 0. The
router's queue takes the same order (test_decode_admission.py)."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from pdserve import LLM
from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams


def _engine(model_dir: str, policy: str, **kw) -> Engine:
    kw = {"max_model_len": 40, "block_size": 8, **kw}
    return Engine.from_args(
        model=model_dir, device=DEVICE, dtype="float32", scheduling_policy=policy, **kw
    )


def _params(priority: int, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def _finish_order(eng: Engine) -> list[str]:
    order = []
    for _ in range(500):
        if not eng.has_unfinished():
            return order
        order += [d.request_id for d in eng.step() if d.finish_reason is not None]
    raise AssertionError("the requests did not finish in 500 steps")


def test_waiting_requests_run_by_priority_then_arrival(tiny_llama_dir):
    """Guards the waiting queue's order: one running slot, four requests queued at once;
    they run lowest priority value first, arrival order among equals; fcfs runs them as
    they came."""
    prompts = {name: [5 + i, 7, 9, 11] for i, name in enumerate("abcd")}
    priorities = {"a": 0, "b": 5, "c": -1, "d": 0}
    eng = _engine(tiny_llama_dir, "priority", max_num_seqs=1, num_gpu_blocks=16)
    for name, ids in prompts.items():
        eng.add_request(name, ids, _params(priorities[name]))
    assert _finish_order(eng) == ["c", "a", "d", "b"]
    fcfs = _engine(tiny_llama_dir, "fcfs", max_num_seqs=1, num_gpu_blocks=16)
    for name, ids in prompts.items():
        fcfs.add_request(name, ids, _params(0))
    assert _finish_order(fcfs) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_takes_the_lowest_priority_not_the_newest(tiny_llama_dir, async_scheduling):
    """Guards the victim choice: blocks run out while a low-priority request admitted first
    and a high-priority one admitted after it both decode. fcfs preempts the newest (the
    high-priority one); priority preempts the low-priority one. Either way the preempted
    request recomputes and every output equals the other policy's (greedy), with async
    scheduling's in-flight tokens too."""
    outs, first_preempted = {}, {}
    for policy, (pa, pb) in (("fcfs", (0, 0)), ("priority", (5, 0))):
        eng = _engine(
            tiny_llama_dir, policy, max_num_seqs=2, num_gpu_blocks=8,
            async_scheduling=async_scheduling,
        )  # fmt: skip
        eng.add_request("low", list(range(3, 26)), _params(pa, max_tokens=12))
        tokens: dict[str, list[int]] = {}
        for d in eng.step():  # "low" is admitted first
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        eng.add_request("high", list(range(5, 19)), _params(pb, max_tokens=12))
        for _ in range(200):
            if not eng.has_unfinished():
                break
            for d in eng.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if policy not in first_preempted:
                hit = [r for r, q in eng.scheduler.requests.items() if q.num_preemptions]
                if hit:
                    first_preempted[policy] = hit
        outs[policy] = tokens
    assert first_preempted == {"fcfs": ["high"], "priority": ["low"]}
    assert outs["fcfs"] == outs["priority"]
    assert sorted(map(len, outs["fcfs"].values())) == [12, 12], outs


def test_priority_needs_the_priority_policy(tiny_llama_dir):
    """Guards vLLM's rule in the engine and the offline LLM: under fcfs a priority other
    than 0 is refused naming the policy; `LLM.generate(priority=...)` gives one per prompt."""
    eng = _engine(tiny_llama_dir, "fcfs", num_gpu_blocks=16)
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        eng.add_request("r", [5, 6], _params(2))
    assert not eng.has_unfinished()
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        _engine(tiny_llama_dir, "lifo", num_gpu_blocks=16)
    llm = LLM(model=tiny_llama_dir, device=DEVICE, dtype="float32", max_model_len=40,
              block_size=8, num_gpu_blocks=16, scheduling_policy="priority")  # fmt: skip
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    outs = llm.generate(prompts, _params(0), use_tqdm=False, priority=[3, -2])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts[:1], _params(0), use_tqdm=False, priority=[1, 2])
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=True)
