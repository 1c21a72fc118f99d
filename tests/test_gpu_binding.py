"""Whole-GPU worker actors see their own GPU first and the node's others after it
(cluster/gpu_binding.py), on a real local Ray instance that declares two GPUs. No GPU is
touched: the test reads the CUDA_VISIBLE_DEVICES each actor sets for itself before CUDA
starts, with the options `start_worker` gives real workers."""

from __future__ import annotations

import os
import sys

import pytest
import ray

from pdserve.cluster.gpu_binding import (
    NODE_GPUS_ENV,
    actor_env,
    bind_visible_gpus,
    node_gpu_ids,
    visible_order,
)
from pdserve.cluster.ray_pool import PoolSpec, actor_options
from pdserve.cluster.serve_args import ServeConfig


class _Probe:
    """What a worker service does first, then what it sees."""

    def __init__(self) -> None:
        bind_visible_gpus()

    def seen(self) -> tuple[str, list[str]]:
        return os.environ.get("CUDA_VISIBLE_DEVICES", ""), [str(g) for g in ray.get_gpu_ids()]


def test_visible_order_puts_the_assigned_gpus_first():
    assert visible_order(["1"], ["0", "1"]) == ["1", "0"]
    assert visible_order(["2", "0"], ["0", "1", "2", "3"]) == ["2", "0", "1", "3"]
    assert visible_order(["0"], ["0"]) == ["0"]


def test_node_gpu_ids_follow_the_driver_visibility(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert node_gpu_ids(2) == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert node_gpu_ids(2) == ["0", "1"]


def test_bind_is_a_no_op_outside_whole_gpu_actors(monkeypatch):
    monkeypatch.delenv(NODE_GPUS_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    bind_visible_gpus()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"


def test_whole_gpu_workers_see_their_gpu_first_and_the_others_after():
    spec = PoolSpec({}, 1, 1, "tcp://127.0.0.1:1", gpus_per_worker=1.0,
                    actor_env=actor_env(["0", "1"]))  # fmt: skip
    # The probe travels by value: the actors' processes cannot import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        probes = [
            ray.remote(_Probe).options(**actor_options(spec, f"decode-{i}")).remote()
            for i in range(2)
        ]
        seen = ray.get([p.seen.remote() for p in probes], timeout=120)
    finally:
        ray.shutdown()
    orders = sorted(visible for visible, _ in seen)
    assert orders == ["0,1", "1,0"], seen  # both GPUs visible to each, in different orders
    for visible, assigned in seen:
        assert len(assigned) == 1 and visible.split(",")[0] == assigned[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
        ({"gpu_memory_utilization": 0.0}, "--gpu-memory-utilization"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
        ({"pd_max_prefill_queue_tokens": -1}, "--pd-max-prefill-queue-tokens"),
        ({"pd_min_prompt_tokens": -1}, "--pd-min-prompt-tokens"),
        (
            {"kv_layer_wise": True, "kv_transport": "cuda_ipc"},
            "--kv-layer-wise streams KV over tcp",
        ),
        ({"kv_layer_wise": True, "kv_transport": "nccl"}, "--kv-transport nccl"),
    ],
)
def test_serve_config_refuses_bad_engine_limits(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, local_gpu, expected",
    [
        ({}, True, "cuda_ipc"),  # the default on a GPU box: a device copy, not tcp loopback
        ({}, False, "tcp"),  # CPU workers, or a joined cluster (pools may be on other nodes)
        ({"kv_layer_wise": True}, True, "tcp"),  # layer-wise streams over tcp
        ({"mode": "colocated"}, True, "tcp"),  # no KV moves
        ({"kv_transport": "tcp"}, True, "tcp"),  # a named transport is kept
        ({"kv_transport": "nccl"}, False, "nccl"),
    ],
)
def test_auto_kv_transport(kwargs, local_gpu, expected):
    from pdserve.cluster.serve_placement import kv_transport

    assert kv_transport(ServeConfig(**kwargs), local_gpu) == expected
    assert ServeConfig().kv_transport == "auto"


def test_serve_batched_tokens_default_follows_vllm_on_cpu():
    """On the CPU the serve default stays at 2,048 tokens per step (vLLM's for small
    devices), and without chunked prefill it grows to max_model_len (vLLM's rule: every
    prompt must fit a step); the GPU branch (8,192 on >= 70 GiB) runs in the two-GPU
    benchmarks."""
    from types import SimpleNamespace

    from pdserve.cluster.serve_sizing import default_batched_tokens

    ecfg = SimpleNamespace(
        runner=SimpleNamespace(device="cpu"), model=SimpleNamespace(max_model_len=4096)
    )
    assert ServeConfig().max_num_batched_tokens is None
    assert default_batched_tokens(ServeConfig(), ecfg) == 2048
    unchunked = ServeConfig(enable_chunked_prefill=False)
    assert default_batched_tokens(unchunked, ecfg) == 4096
    ecfg.model.max_model_len = 1024
    assert default_batched_tokens(unchunked, ecfg) == 2048
