"""gRPC server around an AsyncEngine in the prefill, decode or colocated role."""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import grpc

from engine.async_engine import AsyncEngine
from engine.request import InvalidRequestError, SamplingParams
from engine.scheduler import check_stop
from services import convert
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.common.grpc_server import FailedPrecondition, GrpcService
from services.metrics import ServiceMetrics

logger = logging.getLogger("pdserve.engine_server")
ROLES = ("prefill", "decode", "colocated")


class EngineServicer(pb_grpc.PrefillServicer, pb_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, role: str, engine_id: str, metrics: ServiceMetrics) -> None:
        self.engine, self.role, self.engine_id, self.metrics = engine, role, engine_id, metrics

    def _prompt(self, ids) -> list[int]:
        prompt = list(ids)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids is empty")
        return prompt

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if self.role == "decode":
            raise FailedPrecondition("this is a decode instance: send Prefill to a prefill instance")
        params = convert.sampling_from_proto(request.sampling)
        publish = request.publish_kv
        if publish and self.role != "prefill":
            raise FailedPrecondition("a colocated instance does not publish KV: send publish_kv=false")
        prompt = self._prompt(request.prompt_token_ids)
        first_params = SamplingParams(
            max_tokens=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            min_p=params.min_p, seed=params.seed, ignore_eos=True, logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs)
        rid = request.request_id or uuid.uuid4().hex
        start = time.monotonic()
        final = None
        async for out in self.engine.generate(prompt, first_params, request_id=rid, publish_kv=publish):
            final = out
        if final.outputs[0].finish_reason == "abort":
            raise InvalidRequestError(f"request rejected by the engine: {final.outputs[0].stop_reason}")
        token = final.outputs[0].token_ids[0]
        status, _ = check_stop(params, 1, token, self.engine.processor.eos_token_id,
                               len(prompt) + 1, self.engine.max_model_len)
        finish = status.finish_reason if status is not None else ""
        if finish and final.kv_handle:
            self.engine.abort(rid)  # no decode will pull: free the pinned blocks now
        self._observe(start, final, len(prompt), 1, finished=bool(finish), reason=finish)
        response = pb.PrefillResponse(first_token_id=token, num_cached_tokens=final.num_cached_tokens,
                                      kv_handle=b"" if finish else (final.kv_handle or b""),
                                      finish_reason=finish, engine_id=self.engine_id)
        if params.logprobs is not None:
            response.first_logprob.CopyFrom(convert.token_logprob(token, final.outputs[0].logprobs[0]))
        if final.prompt_logprobs is not None:
            response.prompt_logprobs.extend(convert.token_logprob(t, e)
                                            for t, e in zip(prompt[1:], final.prompt_logprobs))
        return response

    async def Decode(self, request: pb.DecodeRequest, context):
        if self.role == "prefill":
            raise FailedPrecondition("this is a prefill instance: send Decode to a decode instance")
        params = convert.sampling_from_proto(request.sampling)
        prompt = self._prompt(request.prompt_token_ids)
        disagg = {}
        if request.HasField("first_token_id"):
            disagg["first_token_id"] = request.first_token_id
            if request.kv_handle:
                if self.role != "decode":
                    raise FailedPrecondition("a colocated instance cannot pull KV: send no kv_handle")
                disagg["remote_kv"] = request.kv_handle
        elif request.kv_handle:
            raise InvalidRequestError("kv_handle needs first_token_id")
        rid = request.request_id or uuid.uuid4().hex
        start = last = time.monotonic()
        n = 1 if "first_token_id" in disagg else 0
        first = True
        async for out in self.engine.generate(prompt, params, request_id=rid, **disagg):
            c = out.outputs[0]
            now = time.monotonic()
            if first:
                self.metrics.ttft.observe(now - start)
                if out.queue_time is not None:
                    self.metrics.queue.observe(out.queue_time)
            else:
                self.metrics.itl.observe(now - last)
            last = now
            ids = out.delta_token_ids
            response = pb.DecodeResponse(token_ids=ids, finish_reason=c.finish_reason or "",
                                         num_cached_tokens=out.num_cached_tokens)
            if c.stop_reason is not None and c.finish_reason == "stop":
                response.stop_reason = str(c.stop_reason)
            if params.logprobs is not None and c.logprobs:
                response.logprobs.extend(convert.token_logprob(t, e)
                                         for t, e in zip(ids, c.logprobs[len(c.logprobs) - len(ids):]))
            if first and out.prompt_logprobs is not None:
                response.prompt_logprobs.extend(convert.token_logprob(t, e)
                                                for t, e in zip(prompt[1:], out.prompt_logprobs))
            first = False
            n += len(ids)
            if out.finished:
                self._observe(start, out, len(prompt) if "remote_kv" not in disagg else 0, n,
                              finished=True, reason=c.finish_reason, ttft=False)
            yield response

    def _observe(self, start: float, out, prompt_tokens: int, gen_tokens: int, finished: bool,
                 reason: str, ttft: bool = True) -> None:
        if ttft:
            self.metrics.ttft.observe(time.monotonic() - start)
            if out.queue_time is not None:
                self.metrics.queue.observe(out.queue_time)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(gen_tokens)
        if finished:
            self.metrics.e2e.observe(time.monotonic() - start)
            self.metrics.finished(reason)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = request.request_id in self.engine.streams
        self.engine.abort(request.request_id)  # also frees pinned (published, unpulled) KV
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> pb.LoadReport:
        return convert.load_report(self.engine.stats(), self.engine_id, self.role,
                                   self.engine.config.cache.block_size, self.engine.max_model_len)


async def serve(args) -> int:
    """Run one engine service until SIGTERM; returns the exit code."""
    from services.kv_connector import KVConnectorFactory

    role = args.role
    engine_id = args.engine_id or f"{role}-{os.getpid()}"
    factory = None
    if role in ("prefill", "decode") and args.kv_transport != "none":
        if not args.kv_secret:
            raise SystemExit("error: --kv-secret (or PDSERVE_KV_SECRET) is required for prefill/decode")
        factory = KVConnectorFactory(args.kv_transport, role, args.kv_secret.encode(), engine_id,
                                     host=args.kv_host, port=args.kv_port, lease_ttl_s=args.kv_lease_ttl,
                                     timeout_s=args.kv_timeout)
    engine_kwargs = dict(dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
                         num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         enable_prefix_caching=not args.no_prefix_caching,
                         enable_chunked_prefill=not args.no_chunked_prefill, policy=args.scheduling_policy,
                         num_threads=args.num_threads, kernel_backend=args.kernel_backend,
                         kv_cache_memory_bytes=int(args.kv_cache_memory_gb * (1 << 30)))
    logger.info("starting %s %s on %s:%d (model %s)", role, engine_id, args.host, args.port, args.model)
    engine = await AsyncEngine.create(args.model, multiprocess=not args.inproc, detokenize=False,
                                      kv_transfer_factory=factory, **engine_kwargs)
    model_name = args.served_model_name or os.path.basename(os.path.normpath(engine.config.model.path))
    metrics = ServiceMetrics(engine.stats, model_name, role, engine_id)
    servicer = EngineServicer(engine, role, engine_id, metrics)

    def add(server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillServicer_to_server(servicer, server)
        pb_grpc.add_DecodeServicer_to_server(servicer, server)

    names = [pb.DESCRIPTOR.services_by_name["Prefill"].full_name,
             pb.DESCRIPTOR.services_by_name["Decode"].full_name]
    service = GrpcService(args.host, args.port, names, add, args.drain_timeout)
    await service.start()
    service.install_signal_handlers()
    if args.metrics_port:
        metrics.serve(args.host, args.metrics_port)
        logger.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    # Warm up: one real request through the whole engine before reporting SERVING.
    async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)):
        pass
    await service.set_serving(True)
    logger.info("%s %s ready: gRPC on %s:%d", role, engine_id, args.host, service.port)
    await service.wait_for_stop()
    logger.info("%s %s draining (up to %.0fs)", role, engine_id, args.drain_timeout)
    await service.drain()
    await engine.shutdown()
    logger.info("%s %s stopped", role, engine_id)
    return 0


def add_engine_parsers(sub) -> None:
    """`pdserve prefill|decode|colocated`: every flag has a PDSERVE_* env var equivalent."""
    from services.common.flags import add

    docs = {"prefill": "serve prefills: compute prompts' KV, publish it for decode instances",
            "decode": "serve decodes: pull KV from prefill instances, continue with continuous batching",
            "colocated": "one engine that does both (the baseline, and the path for short prompts)"}
    for role in ROLES:
        p = sub.add_parser(role, help=docs[role], description=docs[role])
        p.set_defaults(role=role, func=lambda a: asyncio.run(serve(a)))
        add(p, "--model", default="tiny", help="checkpoint directory, or 'tiny' (built-in random Llama)")
        add(p, "--served-model-name", default=None, help="model name in metrics (default: directory name)")
        add(p, "--host", default="127.0.0.1", help="address for gRPC and metrics")
        add(p, "--port", type=int, default={"prefill": 50051, "decode": 50061, "colocated": 50071}[role],
            help="gRPC port")
        add(p, "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
        add(p, "--engine-id", default=None, help="instance name (default: role-pid)")
        add(p, "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
        add(p, "--inproc", action="store_true", help="run the engine core in a thread, not its own process")
        if role != "colocated":
            add(p, "--kv-transport", default="tcp", choices=["tcp", "shm", "ucx", "nccl", "none"],
                help="KV transfer transport")
            add(p, "--kv-secret", default=None, help="secret shared by the deployment to sign KV handles")
            add(p, "--kv-host", default="127.0.0.1", help="prefill: address KV pulls connect to")
            add(p, "--kv-port", type=int, default=0, help="prefill: KV transfer port (0: any free port)")
            add(p, "--kv-lease-ttl", type=float, default=30.0, help="prefill: seconds a published KV stays pinned")
            add(p, "--kv-timeout", type=float, default=30.0, help="decode: deadline of one KV pull, seconds")
        else:
            p.set_defaults(kv_transport="none", kv_secret=None, kv_host="127.0.0.1", kv_port=0,
                           kv_lease_ttl=30.0, kv_timeout=30.0)
        add(p, "--dtype", default="float32", choices=["float32", "float16", "bfloat16", "auto"], help="model dtype")
        add(p, "--max-model-len", type=int, default=None, help="context length (default: the model's)")
        add(p, "--block-size", type=int, default=16, help="tokens per KV block")
        add(p, "--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-gb)")
        add(p, "--kv-cache-memory-gb", type=float, default=1.0, help="KV cache size when --num-blocks is unset")
        add(p, "--max-num-seqs", type=int, default=256, help="most requests in the running batch")
        add(p, "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
        add(p, "--no-prefix-caching", action="store_true", help="disable the prefix cache")
        add(p, "--no-chunked-prefill", action="store_true", help="disable chunked prefill")
        add(p, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"], help="queue order")
        add(p, "--num-threads", type=int, default=None, help="torch threads of the engine core")
        add(p, "--kernel-backend", default="auto", choices=["auto", "torch", "reference", "triton"],
            help="attention kernels")
