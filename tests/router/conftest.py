"""Router fixtures: fakes and a router on one event loop in a thread, so tests can use sync clients."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

from services.router.config import RouterConfig
from services.router.server import Router

from router_fakes import KVRegistry, start_fake


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


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from engine.tiny import default_tiny_model
    return default_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from engine.processor import load_tokenizer
    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def make_stack(loop_thread, tiny_model_path, tokenizer):
    """make_stack(prefill=1, decode=1, prefill_kwargs=[{...} per fake], decode_kwargs=..., **config);
    `extra_prefill`/`extra_decode`: addresses of instances served elsewhere (other processes)."""
    made = []

    def make(prefill: int = 1, decode: int = 1, prefill_kwargs=None, decode_kwargs=None,
             extra_prefill: tuple = (), extra_decode: tuple = (), **config) -> Stack:
        async def build():
            registry = KVRegistry()
            pk = prefill_kwargs or [{}] * prefill
            dk = decode_kwargs or [{}] * decode
            prefills = [await start_fake("prefill", registry, name=f"prefill-{i}", **pk[i]) for i in range(prefill)]
            decodes = [await start_fake("decode", registry, name=f"decode-{i}", **dk[i]) for i in range(decode)]
            cfg = dict(model=tiny_model_path, served_model_name="tiny", host="127.0.0.1", port=0, grpc_port=0,
                       prefill=(*extra_prefill, *(s.address for s in prefills)),
                       decode=(*extra_decode, *(s.address for s in decodes)),
                       health_check_interval_s=0.1, drain_timeout_s=5.0)
            cfg.update(config)
            router = Router(RouterConfig(**cfg), tokenizer=tokenizer)
            await router.start()
            everyone = router.pool.instances("prefill") + router.pool.instances("decode")
            for _ in range(500):  # a loaded machine may miss the first checks: wait for the next
                if all(i.healthy for i in everyone):
                    break
                await asyncio.sleep(0.01)
            return Stack(loop_thread, router, prefills, decodes)

        stack = loop_thread.run(build())
        made.append(stack)
        return stack

    yield make

    async def teardown(stack: Stack):
        if not stack.router.draining:
            await stack.router.stop()
        for s in stack.prefills + stack.decodes:
            await s.stop(0)

    for stack in made:
        loop_thread.run(teardown(stack))
