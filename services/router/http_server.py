"""The HTTP gateway: routes, API-key auth, OpenAI-style errors, /v1/models, /health, /metrics."""
from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from services.router.cors import is_preflight
from services.router.errors import ModelNotFound, RouterError, bad_request, key_matches
from services.router.generation import REQUEST_ID
from services.router.messages_api import MessagesServing, count_tokens, parse_messages
from services.router.messages_api import error_body as anthropic_error_body
from services.router.openai_protocol import detokenize, parse_chat, parse_completion, tokenize
from services.router.openai_serving import ADMISSION_SLOT, CLIENT_CLOSED, STREAM_STATUS, OpenAIServing
from services.router.responses import ResponsesServing
from services.router.sampling import RequestLimits
from services.version import version

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


# Paths the API key guards: the API, not the probes and /metrics.
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/invocations")
ANTHROPIC = "/v1/messages"  # Anthropic's Messages API: its errors in Anthropic's shape


def error_response(e: RouterError, headers: dict | None = None, anthropic: bool = False) -> web.Response:
    """OpenAI's error body, or Anthropic's on its Messages API."""
    if e.retry_after_s is not None:
        headers = {**(headers or {}), "Retry-After": str(e.retry_after_s)}
    body = anthropic_error_body(e) if anthropic else e.body()
    return web.Response(status=e.status, body=_encode(body), content_type="application/json", headers=headers)


class HttpGateway:
    def __init__(self, router) -> None:
        self.router = router
        self.model = router.model
        self.metrics = router.metrics
        self.serving = OpenAIServing(router.generator, router.model, router.config.max_concurrent_prompts)
        self.responses_serving = ResponsesServing(router.generator, router.model, router.config.responses_store_size)
        router.responses_serving = self.responses_serving  # the router drains its background responses
        self.messages_serving = MessagesServing(router.generator, router.model)
        self.admission = router.admission
        self.limits = RequestLimits.from_config(router.config)
        self.max_body_bytes = router.config.max_payload_size
        self._api_keys = router.config.api_keys
        self.cors = router.config.cors

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.max_body_bytes)
        app.on_response_prepare.append(self._cors_headers)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel_response)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/v1/models/{model}", self.model_card)
        app.router.add_get("/health", self.health)
        # Kubernetes probes: /livez fails only if this process stops answering (a restart would help);
        # /readyz, like /health, fails while no engine can be reached (a restart would not).
        app.router.add_get("/livez", self.livez)
        app.router.add_get("/readyz", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/version", self.version)
        # SageMaker's container contract (as vLLM serves it): /ping is the health check, and
        # /invocations takes a chat or completions body.
        app.router.add_get("/ping", self.health)
        app.router.add_post("/ping", self.health)
        app.router.add_post("/invocations", self.invocations)
        return app

    def _authorized(self, request: web.Request) -> bool:
        """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`."""
        if not self._api_keys or not request.path.startswith(PROTECTED):
            return True
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and key_matches(token, self._api_keys):
            return True
        return key_matches(request.headers.get("x-api-key", ""), self._api_keys)

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        self.cors.decorate(request, response)  # streamed answers too: this runs as headers go out

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        status = 500
        if is_preflight(request):  # before the API key: browsers send none on a preflight
            response = self.cors.preflight(request)
            self.metrics.requests.labels(endpoint, str(response.status)).inc()
            return response
        try:
            if not self._authorized(request):
                raise RouterError(401, "Incorrect API key provided.", code="invalid_api_key")
            try:
                response = await handler(request)
            except ModelNotFound as e:  # --lora-resolver-dir: maybe an adapter to load first
                if request.method != "POST" or not await self.router.lora.resolve(e.name):
                    raise
                response = await handler(request)
            status = request.get(STREAM_STATUS, response.status)
            return response
        except RouterError as e:
            status = e.status
            self.admission.shed(e)
            return error_response(e, anthropic=request.path.startswith(ANTHROPIC))
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            status = e.status
            return error_response(RouterError(e.status, e.text if e.status != 413 else
                                              f"request body over {self.max_body_bytes} bytes "
                                              "(--max-payload-size)"),
                                  headers={"Allow": e.headers["Allow"]} if "Allow" in e.headers else None,
                                  anthropic=request.path.startswith(ANTHROPIC))
        except asyncio.CancelledError:  # aiohttp cancels the handler when its client disconnects
            status = CLIENT_CLOSED
            self.metrics.client_aborts.inc()
            logger.info("client of %s %s disconnected; request aborted", request.method, request.path)
            raise
        except Exception:
            logger.exception("unexpected error serving %s %s", request.method, request.path)
            return error_response(RouterError(500, "internal server error", type="server_error"),
                                  anthropic=request.path.startswith(ANTHROPIC))
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    @staticmethod
    def _decode_json(raw: bytes):
        try:
            return _decode(raw)
        except msgspec.DecodeError as e:
            raise bad_request(f"malformed JSON body: {e}") from None

    @classmethod
    def _parse(cls, raw: bytes, parse, model, limits: RequestLimits):
        """Decoding, templating and tokenizing (on a worker thread unless the body is small)."""
        return parse(cls._decode_json(raw), model, limits)

    def _request_id(self, request: web.Request, kind: str) -> str:
        given = request.headers.get("X-Request-Id", "")
        return given if REQUEST_ID.match(given) else self.router.generator.new_request_id(kind)

    async def _serve(self, request: web.Request, parse, prefix: str, chat: bool, respond=None) -> web.StreamResponse:
        with self.admission.admit() as slot:
            request[ADMISSION_SLOT] = slot  # a background response takes it over
            raw = await request.read()
            parsed = await self.admission.run(len(raw), self._parse, raw, parse, self.model, self.limits)
            self.router.dispatcher.check_available()
            request_id = self._request_id(request, prefix)
            headers = {"X-Request-Id": request_id}
            if parsed.ignored_fields:
                # As vLLM, a warning that names them; the client sees how many, never their text
                # (a header carrying client text could split the response).
                logger.warning("request %s: ignored unknown fields: %.500s", request_id,
                               ", ".join(map(repr, parsed.ignored_fields)))
                headers["X-Ignored-Fields-Count"] = str(len(parsed.ignored_fields))
            if respond is not None:
                return await respond(request, parsed, request_id, headers)
            return await self.serving.respond(request, parsed, request_id, chat, headers)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion, "cmpl", chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat, "chatcmpl", chat=True)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self.responses_serving.parse, "resp", chat=True,
                                 respond=self.responses_serving.respond)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_messages, "msg", chat=True, respond=self.messages_serving.respond)

    async def count_tokens(self, request: web.Request) -> web.Response:
        return await self._answer(request, lambda body: count_tokens(body, self.model, self.limits))

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """The response; ?stream=true&starting_after=N replays a background stream's events."""
        response_id = request.match_info["response_id"]
        stream = request.query.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise bad_request("stream must be true or false", "stream")
        if stream == "false":
            return self._json_response(self.responses_serving.stored(response_id))
        after = request.query.get("starting_after")
        if after is not None:
            try:
                after = int(after)
            except ValueError:
                raise bad_request("starting_after must be an integer (a sequence_number)", "starting_after") from None
        return await self.responses_serving.replay(request, response_id, after, {"X-Request-Id": response_id})

    async def delete_response(self, request: web.Request) -> web.Response:
        return self._json_response(await self.responses_serving.delete(request.match_info["response_id"]))

    async def cancel_response(self, request: web.Request) -> web.Response:
        return self._json_response(await self.responses_serving.cancel(request.match_info["response_id"]))

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """A chat body (`messages`) goes to chat completions, a completions body (`prompt`) to completions."""
        body = self._decode_json(await request.read())  # aiohttp keeps the body for the handler's read
        if isinstance(body, dict) and "messages" in body:
            return await self.chat_completions(request)
        if isinstance(body, dict) and "prompt" in body:
            return await self.completions(request)
        raise bad_request("/invocations takes a chat completions body (messages) or a completions body (prompt)")

    async def _answer(self, request: web.Request, fn) -> web.Response:
        """fn(body) as JSON, decoded and run on a worker thread unless the body is small."""
        raw = await request.read()
        return self._json_response(await self.admission.run(len(raw), lambda: fn(self._decode_json(raw))))

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, lambda body: tokenize(body, self.model, self.limits))

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, lambda body: detokenize(body, self.model))

    def _card(self, name: str) -> dict:
        """A served name's card; a LoRA adapter's as vLLM writes it: its path as root, the base
        model's name as parent."""
        m = self.model
        adapter = name in m.lora_modules
        return {"id": name, "object": "model", "created": m.created, "owned_by": "pdserve",
                "root": m.lora_modules[name] if adapter else m.path, "parent": m.name if adapter else None,
                "max_model_len": m.max_model_len, "permission": []}

    @staticmethod
    def _json_response(obj) -> web.Response:
        return web.Response(body=_encode(obj), content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        names = (*self.model.names, *self.model.lora_modules)
        return self._json_response({"object": "list", "data": [self._card(n) for n in names]})

    async def _lora_body(self, request: web.Request) -> dict:
        if not self.router.config.allow_runtime_lora_updating:
            raise RouterError(404, f"{request.path} is off: start the router with --allow-runtime-lora-updating "
                              "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) to load and unload LoRA adapters at run "
                              "time", code="not_found")
        body = self._decode_json(await request.read())
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's: {"lora_name", "lora_path"} -> loaded on every engine; its answer's text."""
        body = await self._lora_body(request)
        name = body.get("lora_name")
        await self.router.lora.load(name, body.get("lora_path"))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._lora_body(request)
        name = body.get("lora_name")
        await self.router.lora.unload(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self.model.require_name(name)
        return self._json_response(self._card(name))

    async def version(self, request: web.Request) -> web.Response:
        return self._json_response({"version": version()})

    async def livez(self, request: web.Request) -> web.Response:
        return self._json_response({"status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        if self.router.draining:
            raise RouterError(503, "the router is shutting down", code="draining")
        self.router.dispatcher.check_available()
        body = {"status": "ok"}
        refused = self.router.pool.pairs.incompatible()
        if refused:  # ready through the other pairs; these are never chosen
            body["incompatible_pairs"] = refused
        return self._json_response(body)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": self.metrics.CONTENT_TYPE})
