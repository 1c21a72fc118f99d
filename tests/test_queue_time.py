"""vLLM's request phases in the metrics: queue, prefill, decode, inference.

A request's queue time is measured where it waits: the engine stamps the seconds from
arrival to its first schedule on the first delta, a prefill worker sends its count in
the KV ticket (late and early tickets), the decode worker reports the ticket's, and the
token stream carries it checked. The server splits each request's timeline with it
(cluster/request_timing.py) and exports the series under `--metrics-prefix`, labelled
with the model name, as vLLM's Grafana dashboards read them.
"""

from __future__ import annotations

import math
import re
import time
from types import SimpleNamespace

import pytest
from conftest import DEVICE
from test_layer_wise import _early_pair
from test_pd_engine import _kw, _prompts, wait_for_tickets

from pdserve.cluster.metrics import Metrics
from pdserve.cluster.request_timing import RequestTiming
from pdserve.cluster.serve_args import ServeConfig
from pdserve.cluster.token_stream import StreamDelta
from pdserve.decode.worker import DecodeWorker
from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport
from pdserve.prefill.worker import PrefillWorker
from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams

# What vLLM's example Grafana dashboard (examples/observability/prometheus_grafana) asks
# for, each filtered by model_name.
VLLM_DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
    "inter_token_latency_seconds_bucket", "time_to_first_token_seconds_bucket",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_success_total", "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
    "request_max_num_generation_tokens_sum",
)  # fmt: skip


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _delta(tokens: int, queue_s: float = 0.0) -> StreamDelta:
    return StreamDelta("r", [7] * tokens, "x" * tokens, None, None, None, 5, 0, None, queue_s)


def test_a_requests_timeline_splits_into_vllms_phases():
    """Guards the split: queue from the first token's choice, prefill the rest of TTFT,
    decode first to last token over every choice, the time per output token of the
    longest choice, and gaps between tokens per choice (choice 1's late start is not a
    gap of choice 0's)."""
    clock, m = _Clock(), Metrics("m")
    timing = RequestTiming(100.0, 2, clock)
    clock.t = 100.5
    timing.on_delta(m, 1, _delta(0, queue_s=0.4))  # choice 1: a delta without tokens first
    clock.t = 101.0
    timing.on_delta(m, 0, _delta(1, queue_s=0.3))
    clock.t = 101.25
    timing.on_delta(m, 1, _delta(1))  # its queue time came on its first delta
    clock.t = 102.0
    timing.on_delta(m, 0, _delta(2))
    clock.t = 104.0
    timing.on_delta(m, 1, _delta(3))
    assert timing.first_token == 101.0 and timing.max_choice_tokens == 4
    assert timing.phases() == pytest.approx(
        {"queue": 0.3, "prefill": 0.7, "decode": 3.0, "inference": 3.7, "per_output_token": 1.0}
    )
    m.finish(SimpleNamespace(kind="completion", params=SamplingParams(n=2, max_tokens=9)),
             timing, 7, 5, ["length", "length"])  # fmt: skip
    assert _sample(m, "time_to_first_token_seconds_sum") == pytest.approx(1.0)
    # per choice: choice 0 one gap of 1.0 over 2 tokens, choice 1 one of 2.75 over 3 tokens
    assert _sample(m, "inter_token_latency_seconds_sum") == pytest.approx(0.5 + 2.75 / 3)
    assert _sample(m, "inter_token_latency_seconds_count") == 2
    assert _sample(m, "request_queue_time_seconds_sum") == pytest.approx(0.3)
    assert _sample(m, "request_prefill_time_seconds_sum") == pytest.approx(0.7)
    assert _sample(m, "request_inference_time_seconds_sum") == pytest.approx(3.7)
    assert _sample(m, "request_max_num_generation_tokens_sum") == 4
    assert _sample(m, "request_params_n_sum") == 2
    assert _sample(m, "request_params_max_tokens_sum") == 9
    # Another host's clock can make a worker's queue time exceed the TTFT seen here.
    late = RequestTiming(100.0, 1, clock)
    clock.t = 100.2
    late.on_delta(m, 0, _delta(1, queue_s=0.5))
    assert late.phases() == pytest.approx(
        {"queue": 0.2, "prefill": 0.0, "decode": 0.0, "inference": 0.0, "per_output_token": None}
    )
    assert RequestTiming(100.0, 1, clock).phases() is None  # no token came


def _sample(m: Metrics, name: str) -> float:
    text = m.render(None)
    (line,) = [x for x in text.splitlines() if x.startswith(f"pdserve:{name}{{")]
    return float(line.rsplit(" ", 1)[1])


def test_metrics_prefix_and_model_label():
    """Guards what vLLM's dashboards query: with the prefix `vllm:` every series of theirs
    exists under vLLM's name, and every sample carries model_name; a prefix Prometheus
    would refuse is an error naming the flag, from the server's config too."""
    m = Metrics("SmolLM2-135M-Instruct", "vllm:")
    m.requests.labels("chat", "stop").inc()
    text = m.render(None)
    samples = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert samples and all(x.startswith("vllm:") for x in samples)
    assert all('model_name="SmolLM2-135M-Instruct"' in x for x in samples)
    names = {re.split(r"[{ ]", x)[0].removeprefix("vllm:") for x in samples}
    assert set(VLLM_DASHBOARD_SERIES) <= names, set(VLLM_DASHBOARD_SERIES) - names
    assert 'vllm:request_success_total{finished_reason="stop",kind="chat",model_name=' in text
    assert "pdserve:" not in text
    for bad in ("", "1x", "vllm-", "a b"):
        with pytest.raises(ValueError, match="--metrics-prefix"):
            Metrics("m", bad)
    with pytest.raises(ValueError, match="--metrics-prefix"):
        ServeConfig(metrics_prefix="vllm/")


def test_the_token_stream_checks_the_queue_time():
    d = _delta(1, queue_s=0.125)
    assert StreamDelta.from_wire(d.to_wire()) == d
    for bad in (-0.5, math.nan, math.inf, "0.1", None):
        wire = {**d.to_wire(), "u": bad}
        with pytest.raises(ValueError, match="queue time"):
            StreamDelta.from_wire(wire)
    # The cached-count revision flag travels too (a recomputed prompt, test_pd_engine.py).
    revised = StreamDelta("r", [7], "x", None, None, None, 5, 0, None, 0.0, True)
    assert StreamDelta.from_wire(revised.to_wire()) == revised
    assert revised.cached_after(32) == 0 and d.cached_after(32) == 32
    with pytest.raises(ValueError, match="revision flag"):
        StreamDelta.from_wire({**d.to_wire(), "k": 1})


def _first_deltas(step, has_work) -> dict[str, float]:
    """Each request's first delta's queue_s, stepping until nothing is left."""
    first: dict[str, float] = {}
    deadline = time.monotonic() + 120
    while has_work():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for d in step():
            first.setdefault(d.request_id, d.queue_s)
    return first


def test_the_engine_stamps_the_wait_before_the_first_schedule(tiny_llama_dir):
    """Guards the engine's measure: with one running slot, a request that arrived beside
    another waits for all of the other's steps, and its first delta says so; the first
    one's wait is only until the next step."""
    eng = Engine.from_args(
        model=tiny_llama_dir, device=DEVICE, dtype="float32", max_model_len=64, block_size=8,
        max_num_seqs=1,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng.add_request("a", [5, 7, 9, 11], params)
    eng.add_request("b", [6, 7, 9, 11], params)
    added = time.monotonic()
    first: dict[str, float] = {}
    a_done = None
    while eng.has_unfinished():
        for d in eng.step():
            first.setdefault(d.request_id, d.queue_s)
            if d.request_id == "a" and d.finish_reason is not None:
                a_done = time.monotonic()
    assert a_done is not None
    assert 0 <= first["a"] < a_done - added <= first["b"], (first, a_done - added)


@pytest.mark.parametrize("early", [False, True], ids=["ticket", "early_ticket"])
def test_a_pulled_request_reports_the_prefill_workers_queue_time(tiny_qwen3_dir, early):
    """Guards the PD hand-off of the queue time: the prefill worker (one running slot)
    stamps each ticket, late or early, with its request's wait there; the second request
    waited for the first's prompt; the decode worker's first delta for each request
    reports its ticket's number exactly (not its own wait)."""
    extra = dict(max_num_seqs=1, max_num_batched_tokens=16)
    prompts = _prompts(2, 990, seed=3, lo=40, hi=60)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    if early:
        prefill, decode = _early_pair(tiny_qwen3_dir, **extra)
    else:
        registry = LocalRegistry()
        prefill = PrefillWorker(
            Engine.from_args(**_kw(tiny_qwen3_dir, **extra)), "P0", registry=registry
        )
        transports = {"local": LocalTransport(registry, prefill.source.layout_hash)}
        decode = DecodeWorker(_kw(tiny_qwen3_dir, **extra), "D0", transports)
    try:
        for i, p in enumerate(prompts):
            prefill.submit(str(i), p, params)
        results = [r for r in wait_for_tickets(prefill, 2, 120) if r.ticket is not None]
        tickets = {r.request_id: r.ticket for r in results}
        assert len(tickets) == 2 and all((t.first_token is None) == early for t in tickets.values())
        assert 0 <= tickets["0"].queue_s < tickets["1"].queue_s, tickets
        for rid, ticket in tickets.items():
            decode.submit(rid, prompts[int(rid)], params, ticket)

        def step():
            if prefill.has_work():  # an early ticket's first token is sampled there
                prefill.step()
            return decode.step()

        got = _first_deltas(step, lambda: prefill.has_work() or decode.has_work())
        assert got == {rid: t.queue_s for rid, t in tickets.items()}
    finally:
        prefill.close()
        decode.close()
