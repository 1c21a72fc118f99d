"""Host time per function, by wrapping named functions with a wall clock for a while.

A profiling aid for benchmarks, not product code: cProfile doubles a pull's host time and
rounds each function to milliseconds, and torch's profiler sees only aten ops and CUDA
API calls; a wall clock around each named function shows the Python between them too.

- `timed_functions(targets)`: a context in which every `(owner, name)` or
  `(owner, name, label)` of `targets` is wrapped; it yields a `Timings` (seconds and calls
  per label, inclusive: nested targets count in both) and restores the originals after.
  step_breakdown.py times an engine step with it.
- `stage_times(targets, fn, n)`: microseconds per call of `fn` in each target, plus
  `total`, over `n` calls (transfer.py's `--profile-pulls`).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@contextmanager
def _wrapped(owner: object, name: str, label: str, timings: Timings) -> Iterator[None]:
    original = getattr(owner, name)
    timings.seconds[label] += 0.0  # listed even if never called

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timings.seconds[label] += time.perf_counter() - start
            timings.calls[label] += 1

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def timed_functions(targets: Iterable[tuple]) -> Iterator[Timings]:
    timings = Timings()
    with ExitStack() as stack:
        for owner, name, *label in targets:
            default = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
            stack.enter_context(_wrapped(owner, name, label[0] if label else default, timings))
        yield timings


def stage_times(
    targets: Iterable[tuple],
    fn: Callable[[], object],
    n: int,
    between: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Microseconds per call of `fn` in each target and in all of `fn` (`total`), over
    `n` calls with `between()` (untimed) before each."""
    total = 0.0
    with timed_functions(targets) as timings:
        for _ in range(n):
            between()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
    out = {label: s / n * 1e6 for label, s in timings.seconds.items()}
    out["total"] = total / n * 1e6
    return out
