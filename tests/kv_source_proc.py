"""A KV source in its own process, for the transfer tests (test_kv_transfer_procs.py,
test_kv_faults.py): `python kv_source_proc.py '<spec json>'`, or `start(spec)`.

The spec names a mode and one or more sources. A source is a layout (`"layout"`: a name
in `LAYOUTS`, or `"wire"`: a `KVLayout.to_wire()` dict), a unit count, a seed, leases
`{request_id: [[unit ids] per group]}` and optionally `"finite": true`; its storage is
`fill_storages(layout, num_units, seed, finite)`, random bits with NaN patterns, which a test rebuilds from the same seed to compare
against. The process prints one JSON line `{"endpoints": [...], "hashes": [...]}` and
serves until its stdin closes, then exits 0.

Modes:
- "serve": a real `KVSourceServer` per source.
- "misbehave": a raw ROUTER (first source only) that answers a handshake correctly and
  answers a Pull with the stream broken the way its request id says (`BREAKAGES`).
- "die": a Pull gets its first `[DataHeader, frame]` (flushed to the peer), then the
  process ends with `os._exit(1)`, as a crash mid-transfer would.
- "stall": a Pull gets its first `[DataHeader, frame]`, then the line "sent" goes to
  stdout and nothing more is sent (the test SIGKILLs the process).

The raw modes speak the real protocol (`protocol.encode`) over a real socket; only the
reply stream is wrong.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys

import torch
import zmq

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.layout import (
    GroupStorage,
    KVLayout,
    MambaStateGroup,
    PagedGQAGroup,
    PagedMLAGroup,
)
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.pack import as_byte_view
from pdserve.kvtransfer.protocol import (
    Ack,
    DataHeader,
    Handshake,
    HandshakeOk,
    Pull,
    PullDone,
    Release,
    decode,
    encode,
)
from pdserve.kvtransfer.source import KVSource

# Awkward sizes (head_dim 5, rope 3, conv 6x3), bf16 / fp16 / fp32 as the brief asks.
LAYOUTS = {
    "paged_gqa": KVLayout("m", (PagedGQAGroup("kv", 3, 4, 2, 5, "bfloat16"),)),
    "paged_mla": KVLayout("m", (PagedMLAGroup("latent", 2, 4, 12, 3, "float16"),)),
    "mamba_state": KVLayout(
        "m", (MambaStateGroup("ssm", 3, (6, 3), (2, 4, 5), "bfloat16", "float32"),)
    ),
    "hybrid": KVLayout(
        "m",
        (
            PagedGQAGroup("attn", 2, 4, 1, 6, "bfloat16"),
            MambaStateGroup("mamba", 2, (5, 3), (3, 7), "bfloat16", "float32"),
        ),
    ),
}
NUM_UNITS = 13
# Quiet, signalling and sign-flipped NaNs with payloads: a float copy path quiets sNaNs.
NAN_BITS = {
    torch.float32: (0x7FC00001, 0x7F800001, 0xFFC12345),
    torch.bfloat16: (0x7FC1, 0x7F81, 0xFFFF),
    torch.float16: (0x7E01, 0x7C01, 0xFFFF),
}
# The request id of a Pull to a "misbehave" peer picks the breakage of its reply stream.
BREAKAGES = (
    "ok",  # the correct stream: proves the raw peer itself speaks the protocol
    "bad_shape",  # first header: one unit too many (frame sized to match the header)
    "bad_dtype",  # first header: another dtype of the same width
    "truncated_frame",  # first frame 3 bytes short of its header's nbytes
    "bad_nbytes",  # first header claims 8 bytes more than its frame
    "bad_layers",  # first header: layers shifted one past the last layer
    "bad_group",  # first header: a group that does not exist
    "other_request",  # first header carries another request's id
    "no_data_frame",  # first header without its raw frame
    "ack_instead",  # an Ack where a DataHeader belongs
    "garbage_reply",  # random bytes where a DataHeader belongs
    "short_done",  # every frame, but PullDone counts one more
    "missing_frame",  # the last frame left out, PullDone counting what was sent
    "duplicate_frame",  # the last frame replaced by the first again, count unchanged
)


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def fill_storages(
    layout: KVLayout, num_units: int, seed: int, finite: bool = False
) -> tuple[GroupStorage, ...]:
    """Storages of random bits, every unit of every layer starting with NaN patterns, so
    a float path anywhere (which would quiet or canonicalise them) changes the bits; with
    `finite`, standard normal values instead (KV a model could have written)."""
    gen = torch.Generator().manual_seed(seed)
    storages = []
    for group in layout.groups:
        storage = group.allocate(num_units)
        for t in storage.tensors:
            if finite:
                t.copy_(torch.randn(t.shape, generator=gen))
                continue
            bits = bitwise_view(t)
            raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen)
            bits.view(-1).view(torch.uint8).copy_(raw.to(torch.uint8))
            nans = [_signed(v, 8 * t.element_size()) for v in NAN_BITS[t.dtype]]
            per_unit = bits.view(t.shape[0], t.shape[1], -1)
            per_unit[:, :, : len(nans)] = torch.tensor(nans, dtype=bits.dtype)
        storages.append(storage)
    return tuple(storages)


def layout_of(source_spec: dict) -> KVLayout:
    if "wire" in source_spec:
        return KVLayout.from_wire(source_spec["wire"])
    return LAYOUTS[source_spec["layout"]]


def build_source(source_spec: dict, worker_id: str = "P") -> KVSource:
    layout = layout_of(source_spec)
    storages = fill_storages(
        layout, source_spec["num_units"], source_spec["seed"], source_spec.get("finite", False)
    )
    source = KVSource(worker_id, layout, storages, LeaseTable(3600.0))
    for request_id, group_unit_ids in source_spec["leases"].items():
        source.leases.add(request_id, group_unit_ids, num_tokens=1)
    return source


def pull_stream(source: KVSource, pull: Pull) -> list[list[bytes]]:
    """The reply a `KVSourceServer` sends to `pull`: `[header, frame]` messages, then
    `[PullDone]` (each message without the ROUTER identity)."""
    with source.leases.pinned(pull.request_id) as lease:
        buffers = source.pack_request(lease.group_unit_ids, pull.first_units)
    out: list[list[bytes]] = []
    for g, tensors in enumerate(buffers):
        for t, buf in enumerate(tensors):
            num_layers = buf.shape[0]
            spans = (
                [(i, i + 1) for i in range(num_layers)] if pull.layer_wise else [(0, num_layers)]
            )
            for start, end in spans:
                part = buf[start:end].contiguous()
                nbytes = part.numel() * part.element_size()
                dtype = str(part.dtype).removeprefix("torch.")
                header = DataHeader(
                    pull.request_id, g, t, start, end, list(part.shape), dtype, nbytes
                )
                out.append([encode(header), bytes(as_byte_view(part))])
    out.append([encode(PullDone(pull.request_id, len(out)))])
    return out


def _header(message: list[bytes], **changes) -> bytes:
    header = decode(message[0])
    fields = {**header.__dict__, **changes}
    return encode(DataHeader(**fields))


def break_stream(source: KVSource, name: str, stream: list[list[bytes]]) -> list[list[bytes]]:
    """`stream` (as `pull_stream` made it for request `name`) broken the way `name` says."""
    request_id = name
    data, done = stream[:-1], stream[-1]
    first = decode(data[0][0])
    frame = data[0][1]
    if name == "ok":
        return stream
    if name == "bad_shape":
        shape = [first.shape[0], first.shape[1] + 1, first.shape[2]]
        nbytes = first.nbytes // first.shape[1] * shape[1]
        return [[_header(data[0], shape=shape, nbytes=nbytes), bytes(nbytes)], *data[1:], done]
    if name == "bad_dtype":
        other = "float16" if first.dtype == "bfloat16" else "bfloat16"
        return [[_header(data[0], dtype=other), frame], *data[1:], done]
    if name == "truncated_frame":
        return [[data[0][0], frame[:-3]], *data[1:], done]
    if name == "bad_nbytes":
        return [[_header(data[0], nbytes=first.nbytes + 8), frame], *data[1:], done]
    if name == "bad_layers":
        span = first.layer_end - first.layer_start
        start = source.layout.groups[first.group].num_layers - span + 1  # ends one past L
        return [[_header(data[0], layer_start=start, layer_end=start + span), frame], done]
    if name == "bad_group":
        return [[_header(data[0], group=7), frame], *data[1:], done]
    if name == "other_request":
        return [[_header(data[0], request_id="someone-else"), frame], *data[1:], done]
    if name == "no_data_frame":
        return [[data[0][0]], *data[1:], done]
    if name == "ack_instead":
        return [[encode(Ack(request_id))], *data[1:], done]
    if name == "garbage_reply":
        return [[b"\xc1" + os.urandom(40)], *data[1:], done]
    if name == "short_done":
        return [*data, [encode(PullDone(request_id, len(data) + 1))]]
    if name == "missing_frame":
        return [*data[:-1], [encode(PullDone(request_id, len(data) - 1))]]
    if name == "duplicate_frame":
        return [*data[:-1], data[0], done]
    raise AssertionError(f"unknown breakage {name!r}")


def _serve(spec: dict) -> None:
    from pdserve.kvtransfer.server import KVSourceServer

    max_bytes = spec.get("max_message_bytes", 1 << 20)
    servers = [
        KVSourceServer(build_source(s, f"P{i}"), max_message_bytes=max_bytes)
        for i, s in enumerate(spec["sources"])
    ]
    _announce([s.endpoint for s in servers], [s.source.layout_hash for s in servers])
    sys.stdin.read()  # until the test closes our stdin
    for server in servers:
        server.close()


def _raw_peer(spec: dict) -> None:
    mode = spec["mode"]
    source = build_source(spec["sources"][0])
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    _announce([sock.getsockopt_string(zmq.LAST_ENDPOINT)], [source.layout_hash])
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if stdin in ready and not os.read(stdin, 4096):
            break
        if sock not in ready:
            continue
        identity, body = sock.recv_multipart()
        msg = decode(body)
        if isinstance(msg, Handshake):
            sock.send_multipart(
                [identity, encode(HandshakeOk(source.worker_id, source.layout_hash))]
            )
        elif isinstance(msg, Release):
            sock.send_multipart([identity, encode(Ack(msg.request_id))])
        elif isinstance(msg, Pull):
            stream = pull_stream(source, msg)
            if mode == "misbehave":
                for message in break_stream(source, msg.request_id, stream):
                    sock.send_multipart([identity, *message])
                continue
            sock.send_multipart([identity, *stream[0]])
            if mode == "die":
                sock.close(linger=10_000)  # flush the first frame to the peer, then crash
                ctx.term()
                os._exit(1)
            print("sent", flush=True)  # "stall": the test kills us now
        else:
            sock.send_multipart([identity, encode(Ack(getattr(msg, "request_id", "")))])
    sock.close(linger=0)


def _announce(endpoints: list[str], hashes: list[str]) -> None:
    print(json.dumps({"endpoints": endpoints, "hashes": hashes}), flush=True)


def start(spec: dict, timeout_s: float = 60.0) -> tuple[subprocess.Popen, dict]:
    """Start this script on `spec`; returns the process and its announced endpoints."""
    proc = subprocess.Popen(
        [sys.executable, __file__, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = read_line(proc, timeout_s)
    if not line:
        proc.kill()
        raise RuntimeError(f"source process exited with {proc.wait(10)} before announcing")
    return proc, json.loads(line)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of the process's stdout, or "" if none comes within `timeout_s`."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline()


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """Close the process's stdin (its signal to end) and return its exit code."""
    if proc.stdin is not None:
        proc.stdin.close()  # nothing was written to it, so nothing to flush into a dead pipe
    try:
        return proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout_s)
        if proc.stdout is not None:
            proc.stdout.close()


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    if spec["mode"] == "serve":
        _serve(spec)
    else:
        assert spec["mode"] in ("misbehave", "die", "stall"), spec["mode"]
        _raw_peer(spec)


if __name__ == "__main__":
    main()
