"""Prompts sharing a prefix that is being computed wait for it instead of computing it
again.

A request's `n` choices (and RL rollouts, which send one prompt many times) arrive
together; admitted in the same step, each would compute the whole shared prompt, since a
block enters the prefix cache only once its step has run. Here a waiting prompt whose
leading blocks are those of a prompt admitted but not yet in the cache waits (a step, or
the few steps a chunked prompt takes) and then hits them: n copies cost one prompt and
n small tails. On a decode worker the same holds for loads: n tickets for one prompt
(the n choices of a remotely prefilled request) pull it once; the others wait for that
load to be cached and pull only what they do not hit, the last block. It waits only when that saves at least half its tokens, so a short shared
system prompt never holds back a long request; requests behind it in the queue are not
held back (they are admitted past it in this step). The scheduler asks, at each step:

    in_flight = prompts.hashes()                 # blocks of prompts not yet cached
    prompts.should_wait(req, in_flight)          # for each waiting request
    prompts.admitted(req, in_flight)             # for each admitted one
"""

from __future__ import annotations

from pdserve.runner.kv_cache_manager import KVCacheManager
from pdserve.runner.request import Request, RequestStatus


class PromptsInFlight:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._prompts: dict[str, Request] = {}  # admitted, their prompt blocks not all cached

    def __len__(self) -> int:
        return len(self._prompts)

    def hashes(self) -> set[int]:
        """Chain hashes of the full prompt blocks of prompts still being computed or loaded
        (or whose step or load has ended but whose blocks are not cached yet); forgets
        the rest (cached, finished, preempted, or a failed load starting over)."""
        out: set[int] = set()
        for rid, req in list(self._prompts.items()):
            num_full = req.num_prompt_tokens // self.kv.block_size
            if not _filling(req) or self.kv.num_cached_blocks(rid) >= num_full:
                del self._prompts[rid]
                continue
            out.update(self.kv.block_hashes(req)[:num_full])
        return out

    def should_wait(self, req: Request, in_flight: set[int]) -> bool:
        """Whether `req`'s leading blocks not yet cached are being computed for another
        prompt, and are at least half its tokens."""
        if not in_flight:
            return False
        size = self.kv.block_size
        hashes = self.kv.block_hashes(req)[: (req.num_tokens - 1) // size]
        shared = 0
        for h in hashes:
            if h not in in_flight:
                break
            shared += 1
        if not shared:
            return False
        cached = 0
        for h in hashes[:shared]:
            if self.kv.block_pool.lookup(h) is None:
                break
            cached += 1
        return (shared - cached) * size >= max(size, req.num_tokens // 2)

    def admitted(self, req: Request, in_flight: set[int]) -> None:
        """`req` was admitted in this step, to compute its prompt or (decode role) to load
        it: its prompt's blocks are in flight until cached."""
        if not self.kv.enable_prefix_caching:
            return
        num_full = req.num_prompt_tokens // self.kv.block_size
        if num_full > self.kv.num_cached_blocks(req.request_id):
            self._prompts[req.request_id] = req
            in_flight.update(self.kv.block_hashes(req)[:num_full])


def _filling(req: Request) -> bool:
    """Running, loading, or loaded and waiting for its first step (a load that failed
    starts over from no computed token)."""
    status = req.status
    return (
        status is RequestStatus.RUNNING
        or status is RequestStatus.WAITING_FOR_KV
        or (status is RequestStatus.WAITING and req.num_computed_tokens > 0)
    )
