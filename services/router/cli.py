"""`pdserve router`: flags (each with a PDSERVE_ROUTER_* environment variable) and the process main."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal

from engine.config import parse_lora_modules
from services.common.auth import ChannelAuth
from services.common.flags import add
from services.router.config import RouterConfig, parse_addresses
from services.router.cors import CorsPolicy
from services.router.discovery import pod_namespace
from services.router.policy import OVERLAP_WEIGHT
from services.router.reasoning import PARSERS as REASONING_PARSERS
from services.router.tls import FrontTls
from services.router.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)
ENV_PREFIX = "PDSERVE_ROUTER_"


def _flag(p: argparse.ArgumentParser, flag: str, help: str, **kwargs) -> None:
    add(p, flag, env_prefix=ENV_PREFIX, help=help, **kwargs)


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _json_object(text: str) -> dict:
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _json_list(text: str) -> list:
    value = _json(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("must be a JSON array of strings")
    return value


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router", help="OpenAI-compatible HTTP gateway + gRPC Generate front over prefill/decode instances",
        description="Routes each request to a prefill and a decode instance (or, with --decode only, to "
                    "colocated instances) and streams the result back over HTTP (OpenAI API) and gRPC.")
    _flag(p, "--model", "checkpoint directory whose tokenizer, chat template and config the router uses, "
          "or 'tiny' (the built-in tiny model)", default="tiny")
    _flag(p, "--served-model-name", "the model name(s) clients send and /v1/models lists (default: --model); "
          "several (space- or comma-separated) are all served, answers carrying the first (vLLM's rule)",
          nargs="+")
    _flag(p, "--host", "address the HTTP and gRPC fronts listen on", default="0.0.0.0")
    _flag(p, "--port", "HTTP port (0: any free port)", default=8000, type=int)
    _flag(p, "--grpc-port", "gRPC Generate port (0: any free port; -1: no gRPC front)", default=50050,
          type=int)
    _flag(p, "--prefill", "prefill instances, host:port[,host:port...] (static discovery)", default="")
    _flag(p, "--decode", "decode instances, host:port[,...] (static discovery); with no --prefill they are "
          "colocated instances that compute prompts themselves", default="")
    _flag(p, "--discovery", "where the instances come from: the --prefill/--decode lists (static), the DNS "
          "records of headless Services (dns), or their EndpointSlices through the Kubernetes API "
          "(kubernetes: follows pods as they come and go; needs get/list/watch on endpointslices)",
          default="static", choices=["static", "dns", "kubernetes"])
    _flag(p, "--prefill-service", "dns/kubernetes: the prefill pods' headless Service, NAME[:PORT] "
          "(PORT overrides --service-port); none: colocated mode", default="")
    _flag(p, "--decode-service", "dns/kubernetes: the decode (or colocated) pods' headless Service, NAME[:PORT]",
          default="")
    _flag(p, "--discovery-namespace", "dns/kubernetes: the Services' namespace (default: the pod's own; "
          "else kubernetes uses 'default' and dns the resolver's search path)")
    _flag(p, "--service-port", "dns/kubernetes: the instances' gRPC port, a number or (kubernetes) the "
          "port's name in the EndpointSlices", default="grpc")
    _flag(p, "--discovery-interval", "dns: seconds between resolutions of the Services' names",
          default=5.0, type=float)
    _flag(p, "--kubeconfig", "kubernetes: a kubeconfig file to use outside a pod (default: the pod's "
          "service account, else ~/.kube/config)")
    _flag(p, "--kube-api-url", "kubernetes: an API server URL to talk to without credentials "
          "(kubectl proxy, tests)")
    _flag(p, "--policy", "routing policy: kv_aware (least cost: tokens left to prefill after the instance's "
          "cached prefix, from the engines' KV events, plus its load), least_load, round_robin; auto: "
          "kv_aware where the instances publish KV events (--kv-events-config), else round_robin",
          default="auto", choices=["auto", "kv_aware", "least_load", "round_robin"])
    _flag(p, "--kv-overlap-score-weight", "kv_aware: weight of the prompt tokens left to prefill against the "
          "instance's load in tokens (2: a prefix computed again costs its tokens twice, as this request's "
          "compute and as load ahead of the instance's later requests, and a second copy in a cache)",
          default=OVERLAP_WEIGHT, type=float)
    _flag(p, "--router-temperature", "kv_aware: softmax temperature over the normalised costs (0: the least "
          "cost, ties rotate)", default=0.0, type=float)
    _flag(p, "--kv-low-confidence-weight", "kv_aware: weight of cached blocks an instance reported before "
          "an event gap that replay could not fill", default=0.5, type=float)
    _flag(p, "--pd-policy", "disaggregated mode: always (every prompt on a prefill instance), never (decode "
          "instances compute their prompts), conditional (the decode computes when few prompt tokens are "
          "uncached there, or the prefill pool is queueing while it has room); auto: conditional where the "
          "decode instances publish KV events, else always", default="auto",
          choices=["auto", "conditional", "always", "never"])
    _flag(p, "--max-local-prefill-length", "conditional: a decode instance computes a prompt itself when at "
          "most this many of its tokens are not in its prefix cache", default=512, type=int)
    _flag(p, "--max-prefill-queue-tokens", "conditional: above this many tokens queued on the least queued "
          "prefill instance (its outstanding tokens beyond one step's budget), a decode instance with room "
          "computes the prompt (default: the prompt's own uncached tokens times 1 + the requests decoding on "
          "that decode: computing it there stalls each of them for as long as the prompt takes)", type=int)
    _flag(p, "--api-key", "require 'Authorization: Bearer KEY' (or x-api-key) on /v1/* and on gRPC Generate; "
          "several keys (vLLM's flag takes several: rotate one while the other serves) are any of them; "
          "PDSERVE_API_KEY works too, comma-separated", nargs="+", default=os.environ.get("PDSERVE_API_KEY"))
    _flag(p, "--max-model-len", "context length limit (default: the smallest any instance reports, "
          "else the checkpoint's max_position_embeddings)", type=int)
    _flag(p, "--generation-config", "where requests' sampling defaults come from (vLLM's flag): auto (the "
          "model's generation_config.json: its temperature, top_p, top_k, min_p, penalties and max_new_tokens "
          "apply to requests that do not set them), vllm (none: OpenAI's defaults), or a folder holding a "
          "generation_config.json", default="auto")
    _flag(p, "--override-generation-config", "JSON object of sampling defaults on top of --generation-config's, "
          "e.g. '{\"temperature\": 0.5}' (vLLM's flag)", type=_json_object)
    _flag(p, "--request-timeout", "seconds a request may take from arrival to its last token",
          default=600.0, type=float)
    _flag(p, "--prefill-timeout", "seconds one prefill attempt may take before it is retried elsewhere",
          default=60.0, type=float)
    _flag(p, "--max-attempts", "instances tried per request: prefill, and decode before its first token",
          default=3, type=int)
    _flag(p, "--migration-limit", "times one request may move to another decode instance when its "
          "decode is lost mid-stream (the new one continues from the prompt plus the tokens already "
          "sent); 0: never, the client gets an error", default=3, type=int)
    _flag(p, "--health-check-interval", "seconds between grpc.health.v1 checks of every instance",
          default=2.0, type=float)
    _flag(p, "--load-poll-interval", "seconds between GetLoad polls (least_load policy)",
          default=0.5, type=float)
    _flag(p, "--drain-timeout", "seconds SIGTERM waits for in-flight requests", default=30.0, type=float)
    _flag(p, "--max-concurrent-requests", "generation requests in flight (HTTP and gRPC); beyond it 429 "
          "with Retry-After", default=1024, type=int)
    _flag(p, "--max-prompts-per-request", "items in a completions prompt array; beyond it 400",
          default=256, type=int)
    _flag(p, "--max-concurrent-prompts", "of one request's prompts, how many run upstream at once",
          default=16, type=int)
    _flag(p, "--max-payload-size", "bytes of a request body (HTTP; beyond it 413) or message (gRPC)",
          default=8 << 20, type=int)
    _flag(p, "--max-stop-sequences", "stop strings per request; beyond it 400", default=64, type=int)
    _flag(p, "--max-n", "n and best_of of one request (each sample is an engine request; prompts x best_of "
          "counts against --max-prompts-per-request too); beyond it 400", default=16, type=int)
    _flag(p, "--lora-modules", "the engines' LoRA adapters (vLLM's flag, as the engines got it): name=path or "
          "JSON {\"name\": ..., \"path\": ...}; a request's model naming one runs with it, /v1/models lists "
          "them (the environment variable whitespace-separated)", nargs="+", default=None)
    _flag(p, "--allow-runtime-lora-updating", "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
          "(vLLM's, which VLLM_ALLOW_RUNTIME_LORA_UPDATING=true turns on too): an adapter loads on every engine "
          "(each started with LoRA on) and becomes a model name; engines that join later get it too",
          action="store_true")
    _flag(p, "--lora-resolver-dir", "vLLM's filesystem LoRA resolver (VLLM_LORA_RESOLVER_CACHE_DIR works too): a "
          "request whose model the router does not serve loads <dir>/<model> (a PEFT folder on the engines' "
          "filesystem) as a LoRA adapter on every engine first; needs --allow-runtime-lora-updating", default=None)
    _flag(p, "--lora-resolver-max-loras", "adapters --lora-resolver-dir keeps loaded; one more unloads the one "
          "whose last request began longest ago (after its running requests)", default=32, type=int)
    _flag(p, "--max-logprobs", "vLLM's flag: the top-n logprobs a request may ask for per token (logprobs, "
          "top_logprobs, prompt_logprobs; a request's -1 is the whole vocabulary); beyond it 400. -1: no cap "
          "(the whole vocabulary per token: large answers)", default=20, type=int)
    _flag(p, "--non-streaming-interval", "tokens per upstream message for a request the client does not "
          "stream: the engine holds its tokens back to this many a message "
          "(each message costs the router and the engine's service CPU; vLLM sends such output once, at the "
          "end). A decode lost mid-request then loses up to this many - 1 tokens the new one recomputes; "
          "1: a message every step", default=64, type=int)
    _flag(p, "--reasoning-parser", "a thinking model's <think>...</think> text goes to the chat message's "
          "`reasoning` field, the rest to `content` (vLLM's flag): deepseek_r1, minimax_m2, glm45 or kimi_k2 "
          "(the output starts in reasoning), qwen3 or deepseek_v3 (V3.1 and later: it thinks when it or its "
          "template opens <think>)", choices=list(REASONING_PARSERS))
    _flag(p, "--reasoning-end-str", "what the engine forces when a request's thinking budget "
          "(thinking_token_budget, or Messages' thinking.budget_tokens) is spent, ending with </think> "
          "(vLLM's reasoning_end_str), e.g. \"Time is up, so I answer now.</think>\"; default: </think> alone")
    _flag(p, "--responses-store-size", "keep the last N /v1/responses answers sent with store (the default) "
          "in this router's memory, to continue with previous_response_id and read back with GET "
          "/v1/responses/{id}; 0 (the default, as vLLM's): none kept, previous_response_id is a 404",
          default=0, type=int)
    _flag(p, "--enable-auto-tool-choice", "serve tool_choice \"auto\" (the default when a request has tools), "
          "read by --tool-call-parser (vLLM's flag; on here by default, so vLLM command lines work as they are); "
          "--no-enable-auto-tool-choice answers it with 400, as vLLM does without the flag",
          action=argparse.BooleanOptionalAction, default=True)
    _flag(p, "--tool-call-parser", "how an answer to tools with tool_choice auto is read into tool calls "
          "(vLLM's flag): hermes (<tool_call>{...}</tool_call> blocks: Hermes, Qwen), llama3_json (an answer that "
          "is JSON {\"name\", \"parameters\"} objects: Llama 3.1-3.3), pythonic (an answer that is a "
          "Python list of calls: Llama 3.2, Llama 4), mistral ([TOOL_CALLS]name[ARGS]{...}: Mistral, "
          "Ministral, Devstral), qwen3_coder (<function=NAME><parameter=KEY>: Qwen3-Coder, Qwen3.5), glm45 "
          "(<arg_key>/<arg_value>: GLM-4.5 to 4.7), deepseek_v3 / deepseek_v31 (DeepSeek-V3 and R1-0528 / "
          "V3.1 and later) or kimi_k2 (Kimi K2)", choices=list(TOOL_CALL_PARSERS), default="hermes")
    _flag(p, "--chat-template", "the chat template for every chat request, in place of the model's (vLLM's "
          "flag): a Jinja file, or the template itself (text with {, } or a newline); for a base model "
          "without one, or another tool-calling format")
    _flag(p, "--allowed-origins", "origins a browser may call the gateway from, a JSON array (vLLM's flag), "
          "e.g. '[\"https://chat.example.com\"]' or '[\"*\"]'; none by default", type=_json_list, default=[])
    _flag(p, "--allowed-methods", "HTTP methods allowed from those origins, a JSON array", type=_json_list,
          default=["*"])
    _flag(p, "--allowed-headers", "request headers allowed from those origins, a JSON array", type=_json_list,
          default=["*"])
    _flag(p, "--allow-credentials", "allow cookies and HTTP authentication from those origins", action="store_true")
    _flag(p, "--ssl-certfile", "serve HTTPS (and gRPC over TLS) with this PEM certificate chain (vLLM's flag)")
    _flag(p, "--ssl-keyfile", "the TLS private key (PEM)")
    _flag(p, "--ssl-ca-certs", "CA bundle (PEM) client certificates are checked against")
    _flag(p, "--ssl-cert-reqs", "client certificates (vLLM's flag): 0 not asked for, 1 optional, 2 required",
          type=int, default=0)
    _flag(p, "--trust-request-chat-template", "honour a chat template sent with a request (chat_template, "
          "chat_template_kwargs.chat_template); without it such requests get 400", action="store_true")
    _flag(p, "--engine-auth-token", "the engines' bearer token, sent on every call to them (PDSERVE_AUTH_TOKEN "
          "works too; prefer it or --engine-auth-token-file to the flag)", default=os.environ.get("PDSERVE_AUTH_TOKEN"))
    _flag(p, "--engine-auth-token-file", "a file holding the engines' token (e.g. a mounted Secret)")
    _flag(p, "--engine-ssl-ca-certs", "CA bundle (PEM) to verify the engines' certificates: TLS to the engines")
    _flag(p, "--engine-ssl-certfile", "the router's client certificate (PEM), for engines that demand one")
    _flag(p, "--engine-ssl-keyfile", "the client certificate's private key (PEM)")
    _flag(p, "--engine-ssl-server-name", "the name the engines' certificate holds (they are dialled by "
          "address; default: the address's host)")
    p.set_defaults(func=run_router)
    return p


def served_names(args) -> tuple[str, ...]:
    """--served-model-name's names (a list from the flag, a string from its environment variable)."""
    given = args.served_model_name or [args.model]
    names = [n for item in ([given] if isinstance(given, str) else given) for n in item.replace(",", " ").split()]
    return tuple(dict.fromkeys(names)) or (args.model,)


def config_from_args(args) -> RouterConfig:
    return RouterConfig(
        model=args.model, served_model_name=served_names(args)[0], served_model_aliases=served_names(args)[1:],
        prefill=parse_addresses(args.prefill), decode=parse_addresses(args.decode), host=args.host,
        port=args.port, grpc_port=args.grpc_port, policy=args.policy,
        api_key=(tuple(args.api_key) if isinstance(args.api_key, list) else args.api_key) or None,
        kv_overlap_score_weight=args.kv_overlap_score_weight, router_temperature=args.router_temperature,
        kv_low_confidence_weight=args.kv_low_confidence_weight, pd_policy=args.pd_policy,
        max_local_prefill_length=args.max_local_prefill_length,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        max_model_len=args.max_model_len, request_timeout_s=args.request_timeout,
        generation_config=args.generation_config, override_generation_config=args.override_generation_config,
        prefill_timeout_s=args.prefill_timeout, max_attempts=args.max_attempts,
        migration_limit=args.migration_limit,
        health_check_interval_s=args.health_check_interval, load_poll_interval_s=args.load_poll_interval,
        drain_timeout_s=args.drain_timeout, discovery=args.discovery, prefill_service=args.prefill_service,
        decode_service=args.decode_service, namespace=args.discovery_namespace or pod_namespace(),
        service_port=args.service_port, discovery_interval_s=args.discovery_interval,
        kubeconfig=args.kubeconfig, kube_api_url=args.kube_api_url,
        max_concurrent_requests=args.max_concurrent_requests, max_prompts_per_request=args.max_prompts_per_request,
        max_concurrent_prompts=args.max_concurrent_prompts, max_payload_size=args.max_payload_size,
        max_stop_sequences=args.max_stop_sequences, trust_request_chat_template=args.trust_request_chat_template,
        chat_template=args.chat_template,
        tls=FrontTls.from_flags(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs),
        cors=CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                        args.allow_credentials),
        max_n=args.max_n, max_logprobs=args.max_logprobs, lora_modules=parse_lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating or os.environ.get(
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes", "on"),
        lora_resolver_dir=args.lora_resolver_dir or os.environ.get("VLLM_LORA_RESOLVER_CACHE_DIR") or None,
        lora_resolver_max_loras=args.lora_resolver_max_loras,
        non_streaming_interval=args.non_streaming_interval,
        responses_store_size=args.responses_store_size,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_end_str=args.reasoning_end_str,
        engine_auth=ChannelAuth.from_flags(args.engine_auth_token, args.engine_auth_token_file,
                                           args.engine_ssl_ca_certs, args.engine_ssl_certfile,
                                           args.engine_ssl_keyfile, args.engine_ssl_server_name))


async def serve(config: RouterConfig) -> int:
    from services.router.server import Router

    router = Router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await router.start()
    await stop.wait()
    logger.info("router received a stop signal")
    await router.stop()
    return 0


def run_router(args) -> int:
    return asyncio.run(serve(config_from_args(args)))
