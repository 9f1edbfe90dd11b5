"""The served path's cost, measured through a live instance behind a router: per token, and beside a busy neighbour.

The step model times steps inside one process. A served token also leaves the engine core (to
the engine host over ZMQ, its gRPC stream), crosses the router (detokenized, an SSE event) and
reaches a client; on a shared machine that CPU time lands on cores an instance computes on. And
instances packed on one host share its memory bandwidth and caches: a decode step is slower while
the instance next door prefills.

Here one `pdserve colocated` runs on the first `threads` cores this process may use, a router in
front of it and the client on any core, and requests go through the router's OpenAI endpoint, as
bench-pd's client sends them. Each round sends one request per length alone, then `batch`
requests at once (short prompts that fit one step, so they decode in lock-step); where the machine
has room, the lone requests go again (fresh prompts: a repeat would hit the prefix cache) while a
second instance as wide on the next cores is kept busy (long prompts back to back).

- served-path cost, fitted as `step_s + token_s x sampled tokens` on top of the engine's step:
  from the lone requests' TPOT (a batch of 1) and the batch's median inter-token gap (a batch of
  `batch`: the per-token work, detokenizing, SSE and the client's parsing, grows with it), each
  over the engine's own step for that batch at that context as the profile measured it in
  process (the step model's where the grid has no such step). Measured against measured steps,
  not the fit: the fit's own error on one batch (10-40% on CPU decodes) would otherwise land in
  the served figure (a lone request's 1-3 ms read as 0 at two threads), and measured under load,
  not extrapolated from one sequence. Rounds continue (up to MAX_ROUNDS) while the batch's gaps
  spread; served steps faster than the engine's beyond noise, or gaps that never settle, are
  refused with the points, not clamped (a `--quick` profile keeps unsettled medians and says
  so). Where the profile left cores idle beside the instance,
  the router and the client ran there, out of the instance's latency; a fleet that fills the
  host runs that work on instances' cores, so their CPU time per streamed token (from /proc and
  the client thread's clock, over the batches) is added to the per-token figure (the simulator
  charges that share to a step only while every core of its host steps), unless the
  fleet's router and clients run on other hosts (`pdserve profile --router-elsewhere`: a
  cluster's router pods); it is recorded either way.
- sustained traffic: the rounds above run lock-step batches, which steady serving never does:
  there requests arrive and finish every few steps, so most steps admit a prompt beside the
  decodes and the batch's composition changes under them. Closed loops through the router
  (SUSTAINED requests kept in flight, each replaced as it finishes, output lengths spread so
  finishes stagger) measure each request's TPOT; calibrate_sustained() replays their arrivals
  in the simulator on the profile and finds the per-token time the model still lacks (on this
  2-core VM 0.06-0.10 ms a token on top of the lock-step batches' 0.16-0.23: staggered steps
  run 20-30% over the grid's uniform ones in process, and the served path's per-request work
  lands beside them). It joins token_s.
- neighbour slowdown: the median ratio busy / alone of TPOT (decode) and of TTFT (prefill),
  charged to a step that starts while another instance on its host is busy. 1.0 where the
  machine has no cores beside the instance's (nothing shares it), and on accelerators (instances
  on separate devices).
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

from services.launcher import stop_with_parent
from services.planner.costmodel import StepCost, StepPoint

logger = logging.getLogger(__name__)

LENGTHS = ((128, 48), (1024, 48))  # prompt, output: a short and a long context
ROUNDS = 4  # of one request per length alone, a batch at once, then the lone lengths beside the busy neighbour
MAX_ROUNDS = 8  # while the batch's gaps over the rounds deviate (median absolute deviation) by more than
SETTLED = 0.10  # ... this fraction of their median
SETTLED_S = 0.5e-3  # or this much (a small model's millisecond steps jitter by more than 10%)
BATCH = 16  # requests at once (their prompts fit one step), 48 tokens out
NOISE = 0.15  # of the engine's step: a served step this much faster than the engine steps refutes the points
NOISE_S = SETTLED_S  # ... or this much, whichever is more (a millisecond step's jitter, as SETTLED_S)
NEAR = 0.25  # a measured decode step stands for a served one of the same batch within this of its context
NEIGHBOUR_REQUEST = (1024, 32)  # what keeps the neighbour busy: mostly prefill, some decode
SUSTAINED = (16, 64)  # requests kept in flight through the router, one closed loop each
SUSTAINED_REQUESTS = 6  # x the concurrency, a loop
SUSTAINED_MAX_TOKEN_S = 0.05  # the calibration's search bound: 50 ms a token is no served path


@dataclass
class ServeCost:
    token_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    offcore_token_s: float = 0.0  # of token_overhead_s: the router's and client's CPU a token, off the instance's cores
    router_token_s: float = 0.0  # that CPU a token as measured (0: not measurable), charged or not
    neighbour_decode: float = 1.0
    neighbour_prefill: float = 1.0
    points: list[dict] = field(default_factory=list)
    batch_points: list[dict] = field(default_factory=list)
    neighbour_points: list[dict] = field(default_factory=list)
    neighbour_note: str = ""  # why the neighbour was not measured, if it was not
    # Closed loops (sustained traffic): per loop its concurrency and each request's
    # [arrival_s, prompt, output, tpot_s]; calibrate_sustained() turns them into sustained_token_s.
    sustained_runs: list[dict] = field(default_factory=list)
    unsettled: str = ""  # why the served batch's figures are unsettled medians, if they are (rounds_settled)


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_AUTH", "PDSERVE_SSL"))}


def _all_cpus() -> set[int]:
    """The CPUs this machine lets the profile's processes use: the cgroup's effective cpuset (a
    container's), else the host's. Not this process's affinity: the profile may be pinned to the
    instance's cores, and the neighbour, the router and the client must run beside it."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                return _cpu_list(f.read())
        except (OSError, ValueError):
            continue
    return set(range(os.cpu_count() or 1))


def _cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set; ValueError if empty or malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return cpus


def _start(cmd: list[str], cores: set[int] | None, stack: ExitStack, ready, what: str) -> int:
    """Start `cmd` (stopped when `stack` closes) and wait until `ready()`; its log in the error
    if it exits first. Returns its pid."""
    def preexec() -> None:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        stop_with_parent()  # a profile killed outright leaves no instance serving

    # Its log goes to a file, not a pipe nobody drains while it serves (a full pipe would stall it).
    log = stack.enter_context(tempfile.TemporaryFile())
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=_env(), preexec_fn=preexec)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    stack.callback(stop)
    deadline = time.monotonic() + 600
    while not ready():
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the {what} exited during start-up: {log.read().decode(errors='replace')[-500:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {what} did not start within 600 s")
        time.sleep(0.5)
    return proc.pid


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) process `pid` has used, from /proc; None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _colocated(model: str, threads: int, dtype: str, max_model_len: int, cores: set[int] | None,
               stack: ExitStack, engine_args: tuple[str, ...] = ()) -> str:
    from services.common.grpc_server import health_serving
    from services.launcher import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    _start([sys.executable, "-m", "services.cli", "colocated", "--model", model, "--num-threads", str(threads),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--port", str(port),
            "--host", "127.0.0.1", "--metrics-port", "0", *engine_args], cores, stack,
           lambda: health_serving(address), "colocated service")
    return address


def _router(model: str, decode: str, stack: ExitStack) -> tuple[str, int]:
    from services.launcher import free_port, http_ok

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pid = _start([sys.executable, "-m", "services.cli", "router", "--model", model, "--host", "127.0.0.1",
                  "--port", str(port), "--policy", "least_load", "--grpc-port", "-1", "--decode", decode],
                 _all_cpus(), stack, lambda: http_ok(f"{url}/health"), "router")
    return url, pid


def _client(url: str, requests: list, together: bool = False) -> list:
    """_served on a thread of its own that may run on any core, as bench-pd's client does (this
    process may be pinned to the instance's cores: its client work would all land there)."""
    return _client_cpu(url, requests, together)[0]


def _client_cpu(url: str, requests: list, together: bool = False) -> tuple[list, float]:
    """_client, and the CPU seconds its thread used."""
    return _on_any_core(lambda: _served(url, requests, together), "profile-client")


def _on_any_core(make_coroutine, name: str) -> tuple[object, float]:
    """asyncio.run(make_coroutine()) on a thread of its own allowed every core; its result and
    the CPU seconds the thread used. Its exception, if any, is raised here."""
    out: dict = {}

    def run() -> None:
        try:
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, _all_cpus())  # this thread only
            start = time.thread_time()
            out["result"] = asyncio.run(make_coroutine())
            out["cpu_s"] = time.thread_time() - start
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"], out["cpu_s"]


async def _served(url: str, requests: list, together: bool = False) -> list:
    """Each request alone, in turn (or all at once), through the router's completions endpoint
    (bench-pd's client)."""
    import aiohttp

    from bench.serve import send_one

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async with session.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        send = lambda req: send_one(session, f"{url}/v1/completions", model, req, {}, True)  # noqa: E731
        if together:
            results = list(await asyncio.gather(*(send(req) for req in requests)))
        else:
            results = [await send(req) for req in requests]
        for req, res in zip(requests, results):
            if not res.success or res.tpot is None:
                raise RuntimeError(f"a {req.prompt_len}-token request through the router failed: {res.error}")
        return results


def _closed_loop(url: str, requests: list, concurrency: int) -> list[tuple[float, object]]:
    """`requests` through the router's completions endpoint, `concurrency` in flight, each sent as
    one finishes (bench-pd's client), from a thread that may run on any core (_on_any_core);
    [(seconds from the start it was sent, its result)] in the order sent."""
    import aiohttp

    from bench.serve import send_one

    async def run() -> list:
        sent: list = []
        pending = iter(requests)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async with session.get(f"{url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            start = time.perf_counter()

            async def worker() -> None:
                for req in pending:  # one shared iterator: each request is sent once
                    at = time.perf_counter() - start
                    res = await send_one(session, f"{url}/v1/completions", model, req, {}, True)
                    if not res.success or res.tpot is None:
                        raise RuntimeError(f"a {req.prompt_len}-token request of a closed loop through the router "
                                           f"failed: {res.error}")
                    sent.append((at, res))
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return sorted(sent, key=lambda x: x[0])

    return _on_any_core(run, "profile-closed-loop")[0]


def calibrate_sustained(profile, runs: list[dict]) -> tuple[float, list[dict]]:
    """The per-token time to add to `profile`'s token_overhead_s so that the simulator, replaying
    each closed loop's arrivals on one colocated instance, gives the loop's measured mean TPOT
    (over the middle half of its requests by arrival: the first are a lock-step start, the last
    a drain); the mean over the loops, and per loop what it measured and found. A loop the
    simulator already runs as slow as measured adds nothing (0, recorded), so a profile is never
    made faster than its steps."""
    import dataclasses

    from services.planner.simulator import Fleet, SimRequest, simulate

    def middle(xs: list) -> list:
        return xs[len(xs) // 4: max(len(xs) // 4 + 1, 3 * len(xs) // 4)]

    def simulated_tpot(reqs: list, extra: float) -> float:
        prof = dataclasses.replace(profile, token_overhead_s=profile.token_overhead_s + extra)
        traces = sorted(simulate(prof, Fleet(num_colocated=1), reqs), key=lambda t: t.request.arrival)
        return statistics.mean(t.tpot for t in middle(traces))

    found = []
    for run in runs:
        reqs = [SimRequest(a, p, o) for a, p, o, _ in run["requests"]]
        measured = statistics.mean(t for *_, t in middle(run["requests"]))
        lo, hi = 0.0, SUSTAINED_MAX_TOKEN_S
        base = simulated_tpot(reqs, 0.0)
        if base >= measured:
            hi = 0.0
        elif simulated_tpot(reqs, hi) < measured:
            raise ServePathError(f"a closed loop of {run['concurrency']} measured a mean TPOT of {measured * 1e3:.1f} ms, "
                                 f"more than the simulator gives even at {hi * 1e3:.0f} ms a token over the profile's "
                                 f"steps: the machine is too busy to measure the served path; profile again on a quiet one")
        while hi - lo > 1e-6:  # microseconds a token
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if simulated_tpot(reqs, mid) < measured else (lo, mid)
        found.append({"concurrency": run["concurrency"], "requests": len(reqs), "measured_tpot_s": measured,
                      "simulated_tpot_s": base, "token_s": hi})
    if not found:
        return 0.0, []
    return statistics.mean(f["token_s"] for f in found), found


class _Neighbour:
    """Keeps an instance busy from a thread, prompts back to back, between resume() and pause()."""

    def __init__(self, address: str, vocab_size: int, max_model_len: int) -> None:
        self.address, self.vocab, self.max_len = address, vocab_size, max_model_len
        self.sent, self.error = 0, None
        self.stop, self.active, self.started = threading.Event(), threading.Event(), threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.lock = threading.Lock()  # a request starts only while active, and pause() sees it
        self.thread = threading.Thread(target=self._run, name="profile-neighbour", daemon=True)

    def _run(self) -> None:
        import grpc

        from services.api.pdserve.v1 import pdserve_pb2 as pb
        from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

        prompt_len, out = NEIGHBOUR_REQUEST
        prompt_len = min(prompt_len, self.max_len - out - 1)
        try:
            with grpc.insecure_channel(self.address) as ch:
                stub = pb_grpc.DecodeStub(ch)
                while True:
                    with self.lock:
                        if self.stop.is_set():
                            return
                        go = self.active.is_set()
                        if go:
                            self.idle.clear()
                            self.started.set()
                    if not go:
                        self.active.wait()  # resume() or __exit__ sets it
                        continue
                    try:
                        prompt = [(self.sent * 7907 + j * 37) % (self.vocab - 10) + 10 for j in range(prompt_len)]
                        sampling = pb.SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
                        for _ in stub.Decode(pb.DecodeRequest(request_id=f"neighbour-{self.sent}",
                                                              prompt_token_ids=prompt, sampling=sampling), timeout=600):
                            pass
                        self.sent += 1
                    finally:
                        self.idle.set()
        except Exception as e:  # noqa: BLE001 - raised in the measuring thread by check()
            self.error = e
            self.started.set()

    def resume(self) -> None:
        """Busy from now: returns once its first request is under way."""
        self.started.clear()
        with self.lock:
            self.active.set()
        self.started.wait(600)
        self.check()

    def pause(self) -> None:
        """Idle from now: returns once its request in flight has finished."""
        with self.lock:
            self.active.clear()
        self.idle.wait(600)
        self.check()

    def __enter__(self) -> "_Neighbour":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.active.set()  # wakes a paused thread to see stop
        self.thread.join(600)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the neighbour instance failed: {type(self.error).__name__}: {self.error}")


class ServePathError(RuntimeError):
    """The served path's measurements contradict the step model or never settle: no figure to trust."""


def engine_step(measured: list[StepPoint], fit: StepCost, batch: int, context: float) -> tuple[float, str]:
    """Seconds of the engine's decode step of `batch` sequences at about `context` tokens each:
    the median of the profile's measured decode-only steps of that batch within NEAR of that
    context, else the step model's; and which it was."""
    near = [p.seconds for p in measured
            if p.tokens == p.seqs == batch and p.attn == 0 and abs(p.kv / batch - 1 - context) <= NEAR * context]
    if near:
        return statistics.median(near), "measured"
    return fit.decode_seconds(batch, round(context)), "fit"


def fit_serve_path(points: list[dict], batch_points: list[dict]) -> tuple[float, float]:
    """(step_s, token_s) such that a served step of `b` sampled tokens costs the engine's step +
    step_s + token_s x b, from the lone requests (b = 1: each's TPOT over its step) and the batches
    (b = its size: the median gap over its step); medians over rounds on each side. A part a
    straight line through the two medians would make negative is 0 and the other part carries
    the whole figure; a side whose served steps run faster than the engine's by more than NOISE
    of its step (or NOISE_S, on a small model's millisecond steps) refutes the measurement
    (ServePathError)."""
    def side(pts: list[dict], served: str) -> tuple[int, float]:
        sizes = {p["batch"] for p in pts}
        if len(sizes) != 1:
            raise ValueError(f"points of one side come from one batch size, got {sorted(sizes)}")
        gap = statistics.median(p[served] - p["step_s"] for p in pts)
        step_s = statistics.median(p["step_s"] for p in pts)
        if gap < -max(NOISE * step_s, NOISE_S):
            raise ServePathError(
                f"served {'batches of ' + str(pts[0]['batch']) if pts[0]['batch'] > 1 else 'lone requests'} "
                f"stepped {-gap * 1e3:.2f} ms faster than the engine's {step_s * 1e3:.2f} ms step "
                f"(more than {NOISE:.0%} and {NOISE_S * 1e3:.1f} ms): the profile's steps do not describe this instance; "
                f"profile again on a quiet machine. Points: {pts}")
        return sizes.pop(), max(0.0, gap)

    one, y1 = side(points, "tpot_s")
    if not batch_points:
        return 0.0, y1
    b, yb = side(batch_points, "gap_s")
    token = (yb - y1) / (b - one)
    if token < 0:  # the batch cost no more than one sequence: all of it is per step
        return (y1 + yb) / 2, 0.0
    fixed = y1 - token * one
    if fixed < 0:  # one sequence cost less than its share of the batch: all of it is per token
        return 0.0, (one * y1 + b * yb) / (one * one + b * b)
    return fixed, token


def charge_router_cpu(cost: ServeCost, offcore: bool, router_elsewhere: bool) -> None:
    """The router's and client's CPU per streamed token over the batches (recorded in
    router_token_s), joins the per-token figure when they ran on cores the profile left idle
    beside the instance (`offcore`: out of its latency, where a fleet filling the host would run
    them on instances' cores), unless the fleet runs them on other hosts. Where they shared the
    instance's cores, they are in its latency already."""
    if not offcore or not cost.batch_points or any(p["router_cpu_s"] is None for p in cost.batch_points):
        return
    # Over all the batches, not a median of each: /proc counts CPU in clock ticks (10 ms), so one
    # batch's router reads 0 or 20 ms on a fast machine; the sum over the rounds averages that out.
    cost.router_token_s = (sum(p["router_cpu_s"] + p["client_cpu_s"] for p in cost.batch_points)
                           / sum(p["tokens"] for p in cost.batch_points))
    if not router_elsewhere:
        cost.offcore_token_s = cost.router_token_s
        cost.token_overhead_s += cost.offcore_token_s


def rounds_settled(batch_points: list[dict], rounds: int, strict: bool = True) -> str | None:
    """After `rounds` rounds of the served batch: None to go on; "" when its gaps settled (their
    median deviation within SETTLED of the median, or SETTLED_S); past MAX_ROUNDS unsettled, a
    ServePathError when strict, else the note saying so (a quick profile is rough by design: it
    keeps the medians rather than fail on a busy machine)."""
    served = [p["gap_s"] for p in batch_points]
    middle = statistics.median(served)
    deviation = statistics.median(abs(g - middle) for g in served)
    spread = deviation / middle
    if rounds >= ROUNDS and (spread <= SETTLED or deviation <= SETTLED_S):
        return ""
    if rounds < MAX_ROUNDS:
        return None
    what = (f"a served batch of {batch_points[0]['batch']} stepped {min(served) * 1e3:.1f}-{max(served) * 1e3:.1f} "
            f"ms a token over {rounds} rounds (median deviation {spread:.0%} of the median, more than "
            f"{SETTLED:.0%} and {SETTLED_S * 1e3:.1f} ms)")
    if strict:
        raise ServePathError(f"{what}: the machine is too busy to measure the served path; profile again on a "
                             f"quiet one, or pass --no-serve-overhead. Batches: {batch_points}")
    return f"{what}: the served path's figures are the medians of unsettled rounds (a quick profile)"


def measure_serve_cost(model: str, step: StepCost, num_threads: int, dtype: str, max_model_len: int,
                       vocab_size: int, device: str = "cpu", tick=lambda: None, batch: int = BATCH,
                       max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                       measured: list[StepPoint] = (), router_elsewhere: bool = False,
                       sustained: tuple[int, ...] = SUSTAINED, strict: bool = True,
                       kv_cache_dtype: str = "auto") -> ServeCost:
    """The served path's costs (module docstring). On CPU the instance takes the first
    `num_threads` cores this process may use and the neighbour the next as many, if there are.
    The instance runs with the profile's engine settings; `measured` are the profile's steps.
    router_elsewhere: the fleet's router and clients run on other hosts (charge_router_cpu).
    sustained: the closed loops' concurrencies (sustained_runs; none: not measured).
    strict: a served batch whose gaps never settle fails the profile (rounds_settled).
    Rounds alternate: requests alone, a
    batch, then beside the busy neighbour, so that the machine's drift over the measurement
    touches every side alike."""
    from bench.workloads import BenchRequest

    def prompt(seed: int, length: int) -> list[int]:
        return [(seed + j * 31) % (vocab_size - 10) + 10 for j in range(length)]

    def fresh(salt: int) -> list:
        """One request of each length, prompts no earlier one sent (a repeat would hit the prefix cache)."""
        out = []
        for i, (prompt_len, out_len) in enumerate(LENGTHS):
            prompt_len = min(prompt_len, max_model_len - out_len - 1)
            out.append(BenchRequest(prompt(i * 7919 + salt * 104729, prompt_len), prompt_len, out_len))
        return out

    batch = max(2, min(batch, max_num_seqs))
    out_len = LENGTHS[0][1]
    # The whole batch's prompts fit one step: they start decoding together.
    batch_prompt = max(1, min(LENGTHS[0][0], max_num_batched_tokens // batch, max_model_len - out_len - 1))

    def fresh_batch(salt: int) -> list:
        return [BenchRequest(prompt(7 + i * 7919 + salt * 104729 + 1_000_003, batch_prompt), batch_prompt, out_len)
                for i in range(batch)]

    def fresh_loop(salt: int, concurrency: int) -> list:
        """A closed loop's requests: short prompts, outputs from half to 1.5x out_len (finishes stagger)."""
        rng = random.Random(salt)
        out = []
        for i in range(concurrency * SUSTAINED_REQUESTS):
            prompt_len = rng.randint(max(1, batch_prompt // 2), batch_prompt)
            n = rng.randint(max(2, out_len // 2), 3 * out_len // 2)
            out.append(BenchRequest(prompt(13 + i * 7919 + salt * 104729 + 2_000_003, prompt_len), prompt_len, n))
        return out

    sustained = sorted({max(2, min(c, max_num_seqs)) for c in sustained})
    cost = ServeCost()
    on_cpu = device.startswith("cpu")
    own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set(own[:num_threads]) if on_cpu and own else None
    spare = sorted(_all_cpus() - cores) if cores else []
    engine_args = ("--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", str(max_num_seqs),
                   "--kv-cache-dtype", kv_cache_dtype)
    with ExitStack() as stack:
        address = _colocated(model, num_threads, dtype, max_model_len, cores, stack, engine_args)
        url, router_pid = _router(model, address, stack)
        _client(url, [BenchRequest([11, 12, 13, 14], 4, 8)])  # warm-up
        neighbour = None
        if not on_cpu:
            cost.neighbour_note = f"not measured on {device}: instances there do not share a device"
        elif len(spare) < num_threads:
            cost.neighbour_note = (f"not measured: {len(spare)} core(s) beside the instance's {num_threads}, "
                                   f"no room for a neighbour as wide")
        else:
            address_n = _colocated(model, num_threads, dtype, max_model_len, set(spare[:num_threads]), stack,
                                   engine_args)
            neighbour = stack.enter_context(_Neighbour(address_n, vocab_size, max_model_len))
        r = 0
        while True:
            reqs = fresh(2 * r)
            alone = _client(url, reqs)
            for req, res in zip(reqs, alone):
                engine, source = engine_step(measured, step, 1, req.prompt_len + req.output_len / 2)
                cost.points.append({"prompt": req.prompt_len, "output": req.output_len, "batch": 1,
                                    "tpot_s": res.tpot, "ttft_s": res.ttft, "step_s": engine, "step_from": source})
            router_cpu = _cpu_seconds(router_pid)
            together, client_cpu = _client_cpu(url, fresh_batch(r), together=True)
            router_cpu = None if router_cpu is None else _cpu_seconds(router_pid) - router_cpu
            # Median gap, not TPOT: a request whose first token came before the last prompt was
            # computed waited through a prefill step once.
            gaps = [g for res in together for g in res.itl]
            engine, source = engine_step(measured, step, batch, batch_prompt + out_len / 2)
            cost.batch_points.append({"prompt": batch_prompt, "output": out_len, "batch": batch,
                                      "gap_s": statistics.median(gaps),
                                      "tpot_s": statistics.median(res.tpot for res in together),
                                      "step_s": engine, "step_from": source,
                                      "tokens": sum(res.output_len for res in together),
                                      "router_cpu_s": router_cpu, "client_cpu_s": client_cpu})
            if neighbour is not None:
                reqs = fresh(2 * r + 1)
                neighbour.resume()
                busy = _client(url, reqs)
                neighbour.pause()
                for req, a, b in zip(reqs, alone, busy):
                    cost.neighbour_points.append({"prompt": req.prompt_len, "output": req.output_len,
                                                  "tpot_alone_s": a.tpot, "tpot_busy_s": b.tpot,
                                                  "ttft_alone_s": a.ttft, "ttft_busy_s": b.ttft})
            tick()
            r += 1
            unsettled = rounds_settled(cost.batch_points, r, strict)
            if unsettled is not None:
                if unsettled:
                    logger.warning("%s", unsettled)
                cost.unsettled = unsettled
                break
        for i, concurrency in enumerate(sustained):
            loop = fresh_loop(i, concurrency)
            sent = _closed_loop(url, loop, concurrency)
            cost.sustained_runs.append({"concurrency": concurrency, "requests": [
                [round(at, 6), res.prompt_len, res.output_len, res.tpot] for at, res in sent]})
            tick()
    cost.step_overhead_s, cost.token_overhead_s = fit_serve_path(cost.points, cost.batch_points)
    charge_router_cpu(cost, bool(spare), router_elsewhere)
    if cost.neighbour_points:
        cost.neighbour_decode = statistics.median(p["tpot_busy_s"] / p["tpot_alone_s"] for p in cost.neighbour_points)
        long_prompt = max(p["prompt"] for p in cost.neighbour_points)
        cost.neighbour_prefill = statistics.median(p["ttft_busy_s"] / p["ttft_alone_s"]
                                                   for p in cost.neighbour_points if p["prompt"] == long_prompt)
    return cost
