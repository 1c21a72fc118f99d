"""A step-scope graph's inputs and sampled ids in pinned host memory: no copies between steps.

A decode step whose graph runs its own input prep (runner/mrv2/cuda_graphs.py, step scope)
used to need two copy-engine operations around the graph: the packed step buffer
host->device before it and the sampled ids device->host after it. On the H200 the copies
themselves take ~4 us, but the switches between the copy engine and the graph take ~20
us more a step (benchmarks/step_gaps.py: 28 us between one step's last kernel and the
next one's first). Here the kernels do the transfers themselves:

- the host writes the packed buffer into slot `seq % 2` of a pinned [2, L] buffer, and
  the graph's prep (kernels/decode_prep.py) reads it across PCIe;
- the greedy tail's post-update (kernels/input_prep.py) writes each row's sampled id
  into slot `seq % 2` of a pinned [2, rows] buffer and moves `seq`, a device counter, on
  by one; a step without the tail moves it in its eager post-update.

The host keeps its own count of the steps launched this way, so it knows the slot of each.
Why two slots are enough, and never overwritten early: a slot is written again two
mailbox steps later, and the host first waits on the event recorded after the step that
last used it (with async scheduling that step finished before the host planned the next
one, so the wait is over at once); and that step's sampled ids have been read by then
(StepHandle.get reads them before the engine plans the step after next), or, where a
caller did not, `write` copies them out of the slot first.

On a CPU device nothing is pinned and there are no events: the runner makes no graphs
there, but tests/test_graph_path_cpu.py runs the graph path's host logic, the mailbox's
included, with the kernels' torch specs.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels.input_prep import MailOut
from pdserve.runner.mrv2.host_ring import PendingHost


class StepMailbox:
    def __init__(self, buffer_len: int, max_rows: int, device: torch.device):
        self.on_cuda = device.type == "cuda"
        pin = self.on_cuda
        self.inputs = torch.zeros(2, buffer_len, dtype=torch.int32, pin_memory=pin)
        self.sampled = torch.zeros(2, max_rows, dtype=torch.int64, pin_memory=pin)
        self.seq = torch.zeros(1, dtype=torch.int32, device=device)  # read by the prep
        self.steps = 0  # mailbox steps launched: the host's copy of `seq`
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._readers: list[PendingHost | None] = [None, None]

    @property
    def slot(self) -> int:
        """The slot the next mailbox step uses."""
        return self.steps % 2

    def write(self, host: np.ndarray) -> int:
        """Put the next step's packed buffer in its slot -> the slot."""
        i = self.slot
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the step that last read this slot has finished
        reader = self._readers[i]
        if reader is not None and not reader.fetched:
            reader.detach()  # its step's ids, not yet read: copied out before the overwrite
        buf = self.inputs[i].numpy()
        buf[: host.size] = host
        buf[-1] = i  # the slot entry (kernels/decode_prep.py mailbox_slot_index)
        return i

    def launched(self, num_rows: int | None = None) -> PendingHost | None:
        """The step in the current slot is queued (its graph and post-update): record its
        event and move on. `num_rows`: the step's graph wrote that many sampled ids to the
        slot -> their pending host view."""
        i = self.slot
        event = None
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record()
        self._events[i] = event
        self.steps += 1
        if num_rows is None:
            self._readers[i] = None
            return None
        pending = PendingHost(self.sampled[i, :num_rows], event)
        self._readers[i] = pending
        return pending

    def mail_out(self, slot: torch.Tensor, with_rows: bool) -> MailOut:
        """post-update's extras for a mailbox step (`slot`: the device copy of the step
        buffer's slot entry)."""
        return MailOut(self.sampled if with_rows else None, slot, self.seq)

    def reset(self, slot_contents: np.ndarray) -> None:
        """Both slots hold `slot_contents` and the count starts at 0 (after a capture's
        warm-ups moved it)."""
        if self.on_cuda:
            torch.cuda.synchronize()
        self.inputs.numpy()[:] = slot_contents
        self.inputs[:, -1] = torch.arange(2, dtype=torch.int32)  # each slot names itself
        self.seq.zero_()
        self.steps = 0
        self._events = [None, None]
        self._readers = [None, None]
