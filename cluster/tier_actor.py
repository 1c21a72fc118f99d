"""The KV tier as a Ray actor, and the client workers use in place of a local tier.

Blocks cross the actor boundary as one flat uint8 array plus a small spec of shapes and
dtypes (msgpack-able values; never pickled tensors). An array, not `bytes`: Ray moves a
numpy buffer out of band, and both ends copy it with the GIL released. Making `bytes`
(`tobytes()`) or a `bytearray` of 128 MB held the GIL for the whole copy (~0.2 s here),
a stall of the prefill or decode worker's step loop, which shares the process.

`TierClient` has the `HostKVTier` methods the prefill worker (write-behind `put`, off its
thread: cluster/tier_writer.py) and the decode loader (`lookup`, `get`) call, with a
timeout on every call. A tier that is down costs a logged miss, never a failed request.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from pdserve.cluster.tier_writer import TierWriter
from pdserve.kvtransfer.layout import DTYPES
from pdserve.kvtransfer.tier import Block, HostKVTier

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0


def blocks_to_wire(
    blocks: list[Block], stream: torch.cuda.Stream | None = None
) -> tuple[np.ndarray, list]:
    """(all bytes as one uint8 array, [(shape, dtype) per tensor]) for blocks of equal
    shapes. Blocks on a GPU are joined there and copied to the host on `stream` (one the
    caller owns: the copy waits for nothing else queued on the device), synchronously."""
    if not blocks:
        return np.empty(0, dtype=np.uint8), []
    spec = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in blocks[0]]
    parts = [t.contiguous().view(torch.uint8).reshape(-1) for b in blocks for t in b]
    if not parts[0].is_cuda:
        return torch.cat(parts).numpy(), spec
    assert stream is not None, "blocks on a GPU need a stream for their host copy"
    with torch.cuda.stream(stream):
        return torch.cat(parts).cpu().numpy(), spec


def blocks_from_wire(blob, spec: list, n: int) -> list[Block]:
    """Blocks from `blocks_to_wire`'s output (`blob`: any buffer, a read-only array from
    Ray's object store or bytes), copied into memory of their own."""
    sizes = [math.prod(shape) * DTYPES[dtype].itemsize for shape, dtype in spec]
    flat = np.frombuffer(blob, dtype=np.uint8) if len(blob) else np.empty(0, dtype=np.uint8)
    if flat.size != n * sum(sizes):
        raise ValueError(f"tier blob holds {flat.size} bytes, {n} blocks need {n * sum(sizes)}")
    raw = torch.from_numpy(flat.copy())
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
    """What workers call instead of a local tier. Write-behind puts go through a
    `TierWriter` (a thread; capped, drops counted); lookups and gets wait, with a timeout.
    Call `close` when the worker stops."""

    def __init__(self, actor, max_pending_bytes: int = TierWriter.MAX_PENDING_BYTES) -> None:
        self.actor = actor
        self.writer = TierWriter(self._submit, max_pending_bytes)
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}  # the writer's own

    def _submit(self, layout_hash: str, block_hashes: list[int], blocks: list[Block]):
        """On the writer thread: blocks still on a GPU (a prefill worker's packed copies,
        final once the put's `ready` event has passed) are copied to the host here, on a
        stream of this thread's, so neither the host memory nor the copy costs the step
        loop (pinned buffers made there took a fresh H200 worker's first steps ~0.3 s)."""
        stream = None
        if blocks and blocks[0][0].is_cuda:
            device = blocks[0][0].device
            stream = self._copy_streams.get(device)
            if stream is None:
                stream = self._copy_streams[device] = torch.cuda.Stream(device)
        blob, spec = blocks_to_wire(blocks, stream)
        return self.actor.put.remote(layout_hash, block_hashes, blob, spec)

    def _call(self, ref):
        # Through the ref's future, not ray.get: the callers are worker threads of an async
        # actor, where any ray.get makes Ray log that it blocks the event loop (it does not
        # here; the warning would only mislead an operator).
        return ref.future().result(timeout=CALL_TIMEOUT_S)

    @property
    def dropped_puts(self) -> int:
        return self.writer.dropped_puts

    @property
    def failed_puts(self) -> int:
        return self.writer.failed_puts

    def admits(self, nbytes: int) -> bool:
        """Whether a write-behind of `nbytes` would be queued now (a refusal is counted as
        a dropped put; the caller then skips packing the blocks)."""
        return self.writer.admits(nbytes)

    def put(
        self, layout_hash: str, block_hashes: list[int], blocks: list[Block], ready=None
    ) -> int:
        """Queue a write-behind (`ready`: as `HostKVTier.put`, waited for by the writer
        thread); returns 0 (how many were new is only known later)."""
        self.writer.put(layout_hash, block_hashes, blocks, ready)
        return 0

    def flush(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Wait for the write-behinds queued or in flight (tests, shutdown)."""
        self.writer.flush(timeout_s)

    def close(self) -> None:
        self.writer.close()

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
