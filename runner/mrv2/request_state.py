"""Request state by slot (DESIGN §3): fixed rows in `[max_num_reqs, ...]` tables.

A live request owns one slot until it finishes or is preempted; slots are never
compacted or reordered. Large per-slot tables (token history, block table) live on the
device and change only through staged writes; small per-slot counters live on the host
and are gathered per step. Per-slot sampling settings are in `SamplingState`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pdserve.runner.mrv2.host_ring import HostRing
from pdserve.runner.mrv2.staged_writes import StagedWrites
from pdserve.runner.sampling_state import SamplingState
from pdserve.runner.scheduler_output import CachedRequestData, NewRequestData


class RequestState:
    def __init__(
        self,
        max_num_reqs: int,
        max_len: int,
        max_blocks: int,
        vocab_size: int,
        device: torch.device,
        ring: HostRing | None = None,
    ):
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.req_to_slot: dict[str, int] = {}
        self.slot_to_req: list[str | None] = [None] * max_num_reqs
        # Lowest free slot first, so a small batch stays in the first rows.
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        # [max_num_reqs, max_len] int32: prompt + generated tokens; the post-update kernel
        # appends sampled tokens on the device.
        self.token_ids = torch.zeros(max_num_reqs, max_len, dtype=torch.int32, device=device)
        # [max_num_reqs, max_blocks] int32: KV block ids of each slot's request.
        self.block_table = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int32, device=device)
        self.token_writes = StagedWrites(self.token_ids, ring)
        self.block_writes = StagedWrites(self.block_table, ring)
        # Host counters per slot.
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known to exist, sampled or not
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling = SamplingState(max_num_reqs, vocab_size, device)

    @property
    def num_live(self) -> int:
        return len(self.req_to_slot)

    def add(self, new: NewRequestData) -> int:
        assert new.req_id not in self.req_to_slot, f"request {new.req_id} already has a slot"
        assert self._free_slots, "no free slot: the scheduler exceeded max_num_seqs"
        slot = self._free_slots.pop()
        self.req_to_slot[new.req_id] = slot
        self.slot_to_req[slot] = new.req_id
        # Every per-slot field is overwritten: a reused slot inherits nothing.
        self.token_writes.discard_row(slot)
        self.block_writes.discard_row(slot)
        self.token_writes.stage(slot, 0, new.token_ids)
        self.block_writes.stage(slot, 0, new.block_ids)
        self.num_prompt_tokens[slot] = new.num_prompt_tokens
        self.num_tokens[slot] = len(new.token_ids)
        self.num_computed_tokens[slot] = new.num_computed_tokens
        self.num_blocks[slot] = len(new.block_ids)
        self.sampling.add(
            slot, new.params, new.seed, new.stop_ids, new.bad_words, new.grammar,
            new.token_ids[new.num_prompt_tokens :],
        )  # fmt: skip
        return slot

    def update(self, cached: CachedRequestData) -> None:
        slot = self.req_to_slot[cached.req_id]
        if cached.new_block_ids:
            self.block_writes.stage(slot, int(self.num_blocks[slot]), cached.new_block_ids)
            self.num_blocks[slot] += len(cached.new_block_ids)
        self.num_computed_tokens[slot] = cached.num_computed_tokens
        if cached.num_tokens is not None:  # after a step with a draft: what it kept
            self.num_tokens[slot] = cached.num_tokens

    def remove(self, req_id: str) -> None:
        slot = self.req_to_slot.pop(req_id, None)
        if slot is None:
            return  # finished before it was ever scheduled
        self.slot_to_req[slot] = None
        self.token_writes.discard_row(slot)
        self.block_writes.discard_row(slot)
        self._free_slots.append(slot)

    def apply_staged_writes(self) -> None:
        self.token_writes.apply()
        self.block_writes.apply()

    def recent_tokens(
        self,
        slots: np.ndarray,
        width: int,
        to_device: Callable[[np.ndarray], torch.Tensor],
        drafted: np.ndarray | None = None,
    ) -> torch.Tensor:
        """[len(slots), width] int64: each slot's last `width` tokens, gathered on the
        device (the newest may still be in flight there), counting `drafted[i]` of its
        draft tokens (staged after its tokens) for row i. Columns before a slot's first
        token read its first token; callers compare only what the slot has."""
        ends = self.num_tokens[slots] + (0 if drafted is None else drafted)
        cols = np.maximum(ends[:, None] - width + np.arange(width), 0)
        index = to_device(np.stack([np.repeat(slots, width), cols.ravel()]))
        return self.token_ids[index[0], index[1]].view(len(slots), width).long()

    def token_history(self, slot: int, drafted: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt ids, output ids) of a slot as device views of the token table, the output
        with `drafted` of its draft tokens (staged after its tokens); the bounds are host
        counters, so nothing is read back from the device."""
        n, p = int(self.num_tokens[slot]) + drafted, int(self.num_prompt_tokens[slot])
        return self.token_ids[slot, :p], self.token_ids[slot, p:n]
