"""The serving workers' compile watch (runner/compile_watch.py), driven the way Triton calls
its hooks (keyword arguments; on a GPU, tests/test_gpu_compile_watch.py compiles for real)."""

from __future__ import annotations

import logging

import triton

from pdserve.runner.compile_watch import CompileWatch


class _Fn:  # what Triton passes as `fn` (a JitFunctionInfo: module, name, jit_function)
    name = "_my_kernel"


def test_the_watch_counts_names_and_chains_and_never_skips_a_compile(caplog):
    """Guards the hooks' contract with Triton: `jit_cache_hook` must return a false value
    (a true one makes Triton skip the compile and launch nothing), hooks set before the
    watch still run, each compile is counted with its time and logged by kernel name, and
    the hooks are Triton's process-wide settings from `install` on."""
    runtime = triton.knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    calls = []
    runtime.jit_cache_hook = lambda **kw: calls.append(("before", kw["key"])) or False
    runtime.jit_post_compile_hook = lambda **kw: calls.append(("after", kw["key"]))
    try:
        watch = CompileWatch("decode-0").install()
        assert runtime.jit_cache_hook == watch.before_compile
        assert runtime.jit_post_compile_hook == watch.after_compile
        with caplog.at_level(logging.WARNING, logger="pdserve.runner.compile_watch"):
            for key in ("a", "b"):
                kwargs = {"key": key, "repr": "_my_kernel[num_warps=4](x: *fp32)", "fn": _Fn()}
                assert runtime.jit_cache_hook(**kwargs, is_manual_warmup=False) is False
                runtime.jit_post_compile_hook(**kwargs, is_manual_warmup=False)
        assert watch.count == 2 and watch.seconds >= 0
        assert calls == [("before", "a"), ("after", "a"), ("before", "b"), ("after", "b")]
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2
        assert lines[0].startswith("decode-0: Triton compiled _my_kernel while serving (")
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
