"""Deterministic seed derivation (splitmix64): engine seed -> request seeds -> n>1 children.

A request without a seed gets `derive_seed(engine_seed, arrival_index)`, so the same
engine seed and the same submission order reproduce the same samples. Child i > 0 of an
n > 1 request gets `derive_seed(seed, i)`; child 0 keeps the request's seed, so asking
for n=2 does not change the first completion.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(base: int, index: int) -> int:
    """A 63-bit seed from (base, index); distinct indices give unrelated seeds."""
    return splitmix64((splitmix64(base & _MASK64) ^ (index & _MASK64)) & _MASK64) >> 1
