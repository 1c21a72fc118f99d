"""Mamba state slots (DESIGN §3 ModelState, §4 `mamba_state`): per Mamba layer and request
slot, the conv state (the last K-1 conv inputs, model dtype) and the SSM state (heads x
head_dim x state, float32), which runner/models/mamba2.py reads and writes in place.

`prepare` hands each step's rows to the model: their slots, their token spans and which
rows start a request (num_computed 0: a new prompt, or one recomputed after preemption),
whose states start from zero. Nothing is reset on add or remove: a row's first step
overwrites its slot."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.runner.models.mamba2 import MambaStep
from pdserve.runner.mrv2.input_batch import InputBatch
from pdserve.runner.mrv2.model_state import ModelState


class MambaModelState(ModelState):
    def __init__(self, model: torch.nn.Module, max_reqs: int, device: torch.device):
        d, layers = model.mamba_dims, model.num_mamba_layers
        dtype = model.embed_tokens.weight.dtype
        conv = torch.zeros(layers, max_reqs, d.conv_kernel - 1, d.conv_dim, dtype=dtype,
                           device=device)  # fmt: skip
        ssm = torch.zeros(layers, max_reqs, d.heads, d.head_dim, d.state, dtype=torch.float32,
                          device=device)  # fmt: skip
        model.mamba_states = (conv, ssm)
        self.model, self.device = model, device
        self.bytes = conv.numel() * conv.element_size() + ssm.numel() * 4

    def prepare(self, batch: InputBatch) -> None:
        rows = batch.num_reqs
        starts = batch.query_start_loc_np[: rows + 1]
        fresh = (batch.seq_lens_np[:rows] - np.diff(starts)) == 0
        self.model.mamba_step = MambaStep(
            batch.idx_mapping[:rows].long(), starts, fresh,
            torch.from_numpy(fresh).to(self.device, non_blocking=True),
        )  # fmt: skip
