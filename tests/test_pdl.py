"""The PDL switch (kernels/pdl.py) off the GPU: CPU tensors never launch with PDL, so the
interpreter runs the kernels unchanged (USE_PDL False, no launch option) and the skinny
linear keeps its streaming tiles. The on-GPU behaviour (weights loaded before the wait,
results exact under a graph) is tested on the H200 in test_gpu_kernels.py."""

from __future__ import annotations

import torch

from pdserve.kernels import pdl
from pdserve.kernels import skinny_linear as sl


def test_cpu_tensors_launch_without_pdl():
    """Guards the interpreter path: a launch option the interpreter does not know, or a
    griddepcontrol instruction, must not reach a CPU launch."""
    t = torch.zeros(4)
    assert pdl.use_pdl(t) is False
    assert pdl.pdl_launch_args(t) == {"USE_PDL": False}


def test_default_tiles_stream_without_pdl():
    """Guards the tile choice: without PDL a weights-first program would load its slice and
    then wait for nothing, so it gets the streaming tiles (choose_config's)."""
    x = torch.zeros(32, 2048, dtype=torch.bfloat16)
    cfg = sl.default_config(x, 1024, 2048, False)
    assert cfg == sl.choose_config(1024, 2048) and not cfg.weights_first
