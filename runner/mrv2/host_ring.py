"""Host<->device copies that never block the CPU on the GPU and never race the CPU.

`HostRing.to_device(array)` copies a numpy array into the next slot of a ring of pinned
host buffers and from there, asynchronously, to the device. A slot is reused only after
the copy that last read it has completed (an event per slot; with several steps in
flight that wait is almost always already over), so the CPU can fill step N+1's inputs
while step N's copies are still queued. Persistent CPU state is never the source of an
in-flight copy: the array is copied into the ring first.

On a CPU device there is nothing to overlap: `to_device` returns a private copy.
"""

from __future__ import annotations

import numpy as np
import torch


class HostRing:
    # 32 slots: a step makes up to 10 copies (a prefill step: two staged-write tables x 2,
    # inputs with the sample mask, floats, ints, banned pairs, logit_bias entries, allowed
    # ids) and two steps are in flight, so the next step never reuses a slot. With 8, a
    # prefill step waited inside `execute` for the previous step's forward (its sampling
    # copies follow the forward on the stream), and the engine's StepStats counted that
    # wait as CPU time.
    def __init__(self, device: torch.device, num_slots: int = 32, initial_bytes: int = 1 << 16):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._slots: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        if self.on_cuda:
            for _ in range(num_slots):
                self._slots.append(torch.empty(initial_bytes, dtype=torch.uint8, pin_memory=True))
                self._events.append(None)
        self._next = 0

    def _slot(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the copy that last read this slot has finished
        if self._slots[i].numel() < nbytes:
            self._slots[i] = torch.empty(
                max(nbytes, 2 * self._slots[i].numel()), dtype=torch.uint8, pin_memory=True
            )
        return i, self._slots[i]

    def to_device(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy `array` to the device (into `out` if given, keeping its address)."""
        array = np.ascontiguousarray(array)
        if not self.on_cuda:
            host = torch.from_numpy(array.copy())
            if out is None:
                return host
            out.view(-1)[: host.numel()].copy_(host.view(-1))
            return out
        i, slot = self._slot(array.nbytes)
        host = slot[: array.nbytes]
        host.numpy()[:] = array.view(np.uint8).reshape(-1)
        typed = host.view(_TORCH_DTYPES[array.dtype]).view(array.shape)
        if out is None:
            out = torch.empty(array.shape, dtype=typed.dtype, device=self.device)
            out.copy_(typed, non_blocking=True)
        else:
            out.view(-1)[: typed.numel()].copy_(typed.view(-1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[i] = event
        return out


_TORCH_DTYPES = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
}


class DeviceToHost:
    """Ring of pinned host buffers receiving a step's outputs; `fetch()` blocks only on the
    event of that step's copy, when the host actually needs the values. A slot whose last
    result has not been fetched yet is never overwritten: that copy gets a fresh buffer
    (only when one step copies more tensors than the ring holds, e.g. many prompt-logprob
    requests at once)."""

    # 16 slots: a step copies ~1-4 tensors and at most two steps are unfetched.
    def __init__(self, device: torch.device, num_slots: int = 16):
        self.on_cuda = device.type == "cuda"
        self._slots: list[torch.Tensor | None] = [None] * num_slots
        self._owners: list[PendingHost | None] = [None] * num_slots
        self._next = 0

    def copy(self, src: torch.Tensor) -> PendingHost:
        if not self.on_cuda:
            return PendingHost(src.detach().clone(), None)
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        owner = self._owners[i]
        busy = owner is not None and not owner.fetched
        if busy or slot is None or slot.numel() < src.numel() or slot.dtype != src.dtype:
            slot = torch.empty(max(src.numel(), 1024), dtype=src.dtype, pin_memory=True)
            if not busy:
                self._slots[i] = slot
        host = slot[: src.numel()].view(src.shape)
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        pending = PendingHost(host, event)
        if not busy:
            self._owners[i] = pending
        return pending


class PendingHost:
    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None):
        self._host = host
        self._event = event
        self.fetched = False

    def detach(self) -> None:
        """Keep a private copy of the values: the buffer holding them is about to be reused."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._host = self._host.clone()

    def fetch(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self.fetched = True
        return self._host
