"""`pdserve run-batch`: OpenAI's batch file format, as vLLM's `run-batch` takes it.

Each input line is a request, `{"custom_id", "method": "POST", "url", "body"}`; each
output line, in the input's order, is its answer, `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`. A request the server refuses keeps its
status code and error body in `response`; a line that is no request (not JSON, no
`custom_id`, a method, URL or `stream` a batch cannot take) gets `error` and no
`response`, and the other lines run as usual.

The requests go over HTTP to a server: `--base-url`'s, or one this command starts with
the `pdserve serve` flags it was given (cluster/serve_process.py) and stops at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from pdserve.cluster.endpoint import auth_headers, normalize_base_url, probe_model
from pdserve.cluster.tool_args import add_run_batch_args

# The routes a batch line may name: OpenAI's batch endpoints, and vLLM's score and rerank.
BATCH_URLS = (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/score", "/v1/rerank",
)  # fmt: skip
REQUEST_TIMEOUT_S = 3600.0  # one request's answer; a long generation on a busy server


class Progress(Protocol):
    """What counts finished lines: tqdm's bar, or a test's counter."""

    def update(self, n: int) -> object: ...


@dataclass(frozen=True)
class BatchLine:
    """One input line: a request to send, or why it is none (`error`)."""

    custom_id: str | None
    url: str = ""
    body: dict | None = None
    error: str | None = None
    # the error's kind: the line is no request, or it never got an answer from the server
    error_code: str = "invalid_request"


def read_line(text: str) -> BatchLine:
    """An input line checked: what a batch request must be, or the first thing it is not."""
    try:
        item = json.loads(text)
    except ValueError as e:
        return BatchLine(None, error=f"not JSON: {e}")
    if not isinstance(item, dict):
        return BatchLine(None, error="not a JSON object")
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(None, error="'custom_id' must be a non-empty string")
    if item.get("method", "POST") != "POST":
        return BatchLine(cid, error=f"'method' must be POST, got {item.get('method')!r}")
    url, body = item.get("url"), item.get("body")
    if url not in BATCH_URLS:
        return BatchLine(cid, error=f"'url' must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    if not isinstance(body, dict):
        return BatchLine(cid, error="'body' must be a JSON object")
    if body.get("stream"):
        return BatchLine(cid, error="'stream' is not available in a batch")
    return BatchLine(cid, url, body)


def output_line(line: BatchLine, status: int | None = None, reply: dict | None = None) -> dict:
    """The output line of `line`: its response (status and body) or its error."""
    out: dict = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id}
    if line.error is not None:
        out.update(response=None, error={"code": line.error_code, "message": line.error})
        return out
    request_id = reply.get("id") if isinstance(reply, dict) and status == 200 else None
    body = {"status_code": status, "request_id": request_id, "body": reply}
    out.update(response=body, error=None)
    return out


async def _send(
    client: httpx.AsyncClient, base_url: str, line: BatchLine, model: str, headers: dict
) -> dict:
    if line.error is not None:
        return output_line(line)
    body = dict(line.body, model=line.body.get("model", model))
    try:
        r = await client.post(base_url + line.url, json=body, headers=headers)
    except httpx.HTTPError as e:
        failed = f"no answer from the server: {type(e).__name__}: {e}"
        return output_line(BatchLine(line.custom_id, error=failed, error_code="request_failed"))
    try:
        reply = r.json()
    except ValueError:
        reply = {"error": {"message": r.text[:2000], "type": "server_error"}}
    return output_line(line, r.status_code, reply)


def served_model(base_url: str, api_key: str | None) -> str:
    """The model a line without `model` names: the server's first (an EndpointError, which
    the CLI prints, when `base_url` is no OpenAI-compatible server)."""
    return probe_model(normalize_base_url(base_url), api_key)


async def run_lines(
    base_url: str,
    lines: list[BatchLine],
    model: str,
    api_key: str | None,
    max_concurrency: int,
    progress: Progress,
) -> list[dict]:
    """Every line's output line, in input order, at most `max_concurrency` in flight; a
    body without `model` gets `model`."""
    base_url = normalize_base_url(base_url)
    headers, gate = auth_headers(api_key), asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency)

    async def one(client: httpx.AsyncClient, line: BatchLine) -> dict:
        async with gate:
            out = await _send(client, base_url, line, model, headers)
        progress.update(1)
        return out

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        return await asyncio.gather(*(one(client, line) for line in lines))


def read_input(path: str) -> list[BatchLine]:
    """The input file's lines (blank lines skipped); a file that cannot be read is a
    ValueError naming it, before any server starts."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the batch input {path}: {e.strerror or e}") from None
    return [read_line(t) for t in text.splitlines() if t.strip()]


def write_output(path: str, outputs: list[dict]) -> None:
    text = "".join(json.dumps(o, separators=(",", ":")) + "\n" for o in outputs)
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise ValueError(f"cannot write the batch output {path}: {e.strerror or e}") from None


def _own_flags() -> tuple[str, ...]:
    """run-batch's own flags (each takes a value), as cluster/tool_args.py defines them."""
    p = argparse.ArgumentParser(add_help=False)
    add_run_batch_args(p)
    return tuple(flag for action in p._actions for flag in action.option_strings)


def serve_args(argv: list[str]) -> list[str]:
    """`pdserve serve`'s flags among `run-batch`'s arguments (argv after `run-batch`), its
    own flags and their values left out, and `--port`: the started server takes a free one."""
    drop = (*_own_flags(), "--port")
    short = [flag for flag in drop if not flag.startswith("--")]
    out, skip = [], False
    for arg in argv:
        name, joined = arg.split("=", 1)[0], "=" in arg
        if not arg.startswith("--") and arg[:2] in short and len(arg) > 2:
            name, joined = arg[:2], True  # -iFILE
        if skip:
            skip = False
        elif name in drop:
            skip = not joined
        else:
            out.append(arg)
    return out
