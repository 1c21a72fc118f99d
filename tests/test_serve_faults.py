"""Faults against a live `pdserve serve` (PD mode): dead workers, client disconnects.

Workers are killed the way they die in production: SIGKILL of the actor's process.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from serve_server import KEY, Server
from test_serve_e2e import LONG, _metric

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    cfg = tmp / "serve.yaml"
    cfg.write_text(f"lease_s: 3\nhealth_interval_s: 0.5\nmax_model_len: 1024\napi_key: {KEY}\n"
                   "shutdown_timeout_s: 2\nroot_path: /pd/\n")  # fmt: skip
    s = Server(tmp, "--config", str(cfg))
    yield s
    s.stop()


def _actor_pids(server, cls: str) -> list[int]:
    """This server's actor processes of `cls`."""
    return [pid for pid, title in server.ray_processes().items() if f"ray::{cls}" in title]


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _routed(server, role: str) -> bool:
    """Every worker of `role` is ready and polled by the router, so it takes requests
    (a restarted worker's process exists well before that, on a loaded machine seconds)."""
    workers = httpx.get(server.url + "/ops/pools", timeout=30).json()["pools"][role]["workers"]
    return bool(workers) and all(w["state"] == "ready" and "num_blocks" in w for w in workers)


def _restarted_at(server, role: str) -> float | None:
    events = httpx.get(server.url + "/ops/pools", timeout=30).json()["events"]
    times = [e["time"] for e in events if e["text"].startswith(f"restarted {role}")]
    return times[-1] if times else None


def _usage(server, role: str) -> float:
    return _metric(server.metrics(), "pdserve:kv_cache_usage_perc", role=role)


def _running(server, role: str) -> float:
    return _metric(server.metrics(), "pdserve:num_requests_running", role=role)


@pytest.mark.parametrize(
    "prompt, n", [(LONG, 1), ([LONG, "Once more: " + LONG], 2)], ids=["one", "batch-of-2-n-2"]
)
def test_client_disconnect_frees_the_decode_request(server, prompt, n):
    """Guards a leak: a client that hangs up mid-stream must not keep decoding; its
    blocks must come back within moments. A batch of prompts runs each in its own task
    (cluster/batch_stream.py): all of its generations must stop too."""
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": 800, "temperature": 0,
        "stream": True, "ignore_eos": True, "n": n,
    }  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
    # disconnected; the request was running on the decode worker
    _wait(lambda: _running(server, "decode") == 0 and _usage(server, "decode") == 0, 10, "abort")


def test_client_giving_up_on_a_plain_response_stops_its_generations(server):
    """Guards the same leak without a stream (found by fuzzing: a request for n=100000
    whose client timed out kept 80,000 generations queued ahead of every other request
    for minutes). A JSON response is written once, at the end, so the server must watch
    the connection itself (cluster/disconnect.py)."""
    body = {
        "model": MODEL, "prompt": [LONG, "Once more: " + LONG], "max_tokens": 800,
        "temperature": 0, "ignore_eos": True, "n": 8,
    }  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=3)
    _wait(lambda: _running(server, "decode") == 0 and _usage(server, "decode") == 0, 10, "abort")
    queued = _metric(server.metrics(), "pdserve:router_requests_queued")
    assert queued == 0


def test_kill_prefill_worker_mid_request_recomputes(server):
    """Guards policy `recompute`: a prefill worker dying under a request must not fail it
    or hang it; the answer is the one a healthy cluster gives; the worker comes back.
    Every prompt here starts differently, so none is a prefix hit on the decode worker
    (those skip the prefill worker by design)."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def ask(prompt: str) -> str:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        return r.choices[0].text

    prompt = "Question B. " + LONG * 4 + "Which city is the capital of Italy?"
    (old,) = _actor_pids(server, "PrefillActor")
    result: dict = {}
    before = server.metrics()
    t = threading.Thread(target=lambda: result.setdefault("text", ask(prompt)))
    t.start()
    time.sleep(0.05)
    os.kill(old, signal.SIGKILL)
    t.join(120)
    assert "text" in result, "the request did not complete"
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("pdserve:pd_decisions_total", reason="remote_prefill") == 1
    # The prefill call failed, or the pull from the dead worker did: either way counted.
    failures = delta("pdserve:pd_prefill_failures_total")
    fallbacks = delta("pdserve:kv_recompute_fallbacks_total")
    assert failures + fallbacks == 1, (failures, fallbacks)
    _wait(lambda: _actor_pids(server, "PrefillActor") not in ([], [old]), 60, "prefill restart")
    _wait(lambda: _routed(server, "prefill"), 60, "the restarted prefill worker routed")
    _wait(lambda: _restarted_at(server, "prefill") is not None, 60, "the restart event")
    (w,) = httpx.get(server.url + "/ops/pools", timeout=30).json()["pools"]["prefill"]["workers"]
    restarted = _restarted_at(server, "prefill")
    assert restarted - 1.0 <= w["since"] <= restarted  # "ready N s" counts from the restart
    assert ask(prompt) == result["text"]  # the same answer from the decode worker's cache
    before = server.metrics()
    ask("Question C. " + LONG * 2 + "Name a river.")
    after = server.metrics()
    assert delta("pdserve:pd_decisions_total", reason="remote_prefill") == 1
    assert delta("pdserve:pd_prefill_failures_total") == 0


def test_kill_decode_worker_errors_its_requests_then_recovers(server):
    """Guards a hang: requests on a dead decode worker end with an error (not a 5-minute
    wait), the controller restarts it, new requests succeed, and the prefill side gets
    its leased blocks back."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    (old,) = _actor_pids(server, "DecodeActor")
    stream = c.completions.create(
        model=MODEL, prompt=LONG * 2, max_tokens=800, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    start = time.monotonic()
    with pytest.raises(openai.APIError):
        for i, _chunk in enumerate(stream):
            if i == 3:
                os.kill(old, signal.SIGKILL)
    assert time.monotonic() - start < 30
    _wait(lambda: _actor_pids(server, "DecodeActor") not in ([], [old]), 60, "decode restart")
    _wait(lambda: _usage(server, "prefill") == 0, 15, "prefill blocks back")
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0,
    )  # fmt: skip
    assert r.choices[0].message.content == "The capital of France is Paris."


def test_sagemaker_invocations_answer_as_chat_or_completion(server):
    """Guards SageMaker's /invocations (as vLLM serves it): a body with `messages` is
    answered as /v1/chat/completions answers it, one with `prompt` as /v1/completions,
    greedy and token for token; a body with neither is a 400 that says what it needs."""
    auth = {"authorization": f"Bearer {KEY}"}
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}  # fmt: skip
    text = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    for body, route, field in ((chat, "/v1/chat/completions", "message"),
                               (text, "/v1/completions", "text")):  # fmt: skip
        got = httpx.post(server.url + "/invocations", json=body, headers=auth, timeout=60)
        want = httpx.post(server.url + route, json=body, headers=auth, timeout=60)
        assert got.status_code == want.status_code == 200, got.text
        g, w = got.json(), want.json()
        counts = lambda u: (u["prompt_tokens"], u["completion_tokens"])  # noqa: E731
        assert g["object"] == w["object"] and counts(g["usage"]) == counts(w["usage"])
        assert g["choices"][0][field] == w["choices"][0][field]
    bad = httpx.post(server.url + "/invocations", json={"input": "x"}, headers=auth, timeout=10)
    assert bad.status_code == 400 and "'messages'" in bad.json()["error"]["message"]


def test_api_key_required_when_set(server):
    """Guards auth: /v1, the tokenizer routes and SageMaker's /invocations need the key;
    /health, /ping and /metrics stay open. Under the server's root path (`root_path: /pd/`)
    too: the routes answer there, and the key is checked on the path they match."""
    for prefix, key in itertools.product(("", "/pd"), (None, "wrong")):
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        r = httpx.get(server.url + prefix + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}),
                           ("/invocations", {"prompt": "x", "max_tokens": 1}),
                           ("/v1/completions", {"prompt": "x", "max_tokens": 1})):  # fmt: skip
            r = httpx.post(server.url + prefix + path, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (prefix, path, r.text)
    keyed = httpx.post(
        server.url + "/pd/v1/completions", json={"model": MODEL, "prompt": "Paris is", "max_tokens": 2},
        headers={"authorization": f"Bearer {KEY}"}, timeout=60,
    )  # fmt: skip
    assert keyed.status_code == 200 and keyed.json()["usage"]["completion_tokens"] == 2
    keyed = httpx.post(
        server.url + "/tokenize", json={"prompt": "Paris is"},
        headers={"authorization": f"Bearer {KEY}"}, timeout=10,
    )  # fmt: skip
    assert keyed.status_code == 200 and keyed.json()["count"] == 2
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    # CORS as vLLM: a browser's preflight passes without the key; the operator's routes
    # answer none (a page of another site cannot send them its JSON POST).
    preflight = {"origin": "https://ui.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}  # fmt: skip
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.options(server.url + "/ops/scale", headers=preflight, timeout=10)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_reset_prefix_cache_reaches_both_pools_and_the_tier(server):
    """PD: the reset asks the prefill and the decode worker and clears the KV tier (the
    server listens on loopback without an admin key: the operator's POSTs are open); a
    long prompt sent again after it finds nothing cached."""
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 1}

    def cached() -> int:
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    cached()
    assert cached() > 0
    deadline = time.monotonic() + 30  # a lease or an abort may hold blocks a moment
    while True:
        r = httpx.post(server.url + "/ops/reset_prefix_cache", json={}, timeout=60)
        assert r.status_code == 200, r.text
        if r.json()["reset"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out = r.json()  # earlier tests here restart workers: their ids are not assumed
    assert out["reset"] and out["tier"] == "cleared", out
    assert sorted(w.split("-")[0] for w in out["workers"]) == ["decode", "prefill"], out
    assert set(out["workers"].values()) == {"reset"}
    assert cached() == 0


def test_sigterm_answers_every_running_request_then_stops(server):
    """Runs last: it stops the module's server. On SIGTERM (a pod ending) the requests
    running get `shutdown_timeout_s` (2 s here) to finish; then each left ends with a 503
    saying why (a stream: an error event, then [DONE]), not a bare 500 and a traceback,
    and the server, its workers and its Ray exit."""
    headers = {"authorization": f"Bearer {KEY}"}
    long = {"model": MODEL, "prompt": LONG, "max_tokens": 900, "ignore_eos": True}
    got: dict[str, object] = {}
    streaming = threading.Event()

    def plain() -> None:
        got["plain"] = httpx.post(server.url + "/v1/completions", json=long, headers=headers,
                                  timeout=120)  # fmt: skip

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", headers=headers, timeout=120,
                          json={**long, "stream": True}) as r:  # fmt: skip
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()
            got["stream"] = (r.status_code, events)

    threads = [threading.Thread(target=f) for f in (plain, stream)]
    for t in threads:
        t.start()
    assert streaming.wait(120), "the stream sent nothing"
    before = set(server.ray_processes())
    assert before
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(90) == 0
    for t in threads:
        t.join(30)
    plain_reply = got["plain"]
    assert plain_reply.status_code == 503, plain_reply.text
    assert plain_reply.json()["error"]["message"] == "the server is shutting down"
    status, events = got["stream"]
    assert status == 200 and events[-1] == "[DONE]" and len(events) > 2, events[-3:]
    assert json.loads(events[-2])["error"]["message"] == "the server is shutting down"
    assert all("choices" in json.loads(e) for e in events[:-2])
    log = server.log.read_text()
    assert "2 request(s) still running after 2 s (--shutdown-timeout) ended with a 503" in log
    assert "Traceback" not in log and "pdserve: stopped" in log
    _wait(lambda: not set(server.ray_processes()) & before, 30, "the workers to exit")
