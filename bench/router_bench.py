"""`make bench-router`: what the router adds to a request, and how many it sustains on one core.

1. Added latency: max_tokens=1 requests, one at a time, through the router's HTTP API vs
   straight to a colocated engine's gRPC Decode (the call the router makes), same engine, same run.
2. Router throughput: the router pinned to one core in front of instant in-process engines
   (so the engine is never the bottleneck), closed loop at growing concurrency.
3. The serving path's cost per streamed token: a colocated engine (the tiny model) behind the
   router, streaming requests in a closed loop, at --stream-interval 1 and larger; CPU seconds
   of the router, the service's host process and its engine core, per token the clients got.
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

from bench.procs import (Proc, descendants, exit_on_signals, free_port, grpc_serving, http_ok,  # noqa: E402
                         pdserve_cmd, wait_until)
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


async def closed_loop(url: str, concurrency: int, seconds: float, body: dict) -> tuple[int, float]:
    """`concurrency` clients posting `body` to /v1/completions back to back for `seconds`:
    (requests answered 200, seconds). A streamed answer is read to its end."""
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
        return done, time.perf_counter() - t


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_cost(interval: int, env: dict, args) -> dict:
    """Part 3 at one stream interval: tokens/s and CPU microseconds per token of each process."""
    eng_port, http = free_port(), free_port()
    procs = [Proc(f"colocated-si{interval}", pdserve_cmd(
        "colocated", "--model", "tiny", "--port", str(eng_port), "--num-threads", "1",
        "--stream-interval", str(interval)), {1}, env, BUILD)]
    try:
        wait_until(lambda: grpc_serving(f"127.0.0.1:{eng_port}"), procs, "the engine")
        procs.append(Proc(f"router-si{interval}", pdserve_cmd(
            "router", "--model", "tiny", "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(http),
            "--grpc-port", "-1", "--decode", f"127.0.0.1:{eng_port}"), {0}, env, BUILD))
        url = f"http://127.0.0.1:{http}"
        wait_until(lambda: http_ok(f"{url}/health"), procs, "the router")
        body = {"model": "bench", "prompt": list(range(20, 36)), "max_tokens": args.stream_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        asyncio.run(closed_loop(url, args.streams, 2.0, body))  # warm-up
        pids = {"router": procs[1].proc.pid, "service host": procs[0].proc.pid}
        pids["engine core"] = descendants(procs[0].proc.pid)
        before = {k: sum(map(cpu_seconds, v)) if isinstance(v, list) else cpu_seconds(v) for k, v in pids.items()}
        done, seconds = asyncio.run(closed_loop(url, args.streams, args.seconds, body))
        tokens = done * args.stream_tokens
        after = {k: sum(map(cpu_seconds, v)) if isinstance(v, list) else cpu_seconds(v) for k, v in pids.items()}
        row = {"interval": interval, "tokens_per_s": tokens / seconds}
        row.update({k: 1e6 * (after[k] - before[k]) / tokens for k in pids})
        return row
    finally:
        for p in reversed(procs):
            p.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0, help="per concurrency level (and stream interval)")
    ap.add_argument("--stream-intervals", default="1,4,16", help="part 3: the engine's --stream-interval values")
    ap.add_argument("--streams", type=int, default=32, help="part 3: concurrent streaming requests")
    ap.add_argument("--stream-tokens", type=int, default=128, help="part 3: tokens per request")
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
        body = {"model": "bench", "prompt": list(range(20, 36)), "max_tokens": 1}
        for c in (1, 4, 16, 64):
            done, seconds = asyncio.run(closed_loop(url, c, args.seconds, body))
            rate = done / seconds
            best = max(best, rate)
            print(f"  concurrency {c:>3}: {rate:8.0f} req/s")
        for f in fakes:
            f.terminate()
        for p in reversed(procs):
            p.stop()
        procs.clear()

        # Part 3: CPU per streamed token, router and engine service, at each stream interval.
        rows = [stream_cost(int(k), env, args) for k in args.stream_intervals.split(",")]
        print(f"\n{args.streams} streams of {args.stream_tokens} tokens, tiny model (router on core 0, "
              f"colocated engine on core 1), CPU microseconds per token:")
        print(f"{'stream interval':>16}{'tokens/s':>10}{'router':>9}{'host':>9}{'engine core':>13}{'path':>9}")
        for r in rows:
            r["path"] = r["router"] + r["service host"]
            print(f"{r['interval']:>16}{r['tokens_per_s']:>10.0f}{r['router']:>9.1f}{r['service host']:>9.1f}"
                  f"{r['engine core']:>13.1f}{r['path']:>9.1f}")
        print(f"\nrouter_us_per_streamed_token={rows[0]['router']:.1f}")
        print(f"serving_path_us_per_streamed_token={rows[0]['path']:.1f}")
        for r in rows[1:]:
            print(f"stream_interval_{r['interval']}_path_cpu_ratio={r['path'] / rows[0]['path']:.3f}")
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
