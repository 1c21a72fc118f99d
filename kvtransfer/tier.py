"""The secondary KV tier: KV blocks in host memory, keyed by (layout hash, block hash).

Prefill workers write blocks behind; decode workers and later prefills read them through.
A block is a tuple of CPU tensors (one per tensor of its layout group, typically
`[num_layers, E]`); the tier only needs their bytes. Memory is an LRU under `byte_budget`;
with a `spill_dir`, blocks evicted from memory go to disk (an LRU under `spill_budget`)
and a `get` brings them back. The tier never shares storage with its callers: `put`
stores copies and `get` returns copies, so no caller can corrupt another's blocks.

Block hashes are chain hashes (runner/block_hash.py), so block i is useless without
blocks 0..i-1: `lookup` counts leading blocks only, and within one call blocks are
touched last-to-first so that eviction takes a chain's tail before its head.

This module does not know about layouts, requests, Ray or transports; it does not check
that blocks under one layout hash have one shape. Spill files from an earlier process are
not indexed: a restarted tier starts cold. One lock guards everything, disk I/O included
(spills happen on eviction, which is already the slow path).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import msgpack
import torch

Block = tuple[torch.Tensor, ...]
_Key = tuple[str, int]  # (layout_hash, block_hash)

_MAX_BLOCK_HASH = 1 << 64  # block hashes are unsigned 64-bit (runner/block_hash.py)
_LAYOUT_HASH_RE = re.compile(r"[0-9A-Za-z_-]{1,128}")  # it becomes part of a file name
_SPILL_VERSION = 1
_HEADER_LEN_BYTES = 4  # a spill file starts with its msgpack header's length, little-endian


class HostKVTier:
    """Thread-safe LRU store of KV blocks in host memory, optionally spilling to disk."""

    def __init__(
        self, byte_budget: int, spill_dir: str | Path | None = None, spill_budget: int = 0
    ) -> None:
        if byte_budget <= 0:
            raise ValueError(f"byte_budget must be > 0, got {byte_budget}")
        if spill_budget < 0:
            raise ValueError(f"spill_budget must be >= 0, got {spill_budget}")
        if spill_budget > 0 and spill_dir is None:
            raise ValueError(f"spill_budget={spill_budget} needs a spill_dir")
        self.byte_budget = byte_budget
        self.spill_budget = spill_budget
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Both ordered least- to most-recently used; values are blocks / file sizes.
        self._mem: OrderedDict[_Key, Block] = OrderedDict()
        self._spilled: OrderedDict[_Key, int] = OrderedDict()
        self._bytes = 0
        self._spilled_bytes = 0
        # In blocks. hits/misses: what `lookup` found (a block found and then read with
        # `get` is one hit, not two); loaded: blocks read back by `get`.
        self._counters = dict(hits=0, misses=0, loaded=0, evictions=0, puts=0)

    def admits(self, nbytes: int) -> bool:
        """Whether a put of `nbytes` is worth packing: not more than the whole tier."""
        return nbytes <= self.byte_budget

    def put(
        self, layout_hash: str, block_hashes: list[int], blocks: list[Block], ready=None
    ) -> int:
        """Store copies of the blocks not present yet; returns how many were newly stored.
        `ready`: a CUDA event after which the blocks' bytes are final (host copies still
        queued when the caller hands them over); waited for here."""
        if ready is not None:
            ready.synchronize()
        _check_keys(layout_hash, block_hashes)
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(block_hashes)} block hashes but {len(blocks)} blocks")
        for h, block in zip(block_hashes, blocks):
            if not (isinstance(block, tuple) and block):
                raise ValueError(f"block {h} must be a non-empty tuple of tensors")
            if not all(isinstance(t, torch.Tensor) for t in block):
                raise ValueError(f"block {h} must hold only tensors")
            if _nbytes(block) > self.byte_budget:
                raise ValueError(
                    f"block {h} is {_nbytes(block)} bytes, over the tier's byte_budget "
                    f"{self.byte_budget}"
                )
        with self._lock:
            missing = [i for i, h in enumerate(block_hashes) if not self._present((layout_hash, h))]
        # Copy outside the lock (the bulk of a put's time); insert only what is still missing.
        copies = {i: tuple(_copy_to_cpu(t) for t in blocks[i]) for i in missing}
        stored = 0
        with self._lock:
            for i in reversed(missing):
                key = (layout_hash, block_hashes[i])
                if not self._present(key):
                    self._insert(key, copies[i])
                    stored += 1
            self._counters["puts"] += stored
            self._evict()
        return stored

    def lookup(self, layout_hash: str, block_hashes: list[int]) -> int:
        """Number of leading block hashes present (memory or disk); touches them (LRU)."""
        _check_keys(layout_hash, block_hashes)
        with self._lock:
            num_found = 0
            for h in block_hashes:
                if not self._present((layout_hash, h)):
                    self._counters["misses"] += 1
                    break
                num_found += 1
            for h in reversed(block_hashes[:num_found]):
                self._touch((layout_hash, h))
            self._counters["hits"] += num_found
            return num_found

    def get(self, layout_hash: str, block_hashes: list[int]) -> list[Block]:
        """Copies of the blocks, in order; KeyError naming the first absent hash.

        Spilled blocks are read back into memory (which may evict others).
        """
        _check_keys(layout_hash, block_hashes)
        with self._lock:
            for h in block_hashes:
                if not self._present((layout_hash, h)):
                    self._counters["misses"] += 1
                    raise KeyError(f"block {h} of layout {layout_hash} is not in the tier")
            # Gather everything before re-inserting spilled blocks: their insertion may
            # evict (or delete from disk) blocks this same call still has to read.
            out: list[Block] = []
            loaded: dict[_Key, Block] = {}
            for h in block_hashes:
                key = (layout_hash, h)
                if key in self._mem:
                    out.append(tuple(t.clone() for t in self._mem[key]))
                else:
                    if key not in loaded:
                        loaded[key] = self._read_spill(key)
                    out.append(tuple(t.clone() for t in loaded[key]))
            for key in reversed(list(loaded)):
                self._insert(key, loaded[key])
            for h in reversed(block_hashes):
                self._touch((layout_hash, h))
            self._counters["loaded"] += len(block_hashes)
            self._evict()
            return out

    def stats(self) -> dict:
        """Contents (num_blocks, bytes, spilled_*) and cumulative counters, in blocks."""
        with self._lock:
            return dict(
                num_blocks=len(self._mem),
                bytes=self._bytes,
                spilled_blocks=len(self._spilled),
                spilled_bytes=self._spilled_bytes,
                **self._counters,
            )

    def clear(self) -> None:
        """Drop every block, in memory and on disk; cumulative counters are kept."""
        with self._lock:
            self._mem.clear()
            self._bytes = 0
            while self._spilled:
                self._delete_spill(next(iter(self._spilled)))

    # -- internals; the caller holds self._lock --------------------------------------------

    def _present(self, key: _Key) -> bool:
        return key in self._mem or key in self._spilled

    def _touch(self, key: _Key) -> None:
        if key in self._mem:
            self._mem.move_to_end(key)
        elif key in self._spilled:
            self._spilled.move_to_end(key)

    def _insert(self, key: _Key, block: Block) -> None:
        if key in self._spilled:
            self._delete_spill(key)
        assert key not in self._mem, f"block {key} inserted twice"
        self._mem[key] = block
        self._bytes += _nbytes(block)

    def _evict(self) -> None:
        while self._bytes > self.byte_budget:
            key, block = self._mem.popitem(last=False)
            self._bytes -= _nbytes(block)
            self._counters["evictions"] += 1
            if self.spill_dir is not None and self.spill_budget > 0:
                self._write_spill(key, block)
        assert self._bytes >= 0, f"tier byte count went negative: {self._bytes}"

    def _spill_path(self, key: _Key) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / f"{key[0]}-{key[1]:016x}.kvblock"

    def _write_spill(self, key: _Key, block: Block) -> None:
        """File: 4-byte header length, msgpack header (dtypes, shapes), raw tensor bytes."""
        header = msgpack.packb(
            {
                "v": _SPILL_VERSION,
                "layout_hash": key[0],
                "block_hash": key[1],
                "tensors": [
                    {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for t in block
                ],
            },
            use_bin_type=True,
        )
        size = _HEADER_LEN_BYTES + len(header) + _nbytes(block)
        if size > self.spill_budget:
            return  # would not fit even in an empty spill dir: dropped like a plain eviction
        fd, tmp = tempfile.mkstemp(dir=self.spill_dir, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(len(header).to_bytes(_HEADER_LEN_BYTES, "little"))
                f.write(header)
                for t in block:
                    # Through a uint8 view: bytes are written as they are (bf16/fp8 have no
                    # numpy dtype, and no conversion may touch them).
                    f.write(t.reshape(-1).view(torch.uint8).numpy())
            os.replace(tmp, self._spill_path(key))  # atomic: a reader never sees half a file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._spilled[key] = size
        self._spilled_bytes += size
        while self._spilled_bytes > self.spill_budget:
            self._delete_spill(next(iter(self._spilled)))

    def _delete_spill(self, key: _Key) -> None:
        self._spilled_bytes -= self._spilled.pop(key)
        self._spill_path(key).unlink(missing_ok=True)

    def _read_spill(self, key: _Key) -> Block:
        """The block from its spill file; a bad or missing file is forgotten, then raised."""
        try:
            return self._read_spill_file(key)
        except (OSError, ValueError):
            self._delete_spill(key)
            raise

    def _read_spill_file(self, key: _Key) -> Block:
        path = self._spill_path(key)
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(_HEADER_LEN_BYTES), "little")
            header = msgpack.unpackb(f.read(header_len), raw=False)
            if (
                not isinstance(header, dict)
                or header.get("v") != _SPILL_VERSION
                or (
                    header.get("layout_hash"),
                    header.get("block_hash"),
                )
                != key
            ):
                raise ValueError(f"spill file {path} does not hold block {key}")
            tensors = []
            for spec in header["tensors"]:
                dtype = getattr(torch, spec["dtype"])
                assert isinstance(dtype, torch.dtype), f"{path}: bad dtype {spec['dtype']}"
                t = torch.empty(spec["shape"], dtype=dtype)
                raw = t.reshape(-1).view(torch.uint8)
                if f.readinto(raw.numpy()) != raw.numel():
                    raise ValueError(f"spill file {path} is truncated")
                tensors.append(t)
            if f.read(1):
                raise ValueError(f"spill file {path} has trailing bytes")
        return tuple(tensors)


def _check_keys(layout_hash: str, block_hashes: list[int]) -> None:
    if not (isinstance(layout_hash, str) and _LAYOUT_HASH_RE.fullmatch(layout_hash)):
        raise ValueError(f"layout_hash must match {_LAYOUT_HASH_RE.pattern}, got {layout_hash!r}")
    for h in block_hashes:
        if type(h) is not int or not 0 <= h < _MAX_BLOCK_HASH:
            raise ValueError(f"block hashes are unsigned 64-bit ints, got {h!r}")


def _nbytes(block: Block) -> int:
    return sum(t.numel() * t.element_size() for t in block)


def _copy_to_cpu(t: torch.Tensor) -> torch.Tensor:
    """One copy, contiguous, on the CPU, whatever the source's device and strides."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out
