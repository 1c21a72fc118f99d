"""The session's shared servers (`pd`, `colocated`, `pd_layer_wise` in conftest.py): each
starts when a test first asks for it and stops right after the last test that uses it,
not at the session's end.

An idle PD server still takes ~15% of a core (its worker loops, the router, Ray's own
processes). The files that share these servers run together (one xdist scope,
tests/xdist_schedule.py; in a run without xdist, `contiguous` puts them together), so
after their last user a server would only idle while the other files run: on CI's 2 cores
three of them cost the rest of the run about a fifth of the machine.

Which test is a server's last user is known once the run's tests are chosen (`plan`): the
run goes through the shared files in collection order, whichever process runs them. A test
that asks for a stopped server (a run that goes back to a shared file) starts it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

StartServer = Callable[[Path], Any]  # a log folder -> a started `serve_server.Server`


class SharedServers:
    def __init__(self, starts: dict[str, StartServer]) -> None:
        self.starts = starts
        self.running: dict[str, Any] = {}
        self.last_user: dict[str, str] = {}  # server name -> nodeid of its last test

    def plan(self, items: Iterable[pytest.Item]) -> None:
        """Notes each server's last user among the tests this run will run, in order."""
        self.last_user = {}
        for item in items:
            for name in self.starts.keys() & set(getattr(item, "fixturenames", ())):
                self.last_user[name] = item.nodeid

    def get(self, name: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
        server = self.running.get(name)
        if server is None:
            server = self.starts[name](tmp_path_factory.mktemp(name))
            self.running[name] = server
        return server

    def after(self, item: pytest.Item) -> None:
        """Stops the servers whose last user was `item` (its teardown)."""
        for name, nodeid in self.last_user.items():
            if nodeid == item.nodeid:
                self.stop(name)

    def stop(self, name: str) -> None:
        server = self.running.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        errors = []
        for name in list(self.running):
            try:
                self.stop(name)
            except Exception as e:  # stop the others too; the first error is reported
                errors.append(e)
        if errors:
            raise errors[0]


def contiguous(items: list[pytest.Item], shared: Callable[[pytest.Item], bool]) -> None:
    """Moves the shared files' tests (in their order) to where the first of them is, so that
    a run without xdist also goes through them in one stretch."""
    group = [item for item in items if shared(item)]
    if not group:
        return
    first = items.index(group[0])
    rest = [item for item in items if not shared(item)]
    items[:] = rest[:first] + group + rest[first:]
