"""`KVCacheManager`: which KV blocks each request holds, with prefix caching.

The scheduler's only view of KV memory. Per request it keeps the list of block ids
that back tokens [0, len(blocks) * block_size); block i holds tokens
[i * block_size, (i + 1) * block_size). Lifecycle of one scheduling step:

    blocks, n = get_computed_blocks(req)          # only while num_computed_tokens == 0
    new = allocate_slots(req, k, blocks, n)       # None: not enough memory, nothing changed
    ... the runner computes k tokens ...
    cache_blocks(req, req.num_computed_tokens)    # publish blocks that are now full
    free(req)                                     # finish, abort or preempt

A hybrid Mamba model's manager also hands each request a state unit (runner/state_pool.py)
with its first blocks, and takes it back with them: `state_unit`, `detach`, `release`.
With prefix caching it keeps state snapshots at block boundaries (runner/state_snapshots.py):
a prefix hit reaches only as far as the last block with a snapshot, `snapshot_cut` ends a
prompt chunk at the prompt's last block boundary, `scheduled` reserves a snapshot for a
request that reached it (or, decoding, saves into the request's own unit at each block
boundary it crosses, published by `free`), and `take_state_copies` hands the runner each
step's unit copies (last step's saves, then this step's restores).

This module does not know about the GPU tensors the block ids index, the scheduler's
policy (who gets memory, who is preempted) or how KV is transferred; it is bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.runner.block_hash import extend_block_hashes
from pdserve.runner.block_pool import BlockPool
from pdserve.runner.request import Request
from pdserve.runner.state_pool import StatePool
from pdserve.runner.state_snapshots import StateSnapshots, decode_save_stride


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_state_units: int = 0,
        num_snapshot_units: int = 0,
    ) -> None:
        """`num_state_units` > 0: a hybrid Mamba model's state units; with prefix caching,
        `num_snapshot_units` more after them hold snapshots (module docstring)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[int]] = {}
        self.state_pool = StatePool(num_state_units) if num_state_units else None
        self._req_unit: dict[str, int] = {}
        self.snapshots = (
            StateSnapshots(num_state_units, num_snapshot_units)
            if num_state_units and num_snapshot_units and enable_prefix_caching
            else None
        )
        self._restore_from: dict[str, int] = {}  # request -> the snapshot its hit reached
        self._saves: list[tuple[int, int]] = []  # (request unit, snapshot unit), this step
        self._saves_due: list[tuple[int, int]] = []  # last step's: copied before this one
        self._restores: list[tuple[int, int]] = []  # (snapshot unit, request unit)
        # request -> (its taken snapshot unit, the boundary its last decode save is at)
        self._decode_saves: dict[str, tuple[int, int]] = {}
        self.decode_save_stride = decode_save_stride(block_size)
        # How many leading blocks of each request were already offered to the cache, so
        # cache_blocks does work only for blocks completed since its last call.
        self._num_cached_blocks: dict[str, int] = {}
        # Token counts, vLLM's meaning: queries = tokens looked up, hits = tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def state_unit(self, request_id: str) -> int | None:
        """The request's state unit (None: the model has none, or it holds no blocks)."""
        return self._req_unit.get(request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block list ([] for a request holding none)."""
        return list(self._req_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (and a hybrid's state snapshots); refused (False),
        changing nothing, while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.snapshots is not None:
            self.snapshots.clear()
        return True

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks covering the longest hit prefix, and how many tokens they cover.

        The blocks are not referenced yet: pass them to `allocate_slots` before anything
        else allocates, or they may be evicted. The last token is never a hit (at most
        (num_tokens - 1) // block_size blocks): it must be computed to produce logits.
        """
        if not self.enable_prefix_caching or (
            self.state_pool is not None and self.snapshots is None
        ):
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[int] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.block_pool.lookup(block_hash)
            if block_id is None:
                break
            hit_blocks.append(block_id)
        if self.snapshots is not None:  # a hybrid: only as far as a saved state reaches
            self._restore_from.pop(request.request_id, None)
            while hit_blocks:
                unit = self.snapshots.lookup(request.block_hashes[len(hit_blocks) - 1])
                if unit is not None:
                    self._restore_from[request.request_id] = unit
                    break
                hit_blocks.pop()
        num_hit_tokens = len(hit_blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hit_blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's blocks to cover computed + new computed + new tokens.

        Returns the block ids appended in this call (`new_computed_blocks` first, then
        fresh ones), or None, with no state changed, when too few blocks are free.
        """
        assert num_new_tokens >= 0, f"num_new_tokens must be >= 0, got {num_new_tokens}"
        if not new_computed_blocks:
            # Decode fast path (most calls): the new tokens fit in the blocks already held.
            held = self._req_blocks.get(request.request_id)
            if held is not None and (
                request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size
            ):
                return []
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size, (
            f"{len(new_computed_blocks)} computed blocks cover "
            f"{len(new_computed_blocks) * self.block_size} tokens, not {num_new_computed_tokens}"
        )
        blocks = self._req_blocks.get(request.request_id, [])
        assert not new_computed_blocks or (not blocks and request.num_computed_tokens == 0), (
            f"request {request.request_id}: prefix hits must come before any block is held"
        )
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_held = len(blocks) + len(new_computed_blocks)
        num_to_allocate = max(0, _cdiv(num_tokens, self.block_size) - num_held)
        # A hit on a free cached block takes it out of the free queue, so it competes with
        # the fresh blocks for the same free count.
        num_revived = sum(1 for b in new_computed_blocks if self.block_pool.ref_cnt(b) == 0)
        if num_to_allocate + num_revived > self.block_pool.num_free_blocks:
            return None
        pool = self.state_pool
        if pool is not None and request.request_id not in self._req_unit:
            if pool.num_free == 0:
                return None
            self._req_unit[request.request_id] = pool.allocate()

        for i, block_id in enumerate(new_computed_blocks):
            assert self.block_pool.block_hash(block_id) == request.block_hashes[i], (
                f"computed block {block_id} no longer caches prefix block {i} of request "
                f"{request.request_id}: it was evicted after get_computed_blocks"
            )
        self.block_pool.touch(new_computed_blocks)
        new_blocks = list(new_computed_blocks) + self.block_pool.allocate(num_to_allocate)
        if new_computed_blocks:
            # Hit blocks are in the cache already: cache_blocks must not offer them again.
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
        self._req_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return new_blocks

    # ---- hybrid state snapshots (module docstring) ------------------------------------

    def restore_state(self, request: Request) -> None:
        """The request was admitted on a prefix hit (its unit is allocated): fill its unit
        from the snapshot the hit reached, before its first step."""
        src = self._restore_from.pop(request.request_id, None)
        if src is not None:
            self._restores.append((src, self._req_unit[request.request_id]))

    def snapshot_cut(self, request: Request, done: int, num_new: int) -> int:
        """`num_new` tokens from `done`, or fewer so the chunk ends at the prompt's last
        block boundary when it would cross it (its state is saved there)."""
        if self.snapshots is None:
            return num_new
        boundary = self._snapshot_boundary(request)
        return boundary - done if done < boundary < done + num_new else num_new

    def _snapshot_boundary(self, request: Request) -> int:
        """Where a prompt's state is saved: its last block boundary."""
        return request.num_prompt_tokens // self.block_size * self.block_size

    def scheduled(self, request: Request) -> None:
        """The request's computed tokens (scheduled ones included) were just advanced:
        reaching its prompt's last block boundary, its state there is saved before the
        next step; reaching a multiple of `decode_save_stride` past it (decoding), into
        the request's own snapshot unit, which `free` publishes."""
        if self.snapshots is None:
            return
        n = request.num_computed_tokens
        if n == 0 or n % self.block_size:
            return
        boundary = self._snapshot_boundary(request)
        if n == boundary:
            unit = self.snapshots.reserve(self.block_hashes(request)[n // self.block_size - 1])
        elif n > boundary and n % self.decode_save_stride == 0:
            # the hash waits for `free`: the last tokens may be in flight
            rid = request.request_id
            saved = self._decode_saves.get(rid)
            unit = saved[0] if saved is not None else self.snapshots.take()
            if unit is not None:
                self._decode_saves[rid] = (unit, n)
        else:
            return
        if unit is not None:
            self._saves.append((self._req_unit[request.request_id], unit))

    def _end_decode_saves(self, request: Request) -> None:
        """Publish the state the request saved at its last block boundary, under that
        block's hash, if its tokens are known that far (not, e.g., past a token that
        async scheduling still has in flight); else give its unit back."""
        saved = self._decode_saves.pop(request.request_id, None)
        if saved is None:
            return
        unit, n = saved
        if n <= request.num_tokens:
            self.snapshots.publish(self.block_hashes(request)[n // self.block_size - 1], unit)
        else:
            self.snapshots.give_back(unit)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """This step's (source unit, target unit) copies, in order: the saves reserved a
        step ago (those requests' states are at their boundary now), then the restores
        for this step's admissions. Call once per step, after scheduling it."""
        copies = self._saves_due + self._restores
        self._saves_due, self._saves, self._restores = self._saves, [], []
        return copies

    def num_cached_blocks(self, request_id: str) -> int:
        """How many of the request's leading blocks are in the prefix cache (hit, or
        published by `cache_blocks`)."""
        return self._num_cached_blocks.get(request_id, 0)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish every full block of the request whose tokens are all computed and known.

        Called after the runner has written KV for tokens [0, num_computed_tokens).
        Incremental: blocks offered by an earlier call are skipped.
        """
        if not self.enable_prefix_caching:
            return
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_computed_tokens < (num_cached + 1) * self.block_size:
            # The common decode step (15 in 16 at block_size 16): no block completed. Tested
            # first and cheaply: this runs for every running request every step.
            return
        # Tokens scheduled speculatively past the known ones have no ids to hash yet.
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= num_cached:
            return
        blocks = self._req_blocks.get(request.request_id, [])
        assert num_full <= len(blocks), (
            f"request {request.request_id}: {num_full} blocks computed but only "
            f"{len(blocks)} allocated"
        )
        self._update_block_hashes(request)
        for i in range(num_cached, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, and its state unit, and forget
        the request."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._restore_from.pop(request.request_id, None)
        self._end_decode_saves(request)
        if blocks is not None:
            self.block_pool.free(reversed(blocks))
        unit = self._req_unit.pop(request.request_id, None)
        if unit is not None:
            self.state_pool.free(unit)

    def detach(self, request: Request) -> tuple[list[int], int | None]:
        """Forget the request but keep its blocks referenced and its state unit taken
        (prefill role: they back a transfer lease); hand them back later with `release`."""
        self._num_cached_blocks.pop(request.request_id, None)
        self._restore_from.pop(request.request_id, None)
        self._end_decode_saves(request)
        unit = self._req_unit.pop(request.request_id, None)
        return self._req_blocks.pop(request.request_id, []), unit

    def release(self, block_ids: Sequence[int], state_unit: int | None = None) -> None:
        """Drop the references `detach` kept, last block first (like `free`)."""
        self.block_pool.free(reversed(block_ids))
        if state_unit is not None:
            self.state_pool.free(state_unit)

    def block_hashes(self, request: Request) -> list[int]:
        """Chain hashes of the request's full blocks (computed now if missing)."""
        self._update_block_hashes(request)
        return request.block_hashes

    def _update_block_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(
                request.block_hashes,
                request.all_token_ids,
                self.block_size,
                request.params.cache_salt,
                request.lora_name,
            )
