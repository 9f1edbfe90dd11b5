"""KV pull time against bytes for each transport usable here, between two processes, in a model's layout.

The prefill side runs in a spawned process (its own GIL, as in a deployment); this process pulls,
as a decode engine does: start_pull(...) to completion, control round trips and the lease's
release included.
"""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import random
import statistics
import time
from typing import Callable

from kvtransfer import KVHandle, KVLayout, create_connector

SECRET = b"pdserve-profile"


def available_transports(device: str) -> list[str]:
    """tcp and shm always; ucx when its Python binding is installed; nccl between GPU caches (its
    gloo path between CPU processes timed out here: not profiled on CPUs). One that fails (shm
    with GPU caches, NCCL between two processes on one GPU) is reported unavailable in the profile."""
    out = ["tcp", "shm"]
    if importlib.util.find_spec("ucp") is not None:
        out.append("ucx")
    if device.startswith("cuda"):
        out.append("nccl")
    return out


def _prefill_side(conn, transport: str, layout: KVLayout, num_blocks: int) -> None:
    try:
        connector = create_connector(transport, "prefill", layout, secret=SECRET, engine_id="profile-prefill")
        for cache in connector.worker.allocate_kv_caches(num_blocks):
            cache.fill_(1)
    except Exception as e:  # e.g. a transport whose library is broken: report, do not hang the parent
        conn.send(f"error: {type(e).__name__}: {e}")
        return
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        rid, block_ids = msg
        conn.send(connector.publish(rid, block_ids, len(block_ids) * layout.block_size).to_bytes())
        connector.get_finished()  # frees what earlier pulls released
    connector.close()


def measure_transport(transport: str, layout: KVLayout, block_counts: list[int], repeats: int,
                      tick: Callable[[], None] = lambda: None) -> list[tuple[int, float]]:
    """(bytes, seconds) per pull: the median of `repeats` pulls of each block count, random block ids."""
    pool = max(block_counts) + 8
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_prefill_side, args=(child, transport, layout, pool), daemon=True)
    proc.start()
    decode = None
    try:
        if not parent.poll(120):
            raise RuntimeError(f"{transport}: the prefill side did not start")
        ready = parent.recv()
        if ready != "ready":
            raise RuntimeError(f"{transport}: {ready}")
        decode = create_connector(transport, "decode", layout, secret=SECRET, engine_id="profile-decode", timeout_s=120)
        for cache in decode.worker.allocate_kv_caches(pool):
            cache.fill_(0)  # touch the pages once, as a running engine has
        rng = random.Random(0)
        count = 0

        def pull(n: int) -> float:
            nonlocal count
            count += 1
            parent.send((f"p{count}", rng.sample(range(pool), n)))
            handle = KVHandle.from_bytes(parent.recv())
            start = time.perf_counter()
            decode.start_pull(handle.request_id, handle, rng.sample(range(pool), n)).result(timeout=120)
            elapsed = time.perf_counter() - start
            decode.get_finished()
            return elapsed

        pull(max(block_counts))  # connection setup and staging buffers: not part of a pull's cost
        points = []
        for n in block_counts:
            points.append((n * layout.block_bytes, statistics.median(pull(n) for _ in range(repeats))))
            tick()
        return points
    finally:
        if decode is not None:
            decode.close()
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
