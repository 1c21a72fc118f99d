"""The `nccl` transport: KV bytes by torch.distributed P2P, control by our ZMQ protocol.

Both sides are members of one process group, which the caller forms before building
either end (`torch.distributed.init_process_group`: backend "nccl" between GPUs, "gloo"
between CPU processes in tests). Endpoints read `nccl+tcp://host:port`; the tcp part is
the source's control socket (`KVSourceServer`'s). The source's rank is not in the
endpoint: the source names it in its reply, so a stale endpoint cannot make the puller
wait on a rank that is not going to send.

A pull: `NcclPull(dst_rank)` -> one `DataHeader` per packed buffer, then `NcclSend(src_rank,
num_frames)`, over ZMQ; then the source `isend`s each buffer (packed on its device, sent as
flat uint8: every backend has it, and bytes keep NaN payloads) and the puller `irecv`s
into buffers on its own device, checked against its expectations before anything is
allocated, and scatters each with `unpack_frame` as it lands.

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
    ) -> None:
        if not send_timeout_s > 0:
            raise ValueError(f"send_timeout_s must be > 0, got {send_timeout_s}")
        # Set before the base class starts the serving thread.
        self.group = group
        self.ranks = _group_ranks(group)
        self.rank = dist.get_rank()  # global ranks throughout, as P2P calls take them
        self.send_timeout_s = send_timeout_s
        self.broken: str | None = None  # why the group is unusable, once it is
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
                with _on_device(src.storages[0].device):
                    buffers = src.pack_request(lease.group_unit_ids, msg.first_units, False)
        except LeaseError as e:
            return self._error(identity, rid, e.code, str(e))
        frames = []
        for g, tensors in enumerate(buffers):
            for t, buf in enumerate(tensors):
                header = DataHeader(
                    rid, g, t, 0, buf.shape[0], list(buf.shape),
                    str(buf.dtype).removeprefix("torch."), buf.numel() * buf.element_size(),
                )  # fmt: skip
                self._send(identity, header)
                frames.append(buf.reshape(-1).view(torch.uint8))
        self._send(identity, NcclSend(rid, self.rank, len(frames)))
        try:
            self._send_frames(frames, msg.dst_rank, rid)
        except TransferError as e:
            self.broken = f"a send to rank {msg.dst_rank} failed ({e}); rebuild the group"
            logger.error("kv source %s: %s", src.worker_id, self.broken)
            return
        self.counts["pulls"] += 1
        self.counts["bytes"] += sum(f.numel() for f in frames)

    def _send_frames(self, frames: list[torch.Tensor], dst_rank: int, request_id: str) -> None:
        """Post every send at once (the puller posts its receives in the same order) and
        wait for each, keeping each frame referenced until its send completes."""
        deadline = time.monotonic() + self.send_timeout_s
        with _on_device(self.source.storages[0].device):
            works = [dist.isend(f, dst_rank, group=self.group) for f in frames]
            for i, (work, frame) in enumerate(zip(works, frames)):
                wait_p2p(work, frame, deadline, f"send {i} of {request_id} to rank {dst_rank}")


class NcclTransport(ZmqClient):
    """The pulling side; release, abort and heartbeat are `ZmqClient`'s."""

    name = SCHEME

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
        expected = _expected_headers(spec, dst)
        if msg.num_frames != len(headers) or headers != expected:
            raise TransferError(
                "bad_frame", f"{endpoint} announced {headers}, this pull expects {expected}"
            )
        frames = [
            torch.empty(h.nbytes, dtype=torch.uint8, device=dst[h.group].device) for h in headers
        ]
        with _on_device(dst[0].device):
            works = [dist.irecv(f, msg.src_rank, group=self.group) for f in frames]
            for i, (work, header, frame) in enumerate(zip(works, headers, frames)):
                wait_p2p(work, frame, deadline, f"receive {i} of {rid} from rank {msg.src_rank}")
                unpack_frame(header, frame, spec, dst)
        return sum(h.nbytes for h in headers)


def _expected_headers(spec: PullSpec, dst: Sequence[GroupStorage]) -> list[DataHeader]:
    """The headers a correct source sends for this pull, in order (checked before any
    receive buffer is allocated: a peer cannot make us allocate what we did not ask for)."""
    rid, out = spec.ticket.request_id, []
    for g, storage in enumerate(dst):
        n = len(spec.dst_unit_ids[g]) - spec.first_units[g]
        if n == 0:
            continue
        for t, table in enumerate(storage.flat()):
            num_layers, _, num_elems = table.shape
            out.append(
                DataHeader(
                    rid,
                    g,
                    t,
                    0,
                    num_layers,
                    [num_layers, n, num_elems],
                    str(table.dtype).removeprefix("torch."),
                    num_layers * n * num_elems * table.element_size(),
                )
            )
    return out
