"""`pdserve bench` and `pdserve contract` against live `pdserve serve` processes.

One PD server and one colocated server (max-model-len 1024) for the module; the tools
run as the operator runs them, `python -m pdserve.cli ...` in a subprocess, so exit
statuses and messages are the real ones. Unit tests pin the statistics.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_server import Server

from pdserve.cluster.bench_stats import (
    RequestResult,
    aggregate,
    parse_goodput,
    percentile,
    summarize,
)
from pdserve.cluster.contract import CONTRACTS
from pdserve.cluster.contract_cases import DEFAULT_CASES, load_cases

ROOT = Path(__file__).resolve().parents[1]
STAT_FIELDS = {"mean", "p50", "p90", "p95", "p99"}
REPORT_FIELDS = {
    "completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
    "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "goodput", "duration_s", "num_prompts",
    "input_len", "output_len", "base_url", "seed",
}  # fmt: skip


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


# ---------------------------------------------------------------- statistics (no server)


def test_percentiles_match_hand_computation():
    """Guards the percentile rule the report documents (numpy's linear interpolation):
    an off-by-one rank (nearest-rank or n instead of n - 1) changes every value below."""
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input: rank 1.5 -> 2 + .5 * 1
    xs = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(xs, 90) == pytest.approx(46.0)  # rank 3.6 -> 40 + .6 * 10
    assert percentile(xs, 99) == pytest.approx(49.6)  # rank 3.96
    assert percentile([7.0], 99) == 7.0
    s = summarize(xs)
    assert s == pytest.approx({"mean": 30.0, "p50": 30.0, "p90": 46.0, "p95": 48.0, "p99": 49.6})
    rng = np.random.default_rng(0)
    sample = list(rng.exponential(20.0, size=37))  # odd length, skewed
    for q in (50, 90, 95, 99):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)), rel=1e-12)
    assert summarize([]) == dict.fromkeys(STAT_FIELDS)


def test_goodput_counts_requests_meeting_every_slo():
    """Guards DistServe's definition: a request counts only if it meets all SLOs; failed
    requests never count; no --goodput gives null, not 0."""
    rs = [
        RequestResult(True, 10, 5, ttft_ms=100, tpot_ms=10, e2el_ms=140),  # meets both
        RequestResult(True, 10, 5, ttft_ms=300, tpot_ms=10, e2el_ms=340),  # TTFT miss
        RequestResult(True, 10, 5, ttft_ms=100, tpot_ms=30, e2el_ms=220),  # TPOT miss
        RequestResult(True, 10, 1, ttft_ms=100, tpot_ms=None, e2el_ms=100),  # no TPOT: meets
        RequestResult(False, error="HTTP 500"),
    ]
    rep = aggregate(rs, 2.0, parse_goodput(["ttft:200", "tpot:20"]))
    assert rep["goodput"] == 1.0  # 2 good requests / 2 s
    assert (rep["completed"], rep["failed"]) == (4, 1)
    assert rep["output_throughput"] == 8.0 and rep["total_token_throughput"] == 28.0
    assert rep["tpot_ms"]["p50"] == 10.0  # the 1-token request has no TPOT sample
    assert aggregate(rs, 2.0, None)["goodput"] is None
    for bad in (["ttft"], ["speed:5"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("prompts: [unclosed", "not valid YAML"),
        ("- just\n- a list\n", "must be a YAML mapping"),
        ("prompts: [hi]\ntemperature: 2\n", "unknown keys ['temperature']"),
        ("max_tokens: 4\n", "'prompts' is required"),
        ("prompts: hello\n", "'prompts' must be a list"),
        ("prompts: [hi, 3]\n", "non-empty list of non-empty strings"),
        ("prompts: [hi]\nn: 1\n", "'n' must be >= 2"),
        ("prompts: [hi]\nlogprob_atol: 0\n", "'logprob_atol' must be a number > 0"),
    ],
)
def test_malformed_cases_file_is_refused(tmp_path, text, fragment):
    """Guards the operator's input: each malformed file is named with the broken rule."""
    path = tmp_path / "cases.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="cases") as e:
        load_cases(str(path))
    assert fragment in str(e.value)


# ---------------------------------------------------------------- failing endpoints


class _NotOpenAI(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/v1/models":
            self.send_response(404)
            self.end_headers()
        else:
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def not_openai():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotOpenAI)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    thread.join(timeout=5)


def test_tools_fail_clearly_on_bad_endpoints(tmp_path, not_openai):
    """Guards the edges: an unreachable URL, a plain HTTP server (404 on /v1/models) and
    a malformed cases file each give one clear line and exit 2, not a traceback."""
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    runs = {
        "bench-dead": (_cli("bench", "--base-url", dead, "--num-prompts", "2"), "cannot reach"),
        "bench-404": (_cli("bench", "--base-url", not_openai, "--num-prompts", "2"), "HTTP 404"),
        "contract-dead": (
            _cli("contract", "--baseline", dead, "--candidate", not_openai),
            "cannot reach",
        ),
        "contract-404": (
            _cli("contract", "--baseline", not_openai, "--candidate", not_openai),
            "not an OpenAI-compatible server",
        ),
    }
    bad = tmp_path / "bad.yaml"
    bad.write_text("prompts: 5\n")
    runs["contract-cases"] = (
        _cli("contract", "--baseline", dead, "--candidate", dead, "--cases", str(bad)),
        "'prompts' must be a list",
    )
    for name, (res, fragment) in runs.items():
        assert res.returncode == 2, (name, res.stdout, res.stderr)
        assert "pdserve: error:" in res.stderr and fragment in res.stderr, (name, res.stderr)
        assert "Traceback" not in res.stderr, (name, res.stderr)


# ---------------------------------------------------------------- live servers


def test_bench_report_fields_and_percentiles(pd, tmp_path):
    """Guards the JSON contract of `pdserve bench` (every field, per-metric stats) and its
    arithmetic: the live report's percentiles equal numpy.percentile of the per-request
    values it saved, output tokens are exactly --output-len, and a lax SLO counts all."""
    out, png = tmp_path / "r.json", tmp_path / "cdf.png"
    res = _cli(
        "bench", "--base-url", pd.url, "--dataset", "random", "--num-prompts", "8",
        "--input-len", "32", "--output-len", "6", "--request-rate", "20", "--seed", "3",
        "--vocab-size", "49152", "--goodput", "ttft:60000", "tpot:60000", "e2el:60000",
        "--result-file", str(out), "--save-detailed", "--plot", str(png),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "TTFT" in res.stdout and "requests" in res.stderr  # table and progress bar
    rep = json.loads(out.read_text())
    assert not REPORT_FIELDS - set(rep), REPORT_FIELDS - set(rep)
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(rep[m]) == STAT_FIELDS and all(v > 0 for v in rep[m].values()), rep[m]
    assert (rep["completed"], rep["failed"]) == (8, 0)
    reqs = rep["requests"]
    assert all(r["output_tokens"] == 6 and r["prompt_tokens"] == 32 for r in reqs)
    assert rep["output_throughput"] == pytest.approx(48 / rep["duration_s"])
    assert rep["goodput"] == pytest.approx(rep["request_throughput"])
    for m in ("ttft", "tpot", "e2el"):
        vals = [r[f"{m}_ms"] for r in reqs]
        for q in (50, 90, 99):
            assert rep[f"{m}_ms"][f"p{q}"] == pytest.approx(np.percentile(vals, q), rel=1e-9)
    itl = [x for r in reqs for x in r["itl_ms"]]
    assert rep["itl_ms"]["p50"] == pytest.approx(np.percentile(itl, 50), rel=1e-9)
    assert all(r["tpot_ms"] < r["e2el_ms"] for r in reqs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_prefix_and_sharegpt_datasets(colocated, tmp_path):
    """Guards the other two datasets end to end: prefix prompts under a concurrency cap,
    and ShareGPT text prompts (first human turn) with an SLO that nothing meets."""
    res = _cli(
        "bench", "--base-url", colocated.url, "--dataset", "prefix", "--num-prompts", "4",
        "--input-len", "48", "--prefix-len", "32", "--output-len", "3", "--max-concurrency", "2",
        "--vocab-size", "49152", "--result-file", str(tmp_path / "p.json"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / "p.json").read_text())
    assert rep["completed"] == 4 and rep["goodput"] is None and rep["max_concurrency"] == 2
    share = tmp_path / "share.json"
    conv = [{"from": "gpt", "value": "ignored"}, {"from": "human", "value": "Name a color."}]
    share.write_text(json.dumps([{"conversations": conv}, {"conversations": []}]))
    res = _cli(
        "bench", "--base-url", colocated.url, "--dataset", "sharegpt", "--dataset-path",
        str(share), "--num-prompts", "2", "--output-len", "3", "--goodput", "ttft:0.001",
        "--result-file", str(tmp_path / "s.json"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / "s.json").read_text())
    assert rep["completed"] == 2 and rep["goodput"] == 0.0
    assert rep["total_input_tokens"] == 2 * 4  # "Name a color." is 4 SmolLM2 tokens


def test_contract_passes_pd_vs_colocated(pd, colocated):
    """Guards the gate's main use: PD and colocated keep the same output contract, and
    every contract runs and prints PASS."""
    res = _cli("contract", "--baseline", colocated.url, "--candidate", pd.url)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in CONTRACTS:
        assert f"PASS  {name}" in res.stdout, res.stdout


def test_contract_fails_and_names_the_contract(pd, colocated, tmp_path):
    """Guards the failing path with a real difference: the candidate (colocated) was
    started with --max-model-len 1024 and the baseline (PD) with 4096, so a ~1200-token
    golden prompt is served by one and refused by the other. The gate must exit 1 and
    name the contracts that broke, with the candidate's refusal as the first difference."""
    cases = tmp_path / "long.yaml"
    long_prompt = "The customer is planning a trip through Europe in the spring. " * 100
    cases.write_text(json.dumps({"prompts": ["The capital of France is", long_prompt]}))
    res = _cli(
        "contract", "--baseline", pd.url, "--candidate", colocated.url, "--cases", str(cases),
        "--only", "greedy", "max_tokens_length",
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert (
        "FAIL  greedy" in res.stdout
        and "candidate: /v1/completions answered HTTP 400" in res.stdout
    )
    assert "FAIL  max_tokens_length" in res.stdout
    assert "0 passed, 2 failed: greedy, max_tokens_length" in res.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("ref"), "--mode", "colocated", "--runner", "reference",
        "--max-model-len", "1024",
    )  # fmt: skip
    yield server
    server.stop()


def test_contract_passes_mrv2_vs_reference_runner(colocated, reference, tmp_path):
    """Guards the operator's runner switch: the transformers-based reference runner and
    MRV2 keep the same output contract on the same model (CPU float32). Every contract
    runs, on two of the default prompts with shorter outputs and bursts: the reference
    runner is slow on a CPU, and the default cases run in full for PD vs colocated."""
    models = httpx.get(reference.url + "/v1/models", timeout=30).json()["data"][0]
    assert models["runner"] == "reference"
    cases = tmp_path / "short.yaml"
    prompts = [DEFAULT_CASES.prompts[0], DEFAULT_CASES.prompts[2]]
    cases.write_text(json.dumps({"prompts": prompts, "max_tokens": 8, "abort_streams": 2,
                                 "burst": 2}))  # fmt: skip
    res = _cli(
        "contract", "--baseline", colocated.url, "--candidate", reference.url,
        "--cases", str(cases),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    for name in CONTRACTS:
        assert f"PASS  {name}" in res.stdout, res.stdout
