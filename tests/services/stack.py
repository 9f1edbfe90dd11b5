"""A real pdserve stack for the end-to-end tests: prefill and decode processes over one KV transport,
a router process in front, stopped with exit code 0; its counters say what each request cost."""
from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import time

from service_procs import SECRET, LoggedProcess, Service, free_port, metric, poll_until

SERVED_MODEL = "tiny"
# Small KV caches: a dozen engines may share the machine, and 1024 blocks of 16 tokens hold every
# test's load (64 concurrent streams on two decodes).
NUM_BLOCKS = "1024"


@dataclasses.dataclass(frozen=True)
class StackSpec:
    transport: str = "tcp"
    prefills: int = 1
    decodes: int = 1
    router: bool = True
    prefill_args: tuple[str, ...] = ()  # e.g. ("--tensor-parallel-size", "2")
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()  # e.g. ("--reasoning-parser", "deepseek_r1")
    decode_secret: str = SECRET  # another one fails every handle's check: every prompt recomputed

    @classmethod
    def shared(cls, transport: str) -> "StackSpec":
        """The session's stack for a transport; tcp's has two instances per role, so requests are
        routed across instances and pulls cross prefill/decode pairs."""
        n = 2 if transport == "tcp" else 1
        return cls(transport, prefills=n, decodes=n)


class RouterProcess(LoggedProcess):
    """`pdserve router` (HTTP and gRPC fronts) over static lists of instances."""

    def __init__(self, model: str, prefills: list[str], decodes: list[str], args: tuple[str, ...] = ()) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "services.cli", "router", "--model", model, "--served-model-name",
                SERVED_MODEL, "--host", "127.0.0.1", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
                "--prefill", ",".join(prefills), "--decode", ",".join(decodes), "--policy", "round_robin",
                "--health-check-interval", "0.2", *args]
        super().__init__(f"router-{self.port}", argv, dict(os.environ))

    def metric(self, name: str, labels: dict | None = None) -> float:
        return metric(self.port, name, labels)

    def wait_ready(self, num_instances: int, timeout: float = 120) -> None:
        """Until the router's health checks find every instance SERVING (/health wants only one per role)."""
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.output()}")
            try:
                return self.metric("pdserve:router_instance_healthy") == num_instances
            except OSError:
                return False

        if not poll_until(ready, timeout, interval=0.2):
            raise TimeoutError(f"{self.name} does not see {num_instances} healthy instances:\n{self.output()}")


def idle(report) -> bool:
    return (report.num_running == 0 and report.num_waiting == 0 and report.num_pinned_blocks == 0
            and report.kv_cache_usage == 0.0)


class Stack:
    """Prefill and decode engines over one transport, and a router when the spec asks for one.
    Shared by the session's tests: each counts deltas and leaves it idle."""

    def __init__(self, model: str, spec: StackSpec) -> None:
        self.spec = spec
        kv = ("--kv-transport", spec.transport, "--num-blocks", NUM_BLOCKS)
        # Prompts past the prefill's 64-token budget are chunked there.
        self.prefills = [Service("prefill", model, *kv, "--max-num-batched-tokens", "64", *spec.prefill_args)
                         for _ in range(spec.prefills)]
        self.decodes = [Service("decode", model, *kv, *spec.decode_args, secret=spec.decode_secret)
                        for _ in range(spec.decodes)]
        self.router = (RouterProcess(model, [s.address for s in self.prefills], [s.address for s in self.decodes],
                                     spec.router_args)
                       if spec.router else None)
        self.killed: list[LoggedProcess] = []  # by a fault test: neither watched nor asked for exit code 0
        try:
            for s in self.engines:
                s.wait_ready()
            if self.router:
                self.router.wait_ready(len(self.engines))
        except BaseException:
            self.stop()
            raise

    @property
    def engines(self) -> list[Service]:
        return [*self.prefills, *self.decodes]

    def live(self, services: list[Service]) -> list[Service]:
        return [s for s in services if s not in self.killed]

    def kill(self, process: LoggedProcess) -> None:
        """SIGKILL, as a crash would; the rest of the stack carries on without it."""
        self.killed.append(process)
        process.kill()

    @property
    def processes(self) -> list[LoggedProcess]:
        return [*self.engines, *([self.router] if self.router else [])]

    def service_logs(self) -> str:
        return "\n".join(f"--- {p.name} log ---\n{p.output()}" for p in self.processes)

    # -- state and counters ---------------------------------------------------------------------

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request runs or waits anywhere and no KV block is pinned or in use: what every
        test must leave behind (the default 30 s lease outlives the wait, so a block a decode fails
        to give back fails it)."""
        reports: dict = {}

        def quiet() -> bool:
            reports.update((s.name, s.load()) for s in self.live(self.engines))
            routing = self.router.metric("pdserve:router_requests_running") if self.router else 0
            return routing == 0 and all(idle(r) for r in reports.values())

        assert poll_until(quiet, timeout), f"requests or KV left behind after {timeout}s: {reports}"

    def kv_counts(self) -> dict[str, float]:
        """KV handles published (prefills); transfers (pulls finished, or remote KV given back unread
        because every block was cached here) and prompts recomputed (decodes)."""
        prefills, decodes = self.live(self.prefills), self.live(self.decodes)
        return {"published": sum(s.metric("pdserve:kv_published_requests_total") for s in prefills),
                "transfers": sum(s.metric("pdserve:kv_transfers_total") + s.metric("pdserve:kv_released_unpulled_total")
                                 for s in decodes),
                "recomputed": sum(s.metric("pdserve:kv_recomputed_fallbacks_total") for s in decodes)}

    def kv_delta(self, before: dict[str, float], want: dict[str, float], timeout: float = 10) -> dict[str, float]:
        """The counts since `before`, read once each has reached `want` (or after `timeout`): engine
        counters reach GetLoad and /metrics in snapshots each engine core publishes every ~50 ms,
        later on a loaded machine."""
        delta: dict = {}

        def reached() -> bool:
            delta.update((k, v - before[k]) for k, v in self.kv_counts().items())
            return all(delta[k] >= v for k, v in want.items())

        poll_until(reached, timeout)
        return delta

    @contextlib.contextmanager
    def one_transfer_per_request(self, num_requests: int):
        """Around requests of which `num_requests` go on from a prefill to a decode: each had its KV
        published once and pulled once, none was recomputed, nothing is left behind. Deltas from an
        idle stack, so what earlier tests sent does not count. (A prompt whose blocks were all in
        the decode's prefix cache has its remote KV released unpulled: that counts as its transfer.)"""
        self.wait_idle()
        before = self.kv_counts()
        yield
        want = {"published": num_requests, "transfers": num_requests, "recomputed": 0}
        # Counts first: an idle report read after them is one taken after these requests, not before.
        self.kv_delta(before, want)
        self.wait_idle()
        assert self.kv_delta(before, want) == want

    # -- the router's fronts --------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.router.grpc_port}"

    def post(self, path: str, body: dict, timeout: float = 60.0):
        """-> (status, parsed JSON or raw bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.router.port, timeout=timeout)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, json.loads(data) if "json" in resp.getheader("Content-Type", "") else data
        finally:
            conn.close()

    # -- stopping -------------------------------------------------------------------------------

    def stop(self, timeout: float = 60) -> dict[str, int]:
        """SIGTERM to every process at once (they drain in parallel); name -> exit code, SIGKILL
        for any still running after `timeout`."""
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for p in self.processes:
            try:
                codes[p.name] = p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[p.name] = p.proc.returncode
        return codes

    def close(self) -> None:
        codes = self.stop()
        killed = {p.name for p in self.killed}
        assert all(c == 0 for name, c in codes.items() if name not in killed), \
            f"exit codes {codes}\n{self.service_logs()}"

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """For a test's own stack: its logs on failure, a clean stop otherwise."""
        if exc_type is None:
            self.close()
        else:
            print(self.service_logs())
            self.stop()


# Prompts a stack answers as the offline engine does (serving_as_offline): one within a block, one of
# four blocks (past a small sliding window).
PARITY_PROMPTS = [[17, 230, 41, 99, 5, 300, 41, 99, 12, 400, 73], list(range(40, 90))]
PARITY_TOKENS = 12


@contextlib.contextmanager
def serving_as_offline(model: str, spec: StackSpec | None = None):
    """A stack of `model` whose greedy completions of PARITY_PROMPTS are token-exact against the
    offline engine's on the same checkpoint, each decoded over KV pulled from the prefill; yields
    (stack, an OpenAI client of it, the offline answers) for a test's further checks."""
    import openai

    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model).generate(PARITY_PROMPTS, params)]
    with Stack(model, spec or StackSpec()) as stack, \
            openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for prompt, tokens in zip(PARITY_PROMPTS, want):
            out = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=PARITY_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].model_extra["token_ids"] == tokens
        # The prefill's KV was used (the engines' counters are snapshots published every ~50 ms).
        assert poll_until(lambda: stack.decodes[0].metric("pdserve:kv_transfers_total") >= len(PARITY_PROMPTS), 10)
        yield stack, client, want


class Stacks:
    """The session's shared stacks by spec: each starts on first use and runs until stopped."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.running: dict[StackSpec, Stack] = {}

    def get(self, spec: StackSpec) -> Stack:
        if spec not in self.running:
            self.running[spec] = Stack(self.model, spec)
        return self.running[spec]

    def stop(self, spec: StackSpec) -> None:
        self.running.pop(spec).close()

    def stop_all(self) -> None:
        failures = []
        for spec in list(self.running):
            try:
                self.stop(spec)
            except AssertionError as e:
                failures.append(str(e))
        assert not failures, "\n".join(failures)
