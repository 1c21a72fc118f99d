"""`pdserve run-batch` (vLLM's, OpenAI's batch file format) against the shared colocated
server: every line answered in input order with the server's real answer, a refused
request keeping its status and error body, a line that is no request getting `error`
while the others run; and which of its arguments go to the server it starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from pdserve.cluster.run_batch import read_line, serve_args

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6,
        "temperature": 0}  # fmt: skip
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}


def _line(cid: str, url: str, body: dict, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body, **extra})


def test_a_batch_file_is_answered_line_by_line(colocated, tmp_path):
    lines = [
        _line("chat", "/v1/chat/completions", CHAT),
        _line("completion", "/v1/completions", COMPLETION),
        "{not json",
        _line("refused", "/v1/completions", {"prompt": "x", "max_tokens": -3}),
        _line("wrong-url", "/v1/files", {}),
        _line("wrong-method", "/v1/completions", COMPLETION, method="GET"),
        _line("streamed", "/v1/completions", {**COMPLETION, "stream": True}),
        "",
        _line("embedding", "/v1/embeddings", {"input": "hello"}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "run-batch", "-i", str(src), "-o", str(dst),
         "--base-url", colocated.url + "/v1", "--max-concurrency", "3"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "8 request(s): 3 answered, 1 refused by the server, 4 error line(s)" in res.stderr
    out = [json.loads(t) for t in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [
        "chat", "completion", None, "refused", "wrong-url", "wrong-method", "streamed",
        "embedding",
    ]  # fmt: skip
    assert len({o["id"] for o in out}) == 8
    # The answers are the server's own: the same greedy text as a direct request.
    for o, path, body in ((out[0], "/v1/chat/completions", CHAT),
                          (out[1], "/v1/completions", COMPLETION)):  # fmt: skip
        direct = httpx.post(colocated.url + path, json=body, timeout=120).json()
        resp = o["response"]
        assert o["error"] is None and resp["status_code"] == 200
        assert resp["request_id"] == resp["body"]["id"]
        got, want = resp["body"]["choices"][0], direct["choices"][0]
        assert got.get("message", got.get("text")) == want.get("message", want.get("text"))
    refused = out[3]["response"]
    assert refused["status_code"] == 400 and refused["request_id"] is None
    assert "at least 1" in refused["body"]["error"]["message"] and out[3]["error"] is None
    for o, fragment in zip(out[4:7], ("'url' must be one of", "must be POST", "'stream'")):
        assert o["response"] is None and fragment in o["error"]["message"], o
    assert out[2]["error"]["message"].startswith("not JSON")
    emb = out[7]["response"]["body"]["data"][0]["embedding"]
    assert out[7]["response"]["status_code"] == 200 and len(emb) == 576  # SmolLM2's hidden size


def test_a_batch_that_cannot_run_says_why():
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "run-batch", "-i", "/nonexistent/in.jsonl",
         "-o", "/tmp/out.jsonl", "--base-url", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2 and "cannot read the batch input /nonexistent/in.jsonl" in res.stderr


def test_a_server_that_does_not_start_is_one_clear_error(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", "/v1/completions", COMPLETION) + "\n")
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "run-batch", "-i", str(src), "-o",
         str(tmp_path / "out.jsonl"), "--model", "/nonexistent/model"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "the batch's server did not start" in res.stderr and "unknown model" in res.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_lines_are_checked_before_they_are_sent():
    assert read_line(_line("a", "/v1/completions", COMPLETION)).error is None
    assert read_line("[1]").error == "not a JSON object"
    assert read_line(json.dumps({"url": "/v1/completions", "body": {}})).error.startswith(
        "'custom_id'"
    )
    assert read_line(_line("a", "/v1/completions", [1])).error == "'body' must be a JSON object"


def test_a_request_the_server_never_answers_is_an_error_line():
    """A request that gets no answer (nothing listens on the port) is the line's `error`
    (request_failed); the other lines are still written."""
    import asyncio

    from pdserve.cluster.run_batch import run_lines

    class Progress:
        def update(self, n: int) -> None:
            self.done = getattr(self, "done", 0) + n

    lines = [read_line(_line("a", "/v1/completions", COMPLETION)), read_line("{bad")]
    progress = Progress()
    out = asyncio.run(run_lines("http://127.0.0.1:9", lines, "m", None, 2, progress))
    assert out[0]["response"] is None and out[0]["error"]["code"] == "request_failed"
    assert out[0]["error"]["message"].startswith("no answer from the server: ConnectError")
    assert out[1]["error"]["code"] == "invalid_request" and progress.done == 2


def test_only_the_serve_flags_go_to_the_server_it_starts():
    argv = ["-i", "in.jsonl", "--model", "m", "-o=out.jsonl", "--port", "9", "--mode",
            "colocated", "-iX", "--base-url", "u", "--max-concurrency", "3", "--api-key", "k",
            "--input-file=a", "MODEL"]  # fmt: skip
    assert serve_args(argv) == ["--model", "m", "--mode", "colocated", "--api-key", "k", "MODEL"]
