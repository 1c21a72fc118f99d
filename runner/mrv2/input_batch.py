"""InputBatch: the flat per-step inputs, built on the device by kernels from slot state.

Buffers are allocated once at their maximum size and sliced per step, so their device
addresses never change (a CUDA graph captured over them stays valid). The CPU supplies
only `idx_mapping`, `query_start_loc` and `num_computed_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.block_table import compute_slot_mapping, gather_block_tables
from pdserve.kernels.input_prep import prepare_inputs
from pdserve.runner.models.attention_metadata import AttentionMetadata


@dataclass
class InputBatch:
    num_reqs: int
    num_tokens: int
    idx_mapping: torch.Tensor  # [R] int32: batch row -> slot
    query_start_loc: torch.Tensor  # [R + 1] int32
    num_computed_tokens: torch.Tensor  # [R] int32
    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [R] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for pads
    block_tables: torch.Tensor  # [R, max_blocks] int32
    logits_indices: torch.Tensor  # [R] int64: last token of each row
    # Host copies the CPU already had (no device->host sync needed to read them).
    seq_lens_np: np.ndarray  # [R]
    query_start_loc_np: np.ndarray  # [R + 1]

    @property
    def attn(self) -> AttentionMetadata:
        return AttentionMetadata(
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
            max_query_len=int(np.diff(self.query_start_loc_np).max(initial=0)),
            max_seq_len=int(self.seq_lens_np.max(initial=0)),
        )


class InputBuffers:
    """Persistent, fixed-address buffers sized for the largest step."""

    def __init__(
        self, max_num_reqs: int, max_num_tokens: int, max_blocks: int, device: torch.device
    ):
        self.device = device
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int32, device=device)

    def build(
        self,
        slots: np.ndarray,
        num_scheduled: np.ndarray,
        num_computed: np.ndarray,
        token_ids: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
    ) -> InputBatch:
        r = len(slots)
        qsl = np.zeros(r + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=qsl[1:])
        t = int(qsl[-1])
        # One host->device copy of the step's small inputs, from a fresh array (never the
        # persistent per-slot arrays, which the CPU may change while the copy is in flight).
        packed = torch.from_numpy(np.concatenate([slots, qsl, num_computed]).astype(np.int32))
        if self.device.type == "cuda":
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        idx_mapping, query_start_loc, computed = (
            packed[:r],
            packed[r : 2 * r + 1],
            packed[2 * r + 1 :],
        )
        input_ids, positions = self.input_ids[:t], self.positions[:t]
        seq_lens, slot_mapping = self.seq_lens[:r], self.slot_mapping[:t]
        block_tables = self.block_tables[:r]
        prepare_inputs(
            idx_mapping, query_start_loc, computed, token_ids, input_ids, positions, seq_lens, t
        )
        gather_block_tables(block_table, idx_mapping, block_tables)
        compute_slot_mapping(block_tables, query_start_loc, positions, block_size, slot_mapping, t)
        return InputBatch(
            num_reqs=r,
            num_tokens=t,
            idx_mapping=idx_mapping,
            query_start_loc=query_start_loc,
            num_computed_tokens=computed,
            input_ids=input_ids,
            positions=positions,
            seq_lens=seq_lens,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            logits_indices=(query_start_loc[1:] - 1).long(),
            seq_lens_np=num_computed + num_scheduled,
            query_start_loc_np=qsl,
        )
