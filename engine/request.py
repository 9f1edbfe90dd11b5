"""Request, SamplingParams and the request status machine."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from engine.structured_output.params import StructuredOutputsParams
from engine.thinking_budget import ThinkingBudget


class InvalidRequestError(ValueError):
    """The request itself is wrong (maps to HTTP 400 / gRPC INVALID_ARGUMENT)."""


class DuplicateRequestError(InvalidRequestError):
    """The engine already holds a request of that id (maps to gRPC ALREADY_EXISTS)."""


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full (requests or prompt tokens): retry later or on another instance
    (maps to gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine core process died: every request in flight fails, and so does every new one
    (maps to gRPC UNAVAILABLE)."""


def check_priority(priority: int, policy: str) -> None:
    """A priority other than 0 needs priority scheduling: refused (as vLLM does), never ignored."""
    if priority and policy != "priority":
        raise InvalidRequestError(f"priority {priority} needs priority scheduling (--scheduling-policy "
                                  f"priority); this engine schedules {policy}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per sampled token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Prefix-cache isolation (vLLM's field): requests share cached blocks only with the same salt.
    cache_salt: str | None = None
    # The LoRA adapter the request runs with (one of the engine's --lora-modules names; vLLM's
    # LoRARequest, carried here so it travels with the request to every engine): None, the base model.
    lora_name: str | None = None
    # OpenAI's penalties on the output so far (0: off), and HF's repetition penalty on prompt +
    # output (1: off; a positive logit is divided by it, a negative one multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # ((token id, bias), ...) added to the logits; a dict is accepted and stored sorted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Token sequences: a sequence's last token is banned when the output so far ends with the
    # tokens before it (a one-token sequence is always banned).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Offline API only (LLM.generate): n samples per prompt, seeded ones with seed + i; the
    # router fans out into n engine requests itself.
    n: int = 1
    # The prompt's last resumed_tokens tokens are this request's own earlier output (resent as
    # prompt after a migration): presence/frequency penalties, bad words and a structured-output
    # grammar see them as output.
    resumed_tokens: int = 0
    # Guided decoding: the output must match a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (every other logit is -inf);
    # empty: no restriction. Stored sorted, without repeats.
    allowed_token_ids: tuple[int, ...] = ()
    # Streamed (DELTA) updates after the first carry at least this many tokens, or finish the
    # request (vLLM's per-request field): clamped up to the engine's stream_interval. None: the engine's.
    stream_interval: int | None = None
    # A reasoning model's thinking budget: past it, the engine forces the reasoning's closing
    # tokens (vLLM's thinking_token_budget; the router fills in the markers).
    thinking_budget: ThinkingBudget | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        # The cap (vLLM's --max-logprobs) is the server's policy (the router's flag); the engine's
        # own bound, the vocabulary, is checked with it known (validate_sampling).
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequestError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise InvalidRequestError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string if provided")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise InvalidRequestError("lora_name must be a non-empty string if provided")
        self._check_penalties()
        self._freeze_logit_bias()
        self._freeze_bad_words()
        self._freeze_allowed_token_ids()
        if isinstance(self.resumed_tokens, bool) or not isinstance(self.resumed_tokens, int) \
                or self.resumed_tokens < 0:
            raise InvalidRequestError(f"resumed_tokens must be an integer >= 0, got {self.resumed_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}")
        si = self.stream_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise InvalidRequestError(f"stream_interval must be an integer >= 1, got {si!r}")
        if self.thinking_budget is not None and not isinstance(self.thinking_budget, ThinkingBudget):
            raise InvalidRequestError("thinking_budget must be a ThinkingBudget")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not 0.0 < rp < math.inf:
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {rp!r}")

    def _freeze_logit_bias(self) -> None:
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = [(token, bias) for token, bias in items]
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias must map token ids to numbers") from None
        for token, bias in pairs:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise InvalidRequestError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)))

    def _freeze_bad_words(self) -> None:
        words = []
        for word in self.bad_words_token_ids:
            if isinstance(word, (str, bytes)) or not hasattr(word, "__iter__"):
                raise InvalidRequestError("bad_words_token_ids must be sequences of token ids")
            word = tuple(word)
            if not word or any(isinstance(t, bool) or not isinstance(t, int) for t in word):
                raise InvalidRequestError("bad_words_token_ids must be non-empty sequences of token ids")
            words.append(word)
        object.__setattr__(self, "bad_words_token_ids", tuple(words))

    def _freeze_allowed_token_ids(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is None:
            allowed = ()
        elif isinstance(allowed, (str, bytes)) or not hasattr(allowed, "__iter__"):
            raise InvalidRequestError("allowed_token_ids must be a list of token ids")
        allowed = tuple(allowed)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in allowed):
            raise InvalidRequestError("allowed_token_ids must be a list of token ids (integers)")
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))

    @property
    def has_penalties(self) -> bool:
        """Any of the three penalties is on: the next token depends on the output so far."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def depends_on_output(self) -> bool:
        """The logits processors read the output so far (penalties, multi-token bad words): a
        step cannot be launched before the previous token is known."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def generation_budget(params: SamplingParams, prefill_only: bool) -> int:
    """Tokens a request may generate on this engine: max_tokens; one for a prefill-only request.
    What its outstanding tokens (routing load) count beside the prompt."""
    return 1 if prefill_only else params.max_tokens


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # blocks allocated, KV arriving from a prefill instance
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    # Prefill-only: the first token did not end the request, another engine decodes the rest.
    FINISHED_REMOTE_DECODE = 7
    # Held by the engine core's structured output manager until its grammar is compiled.
    WAITING_FOR_FSM = 8

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_REMOTE_DECODE

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False)
class Request:
    """A request is `num_computed_tokens` catching up to `num_tokens` (prompt + output)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Decode role: the signed KV handle of the prompt's blocks on a prefill instance; the
    # request then arrives with prompt + first token and waits in WAITING_FOR_REMOTE_KV.
    remote_kv: bytes | None = None
    # Prefill role: stop after the first token (if it does not end the request by itself,
    # status FINISHED_REMOTE_DECODE), another engine decodes the rest.
    prefill_only: bool = False
    # With prefill_only: keep the prompt's blocks pinned and publish a KV handle for that engine.
    publish_kv: bool = False

    def __post_init__(self) -> None:
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.num_preemptions = 0
        self.queue_time: float | None = None  # arrival -> first scheduled, seconds
        self.block_hashes: list[bytes] = []  # engine.block_hash, one per full block
        self.stop_reason: int | str | None = None
        # Speculative decoding: tokens proposed to follow all_token_ids, verified by the next step.
        self.spec_token_ids: list[int] = []
        # engine.structured_output.StructuredOutputRequest when the params ask for a grammar.
        self.structured_output = None
        # Filled chunk by chunk when sampling_params.prompt_logprobs is set: one entry per
        # prompt token after the first, (logprob, [(token id, logprob), ...top-n]).
        self.prompt_logprobs: list | None = [] if self.sampling_params.prompt_logprobs is not None else None
        # A thinking budget's reasoning has closed in the committed output (it never reopens).
        self.thinking_closed = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def output_start(self) -> int:
        """Where output_history starts in all_token_ids."""
        return self.num_prompt_tokens - min(self.sampling_params.resumed_tokens, self.num_prompt_tokens)

    @property
    def output_history(self) -> list[int]:
        """The output the logits processors read: this engine's output, after the prompt's last
        sampling_params.resumed_tokens tokens when the request was resumed elsewhere."""
        return self.all_token_ids[self.num_prompt_tokens - min(self.sampling_params.resumed_tokens,
                                                               self.num_prompt_tokens):]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.finished
