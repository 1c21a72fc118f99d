"""The PDL switch (kernels/pdl.py) off the GPU: CPU tensors never launch with PDL, so the
interpreter runs the kernels unchanged (USE_PDL False, no launch option). The on-GPU
behaviour (launches overlap, in-kernel waits keep results exact) is tested on the H200 in
test_gpu_kernels.py."""

from __future__ import annotations

import torch

from pdserve.kernels import pdl


def test_cpu_tensors_launch_without_pdl():
    """Guards the interpreter path: a launch option the interpreter does not know, or a
    griddepcontrol instruction, must not reach a CPU launch."""
    t = torch.zeros(4)
    assert pdl.use_pdl(t) is False
    assert pdl.pdl_launch_args(t) == {"USE_PDL": False}
