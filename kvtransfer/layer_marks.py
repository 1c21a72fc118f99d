"""Per-layer completion of one prefill step's KV writes, for layer-wise early tickets.

The engine thread calls `done(l)` right after the forward has queued (GPU) or run (CPU)
decoder layer l; the KV source server's thread asks `ready(l)` before it packs layer l
of a request whose last prompt chunk is in that step. On a GPU, `done` records a CUDA
event on the engine's current stream and `ready` queries it, so neither side waits on
the other's stream; on the CPU the forward is synchronous and the count is enough.
Layers complete in order, so `ready(l)` implies every layer before l is ready too.

What this module does not know: requests, blocks, sockets. It is a counter and a list
of events, shared by every request of the step.
"""

from __future__ import annotations

import threading

import torch


class LayerMarks:
    def __init__(self, num_layers: int, device: torch.device) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._cuda = device.type == "cuda"
        self._events: list[torch.cuda.Event | None] = [None] * num_layers
        self._done = 0  # layers [0, _done) have been marked
        self._lock = threading.Lock()

    def done(self, layer: int) -> None:
        """Layer `layer`'s KV writes are queued (GPU) or done (CPU); layers come in order."""
        assert layer == self._done, f"layer {layer} marked after {self._done} of them"
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()  # the engine's current stream, right after the layer's kernels
        with self._lock:
            self._events[layer] = event
            self._done = layer + 1

    def done_all(self) -> None:
        """Mark every layer not marked yet: a forward that ran as one unit (a CUDA graph)."""
        for layer in range(self._done, self.num_layers):
            self.done(layer)

    def ready(self, layer: int) -> bool:
        """Layer `layer`'s KV is in memory: safe to read from any stream or thread."""
        with self._lock:
            if layer >= self._done:
                return False
            event = self._events[layer]
        return event is None or event.query()

    @property
    def num_marked(self) -> int:
        with self._lock:
            return self._done
