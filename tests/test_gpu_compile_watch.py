"""The compile watch on a real Triton compile (runner/compile_watch.py).

Collected only where a GPU exists (tests/conftest.py)."""

from __future__ import annotations

import logging
import time

import torch
import triton
import triton.language as tl

from pdserve.runner.compile_watch import CompileWatch


@triton.jit
def _add_kernel(x_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + VALUE, mask=mask)


def test_a_new_variant_after_install_is_counted_and_logged_and_still_runs(caplog):
    """Guards what an operator is told: a kernel variant this process has not compiled yet,
    launched after the watch is installed, counts once, is logged by name, and runs (the
    hook must not make Triton skip it); launching it again counts nothing."""
    runtime = triton.knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    value = time.time_ns() % 1000 + 1  # a constexpr no earlier run of this process used
    x = torch.zeros(10, device="cuda")
    try:
        watch = CompileWatch("prefill-0").install()
        with caplog.at_level(logging.WARNING, logger="pdserve.runner.compile_watch"):
            _add_kernel[(1,)](x, 10, VALUE=value, BLOCK=16)
            _add_kernel[(1,)](x, 10, VALUE=value, BLOCK=16)
        torch.cuda.synchronize()
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
    assert torch.equal(x, torch.full_like(x, 2.0 * value))
    assert watch.count == 1 and watch.seconds > 0
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("prefill-0: Triton compiled _add_kernel while serving ("), line
