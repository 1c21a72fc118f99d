"""What a serving worker did to start, as one line of the serve log per worker.

vLLM's server says at start how much memory the weights took, how many tokens the KV
cache holds (and so how many full-length requests fit at once), and how long the CUDA
graphs took to capture and how much memory they use. A pdserve worker runs in its own
Ray actor, where the engine's own log lines stay in the actor's log; so the worker
reports these numbers in its `info()` (plain values, msgpack-able), and `pdserve serve`
prints one line per worker when it is ready:

    pdserve: decode-0 ready in 21.4 s (engine 16.2, warm-up 4.8, transfer set-up 0.4):
    weights 1.11 GiB; KV cache 1,093,408 tokens, 116.79 GiB (room for 266.9 requests of
    4,096 tokens); 36 CUDA graphs in 5.1 s, 0.31 GiB
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.runner.engine import Engine

GiB = float(2**30)


def startup_report(engine: Engine, seconds: dict[str, float]) -> dict[str, Any]:
    """The numbers of one worker's start: `seconds` by phase (engine, warm-up, ...), in
    the order they ran; the rest read from the engine."""
    runner = engine.runner
    block_size = engine.config.cache.block_size
    report: dict[str, Any] = {
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "weights_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
        "kv_tokens": (runner.num_blocks - 1) * block_size,  # block 0 is the null block
        "max_model_len": engine.config.model.max_model_len,
        "engine": engine_settings(engine),
    }
    kv_cache = getattr(runner, "kv_cache", None)  # the reference runner keeps no paged tensor
    if kv_cache is not None:
        report["kv_bytes"] = kv_cache.numel() * kv_cache.element_size()
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        report["cuda_graphs"] = len(graphs.graphs) + len(graphs.tail_graphs)
        report["graph_capture_s"] = round(graphs.capture_seconds, 2)
        report["graph_bytes"] = graphs.memory_bytes
    return report


def engine_settings(engine: Engine) -> dict[str, Any]:
    """The settings a worker's engine runs with, as vLLM names them: what the flags and
    the defaults came to on this worker (e.g. async scheduling is on only on a GPU)."""
    c = engine.config
    return {
        "runner": c.runner.runner,
        "device": c.runner.device,
        "dtype": str(c.model.dtype).removeprefix("torch."),
        "block_size": c.cache.block_size,
        "max_num_seqs": c.scheduler.max_num_seqs,
        "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": c.scheduler.enable_chunked_prefill,
        "enable_prefix_caching": c.cache.enable_prefix_caching,
        "kv_cache_dtype": c.cache.cache_dtype,
        "async_scheduling": c.runner.async_scheduling,
        "scheduling_policy": c.scheduler.policy,
    }


def format_startup(worker_id: str, report: dict[str, Any]) -> str:
    """The serve log's line for a worker's `startup_report`."""
    seconds = report.get("seconds") or {}
    phases = ", ".join(f"{name} {s:.1f}" for name, s in seconds.items())
    line = f"pdserve: {worker_id} ready in {sum(seconds.values()):.1f} s"
    line += f" ({phases})" if phases else ""
    line += f": weights {report['weights_bytes'] / GiB:.2f} GiB"
    kv, max_len = report["kv_tokens"], report["max_model_len"]
    line += f"; KV cache {kv:,} tokens"
    if "kv_bytes" in report:
        line += f", {report['kv_bytes'] / GiB:.2f} GiB"
    line += f" (room for {kv / max_len:,.1f} requests of {max_len:,} tokens)"
    if "cuda_graphs" in report:
        line += (
            f"; {report['cuda_graphs']} CUDA graphs in {report['graph_capture_s']:.1f} s, "
            f"{report['graph_bytes'] / GiB:.2f} GiB"
        )
    else:
        line += "; no CUDA graphs (eager)"
    return line


class StartupLines:
    """Prints each worker's startup line once per start: the first ones when the server
    starts, later ones (added by scaling, or restarted) once the controller lists them
    with their report."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self._done: set[tuple[str, int]] = set()  # (worker id, generation)

    def update(self, members: list[dict]) -> None:
        for m in members:
            key = (m["worker_id"], m["generation"])
            if m.get("startup") and key not in self._done:
                self._done.add(key)
                self.emit(format_startup(m["worker_id"], m["startup"]))
