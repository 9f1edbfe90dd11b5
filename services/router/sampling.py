"""Checks one prompt and its sampling knobs against the model; builds the engines' SamplingParams."""
from __future__ import annotations

from dataclasses import dataclass

from engine import outputs
from engine.processor import MAX_BAD_WORDS, validate_sampling
from engine.request import InvalidRequestError, SamplingParams

from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.convert import sampling_to_proto
from services.router.errors import bad_request
from services.router.served_model import ServedModel

# A stop string longer than this is no stop string: each one is searched at every step.
MAX_STOP_SEQUENCE_CHARS = 1024
MAX_BAD_WORD_CHARS = 256


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, from the router's flags."""
    max_stop_sequences: int = 64
    max_prompts_per_request: int = 256  # engine requests one request fans out into (prompts x best_of)
    trust_request_chat_template: bool = False
    max_n: int = 16  # n and best_of
    non_streaming_interval: int = 64  # tokens a message upstream when nobody watches them arrive
    max_logprobs: int = 20  # vLLM's --max-logprobs: top-n per token at most; -1: the vocabulary

    @classmethod
    def from_config(cls, config) -> "RequestLimits":
        return cls(config.max_stop_sequences, config.max_prompts_per_request, config.trust_request_chat_template,
                   config.max_n, config.non_streaming_interval, config.max_logprobs)


def logprobs_count(n: int, model: ServedModel, limits: RequestLimits, param: str, kind: str = "sample") -> int:
    """vLLM's rules for a top-n logprobs count: -1 is the whole vocabulary, any other negative is
    400, and more than --max-logprobs (-1: the vocabulary) is 400 with vLLM's message."""
    if n == -1:
        n = model.vocab_size
    elif n < 0:
        raise bad_request(f"`{param}` must be a positive value or -1.", param)
    cap = model.vocab_size if limits.max_logprobs == -1 else limits.max_logprobs
    if n > cap:
        raise bad_request(f"Requested {kind} logprobs of {n}, which is greater than max allowed: {cap} "
                          "(the server's --max-logprobs)", param)
    return n


def check_prompt_logprobs_size(num_prompt: int, n: int | None, param: str = "prompt_logprobs") -> None:
    """Prompt logprobs come back in one engine message (engine.outputs bounds the entries one
    carries; a wide top-n of generated tokens the engines spread over several): refused (400)
    when they cannot fit in it."""
    limit = outputs.MAX_LOGPROB_ENTRIES_PER_MESSAGE
    if n is not None and (num_prompt - 1) * (n + 1) > limit:
        raise bad_request(f"{param} of {n} for a prompt of {num_prompt} tokens is {(num_prompt - 1) * (n + 1)} "
                          f"logprobs, more than one answer carries ({limit}); ask for fewer or send a shorter "
                          "prompt", param)




@dataclass
class PreparedPrompt:
    """One prompt ready to dispatch: the token ids, the engine-side params and their protobuf."""
    token_ids: list[int]
    params: SamplingParams  # what the router's detokenizer honours (stop strings, special tokens)
    sampling: pb.SamplingParams  # what the engines get
    text: str | None = None  # the prompt as text, when the client sent text (echo)
    priority: int = 0  # the engines' scheduling priority (vLLM's request field; lower is sooner)


def check_context(model: ServedModel, num_prompt: int, max_tokens: int | None, param: str) -> int:
    """Returns max_tokens (the room left when it is None); 400 when the request cannot fit."""
    limit = model.max_model_len
    if num_prompt >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your "
                          f"prompt has {num_prompt} tokens; at least one must be left to generate. "
                          "Please reduce the length of the prompt.", param, "context_length_exceeded")
    if max_tokens is None:
        return limit - num_prompt
    if num_prompt + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you "
                          f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                          f"{max_tokens} in the completion). Please reduce the length of the prompt "
                          "or completion.", "max_tokens", "context_length_exceeded")
    return max_tokens


def check_stop(stop: tuple[str, ...], limits: RequestLimits) -> None:
    if len(stop) > limits.max_stop_sequences:
        raise bad_request(f"stop has {len(stop)} sequences; at most {limits.max_stop_sequences} are allowed",
                          "stop")
    if any(len(s) > MAX_STOP_SEQUENCE_CHARS for s in stop):
        raise bad_request(f"each stop sequence must be at most {MAX_STOP_SEQUENCE_CHARS} characters", "stop")


def bad_words_token_ids(model: ServedModel, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words: each word without its leading spaces, and again with one
    space before it when that gives a different first token and as many tokens (the word in
    the middle of a text)."""
    if len(words) > MAX_BAD_WORDS // 2:  # each may become two token sequences
        raise bad_request(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS // 2} are allowed",
                          "bad_words")
    if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise bad_request(f"each bad word must be at most {MAX_BAD_WORD_CHARS} characters", "bad_words")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(model.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise bad_request(f"bad word {word!r} is empty once tokenized", "bad_words")
        out.append(plain)
        spaced = tuple(model.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def prepare(model: ServedModel, token_ids: list[int], knobs: dict, *, max_tokens: int | None,
            default_max_tokens: int | None, limits: RequestLimits, text: str | None = None,
            param: str = "prompt", priority: int = 0) -> PreparedPrompt:
    """`knobs`: SamplingParams keyword arguments other than max_tokens, as the client sent them.

    max_tokens None takes `default_max_tokens` (capped by the room left) or, if that is None
    too, all the room left.
    """
    if not token_ids:
        raise bad_request("the prompt is empty", param)
    if max_tokens is None:
        room = check_context(model, len(token_ids), None, param)
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    else:
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        check_context(model, len(token_ids), max_tokens, param)
    model.check_token_ids(token_ids, param)  # after the length check: a bounded scan
    check_stop(tuple(knobs.get("stop", ())), limits)
    check_prompt_logprobs_size(len(token_ids), knobs.get("prompt_logprobs"))
    try:
        params = SamplingParams(max_tokens=max_tokens, **knobs)
        validate_sampling(params, model.vocab_size)  # what the engines refuse, refused here first
        # Stop strings travel too: the text is cut at them here, and a decode stops at them.
        return PreparedPrompt(token_ids, params, sampling_to_proto(params), text, priority)
    except InvalidRequestError as e:  # its message starts with the parameter's name
        message = str(e)
        raise bad_request(message, message.split(" ", 1)[0]) from None
    except TypeError as e:  # a value of the wrong type reached a comparison
        raise bad_request(f"invalid sampling parameters: {e}") from None
