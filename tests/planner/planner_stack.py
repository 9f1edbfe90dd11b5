"""A real local stack for the planner's integration test: engine services and the router as
processes on 127.0.0.1, and Debian's Prometheus scraping them (bounded waits, clean stop)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher import free_port

INSTALL_PROMETHEUS = "apt-get install -y prometheus"


def http_get(url: str, timeout: float = 2.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except OSError:
        return None


def grpc_serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


class Process:
    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_for(ready, what: str, processes: list[Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for p in processes:
            p.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.3)


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    if path is None:
        raise FileNotFoundError(f"the Prometheus server is not installed; install Debian's package: "
                                f"{INSTALL_PROMETHEUS} (the test starts the binary itself, no service needed)")
    return path


def start_prometheus(targets: list[str], workdir: Path) -> tuple[Process, str]:
    """Prometheus scraping `targets` every second, storing into workdir (never the system's)."""
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "pdserve", "static_configs": [{"targets": targets}]}]}))
    proc = Process("prometheus", [prometheus_binary(), f"--config.file={config}",
                                  f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                                  "--storage.tsdb.retention.time=1h", "--log.level=warn"], workdir)
    return proc, f"http://127.0.0.1:{port}"


def targets_up(url: str, n: int) -> bool:
    body = http_get(f"{url}/api/v1/targets")
    if not body:
        return False
    active = json.loads(body)["data"]["activeTargets"]
    return len(active) == n and all(t["health"] == "up" for t in active)


class Load:
    """`concurrency` clients sending completions through the router back to back until stopped."""

    def __init__(self, url: str, model: str, prompt: str, max_tokens: int, concurrency: int) -> None:
        self.body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True}).encode()
        self.url, self.done, self.errors = f"{url}/v1/completions", 0, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(concurrency)]

    def _client(self) -> None:
        while not self.stop.is_set():
            req = urllib.request.Request(self.url, self.body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    json.load(r)
                self.done += 1
            except OSError as e:
                self.errors.append(str(e))
                time.sleep(0.2)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(130)
