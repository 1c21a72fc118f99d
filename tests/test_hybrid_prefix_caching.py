"""Prefix caching for hybrid models (runner/state_snapshots.py): a prompt's prefill is cut at
its last block boundary, the recurrent state there is saved into a snapshot unit, and a
later prompt sharing that prefix starts from it (its cached KV blocks and the restored
state) instead of from zero.

Every check compares with the same engine without prefix caching: a restored state that
is wrong (not restored, restored from another prefix, saved at the wrong step) changes
the tokens, and the hit counts say the prefix really was reused.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve import LLM, SamplingParams

HYBRIDS = ["tiny_bamba_dir", "tiny_jamba_dir", "tiny_nemotron_h_dir", "tiny_qwen3_next_dir"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)


def _llms(model: str, **kw):
    base = dict(device=DEVICE, dtype="float32", block_size=16, max_num_batched_tokens=24) | kw
    return LLM(model=model, **base), LLM(model=model, enable_prefix_caching=False, **base)


def _gen(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("fixture", HYBRIDS)
def test_a_chat_turn_resumes_from_the_last_turns_state(fixture, request):
    """Turn 2 is turn 1's prompt, its reply and more: it reuses turn 1's 64 prompt tokens
    (70 // 16 blocks) and decodes as the engine without caching does."""
    model = request.getfixturevalue(fixture)
    cached, plain = _llms(model)
    rng = random.Random(1)
    first = [rng.randrange(3, 990) for _ in range(70)]
    (reply,), (hit,) = _gen(cached, [first])
    assert hit == 0
    assert _gen(plain, [first])[0] == [reply]
    second = first + reply + [rng.randrange(3, 990) for _ in range(11)]
    got, (hit,) = _gen(cached, [second])
    assert hit == 64
    assert got == _gen(plain, [second])[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("fixture", ["tiny_bamba_dir", "tiny_qwen3_next_dir"])
def test_a_chat_turn_resumes_after_the_last_turns_reply(fixture, async_scheduling, request):
    """Turn 1's reply passes the decode save point at 128 (70 prompt tokens and 59 of its
    60 reply tokens are computed; saves every 64 tokens): turn 2 resumes from the state
    saved at 128, past the prompt's 64, and decodes as the engine without caching does.
    With async scheduling the save at 128 is planned before token 127's value is known on
    the host."""
    model = request.getfixturevalue(fixture)
    cached, plain = _llms(model, async_scheduling=async_scheduling)
    long_reply = SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60)
    rng = random.Random(4)
    first = [rng.randrange(3, 990) for _ in range(70)]
    (out,) = cached.generate([{"prompt_token_ids": first}], long_reply, use_tqdm=False)
    reply = out.outputs[0].token_ids
    (want,) = plain.generate([{"prompt_token_ids": first}], long_reply, use_tqdm=False)
    assert reply == want.outputs[0].token_ids
    second = first + reply + [rng.randrange(3, 990) for _ in range(11)]
    # Logprobs too: a state one token off can leave a tiny model's greedy tokens alone.
    scored = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=1)
    (got,), (want,) = (
        llm.generate([{"prompt_token_ids": second}], scored, use_tqdm=False)
        for llm in (cached, plain)
    )
    assert got.num_cached_tokens == 128
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    lp = [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
          for o in (got, want)]  # fmt: skip
    assert torch.allclose(torch.tensor(lp[0]), torch.tensor(lp[1]), atol=1e-4), lp
    # Turn 1's prompt end (64) and reply save (128) are published; turn 2's prompt ends at
    # 128 + 13, whose boundary is saved already; no unit stays taken.
    snaps = cached.engine.kv.snapshots
    assert len(snaps) == 2 and not snaps._taken


def test_a_decode_save_reaches_no_further_than_the_known_tokens():
    """The request's last save (at 64: every 64 tokens) is at a boundary whose tokens are
    not all known (async scheduling planned it past the last sampled value): its unit goes
    back unpublished. One more known token, and it is published under block 16's hash."""
    from pdserve.runner.kv_cache_manager import KVCacheManager
    from pdserve.runner.request import Request

    kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=True,
                        num_state_units=2, num_snapshot_units=2)  # fmt: skip
    assert kv.decode_save_stride == 64
    for outputs, published in ((57, False), (58, True)):
        req = Request(f"r{outputs}", list(range(3, 9)), GREEDY, seed=0)  # boundary 4
        assert kv.allocate_slots(req, 64) is not None
        req.num_computed_tokens = 64  # 6 prompt tokens and 58 outputs scheduled
        for t in range(outputs):
            req.append_output_token(11 + t)
        kv.scheduled(req)
        kv.take_state_copies()
        assert kv.take_state_copies() == [(0, 2)]  # due a step after it was planned
        kv.free(req)
        assert not kv.snapshots._taken
        assert len(kv.snapshots) == published
    assert kv.snapshots.lookup(kv.block_hashes(req)[15]) == 2


def test_many_prompts_share_prefixes_in_one_batch(tiny_bamba_dir):
    """Prompts of one 48-token system prefix plus their own questions, twice: the second
    round hits each prompt's own boundary, and the tokens of both rounds equal the engine
    without caching (async scheduling: saves reserved a step before they are copied)."""
    cached, plain = _llms(tiny_bamba_dir, async_scheduling=True)
    rng = random.Random(2)
    system = [rng.randrange(3, 990) for _ in range(48)]
    prompts = [system + [rng.randrange(3, 990) for _ in range(n)] for n in (5, 20, 37, 3)]
    want, _ = _gen(plain, prompts)
    first, _ = _gen(cached, prompts)
    assert first == want
    again, hits = _gen(cached, prompts)
    assert again == want
    assert hits == [len(p) // 16 * 16 - (16 if len(p) % 16 == 0 else 0) for p in prompts]


def test_an_evicted_snapshot_is_not_restored(tiny_bamba_dir):
    """One snapshot unit (max_num_seqs 2): the second prompt's save evicts the first's, so
    extending the first prompt hits nothing and still decodes correctly; extending the
    second hits its boundary."""
    cached, plain = _llms(tiny_bamba_dir, max_num_seqs=2)
    assert cached.engine.kv.snapshots.num_units == 1
    rng = random.Random(3)
    a, b = ([rng.randrange(3, 990) for _ in range(40)] for _ in range(2))
    _gen(cached, [a])
    _gen(cached, [b])
    extend = [rng.randrange(3, 990) for _ in range(9)]
    for prompt, hit in ((b + extend, 32), (a + extend, 0)):  # one at a time: each one's
        got, hits = _gen(cached, [prompt])  # own save would evict the other's snapshot
        assert hits == [hit]
        assert got == _gen(plain, [prompt])[0]


def test_snapshot_units_are_reused_least_recently_used_first():
    from pdserve.runner.state_snapshots import StateSnapshots

    snaps = StateSnapshots(first_unit=8, num_units=2)
    assert (snaps.reserve(101), snaps.reserve(102)) == (8, 9)
    assert snaps.reserve(101) is None  # saved already (and now the most recent use)
    assert snaps.reserve(103) == 9  # 102 was the least recently used
    assert (snaps.lookup(102), snaps.lookup(101), snaps.lookup(103)) == (None, 8, 9)
    assert snaps.reserve(104) == 8  # 101's lookup came before 103's
    snaps.clear()
    assert len(snaps) == 0 and snaps.reserve(105) == 8
    # A decoding request's unit: out of the lookups until published, then like any other.
    taken = snaps.take()  # the free one
    second = snaps.take()  # 105's: the least recently used snapshot
    assert (taken, second, snaps.lookup(105)) == (9, 8, None)
    assert snaps.reserve(106) is None  # every unit is taken by a decoding request
    snaps.clear()  # taken units stay their requests'
    snaps.give_back(second)
    assert snaps.reserve(107) == 8 and snaps.lookup(107) == 8
    snaps.publish(108, taken)
    assert snaps.lookup(108) == 9 and len(snaps) == 2
    again = snaps.take()  # evicts 107, the least recently used
    snaps.publish(108, again)  # 108 is saved already: the unit is free again
    assert snaps.lookup(107) is None and snaps.reserve(109) == again == 8


class SnapshotUnitsMachine(RuleBasedStateMachine):
    """StateSnapshots under any order of saves, decode units taken, published and given
    back, lookups and clears: every unit is free, taken by one decoding request or holding
    one snapshot, never two of these; a lookup finds only a published hash."""

    def __init__(self) -> None:
        super().__init__()
        from pdserve.runner.state_snapshots import StateSnapshots

        self.snaps = StateSnapshots(first_unit=5, num_units=3)
        self.taken: list[int] = []

    @rule(h=st.integers(0, 6))
    def reserve(self, h: int) -> None:
        unit = self.snaps.reserve(h)
        assert unit is None or self.snaps.lookup(h) == unit

    @rule()
    def take(self) -> None:
        unit = self.snaps.take()
        if unit is not None:
            assert unit not in self.taken
            self.taken.append(unit)

    @precondition(lambda self: self.taken)
    @rule(h=st.integers(0, 6), i=st.integers(0, 2), publish=st.booleans())
    def end(self, h: int, i: int, publish: bool) -> None:
        unit = self.taken.pop(i % len(self.taken))
        if publish:
            before = self.snaps.lookup(h)
            self.snaps.publish(h, unit)
            assert self.snaps.lookup(h) == (unit if before is None else before)
        else:
            self.snaps.give_back(unit)

    @rule()
    def clear(self) -> None:
        self.snaps.clear()

    @invariant()
    def units_are_partitioned(self) -> None:
        published = list(self.snaps._by_hash.values())
        free = list(self.snaps._free)
        everything = published + free + self.taken
        assert sorted(everything) == [5, 6, 7], (published, free, self.taken)
        assert set(self.taken) == self.snaps._taken


SnapshotUnitsMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                                  deadline=None)  # fmt: skip
test_snapshot_units_stay_partitioned = SnapshotUnitsMachine.TestCase


def test_a_reset_refused_while_busy_keeps_the_snapshots():
    """Guards the reset's order: while a request holds blocks, `reset_prefix_cache` is
    refused and changes nothing, its state snapshots included (they were dropped before
    the refusal, leaving cached blocks no prefix hit could reach); once idle it forgets
    both."""
    from pdserve.runner.kv_cache_manager import KVCacheManager
    from pdserve.runner.request import Request

    kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=True,
                        num_state_units=2, num_snapshot_units=2)  # fmt: skip
    req = Request("r", list(range(3, 9)), GREEDY, seed=0)
    assert kv.allocate_slots(req, 64) is not None
    req.num_computed_tokens = 64
    for t in range(58):
        req.append_output_token(11 + t)
    kv.scheduled(req)
    kv.take_state_copies()
    kv.take_state_copies()
    kv.cache_blocks(req, 64)
    kv.free(req)
    assert len(kv.snapshots) == 1
    busy = Request("b", list(range(3, 9)), GREEDY, seed=0)
    assert kv.allocate_slots(busy, 6) is not None
    assert not kv.reset_prefix_cache()
    assert len(kv.snapshots) == 1 and list(kv.block_pool.cached_blocks())
    kv.free(busy)
    assert kv.reset_prefix_cache()
    assert len(kv.snapshots) == 0 and not list(kv.block_pool.cached_blocks())
