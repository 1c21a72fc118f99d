"""`pdserve serve --ray-address` joining a running Ray cluster, as the Helm chart's head
pod runs it: a `ray start --head` that advertises the pool resources (as the chart's
worker groups do), the pools placed by them, sockets on the node's address, and a stop
that leaves the cluster up with every resource free again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest
from serve_server import Server

from pdserve.cluster.serve_process import free_port

POOL = {"pdserve_prefill": 1, "pdserve_decode": 1, "pdserve_tier": 1}


@pytest.fixture(scope="module")
def head():
    """A Ray head in its own temp dir (so no other test's ray.init finds it)."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="pdr")  # short: Ray's socket paths have a length limit
    log = open(os.path.join(temp, "head.log"), "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
         "--num-cpus=4", "--num-gpus=0", f"--resources={json.dumps(POOL)}",
         "--include-dashboard=false", f"--temp-dir={temp}", "--block"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def _available(address: str) -> dict:
    """The cluster's free resources, read by a separate driver."""
    code = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR'); "
        "print(json.dumps(ray.available_resources()))"
    )
    env = dict(os.environ, RAY_AUTH_MODE="token")  # `ray start` turns token auth on
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_serve_joins_a_cluster_and_leaves_it_clean(head, tmp_path):
    server = Server(tmp_path, "--ray-address", head, "--pool-resources", "--host", "0.0.0.0")
    try:
        log = server.log.read_text()
        assert f"Ray cluster at {head}" in log
        # Every pool resource is taken: the workers and the tier were placed by them.
        free = _available(head)
        assert all(free.get(k, 0) == 0 for k in POOL), free
        client = server.client()
        prompt = " ".join(["Write one sentence about the sea and the wind over the harbour."] * 4)
        out = client.completions.create(model=None, prompt=prompt, max_tokens=6)
        assert out.usage.completion_tokens >= 1
        metrics = server.metrics()
        # remote: the KV came over tcp from the prefill worker's node address
        assert 'pdserve:pd_decisions_total{model_name="SmolLM2-135M-Instruct",reason="remote_prefill"} 1.0' in metrics  # fmt: skip
        # Listening on every address without --admin-key: scaling is refused.
        r = httpx.post(
            server.url + "/ops/scale", json={"role": "decode", "replicas": 2}, timeout=30
        )
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        pools = httpx.get(server.url + "/ops/pools", timeout=30).json()["pools"]
        assert [w["state"] for p in pools.values() for w in p["workers"]] == ["ready", "ready"]
    finally:
        server.stop()
    free = _available(head)  # the cluster is still up, and nothing of ours holds it
    assert all(free.get(k) == v for k, v in POOL.items()), free
