"""Processes for serving benchmarks: pinned to cores, health-waited, stopped cleanly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from services.launcher import exit_on_signals, free_port, http_ok, stop_with_parent  # noqa: F401 (the benchmarks' import point)


def ensure_tiny_model(path: str, **shape) -> str:
    """A random checkpoint of the given shape (engine.tiny), made once and kept under build/."""
    if not os.path.exists(os.path.join(path, "config.json")):
        from engine.tiny import make_tiny_model

        make_tiny_model(path, **shape)
    return path


def _child_setup(cores: set[int] | None) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    stop_with_parent()  # a benchmark killed outright leaves no stack serving


class Proc:
    def __init__(self, name: str, cmd: list[str], cores: set[int] | None = None, env: dict | None = None,
                 log_dir: str | None = None) -> None:
        self.name = name
        log = open(os.path.join(log_dir, f"{name}.log"), "w") if log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: _child_setup(cores))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60) -> None:
        stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM (the services drain), then SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid, from /proc (a service's engine core; nothing orphaned)."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    by_parent.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (a container's cpuset, taskset), in order; os.cpu_count()
    counts the host's. Benchmarks pin their instances to these, never to CPU numbers of their own."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pdserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def wait_until(ready, procs: list[Proc], what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited during start-up (code {p.proc.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)


def grpc_serving(address: str) -> bool:
    from services.common.grpc_server import health_serving

    return health_serving(address)
