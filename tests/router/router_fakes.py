"""Fake prefill/decode engines: the generated servicers (Prefill or Decode, and Engine) on
127.0.0.1 (grpc.aio) over a toy model.

The toy model is a fixed function of the tokens so far, so a test knows every answer. In-process
fakes share a KV registry (decode "pulls" what prefill pinned); run as a script, a fake serves in
its own process (to be killed with SIGKILL) and prints its port.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

FIRST_ORDINARY = 6  # the tiny tokenizer's special tokens are 0..5
VOCAB = 977
EOS = 1


def next_token(ids: list[int]) -> int:
    return FIRST_ORDINARY + (sum(ids[-3:]) * 31 + len(ids) * 7) % (VOCAB - FIRST_ORDINARY)


def toy_logprob(token_id: int, k: int, prompt: bool = False) -> pb.TokenLogprob:
    """As the engines send it: the token's own logprob, then the other top-k tokens (here the
    token is always the most likely, so k - 1 others); a prompt token's rank (1, here)."""
    lp = -((token_id % 7) + 1) / 8
    return pb.TokenLogprob(token_id=token_id, logprob=lp, rank=1 if prompt else 0,
                           top=[pb.TopLogprob(token_id=(token_id + j) % VOCAB, logprob=lp - j) for j in range(1, k)])


def toy_generate(prompt: list[int], n: int, stop_token_ids=()) -> tuple[list[int], str]:
    """What the fakes produce: n tokens (or up to a stop token id) and the finish reason."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        tok = next_token(ids)
        ids.append(tok)
        out.append(tok)
        if tok in stop_token_ids:
            return out, "stop"
    return out, "length"


def fake_pairing(model: str = "tiny", block_size: int = 16, dtype: str = "float32", kv_heads: int = 2,
                 tp: int = 1, transport: str = "tcp", num_layers: int = 2) -> pb.PairingDescriptor:
    """The pairing descriptor a real engine of this shape reports (the model fingerprint stands for
    the checkpoint's: one per model name)."""
    from kvtransfer import KVLayout

    layout = KVLayout(num_layers, kv_heads, 16, block_size, dtype=dtype)
    return pb.PairingDescriptor(model_name=model, model_fingerprint=f"fp-{model}",
                                kv_layout_fingerprint=layout.fingerprint, kv_block_size=block_size,
                                kv_dtype=dtype, total_kv_heads=kv_heads, tensor_parallel_size=tp,
                                kv_transport=transport)


TINY_PAIRING = fake_pairing()  # what every fake reports unless told otherwise


def client_ids(request_ids) -> list[str]:
    """The client's request ids behind the engines' keys (the router appends a unique suffix)."""
    return [rid.rsplit(".", 1)[0] for rid in request_ids]


class KVRegistry:
    """What in-process prefill fakes pinned, so a fake decode can pull it."""

    def __init__(self) -> None:
        self.pinned: dict[bytes, "FakeEngine"] = {}


def first_token_finish(first: int, s: pb.SamplingParams, num_prompt: int, max_model_len: int,
                       eos_token_id: int) -> tuple[str, str]:
    """(finish_reason, stop_reason) of a prefill's first token, decided as an engine does: with the
    request's real parameters; ("", "") when a decode continues."""
    if not s.min_tokens:
        if first in s.stop_token_ids:
            return "stop", str(first)
        if first == eos_token_id and not s.ignore_eos:
            return "stop", ""
    if s.max_tokens == 1 or num_prompt + 1 >= max_model_len:
        return "length", ""
    return "", ""


class FakeEngine(pb_grpc.PrefillServicer, pb_grpc.DecodeServicer, pb_grpc.EngineServicer):
    """`eos_token_id`: the EOS the prefill side honours on the first token (the toy model never
    produces the default one; a test sets it to a token it knows comes first)."""

    def __init__(self, role: str, registry: KVRegistry | None = None, *, name: str = "",
                 prefill_delay: float = 0.0, token_delay: float = 0.0, fail: grpc.StatusCode | None = None,
                 fail_times: int = 0, max_model_len: int = 2048, eos_token_id: int = EOS,
                 pairing: pb.PairingDescriptor | None = TINY_PAIRING, script: list[int] | None = None) -> None:
        self.role = role
        self.script = script  # set: every request generates these tokens (stop at their end), not the toy model's
        self.pairing = pairing  # what GetLoad reports; None: none (an engine older than the router)
        self.load_unavailable = False  # GetLoad fails (UNAVAILABLE) while set
        self.load_requests = 0  # GetLoad calls answered or refused
        self.eos_token_id = eos_token_id
        self.name = name or role
        self.registry = registry or KVRegistry()
        self.prefill_delay = prefill_delay
        self.token_delay = token_delay
        self.fail, self.fail_times = fail, fail_times
        self.max_model_len = max_model_len
        self.requests: list = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []
        self.pulled: list[str] = []
        self.recomputed: list[str] = []
        self.running: set[str] = set()
        self.gate: asyncio.Event | None = None  # when set up, prefill waits for it
        self.lora_enabled = True  # --enable-lora: LoadLoRAAdapter works (FAILED_PRECONDITION when not)
        self.lora_adapters: dict[str, str] = {}  # loaded at run time; a path under /bad does not load
        self.lora_folders: set[str] | None = None  # set: the only paths that hold an adapter
        self.lora_busy = 0  # the next loads answer ABORTED (the name's previous adapter still finishing)
        self.lora_answer_lost = False  # a load is done but its caller hears DEADLINE_EXCEEDED

    @contextlib.contextmanager
    def _in_flight(self, rid: str):
        self.running.add(rid)
        try:
            yield
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running.discard(rid)

    async def _maybe_fail(self, context) -> None:
        if self.fail is not None and self.fail_times != 0:
            self.fail_times -= 1
            await context.abort(self.fail, f"{self.name} was told to fail")

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        self.requests.append(request)
        await self._maybe_fail(context)
        rid = request.request_id
        with self._in_flight(rid):
            if self.gate is not None:
                await self.gate.wait()
            if self.prefill_delay:
                await asyncio.sleep(self.prefill_delay)
        s = request.sampling
        prompt = list(request.prompt_token_ids)
        first = next_token(prompt) if self.script is None else self.script[0]
        resp = pb.PrefillResponse(first_token_id=first, engine_id=self.name)
        if s.HasField("logprobs"):
            resp.first_logprob.CopyFrom(toy_logprob(first, s.logprobs))
        if s.HasField("prompt_logprobs"):
            resp.prompt_logprobs.extend(toy_logprob(t, s.prompt_logprobs, prompt=True) for t in prompt[1:])
        resp.finish_reason, resp.stop_reason = first_token_finish(first, s, len(prompt), self.max_model_len,
                                                                  self.eos_token_id)
        if not resp.finish_reason and request.publish_kv:
            resp.kv_handle = f"{self.name}:{rid}".encode()
            self.registry.pinned[resp.kv_handle] = self
        return resp

    async def Decode(self, request: pb.DecodeRequest, context):
        self.requests.append(request)
        await self._maybe_fail(context)
        rid = request.request_id
        s = request.sampling
        prompt = list(request.prompt_token_ids)
        if request.HasField("first_token_id"):
            owner = self.registry.pinned.pop(request.kv_handle, None)
            (self.pulled if owner is not None else self.recomputed).append(rid)
            tokens, budget = prompt + [request.first_token_id], s.max_tokens - 1
            prompt_logprobs = []
        else:
            tokens, budget = prompt, s.max_tokens
            prompt_logprobs = ([toy_logprob(t, s.prompt_logprobs, prompt=True) for t in prompt[1:]]
                               if s.HasField("prompt_logprobs") else [])
        if self.script is None:
            out, finish = toy_generate(tokens, budget, tuple(s.stop_token_ids))
        else:
            done = len(tokens) - len(prompt)
            out = self.script[done:done + budget]
            finish = "length" if done + budget <= len(self.script) else "stop"
        with self._in_flight(rid):
            for i, tok in enumerate(out):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                msg = pb.DecodeResponse(token_ids=[tok])
                if s.HasField("logprobs"):
                    msg.logprobs.append(toy_logprob(tok, s.logprobs))
                if i == 0:
                    msg.prompt_logprobs.extend(prompt_logprobs)
                if i == len(out) - 1:
                    msg.finish_reason = finish
                    if finish == "stop":
                        msg.stop_reason = str(tok)
                yield msg

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        self.aborts.append(request.request_id)
        handle = f"{self.name}:{request.request_id}".encode()
        return pb.AbortResponse(found=self.registry.pinned.pop(handle, None) is not None)

    async def GetLoad(self, request, context) -> pb.LoadReport:
        self.load_requests += 1
        if self.load_unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} has no load report yet")
        return pb.LoadReport(engine_id=self.name, role=self.role, num_running=len(self.running),
                             outstanding_tokens=100 * len(self.running), max_model_len=self.max_model_len,
                             pairing=self.pairing, lora_enabled=self.lora_enabled,
                             lora_adapters=[pb.LoRAAdapter(name=n, path=p) for n, p in self.lora_adapters.items()])

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context) -> pb.LoRAAdapterResponse:
        """The real engine's statuses (services.common.engine_host)."""
        if not self.lora_enabled:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is not enabled on this engine")
        if self.lora_busy:
            self.lora_busy -= 1
            await context.abort(grpc.StatusCode.ABORTED, f"LoRA adapter {request.lora_name!r} still has requests")
        if self.lora_adapters.get(request.lora_name) == request.lora_path:
            return pb.LoRAAdapterResponse(loaded=False)
        if request.lora_name in self.lora_adapters:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter {request.lora_name!r} is already loaded")
        if request.lora_path.startswith("/bad") or (self.lora_folders is not None
                                                    and request.lora_path not in self.lora_folders):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{request.lora_path}: no adapter_config.json")
        self.lora_adapters[request.lora_name] = request.lora_path
        if self.lora_answer_lost:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return pb.LoRAAdapterResponse(loaded=True)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context) -> pb.LoRAAdapterResponse:
        if self.lora_adapters.pop(request.lora_name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r} is not loaded")
        return pb.LoRAAdapterResponse()


class _CallLog(grpc.aio.ServerInterceptor):
    """Records the full method name of every call, so tests can tell which service answered."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def intercept_service(self, continuation, handler_call_details):
        self.calls.append(handler_call_details.method)
        return await continuation(handler_call_details)


class FakeServer:
    """Serves what a real engine instance of the role serves: Prefill or Decode, and Engine."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.calls: list[str] = []  # "/pdserve.v1.Engine/Abort", ...
        self.health = HealthServicer()
        self.server = grpc.aio.server(interceptors=[_CallLog(self.calls)])
        if engine.role == "prefill":
            pb_grpc.add_PrefillServicer_to_server(engine, self.server)
        else:
            pb_grpc.add_DecodeServicer_to_server(engine, self.server)
        pb_grpc.add_EngineServicer_to_server(engine, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def start(self) -> "FakeServer":
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    async def set_serving(self, serving: bool) -> None:
        states = health_pb2.HealthCheckResponse
        await self.health.set("", states.SERVING if serving else states.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)


async def start_fake(role: str, registry: KVRegistry | None = None, **kwargs) -> FakeServer:
    return await FakeServer(FakeEngine(role, registry, **kwargs)).start()


@contextlib.contextmanager
def fake_process(role: str, *flags: str):
    """A fake engine in a process of its own (to be killed with SIGKILL); yields (process, address)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role, *flags],
                            stdout=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        yield proc, f"127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.kill()
        proc.wait(10)


async def _serve_forever(args) -> None:
    server = await start_fake(args.role, prefill_delay=args.prefill_delay, token_delay=args.token_delay)
    print(f"PORT {server.port}", flush=True)
    await server.server.wait_for_termination()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--prefill-delay", type=float, default=0.0)
    p.add_argument("--token-delay", type=float, default=0.0)
    asyncio.run(_serve_forever(p.parse_args()))
    sys.exit(0)
