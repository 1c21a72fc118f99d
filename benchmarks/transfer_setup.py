"""What both processes of benchmarks/transfer.py build: the layouts, the benchmarked
requests' unit ids, filled storages and their check, and the source process (rank 0 of
the nccl case) that serves them with a raw sender for the baseline beside it.

Not a test, and it measures nothing itself.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.layout import GroupStorage, KVLayout, MambaStateGroup, PagedGQAGroup
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.protocol import Ticket
from pdserve.kvtransfer.source import KVSource

_GQA = PagedGQAGroup("kv", 28, 16, 8, 128, "bfloat16")
# Mamba2 at hidden 1024: conv over 2 x 1024 + 2 x 128 channels, d_conv 4; 32 heads x 64 x
# d_state 128 of fp32 ssm state (1 MiB per layer).
_MAMBA = MambaStateGroup("mamba", 28, (2304, 3), (32, 64, 128), "bfloat16", "float32")
LAYOUTS = {
    "paged_gqa": KVLayout("qwen3-0.6b-shape", (_GQA,)),
    "hybrid": KVLayout("qwen3-0.6b-shape-hybrid", (_GQA, _MAMBA)),
}
TOKENS = (2048, 128)
TIMEOUT_S = 120.0
_UNIT_STRIDE = 1024  # fill value = layer * 1024 + unit + 1 (fits int16: 28 layers, < 1024 units)


@dataclass(frozen=True)
class Request:
    request_id: str
    tokens: int
    src_ids: tuple[tuple[int, ...], ...]  # [group][unit]
    dst_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Run:
    """What every case of one invocation shares."""

    layout_names: tuple[str, ...]
    reps: int
    p2p_backend: str  # "nccl" (GPUs 0 -> 1), or "gloo" (CPU: the nccl transport's path on CPU)
    profile_pulls: int = 0  # > 0: also run this many pulls per case under cProfile
    hang_dump_s: float = 0.0  # > 0: both processes print every thread's stack after this long

    def source_device(self, kind: str) -> str:
        if kind == "tcp" or (kind == "nccl" and self.p2p_backend == "gloo"):
            return "cpu"
        if kind == "local" and not torch.cuda.is_available():
            return "cpu"
        return "cuda:0"


def plan(layout: KVLayout) -> tuple[list[Request], tuple[int, ...]]:
    """The benchmarked requests and the units per storage: paged blocks at scattered ids
    (a random permutation of twice what the requests need), one Mamba slot per request."""
    requests: list[list[list[int]]] = [[[], []] for _ in TOKENS]
    sizes = []
    for g, group in enumerate(layout.groups):
        if isinstance(group, PagedGQAGroup):
            blocks = [math.ceil(t / group.block_size) for t in TOKENS]
            num_units = 2 * sum(blocks) + 8
            for side, seed in ((0, 0), (1, 1)):
                perm = torch.randperm(num_units, generator=torch.Generator().manual_seed(seed))
                cursor = 0
                for r, n in enumerate(blocks):
                    requests[r][side].append(perm[cursor : cursor + n].tolist())
                    cursor += n
        else:
            num_units = len(TOKENS) + 2
            for r in range(len(TOKENS)):
                requests[r][0].append([r + 1])
                requests[r][1].append([num_units - 1 - r])
        assert num_units < _UNIT_STRIDE, f"group {g}: {num_units} units break the fill pattern"
        sizes.append(num_units)
    out = [
        Request(f"r{t}", t, tuple(map(tuple, src)), tuple(map(tuple, dst)))
        for t, (src, dst) in zip(TOKENS, requests)
    ]
    return out, tuple(sizes)


def request_bytes(layout: KVLayout, req: Request) -> int:
    return sum(len(ids) * g.unit_bytes() for ids, g in zip(req.src_ids, layout.groups))


def allocate(layout: KVLayout, sizes: tuple[int, ...], device: str, fill: bool) -> tuple:
    storages = tuple(g.allocate(n, device) for g, n in zip(layout.groups, sizes))
    for storage in storages if fill else ():
        for t in storage.flat():
            bits = bitwise_view(t)
            layer = torch.arange(t.shape[0], device=device).view(-1, 1, 1) * _UNIT_STRIDE
            unit = torch.arange(t.shape[1], device=device).view(1, -1, 1) + 1
            bits.copy_((layer + unit).expand_as(bits))
    return storages


def verify(dst: tuple[GroupStorage, ...], req: Request) -> None:
    """Every destination unit holds its source unit's pattern, in every layer."""
    for g, storage in enumerate(dst):
        for t in storage.flat():
            bits = bitwise_view(t)
            ids = torch.tensor(req.dst_ids[g], device=t.device)
            layer = torch.arange(t.shape[0], device=t.device).view(-1, 1, 1) * _UNIT_STRIDE
            src = torch.tensor(req.src_ids[g], device=t.device).view(1, -1, 1) + 1
            got = bits.index_select(1, ids)
            if not torch.equal(got, (layer + src).to(bits.dtype).expand_as(got)):
                raise AssertionError(f"{req.request_id}: group {g} landed at the wrong units")


def ticket(layout: KVLayout, req: Request, endpoint: str) -> Ticket:
    return Ticket(
        req.request_id, "P", endpoint, [list(ids) for ids in req.src_ids], req.tokens,
        layout.compat_hash(), time.time() + 3600, 0, None, None,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(backend: str, port: int, rank: int, device: str) -> None:
    """Rank 0 is the source, rank 1 the puller. NCCL is initialized eagerly (`device_id`),
    so P2P ops use the group's communicator instead of creating one on first use."""
    kwargs = {}
    if device != "cpu":
        torch.cuda.set_device(device)
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, **kwargs
    )


def _raw_sender(kind: str, buf: torch.Tensor, sock: zmq.Socket, stop: threading.Event) -> None:
    """The baseline's sending side: a request names a byte count; tcp answers with one
    frame of that many bytes (no copy), nccl answers "go" and sends them to rank 1."""
    while not stop.is_set():
        if not sock.poll(50):
            continue
        nbytes = int(sock.recv())
        if kind == "nccl":
            sock.send(b"go")
            dist.send(buf[:nbytes], 1)
        else:
            sock.send(memoryview(buf.numpy())[:nbytes], copy=False)


def serve(kind: str, run: Run, threads: int, pg_port: int, q: mp.Queue, done: mp.Event) -> None:
    from pdserve.kvtransfer.server import KVSourceServer

    torch.set_num_threads(threads)  # the puller's: both sides pack or unpack alike
    if run.hang_dump_s > 0:
        faulthandler.dump_traceback_later(run.hang_dump_s)
    device = run.source_device(kind)
    if kind == "nccl":
        init_group(run.p2p_backend, pg_port, 0, device)
    servers, endpoints, max_bytes = [], {}, 0
    for name in run.layout_names:
        layout = LAYOUTS[name]
        requests, sizes = plan(layout)
        storages = allocate(layout, sizes, device, fill=True)
        leases = LeaseTable(3600.0)
        for req in requests:
            leases.add(req.request_id, [list(ids) for ids in req.src_ids], req.tokens)
            max_bytes = max(max_bytes, request_bytes(layout, req))
        source = KVSource("P", layout, storages, leases)
        if kind == "tcp":
            server = KVSourceServer(source)
            endpoints[name] = server.endpoint
        elif kind in ("cuda_ipc", "cuda_ipc_peer"):
            from pdserve.kvtransfer.transport_cuda_ipc import export_storages

            server = KVSourceServer(source, ipc_export=export_storages(storages))
            endpoints[name] = "cuda_ipc+" + server.endpoint
        else:
            from pdserve.kvtransfer.transport_nccl import NcclSourceServer

            server = NcclSourceServer(source, send_timeout_s=TIMEOUT_S)
            endpoints[name] = server.ticket_endpoint
        servers.append(server)
    # The baseline's sender; cuda_ipc's baselines are copies in the puller's process.
    raw = zmq.Context.instance().socket(zmq.REP)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind("tcp://127.0.0.1:0")
    stop = threading.Event()
    ipc = kind.startswith("cuda_ipc")
    if not ipc:
        buf = torch.ones(max_bytes, dtype=torch.uint8, device=device)
        sender = threading.Thread(target=_raw_sender, args=(kind, buf, raw, stop), daemon=True)
        sender.start()
    q.put({"layouts": endpoints, "raw": raw.getsockopt_string(zmq.LAST_ENDPOINT)})
    done.wait()
    stop.set()
    if not ipc:
        sender.join(5)
    raw.close()
    for server in servers:
        server.close()
    if kind == "nccl":
        dist.destroy_process_group()


@contextlib.contextmanager
def source_process(
    kind: str,
    run: Run,
    pg_port: int = 0,
    join_group: Callable[[], None] | None = None,
    leave_group: Callable[[], None] | None = None,
) -> Iterator[dict]:
    """The source's endpoints, while it serves. `join_group` runs before they are read:
    rank 0 builds its servers only once both ranks have joined the process group.
    `leave_group` runs once the source has been told to stop and before it is waited for:
    NCCL's destroy waits for the other rank's, so the two must overlap (a puller that
    destroyed its group before telling the source to stop hung, H200 x2)."""
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    args = (kind, run, torch.get_num_threads(), pg_port, q, done)
    proc = ctx.Process(target=serve, args=args, daemon=True)
    proc.start()
    try:
        if join_group is not None:
            join_group()
        yield q.get(timeout=TIMEOUT_S)
    finally:
        done.set()
        if leave_group is not None:
            leave_group()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
