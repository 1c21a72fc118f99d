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
from conftest import DEVICE

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
