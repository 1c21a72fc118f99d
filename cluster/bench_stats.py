"""Latency statistics for `pdserve bench`: percentiles, summaries, goodput. Pure functions.

Percentiles use linear interpolation between closest ranks, the same rule as
`numpy.percentile(x, q)` with its default `method="linear"`: with `x` sorted and
`r = q / 100 * (n - 1)`, the result is `x[floor(r)] + (r - floor(r)) * (x[ceil(r)] - x[floor(r)])`.
So p50 of [1, 2, 3, 4] is 2.5, and p90 of [10, 20, 30, 40, 50] is 46.

This module knows nothing about HTTP: it takes per-request numbers in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """{mean, p50, p90, p95, p99}; all None for an empty sample (e.g. TPOT when every
    request produced one token), so a JSON reader sees null rather than a fake 0."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not values:
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {"mean": sum(values) / len(values)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float] | None:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput takes METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, got {item!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it. Times in ms; `tpot_ms` is None with < 2 tokens."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: tuple[float, ...] = ()
    error: str | None = None


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """DistServe's goodput criterion: a completed request counts only if it meets every
    SLO. A request with one output token has no TPOT, so it cannot miss a TPOT SLO."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft_ms, "tpot": r.tpot_ms, "e2el": r.e2el_ms}
    return all(values[k] is None or values[k] <= slo for k, slo in slos.items())


def aggregate(
    results: Sequence[RequestResult], duration_s: float, slos: dict[str, float] | None
) -> dict:
    """The report's numbers (field names are the JSON contract of `pdserve bench`)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    good = None if slos is None else sum(meets_slos(r, slos) for r in done) / duration_s
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": summarize([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "tpot_ms": summarize([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": summarize([x for r in done for x in r.itl_ms]),
        "e2el_ms": summarize([r.e2el_ms for r in done if r.e2el_ms is not None]),
        "goodput": good,
        "slos_ms": slos,
    }
