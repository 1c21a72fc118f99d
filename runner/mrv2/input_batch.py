"""InputBatch: the flat per-step inputs, built on the device by kernels from slot state.

Buffers are allocated once at their maximum size and sliced per step, so their device
addresses never change (a CUDA graph captured over them stays valid). The CPU supplies
only `idx_mapping`, `query_start_loc`, `num_computed_tokens`, the row count and the
sample mask, in one packed copy into a persistent device buffer. A batch may be padded to
a CUDA-graph size: pad rows get one pad token each (input id 0, position 0, slot -1),
`seq_len` 0 and a zero block-table row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.block_table import compute_slot_mapping, gather_block_tables
from pdserve.kernels.decode_prep import mailbox_slot_index, prepare_decode, step_buffer_size
from pdserve.kernels.input_prep import prepare_inputs
from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.mrv2.host_ring import HostRing
from pdserve.runner.mrv2.step_mailbox import StepMailbox


@dataclass
class InputBatch:
    num_reqs: int
    num_tokens: int
    num_reqs_padded: int  # == num_reqs unless padded to a CUDA-graph size
    num_tokens_padded: int
    idx_mapping: torch.Tensor  # [R] int32: batch row -> slot
    query_start_loc: torch.Tensor  # [R_pad + 1] int32 (pad rows: one token each)
    num_computed_tokens: torch.Tensor  # [R] int32
    sample_mask: torch.Tensor  # [R] int32, nonzero: keep the row's sample (post-update)
    input_ids: torch.Tensor  # [T_pad] int32
    positions: torch.Tensor  # [T_pad] int64
    seq_lens: torch.Tensor  # [R_pad] int32
    slot_mapping: torch.Tensor  # [T_pad] int64, -1 for pads
    block_tables: torch.Tensor  # [R_pad, max_blocks] int32
    row_slots: torch.Tensor  # [R_pad] int32: idx_mapping, pad rows' entries whatever they hold
    # Host copies the CPU already had (no device->host sync needed to read them).
    idx_mapping_np: np.ndarray  # [R] int64
    seq_lens_np: np.ndarray  # [R]
    query_start_loc_np: np.ndarray  # [R + 1]
    max_query_len: int
    max_seq_len: int

    @property
    def logits_indices(self) -> torch.Tensor:
        """[R] int64: the last token of each row (two device ops: only eager steps ask)."""
        return (self.query_start_loc[1 : self.num_reqs + 1] - 1).long()

    @property
    def is_uniform_decode(self) -> bool:
        return self.max_query_len == 1

    def attn(self, decode_kernel: str | None = None, max_run: int = 1) -> AttentionMetadata:
        """`max_run`: k + 1 on an engine with k-token drafts (AttentionMetadata's)."""
        return AttentionMetadata(
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            decode_kernel=decode_kernel,
            row_slots=self.row_slots if max_run > 1 else None,
            max_run=max_run,
        )


class InputBuffers:
    """Persistent, fixed-address buffers sized for the largest step."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_blocks: int,
        device: torch.device,
        ring: HostRing | None = None,
    ):
        self.device = device
        self.max_num_reqs = n = max_num_reqs
        self.ring = ring or HostRing(device)
        # int32: idx_mapping [0, n) | query_start_loc [n, 2n + 1) | computed [2n + 1, 3n + 1)
        # | num_reqs [3n + 1] (read by kernels/decode_prep.py inside a step-scope graph)
        # | sample_mask [3n + 2, 4n + 2) (post-update: keep the row's sample; pads 0)
        # | block appends: column + 1 [4n + 2, 5n + 2), block id [5n + 2, 6n + 2)
        # | the step mailbox slot it came through [6n + 2] (runner/mrv2/step_mailbox.py)
        self.step_inputs = torch.zeros(step_buffer_size(n), dtype=torch.int32, device=device)
        self.num_reqs_index = 3 * n + 1
        self.mask_offset = 3 * n + 2
        self.append_offset = 4 * n + 2
        self.mailbox_slot = self.step_inputs[mailbox_slot_index(n) :]  # [1]
        # Set by the runner when step-scope graphs read their inputs from pinned memory.
        self.mailbox: StepMailbox | None = None
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
        sample_mask: np.ndarray,  # [R] bool: rows whose sample is kept
        num_reqs_padded: int | None = None,
        prep_in_graph: bool = False,
        block_appends: dict[int, tuple[int, int]] | None = None,
    ) -> InputBatch:
        """The step's inputs. With `prep_in_graph` (a uniform decode step whose graph runs
        `prepare_decode` itself) only the packed host copy is enqueued here, and
        `block_appends` ({slot: (column, block id)}, this step's new blocks) ride in it for
        the graph's prep to write into the per-slot block table."""
        n = self.max_num_reqs
        r = len(slots)
        r_pad = num_reqs_padded or r
        qsl = np.zeros(r + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=qsl[1:])
        t = int(qsl[-1])
        t_pad = t + (r_pad - r)  # one pad token per pad row
        host = np.zeros(step_buffer_size(n), dtype=np.int32)
        host[:r] = slots
        host[n : n + r + 1] = qsl
        host[n + r + 1 : n + r_pad + 1] = t + np.arange(1, r_pad - r + 1)
        host[2 * n + 1 : 2 * n + 1 + r] = num_computed
        host[self.num_reqs_index] = r
        host[self.mask_offset : self.mask_offset + r] = sample_mask
        if block_appends:
            assert prep_in_graph, "block appends are written by the graph's prep"
            for row, slot in enumerate(slots.tolist()):
                append = block_appends.get(slot)
                if append is not None:
                    host[self.append_offset + row] = append[0] + 1  # 0: no append
                    host[self.append_offset + n + row] = append[1]
        if prep_in_graph and self.mailbox is not None:
            self.mailbox.write(host)  # the graph's prep reads it from pinned memory
        else:
            # One host->device copy, through the pinned ring (never from persistent state).
            self.ring.to_device(host, out=self.step_inputs)
        buf = self.step_inputs
        idx_mapping, computed = buf[:r], buf[2 * n + 1 : 2 * n + 1 + r]
        mask = buf[self.mask_offset : self.mask_offset + r]
        query_start_loc = buf[n : n + r_pad + 1]
        input_ids, positions = self.input_ids[:t_pad], self.positions[:t_pad]
        seq_lens, slot_mapping = self.seq_lens[:r_pad], self.slot_mapping[:t_pad]
        block_tables = self.block_tables[:r_pad]
        if prep_in_graph:
            assert num_reqs_padded is not None and t == r, "prep_in_graph: a padded decode step"
        else:
            prepare_inputs(
                idx_mapping,
                query_start_loc[: r + 1],
                computed,
                token_ids,
                input_ids,
                positions,
                seq_lens,
                t,
            )
            gather_block_tables(block_table, idx_mapping, block_tables)
            compute_slot_mapping(
                block_tables, query_start_loc[: r + 1], positions, block_size, slot_mapping, t
            )
        seq_lens_np = num_computed + num_scheduled
        return InputBatch(
            num_reqs=r,
            num_tokens=t,
            num_reqs_padded=r_pad,
            num_tokens_padded=t_pad,
            idx_mapping=idx_mapping,
            query_start_loc=query_start_loc,
            num_computed_tokens=computed,
            sample_mask=mask,
            input_ids=input_ids,
            positions=positions,
            seq_lens=seq_lens,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            row_slots=buf[:r_pad],
            idx_mapping_np=slots,
            seq_lens_np=seq_lens_np,
            query_start_loc_np=qsl,
            max_query_len=int(num_scheduled.max(initial=0)),
            max_seq_len=int(seq_lens_np.max(initial=0)),
        )

    def prepare_decode(
        self, size: int, token_ids: torch.Tensor, block_table: torch.Tensor, block_size: int
    ) -> None:
        """A decode step's inputs for `size` rows from the packed step buffer the last
        `build` copied or put in the mailbox (its real-row count included): what a
        step-scope graph replays."""
        mb = self.mailbox
        prepare_decode(
            self.step_inputs,
            token_ids,
            block_table,
            self.input_ids,
            self.positions,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
            size,
            block_size,
            mb.inputs if mb is not None else None,
            mb.seq if mb is not None else None,
        )
