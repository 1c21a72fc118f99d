"""`pdserve serve` as the end-to-end tests drive it: a `ServeProcess` with the official
`openai` client and the checks every test server gets when it stops. The `pd` and
`colocated` servers themselves are fixtures in conftest.py (one pair per session)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import openai

from pdserve.cluster.serve_process import ServeProcess

KEY = "test-key"


class Server(ServeProcess):
    """A `ServeProcess` with the test's clients and checks."""

    def client(self, key: str = KEY) -> openai.OpenAI:
        # A TLS server's certificate is checked against its test CA (`tls_ca`).
        tls = (
            {}
            if self.verify is True
            else {"http_client": openai.DefaultHttpxClient(verify=self.verify)}
        )
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120,
                             **tls)  # fmt: skip

    def ray_processes(self) -> dict[int, str]:
        """This server's Ray worker processes (its own Ray's; other servers may run on the
        machine), by pid, with their titles: `ray::DecodeActor`, `ray::IDLE`, ..."""
        out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        found = (line.split(None, 1) for line in out.splitlines()[1:])
        return {
            int(pid): title
            for pid, title in found
            if title.startswith("ray::") and _descends_from(int(pid), self.proc.pid)
        }

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30, verify=self.verify).text

    def stop(self) -> None:
        code = super().stop()  # Ctrl-C, then wait
        assert code == 0, self.log.read_text()
        assert "pdserve: stopped" in self.log.read_text()


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: the parent's pid
    return False
