"""Prometheus metrics: vLLM's names where the meaning is shared, plus PD series.

Request series (latency, vLLM's request phases, token counts, parameters) are observed
by the HTTP layer from each request's `RequestTiming`; the router's view (workers' stats,
tier, pools, PD decisions) comes from cluster/metrics_workers.py at each scrape. One
registry per app (no process-global registry), rendered in the text format under the
configured prefix, every sample labelled with the served model's name.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdserve.cluster.metric_names import PREFIX, check_prefix
from pdserve.cluster.metrics_workers import WorkerCollector
from pdserve.cluster.request_timing import RequestTiming

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300, 600, 1800, 3600,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_N_BUCKETS = (1, 2, 5, 10, 20)


class Metrics:
    """The server's registry. Series are built under `PREFIX` and exported under
    `prefix` (`--metrics-prefix`; `vllm:` makes vLLM's Grafana dashboards read them),
    each sample labelled with the served `model_name` as vLLM labels its own."""

    def __init__(self, model_name: str, prefix: str = PREFIX) -> None:
        check_prefix(prefix)
        self.model_name, self.prefix = model_name, prefix
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between a choice's output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency")
        # vLLM's request phases (cluster/request_timing.py says how they are split).
        self.queue = histogram(
            "request_queue_time_seconds",
            "Arrival to the prompt's first schedule (router and worker queues)",
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "The prompt's first schedule to the first token"
        )
        self.decode = histogram("request_decode_time_seconds", "First token to last token")
        self.inference = histogram(
            "request_inference_time_seconds", "The prompt's first schedule to the last token"
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first (the longest choice)",
        )
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
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Output tokens of a request's longest choice",
            _TOKEN_BUCKETS,
        )
        self.params_n = histogram("request_params_n", "The n a request asked for", _N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens a request ran with", _TOKEN_BUCKETS
        )
        self._router = None
        r.register(WorkerCollector(lambda: self._router))

    def finish(
        self,
        req: Any,
        timing: RequestTiming,
        num_tokens: int,
        prompt_tokens: int = 0,
        finish_reasons: list[str | None] | tuple = (),
    ) -> None:
        """A request answered: its latency and phases, its token counts and parameters,
        and how each choice ended."""
        self.e2e.observe(timing.now() - timing.start)
        phases = timing.phases()
        if phases is not None:
            self.queue.observe(phases["queue"])
            self.prefill.observe(phases["prefill"])
            self.decode.observe(phases["decode"])
            self.inference.observe(phases["inference"])
            if phases["per_output_token"] is not None:
                self.tpot.observe(phases["per_output_token"])
        for reason in finish_reasons or ["stop"]:
            self.requests.labels(req.kind, reason or "unknown").inc()
        self.generation_tokens.inc(num_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(num_tokens)
        self.max_generation_tokens.observe(timing.max_choice_tokens)
        self.params_n.observe(req.params.n)
        self.params_max_tokens.observe(req.params.max_tokens)

    def pooled(self, kind: str, prompt_lens: list[int], seconds: float) -> None:
        """A pooling request answered (`embedding`, `classify`, `score`, `rerank`): each of
        its inputs counts as a finished request of that kind with its prompt tokens."""
        self.e2e.observe(seconds)
        self.requests.labels(kind, "stop").inc(len(prompt_lens))
        self.prompt_tokens.inc(sum(prompt_lens))
        for n in prompt_lens:
            self.request_prompt_tokens.observe(n)

    def render(self, router: Any) -> str:
        self._router = router
        return generate_latest(_Exported(self)).decode()

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
            for name, h in (
                ("queue", self.queue),
                ("prefill", self.prefill),
                ("ttft", self.ttft),
                ("itl", self.itl),
                ("decode", self.decode),
                ("e2e", self.e2e),
            )  # fmt: skip
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


class _Exported:
    """The registry as /metrics shows it: `PREFIX` swapped for the configured prefix and
    a `model_name` label first on every sample (the metric objects are built afresh on
    each collect, so renaming them changes nothing kept)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        prefix, model = self.metrics.prefix, self.metrics.model_name
        for metric in self.metrics.registry.collect():
            metric.name = prefix + metric.name.removeprefix(PREFIX)
            metric.samples = [
                s._replace(
                    name=prefix + s.name.removeprefix(PREFIX),
                    labels={"model_name": model, **s.labels},
                )
                for s in metric.samples
            ]
            yield metric
