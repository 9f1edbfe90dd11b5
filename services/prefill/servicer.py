"""The Prefill gRPC service: the prompt's first token, and a KV handle when a decode continues."""
from __future__ import annotations

import time
import uuid

from services import convert
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.common.engine_host import EngineHost
from services.common.grpc_server import FailedPrecondition


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, host: EngineHost, publishes_kv: bool) -> None:
        self.host = host
        self.publishes_kv = publishes_kv  # False: started with --kv-transport none

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        host = self.host
        params = convert.sampling_from_proto(request.sampling)
        prompt = host.prompt(request.prompt_token_ids)
        if request.publish_kv and not self.publishes_kv:
            raise FailedPrecondition("this prefill instance has no KV transport: send publish_kv=false")
        rid = request.request_id or uuid.uuid4().hex
        start = time.monotonic()
        # The request runs with its real parameters and stops after its first token: the engine
        # decides whether that token ends it, and publishes the KV only when it does not.
        final = None
        async for out in host.engine.generate(prompt, params, request_id=rid, priority=request.priority,
                                              prefill_only=True, publish_kv=request.publish_kv):
            final = out
        c = final.outputs[0]
        host.raise_if_aborted(c, rid)
        token = c.token_ids[0]
        host.observe_first_token(start, final.queue_time)
        finish = c.finish_reason or ""
        host.count_tokens(len(prompt), 1)
        if finish:  # else the request goes on, on a decode instance
            host.observe_finished(start, finish)
        response = pb.PrefillResponse(first_token_id=token, num_cached_tokens=final.num_cached_tokens,
                                      kv_handle=final.kv_handle or b"", finish_reason=finish,
                                      stop_reason="" if c.stop_reason is None else str(c.stop_reason),
                                      engine_id=host.engine_id)
        if params.logprobs is not None:
            response.first_logprob.CopyFrom(convert.token_logprob(token, c.logprobs[0]))
        if final.prompt_logprobs is not None:
            response.prompt_logprobs.extend(convert.prompt_token_logprobs(prompt, final))
        return response
