"""How fast can ZMQ move a KV pull over loopback tcp with several connections?

Not a test. Question: the tcp transport moves ~1.5 GB/s on the H200 host (one DEALER
socket, one ZMQ I/O thread a side). Is that one I/O thread, or the copies around it?

A source process holds `--mib` MiB (on the GPU when `--src gpu`: each chunk is copied to a
fresh host tensor before it is sent, as the KV server's `.cpu()` does) and streams it in
`--chunk-mib` chunks; chunk k goes to connection k % N. The puller opens N DEALER sockets
in a context of T I/O threads, asks each for its share, and receives with `copy=False`;
with `--dst gpu` every frame is copied into a device tensor (pageable host -> device, as
`unpack_frame` does), with `--dst host` into a preallocated host tensor. One JSON row per
(N, T): the median GB/s of `--reps` pulls.

    python benchmarks/tcp_streams_probe.py [--src cpu|gpu] [--dst none|host|gpu] \
        [--conns 1,2,4,8] [--io-threads 1,2,4,8] [--mib 224] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import zmq
from run_meta import device_kind, git_commit


def serve(port_file: str, mib: int, chunk_mib: int, src: str, io_threads: int) -> None:
    ctx = zmq.Context(io_threads=io_threads)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file).write_text(str(port))
    device = "cuda" if src == "gpu" else "cpu"
    data = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8, device=device)
    chunk = chunk_mib << 20
    num_chunks = (data.numel() + chunk - 1) // chunk
    while True:
        ident, body = sock.recv_multipart()
        if body == b"stop":
            return
        i, n = (int(x) for x in body.split(b"/"))
        for k in range(i, num_chunks, n):
            part = data[k * chunk : (k + 1) * chunk]
            part = part.cpu() if device == "cuda" else part
            sock.send_multipart([ident, b"%d" % k, memoryview(part.numpy())], copy=False)
        sock.send_multipart([ident, b"done", b""])


def pull(socks: list[zmq.Socket], dst: torch.Tensor | None, chunk: int) -> int:
    for i, s in enumerate(socks):
        s.send(b"%d/%d" % (i, len(socks)))
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    open_socks, moved = len(socks), 0
    while open_socks:
        for s, _ in poller.poll(30_000):
            head, frame = s.recv_multipart(copy=False)
            if head.bytes == b"done":
                open_socks -= 1
                continue
            buf = frame.buffer
            moved += buf.nbytes
            if dst is not None:
                k = int(head.bytes)
                src = torch.frombuffer(buf, dtype=torch.uint8)
                dst[k * chunk : k * chunk + src.numel()].copy_(src)
    return moved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--serve", default="")
    p.add_argument("--src", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--dst", default="none", choices=["none", "host", "gpu"])
    p.add_argument("--conns", default="1,2,4,8")
    p.add_argument("--io-threads", default="1,2,4,8")
    p.add_argument("--mib", type=int, default=224)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.serve:
        return serve(args.serve, args.mib, args.chunk_mib, args.src, int(args.io_threads))
    rows = []
    chunk = args.chunk_mib << 20
    dst = None
    if args.dst != "none":
        dst = torch.empty(
            args.mib << 20, dtype=torch.uint8, device="cuda" if args.dst == "gpu" else "cpu"
        )
    for t in (int(x) for x in args.io_threads.split(",")):
        port_file = f"/tmp/tcp_probe_port_{t}"
        Path(port_file).unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--serve", port_file, "--src", args.src,
               "--io-threads", str(t), "--mib", str(args.mib),
               "--chunk-mib", str(args.chunk_mib)]  # fmt: skip
        server = subprocess.Popen(cmd)
        deadline = time.monotonic() + 120
        while not Path(port_file).exists() or not Path(port_file).read_text():
            assert time.monotonic() < deadline and server.poll() is None, "server did not start"
            time.sleep(0.05)
        address = f"tcp://127.0.0.1:{Path(port_file).read_text()}"
        ctx = zmq.Context(io_threads=t)
        for n in (int(x) for x in args.conns.split(",")):
            socks = []
            for _ in range(n):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(address)
                socks.append(s)
            pull(socks, dst, chunk)  # warm-up: connections, page cache, allocator
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                moved = pull(socks, dst, chunk)
                if dst is not None and dst.is_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            row = {"conns": n, "io_threads": t, "src": args.src, "dst": args.dst,
                   "bytes": moved, "chunk_mib": args.chunk_mib, "ms": round(1e3 * med, 2),
                   "GBps": round(moved / med / 1e9, 3), "device": device_kind(),
                   "commit": git_commit(), "command": " ".join(sys.argv)}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            for s in socks:
                s.close(linger=0)
        stopper = ctx.socket(zmq.DEALER)
        stopper.connect(address)
        stopper.send(b"stop")
        server.wait(30)
        stopper.close(linger=0)
        ctx.term()
    if args.out:
        path = Path(args.out) / f"tcp_streams_probe_{args.src}_{args.dst}_{device_kind()}.json"
        path.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
