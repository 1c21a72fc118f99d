"""`BlockPool`: reference counts, the free queue and the prefix-cache map of KV blocks.

A block is in exactly one of two states: referenced (ref_cnt > 0, held by one or more
requests) or free (ref_cnt == 0, in the free queue). Orthogonally a block may be
*cached*: it carries the chain hash of the tokens it holds and `hash -> block` maps to
it. A free cached block keeps its KV and can be revived by `touch` (a prefix hit) until
`allocate` hands it out again, which is the eviction.

Eviction order is the free queue's order, oldest first. Freed blocks without a hash go
to the *head*: their contents can never be hit, so reusing them first keeps every cached
block alive a little longer at no cost. Freed cached blocks go to the tail in the order
given, which makes the queue LRU over cached blocks.

Block 0 is the null block: rows of block tables past a request's length point at it, so
it is never allocated, freed, cached or counted.

This module does not know about requests, tokens or how hashes are computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

NULL_BLOCK_ID = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        # Keys only (values unused): O(1) pop from the head, removal from the middle on a
        # prefix hit, and append/prepend on free.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # A block has a hash iff this map points at it: cache_block and allocate keep both
        # sides in step.
        self._cached: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable (non-null) blocks held by at least one request."""
        num_usable = self.num_blocks - 1
        return (num_usable - len(self._free)) / num_usable

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hash[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next to be allocated first)."""
        return list(self._free)

    def cached_blocks(self) -> Iterator[tuple[int, int]]:
        """(hash, block_id) of every cached block, free or referenced."""
        return iter(self._cached.items())

    def allocate(self, n: int) -> list[int]:
        """Take the `n` oldest free blocks, evicting any cached content they hold."""
        assert 0 <= n <= len(self._free), f"asked for {n} blocks, only {len(self._free)} free"
        block_ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            cached_hash = self._block_hash[block_id]
            if cached_hash is not None:
                assert self._cached.get(cached_hash) == block_id, (
                    f"block {block_id} has hash {cached_hash} that the map does not point at it"
                )
                del self._cached[cached_hash]
                self._block_hash[block_id] = None
            self._ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block; a free (cached) block leaves the free queue."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK_ID, "the null block cannot be referenced"
            if self._ref_cnt[block_id] == 0:
                # Only a prefix hit revives a free block; reviving an uncached one would
                # hand out garbage KV.
                assert self._block_hash[block_id] is not None, (
                    f"touching free block {block_id} that holds no cached content"
                )
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        Callers pass a request's blocks last-first, so a prefix's tail is evicted before
        its head (the head is the part other requests are most likely to share).
        """
        for block_id in block_ids:
            assert block_id != NULL_BLOCK_ID, "the null block cannot be freed"
            assert self._ref_cnt[block_id] > 0, f"freeing block {block_id} with ref_cnt 0"
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None
                if self._block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Record that `block_id` holds the tokens hashed as `block_hash`.

        A no-op when another block already caches that hash: two requests computed the
        same prefix concurrently, and one copy in the map is enough.
        """
        assert block_id != NULL_BLOCK_ID, "the null block cannot be cached"
        assert self._ref_cnt[block_id] > 0, f"caching free block {block_id}: its KV is stale"
        current = self._block_hash[block_id]
        if current is not None:
            assert current == block_hash, (
                f"block {block_id} already caches hash {current}, not {block_hash}"
            )
            return
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced.

        While a block is in use, a request may still expect its hash to be registered
        (and a running request may be about to cache it), so only an idle pool resets.
        """
        if len(self._free) != self.num_blocks - 1:
            return False
        for block_id in self._cached.values():
            self._block_hash[block_id] = None
        self._cached.clear()
        return True
