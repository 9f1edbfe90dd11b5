"""Router fixtures: fakes and a router on one event loop in a thread, so tests can use sync clients."""
from __future__ import annotations

import asyncio

import pytest

from services.router.config import RouterConfig
from services.router.server import Router

from router_fakes import KVRegistry, start_fake
from router_harness import LoopThread, Stack


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
