"""Start real engine services as processes on 127.0.0.1 for tests (bounded waits, clean stop)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import descendants, stop_process
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.launcher import free_port

SECRET = "services-test-secret"


class LoggedProcess:
    """A service process whose output goes to a log file, stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, name: str, argv: list[str], env: dict) -> None:
        self.name = name
        # A file, not a pipe: nobody reads a pipe while the service runs, and a full one stalls it.
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"pdserve-{name}-", suffix=".log")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def output(self, last: int = 60) -> str:
        """The service's last log lines, for failure messages."""
        with open(self.log.name) as f:
            return "".join(f.readlines()[-last:])

    def stop(self, timeout: float = 60) -> int:
        return stop_process(self.proc, timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Service(LoggedProcess):
    """One engine service (`pdserve prefill|decode|colocated`) with its metrics endpoint."""

    def __init__(self, role: str, model: str, *extra: str, secret: str = SECRET, env: dict | None = None) -> None:
        self.role = role
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "services.cli", role, "--model", model, "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--engine-id", f"{role}-{self.port}", *extra]
        super().__init__(f"{role}-{self.port}", argv, dict(os.environ, PDSERVE_KV_SECRET=secret, **(env or {})))

    def serving(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            try:
                r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout: float = 240) -> "Service":
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.output()}")
            return self.serving()

        if not poll_until(ready, timeout, interval=0.2):
            raise TimeoutError(f"{self.name} not SERVING after {timeout}s:\n{self.output()}")
        return self

    def load(self) -> pb.LoadReport:
        """The Engine service's GetLoad: a snapshot the engine core publishes every ~50 ms."""
        with grpc.insecure_channel(self.address) as channel:
            return pb_grpc.EngineStub(channel).GetLoad(pb.LoadRequest(), timeout=5)

    def metric(self, name: str) -> float:
        return metric(self.metrics_port, name)


def poll_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Call predicate until it holds (True) or the deadline passes (False). The one polling helper
    of the process tests, for state that announces no event: a process reaped, a counter that
    reaches the metrics endpoint, an engine's load report."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def wait_http_ok(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until GET url answers 200 (a router or gateway up), failing at once if proc exits."""
    def ok() -> bool:
        assert proc.poll() is None, f"{proc.args[:4]} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    assert poll_until(ok, timeout, interval=0.2), f"{url} not answering after {timeout}s"


def metric(port: int, name: str, labels: dict | None = None) -> float:
    """Sum over the samples of `name` on a service's /metrics whose labels include `labels`
    (every label set when None)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    want = (labels or {}).items()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and want <= s.labels.items())


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


children_of = descendants  # every live descendant of a pid, to check that nothing is orphaned
