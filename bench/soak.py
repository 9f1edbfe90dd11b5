"""`make soak`: open-loop load at about twice a local stack's capacity while faults are injected on a
schedule; every request must end completed, rejected (429) or with an explicit error, never lost.

The stack (router, 2 prefills, 2 decodes, the tiny model) runs on loopback and is supervised as
Kubernetes would: a service that exits is restarted on the same ports. Faults: kill -9 a prefill, a
decode and a decode's engine core; a KV connection reset mid-pull (a proxy in front of a prefill's KV
port); clients that disconnect mid-stream. Greedy outputs are checked against a reference run on the
undisturbed stack; at the end no KV block may stay pinned on a prefill. Exit status 1 on any loss.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import re
import sys
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.procs import ensure_tiny_model, exit_on_signals  # noqa: E402
from bench.serve import sse_events  # noqa: E402
from bench.soak_stack import SoakStack  # noqa: E402
from bench.workloads import poisson_arrivals  # noqa: E402

BUILD = os.path.join(ROOT, "build", "soak")
OUTCOMES = ("completed", "rejected", "failed", "disconnected", "lost")


@dataclasses.dataclass
class SoakRequest:
    prompt: list[int]
    max_tokens: int
    stream: bool
    greedy: bool
    ref: int | None = None  # greedy: the index of its reference output
    disconnect_after: int | None = None  # streaming: the client leaves after this many text chunks


@dataclasses.dataclass
class Outcome:
    kind: str  # one of OUTCOMES
    text: str = ""
    detail: str = ""


class Workload:
    """Greedy requests over a fixed set of prompts (their references), sampled ones over fresh prompts."""

    def __init__(self, num_greedy_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                 vocab_size: int, seed: int, disconnect_fraction: float) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.input_len, self.output_len = input_len, output_len
        self.disconnect_fraction = disconnect_fraction
        self.greedy = [(self._prompt(), self.rng.randint(*output_len)) for _ in range(num_greedy_prompts)]

    def _prompt(self) -> list[int]:
        return [self.rng.randrange(10, self.vocab_size) for _ in range(self.rng.randint(*self.input_len))]

    def next(self) -> SoakRequest:
        stream = self.rng.random() < 0.5
        disconnect = self.rng.randint(1, 4) if stream and self.rng.random() < self.disconnect_fraction else None
        if self.rng.random() < 0.5:
            ref = self.rng.randrange(len(self.greedy))
            prompt, max_tokens = self.greedy[ref]
            return SoakRequest(prompt, max_tokens, stream, True, ref, disconnect)
        return SoakRequest(self._prompt(), self.rng.randint(*self.output_len), stream, False, None, disconnect)


def body_of(req: SoakRequest, model: str) -> dict:
    # ignore_eos: every completed request has exactly max_tokens tokens, so a short one is detectable.
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True,
            "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    body.update({"temperature": 0.0} if req.greedy else {"temperature": 0.8, "top_p": 0.95})
    return body


async def send(session: aiohttp.ClientSession, url: str, model: str, req: SoakRequest) -> Outcome:
    try:
        async with session.post(f"{url}/v1/completions", json=body_of(req, model)) as resp:
            if resp.status == 429:
                return Outcome("rejected", detail=(await resp.text())[:200])
            if resp.status != 200:
                data = await resp.text()
                explicit = "error" in json.loads(data) if data.startswith("{") else False
                return Outcome("failed" if explicit else "lost", detail=f"HTTP {resp.status}: {data[:200]}")
            if not req.stream:
                return check_final(req, await resp.json())
            return await read_stream(req, resp)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        return Outcome("lost", detail=f"no complete answer: {type(e).__name__}: {e}")


def check_final(req: SoakRequest, body: dict) -> Outcome:
    choice, usage = body["choices"][0], body.get("usage") or {}
    if choice.get("finish_reason") != "length" or usage.get("completion_tokens") != req.max_tokens:
        return Outcome("lost", detail=f"200 but truncated: finish_reason {choice.get('finish_reason')!r}, "
                                      f"{usage.get('completion_tokens')} of {req.max_tokens} tokens")
    return Outcome("completed", choice["text"])


async def read_stream(req: SoakRequest, resp: aiohttp.ClientResponse) -> Outcome:
    """A stream must end with a finish_reason (and the usage chunk) then [DONE], or with an error event."""
    text, finish, tokens, chunks, done = [], None, None, 0, False
    async for event in sse_events(resp):
        if event is None:
            done = True
            break
        if "error" in event:
            return Outcome("failed", detail=f"error event: {event['error'].get('message', '')[:200]}")
        if event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices", []):
            if choice.get("text"):
                text.append(choice["text"])
                chunks += 1
            finish = choice.get("finish_reason") or finish
        if req.disconnect_after is not None and chunks >= req.disconnect_after and finish is None:
            resp.close()  # the client goes away mid-stream
            return Outcome("disconnected")
    if not done or finish != "length" or tokens != req.max_tokens:
        return Outcome("lost", detail=f"stream ended: [DONE] {done}, finish_reason {finish!r}, "
                                      f"{tokens} of {req.max_tokens} tokens")
    return Outcome("completed", "".join(text))


async def references(url: str, model: str, workload: Workload) -> list[str]:
    """Greedy outputs of the undisturbed stack, one request at a time."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        outs = [await send(session, url, model, SoakRequest(p, n, False, True)) for p, n in workload.greedy]
    bad = [o for o in outs if o.kind != "completed"]
    if bad:
        raise RuntimeError(f"reference run failed on an undisturbed stack: {bad[0]}")
    return [o.text for o in outs]


async def measure_capacity(url: str, model: str, workload: Workload, concurrency: int, seconds: float) -> float:
    """Requests/s the undisturbed stack completes with `concurrency` clients in a closed loop (enough
    to fill every decode's batch, not its queue): completions in the window's second half, once the
    batches are full, per second."""
    finished: list[float] = []

    async def client(session: aiohttp.ClientSession, stop: float) -> None:
        while time.monotonic() < stop:
            req = dataclasses.replace(workload.next(), stream=False, disconnect_after=None)
            if (await send(session, url, model, req)).kind == "completed":
                finished.append(time.monotonic())

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        await asyncio.gather(*(client(session, start + seconds) for _ in range(concurrency)))
    done = sum(start + seconds / 2 <= t < start + seconds for t in finished)
    if done == 0:
        raise RuntimeError("no request completed while measuring the capacity")
    return done / (seconds / 2)


class Faults:
    """The schedule: each fault at its fraction of the load's duration; the second decode goes down
    only once the first is back, so there is always an instance to fail over to."""

    def __init__(self, stack: SoakStack, t0: float, duration: float) -> None:
        self.stack, self.t0, self.duration = stack, t0, duration
        self.log: list[tuple[float, str]] = []  # (seconds since t0, what happened)
        self.missed: list[str] = []  # faults not injected, services not back
        self.done_at = float("inf")  # seconds after t0 when the last service was back
        self.restoring: list[asyncio.Task] = []

    def note(self, what: str, at: float | None = None) -> None:
        self.log.append(((at or time.monotonic()) - self.t0, what))

    async def at(self, fraction: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + fraction * self.duration - time.monotonic()))

    async def wait_back(self, service, restarts: int, timeout: float = 180) -> None:
        """Until the service, restarted once more than `restarts`, is SERVING and in the router's pool."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(service.restarts) > restarts and service.alive() and await asyncio.to_thread(service.ready) \
                    and await asyncio.to_thread(self.stack.router_sees_all):
                self.note(f"{service.name} restarted on its ports, back in the router's pool")
                return
            await asyncio.sleep(0.25)
        self.missed.append(f"{service.name} not back after {timeout:.0f} s")
        self.note(self.missed[-1])

    async def kill(self, service, what: str, kill) -> asyncio.Task | None:
        """kill -9, then the crash as the supervisor saw it; returns the wait for the service's return."""
        restarts, exits = len(service.restarts), len(service.exits)
        at = time.monotonic()
        pid = await asyncio.to_thread(kill, service)
        self.note(f"kill -9 {what} (pid {pid})", at)
        deadline = time.monotonic() + 90
        while len(service.exits) == exits:
            if time.monotonic() > deadline:
                self.missed.append(f"{service.name} still running 90 s after the kill")
                self.note(self.missed[-1])
                return None
            await asyncio.sleep(0.05)
        at, code = service.exits[-1]
        self.note(f"{service.name} exited ({'SIGKILL' if code == -9 else f'code {code}, on its own'})", at)
        self.restoring.append(asyncio.create_task(self.wait_back(service, restarts)))
        return self.restoring[-1]

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as e:  # noqa: BLE001 - reported as a fault not injected; the load goes on
            self.missed.append(f"fault schedule stopped: {type(e).__name__}: {e}")
            self.note(self.missed[-1])
        self.done_at = time.monotonic() - self.t0

    async def _run(self) -> None:
        s = self.stack
        await self.at(0.12)
        await self.kill(s.prefills[0], s.prefills[0].name, s.kill)
        await self.at(0.25)
        await self.cut_kv_pull(s.proxies[-1])  # the prefill that stays up
        await self.at(0.40)
        decode_back = await self.kill(s.decodes[0], s.decodes[0].name, s.kill)
        if decode_back is not None:
            await decode_back
        await self.at(0.60)
        if s.decodes[0].ready():
            await self.kill(s.decodes[-1], f"{s.decodes[-1].name}'s engine core", s.kill_engine_core)
        else:  # never the whole decode pool at once
            self.missed.append(f"{s.decodes[-1].name}'s engine core not killed: {s.decodes[0].name} is not back")
            self.note(self.missed[-1])
        await asyncio.gather(*self.restoring)

    async def cut_kv_pull(self, proxy) -> None:
        proxy.arm()
        self.note(f"armed the KV proxy of prefill port {proxy.port}: reset the next pull midway")
        deadline = time.monotonic() + 30
        while not proxy.cuts and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proxy.cuts:
            self.note("KV connection reset mid-pull", proxy.cuts[0])
        else:
            proxy.armed.clear()
            self.missed.append("KV cut not injected: no pull through the proxy within 30 s")
            self.note(self.missed[-1])


async def soak(stack: SoakStack, model: str, workload: Workload, refs: list[str], rate: float, duration: float,
               max_requests: int, client_timeout: float, seed: int, overtime: float):
    """Poisson arrivals for `duration` seconds, and on (at most `overtime` more) until the faults are
    done and the restarted services have served a tenth of the duration: every fault lands under load."""
    offsets = poisson_arrivals(max_requests, rate, seed)
    timeout = aiohttp.ClientTimeout(total=client_timeout)
    reqs, tasks = [], []
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()
        faults = Faults(stack, t0, duration)
        fault_task = asyncio.create_task(faults.run())
        for offset in offsets:
            if offset >= duration and (offset >= duration + overtime  # the run stays bounded
                                       or fault_task.done() and offset >= faults.done_at + 0.1 * duration):
                break
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            reqs.append(workload.next())
            tasks.append(asyncio.create_task(send(session, stack.url, model, reqs[-1])))
        load_s = time.monotonic() - t0
        outcomes = await asyncio.gather(*tasks)
        await fault_task
    mismatches = [(r, o) for r, o in zip(reqs, outcomes) if r.greedy and o.kind == "completed" and o.text != refs[r.ref]]
    return reqs, outcomes, mismatches, faults, load_s


def wait_quiet(stack: SoakStack, timeout: float) -> dict[str, object]:
    """Until no engine runs, queues or pins anything (a lease left by a dead decode expires on the
    prefill's clock); the last reports either way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reports = {s.name: stack.load(s) for s in stack.engines}
            quiet = all(r.num_running == 0 and r.num_waiting == 0 and r.num_pinned_blocks == 0
                        for r in reports.values()) and stack.router_metric("pdserve:router_requests_running") == 0
        except Exception as e:  # noqa: BLE001 - a service still restarting: try again
            reports, quiet = {"error": repr(e)}, False
        if quiet or time.monotonic() > deadline:
            return reports
        time.sleep(0.5)


def summarize(stack, capacity, rate, refs, reqs, outcomes, mismatches, faults, load_s, reports, rss) -> dict:
    """Everything the table shows, and whether the soak passed."""
    counts = {k: sum(o.kind == k for o in outcomes) for k in OUTCOMES}
    known = "error" not in reports
    summary = {
        "prefills": len(stack.prefills), "decodes": len(stack.decodes), "capacity_rps": capacity,
        "request_rate": rate, "load_s": load_s, "sent": len(reqs),
        "streaming": sum(r.stream for r in reqs), "greedy": sum(r.greedy for r in reqs), **counts,
        "greedy_checked": sum(r.greedy and o.kind == "completed" for r, o in zip(reqs, outcomes)),
        "greedy_mismatches": len(mismatches),
        "pinned_blocks": sum(r.num_pinned_blocks for n, r in reports.items() if n.startswith("prefill")) if known else None,
        "left_in_engines": sum(r.num_running + r.num_waiting for r in reports.values()) if known else None,
        "rss_mib": {name: {"before": b, "after": a} for name, (b, a) in rss.items()},
        "faults": [{"t": round(t, 1), "event": what} for t, what in faults.log], "faults_missed": faults.missed,
        "failure_kinds": collections.Counter(
            re.sub(r"cmpl-[0-9a-f.]+|127\.0\.0\.1:\d+|\(\d+ requests, \d+ prompt tokens", "*", o.detail)
            for o in outcomes if o.kind == "failed").most_common(5),
        "lost_details": [f"{'stream' if r.stream else 'non-stream'}: {o.detail}"
                         for r, o in zip(reqs, outcomes) if o.kind == "lost"][:20],
        "mismatch_details": [f"reference {r.ref} ({'stream' if r.stream else 'non-stream'}): {o.text[:60]!r} "
                             f"!= {refs[r.ref][:60]!r}" for r, o in mismatches[:5]],
    }
    summary["passed"] = (counts["lost"] == 0 and not mismatches and summary["pinned_blocks"] == 0
                         and not faults.missed)
    return summary


def format_table(s: dict, duration: float) -> str:
    rows = [("requests sent", s["sent"]),
            ("  streaming / non-streaming", f"{s['streaming']} / {s['sent'] - s['streaming']}"),
            ("  greedy / sampled", f"{s['greedy']} / {s['sent'] - s['greedy']}"),
            ("completed", s["completed"]), ("rejected with 429", s["rejected"]),
            ("failed with an explicit error", s["failed"]),
            ("client disconnected mid-stream", s["disconnected"]), ("LOST", s["lost"]),
            ("greedy outputs token-exact", f"{s['greedy_checked'] - s['greedy_mismatches']} / {s['greedy_checked']}"),
            ("pinned KV blocks on prefills at the end", s["pinned_blocks"]),
            ("requests left in engines at the end", s["left_in_engines"])]
    rows += [(f"RSS {name} (MiB)", f"{m['before']:.0f} -> {m['after']:.0f} ({m['after'] - m['before']:+.0f})")
             for name, m in s["rss_mib"].items()]
    width = max(len(k) for k, _ in rows)
    lines = [f"soak: {s['prefills']} prefill + {s['decodes']} decode + router on loopback; capacity "
             f"{s['capacity_rps']:.2f} req/s measured, Poisson load at {s['request_rate']:.2f} req/s for "
             f"{s['load_s']:.0f} s (--duration {duration:.0f})",
             *(f"  {k:<{width}}  {v}" for k, v in rows), "  faults (seconds after the load began):"]
    lines += [f"    {f['t']:7.1f}  {f['event']}" for f in s["faults"]]
    lines += [f"  failed x{n}: {kind}" for kind, n in s["failure_kinds"]]
    lines += [f"  lost: {d}" for d in s["lost_details"][:10]]
    lines += [f"  greedy mismatch: {d}" for d in s["mismatch_details"]]
    lines.append(f"soak {'PASSED' if s['passed'] else 'FAILED'}")
    return "\n".join(lines)


def rss_snapshot(stack: SoakStack) -> dict[str, tuple[int, float]]:
    return {s.name: (len(s.restarts), s.rss_mb()) for s in stack.services}


def rss_growth(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """Router and engines never restarted: resident memory from after the warm-up to the end."""
    return {name: (before[name][1], after[name][1]) for name in before if before[name][0] == after[name][0]}


def ensure_model(path: str) -> str:
    return ensure_tiny_model(path, arch="llama", max_position_embeddings=512)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Llama in build/soak)")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of open-loop load")
    ap.add_argument("--max-requests", type=int, default=50000, help="most requests sent")
    ap.add_argument("--capacity-seconds", type=float, default=20.0, help="closed-loop run measuring the capacity")
    ap.add_argument("--overtime", type=float, default=120.0,
                    help="most seconds the load runs past --duration while restarted services come back")
    ap.add_argument("--load-factor", type=float, default=2.0, help="arrival rate as a multiple of the capacity")
    ap.add_argument("--prefills", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=2)
    ap.add_argument("--input-len", default="16:256", help="prompt tokens, LO:HI (uniform)")
    ap.add_argument("--output-len", default="16:128", help="output tokens, LO:HI (uniform)")
    ap.add_argument("--greedy-prompts", type=int, default=32, help="distinct greedy prompts (reference outputs)")
    ap.add_argument("--disconnect-fraction", type=float, default=0.1, help="streams the client leaves midway")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="each engine's running batch (sheds beyond 3x)")
    ap.add_argument("--kv-lease-ttl", type=float, default=15.0, help="prefill's KV lease (pins of a dead decode)")
    ap.add_argument("--client-timeout", type=float, default=180.0, help="seconds a client waits for its answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=os.path.join(BUILD, "logs"))
    ap.add_argument("--result-file", default=None, help="write the summary as JSON")
    args = ap.parse_args(argv)
    model = args.model or ensure_model(os.path.join(BUILD, "model"))
    lo_in, hi_in = (int(x) for x in args.input_len.split(":"))
    lo_out, hi_out = (int(x) for x in args.output_len.split(":"))
    with open(os.path.join(model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    workload = Workload(args.greedy_prompts, (lo_in, hi_in), (lo_out, hi_out), vocab_size, args.seed,
                        args.disconnect_fraction)
    engine_args = ["--num-threads", "1", "--num-blocks", "2048", "--max-num-seqs", str(args.max_num_seqs)]
    # The router's deadline comes before the client's: a slow request gets an explicit 504, not a hang.
    router_args = ["--request-timeout", str(args.client_timeout * 0.6)]
    print(f"starting {args.prefills} prefill + {args.decodes} decode + router (logs in {args.log_dir})", flush=True)
    stack = SoakStack(model, args.prefills, args.decodes, engine_args, ["--kv-lease-ttl", str(args.kv_lease_ttl)],
                      router_args, args.log_dir)
    summary = {"passed": False}
    try:
        stack.wait_ready()
        refs = asyncio.run(references(stack.url, model, workload))
        capacity = asyncio.run(measure_capacity(stack.url, model, workload, args.decodes * args.max_num_seqs,
                                                args.capacity_seconds))
        rate = args.load_factor * capacity
        print(f"capacity {capacity:.2f} req/s ({len(refs)} greedy references); soaking at {rate:.2f} req/s "
              f"for {args.duration:.0f} s", flush=True)
        before = rss_snapshot(stack)
        reqs, outcomes, mismatches, faults, load_s = asyncio.run(
            soak(stack, model, workload, refs, rate, args.duration, args.max_requests, args.client_timeout, args.seed,
                 args.overtime))
        reports = wait_quiet(stack, args.kv_lease_ttl + 20)
        rss = rss_growth(before, rss_snapshot(stack))
        summary = summarize(stack, capacity, rate, refs, reqs, outcomes, mismatches, faults, load_s, reports, rss)
        print(format_table(summary, args.duration), flush=True)
    finally:
        codes = stack.stop()
    summary["exit_codes"] = codes
    unclean = {n: c for n, c in codes.items() if c != 0}
    if unclean:
        print(f"services that did not stop with exit code 0 on SIGTERM: {unclean}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["passed"] and not unclean else 1


if __name__ == "__main__":
    exit_on_signals()  # SIGTERM stops the stack this started, too
    sys.exit(main())
