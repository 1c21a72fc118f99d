"""The worker loop around a real decode worker: it sleeps while its requests wait on KV.

Real engine (a random tiny Qwen3), real tcp transport, a real prefill worker that is gone
by the time its tickets are pulled, so every pull waits out the loader's timeout.
"""

from __future__ import annotations

import random
import threading
import time

from conftest import DEVICE

from pdserve.cluster.worker_loop import WorkerLoop
from pdserve.decode.worker import DecodeWorker
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillWorker
from pdserve.runner.engine import Engine
from pdserve.runner.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LOAD_TIMEOUT_S = 1.0


def _dead_tickets(model: str, prompts: list[list[int]]):
    """Tickets of a prefill worker that has closed: pulls of them time out."""
    prefill = PrefillWorker(Engine.from_args(model=model, dtype="float32", device=DEVICE), "P0")
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    results = []
    deadline = time.monotonic() + 60
    while len(results) < len(prompts):
        assert time.monotonic() < deadline, "prefill did not finish"
        results += prefill.step()
    prefill.close()
    return {r.request_id: r.ticket for r in results}, prefill.source.layout


def test_a_decode_loop_sleeps_while_its_requests_wait_on_loads(tiny_qwen3_dir):
    """Guards two things. The loop must not spin on a worker whose requests all wait on KV
    loads (before, it stepped the empty engine tens of thousands of times a second, taking
    the GIL from the loading threads). And the load's end must wake it: the idle wait is
    30 s here, so a loop that only polled would miss the deadline."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 990) for _ in range(30)] for _ in range(2)]
    tickets, layout = _dead_tickets(tiny_qwen3_dir, prompts)
    decode = DecodeWorker(
        dict(model=tiny_qwen3_dir, dtype="float32", device=DEVICE),
        "D0",
        {"tcp": TcpTransport("D0", layout)},
        policy="fail",
        timeout_s=LOAD_TIMEOUT_S,
    )
    finished: dict[str, str] = {}
    done = threading.Event()

    def on_outputs(deltas) -> None:
        for d in deltas:
            if d.finish_reason is not None:
                finished[d.request_id] = d.finish_reason
        if len(finished) == len(prompts):
            done.set()

    loop = WorkerLoop(decode, on_outputs, idle_wait_s=30.0).start()
    try:
        start = time.monotonic()
        for i, p in enumerate(prompts):
            loop.call(lambda w, i=i, p=p: w.submit(str(i), p, GREEDY, tickets[str(i)])).result(10)
        assert done.wait(LOAD_TIMEOUT_S + 10), f"finished only {finished}"
        elapsed = time.monotonic() - start
        assert finished == {"0": "error", "1": "error"}
        assert LOAD_TIMEOUT_S * 0.9 < elapsed < LOAD_TIMEOUT_S + 5, elapsed
        # A few steps to admit, start and end the loads; a spinning loop makes thousands.
        assert loop.num_steps < 20, loop.num_steps
        assert loop.num_stalls >= 1
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.num_blocks - 1
    finally:
        loop.stop()
        decode.close()


def test_a_prefill_loop_sleeps_while_held_prompts_fill_its_cache(tiny_qwen3_dir):
    """A prefill worker whose cache is full of prompts held for the decode side cannot
    start the next one until a lease ends. Its loop must sleep meanwhile (before, it spun:
    16.7 million empty steps in a 7-minute CPU stress), and the release must wake it: the
    idle wait is 30 s here, so a loop that only polled would miss the deadline."""
    engine = Engine.from_args(
        model=tiny_qwen3_dir, dtype="float32", device=DEVICE, max_model_len=128,
        num_gpu_blocks_override=12,  # 11 usable blocks of 16 tokens
    )  # fmt: skip
    prefill = PrefillWorker(engine, "P0")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 990) for _ in range(100)] for _ in range(2)]  # 7 blocks each
    tickets: dict[str, object] = {}
    ticketed = threading.Event()

    def on_outputs(results) -> None:
        for r in results:
            tickets[r.request_id] = r.ticket
        if "B" in tickets:
            ticketed.set()

    loop = WorkerLoop(prefill, on_outputs, idle_wait_s=30.0).start()
    try:
        loop.call(lambda w: w.submit("A", prompts[0], GREEDY)).result(10)
        deadline = time.monotonic() + 30
        while "A" not in tickets:
            assert time.monotonic() < deadline, "A was not prefilled"
            time.sleep(0.01)
        loop.call(lambda w: w.submit("B", prompts[1], GREEDY)).result(10)
        time.sleep(1.0)  # B waits for A's blocks
        assert "B" not in tickets and prefill.engine.num_held == 1
        steps = loop.num_steps
        assert steps < 20, steps  # a spinning loop steps thousands of times a second
        assert loop.num_stalls >= 1
        released = time.monotonic()
        assert prefill.leases.release("A")  # as the decode side's release does
        assert ticketed.wait(5.0), "the release did not wake the stalled loop"
        assert time.monotonic() - released < 5.0
        assert tickets["B"] is not None
    finally:
        loop.stop()
        prefill.close()
