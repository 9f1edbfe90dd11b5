"""`make bench-router`: what the router adds to a request, and how many it sustains on one core.

1. Added latency: max_tokens=1 requests, one at a time, through the router's HTTP API vs
   straight to a colocated engine's gRPC Decode (the call the router makes), same engine, same run.
2. Router throughput: the router pinned to one core in front of instant in-process engines
   (so the engine is never the bottleneck), closed loop at growing concurrency.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from bench.procs import Proc, exit_on_signals, free_port, grpc_serving, http_ok, pdserve_cmd, wait_until  # noqa: E402
from services.api.pdserve.v1 import pdserve_pb2 as pb  # noqa: E402
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc  # noqa: E402

BUILD = os.path.join(ROOT, "build", "bench-router")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def added_latency(url: str, grpc_addr: str, n: int) -> tuple[list[float], list[float]]:
    prompt = list(range(20, 36))
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    via_router, direct = [], []
    async with aiohttp.ClientSession() as http, grpc.aio.insecure_channel(grpc_addr) as ch:
        stub = pb_grpc.DecodeStub(ch)
        sampling = pb.SamplingParams(max_tokens=1, temperature=0)
        for i in range(n + 10):  # interleaved, so drift hits both alike; 10 warm-up rounds
            t = time.perf_counter()
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            a = time.perf_counter() - t
            t = time.perf_counter()
            async for _ in stub.Decode(pb.DecodeRequest(request_id=f"direct-{i}", prompt_token_ids=prompt,
                                                        sampling=sampling)):
                pass
            b = time.perf_counter() - t
            if i >= 10:
                via_router.append(a)
                direct.append(b)
    return via_router, direct


class InstantEngine(pb_grpc.PrefillServicer, pb_grpc.DecodeServicer, pb_grpc.EngineServicer):
    """Answers at once: the router is then the only thing being measured. Its Prefill ends every
    request at the first token, as an engine does for max_tokens=1."""

    async def Prefill(self, request, context):
        return pb.PrefillResponse(first_token_id=7, finish_reason="length", engine_id="instant")

    async def Decode(self, request, context):
        yield pb.DecodeResponse(token_ids=[7] * max(1, request.sampling.max_tokens), finish_reason="length")

    async def Abort(self, request, context):
        return pb.AbortResponse(found=False)

    async def GetLoad(self, request, context):
        return pb.LoadReport(engine_id="instant", role="colocated", block_size=16, num_blocks=1000,
                             max_model_len=2048)


def serve_instant(port: int) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    async def main():
        server = grpc.aio.server()
        engine = InstantEngine()
        pb_grpc.add_PrefillServicer_to_server(engine, server)
        pb_grpc.add_DecodeServicer_to_server(engine, server)
        pb_grpc.add_EngineServicer_to_server(engine, server)
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def closed_loop(url: str, concurrency: int, seconds: float) -> float:
    body = {"model": "bench", "prompt": list(range(20, 36)), "max_tokens": 1}
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(session):
        nonlocal done
        while time.perf_counter() < stop:
            async with session.post(f"{url}/v1/completions", json=body) as r:
                await r.read()
                if r.status == 200:
                    done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0, help="per concurrency level")
    args = ap.parse_args(argv)
    os.makedirs(BUILD, exist_ok=True)
    env = dict(os.environ, PDSERVE_KV_SECRET=secrets.token_hex(8))
    procs = []
    try:
        # Part 1: real engine (a colocated service: the router sends it Decode, as the direct calls do).
        eng_port, http = free_port(), free_port()
        procs.append(Proc("colocated", pdserve_cmd("colocated", "--model", "tiny", "--port", str(eng_port),
                                                   "--num-threads", "1"), {1}, env, BUILD))
        wait_until(lambda: grpc_serving(f"127.0.0.1:{eng_port}"), procs, "the engine")
        procs.append(Proc("router", pdserve_cmd("router", "--model", "tiny", "--served-model-name", "bench",
                                                "--host", "127.0.0.1", "--port", str(http), "--grpc-port", "-1", "--decode",
                                                f"127.0.0.1:{eng_port}"), {0}, env, BUILD))
        url = f"http://127.0.0.1:{http}"
        wait_until(lambda: http_ok(f"{url}/health"), procs, "the router")
        via, direct = asyncio.run(added_latency(url, f"127.0.0.1:{eng_port}", args.requests))
        for p in reversed(procs):
            p.stop()
        procs.clear()
        print(f"max_tokens=1, {args.requests} sequential requests (router on core 0, engine on core 1)")
        print(f"{'path':<28}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
        for name, xs in (("HTTP via router", via), ("gRPC straight to engine", direct)):
            print(f"{name:<28}{1e3 * pct(xs, 50):>9.2f}{1e3 * pct(xs, 99):>9.2f}{1e3 * statistics.mean(xs):>9.2f}")
        added_p50 = 1e3 * (pct(via, 50) - pct(direct, 50))
        added_p99 = 1e3 * (pct(via, 99) - pct(direct, 99))

        # Part 2: the router alone on one core, in front of instant engines.
        import multiprocessing
        ports = [free_port(), free_port()]
        fakes = [multiprocessing.get_context("spawn").Process(target=serve_instant, args=(p,), daemon=True)
                 for p in ports]
        for f in fakes:
            f.start()
        wait_until(lambda: all(grpc_serving(f"127.0.0.1:{p}") for p in ports), [], "instant engines")
        http = free_port()
        procs.append(Proc("router-alone", pdserve_cmd(
            "router", "--model", "tiny", "--served-model-name", "bench", "--host", "127.0.0.1",
            "--port", str(http), "--grpc-port", "-1", "--prefill", f"127.0.0.1:{ports[0]}", "--decode", f"127.0.0.1:{ports[1]}"),
            {0}, env, BUILD))
        url = f"http://127.0.0.1:{http}"
        wait_until(lambda: http_ok(f"{url}/health"), procs, "the router")
        best = 0.0
        print("\nrouter alone on core 0 (instant engines), closed loop, max_tokens=1:")
        for c in (1, 4, 16, 64):
            rate = asyncio.run(closed_loop(url, c, args.seconds))
            best = max(best, rate)
            print(f"  concurrency {c:>3}: {rate:8.0f} req/s")
        for f in fakes:
            f.terminate()
        print(f"\nrouter_added_p99_ms={added_p99:.2f}")
        print(f"router_max_rps_one_core={best:.0f}")
        print(f"router_added_p50_ms={added_p50:.2f}")
    finally:
        for p in reversed(procs):
            p.stop()
    return 0


if __name__ == "__main__":
    exit_on_signals()  # SIGTERM stops the stack this started, too
    sys.exit(main())
