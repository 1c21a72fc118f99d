"""A side stream for the host-to-device copies a load makes into the engine's KV cache.

A tcp pull (and a copy from the secondary tier) moves hundreds of MB from host memory into
the destination's blocks: one pageable copy and one scatter kernel per frame. Queued on
the loader thread's current stream, which is the engine's compute stream (the default
stream), every copy sat between two decode steps and held them up. Moving them here cut
PD's ITL p99 over tcp on one H200 from 18.0 / 23.4 to 7.6 / 15.2 ms at 2 / 4 req/s
(results/pd_tcp_copy_stream_nvidia-h200_b8e8e7f.json); TPOT there stays bound by the
pulls themselves (loopback tcp at ~1.5 GB/s).

`CopyStreams.scope(device)` runs a load's copies on a stream of their own instead:
- it starts by waiting for the caller's stream as it is then: the destination blocks were
  just allocated, and work still queued there may write the blocks of the request that
  held them before;
- it ends (success or error) by waiting for its own copies on the host, so when the loader
  reports the load, its KV is in place for any stream, and a failed load leaves nothing in
  flight under a recompute.
Steps queued on the caller's stream meanwhile run beside the copies.

One stream per (thread, device): loader threads never switch streams, so the stream
current when a thread first asks is the engine's (`transport_cuda_ipc` relies on the same).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


class CopyStreams:
    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def scope(self, device: torch.device) -> Iterator[None]:
        """Run the block's CUDA work on this thread's copy stream for `device` (nothing
        changes for a CPU device); see the module docstring for the ordering."""
        if device.type != "cuda":
            yield
            return
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        streams = self._local.__dict__.setdefault("streams", {})
        pair = streams.get(device)
        if pair is None:
            pair = streams[device] = (torch.cuda.Stream(device), torch.cuda.current_stream(device))
        side, caller = pair
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            side.synchronize()
