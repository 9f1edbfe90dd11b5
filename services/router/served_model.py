"""The model as the router serves it: name, tokenizer, chat template, context length."""
from __future__ import annotations

import inspect
import json
import logging
import os
import time

from engine.processor import load_light_tokenizer

from services.router.errors import ModelNotFound, RouterError, bad_request
from services.router.prompt_limits import PromptCharBound
from services.router.reasoning import END, START, ReasoningParser

logger = logging.getLogger(__name__)


# Texts on which the direct (Rust) tokenizer must agree with the transformers wrapper.
_PROBES = ("Hello world", "  two leading spaces", "new\nline\ttab", "1234567",
           "caf\u00e9 \u65e5\u672c\u8a9e \U0001f642")


class _RustCodec:
    """The `tokenizers` object behind a transformers fast tokenizer, called directly: several
    times less overhead per call, which matters per request (encode) and per token (decode)."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def make_codec(tokenizer):
    """The direct codec when it gives the same ids and text as `tokenizer` on probe texts
    (special tokens included), else `tokenizer` itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer
    fast = _RustCodec(backend)
    specials = " ".join(t for t in (tokenizer.bos_token, tokenizer.eos_token) if isinstance(t, str))
    for text in (*_PROBES, f"{specials} x {specials}"):
        for add in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=add)
            if fast.encode(text, add) != ids:
                return tokenizer
            for skip in (True, False):
                if fast.decode(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                    return tokenizer
    return fast


def _named_parameters(fn) -> set[str]:
    if fn is None:
        return set()
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is not p.VAR_KEYWORD}


class ServedModel:
    """Loaded once per router; every request reuses the tokenizer and the token-string cache."""

    def __init__(self, path: str, name: str, max_model_len: int | None = None, tokenizer=None,
                 reasoning_parser: ReasoningParser | None = None, aliases: tuple[str, ...] = (),
                 tool_call_parser: str = "hermes", reasoning_end_str: str | None = None) -> None:
        self.path = path
        self.name = name
        self.names = (name, *(a for a in aliases if a != name))  # every name clients may send
        self.lora_modules: dict[str, str] = {}  # --lora-modules: adapter name -> path (model names too)
        self.created = int(time.time())
        # Without transformers when the checkpoint has a tokenizer.json: the router imports no torch.
        self.tokenizer = tokenizer if tokenizer is not None else load_light_tokenizer(path)
        self.reasoning_parser = reasoning_parser  # chat output's <think> text -> `reasoning`
        self.tool_call_parser = tool_call_parser  # how an answer to tools (tool_choice auto) is read
        self.auto_tool_choice = True  # --enable-auto-tool-choice (off: tool_choice "auto" is a 400)
        if reasoning_parser is not None:
            reasoning_parser.check_tokenizer(self.tokenizer)
        # The reasoning's end marker as the model writes it (one token in DeepSeek-R1's and
        # Qwen3's vocabularies): where a structured output's grammar starts.
        self.reasoning_end_ids = (tuple(self.tokenizer.encode(END, add_special_tokens=False))
                                  if reasoning_parser is not None else ())
        self.reasoning_start_ids = (tuple(self.tokenizer.encode(START, add_special_tokens=False))
                                    if reasoning_parser is not None else ())
        # Forced when a thinking budget is spent: --reasoning-end-str's phrase, then the marker.
        phrase = (reasoning_end_str or END)[:-len(END)]
        self.reasoning_forced_ids = (
            (*self.tokenizer.encode(phrase, add_special_tokens=False), *self.reasoning_end_ids)
            if reasoning_parser is not None and phrase else self.reasoning_end_ids)
        self.codec = make_codec(self.tokenizer)  # encode/decode on the request path
        self.default_chat_template: str | None = None  # --chat-template, over the model's
        # What a request that does not set them samples with (the router's --generation-config).
        self.sampling_defaults: dict = {}
        # The Rust tokenizer's encode_batch releases the GIL (encode does not): a long prompt
        # tokenized on a worker thread leaves the event loop free.
        self._backend = getattr(self.codec, "backend", None)
        self.char_bound = PromptCharBound(self._backend or getattr(self.tokenizer, "backend_tokenizer", None))
        # apply_chat_template's own parameters (tokenize, return_dict, ...) never come from a request.
        self._template_params = _named_parameters(getattr(self.tokenizer, "apply_chat_template", None))
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config = config.get("text_config", config)
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer))
        self._config_max_len = int(config.get("max_position_embeddings") or 2048)
        self._override_max_len = max_model_len
        self.reported_max_len: int | None = None  # the smallest an instance reported
        self._token_strings: dict[int, str] = {}

    @property
    def max_model_len(self) -> int:
        return self._override_max_len or self.reported_max_len or self._config_max_len

    def on_load_report(self, report) -> None:
        if report.max_model_len > 0 and (self.reported_max_len is None
                                         or report.max_model_len < self.reported_max_len):
            self.reported_max_len = report.max_model_len

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.codec.encode(text, add_special_tokens=add_special_tokens)

    def encode_prompt(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """encode(), after refusing a text too long for the context under any tokenization."""
        at_least = self.char_bound.min_tokens(text)
        if at_least >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"your prompt has {len(text)} characters, at least {at_least} tokens with this "
                              "model's tokenizer. Please reduce the length of the prompt.", param,
                              "context_length_exceeded")
        return self.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.codec.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_string(self, token_id: int) -> str:
        """The text of one token as logprobs show it (cached: the vocabulary is fixed)."""
        s = self._token_strings.get(token_id)
        if s is None:
            s = self._token_strings[token_id] = self.codec.decode([token_id])
        return s

    def use_chat_template(self, template: str) -> None:
        """The operator's template (--chat-template) for every chat request: checked on a
        one-message chat now, so a template that cannot render says so at start (a warning: a
        template may refuse a conversation without a system message, say)."""
        self.default_chat_template = template
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True, chat_template=template)
        except Exception as e:  # noqa: BLE001 (jinja's errors are many)
            logger.warning("--chat-template does not render a one-message chat: %s", e)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                  template_kwargs: dict, chat_template: str | None = None, tools: list[dict] | None = None,
                  documents: list[dict] | None = None) -> str:
        """The chat template's text for these messages: `chat_template`, a template the operator
        allowed requests to send (else --chat-template's, else the model's); `tools`, the
        request's tools, for templates that render them (Hermes, Qwen, Llama 3); `documents`, for
        templates that render retrieved documents. The template writes the special tokens it
        wants (BOS included)."""
        # Like vLLM, keyword arguments that name apply_chat_template's own parameters are dropped:
        # only template variables reach the template.
        kwargs = {k: v for k, v in template_kwargs.items() if k not in self._template_params}
        chat_template = chat_template if chat_template is not None else self.default_chat_template
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        if documents is not None:
            kwargs["documents"] = documents
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        except Exception as e:  # jinja errors, a model without a template, bad roles
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render text", "messages")
        return text

    def require_name(self, name: str) -> None:
        """404 (OpenAI's model_not_found) unless clients may send `name` (one of --served-model-name's,
        or a LoRA adapter's)."""
        if name not in self.names and name not in self.lora_modules:
            raise ModelNotFound(name)

    def answer_name(self, name: str) -> str:
        """The model name answers carry: an adapter's own; for the base model the first served name,
        whichever of them the client sent (vLLM's rule)."""
        return name if name in self.lora_modules else self.name

    def lora_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's model name asks for (None: the base model); 404 for a name
        served no more (an adapter unloaded since the request's name was checked)."""
        if name is None or name in self.names:
            return None
        if name not in self.lora_modules:
            raise ModelNotFound(name)
        return name

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's own strings for the ids (byte-level pieces such as "Ġhello")."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)


def load_chat_template(value: str) -> str:
    """--chat-template's value: a file's text, or the template itself (vLLM's rule: a value that
    cannot be opened and has none of `{`, `}` or a newline is a path that failed)."""
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be opened: "
                             f"{e.strerror}") from None
        return value
