"""`StatePool`: which request owns each recurrent-state unit of a hybrid Mamba model.

A unit is one request's Mamba state over all Mamba layers (runner/mrv2/mamba_state.py
holds the tensors, `[layers, num_units, ...]`). A request gets a unit with its first KV
blocks and keeps it for as long as it keeps them: while it runs, while a prefill-role
engine holds its prompt for a puller (`KVCacheManager.detach`), and from the moment a
decode-role engine starts loading it. So the state travels like a block (DESIGN §4
`mamba_state`: the request's final state, one unit), and the runner's batch slots stay
free to be reused the moment a request leaves the batch.

Units are handed out lowest first; nothing here knows tensors or requests.
"""

from __future__ import annotations

import heapq


class StatePool:
    def __init__(self, num_units: int) -> None:
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        self.num_units = num_units
        self._free = list(range(num_units))  # a heap: lowest first, so reuse is predictable
        self._used = [False] * num_units

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state unit (check num_free first)")
        unit = heapq.heappop(self._free)
        self._used[unit] = True
        return unit

    def free(self, unit: int) -> None:
        if not 0 <= unit < self.num_units or not self._used[unit]:
            raise ValueError(f"state unit {unit} is not allocated")
        self._used[unit] = False
        heapq.heappush(self._free, unit)
