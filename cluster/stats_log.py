"""The serve log's periodic stats lines, one per pool, in the words of vLLM's engine line
(`Avg prompt throughput: … tokens/s, Avg generation throughput: …, Running: … reqs,
Waiting: … reqs, … KV cache usage: …%, Prefix cache hit rate: …%`), plus what ran the
pool's steps (CUDA graphs or eager), so the log says which path really served the load.

Rates and the hit rate are over the interval since the last line, from the counters each
worker reports in its stats (a restarted worker's counters start again from zero). An idle
pool prints one line of zeros and then stays quiet until it has work again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Worker stats counters the lines difference (cluster/services.py `_engine_stats`).
_COUNTERS = (
    "prompt_tokens_computed",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "kernel_compiles",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)
_STEPS = "steps:"  # prefix of the flattened steps_by_path counters
_SPEC_POS = "spec_pos:"  # and of spec_decode_accepted_by_position's


def _counters(stats: dict) -> dict[str, float]:
    out = {k: float(stats[k]) for k in _COUNTERS if _is_number(stats.get(k))}
    for path, n in (stats.get("steps_by_path") or {}).items():
        if _is_number(n):
            out[_STEPS + path] = float(n)
    for pos, n in (stats.get("spec_decode_accepted_by_position") or {}).items():
        if _is_number(n):
            out[_SPEC_POS + pos] = float(n)
    return out


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class StatsLog:
    """Turns successive polls of the workers' stats into the lines to print."""

    start: float  # when the workers' counters started (their counts before are since it)
    _last: float | None = None
    _prev: dict[str, dict[str, float]] = field(default_factory=dict)  # worker -> counters
    _active: dict[str, bool] = field(default_factory=dict)  # role -> last line had work

    def lines(
        self, now: float, roles: dict[str, str], stats: dict[str, dict], queued: int = 0
    ) -> list[str]:
        """`roles`: worker id -> "prefill" | "decode" for the routed workers; `stats`: worker
        id -> its last polled stats; `queued`: requests waiting in the router for a decode
        slot (on the decode pool's line when any). Returns the pools' lines (prefill
        first)."""
        interval = max(now - (self._start_of_interval()), 1e-9)
        self._last = now
        deltas: dict[str, dict[str, float]] = {}
        for worker in roles:
            cur = _counters(stats.get(worker, {}))
            prev = self._prev.get(worker, {})
            deltas[worker] = {
                k: v - prev.get(k, 0.0) if v >= prev.get(k, 0.0) else v  # restarted: from 0
                for k, v in cur.items()
            }
            self._prev[worker] = cur
        for gone in [w for w in self._prev if w not in roles]:
            del self._prev[gone]
        out = []
        for role in ("prefill", "decode"):
            workers = [w for w, r in roles.items() if r == role]
            if not workers:
                continue
            line, active = _pool_line(
                role, workers, stats, deltas, interval, queued if role == "decode" else 0
            )
            if active or self._active.get(role, False):
                out.append(line)
            self._active[role] = active
        return out

    def _start_of_interval(self) -> float:
        return self.start if self._last is None else self._last


def _pool_line(
    role: str,
    workers: list[str],
    stats: dict[str, dict],
    deltas: dict[str, dict[str, float]],
    interval: float,
    queued: int,
) -> tuple[str, bool]:
    total: dict[str, float] = {}
    for w in workers:
        for k, v in deltas[w].items():
            total[k] = total.get(k, 0.0) + v
    now = [stats.get(w, {}) for w in workers]
    running = sum(int(s.get("num_requests_running") or 0) for s in now)
    waiting = sum(int(s.get("num_requests_waiting") or 0) for s in now)
    usage = [
        float(s["kv_cache_usage_perc"]) for s in now if _is_number(s.get("kv_cache_usage_perc"))
    ]
    prompt = total.get("prompt_tokens_computed", 0.0)
    generated = total.get("generation_tokens", 0.0)
    parts = [
        f"Avg prompt throughput: {prompt / interval:.1f} tokens/s",
        f"Avg generation throughput: {generated / interval:.1f} tokens/s",
        f"Running: {running} reqs",
        f"Waiting: {waiting} reqs",
    ]
    if queued:  # cluster/decode_admission.py: every decode worker is full
        parts.append(f"Queued in router: {queued} reqs")
    if usage:
        mean = 100 * sum(usage) / len(usage)
        kv = f"KV cache usage: {mean:.1f}%"
        parts.append(kv + (f" (max {100 * max(usage):.1f}%)" if len(usage) > 1 else ""))
    queries = total.get("prefix_cache_queries", 0.0)
    if queries:
        parts.append(
            f"Prefix cache hit rate: {100 * total.get('prefix_cache_hits', 0.0) / queries:.1f}%"
        )
    if total.get("num_preemptions"):
        parts.append(f"Preemptions: {int(total['num_preemptions'])}")
    drafted = total.get("spec_decode_num_draft_tokens", 0.0)
    if drafted:  # runner/speculative/: as vLLM's SpecDecoding metrics line says it
        kept = total.get("spec_decode_num_accepted_tokens", 0.0)
        drafts = max(total.get("spec_decode_num_drafts", 0.0), 1.0)
        parts.append(f"Draft acceptance rate: {100 * kept / drafted:.1f}%, "
                     f"Mean acceptance length: {1 + kept / drafts:.2f}")  # fmt: skip
        by_pos = sorted((int(k[len(_SPEC_POS) :]), n) for k, n in total.items()
                        if k.startswith(_SPEC_POS))  # fmt: skip
        if by_pos:
            rates = ", ".join(f"{n / drafts:.2f}" for _, n in by_pos)
            parts.append(f"Per-position acceptance rate: {rates}")
    if total.get("kernel_compiles"):  # runner/compile_watch.py: each one made a request wait
        parts.append(f"Kernel compiles: {int(total['kernel_compiles'])}")
    steps = {k[len(_STEPS) :]: n for k, n in total.items() if k.startswith(_STEPS) and n > 0}
    if steps:
        n = sum(steps.values())
        shares = sorted(steps.items(), key=lambda kv: -kv[1])
        parts.append("Steps: " + ", ".join(f"{100 * c / n:.0f}% {path}" for path, c in shares))
    silent = [w for w in workers if "error" in stats.get(w, {})]
    if silent:
        parts.append(f"not answering: {', '.join(silent)}")
    noun = "worker" if len(workers) == 1 else "workers"
    active = bool(running or waiting or queued or any(v > 0 for v in total.values()))
    return f"{role} pool ({len(workers)} {noun}): " + ", ".join(parts), active


async def stats_log_loop(router, interval_s: float, write: Callable[[str], None]) -> None:
    """Every `interval_s`, poll the workers and write the pools' lines, until cancelled. A
    failed poll is logged and the loop goes on."""
    log = StatsLog(time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        try:
            await router.poll_stats()
        except Exception:
            logger.exception("polling the workers' stats for the stats log failed")
            continue
        stamp = time.strftime("%m-%d %H:%M:%S")
        roles, stats = router.worker_roles(), router.worker_stats
        for line in log.lines(time.monotonic(), roles, stats, router.queued()):
            write(f"pdserve: {stamp} {line}")
