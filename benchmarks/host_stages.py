"""Host time per function of a call, by wrapping named functions for a while.

A profiling aid for benchmarks (transfer.py's `--profile-pulls`), not product code:
cProfile doubles a pull's host time and rounds each function to milliseconds, and torch's
profiler sees only aten ops and CUDA API calls; a wall clock around each named function
shows the Python between them too. `stage_times(targets, fn, n)` calls `fn` `n` times
with every `(owner, name)` in `targets` wrapped, and returns microseconds per call of
`fn` spent in each target (inclusive: nested targets are counted in both), plus `total`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack, contextmanager


@contextmanager
def _wrapped(owner: object, name: str, spent: dict[str, float]):
    original = getattr(owner, name)
    label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    spent.setdefault(label, 0.0)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def stage_times(
    targets: Iterable[tuple[object, str]],
    fn: Callable[[], object],
    n: int,
    between: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Microseconds per call of `fn` in each target and in all of `fn` (`total`), over
    `n` calls with `between()` (untimed) before each."""
    spent: dict[str, float] = {}
    total = 0.0
    with ExitStack() as stack:
        for owner, name in targets:
            stack.enter_context(_wrapped(owner, name, spent))
        for _ in range(n):
            between()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
    out = {label: s / n * 1e6 for label, s in spent.items()}
    out["total"] = total / n * 1e6
    return out
