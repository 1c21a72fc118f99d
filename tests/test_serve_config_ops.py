"""`pdserve serve` configuration for operating the pools: scaling bounds and autoscale
rules, keys from the environment, pool bounds by placement, Ray's auth mode when
joining a cluster, and the latency summary the dashboard shows."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cluster.metrics import Metrics
from pdserve.cluster.serve_args import ServeConfig, decode_capacity
from pdserve.cluster.serve_flags import add_serve_args, config_from_args, with_env
from pdserve.cluster.serve_placement import Placement, join_auth_env, pool_bounds


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_decode_workers=3, max_decode_workers=2), "0 <= min <= max"),
        (dict(min_prefill_workers=-1), "0 <= min <= max"),
        (dict(gpus_per_worker=-0.5), "--gpus-per-worker"),
        (dict(autoscale=True, decode_workers=5), "outside --min/--max-decode"),
        (dict(autoscale=True, prefill_workers=9), "outside --min/--max-prefill"),
        (dict(autoscale=True, kv_transport="nccl"), "nccl"),
        (dict(autoscale_policy={"decode_kv_hi": 0.9}), "unknown keys"),
        (dict(autoscale_policy={"up_after_s": -1}), "up_after_s"),
        (dict(autoscale_policy={"decode_kv_high": "high"}), "decode_kv_high"),
        (dict(autoscale_policy={"interval_s": 0}), "interval_s"),
        (dict(autoscale_policy=[1]), "mapping"),
        (dict(worker_start_timeout_s=0), "worker_start_timeout_s"),
        (dict(max_waiting_per_decode_worker=-1), "--max-waiting-per-decode-worker"),
        (dict(max_num_seqs=0), "--max-num-seqs"),
        # vLLM serves with no key when given an empty one; here it is a start-up error.
        (dict(api_key=""), "--api-key is empty"),
        (dict(decode_prefix_slack=-1), "--decode-prefix-slack must be >= 0, got -1"),
        (dict(admin_key=" "), "--admin-key is empty"),
        (dict(shutdown_timeout_s=-1), "--shutdown-timeout must be >= 0 seconds"),
        (dict(shutdown_timeout_s=float("nan")), "--shutdown-timeout must be >= 0 seconds"),
    ],
)
def test_bad_scaling_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**kwargs)


def test_keys_come_from_the_environment_only_when_unset():
    env = {"PDSERVE_API_KEY": "from-env", "PDSERVE_ADMIN_KEY": "admin-env"}
    assert with_env(ServeConfig(), env).api_key == "from-env"
    assert with_env(ServeConfig(), env).admin_key == "admin-env"
    assert with_env(ServeConfig(api_key="flag"), env).api_key == "flag"
    assert with_env(ServeConfig(), {"PDSERVE_API_KEY": ""}).api_key is None


def test_flags_parse_into_the_new_keys(monkeypatch):
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(
        ["--ray-address", "auto", "--pool-resources", "--gpus-per-worker", "1", "--autoscale",
         "--max-decode-workers", "8", "--admin-key", "k", "--decode-prefix-slack", "3",
         "--pd-min-prompt-tokens", "512", "--shutdown-timeout", "0"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.ray_address, cfg.pool_resources, cfg.gpus_per_worker) == ("auto", True, 1.0)
    assert (cfg.autoscale, cfg.max_decode_workers, cfg.admin_key) == (True, 8, "k")
    assert cfg.decode_prefix_slack == 3 and ServeConfig().decode_prefix_slack == 8
    assert cfg.pd_min_prompt_tokens == 512 and ServeConfig().pd_min_prompt_tokens == 16
    assert cfg.shutdown_timeout_s == 0 and ServeConfig().shutdown_timeout_s == 10


def test_decode_slots_are_the_running_and_the_waiting_requests():
    """Guards the router's slots per decode worker: max_num_seqs running plus, by
    default, as many again waiting; the flag sets the waiting part (0: none)."""
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert decode_capacity(config_from_args(p.parse_args(["--max-num-seqs", "8"]))) == 16
    args = p.parse_args(["--max-num-seqs", "8", "--max-waiting-per-decode-worker", "0"])
    assert decode_capacity(config_from_args(args)) == 8
    assert decode_capacity(ServeConfig(max_waiting_per_decode_worker=3)) == 64 + 3


def _placement(joined=False, gpus=0, per=0.0) -> Placement:
    return Placement(joined, gpus, per, "127.0.0.1", 1)


def test_pool_bounds():
    cfg = ServeConfig(decode_workers=2, max_decode_workers=3)
    assert pool_bounds(cfg, _placement()) == {"decode": (1, 3), "prefill": (1, 4)}
    colocated = ServeConfig(mode="colocated")
    assert pool_bounds(colocated, _placement())["prefill"] == (0, 0)
    # Workers sharing one local GPU were given KV budgets for their count: it stays.
    shared = pool_bounds(ServeConfig(decode_workers=2), _placement(gpus=1, per=1 / 3))
    assert shared == {"decode": (2, 2), "prefill": (1, 1)}
    # A pool started above its default bound keeps its size reachable.
    big = pool_bounds(ServeConfig(decode_workers=6), _placement(joined=True, gpus=8, per=1.0))
    assert big["decode"] == (1, 6)


def test_joining_uses_a_token_when_one_is_at_hand(tmp_path):
    token = tmp_path / "tok"
    token.write_text("secret")
    joined = ServeConfig(ray_address="auto")
    env = {"RAY_AUTH_TOKEN_PATH": str(token)}
    join_auth_env(joined, env)
    assert env["RAY_AUTH_MODE"] == "token"
    env = {"RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_MODE": "disabled"}
    join_auth_env(joined, env)
    assert env["RAY_AUTH_MODE"] == "disabled"  # an explicit choice stays
    env = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}
    join_auth_env(joined, env)
    assert "RAY_AUTH_MODE" not in env
    env = {"RAY_AUTH_TOKEN": "x"}
    join_auth_env(ServeConfig(), env)  # a local Ray of our own: not touched
    assert "RAY_AUTH_MODE" not in env


def test_latency_summary_buckets():
    m = Metrics("m")
    assert m.latency_summary()["ttft"] == {
        "count": 0, "mean_s": None, "p50_le_s": None, "p90_le_s": None
    }  # fmt: skip
    for v in (0.003, 0.03, 0.04, 0.3, 5000.0):
        m.ttft.observe(v)
    s = m.latency_summary()["ttft"]
    assert s["count"] == 5 and s["mean_s"] == pytest.approx(5000.373 / 5)
    assert s["p50_le_s"] == 0.05  # the 3rd of 5 falls in (0.02, 0.05]
    assert s["p90_le_s"] == "+Inf"  # the 5th is past the last bucket (3600 s)
