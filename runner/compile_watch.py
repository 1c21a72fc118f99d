"""Triton compiles after a serving worker's warm-up: counted, timed and logged.

A kernel variant Triton has not compiled in this process is compiled (or loaded from its
disk cache) the first time a launch needs it, on the launching thread: a request's
step or pull waits for it, ~0.5 s on a fresh machine. The warm-up (runner/warm_up.py,
the transfer warm-ups in kvtransfer/) exists to take these off the request path; this
watch says when one still happens, so an operator sees it in the log and in
`pdserve:worker_kernel_compiles_total` instead of as an unexplained slow first request.
(Before it, the first pulls of a fresh H200 PD pair each waited ~0.6 s for one,
benchmarks/results/gpu_serve_log_first_use_da8f0ae.log.)

Triton's compile hooks are process-wide settings (`triton.knobs.runtime`); `install`
sets them once the worker is warm, and chains to hooks that were already set.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Counts the Triton compiles of this process after `install`."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.count = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._started = threading.local()  # per thread: compiles run on the launching one
        self._before_hook: Any = None
        self._after_hook: Any = None

    def install(self) -> CompileWatch:
        import triton

        runtime = triton.knobs.runtime
        self._before_hook, self._after_hook = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        return self

    def before_compile(self, **kwargs: Any) -> bool:
        """Triton's `jit_cache_hook`: a variant is about to be compiled. Returns False
        (a true value would tell Triton to skip the compile)."""
        self._started.t = time.perf_counter()
        if self._before_hook is not None:
            return bool(self._before_hook(**kwargs))
        return False

    def after_compile(self, **kwargs: Any) -> None:
        """Triton's `jit_post_compile_hook`: the variant is compiled (or loaded from disk)."""
        start = getattr(self._started, "t", None)
        seconds = time.perf_counter() - start if start is not None else 0.0
        self._started.t = None
        with self._lock:
            self.count += 1
            self.seconds += seconds
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        logger.warning(
            "%s: Triton compiled %s while serving (%.0f ms; a request waited for it)",
            self.worker, name, seconds * 1e3,
        )  # fmt: skip
        if self._after_hook is not None:
            self._after_hook(**kwargs)
