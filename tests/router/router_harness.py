"""The router test harness: an event loop in a thread, fakes + router stacks, sync HTTP helpers."""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import threading
import time

from services.router.cli import add_router_parser, config_from_args
from services.router.server import Router


def router_config(model: str, *argv: str):
    """The RouterConfig `pdserve router --model MODEL --decode h:1 ARGV...` builds (flags and
    environment variables read as the CLI reads them)."""
    p = argparse.ArgumentParser()
    add_router_parser(p.add_subparsers(dest="command"))
    return config_from_args(p.parse_args(["router", "--model", model, "--decode", "h:1", *argv]))


class LoopThread:
    """An event loop in a daemon thread; `run(coro)` waits for its result from the test thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Stack:
    """Fake prefill/decode servers and a router in front of them."""

    def __init__(self, lt: LoopThread, router: Router, prefills: list, decodes: list) -> None:
        self.lt, self.router, self.prefills, self.decodes = lt, router, prefills, decodes

    @property
    def port(self) -> int:
        return self.router.http_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.http_port}/v1"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.router.grpc_port}"

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 30.0):
        """-> (status, headers, parsed JSON or raw bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            raw = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
            conn.request(method, path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
            ctype = resp.getheader("Content-Type", "")
            return resp.status, dict(resp.getheaders()), json.loads(data) if "json" in ctype else data
        finally:
            conn.close()

    def post(self, path: str, body, headers: dict | None = None):
        return self.request("POST", path, body, headers)

    def sse(self, path: str, body, headers: dict | None = None) -> list:
        """The data: events of a streamed response, JSON-decoded ([DONE] as the string)."""
        status, _, data = self.request("POST", path, body, headers)
        assert status == 200, data
        events = [line[len(b"data: "):] for line in data.split(b"\n") if line.startswith(b"data: ")]
        return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels or {}) or 0.0
