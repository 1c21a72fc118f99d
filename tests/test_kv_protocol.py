"""The KV transfer control protocol: round trips, and every way a peer's bytes are refused."""

from __future__ import annotations

import math
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
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
    NcclPull,
    NcclSend,
    ProtocolError,
    Pull,
    PullDone,
    Release,
    Ticket,
    decode,
    encode,
    ticket_from_wire,
    ticket_to_wire,
)

TICKET = Ticket(
    request_id="req-1",
    worker_id="prefill-0",
    endpoint="tcp://10.0.0.7:5555",
    group_unit_ids=[[3, 17, 4_000_000], [0]],
    num_tokens=37,
    layout_hash="a1b2c3",
    lease_expiry=1_700_000_000.25,
    first_token=9906,
    first_logprobs=[[9906, -0.125, 1], [13, -2.5, 2]],
    finish_reason=None,
    num_cached_tokens=16,
    queue_s=0.25,
)
ONE_OF_EACH = [
    Handshake("decode-3", {"kind": "paged_gqa", "num_layers": 30, "shape": [2, 16, 3, 64]}, "a1"),
    HandshakeOk("prefill-0", "a1"),
    TICKET,
    Ticket("r", "w", "inproc://x", [], 0, "h", 0.0, 0, None, "stop"),
    Pull("req-1", "a1b2c3", layer_wise=True, first_units=[0, 2]),
    DataHeader("req-1", group=0, tensor=1, layer_start=0, layer_end=30, shape=[30, 6144],
               dtype="bfloat16", nbytes=368_640),
    IpcOpen("a1b2c3"),
    IpcExport("prefill-0", {"tensors": [{"device": 0, "handle": b"\x01\x02", "size": 64}]}),
    PullDone("req-1", num_frames=2),
    Release("req-1"),
    Heartbeat("req-1", extend_s=5.0),
    LeaseInfo("req-1", lease_expiry=1_700_000_005.0),
    Abort("req-1"),
    Ack("req-1"),
    Error("req-1", "lease_expired", "blocks were freed at 1700000005.0"),
    NcclPull("req-1", "a1b2c3", first_units=[2, 0], dst_rank=3),
    NcclSend("req-1", src_rank=0, num_frames=3),
    # Version 2: an early ticket (no first token yet) and the PullDone that brings it.
    Ticket("early", "w", "tcp://h:1", [[5, 6]], 20, "h", 1.0, None, None, None),
    PullDone("early", num_frames=30, first_token=9906, first_logprobs=[[9906, -0.125, 1]]),
]  # fmt: skip


def wire(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def rejected(data: bytes, code: str, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data, max_bytes=max_bytes)
    assert info.value.code == code, str(info.value)
    return str(info.value)


def ticket_with(**changes) -> bytes:
    obj = wire(TICKET)
    obj["f"].update(changes)
    return pack(obj)


def test_every_message_type_round_trips():
    """A field dropped or renamed by encode, or a message type missing from the table."""
    assert {type(m) for m in ONE_OF_EACH} == set(MESSAGE_TYPES.values())
    for msg in ONE_OF_EACH:
        data = encode(msg)
        assert decode(data) == msg
        assert decode(memoryview(data)) == msg
        assert wire(msg)["v"] == PROTOCOL_VERSION and wire(msg)["t"] == msg.TYPE


def test_ticket_to_and_from_wire_round_trip_and_refuse_other_messages():
    """A ticket nested in another message skipping the checks decode makes."""
    assert ticket_from_wire(ticket_to_wire(TICKET)) == TICKET
    assert ticket_from_wire(msgpack.unpackb(pack(ticket_to_wire(TICKET)), raw=False)) == TICKET
    with pytest.raises(ProtocolError, match="expected a 'ticket' message, got 'pull'") as info:
        ticket_from_wire(wire(Pull("r", "h", False, [0])))
    assert info.value.code == "bad_schema"
    bad = ticket_to_wire(TICKET)
    bad["f"] = dict(bad["f"], num_tokens=-1)
    with pytest.raises(ProtocolError, match="num_tokens: must be >= 0"):
        ticket_from_wire(bad)


def test_every_truncation_of_a_ticket_is_corrupt():
    """A short read (a frame cut in two) decoded as a smaller valid message or crashing."""
    data = encode(TICKET)
    for n in range(len(data)):
        rejected(data[:n], "corrupt")


def test_random_garbage_is_rejected():
    """Noise on a socket raising something other than ProtocolError (and killing a loop)."""
    rng = random.Random(0)
    for _ in range(500):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        with pytest.raises(ProtocolError):
            decode(data)


def test_a_flipped_byte_is_rejected_or_decodes_to_a_valid_message():
    """A corrupted byte yielding an invalid message object or an unexpected exception."""
    data = encode(TICKET)
    for pos in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            flipped = bytearray(data)
            flipped[pos] ^= mask
            try:
                msg = decode(bytes(flipped))
            except ProtocolError:
                continue
            assert type(msg) in MESSAGE_TYPES.values()
            assert decode(encode(msg)) == msg  # it passed the same checks a sender's would


def test_wrong_version_names_both_versions():
    """A v2 peer's message read as v1 (fields might mean something else)."""
    obj = wire(TICKET)
    obj["v"] = PROTOCOL_VERSION + 1
    assert f"got protocol version {PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}" in rejected(
        pack(obj), "bad_version"
    )
    obj["v"] = True  # True == 1 in Python; must not pass as version 1
    rejected(pack(obj), "bad_version")
    del obj["v"]
    rejected(pack(obj), "bad_version")


def test_envelope_must_be_a_map_with_exactly_v_t_f():
    """A bare list or an envelope with extra keys accepted as a message."""
    rejected(pack([1, "ticket", {}]), "corrupt")
    obj = wire(Ack("r"))
    obj["x"] = 1
    rejected(pack(obj), "bad_schema")
    obj = wire(Ack("r"))
    obj["f"] = ["r"]
    assert "fields must be a map" in rejected(pack(obj), "bad_schema")


def test_unknown_type_is_named():
    """An unknown message type dispatched to some handler anyway."""
    obj = wire(Ack("r"))
    obj["t"] = "teleport"
    assert "'teleport'" in rejected(pack(obj), "unknown_type")
    obj["t"] = 7
    rejected(pack(obj), "unknown_type")


def test_missing_and_extra_fields_are_named():
    """A message built with a default for a field the peer forgot, or a field ignored."""
    obj = wire(TICKET)
    del obj["f"]["num_tokens"]
    assert "Ticket: missing field 'num_tokens'" in rejected(pack(obj), "bad_schema")
    assert "Ticket: unexpected field 'colour'" in rejected(ticket_with(colour=1), "bad_schema")


@pytest.mark.parametrize(
    "changes, problem",
    [
        (dict(num_tokens="37"), "Ticket.num_tokens: expected int, got str"),
        (dict(num_tokens=True), "Ticket.num_tokens: expected int, got bool"),
        (dict(num_tokens=37.0), "Ticket.num_tokens: expected int, got float"),
        (dict(group_unit_ids=[[3, 17.0]]), "Ticket.group_unit_ids[0][1]: expected int, got float"),
        (dict(group_unit_ids=[[3], [4, False]]), "group_unit_ids[1][1]: expected int, got bool"),
        (dict(group_unit_ids=[3, 17]), "Ticket.group_unit_ids[0]: expected list[int], got int"),
        (dict(group_unit_ids=None), "group_unit_ids: expected list[list[int]], got NoneType"),
        (dict(first_logprobs=[[1, "x", 1]]), "first_logprobs[0][1]: expected float, got str"),
        (dict(first_logprobs=[[1, -0.5]]), "first_logprobs[0]: must be [token_id, logprob, rank]"),
        (dict(lease_expiry="soon"), "Ticket.lease_expiry: expected float, got str"),
        (dict(lease_expiry=math.inf), "Ticket.lease_expiry: must be finite"),
        (dict(lease_expiry=math.nan), "Ticket.lease_expiry: must not be NaN"),
        (dict(finish_reason=3), "Ticket.finish_reason: expected str, got int"),
        (dict(request_id=b"req-1"), "Ticket.request_id: expected str, got bytes"),
        (dict(num_tokens=-1), "Ticket.num_tokens: must be >= 0, got -1"),
        (dict(group_unit_ids=[[-3]]), "Ticket.group_unit_ids[0][0]: must be >= 0"),
        (dict(num_cached_tokens=38), "Ticket.num_cached_tokens: must be in [0, 37], got 38"),
        (dict(num_cached_tokens=-1), "Ticket.num_cached_tokens: must be >= 0, got -1"),
        (dict(num_cached_tokens=1.0), "Ticket.num_cached_tokens: expected int, got float"),
        (dict(queue_s=-0.5), "Ticket.queue_s: must be finite and >= 0, got -0.5"),
        (dict(queue_s=float("nan")), "Ticket.queue_s: must not be NaN"),
        (dict(queue_s=float("inf")), "Ticket.queue_s: must be finite and >= 0, got inf"),
        (dict(queue_s="1"), "Ticket.queue_s: expected float, got str"),
    ],
)
def test_wrong_field_types_and_values_are_named(changes, problem):
    """A wrong-typed field reaching the block allocator (True as block 1, 17.0 as an index)."""
    assert problem in rejected(ticket_with(**changes), "bad_schema")


def test_other_messages_check_their_fields():
    """Schema checks only wired up for tickets."""
    obj = wire(Pull("r", "h", True, [0]))
    obj["f"]["layer_wise"] = 1
    assert "Pull.layer_wise: expected bool, got int" in rejected(pack(obj), "bad_schema")
    obj = wire(PullDone("r", 2))
    obj["f"]["num_frames"] = -2
    assert "PullDone.num_frames: must be >= 0" in rejected(pack(obj), "bad_schema")
    obj = wire(ONE_OF_EACH[5])
    obj["f"]["shape"] = [30, 6144.0]
    assert "DataHeader.shape[1]: expected int, got float" in rejected(pack(obj), "bad_schema")
    obj["f"].update(shape=[30, 6144], layer_start=5, layer_end=4)
    assert "DataHeader.layer_end: must be >= layer_start" in rejected(pack(obj), "bad_schema")
    obj = wire(Handshake("w", {}, "h"))
    obj["f"]["layout"] = [1, 2]
    assert "Handshake.layout: expected dict, got list" in rejected(pack(obj), "bad_schema")
    obj = wire(Heartbeat("r", 1.0))
    obj["f"]["extend_s"] = -1.0
    assert "Heartbeat.extend_s: must be finite and >= 0" in rejected(pack(obj), "bad_schema")
    obj = wire(NcclPull("r", "h", [0], dst_rank=1))
    obj["f"]["dst_rank"] = -1
    assert "NcclPull.dst_rank: must be >= 0" in rejected(pack(obj), "bad_schema")


def test_int_is_accepted_where_float_is_expected():
    """A peer whose encoder packs 5.0 as 5 refused for no reason."""
    assert decode(ticket_with(lease_expiry=1_700_000_000)).lease_expiry == 1_700_000_000


def test_a_sender_cannot_build_what_a_receiver_refuses():
    """An invalid message encoded locally and only caught by the remote peer."""
    with pytest.raises(ProtocolError, match="Ticket.num_tokens: must be >= 0") as info:
        Ticket("r", "w", "e", [[1]], -5, "h", 0.0, 0, None, None)
    assert info.value.code == "bad_schema"
    with pytest.raises(ProtocolError, match=r"Release.request_id: expected str, got int"):
        Release(5)


def test_oversized_message_is_refused_before_unpacking():
    """A peer making us unpack (and allocate) a message we will refuse anyway."""
    huge = b"\xc1" * (2 << 20)  # invalid msgpack: unpacking it would say corrupt, not too_large
    assert f"{2 << 20} bytes, limit is {1 << 20}" in rejected(huge, "too_large", max_bytes=1 << 20)
    with pytest.raises(ProtocolError) as info:
        decode(memoryview(huge), max_bytes=1 << 20)
    assert info.value.code == "too_large"
    data = encode(TICKET)
    rejected(data, "too_large", max_bytes=len(data) - 1)
    assert decode(data, max_bytes=len(data)) == TICKET


def test_ext_types_and_nested_garbage_are_corrupt():
    """msgpack ext types (or timestamps) smuggled into the opaque layout dict."""
    obj = wire(Handshake("w", {}, "h"))
    obj["f"]["layout"] = {"x": msgpack.ExtType(5, b"abc")}
    rejected(pack(obj), "corrupt")
    rejected(b"\x91" * 10_000, "corrupt")  # 10k nested arrays, truncated


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_raise_protocol_error(data):
    """Any byte string from a peer raising a non-ProtocolError (crashing the receive loop)."""
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert type(msg) in MESSAGE_TYPES.values()


_LEAF = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text()
_VALUE = st.recursive(
    _LEAF | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_FIELD_NAMES = sorted({name for m in ONE_OF_EACH for name in wire(m)["f"]})


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.sampled_from(_FIELD_NAMES), _VALUE, max_size=12),
)
def test_well_formed_envelopes_with_random_fields_only_raise_protocol_error(type_name, fields):
    """Random field values getting past unpacking and crashing the validator or __init__."""
    try:
        msg = decode(pack({"v": PROTOCOL_VERSION, "t": type_name, "f": fields}))
    except ProtocolError as exc:
        assert exc.code == "bad_schema", str(exc)
        return
    assert decode(encode(msg)) == msg


def test_pull_done_first_token_is_checked_like_a_tickets():
    """Guards version 2's PullDone: the first token of an early ticket travels in it, so a
    peer's token of the wrong type (a float, a bool, a string) or a frame from a version 1
    peer (no token fields at all) must be refused at decode, never reach the engine."""
    obj = wire(PullDone("early", num_frames=2, first_token=5, first_logprobs=None))
    for bad in (5.0, True, "5"):
        obj["f"]["first_token"] = bad
        assert "PullDone.first_token" in rejected(pack(obj), "bad_schema")
    obj["f"]["first_token"] = 5
    obj["f"]["first_logprobs"] = [[5, -0.5]]  # rows are [token, logprob, rank]
    decoded = decode(pack(obj))  # the row length is the engine's to check (Ticket checks it)
    assert decoded.first_logprobs == [[5, -0.5]]
    del obj["f"]["first_token"], obj["f"]["first_logprobs"]
    assert "missing field 'first_token'" in rejected(pack(obj), "bad_schema")
