"""A controller actor on a real local Ray instance, as the controller and scaling tests
drive it: tiny-model workers on the CPU, a ZMQ sink for the decode workers' tokens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray
import zmq

from pdserve.cluster.controller import Controller
from pdserve.cluster.ray_pool import PoolSpec
from pdserve.cluster.serve_placement import LOCAL_RAY_SYSTEM_CONFIG


def tiny_spec(model_dir: str, endpoint: str, num_prefill: int = 1, num_decode: int = 1,
              **kw) -> PoolSpec:  # fmt: skip
    return PoolSpec(
        engine_kwargs=dict(model=model_dir, dtype="float32", device="cpu", max_model_len=256),
        num_prefill=num_prefill,
        num_decode=num_decode,
        stream_endpoint=endpoint,
        **kw,
    )


@contextmanager
def controller_on_ray(
    model_dir: str, num_decode: int, bounds: dict | None = None, stream: str | None = None
) -> Iterator[object]:
    """Ray up, a started controller (health every 0.5 s) over 1 prefill and `num_decode`
    decode workers; stopped and Ray down at the end, even after a failed stop (so the next
    module's ray.init finds no Ray). The decode workers stream tokens to `stream`, where
    the caller binds a router's subscriber; without one, to a sink of our own."""
    ray.init(
        num_cpus=2, include_dashboard=False, logging_level="ERROR",
        _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )  # fmt: skip
    sink = zmq.Context.instance().socket(zmq.PULL)
    try:
        if stream is None:
            stream = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
        spec = tiny_spec(model_dir, stream, num_decode=num_decode)
        handle = ray.remote(Controller).options(num_cpus=0).remote(spec, 0.5, bounds)
        ray.get(handle.start.remote(), timeout=300)
        yield handle
        ray.get(handle.stop.remote(), timeout=120)
    finally:
        sink.close(linger=0)
        ray.shutdown()


def free_endpoint() -> str:
    """A TCP endpoint on the loopback nobody listens on now (for a subscriber bound later).
    From 20000-32000: below the kernel's ephemeral ports (32768 up), which the Ray
    processes a test starts between this choice and the bind take at random, and above
    Ray's worker ports (10002-19999). zmq's default range (49152 up) lies in the ephemeral
    one, and a CI run once lost the port to Ray that way."""
    probe = zmq.Context.instance().socket(zmq.PULL)
    try:
        port = probe.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=32000)
        return f"tcp://127.0.0.1:{port}"
    finally:
        probe.close(linger=0)
