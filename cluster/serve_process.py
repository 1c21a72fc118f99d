"""`pdserve serve` as a child process: start it on a free port, wait until /health answers,
stop it the way an operator does (Ctrl-C), with a deadline on every wait.

Used by the end-to-end tests and by benchmarks that compare deployments (PD vs
colocated). The server's output goes to a log file, which every error quotes.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What `pdserve serve` prints when its port was taken between `free_port` and its bind
# (another process can take a free port first); the start is retried on a new port.
PORT_TAKEN = "cannot listen on"
PORT_ATTEMPTS = 3


class ServeProcess:
    """One `pdserve serve --port P *args` child, up and healthy once constructed.
    `tls_ca`: the child serves TLS (its args name a certificate), checked against this CA
    file; `url` is then https."""

    def __init__(
        self, log_dir: Path, *args: str, start_timeout_s: float = 300.0, tls_ca: str | None = None
    ) -> None:
        self.verify: ssl.SSLContext | bool = (
            True if tls_ca is None else ssl.create_default_context(cafile=tls_ca)
        )
        self.scheme = "http" if tls_ca is None else "https"
        deadline = time.monotonic() + start_timeout_s
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._start(Path(log_dir), args, deadline)
                return
            except _PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise RuntimeError(
                        f"server found its port taken {PORT_ATTEMPTS} times:\n{self.log.read_text()}"
                    ) from None

    def _start(self, log_dir: Path, args: tuple[str, ...], deadline: float) -> None:
        self.port = free_port()
        self.log = log_dir / f"serve-{self.port}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log.open("w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        start_timeout_s = max(deadline - time.monotonic(), 0.0)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text()
                if PORT_TAKEN in log:
                    raise _PortTaken
                raise RuntimeError(f"server exited:\n{log}")
            # Short waits: a child that exits at once (its port was taken, and whoever
            # holds the port may accept and never answer) is seen within a second; a
            # slow /health is asked again.
            try:
                health = httpx.get(self.url + "/health", timeout=0.5, verify=self.verify)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(
            f"server did not come up in {start_timeout_s:.0f} s:\n{self.log.read_text()}"
        )

    def stop(self, timeout_s: float = 60.0) -> int:
        """Ctrl-C, then wait; SIGKILL of the whole group past the deadline (and an error)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"server did not stop on Ctrl-C:\n{self.log.read_text()}") from None

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


class _PortTaken(Exception):
    """The child exited because its port was taken before it could bind it."""
