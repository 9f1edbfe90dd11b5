"""The public gRPC Generate service: the same flow as the HTTP gateway, streamed as GenerateResponse."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from engine.request import InvalidRequestError

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.convert import DEFAULT_MAX_TOKENS, NEUTRAL, sampling_kwargs, thinking_from_proto
from services.router.errors import RouterError, bad_request, key_matches
from services.router.generation import REQUEST_ID
from services.router.sampling import PreparedPrompt, RequestLimits, bad_words_token_ids, logprobs_count, prepare
from services.router.structured_outputs import check as check_structured_outputs

logger = logging.getLogger(__name__)
ENDPOINT = "/pdserve.v1.Generate/Generate"


class GenerateService(pb_grpc.GenerateServicer):
    def __init__(self, router) -> None:
        self.router = router
        self.model = router.model
        self.metrics = router.metrics
        self.admission = router.admission
        self.limits = RequestLimits.from_config(router.config)
        self._api_keys = router.config.api_keys

    def _check_auth(self, context) -> None:
        if not self._api_keys:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token, self._api_keys):
            raise RouterError(401, "missing or incorrect API key (metadata authorization: Bearer <key>)")

    def _prepare(self, request: pb.GenerateRequest) -> PreparedPrompt:
        if request.model:
            self.model.require_name(request.model)
        if request.request_id and not REQUEST_ID.match(request.request_id):
            raise bad_request("request_id must be 1-128 characters of [A-Za-z0-9._:-]", "request_id")
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids, text = self.model.encode_prompt(request.text, "text"), request.text
        elif kind == "token_ids":
            ids, text = list(request.token_ids.ids), None
        else:
            raise bad_request("a prompt is required: text or token_ids", "prompt")
        s = request.sampling
        if s.HasField("prompt_logprobs"):  # GenerateResponse has no place for them
            raise bad_request("prompt_logprobs is not available through Generate; use /v1/completions "
                              "with echo and logprobs", "prompt_logprobs")
        if s.HasField("thinking_budget"):
            try:
                thinking_from_proto(s.thinking_budget)
            except InvalidRequestError as e:
                raise bad_request(str(e), "thinking_budget") from None
        try:
            knobs = sampling_kwargs(s)
        except InvalidRequestError as e:  # a malformed structured_outputs
            raise bad_request(str(e), "structured_outputs") from None
        # The model's sampling defaults (--generation-config) where the request leaves a field
        # unset, as the HTTP APIs apply them; max_tokens keeps its 16, as completions do.
        knobs.update({k: v for k, v in self.model.sampling_defaults.items()
                      if k in NEUTRAL and not s.HasField(k)})
        if knobs["logprobs"] is not None:
            knobs["logprobs"] = logprobs_count(knobs["logprobs"], self.model, self.limits, "logprobs")
        if knobs["structured_outputs"] is not None:
            check_structured_outputs(knobs["structured_outputs"], "structured_outputs")
        if s.bad_words:  # text: tokenized here, as the HTTP gateway does
            knobs["bad_words_token_ids"] += bad_words_token_ids(self.model, list(s.bad_words))
        knobs["lora_name"] = self.model.lora_of(request.model or None)
        max_tokens = knobs.pop("max_tokens")
        return prepare(self.model, ids, knobs, max_tokens=max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS,
                       limits=self.limits, text=text, priority=request.priority)

    async def Generate(self, request: pb.GenerateRequest, context):
        status = 500
        try:
            self._check_auth(context)
            m = self.model
            if request.model and request.model not in m.names and request.model not in m.lora_modules:
                await self.router.lora.resolve(request.model)  # --lora-resolver-dir: an adapter to load first?
            with self.admission.admit():
                prompt = await self.admission.run(request.ByteSize(), self._prepare, request)
                self.router.dispatcher.check_available()
                request_id = request.request_id or self.router.generator.new_request_id("gen")
                num_tokens, num_cached = 0, None
                chunks = self.router.generator.stream(request_id, prompt)
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        num_tokens += len(chunk.token_ids)
                        if num_cached is None:  # the prefill side's count, on the first chunk
                            num_cached = chunk.num_cached_tokens
                        out = pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids,
                                                  logprobs=chunk.logprobs, request_id=request_id)
                        if chunk.finish_reason is not None:
                            out.finish_reason = chunk.finish_reason
                            out.usage.CopyFrom(pb.Usage(prompt_tokens=len(prompt.token_ids),
                                                        completion_tokens=num_tokens,
                                                        cached_tokens=num_cached))
                        yield out
            status = 200
        except RouterError as e:
            status = e.status
            self.admission.shed(e)
            await context.abort(e.grpc_code, e.message)
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled or its deadline passed: grpc.aio cancels this generator where
            # it waits for the next chunk, or closes it (GeneratorExit at the yield) where the cancel
            # finds it held up sending one (a client reading slowly, HTTP/2 flow control).
            status = 499
            self.metrics.client_aborts.inc()
            logger.info("Generate client went away; request aborted")
            raise
        finally:
            self.metrics.requests.labels(ENDPOINT, str(status)).inc()
