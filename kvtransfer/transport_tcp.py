"""The `tcp` transport's pulling side: ZMQ DEALER sockets to `KVSourceServer`s.

Works without GPUs (CPU tests, nodes without GPU-direct). A pull sends `Pull`, then reads
`[DataHeader, frame]` messages until `PullDone`, scattering each frame into the
destination units as it lands (so with `layer_wise` the first layers are in place
before the last arrive), on a copy stream beside the engine's (kvtransfer/copy_stream.py).
Every receive waits at most the time left of the call's timeout; on a timeout or error
the socket is closed and forgotten, so a late reply can never be mistaken for the answer
to a later request.

Sockets are per thread (ZMQ sockets are not thread-safe) and per endpoint; a handshake
(layout check) runs once per endpoint per transport.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch
import zmq

from pdserve.kvtransfer.copy_stream import CopyStreams
from pdserve.kvtransfer.layout import GroupStorage, KVLayout
from pdserve.kvtransfer.pack import from_bytes
from pdserve.kvtransfer.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Abort,
    Ack,
    DataHeader,
    Error,
    Handshake,
    HandshakeOk,
    Heartbeat,
    LeaseInfo,
    Message,
    ProtocolError,
    Pull,
    PullDone,
    Release,
    Ticket,
    decode,
    encode,
)
from pdserve.kvtransfer.transport import PullSpec, TransferError, expected_parts, unpack_frame


def zmq_address(endpoint: str) -> str:
    """The control socket of an endpoint: `cuda_ipc+tcp://h:p` and `tcp://h:p` -> `tcp://h:p`."""
    scheme, sep, rest = endpoint.partition("://")
    return scheme.rpartition("+")[2] + sep + rest


class ZmqClient:
    """Request/reply over per-thread DEALER sockets, with the handshake done once."""

    def __init__(self, worker_id: str, layout: KVLayout, max_message_bytes: int) -> None:
        self.worker_id = worker_id
        self.layout = layout
        self.layout_hash = layout.compat_hash()
        self.max_message_bytes = max_message_bytes
        self._ctx = zmq.Context.instance()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._verified: set[str] = set()
        self._all_sockets: list[zmq.Socket] = []

    def _socket(self, endpoint: str) -> zmq.Socket:
        sockets = self._local.__dict__.setdefault("sockets", {})
        sock = sockets.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(zmq_address(endpoint))
            sockets[endpoint] = sock
            with self._lock:
                self._all_sockets.append(sock)
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self._local.__dict__.get("sockets", {}).pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, endpoint: str, msg: Message) -> None:
        self._socket(endpoint).send(encode(msg))

    def recv(self, endpoint: str, deadline: float) -> list[zmq.Frame]:
        sock = self._socket(endpoint)
        left_ms = int(1e3 * (deadline - time.monotonic()))
        if left_ms <= 0 or not sock.poll(left_ms, zmq.POLLIN):
            self._drop(endpoint)
            raise TransferError("timeout", f"no reply from {endpoint} in time")
        return sock.recv_multipart(copy=False)

    def recv_message(self, endpoint: str, deadline: float, request_id: str = "") -> Message:
        frames = self.recv(endpoint, deadline)
        return self.parse(endpoint, frames[0], request_id)

    def parse(self, endpoint: str, frame: zmq.Frame, request_id: str) -> Message:
        try:
            msg = decode(frame.buffer, self.max_message_bytes)
        except ProtocolError as e:
            self._drop(endpoint)
            raise TransferError(e.code, f"from {endpoint}: {e}") from e
        if isinstance(msg, Error):
            raise TransferError(msg.code, f"{endpoint}: {msg.message}")
        if request_id and getattr(msg, "request_id", request_id) != request_id:
            self._drop(endpoint)
            raise TransferError("bad_reply", f"{endpoint} answered for {msg.request_id!r}")
        return msg

    def call(self, endpoint: str, msg: Message, timeout_s: float) -> Message:
        deadline = time.monotonic() + timeout_s
        self.handshake(endpoint, deadline)
        self.send(endpoint, msg)
        return self.recv_message(endpoint, deadline, getattr(msg, "request_id", ""))

    def handshake(self, endpoint: str, deadline: float) -> None:
        if endpoint in self._verified:
            return
        self.send(endpoint, Handshake(self.worker_id, self.layout.to_wire(), self.layout_hash))
        reply = self.recv_message(endpoint, deadline)
        if not isinstance(reply, HandshakeOk) or reply.layout_hash != self.layout_hash:
            self._drop(endpoint)
            raise TransferError("bad_reply", f"{endpoint}: unexpected handshake reply {reply}")
        with self._lock:
            self._verified.add(endpoint)

    def release(self, ticket: Ticket, timeout_s: float) -> None:
        reply = self.call(ticket.endpoint, Release(ticket.request_id), timeout_s)
        if not isinstance(reply, Ack):
            raise TransferError("bad_reply", f"release answered with {reply.TYPE}")

    def abort(self, ticket: Ticket, timeout_s: float) -> None:
        reply = self.call(ticket.endpoint, Abort(ticket.request_id), timeout_s)
        if not isinstance(reply, Ack):
            raise TransferError("bad_reply", f"abort answered with {reply.TYPE}")

    def heartbeat(self, ticket: Ticket, extend_s: float, timeout_s: float) -> float:
        reply = self.call(ticket.endpoint, Heartbeat(ticket.request_id, extend_s), timeout_s)
        if not isinstance(reply, LeaseInfo):
            raise TransferError("bad_reply", f"heartbeat answered with {reply.TYPE}")
        return reply.lease_expiry

    def close(self) -> None:
        with self._lock:
            for sock in self._all_sockets:
                sock.close(linger=0)
            self._all_sockets.clear()


class TcpTransport(ZmqClient):
    name = "tcp"
    beats_tier = False  # loopback tcp moves ~1.4 GB/s; the tier actor's shared memory more
    release_confirms_copy = False

    def __init__(
        self,
        worker_id: str,
        layout: KVLayout,
        layer_wise: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(worker_id, layout, max_message_bytes)
        self.layer_wise = layer_wise
        self._copies = CopyStreams()

    # An early ticket's first token comes with the stream's PullDone (`pull_early`).
    streams_first_token = True

    def pull(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> int:
        return self._stream(spec, dst, timeout_s, cancel)[0]

    def pull_early(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> tuple[int, int, list[list[float]] | None]:
        """`pull` for an early ticket: (bytes moved, the first token, its logprob rows),
        the token from `PullDone`, which the source sends once the forward sampled it."""
        moved, done = self._stream(spec, dst, timeout_s, cancel)
        if done.first_token is None:
            raise TransferError("bad_reply", "the stream of an early ticket ended without a token")
        return moved, done.first_token, done.first_logprobs

    def _stream(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None,
    ) -> tuple[int, PullDone]:
        ticket = spec.ticket
        endpoint, rid = ticket.endpoint, ticket.request_id
        deadline = time.monotonic() + timeout_s
        self.handshake(endpoint, deadline)
        self.send(endpoint, Pull(rid, self.layout_hash, self.layer_wise, list(spec.first_units)))
        device = dst[0].device if dst else torch.device("cpu")
        with self._copies.scope(device):  # beside the engine's steps, done on return
            return self._receive(spec, dst, endpoint, rid, deadline, cancel)

    def _receive(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        endpoint: str,
        rid: str,
        deadline: float,
        cancel: threading.Event | None,
    ) -> tuple[int, PullDone]:
        """Scatter the stream's frames into `dst` as they land, until `PullDone`."""
        moved = frames_seen = 0
        missing = expected_parts(spec, dst)
        while True:
            frames = self.recv(endpoint, deadline)
            msg = self.parse(endpoint, frames[0], rid)
            if isinstance(msg, PullDone):
                if msg.num_frames != frames_seen:
                    raise TransferError(
                        "bad_frame", f"{frames_seen} frames, PullDone says {msg.num_frames}"
                    )
                if missing:
                    g, t, layer = min(missing)
                    raise TransferError(
                        "bad_frame",
                        f"stream ended without {len(missing)} (group, tensor, layer) "
                        f"part(s), e.g. group {g} tensor {t} layer {layer}",
                    )
                return moved, msg
            if not isinstance(msg, DataHeader) or len(frames) != 2:
                self._drop(endpoint)
                raise TransferError(
                    "bad_frame", f"expected a data header and a frame, got {msg.TYPE}"
                )
            if cancel is not None and cancel.is_set():
                self._drop(endpoint)  # the rest of the stream is discarded with the socket
                raise TransferError("cancelled", f"pull of {rid} cancelled")
            buf = frames[1].buffer
            data = from_bytes(buf, [buf.nbytes], torch.uint8)
            try:
                unpack_frame(msg, data, spec, dst)
                parts = {(msg.group, msg.tensor, i) for i in range(msg.layer_start, msg.layer_end)}
                if not parts <= missing:
                    raise TransferError(
                        "bad_frame",
                        f"group {msg.group} tensor {msg.tensor} layers {msg.layer_start}:"
                        f"{msg.layer_end} came again",
                    )
                missing -= parts
            except TransferError:
                self._drop(endpoint)
                raise
            moved += msg.nbytes
            frames_seen += 1
