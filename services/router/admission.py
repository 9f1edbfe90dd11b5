"""The router's front door: a cap on generation requests in flight, and the worker threads that
tokenize and render chat templates off the event loop."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor

from services.router.errors import RouterError

RETRY_AFTER_S = 1
# Smaller inputs are parsed and tokenized on the loop: a few milliseconds at most, and no thread
# hop on the common path; larger ones go to the workers.
INLINE_BYTES = 16 << 10


class Slot:
    """One place among the requests in flight, released once."""

    def __init__(self, admission: "Admission") -> None:
        self._admission = admission
        self._held = True
        self.taken = False  # handed over: whoever took it releases it

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.in_flight -= 1

    def take(self):
        """The slot stays held past its request (the admit block no longer releases it); returns
        the release for whoever holds it now."""
        self.taken = True
        return self.release


class Admission:
    """Shared by the HTTP gateway and the gRPC Generate front."""

    def __init__(self, max_concurrent_requests: int, metrics, num_workers: int | None = None) -> None:
        self.limit = max_concurrent_requests
        self.metrics = metrics
        self.in_flight = 0
        # Tokenizing releases the GIL (the Rust tokenizer's batch call); a template renders in Python
        # but is preempted every switch interval: either way the loop keeps serving other clients.
        self._pool = ThreadPoolExecutor(max_workers=num_workers or max(4, min(8, os.cpu_count() or 1)),
                                        thread_name_prefix="pdserve-router-input")

    @contextlib.contextmanager
    def admit(self):
        """One request in flight for the block; 429 (Retry-After) when the router is at its cap.
        Yields its Slot: work that outlives the block (a background response) takes it over."""
        if self.in_flight >= self.limit:
            raise RouterError(429, f"the router is at capacity ({self.limit} requests in flight); retry later",
                              code="router_at_capacity", retry_after_s=RETRY_AFTER_S)
        self.in_flight += 1
        slot = Slot(self)
        try:
            yield slot
        finally:
            if not slot.taken:
                slot.release()

    async def run(self, size: int, fn, *args):
        """fn(*args), its input `size` bytes: on a worker thread unless small (exceptions raised here)."""
        if size <= INLINE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def shed(self, error: RouterError) -> None:
        """Counts a 429, whoever refused: this router's cap or every engine tried."""
        if error.status == 429:
            self.metrics.requests_shed.labels(error.code or "unknown").inc()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
