"""Serve a `KVSource` over ZMQ: the prefill side of the tcp, cuda_ipc and nccl transports.

One ROUTER socket on one thread. Each request is one control message (msgpack, checked by
`protocol.decode`); the reply is one message, except a tcp pull, which streams
`[DataHeader, raw frame]` messages (one per tensor, or per layer and tensor when
`layer_wise`) and ends with `PullDone`. Raw frames go out without a copy (zmq
`copy=False` over the packed buffer). A bad message gets an `Error` reply and nothing else
changes; the socket never stops serving because of what a peer sent.

A pull of an early lease (layer-wise mode: the ticket went out before the prompt's
forward ran) becomes a stream that the loop advances between messages, polling every
millisecond while one is open: each layer is packed and sent once the forward has marked
it done (`LayerMarks.ready`), then `PullDone` once the first token is known. The lease
stays pinned meanwhile; a stream past the lease's expiry, or whose prompt ended without
a first token, ends with an `Error`. On a GPU, early layers are packed on a side stream,
so they never wait behind the rest of the forward on the engine's stream.

It binds only the address it is given. It does not free blocks: releases, aborts and
expiries go through the lease table, whose owner frees them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from pdserve.kvtransfer.layout import GroupStorage, KVLayout, LayoutMismatch
from pdserve.kvtransfer.lease import Lease, LeaseError
from pdserve.kvtransfer.pack import as_byte_view, pack
from pdserve.kvtransfer.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Abort,
    Ack,
    DataHeader,
    Error,
    Handshake,
    HandshakeOk,
    Heartbeat,
    IpcExport,
    IpcOpen,
    LeaseInfo,
    Message,
    ProtocolError,
    Pull,
    PullDone,
    Release,
    decode,
    encode,
)
from pdserve.kvtransfer.source import KVSource

logger = logging.getLogger(__name__)

POLL_MS = 50  # how often the loop checks for close()
STREAM_POLL_MS = 1  # how often it checks the forward's progress while a stream is open
# A pull is packed and sent in chunks of whole layers of at most about this many bytes, so
# the socket's I/O thread sends chunk k (and the puller unpacks it) while chunk k + 1 is
# packed. Loopback on 2 CPU cores (benchmarks/transfer.py --transports tcp, 2,048 tokens):
# 0.76 GB/s as one frame per tensor, 1.2 with 8 MB (one-layer) chunks, 1.38-1.46 with 16 MB,
# 0.91 with 33 MB: buffers past glibc's 32 MiB mmap threshold are fresh pages every time.
CHUNK_BYTES = 16 << 20


@dataclass
class _Stream:
    """A pull of an early lease, sent layer by layer as the forward completes them."""

    identity: bytes
    pull: Pull
    lease: Lease
    pin: contextlib.ExitStack  # holds the lease's pin until the stream ends
    deadline: float  # time.monotonic(): the lease's expiry when the stream began
    next_layer: int = 0
    frames: int = 0
    done: bool = field(default=False)


def chunk_layers(storage: GroupStorage, num_units: int) -> int:
    """Layers per chunk of a pull of `num_units` units: about CHUNK_BYTES, at least one."""
    per_layer = num_units * storage.group.unit_bytes() // max(storage.group.num_layers, 1)
    return max(1, CHUNK_BYTES // max(per_layer, 1))


class KVSourceServer:
    def __init__(
        self,
        source: KVSource,
        bind: str = "tcp://127.0.0.1:0",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ipc_export: dict | None = None,
    ) -> None:
        self.source = source
        self.max_message_bytes = max_message_bytes
        self._ipc_export = ipc_export  # cuda_ipc: handles of the source tensors, if shared
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A hard wall against memory abuse; anything between max_message_bytes and this is
        # received and refused by `decode` with an Error reply that says why.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 16 * max_message_bytes)
        self._sock.bind(bind)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.counts = {"pulls": 0, "bytes": 0, "frames": 0, "errors": 0}
        self._streams: list[_Stream] = []
        devices = {st.device for st in source.storages}
        self._pack_stream = (
            torch.cuda.Stream(next(iter(devices)))
            if len(devices) == 1 and next(iter(devices)).type == "cuda"
            else None
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-source-server", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "kv source server did not stop"
        for stream in self._streams:  # unpin: the owner frees the blocks as leases end
            stream.pin.close()
        self._streams.clear()
        self._sock.close(linger=0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if self._streams:
                self._advance_streams()
            if not poller.poll(STREAM_POLL_MS if self._streams else POLL_MS):
                continue
            frames = self._sock.recv_multipart(copy=False)
            identity, body = frames[0].bytes, frames[-1].buffer
            try:
                if len(frames) != 2:
                    raise ProtocolError("corrupt", f"expected one message frame, got {len(frames)}")
                self._handle(identity, decode(body, self.max_message_bytes))
            except ProtocolError as e:
                self._error(identity, "", e.code, str(e))
            except LeaseError as e:
                self._error(identity, getattr(e, "request_id", ""), e.code, str(e))

    def _send(self, identity: bytes, msg: Message) -> None:
        self._sock.send_multipart([identity, encode(msg)])

    def _error(self, identity: bytes, request_id: str, code: str, message: str) -> None:
        self.counts["errors"] += 1
        logger.warning("kv source %s: %s", self.source.worker_id, message)
        self._send(identity, Error(request_id, code, message))

    def _handle(self, identity: bytes, msg: Message) -> None:
        src = self.source
        if isinstance(msg, Handshake):
            try:
                src.layout.check_compatible(KVLayout.from_wire(msg.layout))
            except (LayoutMismatch, ValueError) as e:
                return self._error(identity, "", "layout_mismatch", str(e))
            return self._send(identity, HandshakeOk(src.worker_id, src.layout_hash))
        if isinstance(msg, IpcOpen):
            if msg.layout_hash != src.layout_hash or self._ipc_export is None:
                why = "layout hash differs" if self._ipc_export else "no CUDA IPC export here"
                return self._error(identity, "", "ipc_unavailable", why)
            return self._send(identity, IpcExport(src.worker_id, self._ipc_export))
        rid = msg.request_id
        if isinstance(msg, Pull):
            if msg.layout_hash != src.layout_hash:
                why = f"pull for layout {msg.layout_hash[:12]}, here {src.layout_hash[:12]}"
                return self._error(identity, rid, "layout_mismatch", why)
            return self._pull(identity, msg)
        if isinstance(msg, Abort):
            src.leases.release(rid, "aborted")
            return self._send(identity, Ack(rid))
        if isinstance(msg, Release):
            if src.leases.release(rid, "released"):
                return self._send(identity, Ack(rid))
            # An Ack confirms that the lease was live until now, so the blocks were not
            # freed while a direct copy (cuda_ipc) read them; say so when it was not.
            return self._error(identity, rid, "lease_gone", f"the lease of {rid!r} had ended")
        if isinstance(msg, Heartbeat):
            try:
                expiry = src.leases.extend(rid, msg.extend_s)
            except LeaseError as e:  # a keeper's round met a release or an expiry: counted,
                self.counts["errors"] += 1  # answered, but no warning in the log
                logger.debug("kv source %s: heartbeat: %s", src.worker_id, e)
                return self._send(identity, Error(rid, e.code, str(e)))
            return self._send(identity, LeaseInfo(rid, expiry))
        self._error(identity, rid, "unexpected", f"a {msg.TYPE} message is not a request")

    def _pull(self, identity: bytes, msg: Pull) -> None:
        rid = msg.request_id
        try:
            pin = contextlib.ExitStack()
            lease = pin.enter_context(self.source.leases.pinned(rid))
        except LeaseError as e:
            return self._error(identity, rid, e.code, str(e))
        if len(msg.first_units) != len(lease.group_unit_ids):
            pin.close()
            return self._error(identity, rid, "bad_pull", "first_units per group")
        if lease.early:
            left_s = max(lease.expiry - time.time(), 0.0)
            stream = _Stream(identity, msg, lease, pin, time.monotonic() + left_s)
            self._advance(stream)  # a stream whose forward is done ends right here
            if not stream.done:
                self._streams.append(stream)
            return None
        num_frames = 0
        with pin:
            for g, (storage, ids) in enumerate(zip(self.source.storages, lease.group_unit_ids)):
                units = list(ids[msg.first_units[g] :])
                if not units:
                    continue
                num_layers = storage.group.num_layers
                step = 1 if msg.layer_wise else chunk_layers(storage, len(units))
                for start in range(0, num_layers, step):
                    end = min(start + step, num_layers)
                    num_frames += self._send_group_layers(identity, rid, g, units, start, end)
        self.counts["pulls"] += 1
        self._send(identity, PullDone(rid, num_frames))

    # ---- early leases: streams -------------------------------------------------------------

    def _advance_streams(self) -> None:
        for stream in self._streams:
            self._advance(stream)
        self._streams = [st for st in self._streams if not st.done]  # each ends once

    def _advance(self, st: _Stream) -> None:
        """Send what the forward has finished since the last call; end the stream with
        `PullDone` (first token included) or an `Error`."""
        lease, rid = st.lease, st.pull.request_id
        marks = lease.marks
        if lease.pending_error is not None:
            return self._end(st, "prompt_ended", f"{rid}: {lease.pending_error}")
        num_layers = marks.num_layers
        if st.pull.layer_wise:
            while st.next_layer < num_layers and marks.ready(st.next_layer):
                self._send_layers(st, st.next_layer, st.next_layer + 1)
                st.next_layer += 1
        elif st.next_layer < num_layers and marks.ready(num_layers - 1):
            self._send_layers(st, 0, num_layers)
            st.next_layer = num_layers
        if st.next_layer == num_layers and lease.first is not None:
            token, logprobs = lease.first
            self.counts["pulls"] += 1
            self._send(st.identity, PullDone(rid, st.frames, token, logprobs))
            st.done = True
            st.pin.close()
        elif time.monotonic() > st.deadline:
            self._end(st, "timeout", f"{rid}: the prompt's forward did not finish in its lease")

    def _end(self, st: _Stream, code: str, message: str) -> None:
        st.done = True
        st.pin.close()
        self._error(st.identity, st.pull.request_id, code, message)

    def _send_layers(self, st: _Stream, start: int, end: int) -> None:
        """Layers [start, end) of the request's units after `first_units`: one frame per
        tensor (one layer at a time when layer-wise, all of them otherwise). On a GPU the
        packing runs on the side stream: the forward may still be queued on the engine's."""
        rid = st.pull.request_id
        side = self._pack_stream
        for g, ids in enumerate(st.lease.group_unit_ids):
            units = list(ids[st.pull.first_units[g] :])
            if not units:
                continue
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                st.frames += self._send_group_layers(st.identity, rid, g, units, start, end)

    def _send_group_layers(
        self, identity: bytes, rid: str, g: int, units: list[int], start: int, end: int
    ) -> int:
        """Pack layers [start, end) of `units` of group g and send them, a frame per
        tensor; returns the number of frames."""
        buffers = pack(self.source.storages[g], units, (start, end))
        for t, buf in enumerate(buffers):
            self._send_frame(identity, rid, g, t, start, end, buf.cpu())
        return len(buffers)

    def _send_frame(
        self, identity: bytes, rid: str, g: int, t: int, start: int, end: int, part
    ) -> None:
        """One `[DataHeader, raw frame]` message: layers [start, end) of group g's tensor t,
        `part` a contiguous CPU tensor sent without a copy."""
        header = DataHeader(
            rid, g, t, start, end, list(part.shape), str(part.dtype).removeprefix("torch."),
            part.numel() * part.element_size(),
        )  # fmt: skip
        self._sock.send_multipart([identity, encode(header), as_byte_view(part)], copy=False)
        self.counts["bytes"] += header.nbytes
        self.counts["frames"] += 1
