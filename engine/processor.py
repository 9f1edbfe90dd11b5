"""Front-end input processing: tokenization, chat templates and request validation."""
from __future__ import annotations

import functools
import json
import math
import os

from engine.request import InvalidRequestError, SamplingParams

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names templates read it under
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The core scans a request's stop ids at every step: a bounded list (the router caps it too).
MAX_STOP_TOKEN_IDS = 256
# Bad words are matched against the output at every step: a bounded number of bounded sequences.
MAX_BAD_WORDS = 256
MAX_BAD_WORD_TOKENS = 64


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory not found: {path!r}")
    return AutoTokenizer.from_pretrained(path)


def load_light_tokenizer(path: str):
    """The checkpoint's tokenizer without transformers, and so without torch (the router's start
    time): a TokenizerCodec when there is a tokenizer.json, else transformers' tokenizer."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return load_tokenizer(path)
    return TokenizerCodec(path)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # AddedToken dicts carry "content"


class TokenizerCodec:
    """tokenizer.json through the `tokenizers` library, special tokens and chat template from
    tokenizer_config.json as transformers reads them: the same ids and text as its fast tokenizer
    (which also uses tokenizer.json as it is), with the part of its interface the router uses."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.backend.no_truncation()  # transformers encodes without them unless asked
        self.backend.no_padding()
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        config.update(_read_json(os.path.join(path, "special_tokens_map.json")))  # it wins, as in transformers
        self.special_tokens_map = {k: _token_text(config[k]) for k in _SPECIAL_TOKENS if config.get(k) is not None}
        # transformers' clean-up of spaces before punctuation, which it skips for BPE models.
        self._clean_up = (bool(config.get("clean_up_tokenization_spaces"))
                          and type(self.backend.model).__name__ != "BPE")
        self.chat_template = _chat_templates(path, config.get("chat_template"))

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens_map.get("eos_token")
        return self.backend.token_to_id(eos) if eos is not None else None

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                                  (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            tools: list[dict] | None = None, documents: list[dict] | None = None, **kwargs) -> str:
        """The prompt text, rendered as transformers' apply_chat_template(tokenize=False) renders it;
        `chat_template`: a template (or the name of one of the model's) instead of the default;
        `documents`: for templates that render retrieved documents (RAG)."""
        if tokenize:
            raise ValueError("TokenizerCodec renders text only: encode it with add_special_tokens=False")
        template = self.chat_template.get(chat_template or "default", chat_template)
        if template is None:
            raise ValueError("this model has no chat template" if not self.chat_template else
                             f"this model has several chat templates ({', '.join(sorted(self.chat_template))}) "
                             "and no default")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        chat = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
        final = chat[-1].get("content") if continue_final_message else None
        if continue_final_message:
            if not isinstance(final, str) or "content" not in template:
                raise ValueError("continue_final_message needs a final message with text content the "
                                 "template renders")
            chat[-1]["content"] = final + _CONTINUE_TAG
        text = _compile(template).render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens_map, **kwargs})
        if continue_final_message:  # cut the text after the final message's content
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message: the template does not render the final message")
            at = text.rindex(_CONTINUE_TAG.strip())
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, lora_names=None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # The LoRA adapters the engine serves (a live view where adapters load at run time); None: LoRA off.
        self.lora_names = lora_names

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    def to_token_ids(self, prompt) -> list[int]:
        """str, list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: send prompt token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len} "
                f"tokens and at least one must be left to generate")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams")
        if params.resumed_tokens > len(token_ids):
            raise InvalidRequestError(f"resumed_tokens ({params.resumed_tokens}) exceeds the prompt's "
                                      f"{len(token_ids)} tokens")
        validate_sampling(params, self.vocab_size)
        if params.lora_name is not None and params.lora_name not in (self.lora_names or ()):
            served = ("none (no --enable-lora)" if self.lora_names is None
                      else ", ".join(sorted(self.lora_names)) or "none")
            raise InvalidRequestError(f"lora_name {params.lora_name!r} is not an adapter this engine serves; "
                                      f"it serves {served}")


def validate_sampling(params: SamplingParams, vocab_size: int) -> None:
    """What the core indexes or divides with, checked at the door (as vLLM's processor does):
    an out-of-vocabulary stop id is refused, not silently dropped by the sampler."""
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids has {len(params.stop_token_ids)} entries; at most "
                                  f"{MAX_STOP_TOKEN_IDS} are allowed")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.allowed_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"allowed_token_ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    words = params.bad_words_token_ids
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_TOKENS for w in words):
        raise InvalidRequestError(f"bad_words may hold at most {MAX_BAD_WORDS} words of at most "
                                  f"{MAX_BAD_WORD_TOKENS} tokens each")
    bad = [t for w in words for t in w if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"bad_words token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    tb = params.thinking_budget
    bad = [t for t in (tb.token_ids() if tb is not None else ()) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"thinking budget token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name)
        if n is not None and n > vocab_size:
            raise InvalidRequestError(f"{name} cannot be greater than the vocabulary size ({vocab_size}), got {n}")
    if params.top_k > vocab_size:
        raise InvalidRequestError(f"top_k cannot be greater than the vocabulary size ({vocab_size}), "
                                  f"got {params.top_k}")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise InvalidRequestError(f"{name} must be a finite number, got {getattr(params, name)}")


def _chat_templates(path: str, in_config) -> dict[str, str]:
    """name -> template: chat_template.jinja and additional_chat_templates/*.jinja win over
    tokenizer_config.json's chat_template (a string, or a list of {name, template})."""
    files = {"default": os.path.join(path, "chat_template.jinja")}
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
        files.update({n.removesuffix(".jinja"): os.path.join(extra, n) for n in os.listdir(extra)
                      if n.endswith(".jinja")})
    templates = {}
    for name, file in files.items():
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                templates[name] = f.read()
    if templates:
        return templates
    if isinstance(in_config, list):
        return {t["name"]: t["template"] for t in in_config}
    return {"default": in_config} if isinstance(in_config, str) else {}


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """The environment transformers renders chat templates in: a sandbox, trimmed blocks, loop
    controls, a tojson that keeps non-ASCII, raise_exception, strftime_now, {% generation %}."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}  # marks assistant text for training masks; the text renders as is

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(template)
