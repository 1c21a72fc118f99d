"""The router's stats poll (cluster/router.py `poll_stats`) and what /metrics makes of it.

The workers here are plain `WorkerHandle` implementations, not Ray actors: what is under
test is the router's answer to a worker that does not answer a poll (slow under load, or
dead), which a real worker cannot be made to do on cue. The serve tests
(test_serve_e2e.py) scrape the same series from real workers.
"""

from __future__ import annotations

import asyncio

from pdserve.cluster.metrics import Metrics
from pdserve.cluster.route_policy import RouterConfig
from pdserve.cluster.router import Router


class _Worker:
    def __init__(self, worker_id: str, pulls: int) -> None:
        self.worker_id = worker_id
        self.pulls = pulls
        self.answers = True

    async def stats(self) -> dict:
        if not self.answers:
            raise TimeoutError("stats poll timed out")
        return {"num_requests": 1, "pulls_by_transport": {"tcp": self.pulls}}


def _series(text: str, name: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name)
    }


def test_a_worker_missing_a_poll_keeps_its_last_stats_and_is_counted():
    """Guards /metrics under a slow worker: its counters stay at what it last said (a
    counter that vanished for one scrape would read as a reset), the poll marks the error
    and counts it per worker, a worker that answered is unaffected, and the next answer
    replaces the marked stats."""
    slow, fine = _Worker("d0", pulls=3), _Worker("p0", pulls=5)
    router = Router(RouterConfig(), [slow], [fine])
    metrics = Metrics("m")
    asyncio.run(router.poll_stats())
    slow.answers, slow.pulls, fine.pulls = False, 9, 6
    asyncio.run(router.poll_stats())
    assert router.worker_stats["d0"]["pulls_by_transport"] == {"tcp": 3}
    assert "TimeoutError" in router.worker_stats["d0"]["error"]
    assert router.worker_stats["p0"] == {"num_requests": 1, "pulls_by_transport": {"tcp": 6}}
    text = metrics.render(router)
    pulls = _series(text, "pdserve:kv_transfer_pulls_total")
    assert pulls == {
        'pdserve:kv_transfer_pulls_total{model_name="m",role="decode",transport="tcp",'
        'worker="d0"}': 3.0,
        'pdserve:kv_transfer_pulls_total{model_name="m",role="prefill",transport="tcp",'
        'worker="p0"}': 6.0,
    }
    failures = _series(text, "pdserve:worker_stats_failures_total")
    assert failures == {
        'pdserve:worker_stats_failures_total{model_name="m",role="decode",worker="d0"}': 1.0
    }
    slow.answers = True
    asyncio.run(router.poll_stats())
    assert router.worker_stats["d0"] == {"num_requests": 1, "pulls_by_transport": {"tcp": 9}}
    assert router.stats_failures["d0"] == 1
