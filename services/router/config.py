"""The router's frozen config, built once from the command line."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.auth import ChannelAuth
from services.router.cors import CorsPolicy
from services.router.policy import OVERLAP_WEIGHT
from services.router.tls import FrontTls


def parse_addresses(value: str | list | tuple | None) -> tuple[str, ...]:
    """'h1:p1,h2:p2' (or a list of such strings) -> ('h1:p1', 'h2:p2'); checks each has a port."""
    if not value:
        return ()
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    out = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"instance address must be host:port, got {part!r}")
        if part not in out:
            out.append(part)
    return tuple(out)


def parse_service(value: str, default_port: str) -> tuple[str, str]:
    """'name[:port]' -> (name, port); the port is a number or a port name, default `default_port`."""
    name, sep, port = value.strip().partition(":")
    port = port if sep else default_port
    if not name or not port or (port.isdigit() and not 0 < int(port) < 65536):
        raise ValueError(f"a discovered Service must be name[:port], got {value!r}")
    return name, port


def split_api_keys(value) -> tuple[str, ...]:
    """--api-key's keys: the flag's list, or its environment variable's comma-separated string."""
    keys = value.split(",") if isinstance(value, str) else (value or ())
    return tuple(k.strip() for k in keys if k.strip())


@dataclass(frozen=True)
class RouterConfig:
    model: str  # checkpoint directory: the tokenizer, chat template and config.json come from it
    served_model_name: str
    decode: tuple[str, ...] = ()  # static discovery
    prefill: tuple[str, ...] = ()  # empty (and no prefill_service): colocated mode
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50050  # < 0: no gRPC front
    policy: str = "auto"  # auto: kv_aware where the instances publish KV events, else round_robin
    kv_overlap_score_weight: float = OVERLAP_WEIGHT  # kv_aware: weight of the tokens left to prefill against load
    router_temperature: float = 0.0  # kv_aware: softmax temperature over normalised costs; 0: least cost
    kv_low_confidence_weight: float = 0.5  # KV index entries older than an unreplayed gap count this much
    pd_policy: str = "auto"  # auto | always | never | conditional (disaggregated mode only)
    max_local_prefill_length: int = 512  # conditional: uncached prompt tokens a decode computes itself
    # conditional: prefill queue beyond which a decode with room computes; None: the prompt's own
    # uncached tokens (it would wait at the prefill longer than its compute takes)
    max_prefill_queue_tokens: int | None = None
    # The API keys clients may send (vLLM's --api-key takes several: rotate one while the other
    # serves); a string may hold several, comma-separated (the environment variable's form).
    api_key: str | tuple[str, ...] | None = None
    max_model_len: int | None = None  # None: what the instances report, else config.json
    request_timeout_s: float = 600.0
    prefill_timeout_s: float = 60.0
    max_attempts: int = 3
    migration_limit: int = 3  # times one request may move to another decode mid-stream; 0: never
    health_check_interval_s: float = 2.0
    load_poll_interval_s: float = 0.5
    drain_timeout_s: float = 30.0
    discovery: str = "static"  # static (the flags above) | dns | kubernetes (the Services below)
    prefill_service: str = ""  # name[:port]; empty: colocated mode
    decode_service: str = ""
    namespace: str | None = None  # None: not known (kubernetes: "default"; dns: the resolver's search path)
    service_port: str = "grpc"  # a port number, or (kubernetes) the port's name in the EndpointSlices
    discovery_interval_s: float = 5.0  # dns: seconds between resolutions
    kubeconfig: str | None = None  # kubernetes: None = in-cluster config, else ~/.kube/config
    kube_api_url: str | None = None  # kubernetes: an unauthenticated API server (kubectl proxy, tests)
    # Hostile input: caps on what the router takes in (429 beyond the first, 400/413 beyond the others).
    max_concurrent_requests: int = 1024  # generation requests in flight, HTTP and gRPC together
    max_prompts_per_request: int = 256  # items of a completions prompt array
    max_concurrent_prompts: int = 16  # of one request's prompts, upstream at once
    max_payload_size: int = 8 << 20  # bytes of a request body (HTTP) or message (gRPC)
    max_stop_sequences: int = 64
    max_n: int = 16  # n and best_of of one request (each sample is an engine request)
    max_logprobs: int = 20  # vLLM's --max-logprobs: top-n logprobs per token at most; -1: the vocabulary
    # vLLM's --lora-modules, as the engines got them: (name, path); a request's model names one to
    # run with it (the path keys its prefix-cache blocks, for KV-aware routing).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    # load and unload adapters on every engine (404 without it, as in vLLM)
    allow_runtime_lora_updating: bool = False
    # vLLM's filesystem LoRA resolver (VLLM_LORA_RESOLVER_CACHE_DIR): a request naming a model not
    # served loads <dir>/<name> (a folder on the engines' filesystem) as an adapter first
    lora_resolver_dir: str | None = None
    lora_resolver_max_loras: int = 32  # adapters the resolver keeps loaded; one more evicts the least recently used
    trust_request_chat_template: bool = False  # honour a request's chat_template (vLLM's flag)
    chat_template: str | None = None  # vLLM's --chat-template: a file or the template, over the model's
    cors: CorsPolicy = CorsPolicy()  # vLLM's --allowed-origins & co.: none by default
    tls: FrontTls | None = None  # vLLM's --ssl-*: HTTPS and gRPC TLS on the router's fronts
    # Requests the client does not stream and with no text stop strings: the engines send their
    # tokens at least this many a message (SamplingParams.stream_interval); 1: every step.
    non_streaming_interval: int = 64
    responses_store_size: int = 0  # /v1/responses kept for previous_response_id and GET; 0: none
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: deepseek_r1, qwen3, glm45, ...
    tool_call_parser: str = "hermes"  # vLLM's --tool-call-parser: hermes | llama3_json | pythonic
    enable_auto_tool_choice: bool = True  # vLLM's flag (on here by default): tool_choice "auto" is served
    # Requests' sampling defaults (vLLM's --generation-config): "auto" (the model's
    # generation_config.json), "vllm" (none) or a folder; --override-generation-config on top.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # Forced when a thinking budget is spent (vLLM's reasoning_end_str); ends with </think>. None: </think>.
    reasoning_end_str: str | None = None
    served_model_aliases: tuple[str, ...] = ()  # more names clients may send (answers carry the first)
    engine_auth: ChannelAuth = ChannelAuth()  # token and/or TLS the engines' gRPC services demand

    @property
    def api_keys(self) -> tuple[bytes, ...]:
        return tuple(k.encode() for k in split_api_keys(self.api_key))

    def __post_init__(self) -> None:
        self._check_discovery()
        if self.policy not in ("round_robin", "least_load", "kv_aware", "auto"):
            raise ValueError(f"unknown routing policy {self.policy!r}; choose round_robin, least_load, kv_aware "
                             "or auto")
        if self.pd_policy not in ("auto", "always", "never", "conditional"):
            raise ValueError(f"unknown --pd-policy {self.pd_policy!r}; choose auto, always, never or conditional")
        if self.kv_overlap_score_weight < 0 or self.router_temperature < 0:
            raise ValueError("--kv-overlap-score-weight and --router-temperature must be >= 0")
        if not 0 <= self.kv_low_confidence_weight <= 1:
            raise ValueError("--kv-low-confidence-weight must be in [0, 1]")
        if self.max_local_prefill_length < 0 or (self.max_prefill_queue_tokens or 0) < 0:
            raise ValueError("--max-local-prefill-length and --max-prefill-queue-tokens must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be >= 1")
        if self.reasoning_parser is not None:
            from services.router.reasoning import reasoning_parser
            reasoning_parser(self.reasoning_parser)  # an unknown name is a start-up error
        if self.reasoning_end_str is not None:
            from services.router.reasoning import END
            if self.reasoning_parser is None:
                raise ValueError("--reasoning-end-str needs --reasoning-parser")
            if not self.reasoning_end_str.endswith(END) or END in self.reasoning_end_str[:-len(END)]:
                raise ValueError(f"--reasoning-end-str must end with {END}, and hold it only there")
        from services.router.tool_calls import check_tool_call_parser
        check_tool_call_parser(self.tool_call_parser)
        if self.migration_limit < 0:
            raise ValueError("--migration-limit must be >= 0")
        for name in ("request_timeout_s", "prefill_timeout_s", "health_check_interval_s",
                     "load_poll_interval_s", "max_concurrent_requests", "max_prompts_per_request",
                     "max_concurrent_prompts", "max_payload_size", "max_stop_sequences", "max_n",
                     "non_streaming_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        names = [n for n, _ in self.lora_modules]
        clash = set(names) & {self.served_model_name, *self.served_model_aliases}
        if len(set(names)) != len(names) or clash:
            raise ValueError(f"--lora-modules: each adapter needs a name of its own, not a served model's; "
                             f"got {names}")
        if self.lora_resolver_max_loras < 1:
            raise ValueError("--lora-resolver-max-loras must be >= 1")
        if self.lora_resolver_dir is not None and not self.allow_runtime_lora_updating:
            raise ValueError("--lora-resolver-dir loads adapters at run time: it needs --allow-runtime-lora-updating "
                             "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), as in vLLM")
        if self.max_logprobs < -1:
            raise ValueError("--max-logprobs must be >= 0, or -1 (the whole vocabulary)")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")

    def _check_discovery(self) -> None:
        if self.discovery == "static":
            if self.prefill_service or self.decode_service:
                raise ValueError("--prefill-service/--decode-service need --discovery dns or kubernetes")
            if not self.decode:
                raise ValueError("at least one --decode instance is needed (decode-only = colocated mode)")
            return
        if self.discovery not in ("dns", "kubernetes"):
            raise ValueError(f"unknown discovery {self.discovery!r}; choose static, dns or kubernetes")
        if self.prefill or self.decode:
            raise ValueError(f"--prefill/--decode list static instances; with --discovery {self.discovery} "
                             "give --prefill-service/--decode-service")
        if not self.decode_service:
            raise ValueError(f"--discovery {self.discovery} needs --decode-service (with no "
                             "--prefill-service its instances are colocated ones)")
        if self.discovery_interval_s <= 0:
            raise ValueError("discovery_interval_s must be > 0")
        for role, (name, port) in self.services.items():
            if self.discovery == "dns" and not port.isdigit():
                raise ValueError(f"--discovery dns needs a port number for the {role} Service (DNS A/AAAA "
                                 f"records carry none): --service-port N or --{role}-service {name}:N")
            if self.discovery == "kubernetes" and "." in name:
                raise ValueError(f"--{role}-service must be a Service name in --discovery-namespace, got {name!r}")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.prefill_service)

    @property
    def services(self) -> dict[str, tuple[str, str]]:
        """role -> (Service name, port number or name), for the roles found by discovery."""
        named = {"prefill": self.prefill_service, "decode": self.decode_service}
        return {role: parse_service(value, self.service_port) for role, value in named.items() if value}
