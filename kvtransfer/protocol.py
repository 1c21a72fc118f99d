"""The KV transfer control protocol: typed messages, msgpack on the wire, strict on receive.

Every control message between a prefill worker, a decode worker and the tier is one of the
frozen dataclasses in `MESSAGE_TYPES`. On the wire a message is the msgpack map
`{"v": PROTOCOL_VERSION, "t": TYPE, "f": {field: value}}`; never pickle, so a peer can
send us bad data but never code. `decode` trusts nothing: it bounds the size before
unpacking, bounds every msgpack container by that size, and checks the version, the type
and every field (names, types down to list elements, non-negative ints) before it builds
a message. Every rejection is a `ProtocolError` whose `code` says which rule broke.

Messages check their own fields when constructed too, so a sender cannot encode what a
receiver would refuse.

This module does not know about transports, sockets or tensors: a `DataHeader` only
describes the raw frame that follows it, and `Handshake.layout` is a KV layout's wire dict
that the layout module (not this one) interprets. It does not track request state either
(which message may follow which is the connectors' business).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

# 2: a Ticket's first token may be None (an early ticket, issued when the prompt's last
# chunk is scheduled), and PullDone carries the first token and its logprobs.
# 3: a Ticket says how many prompt tokens the prefill worker found in its prefix cache.
# 4: and how long the prompt waited there before it was scheduled (`queue_s`).
PROTOCOL_VERSION = 4
# Control messages are small: the largest, a Ticket, carries one int per KV block
# (~9 bytes each), so 1 MiB covers ~100k blocks — far beyond any prompt.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

ERROR_CODES = ("bad_version", "bad_schema", "too_large", "corrupt", "unknown_type")


class ProtocolError(ValueError):
    """A message that cannot be accepted; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str) -> None:
        assert code in ERROR_CODES, f"unknown protocol error code {code!r}"
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Message:
    """Base of every protocol message; a subclass sets TYPE, its name on the wire."""

    TYPE: ClassVar[str]

    def __post_init__(self) -> None:
        for name, tp in _FIELD_TYPES[type(self)].items():
            problem = _type_problem(getattr(self, name), tp)
            if problem is not None:
                raise ProtocolError("bad_schema", f"{type(self).__name__}.{name}{problem}")
        self._check()

    def _check(self) -> None:
        """Rules beyond types (ranges, consistency); raises ProtocolError('bad_schema')."""


@dataclass(frozen=True)
class Handshake(Message):
    TYPE: ClassVar[str] = "handshake"
    worker_id: str
    layout: dict  # a KVLayout wire dict, opaque here
    layout_hash: str


@dataclass(frozen=True)
class HandshakeOk(Message):
    TYPE: ClassVar[str] = "handshake_ok"
    worker_id: str
    layout_hash: str


@dataclass(frozen=True)
class Ticket(Message):
    """What the prefill side returns after prefill: where the request's KV is, until when.

    An early ticket (layer-wise mode) is issued when the prompt's last chunk is scheduled,
    before its forward has run: `first_token` is None, the source streams each layer as
    the forward finishes it, and the pull's `PullDone` brings the first token."""

    TYPE: ClassVar[str] = "ticket"
    request_id: str
    worker_id: str
    endpoint: str
    group_unit_ids: list[list[int]]  # [num_groups][num_units]: block ids, or one slot
    num_tokens: int
    layout_hash: str
    lease_expiry: float  # unix time
    first_token: int | None  # None: an early ticket
    first_logprobs: list[list[float]] | None  # rows of [token_id, logprob, rank]
    finish_reason: str | None
    # prompt tokens the prefill worker did not compute (its prefix-cache hits): the
    # request's `cached_tokens` in the API's usage
    num_cached_tokens: int = 0
    # seconds the prompt waited on the prefill worker before it was scheduled: the
    # request's queue time in the metrics
    queue_s: float = 0.0

    def _check(self) -> None:
        if not math.isfinite(self.lease_expiry):
            raise _schema_error(self, "lease_expiry", f"must be finite, got {self.lease_expiry}")
        if not (math.isfinite(self.queue_s) and self.queue_s >= 0):
            raise _schema_error(self, "queue_s", f"must be finite and >= 0, got {self.queue_s}")
        if not 0 <= self.num_cached_tokens <= self.num_tokens:
            raise _schema_error(
                self, "num_cached_tokens", f"must be in [0, {self.num_tokens}], got "
                f"{self.num_cached_tokens}",
            )  # fmt: skip
        for i, row in enumerate(self.first_logprobs or ()):
            if len(row) != 3:
                raise _schema_error(
                    self,
                    f"first_logprobs[{i}]",
                    f"must be [token_id, logprob, rank], got {len(row)} values",
                )


@dataclass(frozen=True)
class Pull(Message):
    TYPE: ClassVar[str] = "pull"
    request_id: str
    layout_hash: str
    layer_wise: bool
    first_units: list[int]  # per group: units before this one are not sent (receiver has them)


@dataclass(frozen=True)
class NcclPull(Message):
    """A pull whose data frames travel by torch.distributed P2P to `dst_rank` (a global
    rank of the group both sides joined). The reply is one `DataHeader` per frame, then
    `NcclSend`; the frames themselves never touch the socket."""

    TYPE: ClassVar[str] = "nccl_pull"
    request_id: str
    layout_hash: str
    first_units: list[int]  # per group, as in Pull
    dst_rank: int


@dataclass(frozen=True)
class NcclSend(Message):
    """Ends the reply to an `NcclPull`: the `num_frames` frames described by the headers
    before it follow as P2P sends from `src_rank`, in header order. The source names its
    own rank, so a puller never waits on a rank that is not going to send."""

    TYPE: ClassVar[str] = "nccl_send"
    request_id: str
    src_rank: int
    num_frames: int


@dataclass(frozen=True)
class DataHeader(Message):
    """Describes the one raw data frame that follows it: layers [layer_start, layer_end)."""

    TYPE: ClassVar[str] = "data_header"
    request_id: str
    group: int
    tensor: int
    layer_start: int
    layer_end: int
    shape: list[int]
    dtype: str
    nbytes: int

    def _check(self) -> None:
        if self.layer_end < self.layer_start:
            raise _schema_error(
                self,
                "layer_end",
                f"must be >= layer_start {self.layer_start}, got {self.layer_end}",
            )


@dataclass(frozen=True)
class IpcExport(Message):
    """Reply to an `IpcOpen`: how to map the source's KV tensors in another process on the
    same node (CUDA IPC). `handles["tensors"]` holds one entry per group tensor; the
    entries are plain msgpack values that the cuda_ipc transport interprets."""

    TYPE: ClassVar[str] = "ipc_export"
    worker_id: str
    handles: dict


@dataclass(frozen=True)
class IpcOpen(Message):
    TYPE: ClassVar[str] = "ipc_open"
    layout_hash: str


@dataclass(frozen=True)
class PullDone(Message):
    """Ends a tcp pull's stream of `num_frames` frames. For an early ticket it carries the
    prompt's first token and its logprobs (rows as in Ticket); otherwise both are None."""

    TYPE: ClassVar[str] = "pull_done"
    request_id: str
    num_frames: int
    first_token: int | None = None
    first_logprobs: list[list[float]] | None = None


@dataclass(frozen=True)
class Release(Message):
    TYPE: ClassVar[str] = "release"
    request_id: str


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    request_id: str
    extend_s: float

    def _check(self) -> None:
        if not (math.isfinite(self.extend_s) and self.extend_s >= 0):
            raise _schema_error(self, "extend_s", f"must be finite and >= 0, got {self.extend_s}")


@dataclass(frozen=True)
class LeaseInfo(Message):
    """Reply to a Heartbeat: the lease's new expiry (unix time)."""

    TYPE: ClassVar[str] = "lease_info"
    request_id: str
    lease_expiry: float

    def _check(self) -> None:
        if not math.isfinite(self.lease_expiry):
            raise _schema_error(self, "lease_expiry", f"must be finite, got {self.lease_expiry}")


@dataclass(frozen=True)
class Abort(Message):
    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True)
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    request_id: str


@dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    request_id: str
    code: str
    message: str


# The one table: wire type string -> message class.
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Handshake, HandshakeOk, Ticket, Pull, NcclPull, NcclSend, DataHeader, IpcExport,
                IpcOpen, PullDone, Release, Heartbeat, LeaseInfo, Abort, Ack, Error)
}  # fmt: skip
# Field name -> annotation, resolved once (annotations are strings under `from __future__`).
_FIELD_TYPES: dict[type[Message], dict[str, Any]] = {
    cls: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
    for cls in MESSAGE_TYPES.values()
}


def encode(msg: Message) -> bytes:
    """Pack a message as `{"v", "t", "f"}` msgpack bytes."""
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(data: bytes | memoryview, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Unpack and check one message; any problem raises ProtocolError (never another error)."""
    size = memoryview(data).nbytes
    # Checked before unpacking: a peer must not make us allocate for a message we refuse.
    if size > max_bytes:
        raise ProtocolError("too_large", f"message is {size} bytes, limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            # Every element costs >= 1 byte (a map entry >= 2), so no container or string
            # can be longer than the message; ext types are not part of the protocol.
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes // 2,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError("corrupt", f"cannot unpack message: {exc}") from exc
    return _from_wire(obj)


def ticket_to_wire(ticket: Ticket) -> dict:
    """A ticket as a msgpack-ready dict, for carrying inside another message."""
    assert isinstance(ticket, Ticket), f"expected a Ticket, got {type(ticket).__name__}"
    return _to_wire(ticket)


def ticket_from_wire(d: Any) -> Ticket:
    """The inverse of ticket_to_wire, with decode's checks; raises ProtocolError."""
    msg = _from_wire(d)
    if not isinstance(msg, Ticket):
        raise ProtocolError("bad_schema", f"expected a {Ticket.TYPE!r} message, got {msg.TYPE!r}")
    return msg


def _to_wire(msg: Message) -> dict:
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return {"v": PROTOCOL_VERSION, "t": msg.TYPE, "f": fields}


def _from_wire(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise ProtocolError("corrupt", f"a message is a map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version",
            f"got protocol version {reprlib.repr(version)}, expected {PROTOCOL_VERSION}",
        )
    if set(obj) != {"v", "t", "f"}:
        raise ProtocolError(
            "bad_schema",
            f"envelope keys must be v, t, f; got {reprlib.repr(sorted(map(str, obj)))}",
        )
    type_name = obj["t"]
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(
            "unknown_type",
            f"unknown message type {reprlib.repr(type_name)}; known: {sorted(MESSAGE_TYPES)}",
        )
    fields = obj["f"]
    if not isinstance(fields, dict):
        raise ProtocolError(
            "bad_schema", f"{cls.__name__}: fields must be a map, got {type(fields).__name__}"
        )
    expected = _FIELD_TYPES[cls]
    for name in expected:
        if name not in fields:
            raise ProtocolError("bad_schema", f"{cls.__name__}: missing field {name!r}")
    for name in fields:
        if name not in expected:
            raise ProtocolError(
                "bad_schema", f"{cls.__name__}: unexpected field {reprlib.repr(name)}"
            )
    return cls(**fields)  # __post_init__ checks every value


def _type_problem(value: Any, tp: Any) -> str | None:
    """The one validator: None if `value` fits annotation `tp`, else what is wrong, as
    '<path below value>: <problem>' (e.g. '[2][0]: expected int, got float')."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):  # only the `X | None` form is used
        assert len(args) == 2 and type(None) in args, f"{tp}: only X | None is supported"
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _type_problem(value, inner)
    if origin is list:
        if not isinstance(value, list):
            return _mismatch(tp, value)
        (elem_tp,) = args
        # Fast path for block-id lists (a 32k-token ticket holds thousands of ids).
        if elem_tp is int and all(type(x) is int and x >= 0 for x in value):
            return None
        for i, elem in enumerate(value):
            problem = _type_problem(elem, elem_tp)
            if problem is not None:
                return f"[{i}]{problem}"
        return None
    if tp is bool:
        return None if type(value) is bool else _mismatch(tp, value)
    if tp is int:
        # bool is an int subclass: True must not pass as a block id.
        if type(value) is not int:
            return _mismatch(tp, value)
        # Every int in the protocol is an id, index or count.
        return None if value >= 0 else f": must be >= 0, got {value}"
    if tp is float:
        # ints are accepted (other encoders pack 2.0 as 2); NaN never means anything here.
        if type(value) not in (int, float):
            return _mismatch(tp, value)
        return None if value == value else ": must not be NaN"
    if tp in (str, dict):
        return None if type(value) is tp else _mismatch(tp, value)
    raise AssertionError(f"annotation {tp!r} has no validator")


def _mismatch(tp: Any, value: Any) -> str:
    expected = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return f": expected {expected or str(tp)}, got {type(value).__name__}"


def _schema_error(msg: Message, path: str, problem: str) -> ProtocolError:
    return ProtocolError("bad_schema", f"{type(msg).__name__}.{path}: {problem}")
