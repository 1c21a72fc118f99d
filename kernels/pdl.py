"""Programmatic dependent launch (PDL) for the kernels of a decode layer.

A decode step at 32 rows is ~230 kernels of 1.5-6 us each, and a good part of each is the
gap in which the next kernel is launched and its programs are placed after the previous
one ends. With PDL (Hopper and later) a kernel launched with `launch_pdl=True` may start
while its predecessor in the stream still runs; it must then wait (`griddepcontrol.wait`)
before it touches any memory, which returns once the predecessor has finished and its
writes are visible. Its predecessor lets it launch early by `launch_dependents`.

The contract every PDL kernel here keeps: `wait_for_producer(USE_PDL)` comes before any
load or store; before it a kernel may only compute addresses and `prefetch_l2` memory it
never writes (the skinny linear's weights). The wait covers the whole chain: a
predecessor cannot finish before its own wait returned, so everything earlier in the
stream is done too.

Launching early alone measured no gain (small_batch TPOT 1.561-1.566 ms with it against
1.559-1.573 without, results/throughput_ab_pdl_77c6592.json): the gap between two decode
kernels is less the launch than the ramp of the next one's DRAM reads. What an early
start buys is time to put those reads in flight: a skinny linear prefetches its weight
slice into L2 before it waits, while its predecessor still runs. Kernels launched without PDL (torch's, cuBLAS) start after their predecessor ends,
as usual. Off the GPU (Triton's interpreter) USE_PDL is False and nothing changes.
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
    """First statement of a PDL kernel: wait until the previous kernel has finished, then
    let the next one launch (its programs wait in turn; none of them can start before all
    of ours have, so they never take an SM our programs still need)."""
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """Ask L2 for `nbytes` (a multiple of 16) from each 16-byte aligned address in `ptrs`:
    one Hopper bulk prefetch per element, a hint with no effect on memory. GPU only (PTX);
    callers gate it on the same switch as the PDL launch."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


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
    """Launch keywords for a kernel that starts with `wait_for_producer(USE_PDL)`."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(t) else {"USE_PDL": False}
