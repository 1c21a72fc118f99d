"""Chain hashes of full token blocks: the key of the prefix cache.

Block i's hash covers block i's token ids *and* (through the parent hash) every token
before it, so equal hashes mean equal prefixes, not just equal blocks. This exact
function is the contract between three places (DESIGN §2): the router's block-hash
index, each worker's KV cache manager and the secondary KV tier. It must therefore give
the same value in every process and on every machine: no Python `hash()` (salted per
process by PYTHONHASHSEED), no native byte order. Changing it invalidates every index
and tier store at once, so treat the byte layout below as a wire format.

A request's `cache_salt` (vLLM's, for multi-tenant isolation) moves its whole chain: block
0's parent is `salt_root(salt)` instead of none, so a salted block never equals an
unsalted one or one under another salt, and a tenant cannot learn from the cache timing
whether another tenant sent a prefix. Unsalted chains hash exactly as they did before
salts existed. A LoRA adapter moves it the same way (`salt_root(salt, adapter)`, its own
domain): the KV of a prompt under an adapter is not the base model's.

This module does not know about block ids, requests or eviction; only tokens and salts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Hashes are unsigned 64-bit: 8 bytes fit a numpy uint64 / msgpack uint and give a
# collision chance of ~n^2 / 2^65 — about 3e-8 for 1e6 cached blocks.
HASH_BYTES = 8
_MAX_HASH = 1 << (8 * HASH_BYTES)
# Prefixed to a salt's bytes so its root is not the hash of some other input of this
# module, and so a future kind of root (e.g. per adapter) can take another prefix.
_SALT_DOMAIN = b"pdserve.cache_salt.v1\0"
_ADAPTER_DOMAIN = b"pdserve.lora_adapter.v1\0"


def salt_root(salt: str | None, adapter: str | None = None) -> int | None:
    """The parent of block 0 under `salt` and LoRA `adapter`: None (today's chains) for
    neither, else the 8-byte blake2b, read little-endian, of a domain prefix and then: the
    salt's UTF-8 (no adapter); or the adapter name's UTF-8 length as 4 little-endian bytes,
    the name, and a 0 byte (no salt) or a 1 byte and the salt's UTF-8."""
    if salt is not None:
        assert isinstance(salt, str) and salt, f"cache_salt must be a non-empty string: {salt!r}"
    if adapter is None:
        if salt is None:
            return None
        data = _SALT_DOMAIN + salt.encode("utf-8")
    else:
        name = adapter.encode("utf-8")
        tail = b"\0" if salt is None else b"\1" + salt.encode("utf-8")
        data = _ADAPTER_DOMAIN + struct.pack("<I", len(name)) + name + tail
    return int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (None for block 0).

    Bytes hashed: parent hash as 8 little-endian bytes (0 when None) followed by each
    token id as a little-endian int32, through blake2b with an 8-byte digest. The digest
    is read back little-endian into an unsigned int.
    """
    parent = 0 if parent_hash is None else parent_hash
    assert 0 <= parent < _MAX_HASH, f"parent hash must be an unsigned 64-bit int, got {parent}"
    hasher = hashlib.blake2b(digest_size=HASH_BYTES)
    hasher.update(parent.to_bytes(HASH_BYTES, "little"))
    # struct raises if a token id does not fit int32 (vocabularies are < 2^31).
    hasher.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(hasher.digest(), "little")


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    adapter: str | None = None,
) -> None:
    """Append the hash of every full block of `token_ids` that `hashes` does not cover yet.

    `hashes` already holds the first len(hashes) blocks; they are trusted, not recomputed,
    so the cost is proportional to the new blocks only (a decoding request completes one
    block every `block_size` steps). A trailing partial block is never hashed. `salt`
    (the request's `cache_salt`) and `adapter` (its LoRA adapter's name) only matter for
    block 0: later blocks chain from it.
    """
    assert block_size >= 1, f"block_size must be >= 1, got {block_size}"
    num_full_blocks = len(token_ids) // block_size
    parent = hashes[-1] if hashes else salt_root(salt, adapter)
    for i in range(len(hashes), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
