"""Programmatic dependent launch (PDL): a decode kernel loads its weights while the
previous kernel still runs.

A 32-row decode layer is six kernels of 3-15 us, and each skinny linear spends ~2-3 us of
its 5-7 starting its weight stream: its programs are placed only after the previous
kernel ends, and their first DRAM reads take a microsecond to come back. With PDL (Hopper
and later) a kernel launched with `launch_pdl=True` may start while its predecessor in the
stream still runs, as soon as every program of the predecessor has called
`launch_dependents` (or ended). Its programs then wait in `griddepcontrol.wait`, which
returns once the predecessor has finished and its writes are visible.

The contract every PDL kernel here keeps: before `wait_for_producer(USE_PDL)` it may only
compute addresses and load memory no kernel writes (a linear's weights); everything else
comes after. The wait covers the whole chain: a predecessor cannot finish before its own
wait returned, so everything earlier in the stream is done too. A kernel launched without
PDL (torch's, cuBLAS) starts after its predecessor ends, as usual; one that calls
`launch_dependents` lets a PDL successor start early (the decode attention does, at its
start). Off the GPU (Triton's interpreter) USE_PDL is False and nothing changes.

History: launching early alone measured no gain (results/throughput_ab_pdl_77c6592.json),
and prefetching the weights into L2 before the wait measured slower
(decode_graph_ab_pdl_prefetch_e98337f.json): what helps is the weights in registers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Triton >= 3.5 has the intrinsics and the launch option; without them this is a no-op.
HAS_GDC = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")

if HAS_GDC:

    @triton.jit
    def _gdc_wait():
        tl.extra.cuda.gdc_wait()

    @triton.jit
    def _gdc_launch_dependents():
        tl.extra.cuda.gdc_launch_dependents()

else:  # pragma: no cover - older Triton

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished, then let the next one launch (its
    programs cannot start before all of ours have, so they never take an SM ours need)."""
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """Let a PDL successor launch now (a kernel not itself launched with PDL)."""
    if USE_PDL:
        _gdc_launch_dependents()


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: a CUDA device of compute capability
    9.0 or later, and a Triton that has it."""
    if not (HAS_GDC and t.is_cuda):
        return False
    index = t.device.index
    return _device_supports_pdl(torch.cuda.current_device() if index is None else index)


def pdl_launch_args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that calls `wait_for_producer(USE_PDL)`."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(t) else {"USE_PDL": False}
