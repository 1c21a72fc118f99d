"""Prometheus metrics: vLLM's names where the meaning is shared, plus PD series.

Latency histograms are observed by the HTTP layer; worker-side numbers (running and
waiting requests, KV usage, prefix-cache counters, transfer bytes and seconds, recompute
fallbacks, lease expiries) are read from the workers' last polled stats and exported
with `role` and `worker` labels; router decisions are counted by reason. One registry
per app (no process-global registry), rendered in the text format.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "pdserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# stats key -> (metric name, kind, help)
_WORKER_SERIES = {
    "num_requests_running": ("num_requests_running", "gauge", "Requests running on the worker"),
    "num_requests_waiting": ("num_requests_waiting", "gauge", "Requests waiting (or loading KV)"),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gauge", "KV cache usage, 1 = full"),
    "prefix_cache_queries": ("prefix_cache_queries", "counter", "Prompt tokens looked up"),
    "prefix_cache_hits": ("prefix_cache_hits", "counter", "Prompt tokens found in the cache"),
    "num_preemptions": ("num_preemptions", "counter", "Requests preempted"),
    "prompt_tokens_computed": (
        "worker_prompt_tokens_computed",
        "counter",
        "Prompt tokens the worker computed (prefix-cache hits and pulled KV not counted)",
    ),
    "generation_tokens": ("worker_generation_tokens", "counter", "Tokens the worker sampled"),
    "kernel_compiles": (
        "worker_kernel_compiles",
        "counter",
        "Triton kernels compiled after the warm-up (a request waited for each)",
    ),
    "structured_requests": (
        "worker_structured_requests",
        "counter",
        "Requests under structured output (JSON schema, JSON mode, regex, choice)",
    ),
    "grammar_compiles": (
        "worker_grammar_compiles",
        "counter",
        "Structured-output constraints compiled for the worker's tokenizer (new ones only)",
    ),
    "grammar_compile_seconds": (
        "worker_grammar_compile_seconds",
        "counter",
        "Seconds the worker's loop spent compiling them",
    ),
    "transfer_bytes": ("kv_transfer_bytes", "counter", "KV bytes pulled"),
    "transfer_seconds": ("kv_transfer_seconds", "counter", "Seconds spent pulling KV"),
    "recompute_fallbacks": ("kv_recompute_fallbacks", "counter", "Failed pulls recomputed"),
    "transfer_failures": ("kv_transfer_failures", "counter", "Failed pulls failed (policy fail)"),
    "lease_expiries": ("kv_lease_expiries", "counter", "Leases that expired unclaimed"),
    "lease_extensions": (
        "kv_lease_extensions",
        "counter",
        "Leases a decode worker extended for requests queued on it",
    ),
    "lease_extension_failures": (
        "kv_lease_extension_failures",
        "counter",
        "Heartbeats of a decode worker that did not extend a queued request's lease",
    ),
    "early_tickets": (
        "kv_early_tickets",
        "counter",
        "Tickets sent before the prompt's forward (layer-wise)",
    ),
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens", _LATENCY_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency", _LATENCY_BUCKETS)
        # Per choice (as vLLM counts each of a request's n sequences), by how it ended.
        self.requests = Counter(
            PREFIX + "request_success", "Finished requests", ["kind", "finished_reason"],
            registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens", registry=r)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a request", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Output tokens of a request", _TOKEN_BUCKETS
        )
        self._router = None
        r.register(_RouterCollector(self))

    def finish(
        self,
        req: Any,
        start: float,
        num_tokens: int,
        prompt_tokens: int = 0,
        finish_reasons: list[str | None] | tuple = (),
    ) -> None:
        """A request answered: its latency, its token counts, and how each choice ended."""
        self.e2e.observe(time.monotonic() - start)
        for reason in finish_reasons or ["stop"]:
            self.requests.labels(req.kind, reason or "unknown").inc()
        self.generation_tokens.inc(num_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(num_tokens)

    def render(self, router: Any) -> str:
        self._router = router
        return generate_latest(self.registry).decode()

    def totals(self) -> dict[str, float]:
        """Since start: output tokens and finished requests (the page turns them into rates
        between two polls)."""
        requests = sum(
            s.value for m in self.requests.collect() for s in m.samples if s.name.endswith("_total")
        )
        tokens = next(
            s.value
            for m in self.generation_tokens.collect()
            for s in m.samples
            if s.name.endswith("_total")
        )
        return {"generation_tokens": tokens, "requests": requests}

    def latency_summary(self) -> dict[str, dict]:
        """Since start, per latency histogram: count, mean, and the bucket bounds that
        hold the median and the 90th percentile (what the dashboard shows)."""
        return {
            name: histogram_summary(h)
            for name, h in (("ttft", self.ttft), ("itl", self.itl), ("e2e", self.e2e))
        }


def histogram_summary(hist: Histogram) -> dict:
    """count, mean_s, and p50_le_s / p90_le_s: the upper bound of the bucket where that
    quantile falls (None with no observations; "+Inf" past the last finite bucket)."""
    samples = {}
    buckets = []
    for metric in hist.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            else:
                samples[s.name.rsplit("_", 1)[1]] = s.value
    count = samples.get("count", 0.0)
    out: dict = {"count": int(count), "mean_s": samples["sum"] / count if count else None}
    for q in (50, 90):
        bound = None
        if count:
            bound = next(le for le, n in sorted(buckets) if n >= count * q / 100)
        out[f"p{q}_le_s"] = "+Inf" if bound == float("inf") else bound  # JSON has no inf
    return out


class _RouterCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        router = self.metrics._router
        if router is None:
            return
        families = {}
        for key, (name, kind, help_) in _WORKER_SERIES.items():
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            families[key] = cls(PREFIX + name, help_, labels=["role", "worker"])
        roles = router.worker_roles()
        for worker, stats in router.worker_stats.items():
            for key, fam in families.items():
                if isinstance(stats.get(key), int | float) and not isinstance(stats[key], bool):
                    fam.add_metric([roles.get(worker, "?"), worker], float(stats[key]))
        yield from families.values()
        yield _counts_by(
            router, roles, "kv_transfer_pulls", "KV pulls by transport",
            "pulls_by_transport", "transport",
        )  # fmt: skip
        yield _counts_by(
            router, roles, "kv_early_first_tokens",
            "Early tickets' first tokens by how they reached the decode worker: relayed "
            "by the router ahead of the KV, or at the end of the pull",
            "first_tokens_by_source", "source",
        )  # fmt: skip
        yield from _path_families(router, roles)
        failures = CounterMetricFamily(
            PREFIX + "worker_stats_failures",
            "Stats polls a worker did not answer in time (its series then show its last stats)",
            labels=["role", "worker"],
        )
        for worker, n in router.stats_failures.items():
            failures.add_metric([roles.get(worker, "?"), worker], n)
        yield failures
        tier = GaugeMetricFamily(PREFIX + "kv_tier_blocks", "KV blocks held by the tier actor")
        tier_puts = CounterMetricFamily(
            PREFIX + "kv_tier_puts", "Blocks written behind to the tier"
        )
        tier_hits = CounterMetricFamily(PREFIX + "kv_tier_hits", "Blocks found in the tier")
        tier_loaded = CounterMetricFamily(
            PREFIX + "kv_tier_loaded", "Blocks read back from the tier into a worker"
        )
        if isinstance(router.tier_stats.get("num_blocks"), int):
            tier.add_metric([], router.tier_stats["num_blocks"])
            tier_puts.add_metric([], router.tier_stats.get("puts", 0))
            tier_hits.add_metric([], router.tier_stats.get("hits", 0))
            tier_loaded.add_metric([], router.tier_stats.get("loaded", 0))
        yield from (tier, tier_puts, tier_hits, tier_loaded)
        pools = GaugeMetricFamily(
            PREFIX + "pool_workers",
            "Workers of each pool by state (starting, ready, draining)",
            labels=["role", "state"],
        )
        for role in ("prefill", "decode"):
            for state in ("starting", "ready", "draining"):
                pools.add_metric([role, state], router.pool_states.get((role, state), 0))
        yield pools
        queued = GaugeMetricFamily(
            PREFIX + "router_requests_queued",
            "Requests waiting in the router for a decode slot (every decode worker full)",
        )
        queued.add_metric([], router.queued())
        yield queued
        decisions = CounterMetricFamily(
            PREFIX + "pd_decisions", "Remote-prefill decisions by reason", labels=["reason"]
        )
        for reason, n in router.decisions.items():
            decisions.add_metric([reason], n)
        yield decisions
        failures = CounterMetricFamily(
            PREFIX + "pd_prefill_failures", "Failed remote prefills by error", labels=["error"]
        )
        for reason, n in router.prefill_failures.items():
            failures.add_metric([reason], n)
        yield failures


def _counts_by(
    router: Any, roles: dict[str, str], name: str, doc: str, stat: str, label: str
) -> CounterMetricFamily:
    """A counter per worker and `label` value from each worker's `stat` map of counts."""
    family = CounterMetricFamily(PREFIX + name, doc, labels=["role", "worker", label])
    for worker, stats in router.worker_stats.items():
        for value, n in (stats.get(stat) or {}).items():
            family.add_metric([roles.get(worker, "?"), worker, value], n)
    return family


_PATH_KEYS = ("runner", "decode_attention", "norms", "graph_scope")  # Engine.execution_path


def _path_families(router: Any, roles: dict[str, str]):
    """What each worker's engine runs (an info gauge, 1) and its steps by path: the
    operator sees whether decode steps really take the CUDA graphs."""
    info = GaugeMetricFamily(
        PREFIX + "engine_info",
        "The engine's execution path (runner, decode attention kernel, norms, graph scope)",
        labels=["role", "worker", *_PATH_KEYS],
    )
    steps = CounterMetricFamily(
        PREFIX + "engine_steps", "Engine steps by what ran them", labels=["role", "worker", "path"]
    )
    for worker, stats in router.worker_stats.items():
        role = roles.get(worker, "?")
        path = stats.get("execution_path")
        if isinstance(path, dict):
            info.add_metric([role, worker, *(str(path.get(k, "?")) for k in _PATH_KEYS)], 1.0)
        for name, n in (stats.get("steps_by_path") or {}).items():
            steps.add_metric([role, worker, name], n)
    yield info
    yield steps
