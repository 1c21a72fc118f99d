"""Drive one worker (prefill or decode) on its own thread, the only thread that touches it.

Callers never call the worker directly: `call(fn)` runs `fn(worker)` on the loop thread
between steps and returns a future, so submits, aborts and stats reads are serialized
with `step()` without locks in the engine. The loop steps while the worker has work and
otherwise sleeps on its inbox (bounded wait). A worker whose last step had nothing to run
(`stalled()`: a decode worker's requests wait on KV loads, a prefill worker's prompts on
blocks that held prompts keep) sleeps too, until the next call, the bounded wait, or the
`wake()` it was handed with `set_waker` (a load ended, a lease freed blocks): stepping it
again would only spin, and take the GIL from the threads it waits on. Work arrives through
calls and wakes, so the bounded wait is only a backstop for timers (lease expiry, lease
renewal of queued requests), which run on seconds. At 0.01 s an idle worker's loop took
~1.5% of a core (a decode worker in its own process on a 2-core box); at 0.1 s it wakes a
tenth as often. The loop records
forward progress (steps done, time of the last step that had work), which is what
"healthy" means for the controller: a loop that is alive but stuck stops advancing
`last_progress`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class SteppedWorker(Protocol):
    def has_work(self) -> bool: ...
    def step(self) -> list: ...


class WorkerLoop:
    def __init__(
        self,
        worker: SteppedWorker,
        on_outputs: Callable[[list], None],
        name: str = "worker-loop",
        idle_wait_s: float = 0.1,
    ) -> None:
        self.worker = worker
        self.on_outputs = on_outputs
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue[tuple[Callable[[Any], Any], Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0
        self.last_progress = time.monotonic()
        self.error: BaseException | None = None
        # Optional housekeeping while idle (a prefill worker expires leases in it).
        self._idle: Callable[[], None] | None = getattr(worker, "idle", None)
        self._stalled: Callable[[], bool] | None = getattr(worker, "stalled", None)
        self.num_stalls = 0  # sleeps of a stalled worker (each one a step not spun)
        if hasattr(worker, "set_waker"):
            worker.set_waker(self.wake)

    def start(self) -> WorkerLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "worker loop did not stop in time"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def wake(self) -> None:
        """End a stalled (or idle) wait now; safe from any thread."""
        self._inbox.put((_nothing, Future()))

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run `fn(worker)` on the loop thread; its result or exception lands in the future."""
        fut: Future = Future()
        if not self.alive:
            fut.set_exception(RuntimeError(f"worker loop is not running ({self.error!r})"))
            return fut
        self._inbox.put((fn, fut))
        return fut

    def _drain(self, wait_s: float) -> None:
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.worker))
                except Exception as e:  # the caller gets it; the loop keeps serving
                    fut.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.worker.has_work()
                if busy and self._stalled is not None and self._stalled():
                    busy = False
                    self.num_stalls += 1
                self._drain(0 if busy else self.idle_wait_s)
                if not self.worker.has_work():
                    self.last_progress = time.monotonic()  # idle is not stuck
                    if self._idle is not None:
                        self._idle()
                    continue
                outputs = self.worker.step()
                self.num_steps += 1
                self.last_progress = time.monotonic()
                if outputs:
                    self.on_outputs(outputs)
        except BaseException as e:  # a crashed loop must be visible to health checks
            self.error = e
            logger.exception("worker loop crashed")
        finally:
            while True:  # nobody will run these now: fail them instead of leaving waiters
                try:
                    _, fut = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("worker loop stopped"))


def _nothing(worker: Any) -> None:
    """What `wake()` runs: the call itself is the point (it ends the inbox wait)."""
