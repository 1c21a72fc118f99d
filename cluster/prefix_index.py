"""The router's view of which prompt prefixes each worker has cached (DESIGN §2).

Keyed by the same chain hash of full token blocks the KV cache and the tier use. It is
what the router sent each worker recently, not what the worker still holds (a worker may
have evicted a block since): a stale hit costs a local prefill that finds less in the
cache than hoped, never a wrong token. Each worker's entry is an LRU bounded in blocks.

For a hybrid Mamba model (`state_points`), a hit reaches only as far as the last block
after which the worker saved a recurrent state (runner/state_snapshots.py): the end of a
prompt it computed, the last save point a reply it decoded passed. So each block
remembered also says whether a state ends there, and a hit stops at the last that does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.runner.block_hash import extend_block_hashes
from pdserve.runner.state_snapshots import decode_save_stride


class PrefixIndex:
    def __init__(
        self,
        block_size: int,
        max_blocks_per_worker: int = 1 << 16,
        enabled: bool = True,
        state_points: bool = False,
    ) -> None:
        """`enabled=False`: the workers cache no prefixes (`--no-enable-prefix-caching`), so
        nothing is remembered and no worker has a hit. `state_points`: a hybrid's hits
        (module docstring)."""
        self.block_size = block_size
        self.max_blocks = max_blocks_per_worker
        self.enabled = enabled
        self.state_points = state_points
        # block hash -> whether a saved state ends there (state_points only), oldest first
        self._by_worker: dict[str, OrderedDict[int, bool]] = {}

    def hashes(
        self, prompt: Sequence[int], salt: str | None = None, adapter: str | None = None
    ) -> list[int]:
        """The prompt's block hashes under the request's `cache_salt` and LoRA adapter, as
        its workers' KV cache managers compute them (a salted prompt never matches an
        unsalted one, nor one under an adapter the base model's)."""
        out: list[int] = []
        extend_block_hashes(out, prompt, self.block_size, salt, adapter)
        return out

    def extended(
        self,
        hashes: list[int],
        tokens: Sequence[int],
        salt: str | None = None,
        adapter: str | None = None,
    ) -> list[int]:
        """The hashes of `tokens` (which start with the tokens `hashes` cover), hashing
        only the blocks past them: a reply's, after its prompt's."""
        out = list(hashes)
        extend_block_hashes(out, tokens, self.block_size, salt, adapter)
        return out

    def hit_tokens(self, worker_id: str, hashes: list[int]) -> int:
        """Leading prompt tokens the worker probably has cached."""
        seen = self._by_worker.get(worker_id)
        if not seen:
            return 0
        reached = 0
        for n, h in enumerate(hashes, 1):
            point = seen.get(h)
            if point is None:
                break
            if point or not self.state_points:
                reached = n
        return reached * self.block_size

    def remember(self, worker_id: str, hashes: list[int], state: bool = True) -> None:
        """The worker holds these blocks; `state` (state_points only): and a state saved
        after the last of them."""
        if not self.enabled:
            return
        seen = self._by_worker.setdefault(worker_id, OrderedDict())
        for h in hashes:
            seen[h] = seen.get(h, False)
            seen.move_to_end(h)
        if state and hashes:
            seen[hashes[-1]] = True
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def remember_reply(self, worker_id: str, hashes: list[int], num_prompt_blocks: int) -> None:
        """A sequence the worker decoded (`hashes` over its prompt and reply): a hybrid saved
        its state at the last multiple of `decode_save_stride` past the prompt's blocks."""
        self.remember(worker_id, hashes, state=False)
        if self.state_points:
            per_save = decode_save_stride(self.block_size) // self.block_size
            saved = len(hashes) // per_save * per_save
            if saved > num_prompt_blocks:
                self.remember(worker_id, hashes[:saved])

    def forget(self, worker_id: str) -> None:
        """A restarted worker starts with an empty cache."""
        self._by_worker.pop(worker_id, None)
