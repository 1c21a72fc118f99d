"""/metrics' series from the router's view: each worker's last polled stats (running and
waiting requests, KV usage, prefix-cache counters, transfer bytes and seconds, recompute
fallbacks, lease expiries, steps by path) with `role` and `worker` labels, the tier's
counts, the pools by state, the router's queue and its PD decisions. Built afresh at each
scrape (cluster/metrics.py exports them with the request series).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.cluster.metric_names import PREFIX

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
    "prefix_waits": (
        "worker_prefix_waits",
        "counter",
        "Steps a prompt waited for the same prefix being computed beside it, to hit it",
    ),
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
    "spec_decode_num_drafts": (
        "spec_decode_num_drafts",
        "counter",
        "Steps in which a request verified a draft",
    ),
    "spec_decode_num_draft_tokens": (
        "spec_decode_num_draft_tokens",
        "counter",
        "Draft tokens verified",
    ),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "counter",
        "Draft tokens kept",
    ),
    "spec_sync_steps": (
        "worker_spec_sync_steps",
        "counter",
        "Steps with drafts under async scheduling, waited for where they launched",
    ),
    "spec_drains": (
        "worker_spec_drains",
        "counter",
        "Steps in flight read before the next was planned, as a request would draft",
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


class WorkerCollector:
    """The router's view at scrape time: `router_of()` is the router /metrics renders
    for (None: nothing)."""

    def __init__(self, router_of: Callable[[], Any]) -> None:
        self.router_of = router_of

    def describe(self):
        return []

    def collect(self):
        router = self.router_of()
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
        yield _counts_by(
            router, roles, "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens kept, by their position in the draft (0 first)",
            "spec_decode_accepted_by_position", "position",
        )  # fmt: skip
        yield from _path_families(router, roles)
        yield _lora_info(router, roles)
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


def _lora_info(router: Any, roles: dict[str, str]) -> GaugeMetricFamily:
    """vLLM's `lora_requests_info` (which LoRA-aware gateways read, with the `vllm:`
    prefix): per worker, its adapter slots and the adapters its running and waiting
    requests name (comma-separated); the value is when the worker was polled."""
    info = GaugeMetricFamily(
        PREFIX + "lora_requests_info",
        "Running stats on LoRA requests (adapters of running and waiting requests)",
        labels=["role", "worker", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    names = router.loras  # workers run adapters by key; the series speaks names
    for worker, stats in router.worker_stats.items():
        lora = stats.get("lora_requests")
        if isinstance(lora, dict):
            running, waiting = (
                ",".join(names.served_name(k) for k in lora.get(which) or ())
                for which in ("running", "waiting")
            )
            info.add_metric(
                [roles.get(worker, "?"), worker, str(lora.get("max_lora")), running, waiting],
                time.time(),
            )
    return info


# Engine.execution_path
_PATH_KEYS = (
    "runner",
    "decode_attention",
    "norms",
    "graph_scope",
    "experts",
    "weights",
    "kv_cache",
    "speculative",
)


def _path_families(router: Any, roles: dict[str, str]):
    """What each worker's engine runs (an info gauge, 1) and its steps by path: the
    operator sees whether decode steps really take the CUDA graphs."""
    info = GaugeMetricFamily(
        PREFIX + "engine_info",
        "The engine's execution path (runner, decode attention kernel, norms, graph scope, "
        "MoE experts, weights dtype, KV cache dtype, speculative decoding)",
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
