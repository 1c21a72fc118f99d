"""Token deltas from decode workers to the router: ZMQ PUSH -> PULL, msgpack frames.

No Ray call per token (DESIGN §5): each decode worker connects a PUSH socket to the
router's PULL socket and sends one frame per step with every delta of that step. A
frame is `{"v": 1, "w": worker_id, "d": [delta, ...]}`; a delta is a small map with
short keys (below). The router checks the version and field types before trusting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

# 2: deltas carry the prompt's logprobs ("q"); 3: the prompt's queue time ("u")
STREAM_VERSION = 3
MAX_FRAME_BYTES = 64 << 20


@dataclass
class StreamDelta:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[list[list[float]]] | None  # per token: rows [token_id, logprob, rank]
    num_prompt_tokens: int
    num_cached_tokens: int
    # Per prompt position (the first is None), rows as in `logprobs`: on the delta of the
    # step that finished the prompt, when the request asked for prompt logprobs.
    prompt_logprobs: list[list[list[float]] | None] | None = None
    # On a request's first delta: seconds its prompt waited before it was scheduled, on
    # the worker that prefilled it. The router adds its own wait for a decode slot.
    queue_s: float = 0.0
    # num_cached_tokens replaces the earlier report (RequestDelta.cached_revised)
    cached_revised: bool = False
    # An embedding request's pooled prompt, on its one delta (runner/pooling.py)
    embedding: list[float] | None = None

    def cached_after(self, reported: int) -> int:
        """A choice's cached prompt tokens after this delta, `reported` before it: a
        revision replaces the count, any other report can only add hits."""
        return (
            self.num_cached_tokens if self.cached_revised else max(reported, self.num_cached_tokens)
        )

    def to_wire(self) -> dict:
        return {
            "r": self.request_id,
            "t": self.token_ids,
            "x": self.text,
            "f": self.finish_reason,
            "s": self.stop_reason,
            "l": self.logprobs,
            "p": self.num_prompt_tokens,
            "c": self.num_cached_tokens,
            "q": self.prompt_logprobs,
            "u": self.queue_s,
            "k": self.cached_revised,
            "e": self.embedding,
        }

    @classmethod
    def from_wire(cls, d: dict) -> StreamDelta:
        if not isinstance(d, dict) or set(d) != {
            "r",
            "t",
            "x",
            "f",
            "s",
            "l",
            "p",
            "c",
            "q",
            "u",
            "k",
            "e",
        }:
            raise ValueError(f"bad stream delta keys: {sorted(d) if isinstance(d, dict) else d}")
        if not isinstance(d["r"], str) or not isinstance(d["x"], str):
            raise ValueError("stream delta: request id and text must be strings")
        if not isinstance(d["t"], list) or not all(type(t) is int for t in d["t"]):
            raise ValueError("stream delta: token ids must be a list of ints")
        if d["f"] is not None and not isinstance(d["f"], str):
            raise ValueError("stream delta: finish reason must be a string or null")
        if d["q"] is not None and not isinstance(d["q"], list):
            raise ValueError("stream delta: prompt logprobs must be a list or null")
        if type(d["u"]) not in (int, float) or not 0 <= d["u"] < float("inf"):
            raise ValueError("stream delta: queue time must be a finite number >= 0")
        if type(d["k"]) is not bool:
            raise ValueError("stream delta: the cached-count revision flag must be a bool")
        e = d["e"]
        if e is not None and not (isinstance(e, list) and all(type(v) in (int, float) for v in e)):
            raise ValueError("stream delta: an embedding must be a list of numbers or null")
        return cls(
            d["r"], d["t"], d["x"], d["f"], d["s"], d["l"], int(d["p"]), int(d["c"]), d["q"],
            float(d["u"]), d["k"], e,
        )  # fmt: skip


def _rows(pos) -> list[list[float]]:
    return [[tok, lp.logprob, lp.rank] for tok, lp in pos.items()]


def delta_from_engine(delta) -> StreamDelta:
    """A runner `RequestDelta` as a stream delta (logprobs flattened to rows)."""
    lps = [_rows(pos) for pos in delta.new_logprobs] if delta.new_logprobs else None
    prompt = delta.prompt_logprobs
    return StreamDelta(
        delta.request_id,
        list(delta.new_token_ids),
        delta.new_text,
        delta.finish_reason,
        delta.stop_reason,
        lps,
        delta.num_prompt_tokens,
        delta.num_cached_tokens,
        None if prompt is None else [None if pos is None else _rows(pos) for pos in prompt],
        delta.queue_s,
        delta.cached_revised,
        delta.embedding,
    )


class TokenPublisher:
    """Decode worker side; used only from its loop thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.connect(endpoint)

    def publish(self, deltas: list[StreamDelta]) -> None:
        frame = {"v": STREAM_VERSION, "w": self.worker_id, "d": [d.to_wire() for d in deltas]}
        self._sock.send(msgpack.packb(frame, use_bin_type=True))

    def close(self) -> None:
        self._sock.close(linger=1000)


def _bind(sock: zmq.Socket, endpoint: str, timeout_s: float) -> None:
    """Bind, retrying for up to `timeout_s` while the address is in use: a subscriber this
    process closed a moment ago releases it only once zmq's I/O thread gets to it (a router
    started again on the same endpoint, a test after a test). A port another live socket
    holds still fails, after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


class TokenSubscriber:
    """Router side: one PULL socket, a task that hands each delta to `on_delta`."""

    def __init__(
        self,
        bind: str,
        on_delta: Callable[[str, StreamDelta], None],
        bind_timeout_s: float = 2.0,
    ) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        _bind(self._sock, bind, bind_timeout_s)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.on_delta = on_delta
        self.num_bad_frames = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sock.close(linger=0)

    async def _run(self) -> None:
        while True:
            data = await self._sock.recv()
            try:
                frame = msgpack.unpackb(data, raw=False, max_bin_len=MAX_FRAME_BYTES)
                if not isinstance(frame, dict) or frame.get("v") != STREAM_VERSION:
                    raise ValueError(
                        f"stream frame version {frame.get('v') if isinstance(frame, dict) else '?'}"
                    )
                deltas = [StreamDelta.from_wire(d) for d in frame["d"]]
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                self.num_bad_frames += 1
                logger.warning("dropped a bad token-stream frame: %s", e)
                continue
            for d in deltas:
                self.on_delta(str(frame.get("w", "")), d)
