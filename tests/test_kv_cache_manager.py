"""KV cache bookkeeping: block pool, chain hashes and the prefix-caching manager."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.runner.block_hash import extend_block_hashes, hash_block_tokens, salt_root
from pdserve.runner.block_pool import NULL_BLOCK_ID
from pdserve.runner.kv_cache_manager import KVCacheManager
from pdserve.runner.request import Request
from pdserve.runner.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(request_id, list(prompt), SamplingParams(cache_salt=salt), seed=0)


def run_prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Schedule the whole request in one chunk, as the scheduler would, and compute it."""
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    new_blocks = kv.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, num_hit)
    assert new_blocks is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return kv.get_block_ids(req.request_id)


def pool_snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.block_pool
    return (
        pool.free_block_ids(),
        [pool.ref_cnt(b) for b in range(kv.num_blocks)],
        sorted(pool.cached_blocks()),
        dict(kv._req_blocks),
        dict(kv._num_cached_blocks),
    )


def test_allocate_and_free_counts() -> None:
    """Guards against off-by-one block counts (ceil division) and blocks leaked on free."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0
    req = make_request("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert len(kv.allocate_slots(req, 9)) == 3
    assert kv.num_free_blocks == 6 and kv.usage == pytest.approx(3 / 9)
    req.num_computed_tokens = 9
    assert kv.allocate_slots(req, 3) == []  # 12 tokens still fit 3 blocks
    assert len(kv.allocate_slots(req, 4)) == 1  # 13 tokens need a 4th
    kv.free(req)
    kv.free(req)  # idempotent
    assert kv.num_free_blocks == 9 and kv.get_block_ids("a") == []


def test_state_units_come_and_go_with_the_blocks() -> None:
    """A hybrid Mamba model's state units (runner/state_pool.py): one with a request's first
    blocks, none with its later ones; a request that finds no free unit gets nothing (its
    blocks are not taken either); `detach` keeps the unit past the request, `release`
    and `free` give it back."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False,
                        num_state_units=2)  # fmt: skip
    a, b, c = (make_request(r, list(range(6))) for r in "abc")
    assert kv.allocate_slots(a, 6) is not None and kv.state_unit("a") == 0
    a.num_computed_tokens = 6
    assert len(kv.allocate_slots(a, 4)) == 1 and kv.state_unit("a") == 0
    assert kv.allocate_slots(b, 6) is not None and kv.state_unit("b") == 1
    free_blocks = kv.num_free_blocks
    assert kv.allocate_slots(c, 6) is None, "no unit left: nothing is allocated"
    assert kv.num_free_blocks == free_blocks and kv.state_unit("c") is None
    blocks, unit = kv.detach(a)
    assert unit == 0 and kv.state_unit("a") is None and kv.state_pool.num_free == 0
    assert kv.allocate_slots(c, 6) is None, "a detached unit is still taken"
    kv.release(blocks, unit)
    assert kv.allocate_slots(c, 6) is not None and kv.state_unit("c") == 0
    kv.free(b)
    kv.free(c)
    assert kv.state_pool.num_free == 2 and kv.num_free_blocks == 9
    plain = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    assert plain.allocate_slots(a, 6) is not None and plain.state_unit("a") is None


def test_null_block_never_handed_out() -> None:
    """Guards against block 0 (the pad target of block tables) being given to a request."""
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)
    req = make_request("a", list(range(16)))
    blocks = kv.allocate_slots(req, 16)
    assert sorted(blocks) == [1, 2, 3, 4] and kv.num_free_blocks == 0
    assert kv.allocate_slots(make_request("b", [1]), 1) is None
    kv.free(req)
    assert NULL_BLOCK_ID not in kv.block_pool.free_block_ids()
    with pytest.raises(AssertionError):
        kv.block_pool.free([NULL_BLOCK_ID])


def test_prefix_hit_reuses_blocks_and_counts_hits() -> None:
    """Guards against a finished request's cached blocks not being found again (or new
    copies being allocated instead), and against wrong hit/query token stats."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    first_blocks = run_prefill(kv, first)
    kv.free(first)
    second = make_request("b", list(range(8)) + [99, 98, 97])
    hit_blocks, num_hit = kv.get_computed_blocks(second)
    assert hit_blocks == first_blocks[:2] and num_hit == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    new_blocks = kv.allocate_slots(second, 3, hit_blocks, num_hit)
    assert new_blocks[:2] == first_blocks[:2] and len(new_blocks) == 3


def test_last_token_is_never_a_hit() -> None:
    """Guards against a full-prompt hit leaving no token to compute, so no logits."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(2 * BS))
    first = make_request("a", prompt)
    run_prefill(kv, first)
    kv.free(first)
    hit_blocks, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert len(hit_blocks) == 1 and num_hit == BS


def test_prefix_caching_off_never_hits() -> None:
    """Guards against the cache being consulted or filled when it is disabled."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    run_prefill(kv, first)
    kv.free(first)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert list(kv.block_pool.cached_blocks()) == []


def test_lru_evicts_oldest_cached_block_first() -> None:
    """Guards against evicting a recently freed prefix while an older one is still cached."""
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    old, new = make_request("old", [1] * BS + [0]), make_request("new", [2] * BS + [0])
    old_block = run_prefill(kv, old)[0]
    kv.free(old)
    run_prefill(kv, new)
    kv.free(new)
    kv.allocate_slots(make_request("c", [3]), 1)  # takes one block: must evict "old"
    assert kv.get_computed_blocks(make_request("x", [1] * BS + [0])) == ([], 0)
    assert kv.get_computed_blocks(make_request("y", [2] * BS + [0]))[1] == BS
    assert kv.block_pool.block_hash(old_block) is None


def test_prefix_tail_evicted_before_head() -> None:
    """Guards against freeing blocks head-first, which evicts the shared head of a prefix
    and makes the still-cached tail unreachable (hits stop at the first miss)."""
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    req = make_request("a", list(range(3 * BS)))
    blocks = run_prefill(kv, req)
    kv.free(req)
    assert kv.block_pool.free_block_ids() == blocks[::-1]
    kv.allocate_slots(make_request("c", [7]), 1)
    hit_blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(3 * BS))))
    assert hit_blocks == blocks[:2] and num_hit == 2 * BS


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    """Guards against evicting a cached prefix while a block with nothing to hit is free."""
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    cached = make_request("a", list(range(BS + 1)))
    run_prefill(kv, cached)
    kv.free(cached)
    partial = make_request("b", [9])  # its only block is partial: never cached
    partial_block = run_prefill(kv, partial)[0]
    kv.free(partial)
    assert kv.allocate_slots(make_request("c", [5]), 1) == [partial_block]


def test_failed_allocate_changes_nothing() -> None:
    """Guards against a partial allocation (or touched hit blocks) left behind when
    allocate_slots returns None, and against not counting free hit blocks as consumed."""
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)
    first = make_request("a", list(range(2 * BS + 1)))
    run_prefill(kv, first)
    kv.free(first)  # 4 blocks free: 2 cached full ones, 1 partial, 1 never used
    second = make_request("b", list(range(2 * BS)) + [50] * (2 * BS))
    hit_blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 2 * BS and kv.num_free_blocks == 4
    # 4 blocks needed: the 2 free hit blocks + 2 fresh = 4 free -> fits; 3 fresh does not.
    before = pool_snapshot(kv)
    assert kv.allocate_slots(second, 2 * BS + 1, hit_blocks, num_hit) is None
    assert pool_snapshot(kv) == before
    assert len(kv.allocate_slots(second, 2 * BS, hit_blocks, num_hit)) == 4


def test_shared_prefix_blocks_have_ref_cnt_two() -> None:
    """Guards against a shared block being freed (and reused) while a sharer still runs."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(2 * BS + 1)))
    a_blocks = run_prefill(kv, a)
    b = make_request("b", list(range(2 * BS)) + [77])
    b_blocks = run_prefill(kv, b)
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    assert [kv.block_pool.ref_cnt(x) for x in a_blocks] == [2, 2, 1]
    kv.free(a)
    assert [kv.block_pool.ref_cnt(x) for x in b_blocks] == [1, 1, 1]
    assert not set(b_blocks) & set(kv.block_pool.free_block_ids())


def test_reset_prefix_cache_only_when_idle() -> None:
    """Guards against dropping hashes of blocks a running request still relies on."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    req = make_request("a", list(range(BS + 1)))
    run_prefill(kv, req)
    assert not kv.reset_prefix_cache()
    kv.free(req)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(BS + 1)))) == ([], 0)


HASH_1234 = 658132497017838498  # blake2b-64(0 as 8 LE bytes ++ int32 LE 1, 2, 3, 4), LE


def test_hash_is_fixed_and_process_independent() -> None:
    """Guards against a salted or platform-dependent hash: the router, the workers and
    the KV tier must agree on block hashes across processes and machines."""
    assert hash_block_tokens(None, [1, 2, 3, 4]) == HASH_1234
    assert hash_block_tokens(HASH_1234, [5, 6, 7, 8]) == 7641984106258271874
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(1, [1, 2, 3, 4])
    code = (
        "from pdserve.runner.block_hash import hash_block_tokens as h;"
        "print(h(None, [1, 2, 3, 4]), h(None, (100000, 0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    ).stdout.split()
    assert out == [str(HASH_1234), str(hash_block_tokens(None, [100000, 0]))]


def test_extend_block_hashes_is_incremental() -> None:
    """Guards against rehashing already-hashed blocks (quadratic decode cost) and against
    hashing a trailing partial block."""
    tokens = list(range(11))
    full: list[int] = []
    extend_block_hashes(full, tokens, BS)
    assert len(full) == 2 and full[1] == hash_block_tokens(full[0], tokens[4:8])
    sentinel = [12345]  # a fake block-0 hash: must be kept and used as the parent
    extend_block_hashes(sentinel, tokens, BS)
    assert sentinel == [12345, hash_block_tokens(12345, tokens[4:8])]


# blake2b-64(b"pdserve.cache_salt.v1\0" ++ UTF-8 "tenant-a"), LE: block 0's parent under it.
ROOT_TENANT_A = 14758683799293028993


def test_unsalted_chains_hash_as_before_salts() -> None:
    """Guards the wire format: the router's index, the workers and the KV tier of a fleet
    mid-upgrade share hashes, so an unsalted request's chain must stay bit-identical to
    the one from before cache_salt existed (the pinned values)."""
    assert salt_root(None) is None
    hashes: list[int] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert hashes == [HASH_1234, 7641984106258271874]
    unsalted: list[int] = []
    extend_block_hashes(unsalted, [1, 2, 3, 4, 5, 6, 7, 8], BS, None)
    assert unsalted == hashes


def test_a_salt_moves_every_block_of_the_chain() -> None:
    """Guards tenant isolation (vLLM's cache_salt): salted and unsalted chains, and chains
    under two salts, share no block hash, not even the later blocks; equal salts agree
    (in any process: the salt's hash is pinned)."""
    assert salt_root("tenant-a") == ROOT_TENANT_A
    assert hash_block_tokens(ROOT_TENANT_A, [1, 2, 3, 4]) == 3743580026118566204
    tokens = list(range(3, 3 + 5 * BS))
    chains = {}
    for salt in (None, "tenant-a", "tenant-b", "tenant-a ", "é"):
        chains[salt] = []
        extend_block_hashes(chains[salt], tokens, BS, salt)
        assert len(chains[salt]) == 5
    all_hashes = [h for chain in chains.values() for h in chain]
    assert len(set(all_hashes)) == len(all_hashes), "two chains share a block hash"
    again: list[int] = []
    extend_block_hashes(again, tokens, BS, "tenant-a")
    assert again == chains["tenant-a"]
    # Incremental extension of a salted chain keeps it: later blocks chain from block 0.
    grown = chains["tenant-a"][:2]
    extend_block_hashes(grown, tokens, BS, "tenant-a")
    assert grown == chains["tenant-a"]


def test_a_salted_request_hits_only_blocks_of_its_own_salt() -> None:
    """Guards the KV cache manager's use of the salt: a prompt cached unsalted (or under
    another salt) is a miss for a salted request, and the same salt hits it."""
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(10, 10 + 3 * BS + 1))  # 3 full blocks, and a token to compute
    run_prefill(kv, make_request("plain", prompt))
    assert kv.get_computed_blocks(make_request("plain-again", prompt))[1] == 3 * BS
    salted = make_request("a1", prompt, "tenant-a")
    assert kv.get_computed_blocks(salted) == ([], 0)
    run_prefill(kv, salted)
    assert kv.get_computed_blocks(make_request("a2", prompt, "tenant-a"))[1] == 3 * BS
    assert kv.get_computed_blocks(make_request("b1", prompt, "tenant-b")) == ([], 0)
    # The unsalted blocks are still there, and still the unsalted request's only.
    assert kv.get_computed_blocks(make_request("plain-3", prompt))[1] == 3 * BS
    # The router's index routes by the hashes the workers cache under (DESIGN §2).
    index = PrefixIndex(BS)
    for salt in (None, "tenant-a"):
        assert index.hashes(prompt, salt) == kv.block_hashes(make_request("h", prompt, salt))
    # Workers that cache nothing (no prefix caching, a hybrid Mamba model): no hits.
    index.remember("w", index.hashes(prompt))
    assert index.hit_tokens("w", index.hashes(prompt)) == 3 * BS
    off = PrefixIndex(BS, enabled=False)
    off.remember("w", off.hashes(prompt))
    assert off.hit_tokens("w", off.hashes(prompt)) == 0


def test_a_hybrids_router_hits_stop_at_the_last_saved_state() -> None:
    """PrefixIndex(state_points=True): a hit reaches the last remembered block after which
    a state was saved, not the last remembered block; a block remembered later with a
    state gains one, and one remembered without keeps the one it had."""
    index = PrefixIndex(BS, state_points=True)
    seq = index.hashes(list(range(10, 10 + 6 * BS)))
    index.remember("w", seq[:2])  # a prompt it computed: a state after block 2
    index.remember("w", seq[:4], state=False)  # a pulled prompt's blocks
    assert index.hit_tokens("w", seq) == 2 * BS
    index.remember("w", seq[:5])  # a reply's last boundary
    assert index.hit_tokens("w", seq) == 5 * BS and index.hit_tokens("w", seq[:4]) == 2 * BS
    index.remember("w", seq[:2], state=False)
    assert index.hit_tokens("w", seq[:3]) == 2 * BS
    assert index.hit_tokens("v", seq) == 0
    # A decoded reply: its state was saved at the last multiple of 64 tokens (16 blocks
    # of 4) past the prompt's blocks, if there is one (runner/state_snapshots.py).
    turn = index.hashes(list(range(10, 10 + 21 * BS)))
    index.remember_reply("u", turn[:20], num_prompt_blocks=3)
    assert index.hit_tokens("u", turn) == 16 * BS
    index.remember_reply("t", turn[:20], num_prompt_blocks=17)
    assert index.hit_tokens("t", turn) == 0


def test_cache_blocks_skips_tokens_not_known_yet() -> None:
    """Guards against hashing a block whose last tokens are still being sampled (async
    scheduling computes positions before their token ids reach the CPU)."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    req = make_request("a", list(range(BS + 2)))
    kv.allocate_slots(req, 2 * BS)
    kv.cache_blocks(req, 2 * BS)  # 2 blocks computed, but only 6 token ids known
    assert len(list(kv.block_pool.cached_blocks())) == 1


# --- property test: random programs of the scheduler's calls ---------------------------


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


BASE_PROMPTS = ((0,) * 10, (0, 1) * 5, (1, 0, 0, 1, 1, 0, 1, 0, 0, 1))


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler and keeps a simulated KV store: slot j of
    block b holds the token prefix whose KV a real runner would have written there. A
    prefix hit must return blocks whose simulated contents equal the request's prefix."""

    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.sampled_from(range(2, 15)),
        prefix_caching=st.booleans(),
    )
    def setup(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching)
        self.waiting: list[Request] = []  # holds no blocks: new or preempted
        self.running: list[Request] = []  # holds blocks
        self.scheduled: dict[str, int] = {}  # tokens covered by computed + in-flight work
        self.content: dict[int, list[tuple[int, ...] | None]] = {}
        self.next_id = 0

    def _pick(self, reqs: list[Request], idx: int) -> Request:
        return reqs[idx % len(reqs)]

    def _schedulable(self) -> list[Request]:
        """Waiting requests and running ones with no work in flight and tokens to compute."""
        return self.waiting + [
            r
            for r in self.running
            if self.scheduled[r.request_id] == r.num_computed_tokens < r.num_tokens
        ]

    # Capping live requests leaves more steps for scheduling; prompts start with a cut of
    # one of three base prefixes so that hits (and concurrent equal prefixes) are common.
    @precondition(lambda self: len(self.waiting) + len(self.running) < 6)
    @rule(
        base=st.sampled_from(BASE_PROMPTS),
        cut=st.sampled_from(range(11)),
        suffix=st.lists(st.integers(0, 1), max_size=5),
    )
    def add(self, base: tuple[int, ...], cut: int, suffix: list[int]) -> None:
        self.waiting.append(make_request(f"r{self.next_id}", list(base[:cut]) + suffix or [0]))
        self.next_id += 1

    @precondition(lambda self: self._schedulable())
    @rule(idx=st.integers(0, 99), chunk=st.integers(1, 8))
    def schedule(self, idx: int, chunk: int) -> None:
        req = self._pick(self._schedulable(), idx)
        hit, num_hit = [], 0
        if req in self.waiting:
            hit, num_hit = self.kv.get_computed_blocks(req)
            assert num_hit < req.num_tokens, "the last token must never be a hit"
            tokens = tuple(req.all_token_ids)
            for i, block_id in enumerate(hit):
                expected = [tokens[: i * self.bs + j + 1] for j in range(self.bs)]
                assert self.content[block_id] == expected, "prefix hit served another prefix's KV"
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens - num_hit)
        before = pool_snapshot(self.kv)
        new_blocks = self.kv.allocate_slots(req, num_new, hit, num_hit)
        if new_blocks is None:
            assert pool_snapshot(self.kv) == before, "failed allocate_slots changed state"
            return
        assert new_blocks[: len(hit)] == hit
        req.num_computed_tokens += num_hit
        self.scheduled[req.request_id] = req.num_computed_tokens + num_new
        if req in self.waiting:
            self.waiting.remove(req)
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(token=st.integers(0, 1))
    def step(self, token: int) -> None:
        """One runner step: write KV for every scheduled token, publish full blocks, and
        sample a token for each request that caught up with its tokens."""
        for req in self.running:
            blocks, tokens = self.kv.get_block_ids(req.request_id), tuple(req.all_token_ids)
            for pos in range(req.num_computed_tokens, self.scheduled[req.request_id]):
                block_id = blocks[pos // self.bs]
                assert self.kv.block_pool.ref_cnt(block_id) == 1, "writing KV into a shared block"
                slots = self.content.setdefault(block_id, [None] * self.bs)
                slots[pos % self.bs] = tokens[: pos + 1]
            num_full_before = req.num_computed_tokens // self.bs
            req.num_computed_tokens = self.scheduled[req.request_id]
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if self.kv.enable_prefix_caching:
                for block_hash in req.block_hashes[
                    num_full_before : req.num_computed_tokens // self.bs
                ]:
                    assert self.kv.block_pool.lookup(block_hash) is not None, "block not cached"
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(token)

    @precondition(lambda self: self.waiting or self.running)
    @rule(idx=st.integers(0, 99))
    def finish_or_abort(self, idx: int) -> None:
        req = self._pick(self.waiting + self.running, idx)
        self.kv.free(req)  # a no-op for a waiting request, which holds no blocks
        (self.waiting if req in self.waiting else self.running).remove(req)

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 99))
    def preempt(self, idx: int) -> None:
        req = self._pick(self.running, idx)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.append(req)

    @invariant()
    def ref_counts_match_holders(self) -> None:
        pool, num_blocks = self.kv.block_pool, self.kv.num_blocks
        holders = [0] * num_blocks
        for req in self.running:
            blocks = self.kv.get_block_ids(req.request_id)
            assert len(set(blocks)) == len(blocks), f"block twice in one request: {blocks}"
            assert NULL_BLOCK_ID not in blocks
            assert len(blocks) == _cdiv(self.scheduled[req.request_id], self.bs)
            for block_id in blocks:
                holders[block_id] += 1
        for req in self.waiting:
            assert self.kv.get_block_ids(req.request_id) == []
        assert [pool.ref_cnt(b) for b in range(num_blocks)] == holders
        free = pool.free_block_ids()
        referenced = {b for b in range(num_blocks) if holders[b] > 0}
        assert len(set(free)) == len(free) and NULL_BLOCK_ID not in free
        assert not set(free) & referenced, "a block is both free and referenced"
        assert len(free) + len(referenced) == num_blocks - 1
        if not self.running:
            assert self.kv.num_free_blocks == num_blocks - 1, "blocks leaked"

    @invariant()
    def cached_hashes_match_contents(self) -> None:
        pool = self.kv.block_pool
        cached = list(pool.cached_blocks())
        assert sum(pool.block_hash(b) is not None for b in range(self.kv.num_blocks)) == len(cached)
        for block_hash, block_id in cached:
            assert pool.block_hash(block_id) == block_hash
            slots = self.content[block_id]
            prefix = slots[-1]
            assert prefix is not None and len(prefix) % self.bs == 0
            assert slots == [prefix[: len(prefix) - self.bs + j + 1] for j in range(self.bs)]
            hashes: list[int] = []
            extend_block_hashes(hashes, prefix, self.bs)
            assert hashes[-1] == block_hash, "cached hash does not describe the block's KV"


KVCacheMachine.TestCase.settings = settings(max_examples=600, stateful_step_count=50, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
