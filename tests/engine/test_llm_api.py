"""The offline API as a user meets it: bad input, stop strings, text, logprobs."""
from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama", max_position_embeddings=256))


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=2.0), "min_p"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_cleanly_and_engine_keeps_serving(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[10 ** 9]], SamplingParams(max_tokens=2))
    # A batch with one bad prompt queues nothing.
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    # A priority on an FCFS engine is refused, as vLLM does, not ignored; so is one per prompt missing.
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        llm.generate(["fine", "too"], SamplingParams(max_tokens=2), priority=[0, 1])
    with pytest.raises(ValueError, match="one priority per prompt"):
        llm.generate(["fine", "too"], SamplingParams(max_tokens=2), priority=[0])
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["still serving"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    llm.engine.check_integrity(expect_all_free=True)


def test_unknown_model_directory():
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM("/nonexistent/model/dir")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_an_unsupported_activation_is_named(tiny_model_factory, tmp_path):
    import json
    import shutil

    shutil.copytree(tiny_model_factory("llama"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "relu2"}))
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu2' \\(served: silu, gelu_pytorch_tanh\\)"):
        LLM(str(tmp_path))


def test_generation_stops_at_context_length(llm):
    out = llm.generate([[5] * 250], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_text_matches_decoded_tokens(llm):
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    c = out.outputs[0]
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert c.finish_reason == "length"


def test_stop_string_truncates_and_finishes(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(["Winter rain"], params)[0].outputs[0].text
    assert len(full) > 6
    stop = full[4:7]
    out = llm.generate(["Winter rain"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                       stop=[stop]))[0].outputs[0]
    assert out.text == full[:full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    llm.engine.check_integrity(expect_all_free=True)


def test_streamed_deltas_concatenate_to_the_text(llm):
    ids = llm.generate(["Summer garden"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    c = ids.outputs[0]
    detok = IncrementalDetokenizer(llm.tokenizer, SamplingParams(max_tokens=30))
    deltas = [detok.add_tokens([t]) for t in c.token_ids[:-1]] + [detok.add_tokens(c.token_ids[-1:], finished=True)]
    assert "".join(deltas) == c.text


def test_logprobs_returned_per_token(llm):
    out = llm.generate(["A small bird"], SamplingParams(max_tokens=4, temperature=0, logprobs=2,
                                                        ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok] == max(entry.values()) and entry[tok] <= 0


class _SlowTokenizer:
    """Only `decode`: the detokenizer's window path, as for a tokenizer without a Rust core."""

    def __init__(self, tokenizer):
        self._inner = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("path", ["stream", "window"])
def test_incremental_text_equals_decoding_all_ids(llm, path):
    tok = llm.tokenizer if path == "stream" else _SlowTokenizer(llm.tokenizer)
    ids = llm.tokenizer.encode("Summer garden — naïve café 日本語 🎉 ok.", add_special_tokens=False)
    for cut in (len(ids), len(ids) - 1, len(ids) - 4):  # whole, and ending inside a character
        detok = IncrementalDetokenizer(tok, SamplingParams(max_tokens=64))
        deltas = [detok.add_tokens([t]) for t in ids[:cut - 1]] + [detok.add_tokens(ids[cut - 1:cut], finished=True)]
        assert "".join(deltas) == detok.text == llm.tokenizer.decode(ids[:cut], skip_special_tokens=True)
    assert (detok._stream is not None) == (path == "stream")


@pytest.mark.parametrize("path", ["stream", "window"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_partial_character_that_never_completes_is_not_held_to_the_end(llm, path, skip_special_tokens):
    """A lone UTF-8 lead byte between special tokens (what a random model streamed for seconds
    with no text) comes out as U+FFFD within a few tokens, not when the request finishes."""
    from engine.detokenizer import MAX_HELD_TOKENS

    tok = llm.tokenizer if path == "stream" else _SlowTokenizer(llm.tokenizer)
    lead = llm.tokenizer.convert_tokens_to_ids("æ")  # byte 0xE6 alone: a 3-byte character's start
    special = llm.tokenizer.all_special_ids[-1]
    head = llm.tokenizer.encode("ok then", add_special_tokens=False)
    tail = llm.tokenizer.encode(" done", add_special_tokens=False)
    ids = head + [lead, special] * 8 + tail
    detok = IncrementalDetokenizer(tok, SamplingParams(max_tokens=64, skip_special_tokens=skip_special_tokens))
    deltas = [detok.add_tokens([t]) for t in ids[:-1]] + [detok.add_tokens(ids[-1:], finished=True)]
    assert "".join(deltas) == llm.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "\ufffd" in "".join(deltas[:len(head) + 8])  # shown while the pattern still runs
    quiet = longest = 0
    for d in deltas:
        quiet = 0 if d else quiet + 1
        longest = max(longest, quiet)
    assert longest <= MAX_HELD_TOKENS
