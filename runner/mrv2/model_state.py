"""Model-family hooks of the runner (DESIGN §3), with do-nothing defaults.

The runner's common path calls these at fixed points and never branches on the model
family. GQA models need nothing beyond the defaults; MLA latent caches, Mamba state
slots and hybrid layer maps override what they need.
"""

from __future__ import annotations

import torch

from pdserve.runner.mrv2.input_batch import InputBatch
from pdserve.runner.scheduler_output import NewRequestData


class ModelState:
    def on_add(self, slot: int, new: NewRequestData) -> None:
        """A request took `slot` (e.g. map the slot to the request's recurrent state)."""

    def on_remove(self, slot: int) -> None:
        """The request in `slot` left."""

    def prepare(self, batch: InputBatch) -> None:
        """Adjust per-step inputs before the forward pass (extra metadata, state indices).
        On a step-scope graph step (`--cuda-graph-scope step`) the batch's device inputs
        (the packed ones too: idx_mapping, query_start_loc, the sample mask, copied from
        the step mailbox) are written by the graph's own prep, after this has run: read
        host fields here, not the device tensors."""

    def copy_units(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent-state units (source, target), in order (a hybrid's prefix
        snapshots: runner/state_snapshots.py)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state units")

    def capture_inputs(self, size: int) -> None:
        """Before a decode graph of `size` one-token rows is captured (all rows pads): point
        the model at the persistent inputs that `prepare` fills on every later step, pad
        rows included (runner/mrv2/cuda_graphs.py). Host work only: a device op issued here
        is captured into the graph and replayed at every step."""

    def post_forward(self, batch: InputBatch, hidden: torch.Tensor) -> None:
        """Runs after the forward pass (e.g. commit recurrent state of finished prompts)."""


class GQAModelState(ModelState):
    """Standard paged GQA/MHA attention: everything is in the shared InputBatch."""
