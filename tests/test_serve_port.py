"""`pdserve serve` and a port someone else holds: the HTTP socket is bound before Ray and
the workers start, so a taken port is a clear error within seconds (and Ray's own
processes, which take ports at random while they start, cannot take it from the server);
`ServeProcess` (tests, benchmarks) retries on a new port when that happens to its pick."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from pdserve.cluster import serve_process


def _held_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_taken_port_fails_before_ray_starts():
    with _held_port() as held:
        port = held.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "on Ray" not in proc.stdout, "the workers started before the bind"
    assert time.monotonic() - start < 120


def test_serve_process_retries_a_taken_port_then_says_so(tmp_path, monkeypatch):
    """Every pick taken (a stand-in `free_port` handing out held ports): three starts,
    three fast exits, then one error naming the cause and quoting the server's log."""
    held = [_held_port() for _ in range(serve_process.PORT_ATTEMPTS)]
    picks = iter([s.getsockname()[1] for s in held])
    monkeypatch.setattr(serve_process, "free_port", lambda: next(picks))
    try:
        with pytest.raises(RuntimeError, match="port taken 3 times") as err:
            serve_process.ServeProcess(tmp_path, "--device", "cpu", start_timeout_s=300)
        assert "cannot listen on 127.0.0.1:" in str(err.value)
        assert len(list(tmp_path.glob("serve-*.log"))) == serve_process.PORT_ATTEMPTS
    finally:
        for s in held:
            s.close()
