"""The `nccl` transport: KV bytes by torch.distributed P2P, control by our ZMQ protocol.

Both sides are members of one process group, which the caller forms before building
either end (`torch.distributed.init_process_group`: backend "nccl" between GPUs, "gloo"
between CPU processes in tests). Endpoints read `nccl+tcp://host:port`; the tcp part is
the source's control socket (`KVSourceServer`'s). The source's rank is not in the
endpoint: the source names it in its reply, so a stale endpoint cannot make the puller
wait on a rank that is not going to send.

A pull: `NcclPull(dst_rank)` -> one `DataHeader` per frame, then `NcclSend(src_rank,
num_frames)`, over ZMQ; then the source `isend`s each frame (packed on its device, sent as
flat uint8: every backend has it, and bytes keep NaN payloads) and the puller `irecv`s
into buffers on its own device, checked against its expectations before anything is
allocated, and scatters each with `unpack_frame` as it lands. A frame is one tensor's
units over a range of whole layers: a big tensor goes as up to MAX_FRAMES frames, packed
one by one as the previous is sent, so packing, the wire and the scatter overlap (on the
H200 x2 at bfa8945, one 235 MB frame took 2.4 ms end to end against 1.0 ms for a raw
send of the same bytes).

Timeouts. ZMQ waits use the call's deadline. CUDA tensors go through NCCL, whose works are
polled with `is_completed()` until the deadline; CPU tensors go through gloo, whose P2P
works report completion only from `wait()` (torch 2.13), so `wait(timeout=time left)` is
the poll there. A P2P op that timed out, or a reply cut short after the source may have
started sending, leaves the group unusable: NCCL P2P has no tags, so the next pair of ops
would match the stale ones. Both ends then refuse every later pull with code
"group_broken"; the worker must destroy the process group, form a new one and build new
transports and servers. This module does not rebuild anything. (NCCL's watchdog also
aborts a communicator whose op outlives the group's `timeout`, by default with the
process: set that timeout for the worker's policy.) Form an NCCL group with `device_id`
(eager init): without it, the first P2P op between two ranks creates their own 2-rank
communicator inside `isend`/`irecv`, a rendezvous bounded only by the group's timeout.

Ordering. P2P between two ranks matches in posting order, so one transport runs one pull
at a time (a lock) and the server, one thread, sends in the order it answers. A pull in
flight is not cancelled (abandoned receives would desync the group): `cancel` is honoured
before it starts. The group should carry nothing but KV transfer: collectives issued on it
by other threads would interleave with these sends. While a send runs (235 MB for a
2,048-token Qwen3-0.6B request), the server answers nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.kvtransfer.layout import GroupStorage, KVLayout
from pdserve.kvtransfer.lease import LeaseError
from pdserve.kvtransfer.pack import pack
from pdserve.kvtransfer.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DataHeader,
    Error,
    Message,
    NcclPull,
    NcclSend,
    ProtocolError,
    decode,
)
from pdserve.kvtransfer.server import KVSourceServer
from pdserve.kvtransfer.source import KVSource
from pdserve.kvtransfer.transport import PullSpec, TransferError, unpack_frame
from pdserve.kvtransfer.transport_tcp import ZmqClient

logger = logging.getLogger(__name__)

SCHEME = "nccl"
POLL_S = 50e-6  # between is_completed() polls: ~1% of a 235 MB receive at ~50 GB/s


def nccl_endpoint(zmq_endpoint: str) -> str:
    """The endpoint tickets carry for a source whose control socket is `zmq_endpoint`."""
    return f"{SCHEME}+{zmq_endpoint}"


def _group_ranks(group: dist.ProcessGroup | None) -> frozenset[int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "the nccl transport needs an initialized process group: call "
            "torch.distributed.init_process_group(backend, rank, world_size, init_method) first"
        )
    return frozenset(dist.get_process_group_ranks(group or dist.group.WORLD))


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Server and loader threads do not inherit the worker's current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def wait_p2p(work: dist.Work, tensor: torch.Tensor, deadline: float, what: str) -> None:
    """Wait for one P2P op on `tensor` until `deadline` (time.monotonic); raises
    TransferError "timeout" past it, "p2p_error" if the backend reports a failure."""
    if not tensor.is_cuda:  # gloo: only wait() completes the work
        left = deadline - time.monotonic()
        try:
            done = left > 0 and work.wait(timeout=timedelta(seconds=left))
        except RuntimeError as e:
            code = "timeout" if "Timed out" in str(e) else "p2p_error"
            raise TransferError(code, f"{what}: {e}") from e
        if not done:
            raise TransferError("timeout", f"{what} not done by the deadline")
        return
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransferError("timeout", f"{what} not done by the deadline")
        time.sleep(POLL_S)
    try:
        work.wait()  # joins the NCCL stream into the current one (the data is there)
    except RuntimeError as e:
        raise TransferError("p2p_error", f"{what}: {e}") from e


class NcclSourceServer(KVSourceServer):
    """A `KVSourceServer` that also answers `NcclPull`s (tcp pulls still work)."""

    def __init__(
        self,
        source: KVSource,
        bind: str = "tcp://127.0.0.1:0",
        group: dist.ProcessGroup | None = None,
        send_timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        frame_bytes: int | None = None,
    ) -> None:
        if not send_timeout_s > 0:
            raise ValueError(f"send_timeout_s must be > 0, got {send_timeout_s}")
        # Set before the base class starts the serving thread.
        self.group = group
        self.ranks = _group_ranks(group)
        self.rank = dist.get_rank()  # global ranks throughout, as P2P calls take them
        self.send_timeout_s = send_timeout_s
        self.broken: str | None = None  # why the group is unusable, once it is
        self.frame_bytes = frame_bytes or FRAME_BYTES  # how big a tensor's frames get
        super().__init__(source, bind, max_message_bytes=max_message_bytes)

    @property
    def ticket_endpoint(self) -> str:
        return nccl_endpoint(self.endpoint)

    def _handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, NcclPull):
            return self._nccl_pull(identity, msg)
        return super()._handle(identity, msg)

    def _nccl_pull(self, identity: bytes, msg: NcclPull) -> None:
        rid, src = msg.request_id, self.source
        if self.broken is not None:
            return self._error(identity, rid, "group_broken", self.broken)
        if msg.layout_hash != src.layout_hash:
            return self._error(identity, rid, "layout_mismatch", "pull for another layout")
        if msg.dst_rank == self.rank or msg.dst_rank not in self.ranks:
            return self._error(
                identity, rid, "bad_rank", f"rank {msg.dst_rank} is this source or not in the group"
            )
        try:
            with src.leases.pinned(rid) as lease:
                if len(msg.first_units) != len(lease.group_unit_ids):
                    return self._error(identity, rid, "bad_pull", "first_units per group")
                units = [
                    list(ids[first:])
                    for ids, first in zip(lease.group_unit_ids, msg.first_units, strict=True)
                ]
                headers = frame_headers(
                    rid, src.storages, [len(u) for u in units], self.frame_bytes
                )
                for header in headers:
                    self._send(identity, header)
                self._send(identity, NcclSend(rid, self.rank, len(headers)))
                # Pack each frame just before its send: the pack of frame i + 1 runs on
                # the compute stream while frame i is on the wire.
                sent = self._send_frames(headers, units, msg.dst_rank, rid)
        except LeaseError as e:
            return self._error(identity, rid, e.code, str(e))
        except TransferError as e:
            self.broken = f"a send to rank {msg.dst_rank} failed ({e}); rebuild the group"
            logger.error("kv source %s: %s", src.worker_id, self.broken)
            return
        self.counts["pulls"] += 1
        self.counts["bytes"] += sent

    def _send_frames(
        self, headers: list[DataHeader], units: list[list[int]], dst_rank: int, request_id: str
    ) -> int:
        """Pack and post every send in header order (the puller posts its receives in the
        same order), then wait for each, keeping each frame referenced until its send
        completes. Returns the bytes sent."""
        deadline = time.monotonic() + self.send_timeout_s
        storages = self.source.storages
        with _on_device(storages[0].device):
            frames, works = [], []
            for h in headers:
                try:
                    buf = pack(storages[h.group], units[h.group], (h.layer_start, h.layer_end))
                except ValueError as e:  # the frames are announced: the group is out of step
                    raise TransferError("pack_failed", f"{request_id}: {e}") from e
                frames.append(buf[h.tensor].reshape(-1).view(torch.uint8))
                works.append(dist.isend(frames[-1], dst_rank, group=self.group))
            for i, (work, frame) in enumerate(zip(works, frames)):
                wait_p2p(work, frame, deadline, f"send {i} of {request_id} to rank {dst_rank}")
        return sum(f.numel() for f in frames)


class NcclTransport(ZmqClient):
    """The pulling side; release, abort and heartbeat are `ZmqClient`'s."""

    name = SCHEME
    beats_tier = True
    release_confirms_copy = False

    def __init__(
        self,
        worker_id: str,
        layout: KVLayout,
        group: dist.ProcessGroup | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(worker_id, layout, max_message_bytes)
        self.group = group
        self.ranks = _group_ranks(group)
        self.rank = dist.get_rank()
        self.broken: str | None = None  # why the group is unusable, once it is
        self._pull_lock = threading.Lock()

    def pull(
        self,
        spec: PullSpec,
        dst: Sequence[GroupStorage],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> int:
        ticket = spec.ticket
        deadline = time.monotonic() + timeout_s
        with self._pull_lock:
            if self.broken is not None:
                raise TransferError("group_broken", self.broken)
            if cancel is not None and cancel.is_set():
                raise TransferError("cancelled", f"pull of {ticket.request_id} cancelled")
            self.handshake(ticket.endpoint, deadline)
            self.send(
                ticket.endpoint,
                NcclPull(ticket.request_id, self.layout_hash, list(spec.first_units), self.rank),
            )
            first = self._first_reply(ticket.endpoint, deadline)
            try:
                moved = self._receive(first, spec, dst, deadline)
            except TransferError as e:
                self.broken = f"a pull from {ticket.endpoint} failed mid-stream ({e})"
                raise
        device = dst[0].device
        if device.type == "cuda":  # return once the scatters are done, as other transports do
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            while not done.query():
                if time.monotonic() > deadline:
                    raise TransferError("timeout", f"scatter of {ticket.request_id} not done")
                time.sleep(POLL_S)
        return moved

    def _first_reply(self, endpoint: str, deadline: float) -> Message:
        """The first reply; an `Error` is raised as is, since after one the source sends
        nothing and the group is still in step. No reply at all breaks it."""
        try:
            frames = self.recv(endpoint, deadline)
            first = decode(frames[0].buffer, self.max_message_bytes)
        except (TransferError, ProtocolError) as e:
            self._drop(endpoint)
            self.broken = f"no usable reply from {endpoint} ({e})"
            raise TransferError(e.code, self.broken) from e
        if isinstance(first, Error):
            raise TransferError(first.code, f"{endpoint}: {first.message}")
        return first

    def _receive(
        self, msg: Message, spec: PullSpec, dst: Sequence[GroupStorage], deadline: float
    ) -> int:
        """Read the headers up to `NcclSend`, check them, receive and scatter each frame."""
        endpoint, rid = spec.ticket.endpoint, spec.ticket.request_id
        headers = []
        while not isinstance(msg, NcclSend):
            if not isinstance(msg, DataHeader) or msg.request_id != rid:
                raise TransferError("bad_reply", f"{endpoint}: expected a data header, got {msg}")
            headers.append(msg)
            msg = self.recv_message(endpoint, deadline, rid)
        if msg.src_rank == self.rank or msg.src_rank not in self.ranks:
            raise TransferError("bad_reply", f"{endpoint} sends from rank {msg.src_rank}")
        if msg.num_frames != len(headers):
            raise TransferError(
                "bad_frame",
                f"{endpoint} announced {msg.num_frames} frames, sent {len(headers)} headers",
            )
        check_headers(headers, spec, dst)
        frames = [
            torch.empty(h.nbytes, dtype=torch.uint8, device=dst[h.group].device) for h in headers
        ]
        with _on_device(dst[0].device):
            works = [dist.irecv(f, msg.src_rank, group=self.group) for f in frames]
            for i, (work, header, frame) in enumerate(zip(works, headers, frames)):
                wait_p2p(work, frame, deadline, f"receive {i} of {rid} from rank {msg.src_rank}")
                unpack_frame(header, frame, spec, dst)
        return sum(h.nbytes for h in headers)


# A request's tensor goes as several frames of whole layers when it is big: the source
# packs frame i + 1 while frame i is sent, and the puller scatters frame i while frame
# i + 1 arrives. One frame below 2 x FRAME_BYTES; at most MAX_FRAMES per tensor (a 2,048-
# token Qwen3-0.6B request, 235 MB in one tensor: 4 frames of 7 layers).
FRAME_BYTES = 32 << 20
MAX_FRAMES = 4


def layer_frames(
    num_layers: int, nbytes: int, frame_bytes: int = FRAME_BYTES
) -> list[tuple[int, int]]:
    """The [start, end) layer ranges a source sends one tensor of `nbytes` over
    `num_layers` in."""
    n = max(1, min(MAX_FRAMES, nbytes // frame_bytes, num_layers))
    per = -(-num_layers // n)
    return [(a, min(a + per, num_layers)) for a in range(0, num_layers, per)]


def frame_headers(
    request_id: str,
    storages: Sequence[GroupStorage],
    num_units: list[int],
    frame_bytes: int = FRAME_BYTES,
) -> list[DataHeader]:
    """Every frame of a pull of `num_units[g]` units per group, in sending order: groups,
    then tensors, then layer ranges."""
    out = []
    for g, (storage, n) in enumerate(zip(storages, num_units, strict=True)):
        if n == 0:
            continue
        for t, table in enumerate(storage.flat()):
            num_layers, _, num_elems = table.shape
            layer_bytes = n * num_elems * table.element_size()
            for a, b in layer_frames(num_layers, num_layers * layer_bytes, frame_bytes):
                out.append(
                    DataHeader(
                        request_id,
                        g,
                        t,
                        a,
                        b,
                        [b - a, n, num_elems],
                        str(table.dtype).removeprefix("torch."),
                        (b - a) * layer_bytes,
                    )  # fmt: skip
                )
    return out


def check_headers(headers: list[DataHeader], spec: PullSpec, dst: Sequence[GroupStorage]) -> None:
    """What a source announces must be this pull's frames: every tensor of every group
    with units to move, in order, each as whole-layer ranges that tile its layers in order,
    with the shape, dtype and byte count the geometry gives. How the layers are split is
    the source's choice. Checked before any receive buffer is allocated: a peer cannot
    make us allocate what we did not ask for."""
    rid, pos = spec.ticket.request_id, 0
    for g, storage in enumerate(dst):
        n = len(spec.dst_unit_ids[g]) - spec.first_units[g]
        if n == 0:
            continue
        for t, table in enumerate(storage.flat()):
            num_layers, _, num_elems = table.shape
            layer_bytes = n * num_elems * table.element_size()
            dtype = str(table.dtype).removeprefix("torch.")
            layer = 0
            while layer < num_layers:
                h = headers[pos] if pos < len(headers) else None
                # The range first: a header for it is only built when it is a valid one.
                ok = h is not None and layer < h.layer_end <= num_layers
                if ok:
                    end = h.layer_end
                    ok = h == DataHeader(
                        rid, g, t, layer, end, [end - layer, n, num_elems], dtype,
                        (end - layer) * layer_bytes,
                    )  # fmt: skip
                if not ok:
                    raise TransferError(
                        "bad_frame",
                        f"frame {pos} is {h}; expected group {g} tensor {t} from layer {layer}",
                    )
                layer, pos = h.layer_end, pos + 1
    if pos != len(headers):
        raise TransferError("bad_frame", f"{len(headers) - pos} frame(s) more than this pull has")
