"""`StateSnapshots`: a hybrid model's recurrent states saved at block boundaries, so a later
prompt with the same prefix can start from them (prefix caching for hybrids).

A Mamba (or Gated DeltaNet) layer's state after a prefix is one state unit over all its
layers, far larger than a KV block, so it is not kept for every block: the scheduler cuts
each prompt's prefill at its last block boundary B (runner/scheduler.py) and saves the
request's state there into a snapshot unit, keyed by the chain hash of the block that
ends at B. A new request whose cached prefix reaches a block with a snapshot starts from
it: its unit is filled from the snapshot before its first step (KVCacheManager's state
copies), and it computes from B on.

A decoding request also saves its state at block boundaries (every 64 tokens at 16-token
blocks: `decode_save_stride`), into one unit of its own that is not yet
looked up (`take`): each save overwrites the last. When the request ends, that unit is
published under the hash of the block ending at its last save (`publish`), so the next
chat turn, which repeats the prompt and the reply, resumes near the reply's end, not
just after the prompt.

Snapshot units are numbered after the requests' units (runner/mrv2/mamba_state.py holds
the tensors); when none is free the least recently used snapshot is overwritten.

What this module does not know: tensors, or whether a snapshot's KV blocks are still
cached (a lookup only follows a prefix hit, so a snapshot whose blocks were evicted is
never reached, and is overwritten in its turn).
"""

from __future__ import annotations

from collections import OrderedDict


def decode_save_stride(block_size: int) -> int:
    """How often a decoding request saves its state, in tokens: whole blocks, at least 64
    tokens. A save copies the request's whole state, so one every 16-token block would add
    1/16 to a decode step's state traffic; one every 64 tokens adds 1/64, and the next
    turn recomputes at most 63 reply tokens more. The router marks the same points
    (cluster/prefix_index.py)."""
    return block_size * max(1, 64 // block_size)


class StateSnapshots:
    def __init__(self, first_unit: int, num_units: int) -> None:
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        self.first_unit, self.num_units = first_unit, num_units
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # oldest use first
        self._taken: set[int] = set()  # units saved into by decoding requests, unpublished
        self._free = list(range(first_unit + num_units - 1, first_unit - 1, -1))  # pop: lowest

    def lookup(self, block_hash: int) -> int | None:
        """The unit holding the state at the end of this block, if any (a use)."""
        unit = self._by_hash.get(block_hash)
        if unit is not None:
            self._by_hash.move_to_end(block_hash)
        return unit

    def reserve(self, block_hash: int) -> int | None:
        """A unit to save the state at the end of this block into (a free one, else the
        least recently used snapshot's), or None if it is saved already or every unit is
        taken by a decoding request."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        unit = self._unit()
        if unit is not None:
            self._by_hash[block_hash] = unit
        return unit

    def take(self) -> int | None:
        """A unit for a decoding request's saves, looked up by nobody until `publish` or
        `give_back`; None if every unit is taken so."""
        unit = self._unit()
        if unit is not None:
            self._taken.add(unit)
        return unit

    def publish(self, block_hash: int, unit: int) -> None:
        """A taken unit now holds the state at the end of this block (or will, once the
        save a step ago is copied: copies run before any restore of the same step). A unit
        freed here or by `give_back` may still have that save pending: it runs before any
        later save into the unit, as copies run in the order they were planned."""
        self._taken.remove(unit)
        if block_hash in self._by_hash:  # the same prefix, saved already: keep that one
            self._by_hash.move_to_end(block_hash)
            self._free.append(unit)
        else:
            self._by_hash[block_hash] = unit

    def give_back(self, unit: int) -> None:
        """A taken unit whose state will not be looked up."""
        self._taken.remove(unit)
        self._free.append(unit)

    def _unit(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._by_hash:
            return self._by_hash.popitem(last=False)[1]
        return None

    def clear(self) -> None:
        """Forget every snapshot (units taken by decoding requests stay theirs)."""
        self._by_hash.clear()
        self._free = [
            u
            for u in range(self.first_unit + self.num_units - 1, self.first_unit - 1, -1)
            if u not in self._taken
        ]

    def __len__(self) -> int:
        return len(self._by_hash)
