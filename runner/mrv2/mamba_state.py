"""Mamba state (DESIGN §3 ModelState, §4 `mamba_state`): per Mamba layer and state unit,
the conv state (the last K-1 conv inputs; the model's dtype unless `--mamba-cache-dtype`)
and the SSM state (heads x head_dim x state; float32 unless `--mamba-ssm-cache-dtype`),
which runner/models/mamba2.py reads and writes in place.

A request's unit is the scheduler's (runner/state_pool.py: it comes with the request's
first KV blocks and stays while they do, past the batch slot in PD); `on_add` maps the
slot the runner gives the request to it. `prepare` hands each step's rows to the model:
their units, their token spans and which rows start a request (num_computed 0: a new
prompt, or one recomputed after preemption), whose states start from zero. Nothing is
reset on add or remove: a row's first step overwrites its unit, and a request whose
prompt came with its state (a decode-role load) starts past its prompt, from that state.

Decode graphs (runner/mrv2/cuda_graphs.py): the rows' units and fresh flags live in
persistent device buffers, refilled every step; a graph's pad rows read and write one
extra scratch unit past the scheduler's, as fresh rows (their state starts from zero), so
a padded replay never touches a request's state.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.runner.models.mamba2 import MambaStep
from pdserve.runner.mrv2.input_batch import InputBatch
from pdserve.runner.mrv2.model_state import ModelState
from pdserve.runner.scheduler_output import NewRequestData


class MambaModelState(ModelState):
    def __init__(
        self,
        model: torch.nn.Module,
        max_reqs: int,
        num_units: int,
        device: torch.device,
        conv_dtype: torch.dtype | None = None,
        ssm_dtype: torch.dtype = torch.float32,
    ):
        """`conv_dtype` None: the model's (`--mamba-cache-dtype`, `--mamba-ssm-cache-dtype`:
        runner/config.py). The mixer computes in float32 and rounds to these on store."""
        (conv_shape, ssm_shape), layers = model.mamba_state_shapes, model.num_mamba_layers
        conv_dtype = conv_dtype or model.embed_tokens.weight.dtype
        units = num_units + 1  # the last: pad rows' scratch
        conv = torch.zeros(layers, units, *conv_shape, dtype=conv_dtype, device=device)
        ssm = torch.zeros(layers, units, *ssm_shape, dtype=ssm_dtype, device=device)
        model.mamba_states = (conv, ssm)
        self.model, self.device = model, device
        self.bytes = conv.numel() * conv.element_size() + ssm.numel() * ssm.element_size()
        self.slot_unit = np.zeros(max_reqs, dtype=np.int64)
        self.scratch_unit = num_units
        # Every step's rows (then pads: the scratch unit, fresh) at fixed addresses
        self.units = torch.full((max_reqs,), num_units, dtype=torch.int64, device=device)
        self.fresh = torch.ones(max_reqs, dtype=torch.bool, device=device)

    def on_add(self, slot: int, new: NewRequestData) -> None:
        assert new.state_unit is not None, f"{new.req_id}: a hybrid request needs a state unit"
        self.slot_unit[slot] = new.state_unit

    def prepare(self, batch: InputBatch) -> None:
        rows = batch.num_reqs
        starts = batch.query_start_loc_np[: rows + 1]
        fresh = (batch.seq_lens_np[:rows] - np.diff(starts)) == 0
        units = np.full(self.units.numel(), self.scratch_unit, dtype=np.int64)
        units[:rows] = self.slot_unit[batch.idx_mapping_np[:rows]]
        all_fresh = np.ones(self.fresh.numel(), dtype=bool)
        all_fresh[:rows] = fresh
        # Stream-ordered after the step before (whose graph may read these buffers); a
        # pageable source is staged before the call returns.
        self.units.copy_(torch.from_numpy(units), non_blocking=True)
        self.fresh.copy_(torch.from_numpy(all_fresh), non_blocking=True)
        self.model.mamba_step = MambaStep(self.units[:rows], starts, fresh, self.fresh[:rows])

    def copy_units(self, pairs: list[tuple[int, int]]) -> None:
        conv, ssm = self.model.mamba_states
        for src, dst in pairs:  # in order: a save may free the unit a restore then fills
            conv[:, dst].copy_(conv[:, src])
            ssm[:, dst].copy_(ssm[:, src])

    def capture_inputs(self, size: int) -> None:
        # No device op here: it would join the capture and undo every step's `prepare`
        # at each replay. The buffers still hold what __init__ put there (every row a pad)
        # because graphs are captured before the first step.
        self.model.mamba_step = MambaStep(
            self.units[:size], np.arange(size + 1), np.ones(size, dtype=bool), self.fresh[:size]
        )
