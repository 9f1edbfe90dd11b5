"""The Decode gRPC service: continue a request (from a prefill's KV handle, or from its prompt) and
stream its tokens."""
from __future__ import annotations

import time
import uuid

from engine.request import InvalidRequestError
from services import convert
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.common.engine_host import EngineHost
from services.common.grpc_server import FailedPrecondition
from services.common.metrics import observe_per_token

# Sent as the stream's headers once the engine has taken the request: the router holds the
# prefill's first token back until then, so a request every decode refuses is still a clean 429
# rather than a stream that broke after its first token.
ADMITTED = (("pdserve-admitted", "1"),)


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, host: EngineHost, pulls_kv: bool) -> None:
        self.host = host
        self.pulls_kv = pulls_kv  # False: colocated, or a decode started without a transport

    def _disaggregation(self, request: pb.DecodeRequest) -> dict:
        if not request.HasField("first_token_id"):
            if request.kv_handle:
                raise InvalidRequestError("kv_handle needs first_token_id")
            return {}
        if request.kv_handle and not self.pulls_kv:
            raise FailedPrecondition(f"this {self.host.role} instance cannot pull KV: send no kv_handle")
        return {"first_token_id": request.first_token_id, "remote_kv": request.kv_handle or None}

    async def Decode(self, request: pb.DecodeRequest, context):
        host = self.host
        params = convert.sampling_from_proto(request.sampling)
        prompt = host.prompt(request.prompt_token_ids)
        disagg = self._disaggregation(request)
        rid = request.request_id or uuid.uuid4().hex
        start = last = time.monotonic()
        num_generated = 1 if disagg else 0  # the prefill's first token counts as generated
        first = True
        async for out in host.engine.generate(prompt, params, request_id=rid, priority=request.priority,
                                              admitted=lambda: context.send_initial_metadata(ADMITTED), **disagg):
            c = out.outputs[0]
            host.raise_if_aborted(c, rid)
            now = time.monotonic()
            if first:
                host.observe_first_token(start, out.queue_time)
            else:
                observe_per_token(host.metrics.itl, now - last, len(c.token_ids))
            last = now
            response = pb.DecodeResponse(token_ids=c.token_ids, finish_reason=c.finish_reason or "",
                                         num_cached_tokens=out.num_cached_tokens)
            if c.stop_reason is not None and c.finish_reason == "stop":
                response.stop_reason = str(c.stop_reason)
            if c.logprobs:
                response.logprobs.extend(convert.token_logprob(t, e) for t, e in zip(c.token_ids, c.logprobs))
            if first and out.prompt_logprobs is not None:
                response.prompt_logprobs.extend(convert.prompt_token_logprobs(prompt, out))
            first = False
            num_generated += len(c.token_ids)
            if out.finished:
                host.count_tokens(0 if disagg.get("remote_kv") else len(prompt), num_generated)
                host.observe_finished(start, c.finish_reason)
            yield response
