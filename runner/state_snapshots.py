"""`StateSnapshots`: a hybrid model's recurrent states saved at block boundaries, so a later
prompt with the same prefix can start from them (prefix caching for hybrids).

A Mamba (or Gated DeltaNet) layer's state after a prefix is one state unit over all its
layers, far larger than a KV block, so it is not kept for every block: the scheduler cuts
each prompt's prefill at its last block boundary B (runner/scheduler.py) and saves the
request's state there into a snapshot unit, keyed by the chain hash of the block that
ends at B. A new request whose cached prefix reaches a block with a snapshot starts from
it: its unit is filled from the snapshot before its first step (KVCacheManager's state
copies), and it computes from B on. Chat turns reuse the last turn's prompt this way.

Snapshot units are numbered after the requests' units (runner/mrv2/mamba_state.py holds
the tensors); when all are taken the least recently used is overwritten.

What this module does not know: tensors, or whether a snapshot's KV blocks are still
cached (a lookup only follows a prefix hit, so a snapshot whose blocks were evicted is
never reached, and is overwritten in its turn).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_unit: int, num_units: int) -> None:
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        self.first_unit, self.num_units = first_unit, num_units
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # oldest use first

    def lookup(self, block_hash: int) -> int | None:
        """The unit holding the state at the end of this block, if any (a use)."""
        unit = self._by_hash.get(block_hash)
        if unit is not None:
            self._by_hash.move_to_end(block_hash)
        return unit

    def reserve(self, block_hash: int) -> int | None:
        """A unit to save the state at the end of this block into (a free one, else the
        least recently used one's), or None if it is saved already."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        if len(self._by_hash) < self.num_units:
            unit = self.first_unit + len(self._by_hash)
        else:
            _, unit = self._by_hash.popitem(last=False)
        self._by_hash[block_hash] = unit
        return unit

    def clear(self) -> None:
        self._by_hash.clear()

    def __len__(self) -> int:
        return len(self._by_hash)
