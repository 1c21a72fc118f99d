"""kvtransfer/copy_stream.py on a GPU: a load's copies run on their own stream, after the
work the engine's stream had queued when the load began, and are finished when the scope
ends, an error included. conftest does not collect this module without a GPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvtransfer.copy_stream import CopyStreams

CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s on an H200, far longer than a launch


def test_copies_wait_for_the_callers_queued_work_and_end_done():
    """Guards both orderings: a block written by work still queued on the caller's stream
    (a freed request's last step) is written by the copy only after it, and the copy is
    complete when the scope returns (the loader then reports the KV in place)."""
    x = torch.zeros(4, device="cuda")
    caller = torch.cuda.current_stream()
    torch.cuda._sleep(CYCLES)
    x.fill_(1.0)  # queued behind the sleep on the caller's stream
    with CopyStreams().scope(x.device):
        assert torch.cuda.current_stream() != caller
        torch.cuda._sleep(CYCLES // 4)
        x.mul_(3.0)  # 3 only if it ran after the fill; 0 * 3 then 1 otherwise
        done = torch.cuda.Event()
        done.record()
    assert done.query(), "the scope returned before its copies finished"
    assert torch.cuda.current_stream() == caller
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3.0))


def test_an_error_inside_still_waits_for_the_queued_copies():
    """Guards the failed-pull path: under `recompute` the engine writes the same blocks
    next, so nothing of the failed load may still be in flight."""
    streams = CopyStreams()
    with pytest.raises(RuntimeError, match="mid-stream"), streams.scope(torch.device("cuda")):
        torch.cuda._sleep(CYCLES // 4)
        done = torch.cuda.Event()
        done.record()
        raise RuntimeError("a pull failed mid-stream")
    assert done.query()
