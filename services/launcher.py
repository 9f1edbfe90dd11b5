"""`pdserve up`: the whole stack on 127.0.0.1 (router + prefill and decode services)."""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import random
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from services.common.grpc_server import health_serving

logger = logging.getLogger("pdserve.up")


_handed_out: set[int] = set()
_random = random.Random()  # its own: a caller's random.seed() never repeats our ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port that is free now, for a service to bind seconds later. Chosen below the kernel's
    ephemeral range: a port from bind(0) is in that range, where any outgoing connection (a gRPC
    client, a KV pull) may take it before the service starts, which then fails to bind. Never the
    same port twice in this process."""
    lo, _ = _ephemeral_range()
    first = max(1024, lo - 12000)
    if lo - first >= 1000:
        for _ in range(200):
            port = _random.randrange(first, lo)
            if port not in _handed_out and port_is_free(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:  # no room below the ephemeral range (or none free): the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_with_parent() -> None:
    """A child's preexec_fn: SIGTERM (a service drains on it) when the process that started it dies,
    even by SIGKILL (Linux's PR_SET_PDEATHSIG; elsewhere nothing). Start such children from the main
    thread: the signal comes when the starting *thread* exits."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def exit_on_signals(signals=(signal.SIGTERM, signal.SIGHUP)) -> None:
    """SIGTERM or SIGHUP ends this process as SystemExit(128 + signum) instead of outright, so its
    `finally` blocks and context managers stop what it started (a benchmark's stack of services);
    further signals are ignored while that runs. A signal this process was started ignoring stays
    ignored (`nohup` keeps a benchmark through a closed terminal). Call from the main thread."""
    taken = [s for s in signals if signal.getsignal(s) is not signal.SIG_IGN]

    def on_signal(signum, frame):
        for s in taken:
            signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for s in taken:
        signal.signal(s, on_signal)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    grpc_port: int | None = None


def _grpc_serving(port: int, timeout: float = 1.0) -> bool:
    return health_serving(f"127.0.0.1:{port}", timeout)


def http_ok(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> bool:
    """A 200 from `url` (a health endpoint) within `timeout` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass(frozen=True)
class RouterFront:
    """How `up` reaches the router it started, from the router flags it passes (--router-arg) and
    the router's environment: HTTPS under --ssl-certfile (its certificate is not checked: it is
    our own child on 127.0.0.1), an API key under --api-key, and no request at all where
    --ssl-cert-reqs 2 demands a client certificate `up` does not have."""
    certfile: str | None = None
    client_certs_required: bool = False
    api_key: str | None = None

    @classmethod
    def from_router_argv(cls, argv: list[str]) -> "RouterFront":
        """`argv`: the router's command line as `up` runs it, read by the router's own parser (its
        flags and their environment variables, as the router reads them)."""
        from services.router.cli import add_router_parser
        from services.router.config import split_api_keys

        try:  # the parser reads the environment as it is built
            parser = argparse.ArgumentParser(add_help=False)
            add_router_parser(parser.add_subparsers(dest="command"))
            args = parser.parse_args(argv)
        except (SystemExit, ValueError):  # the router refuses them too, at start: `up` reports its exit
            return cls()
        keys = split_api_keys(args.api_key)
        return cls(args.ssl_certfile, bool(args.ssl_certfile) and args.ssl_cert_reqs == 2, keys[0] if keys else None)

    @property
    def scheme(self) -> str:
        return "https" if self.certfile else "http"

    @property
    def context(self) -> ssl.SSLContext | None:
        if not self.certfile:
            return None
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def ready(self, port: int) -> bool:
        if self.client_certs_required:  # listening is all `up` can see
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                return True
            except OSError:
                return False
        return http_ok(f"{self.scheme}://127.0.0.1:{port}/health", 1.0, self.context)


class Stack:
    def __init__(self, args) -> None:
        self.args = args
        self.children: list[Child] = []
        self.stopping = False
        self.front = RouterFront()

    def spawn(self, name: str, argv: list[str], env: dict, grpc_port: int | None = None) -> Child:
        cmd = [sys.executable, "-m", "services.cli", *argv]
        # Its own process group: a terminal's Ctrl-C reaches this process only, and stop() ends the
        # stack in order (router first) with SIGTERM, which every service drains on.
        proc = subprocess.Popen(cmd, env=env, process_group=0)
        child = Child(name, proc, grpc_port)
        self.children.append(child)
        logger.info("started %s (pid %d)", name, proc.pid)
        return child

    def start(self) -> str | None:
        """The router's URL once every service is healthy; None if a stop signal came first."""
        a = self.args
        env = dict(os.environ)
        env["PDSERVE_KV_SECRET"] = a.kv_secret or secrets.token_hex(16)  # never on a command line
        if a.auth_token:  # the engines demand it, the router presents it: also never on a command line
            env["PDSERVE_AUTH_TOKEN"] = a.auth_token
        common = ["--model", a.model, "--host", "127.0.0.1", "--device", a.device]
        prefill, decode = [], []
        roles = [("prefill", a.prefill), ("decode", a.decode)] if a.prefill > 0 else [("colocated", a.decode)]
        for role, count in roles:
            for i in range(count):
                port = free_port()
                argv = [role, *common, "--port", str(port), "--metrics-port", str(free_port()),
                        "--engine-id", f"{role}-{i}", *a.engine_arg]
                if role != "colocated":
                    argv += ["--kv-transport", a.transport]
                if a.speculative_config and role != "prefill":  # a prefill produces one token
                    argv += ["--speculative-config", a.speculative_config]
                self.spawn(f"{role}-{i}", argv, env, port)
                (prefill if role == "prefill" else decode).append(f"127.0.0.1:{port}")
        if not self._wait(lambda: all(c.grpc_port is None or _grpc_serving(c.grpc_port) for c in self.children),
                          "engine services to report SERVING"):
            return None
        http_port = a.port or free_port()
        router = ["router", "--model", a.model, "--host", "127.0.0.1", "--port", str(http_port),
                  "--decode", ",".join(decode), "--policy", a.policy]
        if prefill:
            router += ["--prefill", ",".join(prefill)]
        router += ["--grpc-port", str(a.grpc_port) if a.grpc_port else "-1"]  # -1: no gRPC front
        self.spawn("router", [*router, *a.router_arg], env)
        self.front = RouterFront.from_router_argv([*router, *a.router_arg])
        url = f"{self.front.scheme}://127.0.0.1:{http_port}"
        return url if self._wait(lambda: self.front.ready(http_port), "the router") else None

    def _wait(self, ready, what: str) -> bool:
        deadline = time.monotonic() + self.args.startup_timeout
        while not ready():
            if self.stopping:
                return False
            dead = [c for c in self.children if c.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.25)
        return True

    def watch(self) -> int:
        """Until SIGTERM/SIGINT or a child dies."""
        while not self.stopping:
            for c in self.children:
                if c.proc.poll() is not None:
                    logger.error("%s exited with code %d: stopping the stack", c.name, c.proc.returncode)
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        for c in reversed(self.children):  # router first: no new requests
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time: killing it", c.name)
                c.proc.kill()
                c.proc.wait()
        logger.info("stack stopped")


def demo_request(url: str, model: str, stopping=lambda: False, front: RouterFront = RouterFront()) -> str:
    body = json.dumps({"model": model, "prompt": "The old king", "max_tokens": 24, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **front.headers})
    text = []
    with urllib.request.urlopen(req, timeout=120, context=front.context) as r:
        for line in r:
            if stopping():
                break
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text.append(choice.get("text", ""))
                    print(choice.get("text", ""), end="", flush=True)
    print()
    return "".join(text)


def announce(url: str, args, stopping, front: RouterFront = RouterFront()) -> None:
    """The URL, a curl to paste, and with --demo one streamed completion."""
    print(f"\npdserve is serving at {url}  (prefill x{args.prefill}, decode x{args.decode}, "
          f"transport {args.transport})", flush=True)
    if front.client_certs_required:
        print("the router demands client certificates (--ssl-cert-reqs 2): send requests with yours\n", flush=True)
        return
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=front.headers),
                                    timeout=10, context=front.context) as r:
            model = json.load(r)["data"][0]["id"]
        options = (f"--cacert {front.certfile} " if front.certfile else "") + \
            ("-H 'Authorization: Bearer <your --api-key>' " if front.api_key else "")
        print("try:\n  curl " + options + f"{url}/v1/completions -H 'Content-Type: application/json' -d "
              + "'" + json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16}) + "'\n", flush=True)
        if args.demo:
            print("demo completion (streamed): The old king", end="", flush=True)
            demo_request(url, model, stopping, front)
    except (OSError, http.client.HTTPException, ValueError) as e:  # a dead service is watch()'s call
        print(flush=True)
        logger.error("a request to the router failed: %s", e)


def run_up(args) -> int:
    stack = Stack(args)

    def on_signal(signum, frame):
        stack.stopping = True

    # The children are in process groups of their own (see Stack.spawn): a closed terminal's SIGHUP
    # must stop them too.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    code = 0
    try:
        url = stack.start()
        if url is not None:
            announce(url, args, lambda: stack.stopping, stack.front)
            if not stack.stopping:
                print("serving; Ctrl-C to stop", flush=True)
            code = stack.watch()
    except RuntimeError as e:
        logger.error("%s", e)
        code = 1
    finally:
        if stack.stopping:
            logger.info("stopping the stack")
        stack.stop()
    return code


def add_up_parser(sub) -> None:
    from services.common.flags import add

    p = sub.add_parser("up", help="start the whole stack on 127.0.0.1 and serve until Ctrl-C",
                       description="Start the router and N prefill + M decode services as processes on "
                                   "127.0.0.1, wait until all are healthy, print the URL, serve until "
                                   "Ctrl-C / SIGTERM, then stop everything.")
    add(p, "--prefill", type=int, default=1, env_prefix="PDSERVE_UP_",
        help="prefill services (0: colocated services only)")
    add(p, "--decode", type=int, default=1, env_prefix="PDSERVE_UP_", help="decode (or colocated) services")
    add(p, "--model", default="tiny", env_prefix="PDSERVE_UP_", help="checkpoint directory, or 'tiny'")
    add(p, "--device", default="auto", env_prefix="PDSERVE_UP_",
        help="every engine's device: auto (the first visible GPU, else the CPU), cpu, cuda or cuda:N")
    add(p, "--transport", default="tcp", choices=["tcp", "shm", "ucx", "nccl"], env_prefix="PDSERVE_UP_",
        help="KV transfer transport")
    add(p, "--port", type=int, default=8000, env_prefix="PDSERVE_UP_", help="router HTTP port (0: any free)")
    add(p, "--grpc-port", type=int, default=0, env_prefix="PDSERVE_UP_", help="router gRPC Generate port (0: off)")
    add(p, "--policy", default="least_load", choices=["round_robin", "least_load"], env_prefix="PDSERVE_UP_",
        help="routing policy")
    add(p, "--kv-secret", default=None, env_prefix="PDSERVE_UP_", help="KV handle secret (default: random)")
    add(p, "--auth-token", default=None, env_prefix="PDSERVE_UP_",
        help="a token every engine demands on gRPC and KV control connections; the router presents it "
             "(default: none)")
    add(p, "--startup-timeout", type=float, default=600.0, env_prefix="PDSERVE_UP_",
        help="seconds to wait for every service to be healthy")
    add(p, "--demo", action="store_true", env_prefix="PDSERVE_UP_",
        help="send one streamed completion once serving")
    add(p, "--speculative-config", default=None, env_prefix="PDSERVE_UP_",
        help="speculative decoding JSON for the decode and colocated services (as their flag)")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra flag passed to every engine service, e.g. --engine-arg=--max-num-seqs=64")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra flag passed to the router, e.g. --router-arg=--reasoning-parser=qwen3")
    p.set_defaults(func=run_up)
