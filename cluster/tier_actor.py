"""The KV tier as a Ray actor, and the client workers use in place of a local tier.

Blocks cross the actor boundary as one bytes blob plus a small spec of shapes and dtypes
(msgpack-able values; never pickled tensors). `TierClient` has the `HostKVTier` methods
the prefill worker (write-behind `put`) and the decode loader (`lookup`, `get`) call, with
a timeout on every call. A tier that is down costs a logged miss, never a failed request.
"""

from __future__ import annotations

import logging
import math

import ray
import torch

from pdserve.kvtransfer.layout import DTYPES
from pdserve.kvtransfer.tier import Block, HostKVTier

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0


def blocks_to_wire(blocks: list[Block]) -> tuple[bytes, list]:
    """(all bytes, [(shape, dtype) per tensor]) for blocks of equal shapes."""
    if not blocks:
        return b"", []
    spec = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in blocks[0]]
    parts = [t.contiguous().view(torch.uint8).reshape(-1) for b in blocks for t in b]
    return torch.cat(parts).numpy().tobytes(), spec


def blocks_from_wire(blob: bytes, spec: list, n: int) -> list[Block]:
    sizes = [math.prod(shape) * DTYPES[dtype].itemsize for shape, dtype in spec]
    if len(blob) != n * sum(sizes):
        raise ValueError(f"tier blob holds {len(blob)} bytes, {n} blocks need {n * sum(sizes)}")
    raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out, off = [], 0
    for _ in range(n):
        block = []
        for (shape, dtype), size in zip(spec, sizes):
            block.append(raw[off : off + size].view(DTYPES[dtype]).view(shape))
            off += size
        out.append(tuple(block))
    return out


class TierService:
    """What the tier actor runs: a HostKVTier behind bytes-in, bytes-out methods."""

    def __init__(self, byte_budget: int, spill_dir: str | None = None, spill_budget: int = 0):
        self.tier = HostKVTier(byte_budget, spill_dir, spill_budget)

    def put(self, layout_hash: str, block_hashes: list[int], blob: bytes, spec: list) -> int:
        return self.tier.put(
            layout_hash, block_hashes, blocks_from_wire(blob, spec, len(block_hashes))
        )

    def lookup(self, layout_hash: str, block_hashes: list[int]) -> int:
        return self.tier.lookup(layout_hash, block_hashes)

    def get(self, layout_hash: str, block_hashes: list[int]) -> tuple[bytes, list]:
        return blocks_to_wire(self.tier.get(layout_hash, block_hashes))

    def stats(self) -> dict:
        return self.tier.stats()


class TierClient:
    """Write-behind puts do not wait: at most MAX_PENDING_PUTS and `max_pending_bytes` are
    in flight, more are dropped (counted), and finished ones are reaped on the next call.

    The byte cap keeps the prefill worker serving. A put costs its worker a device-to-host
    copy and the serialization of every byte, under the GIL, on the step loop: on 2 H200s,
    long prompts (2,048-8,192 tokens, 0.23-0.94 GB of Qwen3-0.6B KV each) at 2 req/s with
    no cap starved the actor's event loop until its health checks timed out and the
    controller restarted it (benchmarks/pd_vs_colocated.py, c615c22). Callers ask `admits`
    before packing anything."""

    MAX_PENDING_PUTS = 8
    MAX_PENDING_BYTES = 256 << 20

    def __init__(self, actor, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.actor = actor
        self.max_pending_bytes = max_pending_bytes
        self._pending: list = []
        self._pending_bytes: dict = {}  # ref -> bytes it carries
        self.dropped_puts = 0
        self.failed_puts = 0

    def _call(self, ref):
        return ray.get(ref, timeout=CALL_TIMEOUT_S)

    def _reap(self) -> None:
        if not self._pending:
            return
        done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        for ref in done:
            self._pending_bytes.pop(ref, None)
            try:
                ray.get(ref, timeout=0)
            except Exception as e:
                self.failed_puts += 1
                logger.warning("tier put failed: %r", e)

    def admits(self, nbytes: int) -> bool:
        """Whether a write-behind of `nbytes` would be queued now; a refusal is counted as
        a dropped put (the caller then skips packing the blocks)."""
        self._reap()
        pending = sum(self._pending_bytes.values())
        ok = len(self._pending) < self.MAX_PENDING_PUTS
        ok = ok and pending + nbytes <= self.max_pending_bytes
        if not ok:
            self.dropped_puts += 1
        return ok

    def put(self, layout_hash: str, block_hashes: list[int], blocks: list[Block]) -> int:
        """Queue a write-behind; returns 0 (how many were new is only known later)."""
        blob, spec = blocks_to_wire(blocks)
        if not self.admits(len(blob)):
            return 0
        ref = self.actor.put.remote(layout_hash, block_hashes, blob, spec)
        self._pending.append(ref)
        self._pending_bytes[ref] = len(blob)
        return 0

    def flush(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Wait for the write-behinds in flight (tests, shutdown)."""
        if self._pending:
            ray.wait(self._pending, num_returns=len(self._pending), timeout=timeout_s)
        self._reap()

    def lookup(self, layout_hash: str, block_hashes: list[int]) -> int:
        try:
            return self._call(self.actor.lookup.remote(layout_hash, block_hashes))
        except Exception as e:
            logger.warning("tier lookup failed: %r", e)
            return 0

    def get(self, layout_hash: str, block_hashes: list[int]) -> list[Block]:
        try:
            blob, spec = self._call(self.actor.get.remote(layout_hash, block_hashes))
        except Exception as e:  # the loader treats a KeyError as "not there any more"
            raise KeyError(f"tier get failed: {e!r}") from e
        return blocks_from_wire(blob, spec, len(block_hashes))
