"""Text stop strings in the engine: where a service's engine (token ids out, no text) stops a
request on one, and vLLM's min_tokens rule (none is looked for before min_tokens tokens)."""
from __future__ import annotations

from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import OutputKind, OutputProcessor
from engine.scheduler_output import EngineCoreOutput


class CharTokenizer:
    """Token id = a character's code point: the text is plain to read."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_service_engine_stops_a_request_where_its_stop_string_matches():
    """Services stream token ids and leave text to the router (no tokenizer for text), but a
    request with stop strings is detokenized to stop where one matches: at once, not a stream
    interval later when the router would abort it. A prefill's request is left alone (its KV is
    published with its one token; the router judges that token)."""
    p = OutputProcessor(None, OutputKind.DELTA, stream_interval=8, stop_tokenizer=CharTokenizer())
    p.add("stop", None, [1], SamplingParams(max_tokens=20, stop=["cd"]))
    p.add("plain", None, [1], SamplingParams(max_tokens=20))
    p.add("prefill", None, [1], SamplingParams(max_tokens=20, stop=["a"]), find_stop=False)
    assert p.states["plain"].detokenizer is None and p.states["prefill"].detokenizer is None
    outs, halted = [], []
    for tok in ids("abcdefgh"):
        got, stopped = p.process([EngineCoreOutput("stop", [tok])])
        outs += got
        halted += stopped
        if "stop" not in p.states:
            break
    # The first token at once, then the rest held for the interval until the match ends it.
    assert [o.outputs[0].token_ids for o in outs] == [ids("a"), ids("bcd")]
    assert halted == ["stop"]  # the core is told to stop generating
    last = outs[-1].outputs[0]
    assert outs[-1].finished and (last.finish_reason, last.stop_reason) == ("stop", "cd")
    got, stopped = p.process([EngineCoreOutput("prefill", ids("a"), finish_reason="length", finished=True)])
    assert not stopped and got[0].outputs[0].finish_reason == "length"


def test_stop_strings_are_looked_for_only_past_min_tokens():
    def run(min_tokens: int) -> tuple[str, str | None]:
        detok = IncrementalDetokenizer(CharTokenizer(), SamplingParams(max_tokens=20, stop=["b"],
                                                                        min_tokens=min_tokens))
        text = ""
        for tok in ids("abcabcab"):
            text += detok.add_tokens([tok])
            if detok.stopped_on is not None:
                break
        return text, detok.stopped_on

    assert run(0) == ("a", "b")
    # vLLM's rule: a match within the first min_tokens tokens does not count, one after does.
    assert run(3) == ("abca", "b")
    assert run(2) == ("abca", "b")  # the "b" at token 2 is not past min_tokens
    assert run(1) == ("a", "b")


def test_a_stop_string_spanning_the_prefills_token_stops_the_decode():
    """A decode's request arrives with the prefill's first token: a stop string that begins in it
    and ends in the decode's first token is found by the decode (before, only by the router)."""
    p = OutputProcessor(None, OutputKind.DELTA, stream_interval=8, stop_tokenizer=CharTokenizer())
    p.add("spans", None, [1], SamplingParams(max_tokens=20, stop=["ab"]), output_prefix=tuple(ids("xa")))
    p.add("inside", None, [1], SamplingParams(max_tokens=20, stop=["zz"]), output_prefix=tuple(ids("x")))
    got, stopped = p.process([EngineCoreOutput("spans", ids("b"))])
    assert stopped == ["spans"] and got[0].outputs[0].finish_reason == "stop"
    assert got[0].outputs[0].token_ids == ids("b") and got[0].outputs[0].text == ""  # the prefix is not shown again
    got, stopped = p.process([EngineCoreOutput("inside", ids("abc"))])
    assert not stopped and got[0].outputs[0].text == "ab"  # "c" held back: a stop may still span
