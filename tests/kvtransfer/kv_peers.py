"""A prefill engine's connector in a second process (spawn), driven over a multiprocessing Pipe.

The child fills its KV caches with seeded random bytes; the test process rebuilds the same
bytes with `fill()` to check what it pulled bit for bit.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict
from typing import Any

import torch

from kvtransfer.connector import TransferEvents

SECRET = b"pdserve-test-secret"

# (layers, kv heads, head dim, block size, dtype): MHA, GQA and MQA shapes, three block sizes.
LAYOUTS = {
    "f32-bs16": dict(num_layers=2, num_kv_heads=4, head_dim=32, block_size=16, dtype="float32"),
    "f16-bs8-gqa": dict(num_layers=3, num_kv_heads=2, head_dim=64, block_size=8, dtype="float16"),
    "bf16-bs32-mqa": dict(num_layers=2, num_kv_heads=1, head_dim=128, block_size=32, dtype="bfloat16"),
    "fp8-bs16": dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float8_e4m3fn"),  # --kv-cache-dtype fp8
}
PREFILL_BLOCKS = 400
DECODE_BLOCKS = 450


def fill(caches: list[torch.Tensor], seed: int) -> None:
    """Random bit patterns (NaNs included): only a bytewise comparison can pass."""
    for layer, cache in enumerate(caches):
        flat = cache.reshape(-1).view(torch.uint8)
        gen = torch.Generator().manual_seed(seed * 1000 + layer)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))


def reference_caches(layout_kwargs: dict, num_blocks: int, seed: int) -> list[torch.Tensor]:
    from kvtransfer import KVLayout

    layout = KVLayout(**layout_kwargs)
    caches = [torch.empty(layout.cache_shape(num_blocks), dtype=layout.torch_dtype) for _ in range(layout.num_layers)]
    fill(caches, seed)
    return caches


def _stalling(base: type, stalled: Any, truncate_bytes: int | None) -> type:
    """A prefill transport that stops in the middle of a transfer: after PullReady, optionally
    after `truncate_bytes` raw bytes (then it drops the connection), else it hangs until killed."""
    from kvtransfer.errors import PeerLost

    class Stalling(base):
        def send_blocks(self, peer, sock, block_ids, transfer_id, timeout_s, heads=None):
            if truncate_bytes is not None:
                sock.sendall(bytes(truncate_bytes))
                raise PeerLost("test: stream cut short on purpose")
            stalled.set()
            time.sleep(3600)

    return Stalling


def _child(conn: Any, transport: str, stalled: Any, stall: str | None, truncate_bytes: int | None) -> None:
    from kvtransfer import KVLayout, create_connector
    from kvtransfer import _transport_classes
    from kvtransfer.prefill import PrefillConnector

    connectors: dict[str, Any] = {}
    freed: dict[str, list] = {}
    while True:
        try:
            cmd, key, *args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if cmd == "open":
                layout_kwargs, num_blocks, seed, lease_ttl_s = args
                layout = KVLayout(**layout_kwargs)
                if stall:
                    cls = _stalling(_transport_classes(transport)[0], stalled, truncate_bytes)
                    c = PrefillConnector(cls(layout), secret=SECRET, engine_id=f"prefill-{key}", lease_ttl_s=lease_ttl_s)
                else:
                    c = create_connector(transport, "prefill", layout, secret=SECRET, engine_id=f"prefill-{key}",
                                         lease_ttl_s=lease_ttl_s)
                fill(c.worker.allocate_kv_caches(num_blocks), seed)
                connectors[key], freed[key] = c, []
                result: Any = c.endpoint
            elif cmd == "publish":
                rid, block_ids, num_tokens, ttl = args
                result = connectors[key].publish(rid, block_ids, num_tokens, ttl).to_bytes()
            elif cmd == "poll":
                events = connectors[key].get_finished()
                freed[key].extend(asdict(f) for f in events.freed)
                result = list(freed[key])
            elif cmd == "stats":
                result = connectors[key].stats()
            elif cmd == "abort":
                result = connectors[key].abort(args[0])
            else:
                raise ValueError(cmd)
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - reported to the test
            conn.send(("err", f"{type(e).__name__}: {e}"))
    for c in connectors.values():
        c.close()


class PrefillPeer:
    """Handle on the child process; every call has a deadline so a hung child fails the test."""

    def __init__(self, transport: str, stall: str | None = None, truncate_bytes: int | None = None):
        ctx = mp.get_context("spawn")
        self.transport = transport
        self._conn, child_conn = ctx.Pipe()
        self.stalled = ctx.Event()
        self.proc = ctx.Process(target=_child, args=(child_conn, transport, self.stalled, stall, truncate_bytes),
                                daemon=True, name=f"prefill-{transport}")
        self.proc.start()
        child_conn.close()

    def call(self, cmd: str, key: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((cmd, key, *args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"prefill child did not answer {cmd!r} in {timeout}s")
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(result)
        return result

    def open(self, key: str, layout_kwargs: dict, num_blocks: int, seed: int, lease_ttl_s: float = 30.0) -> str:
        return self.call("open", key, layout_kwargs, num_blocks, seed, lease_ttl_s)

    def publish(self, key: str, rid: str, block_ids: list[int], num_tokens: int, ttl: float | None = None):
        from kvtransfer import KVHandle

        return KVHandle.from_bytes(self.call("publish", key, rid, block_ids, num_tokens, ttl))

    def wait_for(self, key: str, predicate: Any, timeout: float = 10.0) -> dict:
        """Poll the child's connector (get_finished + stats) until predicate(stats, freed) holds."""
        deadline = time.monotonic() + timeout
        while True:
            freed = self.call("poll", key)
            stats = self.call("stats", key)
            if predicate(stats, freed):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout}s: stats={stats}, freed={freed}")
            time.sleep(0.01)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        self._conn.close()
        self.proc.join(10)
        self.kill()


def wait_events(connector, request_ids, timeout: float = 30.0) -> TransferEvents:
    """Poll get_finished() until every request id is finished or failed (as the engine loop would)."""
    pending, out = set(request_ids), TransferEvents()
    deadline = time.monotonic() + timeout
    while pending:
        events = connector.get_finished()
        out.finished += events.finished
        out.failed.update(events.failed)
        pending -= set(events.finished) | set(events.failed)
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"no completion for {sorted(pending)[:5]} within {timeout}s")
        if pending:
            time.sleep(0.002)
    return out


def blocks_bytes(caches, block_ids) -> list[bytes]:
    """Raw bytes of the given blocks in every layer: bit-identical means these are equal."""
    ids = torch.tensor(block_ids, dtype=torch.long)
    return [c.index_select(1, ids).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for c in caches]
