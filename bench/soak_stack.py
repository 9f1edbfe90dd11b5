"""The soak's stack on loopback: router, prefills and decodes restarted on the same ports after a crash,
as a Deployment's pods are, and a proxy in front of each prefill's KV port that can cut a pull."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.procs import descendants, free_port, grpc_serving, http_ok, pdserve_cmd, stop_with_parent

# Decodes reach a prefill's KV port through its proxy: the prefill binds 127.0.0.1:P and its
# handles name PROXY_HOST:P (--kv-advertise-host), where the proxy listens. Both are loopback.
PROXY_HOST = "127.0.0.2"
CUT_MIN_BYTES = 1024  # control messages are smaller; KV bytes come in larger reads
RESTART_BACKOFF_S = 1.0


class Service:
    """One engine service or the router: restarted with the same command (ports included) when it exits."""

    def __init__(self, name: str, argv: list[str], env: dict, log_dir: str, grpc_address: str | None = None,
                 http_port: int | None = None) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.grpc_address, self.http_port = grpc_address, http_port
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.exits: list[tuple[float, int]] = []  # (monotonic time, exit code) of each crash
        self.restarts: list[float] = []
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=stop_with_parent)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        if self.grpc_address:
            return grpc_serving(self.grpc_address)
        return http_ok(f"http://127.0.0.1:{self.http_port}/health")

    def engine_core_pid(self) -> int:
        """The engine core: the service's child started by multiprocessing's spawn."""
        for pid in descendants(self.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        return pid
            except OSError:
                continue
        raise RuntimeError(f"{self.name} has no engine-core process")

    def rss_mb(self) -> float:
        """Resident memory of the service and its children (the engine core), MiB."""
        return sum(rss_kb(p) for p in [self.pid, *descendants(self.pid)]) / 1024.0


class KVCutProxy:
    """Forwards PROXY_HOST:port to 127.0.0.1:port. Once armed, the next read of KV bytes from the
    prefill is passed on by half, then both connections are reset: a connection dropped mid-pull."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server = socket.create_server((PROXY_HOST, port), backlog=64)
        self.armed = threading.Event()
        self.cuts: list[float] = []
        self.connections = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name=f"kv-proxy-{port}", daemon=True).start()

    def arm(self) -> None:
        self.armed.set()

    def _take_arm(self) -> bool:
        with self._lock:
            if not self.armed.is_set():
                return False
            self.armed.clear()
            return True

    def _accept_loop(self) -> None:
        while True:
            try:
                downstream, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                downstream.close()  # the prefill is down: the decode sees the refusal as a reset
                continue
            upstream.settimeout(None)
            for s in (downstream, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connections += 1
            pair = (downstream, upstream)
            threading.Thread(target=self._pump, args=(downstream, upstream, pair, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, pair, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair, from_prefill: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if from_prefill and len(data) >= CUT_MIN_BYTES and self._take_arm():
                    dst.sendall(data[: len(data) // 2])
                    self.cuts.append(time.monotonic())
                    for s in pair:  # RST, not FIN: as a peer that vanished
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the other direction's thread
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.server.close()


class SoakStack:
    """`prefills` prefill and `decodes` decode services and a router (least load), all on 127.0.0.1."""

    def __init__(self, model: str, prefills: int, decodes: int, engine_args: list[str], prefill_args: list[str],
                 router_args: list[str], log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        # A build cache of the soak's own for the CPU kernels: engines restarted mid-run load them at
        # once instead of queueing behind (or for ever, if its holder was killed) another tree's build.
        env = dict(os.environ, PDSERVE_KV_SECRET=secrets.token_hex(16),
                   PDSERVE_CACHE_DIR=os.environ.get("PDSERVE_CACHE_DIR", os.path.join(os.path.dirname(os.path.abspath(log_dir)), "cache")))
        self.proxies: list[KVCutProxy] = []
        self.prefills, self.decodes = [], []
        self.stopping = False
        for role, n, group in (("prefill", prefills, self.prefills), ("decode", decodes, self.decodes)):
            for i in range(n):
                port, metrics_port = free_port(), free_port()
                argv = pdserve_cmd(role, "--model", model, "--port", str(port), "--metrics-port", str(metrics_port),
                                   "--engine-id", f"{role}-{i}", "--kv-transport", "tcp", *engine_args)
                if role == "prefill":
                    proxy = KVCutProxy(free_port())
                    self.proxies.append(proxy)
                    argv += ["--kv-port", str(proxy.port), "--kv-advertise-host", PROXY_HOST, *prefill_args]
                group.append(Service(f"{role}-{i}", argv, env, log_dir, grpc_address=f"127.0.0.1:{port}"))
        self.router_port = free_port()
        router = pdserve_cmd("router", "--model", model, "--host", "127.0.0.1", "--port", str(self.router_port),
                             "--grpc-port", "-1", "--policy", "least_load", "--health-check-interval", "0.5",
                             "--prefill", ",".join(s.grpc_address for s in self.prefills),
                             "--decode", ",".join(s.grpc_address for s in self.decodes), *router_args)
        self.router = Service("router", router, env, log_dir, http_port=self.router_port)
        self._supervisor = threading.Thread(target=self._supervise, name="soak-supervisor", daemon=True)

    @property
    def engines(self) -> list[Service]:
        return [*self.prefills, *self.decodes]

    @property
    def services(self) -> list[Service]:
        return [*self.engines, self.router]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def wait_ready(self, timeout: float = 600) -> None:
        """Every engine SERVING and the router's health checks seeing each of them; then supervise."""
        deadline = time.monotonic() + timeout
        while not (all(s.ready() for s in self.services) and self.router_sees_all()):
            for s in self.services:
                if not s.alive():
                    raise RuntimeError(f"{s.name} exited during start-up (code {s.proc.returncode}); see {s.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError("the stack did not come up")
            time.sleep(0.5)
        self._supervisor.start()

    def router_sees_all(self) -> bool:
        try:
            return self.router_metric("pdserve:router_instance_healthy") == len(self.engines)
        except OSError:
            return False

    def router_metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def _supervise(self) -> None:
        """Restarts a service that exited (crashed, or its engine core died) with the same command."""
        while not self.stopping:
            for s in self.services:
                code = s.proc.poll()
                if code is not None and not self.stopping:
                    s.exits.append((time.monotonic(), code))
                    time.sleep(RESTART_BACKOFF_S)
                    if not self.stopping:
                        s.start()
                        s.restarts.append(time.monotonic())
            time.sleep(0.1)

    @staticmethod
    def kill(service: Service) -> int:
        pid = service.pid
        os.kill(pid, signal.SIGKILL)
        return pid

    @staticmethod
    def kill_engine_core(service: Service) -> int:
        pid = service.engine_core_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    def load(self, service: Service):
        """The engine's GetLoad report (running, waiting, pinned KV blocks)."""
        import grpc

        from services.api.pdserve.v1 import pdserve_pb2 as pb
        from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

        with grpc.insecure_channel(service.grpc_address) as ch:
            return pb_grpc.EngineStub(ch).GetLoad(pb.LoadRequest(), timeout=5)

    def stop(self) -> dict[str, int]:
        """SIGTERM to all at once (they drain in parallel), SIGKILL after 60 s; name -> exit code."""
        self.stopping = True
        if self._supervisor.is_alive():
            self._supervisor.join()
        for s in self.services:
            if s.alive():
                s.proc.send_signal(signal.SIGTERM)
        deadline, codes = time.monotonic() + 60, {}
        for s in self.services:
            try:
                codes[s.name] = s.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                codes[s.name] = s.proc.wait()
        for p in self.proxies:
            p.close()
        return codes


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
