"""The operator endpoints on a real `pdserve serve`: the dashboard page, /ops/pools, and
scaling and draining through /ops/scale and /ops/drain behind the admin key."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser

import httpx
import pytest
from serve_server import Server

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.ops_api import OpsState, check_admin, is_loopback

ADMIN = "ops-secret"
PREFIX = "/pd"  # the server's --root-path


@pytest.fixture(scope="module")
def ops_server(tmp_path_factory):
    """Colocated (one pool), listening on every address, with an admin key."""
    server = Server(
        tmp_path_factory.mktemp("ops"), "--mode", "colocated", "--max-model-len", "512",
        "--host", "0.0.0.0", "--admin-key", ADMIN, "--max-decode-workers", "2",
        "--root-path", PREFIX,
    )  # fmt: skip
    yield server
    server.stop()


def _pools(server: Server) -> dict:
    r = httpx.get(server.url + "/ops/pools", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _post(server: Server, path: str, body, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def _wait_pool(server: Server, want: list[tuple[str, str]], timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        d = _pools(server)
        workers = d["pools"]["decode"]["workers"]
        have = [(w["worker_id"], w["state"]) for w in workers]
        routed = all("num_blocks" in w for w in workers)  # the router polls it: it routes to it
        if have == want and routed:
            return d
        assert time.monotonic() < deadline, f"decode pool {have}, want {want}"
        time.sleep(0.5)


class _Headers:
    """What check_admin reads of a request: its headers."""

    def __init__(self, headers: dict) -> None:
        self.headers = headers


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.script = ""

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        if self.tags and self.tags[-1] == "script":
            self.script += data


def test_dashboard_page_is_served_and_uses_the_ops_endpoints(ops_server):
    """The page names its endpoints relative to itself, so that behind a proxy that
    publishes the server under a prefix (--root-path) it calls them there too."""
    r = httpx.get(ops_server.url + "/dashboard", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert httpx.get(ops_server.url + PREFIX + "/dashboard", timeout=30).text == r.text
    page = _Tags()
    page.feed(r.text)
    assert {"html", "table", "script"} <= set(page.tags)
    for endpoint in ("ops/pools", "ops/scale", "ops/drain", "ops/reset_prefix_cache"):
        assert f'"{endpoint}"' in page.script
    assert '"/ops/' not in page.script


def test_root_path_serves_the_operator_routes_under_the_prefix_too(ops_server):
    """--root-path /pd: /pd/ops/pools is /ops/pools, the admin key still guards scaling
    there, CORS still leaves the operator's routes out, and the log says so."""
    assert (
        _pools(ops_server)["pools"].keys()
        == httpx.get(ops_server.url + PREFIX + "/ops/pools", timeout=60).json()["pools"].keys()
    )
    refused = _post(ops_server, PREFIX + "/ops/scale", {"role": "decode", "replicas": 1}, None)
    assert refused.status_code == 401, refused.text
    preflight = {"origin": "https://ui.example", "access-control-request-method": "POST"}
    r = httpx.options(ops_server.url + PREFIX + "/ops/scale", headers=preflight, timeout=10)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(ops_server.url + PREFIX + "/v1/completions", headers=preflight, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert f"every route also under {PREFIX} (--root-path)" in ops_server.log.read_text()
    document = httpx.get(ops_server.url + PREFIX + "/openapi.json", timeout=30).json()
    assert document["servers"] == [{"url": PREFIX}]


def test_pools_view_lists_the_workers_and_bounds(ops_server):
    client = ops_server.client()
    client.completions.create(model=None, prompt="Hello there", max_tokens=3)
    d = _pools(ops_server)
    assert d["mode"] == "colocated"
    decode = d["pools"]["decode"]
    assert decode["bounds"] == [1, 2] and decode["ready"] == 1
    (w,) = decode["workers"]
    assert w["worker_id"] == "decode-0" and w["state"] == "ready"
    # "ready N s" counts from when it came up (the pool's start event), not from when its
    # actor was created several seconds before.
    started = next(e["time"] for e in d["events"] if e["text"].startswith("started"))
    assert started - 1.0 <= w["since"] <= started
    assert w["num_blocks"] > 0 and 0 <= w["kv_cache_usage_perc"] <= 1
    assert w["kernel_compiles"] == 0  # a CPU worker compiles nothing (no Triton launches)
    # What the engine really runs, for the dashboard's worker tooltip.
    assert w["execution_path"] == {"runner": "mrv2", "decode_attention": "torch",
                                   "norms": "kernels", "graph_scope": "none",
                                   "experts": "none", "weights": "float32", "lora": "off",
                                   "kv_cache": "float32", "speculative": "off"}  # fmt: skip
    assert w["startup"]["kv_tokens"] == (w["num_blocks"] - 1) * 16
    assert d["pools"]["prefill"] == {"bounds": [0, 0], "workers": [], "ready": 0,
                                     "starting": 0, "draining": 0}  # fmt: skip
    assert d["latency"]["ttft"]["count"] >= 1 and d["latency"]["e2e"]["mean_s"] > 0
    assert list(d["latency"]) == ["queue", "prefill", "ttft", "itl", "decode", "e2e"]
    lat = d["latency"]  # the phases of the requests that ended (a client gone: none)
    assert lat["queue"]["count"] == lat["prefill"]["count"] == lat["decode"]["count"] >= 1
    assert lat["queue"]["count"] <= lat["ttft"]["count"]
    assert d["decisions"]["colocated"] >= 1
    assert d["totals"]["requests"] >= 1 and d["totals"]["generation_tokens"] >= 1
    assert d["admin_key_required"] and d["scaling_open"]
    assert d["autoscale"] == {"enabled": False}


def test_reset_prefix_cache_makes_the_next_prompt_cold(ops_server):
    """POST /ops/reset_prefix_cache (admin key; vLLM's /reset_prefix_cache too): a prompt
    sent again hits its cached prefix; while a request holds blocks the worker refuses,
    changing nothing (`busy`); once idle it resets, and the same prompt is computed whole
    again. Like scaling, it takes the admin key and answers no CORS preflight."""
    client = ops_server.client()
    prompt = "Tell me about the history of the printing press in Europe. " * 4

    def cached() -> int:
        usage = client.completions.create(model=None, prompt=prompt, max_tokens=1).usage
        details = usage.prompt_tokens_details
        return details.cached_tokens if details is not None else 0

    cached()
    assert cached() >= 16  # at least a block
    assert _post(ops_server, "/ops/reset_prefix_cache", {}, None).status_code == 401
    stream = client.completions.create(model=None, prompt="Once upon a time", max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))  # running: it holds blocks
    busy = _post(ops_server, "/ops/reset_prefix_cache", {})
    stream.close()
    assert busy.status_code == 200, busy.text
    assert busy.json()["reset"] is False and busy.json()["workers"] == {"decode-0": "busy"}
    deadline = time.monotonic() + 30  # the closed stream's abort frees its blocks
    while (done := _post(ops_server, PREFIX + "/reset_prefix_cache", {})).json()["reset"] is False:
        assert time.monotonic() < deadline, done.text
        time.sleep(0.2)
    assert done.json()["workers"] == {"decode-0": "reset"}
    assert cached() == 0
    preflight = {"origin": "https://ui.example", "access-control-request-method": "POST"}
    r = httpx.options(ops_server.url + "/reset_prefix_cache", headers=preflight, timeout=10)
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    "path, body, key, status, fragment",
    [
        ("/ops/scale", {"role": "decode", "replicas": 2}, None, 401, "admin key"),
        ("/ops/scale", {"role": "decode", "replicas": 2}, "wrong", 401, "admin key"),
        ("/ops/drain", {"worker_id": "decode-0"}, None, 401, "admin key"),
        ("/ops/scale", {"role": "prefill", "replicas": 1}, ADMIN, 400, "[0, 0]"),
        ("/ops/scale", {"role": "decode", "replicas": 3}, ADMIN, 400, "[1, 2]"),
        ("/ops/scale", {"role": "decode", "replicas": "2"}, ADMIN, 400, "integer"),
        ("/ops/scale", {"role": "router", "replicas": 1}, ADMIN, 400, "'role'"),
        ("/ops/scale", [1, 2], ADMIN, 400, "JSON object"),
        ("/ops/drain", {"worker_id": "decode-0"}, ADMIN, 400, "minimum"),
        ("/ops/drain", {"worker_id": "decode-9"}, ADMIN, 400, "no worker"),
    ],
)
def test_bad_ops_calls_get_errors_and_change_nothing(ops_server, path, body, key, status, fragment):
    r = _post(ops_server, path, body, key)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert [w["worker_id"] for w in _pools(ops_server)["pools"]["decode"]["workers"]] == [
        "decode-0"
    ]


def test_ops_posts_take_only_json(ops_server):
    """Guards the cross-site rule: a plain-text body (what another site's page can send
    without a CORS preflight) is refused before anything else, even with the key."""
    r = httpx.post(
        ops_server.url + "/ops/scale", content=b'{"role": "decode", "replicas": 2}',
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "text/plain"}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert len(_pools(ops_server)["pools"]["decode"]["workers"]) == 1


def test_scale_up_serve_then_drain(ops_server):
    """Guards the operator's loop end to end: a second decode worker starts, becomes ready
    and takes requests; draining it returns the pool to one worker, still serving."""
    r = _post(ops_server, "/ops/scale", {"role": "decode", "replicas": 2})
    assert r.status_code == 200, r.text
    assert r.json() == {"role": "decode", "replicas": 2, "started": ["decode-1"], "draining": []}
    _wait_pool(ops_server, [("decode-0", "ready"), ("decode-1", "ready")])
    client = ops_server.client()

    def ask(i: int) -> int:
        out = client.completions.create(model=None, prompt=f"Count to {i}", max_tokens=4)
        return out.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:  # at once: the router spreads them by load
        assert all(n >= 1 for n in pool.map(ask, range(4)))
    workers = {w["worker_id"]: w for w in _pools(ops_server)["pools"]["decode"]["workers"]}
    assert workers["decode-1"]["prefix_cache_queries"] > 0  # the new worker took requests
    _next_turn_finds_its_prefix(ops_server)
    _a_requests_choices_share_a_worker(ops_server)
    r = _post(ops_server, "/ops/drain", {"worker_id": "decode-1"})
    assert r.status_code == 200 and r.json() == {"worker_id": "decode-1", "draining": True}
    d = _wait_pool(ops_server, [("decode-0", "ready")])
    texts = [e["text"] for e in d["events"]]
    assert "decode-1 ready" in texts and any(t.startswith("drained decode-1") for t in texts)
    assert ask(5) >= 1
    # The new worker's startup line, printed by the serve loop once it was ready.
    log = ops_server.log.read_text().splitlines()
    assert [x for x in log if x.startswith("pdserve: decode-1 ready in ")], log[-20:]


def _counts(server: Server, key: str) -> dict[str, float]:
    return {w["worker_id"]: w[key] for w in _pools(server)["pools"]["decode"]["workers"]}


def _computed(server: Server) -> dict[str, float]:
    """Prompt tokens each decode worker computed, from /metrics."""
    out = {}
    for line in server.metrics().splitlines():
        if line.startswith("pdserve:worker_prompt_tokens_computed_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


def _next_turn_finds_its_prefix(server: Server) -> None:
    """The router's prefix-aware pick (route_policy.prefer_cached): while a long request
    keeps one worker busy, a conversation's first turn goes to the other; once both are
    idle again its next turn goes back there and hits its KV, where a pick by load alone
    would take the first idle worker."""
    client = server.client()
    busy = client.completions.create(model=None, prompt="Tell a long story.", max_tokens=400,
                                     stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(busy))  # running on its worker
    turn = "You are a ship's navigator. " * 40 + "Where is the nearest harbour?"
    queries = _counts(server, "prefix_cache_queries")
    client.completions.create(model=None, prompt=turn, max_tokens=2)
    grew = {w: n - queries[w] for w, n in _counts(server, "prefix_cache_queries").items()}
    (first,) = [w for w, n in grew.items() if n > 0]
    busy.close()  # the long request ends (client gone): both workers idle
    deadline = time.monotonic() + 60
    while sum(_counts(server, "num_requests_running").values()) > 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    hits = _counts(server, "prefix_cache_hits")
    client.completions.create(model=None, prompt=turn + " And the next one?", max_tokens=2)
    grew = {w: n - hits[w] for w, n in _counts(server, "prefix_cache_hits").items()}
    assert grew[first] >= 256 and sum(grew.values()) == grew[first], (first, grew)


def _a_requests_choices_share_a_worker(server: Server) -> None:
    """A request's n choices go to the worker its first choice went to (while it is in the
    load band), so the prompt is computed there once, not once per worker: with two idle
    workers, n=4 lands on one, which computes the prompt and three tails."""
    prompt = "Describe the tides of a northern sea, briefly. " * 30
    queries = _counts(server, "prefix_cache_queries")
    computed = _computed(server)
    out = server.client().completions.create(model=None, prompt=prompt, max_tokens=3, n=4,
                                             temperature=1.0, seed=3)  # fmt: skip
    grew = {w: n - queries[w] for w, n in _counts(server, "prefix_cache_queries").items()}
    used = [w for w, n in grew.items() if n > 0]
    assert len(used) == 1, grew
    work = _computed(server)[used[0]] - computed[used[0]]
    assert work < out.usage.prompt_tokens + 3 * 16, (work, out.usage.prompt_tokens)


def test_without_an_admin_key_scaling_is_open_only_on_loopback():
    """Guards the rule for servers started without --admin-key: loopback listeners allow
    scaling (the default local run), any other address refuses it with 403."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    assert not is_loopback("example.com")
    json_post = _Headers({"content-type": "application/json"})
    check_admin(OpsState(None, None, "127.0.0.1"), json_post)  # open: no error
    with pytest.raises(ApiError) as e:
        check_admin(OpsState(None, None, "0.0.0.0"), json_post)
    assert e.value.status == 403 and "--admin-key" in e.value.message


def test_autoscale_grows_the_pool_and_metrics_show_it(tmp_path):
    """Guards `--autoscale` end to end: a policy from the config file whose decode mark is
    always "high" grows the pool to its maximum; /metrics and /ops/pools show it; Ctrl-C
    stops the autoscale loop with the rest (the server exits 0), even while the new worker
    may still be starting (its bring-up to "ready" is test_scale_up_serve_then_drain's)."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "mode: colocated\nmax_model_len: 512\nautoscale: true\nmax_decode_workers: 2\n"
        "autoscale_policy: {interval_s: 0.5, up_after_s: 0, cooldown_s: 0, "
        "decode_waiting_high: -1}\n"
    )
    server = Server(tmp_path, "--config", str(cfg))
    try:
        _wait_pool(server, [("decode-0", "ready")])
        deadline = time.monotonic() + 60
        while True:  # one tick after the first: the pool is asked for its maximum
            d = _pools(server)
            ids = [w["worker_id"] for w in d["pools"]["decode"]["workers"]]
            if ids == ["decode-0", "decode-1"]:
                break
            assert time.monotonic() < deadline, ids
            time.sleep(0.25)
        auto = d["autoscale"]
        assert auto["enabled"] and auto["bounds"]["decode"] == [1, 2]
        assert auto["pools"]["decode"]["last_change"]["to"] == 2
        assert auto["config"]["interval_s"] == 0.5
        decode = tuple(f'role="decode",state="{state}"}}' for state in ("starting", "ready"))
        while True:  # /metrics has the member list of the router's last sync (every ~2 s)
            metrics = server.metrics()
            lines = [ln for ln in metrics.splitlines()
                     if ln.startswith("pdserve:pool_workers{") and any(d in ln for d in decode)]  # fmt: skip
            if sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) == 2.0:
                break
            assert time.monotonic() < deadline, lines
            time.sleep(0.25)
        assert server.client().completions.create(model=None, prompt="Hi", max_tokens=2)
    finally:
        server.stop()
