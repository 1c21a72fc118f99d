"""How the chart's pods stop (helm/pdserve, rendered by a real helm binary): every pod's
grace period covers the router's `--shutdown-timeout` drain and the workers' stop, and each
Ray container's preStop hook keeps Ray up while what runs on it is still needed: the head's
until the router process has gone (its requests and the workers' stop go through Ray), a
worker pod's until its pdserve actor has been stopped by the router. The hooks run here as
the pod would run them, with real processes holding them open; `ray` is a stub on PATH
that records when it is called (a real `ray stop` would stop this host's other tests'
Ray). Helpers come from test_helm_chart.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_helm_chart import _stub, container, head_pod, helm_binary, pod_templates, render

HOLD_S = 1.0  # how long a process holds a hook open


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_binary()


def pre_stop(pod: dict, name: str) -> str:
    command = container(pod, name)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3
    return command[2]


def wait_bound(script: str) -> int:
    """The most seconds a hook waits (its loop's bound)."""
    m = re.search(r'\[ "\$i" -lt (\d+) \]', script)
    assert m, script
    return int(m.group(1))


def run_hook(
    script: str, tmp_path: Path, holder: list[str] | None, only_held: bool = False
) -> tuple[float, float]:
    """Runs a preStop hook while `holder` (an argv; the first item becomes its command
    line's first word) lives for HOLD_S seconds; returns (seconds until the holder ended,
    seconds until the hook's `ray stop`), both from the hook's start. `only_held`: the hook
    reads the holder's /proc entry and its own instead of every process's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "ray_calls"
    calls.unlink(missing_ok=True)
    _stub(bin_dir / "ray", f'echo "$* $(date +%s.%N)" >> {calls}\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc, ended = None, [0.0]
    if holder is not None:
        # `exec -a` gives the process the command line a Ray worker's title or the router's
        # arguments give it; the hook starts once the process shows it.
        proc = subprocess.Popen(["/bin/bash", "-c", 'exec -a "$0" "$@"', *holder])
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        deadline = time.monotonic() + 10
        while not cmdline.read_bytes().startswith(holder[0].encode() + b"\0"):
            assert time.monotonic() < deadline, cmdline.read_bytes()
            time.sleep(0.01)
    if only_held:
        pid = proc.pid if proc is not None else 0
        script = script.replace("/proc/[0-9]*/cmdline", f"/proc/{pid}/cmdline /proc/$$/cmdline")
    start = time.time()

    def watch() -> None:  # when the holder ends, from the hook's start
        proc.wait()
        ended[0] = time.time() - start

    if proc is not None:
        watcher = threading.Thread(target=watch)
        watcher.start()
    try:
        hook = subprocess.run(
            ["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        if proc is not None:
            proc.kill()
            watcher.join(timeout=10)
    assert hook.returncode == 0, hook.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stop "), lines
    return ended[0], float(lines[0].split()[1]) - start


def sleeper(title: str, *args: str) -> list[str]:
    """A real process that sleeps HOLD_S seconds with `title` as its command line's start."""
    return [title, sys.executable, "-c", f"import time; time.sleep({HOLD_S})", *args]


@pytest.mark.parametrize("timeout_s,grace", [(None, 60), (0, 50), (2.5, 53), (300, 350)])
def test_grace_period_covers_the_router_drain(helm: str, timeout_s, grace: int) -> None:
    """terminationGracePeriodSeconds = the drain (serve.shutdown_timeout_s, 10 by default,
    rounded up) + 5 s of 503s + 30 s for the workers' stop + 15 s for `ray stop`; each
    hook waits at most the first three, so Kubernetes never kills a pod mid-`ray stop`."""
    sets = () if timeout_s is None else (f"serve.shutdown_timeout_s={timeout_s}",)
    pods = pod_templates(render(helm, *sets))
    assert set(pods) == {"head", "prefill", "decode", "tier"}
    for name, pod in pods.items():
        assert pod["spec"]["terminationGracePeriodSeconds"] == grace, name
        ray = "ray-head" if name == "head" else "ray-worker"
        assert wait_bound(pre_stop(pod, ray)) == grace - 15, name
    assert pods["head"]["spec"]["shareProcessNamespace"] is True  # the hook sees the router
    assert not any("shareProcessNamespace" in p["spec"] for n, p in pods.items() if n != "head")


def test_head_stops_ray_after_the_router_exits(helm: str, tmp_path: Path) -> None:
    """The head's hook runs `ray stop` once the router's process (found by the config path
    on its command line, which the router container passes) has exited, and at once when
    there is none; the hook's own command line does not hold it."""
    pod = head_pod(render(helm))
    script = pre_stop(pod, "ray-head")
    router_args = container(pod, "router")["args"][0]
    assert "--config /etc/pdserve/config.yaml" in router_args
    pattern = re.search(r"grep -qsaE '([^']+)'", script).group(1)
    assert re.search(pattern, "pdserve serve --config /etc/pdserve/config.yaml")
    assert not re.search(pattern, script)  # sh -c SCRIPT and grep PATTERN are not the router

    router = sleeper("pdserve", "serve", "--config", "/etc/pdserve/config.yaml")
    ended, stopped = run_hook(script, tmp_path, router)
    assert HOLD_S / 2 < ended <= stopped < ended + 3.0, (ended, stopped)
    _, stopped = run_hook(script, tmp_path, None)
    assert stopped < 1.0


def test_worker_pods_stop_ray_after_their_actor(helm: str, tmp_path: Path) -> None:
    """A worker pod's hook runs `ray stop` once no pdserve actor process (Ray titles it
    `ray::DecodeActor`, or `ray::pdserve-decode-0:DecodeActor.step` while it runs a method;
    cluster/pool_actors.py) is left, and at once when only other Ray processes run. Processes of this host's other tests (servers with real
    actors) are kept out: the hook reads the held process's /proc entry and its own."""
    pods = pod_templates(render(helm))
    scripts = {pre_stop(pods[g], "ray-worker") for g in ("prefill", "decode", "tier")}
    assert len(scripts) == 1
    script = scripts.pop()
    assert "/proc/[0-9]*/cmdline" in script
    # Ray's titles: the actor class, idle; `name:Class.method` while a method runs
    # (test_serve_e2e's test_a_local_ray_runs_no_idle_workers reads them on a real server).
    for title in ("ray::DecodeActor", "ray::pdserve-prefill-0:PrefillActor.info",
                  "ray::pdserve-tier:TierActor.__init__"):  # fmt: skip
        ended, stopped = run_hook(script, tmp_path, sleeper(title), only_held=True)
        assert HOLD_S / 2 < ended <= stopped < ended + 3.0, (title, ended, stopped)
    _, stopped = run_hook(script, tmp_path, sleeper("ray::IDLE"), only_held=True)
    assert stopped < 1.0
