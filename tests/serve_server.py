"""`pdserve serve` as the end-to-end tests drive it: a `ServeProcess` with the official
`openai` client and the checks every test server gets when it stops. The `pd` and
`colocated` servers themselves are fixtures in conftest.py (one pair per session)."""

from __future__ import annotations

import httpx
import openai

from pdserve.cluster.serve_process import ServeProcess

KEY = "test-key"


class Server(ServeProcess):
    """A `ServeProcess` with the test's clients and checks."""

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self) -> None:
        code = super().stop()  # Ctrl-C, then wait
        assert code == 0, self.log.read_text()
        assert "pdserve: stopped" in self.log.read_text()
