"""The autoscaling policy (cluster/autoscale.py): levels from pool signals, and when a
level held long enough resizes a pool, one worker at a time, within bounds."""

from __future__ import annotations

import pytest

from pdserve.cluster.autoscale import AutoscaleConfig, Autoscaler, decode_level, prefill_level

CFG = AutoscaleConfig(up_after_s=20, down_after_s=300, cooldown_s=60)


@pytest.mark.parametrize(
    "stats, level",
    [
        ([{"kv_cache_usage_perc": 0.9, "num_requests_waiting": 0}], "high"),
        ([{"kv_cache_usage_perc": 0.5, "num_requests_waiting": 5}], "high"),  # queueing
        ([{"kv_cache_usage_perc": 0.5, "num_requests_waiting": 0}], "ok"),
        ([{"kv_cache_usage_perc": 0.1, "num_requests_waiting": 0}], "low"),
        ([{"kv_cache_usage_perc": 0.1, "num_requests_waiting": 1}], "ok"),  # busy, not full
        # the mean over workers: one full and one empty is not "high"
        ([{"kv_cache_usage_perc": 0.95}, {"kv_cache_usage_perc": 0.05}], "ok"),
        ([], "low"),  # no stats yet: nothing says it is busy
    ],
)
def test_decode_level(stats, level):
    assert decode_level(stats, CFG)[0] == level


def test_requests_queued_in_the_router_count_as_waiting():
    """Guards the router's queue as a signal: with every decode worker full the backlog
    waits in the router, not on the workers, and must still read as waiting."""
    calm = [{"kv_cache_usage_perc": 0.1, "num_requests_waiting": 0}] * 2
    assert decode_level(calm, CFG, queued=5) == (
        "high",
        {"kv_cache_usage_perc": 0.1, "waiting_per_worker": 2.5},
    )
    assert decode_level(calm, CFG, queued=1)[0] == "ok"  # busy, not "low"


@pytest.mark.parametrize(
    "tokens, level",
    [([40000, 0], "high"), ([20000, 20000], "high"), ([5000], "ok"), ([0, 0], "low")],
)
def test_prefill_level(tokens, level):
    assert prefill_level(tokens, CFG)[0] == level


def test_a_high_level_must_hold_before_a_worker_is_added():
    a = Autoscaler(CFG, {"decode": (1, 3)})
    assert a.decide("decode", "high", 1, 0, now=0) is None
    assert a.decide("decode", "high", 1, 0, now=19) is None
    assert a.decide("decode", "high", 1, 0, now=20) == 2


def test_a_level_that_changes_restarts_the_clock():
    a = Autoscaler(CFG, {"decode": (1, 3)})
    a.decide("decode", "high", 1, 0, now=0)
    a.decide("decode", "ok", 1, 0, now=15)
    assert a.decide("decode", "high", 1, 0, now=30) is None  # high again only since 30
    assert a.decide("decode", "high", 1, 0, now=50) == 2


def test_one_step_then_cooldown_and_a_fresh_hold():
    a = Autoscaler(CFG, {"decode": (1, 4)})
    a.decide("decode", "high", 1, 0, now=0)
    assert a.decide("decode", "high", 1, 0, now=20) == 2
    assert a.decide("decode", "high", 2, 0, now=60) is None  # cooldown until 80
    assert a.decide("decode", "high", 2, 0, now=80) == 3  # held since 20 and cooled down


def test_no_step_while_a_worker_is_starting():
    a = Autoscaler(CFG, {"decode": (1, 4)})
    a.decide("decode", "high", 2, 1, now=0)
    assert a.decide("decode", "high", 2, 1, now=100) is None
    assert a.decide("decode", "high", 2, 0, now=101) == 3


def test_shrinks_after_a_long_low_and_never_below_min_or_above_max():
    a = Autoscaler(CFG, {"decode": (1, 2), "prefill": (1, 1)})
    a.decide("decode", "low", 2, 0, now=0)
    assert a.decide("decode", "low", 2, 0, now=299) is None
    assert a.decide("decode", "low", 2, 0, now=300) == 1
    assert a.decide("decode", "low", 1, 0, now=10_000) is None  # at the minimum
    a.decide("prefill", "high", 1, 0, now=0)
    assert a.decide("prefill", "high", 1, 0, now=10_000) is None  # at the maximum


def test_a_pool_outside_its_bounds_is_brought_back():
    a = Autoscaler(CFG, {"decode": (2, 3)})
    assert a.decide("decode", "ok", 1, 0, now=0) == 2
    b = Autoscaler(CFG, {"decode": (1, 2)})
    assert b.decide("decode", "ok", 4, 0, now=0) == 2
