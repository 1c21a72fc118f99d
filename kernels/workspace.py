"""Persistent scratch for kernels that finish in one launch by "last arriver merges".

A split kernel (split-K linear, split decode attention) writes its partials to scratch,
counts itself in on an arrival counter (`arrives_last`, shared by all of them), and the
program that arrives last merges the partials and resets the counter to zero. That saves the second (reduce) launch, ~3 us
a layer on an H200, but the counters must be zero before every launch and keep their
address under CUDA graphs. So they live here, owned by the model and handed to the
kernels explicitly: one workspace per model, shared by its layers, which run one after
another on one stream.

Buffers grow on demand (the largest request wins). A buffer once handed out is never
freed: a CUDA graph captured its address, and an eager step that later needs a larger one
(more rows than any captured size) gets a new buffer while the old one stays alive for
the graph's replays (same stream, so the two are never in use at once). Growing during a
capture is refused: the warm-up forward that precedes each capture sizes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


class KernelWorkspace:
    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # outgrown, kept for graphs that hold them

    def _get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        device = _with_index(device)
        buf = self._buffers.get((name, dtype))
        if buf is not None and buf.numel() >= numel and buf.device == device:
            return buf
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), (
            f"kernel workspace '{name}' must be sized before CUDA graph capture "
            "(run one eager forward at the largest capture size first)"
        )
        grown = max(numel, 1 if buf is None or buf.device != device else buf.numel())
        if buf is not None:
            self._retired.append(buf)
        # Zeroed once: counters are zero between launches; scratch is written before read.
        buf = torch.zeros(grown, dtype=dtype, device=device)
        self._buffers[(name, dtype)] = buf
        return buf

    def counters(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """[>= numel] int32 arrival counters, zero between launches."""
        return self._get(name, numel, torch.int32, device)

    def scratch(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """[>= numel] float32 scratch for partial results."""
        return self._get(name, numel, torch.float32, device)


@triton.jit
def arrives_last(counters, index, arrivals):
    """Counts a program in on `counters + index` once every thread of it has stored its
    partials (the barrier), the acq_rel atomic publishing them to the last to arrive, which
    reads them from L2. -> (whether this program is the last of `arrivals`, the counter):
    the last merges, then zeroes the counter."""
    tl.debug_barrier()
    counter = counters + index
    return tl.atomic_add(counter, 1, sem="acq_rel") == arrivals - 1, counter


def _with_index(device: torch.device) -> torch.device:
    """`cuda` as the `cuda:<current>` it means: an index-less device must find the buffer
    that a tensor's own device (which always has an index) was given, not a fresh one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
