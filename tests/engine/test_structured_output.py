"""Structured outputs in the engine: every kind constrains a random-weight model's output, grammars
compile once and off the step loop, a bad one fails only its request, and the batch bitmask masks
exactly what each matcher forbids."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.engine_core import EngineCore
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import InvalidRequestError, Request, RequestStatus, SamplingParams
from engine.structured_output.bitmask import GrammarBitmask, apply_bitmask_reference, bitmask_words
from engine.structured_output.params import StructuredOutputsParams as Guided
from structured_schemas import PERSON

BACKENDS = ["xgrammar", "llguidance"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_blocks=512)


def guided(max_tokens=300, seed=0, temperature=1.0, resumed_tokens=0, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, resumed_tokens=resumed_tokens,
                          structured_outputs=Guided(**kind))


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_outputs_validate(llm, backend):
    params = [guided(seed=s, json=json.dumps(PERSON), backend=backend, disable_any_whitespace=True)
              for s in range(6)]
    for out in llm.generate(["Tell me about a person"] * 6, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_regex_choice_and_grammar(llm, backend):
    choices = ["red apple", "green", "blue moon"]
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    prompts = ["a b c"] * 4
    outs = llm.generate(prompts, [
        guided(seed=1, json_object=True, backend=backend, disable_any_whitespace=True, max_tokens=60),
        guided(seed=2, regex=r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", backend=backend),
        guided(seed=3, choice=choices, backend=backend),
        guided(seed=4, grammar=grammar, max_tokens=40, backend=backend),
    ])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[1:]), texts
    # Any object: nothing bounds its strings, so a random model may not close it in 60 tokens;
    # what it wrote is an object's start, and a closed one parses.
    assert texts[0].startswith("{")
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[0]), dict)
    else:
        assert outs[0].outputs[0].finish_reason == "length"
    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", texts[1])
    assert texts[2] in choices
    assert re.fullmatch(r"\((\d|[1-9]\d)(,(\d|[1-9]\d))*\)", texts[3])


def test_auto_backend_falls_back_to_llguidance(llm):
    """A Lark grammar is no xgrammar EBNF: auto compiles it with llguidance; xgrammar alone refuses."""
    lark = 'start: "yes" | "no" | "maybe"'
    auto, strict = llm.generate(["q", "q"], [guided(grammar=lark, max_tokens=8),
                                             guided(grammar=lark, max_tokens=8, backend="xgrammar")])
    assert auto.outputs[0].finish_reason == "stop" and auto.outputs[0].text in ("yes", "no", "maybe")
    assert strict.outputs[0].finish_reason == "abort" and "grammar" in strict.outputs[0].stop_reason


def test_choice_is_greedy_exact(llm):
    """Greedy decoding under a choice grammar picks the choice the model's masked argmax leads to,
    and the same one every time."""
    params = guided(temperature=0.0, choice=["yes", "no"])
    first = llm.generate(["Is it?"], params)[0].outputs[0].text
    assert first in ("yes", "no")
    assert llm.generate(["Is it?"], params)[0].outputs[0].text == first


def test_grammar_compiles_once_per_spec(tiny_llama):
    llm = LLM(tiny_llama, num_blocks=128)
    schema = json.dumps({"type": "object", "properties": {"x": {"enum": [1, 2, 3]}}, "required": ["x"],
                         "additionalProperties": False})
    llm.generate(["one", "two"], [guided(json=schema, seed=1), guided(json=schema, seed=2)])
    llm.generate(["three"], guided(json=schema, seed=3))
    stats = llm.engine.stats()
    assert stats["grammar_compiles"] == 1
    assert stats["grammar_cache_hits"] == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_grammar_ends_a_complete_document_before_min_tokens(llm, temperature):
    """min_tokens hides EOS, the grammar allows only EOS once the choice is written: the grammar
    wins (the document is complete), where the row used to have nothing left to sample and the
    request was aborted; bad words banning every token the grammar allows likewise."""
    alone = llm.generate(["Is it?"], guided(temperature=temperature, choice=["yes"], max_tokens=20))[0].outputs[0]
    assert (alone.text, alone.finish_reason) == ("yes", "stop")
    written = [t for t in alone.token_ids if t != llm.tokenizer.eos_token_id]
    outs = llm.generate(["Is it?", "Is it?"], [
        SamplingParams(max_tokens=20, min_tokens=10, temperature=temperature, seed=i,
                       structured_outputs=Guided(choice=["yes"]),
                       bad_words_token_ids=[[t] for t in written] if i else ())
        for i in range(2)])
    for out in outs:
        assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("yes", "stop")
    free = llm.generate(["Is it?"], SamplingParams(max_tokens=20, min_tokens=10, temperature=temperature))
    assert len(free[0].outputs[0].token_ids) >= 10  # without a grammar, min_tokens holds


def test_bad_grammar_fails_only_its_request(llm):
    outs = llm.generate(["x", "y", "z"], [guided(json='{"type": "nonsense"}'), SamplingParams(max_tokens=4),
                                          guided(grammar='root ::= ("a"')])
    assert outs[0].outputs[0].finish_reason == "abort"
    assert "nonsense" in outs[0].outputs[0].stop_reason
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
    assert outs[2].outputs[0].finish_reason == "abort"
    assert "grammar" in outs[2].outputs[0].stop_reason


def test_params_refuse_ambiguous_or_malformed_constraints():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Guided(json="{}", regex="a")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Guided()
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        Guided(json="{")
    with pytest.raises(InvalidRequestError, match="choice"):
        Guided(choice=[])
    with pytest.raises(InvalidRequestError, match="backend"):
        Guided(regex="a", backend="outlines")


def test_slow_compile_does_not_hold_back_other_requests(tiny_llama):
    """A large schema compiles on a worker thread: the running request keeps producing tokens
    meanwhile, and the guided request waits (WAITING_FOR_FSM) without a seat in the batch."""
    core = EngineCore(EngineConfig.create(tiny_llama, num_blocks=256))
    free = Request("free", [5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0))
    core.add_request(free)
    core.step()
    big = {"type": "object", "required": [f"f{i}" for i in range(900)], "additionalProperties": False,
           "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 20}}}[0-9]{{2,{i % 5 + 3}}}$"}
                          for i in range(900)}}
    slow = Request("slow", [8, 9], guided(json=json.dumps(big), max_tokens=4))
    core.add_request(slow)
    assert slow.status == RequestStatus.WAITING_FOR_FSM
    tokens_while_compiling = 0
    while slow.status == RequestStatus.WAITING_FOR_FSM:
        assert all(r.request_id != "slow" for r in core.scheduler.running)
        for out in core.step():
            if out.request_id == "free":
                tokens_while_compiling += len(out.new_token_ids)
    assert tokens_while_compiling >= 3, "the step loop waited for the compile"
    finished = False
    while not finished:
        finished = any(o.request_id == "slow" and o.finished for o in core.step())
    core.abort_requests(["free"])
    core.shutdown()


def test_preemption_and_async_scheduling_keep_the_grammar(tiny_llama):
    """Few KV blocks force recompute preemption mid-document; async scheduling launches ahead only
    without grammar rows. Every document still validates."""
    llm = LLM(tiny_llama, num_blocks=24, block_size=16, async_scheduling=True)
    schema = json.dumps(PERSON)
    prompts = ["The quick brown fox jumps over the lazy dog " * 3] * 6
    params = [guided(seed=s, json=schema, disable_any_whitespace=True) if s % 2 == 0
              else SamplingParams(max_tokens=60, ignore_eos=True) for s in range(6)]
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs[::2]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs[1::2])


def test_a_resumed_request_continues_its_document(tiny_llama):
    """P/D and migration: a request that arrives with output tokens (a prefill's first token) has
    its matcher advanced over them; a token the grammar refuses fails the request."""
    core = EngineCore(EngineConfig.create(tiny_llama, num_blocks=64))
    params = guided(choice=["{}"], max_tokens=10, temperature=0.0)
    from engine.processor import load_tokenizer
    ids = load_tokenizer(tiny_llama).encode("{", add_special_tokens=False)
    ok = Request("ok", [5, 6], params)
    ok.append_token(ids[0])
    bad = Request("bad", [5, 6], params)
    bad.append_token(load_tokenizer(tiny_llama).encode("x", add_special_tokens=False)[0])
    core.add_request(ok)
    core.add_request(bad)
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    by_id = {o.request_id: o for o in outs if o.finished}
    assert by_id["bad"].finish_reason == "abort" and "does not match" in by_id["bad"].stop_reason
    assert by_id["ok"].finish_reason == "stop"
    assert core.structured_output.num_waiting == 0
    core.shutdown()


def test_a_migrated_request_resumes_its_grammar_after_the_prompt_tail(tiny_llama):
    """Migration sends prompt + tokens so far as the prompt: resumed_tokens says how many of them
    the grammar has seen already, and the output completes that document, not a new one."""
    from engine.processor import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    core = EngineCore(EngineConfig.create(tiny_llama, num_blocks=64))
    so_far = [tok.convert_tokens_to_ids(c) for c in ("a", "b")]
    resumed = Request("resumed", [5, 6] + so_far,
                      guided(regex="ab+c", resumed_tokens=2, max_tokens=20, temperature=1.0))
    core.add_request(resumed)
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    tokens = [t for o in outs if o.request_id == "resumed" for t in o.new_token_ids]
    final = {o.request_id: o for o in outs if o.finished}
    assert final["resumed"].finish_reason == "stop"
    assert re.fullmatch("ab+c", "ab" + tok.decode(tokens, skip_special_tokens=True))
    core.shutdown()


def _allowed_by_matcher(grammar, vocab: int) -> list[bool]:
    return [grammar.validate_tokens([t]) == 1 for t in range(vocab)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitmask_masks_exactly_what_the_matcher_forbids(tiny_llama, device, backend):
    """Rows with a grammar get -inf exactly where their matcher refuses the token (and the logit
    unchanged elsewhere); rows without one are untouched; the kernel equals the torch reference."""
    from engine.structured_output.manager import StructuredOutputManager

    vocab = EngineConfig.create(tiny_llama).model.hf_config["vocab_size"]
    manager = StructuredOutputManager(tiny_llama, vocab)
    specs = [Guided(json=json.dumps(PERSON), backend=backend), None, Guided(regex=r"[0-9]+x", backend=backend),
             Guided(choice=["alpha", "beta"], backend=backend), None]
    requests = []
    for i, spec in enumerate(specs):
        r = Request(str(i), [1, 2], SamplingParams(structured_outputs=spec))
        if manager.add(r):
            manager.wait(10)
        requests.append(r)
    while manager.num_waiting:
        manager.wait(10)
        ready, failed = manager.take_settled()
        assert not failed
    # Move two grammars off their start state.
    from engine.processor import load_tokenizer
    tok = load_tokenizer(tiny_llama)
    for t in tok.encode('{"name": "', add_special_tokens=False):
        assert requests[0].structured_output.accept_token(t)
    for t in tok.encode("12", add_special_tokens=False):
        assert requests[2].structured_output.accept_token(t)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(requests), vocab, generator=gen).to(device)
    bitmask = GrammarBitmask(8, vocab, torch.device(device))
    masked = bitmask.apply(logits.clone(), requests)
    rows = [i for i, s in enumerate(specs) if s is not None]
    host = torch.full((len(requests), bitmask_words(vocab)), -1, dtype=torch.int32)
    for i in rows:
        requests[i].structured_output.fill_bitmask(host, i)
    expected = apply_bitmask_reference(logits, host.to(device), rows)
    assert torch.equal(masked.cpu(), expected.cpu())
    for i, spec in enumerate(specs):
        if spec is None:
            assert torch.equal(masked[i].cpu(), logits[i].cpu())
            continue
        allowed = torch.tensor(_allowed_by_matcher(requests[i].structured_output, vocab))
        assert allowed.any()
        assert torch.equal(torch.isinf(masked[i].cpu()), ~allowed)
        assert torch.equal(masked[i].cpu()[allowed], logits[i].cpu()[allowed])
    manager.shutdown()


def test_proposal_bitmask_matches_stepwise_fills(tiny_llama):
    """For speculative decoding: the rows filled along proposed tokens equal the masks the matcher
    gives after accepting them one by one, the count stops at the first refused proposal, and
    the matcher ends where it started."""
    from engine.processor import load_tokenizer
    from engine.structured_output.manager import StructuredOutputManager

    vocab = EngineConfig.create(tiny_llama).model.hf_config["vocab_size"]
    manager = StructuredOutputManager(tiny_llama, vocab)
    r = Request("r", [1], SamplingParams(structured_outputs=Guided(regex="ab+c")))
    manager.add(r)
    manager.wait(10)
    manager.take_settled()
    grammar = r.structured_output
    tok = load_tokenizer(tiny_llama)
    proposals = [tok.convert_tokens_to_ids(c) for c in ("a", "b", "b", "x", "c")]
    words = bitmask_words(vocab)
    rows = torch.zeros((len(proposals) + 1, words), dtype=torch.int32)
    assert grammar.fill_bitmask_for_proposals(proposals, rows, 0) == 3
    step = torch.zeros((1, words), dtype=torch.int32)
    for j in range(4):
        grammar.fill_bitmask(step, 0)
        assert torch.equal(rows[j], step[0]), j
        if j < 3:
            assert grammar.accept_token(proposals[j])
    grammar.rollback(3)
    assert grammar.validate_tokens(proposals) == 3
    grammar.fill_bitmask(step, 0)
    assert torch.equal(step[0], rows[0])  # back at the start
    manager.shutdown()


def test_the_grammar_starts_after_the_reasoning_end_marker(tiny_llama):
    """Under a reasoning parser (vLLM's rule) the grammar applies after the reasoning's end marker:
    an output whose earlier tokens show the marker continues a document from the first token
    after it; one that has not shown it yet is free (the marker never comes from this random
    model, so the constraint never starts)."""
    from engine.processor import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    marker = tok.encode(" END", add_special_tokens=False)
    core = EngineCore(EngineConfig.create(tiny_llama, num_blocks=64))
    thought = tok.encode("hmm", add_special_tokens=False)
    closed = Request("closed", [5, 6, *thought, *marker], guided(
        regex="z{6}", reasoning_end=tuple(marker), resumed_tokens=len(thought) + len(marker), max_tokens=12,
        temperature=0.0))
    still = Request("still", [5, 6, *thought], guided(regex="z{6}", reasoning_end=tuple(marker),
                                                       resumed_tokens=len(thought), max_tokens=12, temperature=0.0))
    for r in (closed, still):
        core.add_request(r)
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    tokens = {rid: [t for o in outs if o.request_id == rid for t in o.new_token_ids] for rid in ("closed", "still")}
    final = {o.request_id: o for o in outs if o.finished}
    assert tok.decode(tokens["closed"], skip_special_tokens=True) == "z" * 6 and final["closed"].finish_reason == "stop"
    free = tok.decode(tokens["still"], skip_special_tokens=True)
    assert len(tokens["still"]) == 12 and final["still"].finish_reason == "length" and free != "z" * 12
    core.shutdown()


def test_the_after_reasoning_matcher_walks_and_rolls_back_both_phases(tiny_llama):
    from engine.structured_output.backends import AfterReasoningMatcher
    from engine.processor import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    core = EngineCore(EngineConfig.create(tiny_llama, num_blocks=16))
    grammars = core.structured_output
    request = Request("r", [5], guided(regex="ab", reasoning_end=(7, 8)))
    grammars.add(request)
    while grammars.num_waiting:
        grammars.wait(1.0)
        grammars.take_settled()
    m = request.structured_output.matcher
    assert isinstance(m, AfterReasoningMatcher) and not m.started
    a, b = (tok.convert_tokens_to_ids(c) for c in ("a", "b"))
    words = bitmask_words(core.vocab_size)
    mask = torch.zeros((1, words), dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    assert bool((mask == -1).all())  # reasoning: every token
    assert all(m.accept_token(t) for t in (3, 7, 9, 7)) and not m.started  # 7 then 9: not the marker
    assert m.accept_token(8) and m.started and not m.is_terminated()
    m.fill_bitmask(mask, 0)
    assert not bool((mask == -1).all())  # the grammar's own mask
    assert not m.accept_token(b) and m.accept_token(a)  # "ab": a first
    assert m.validate_tokens([b, a]) == 1 and m.tokens[-1] == a  # read-only
    m.rollback(2)  # "a" and the marker's last token: back in the reasoning
    assert not m.started and m.tokens == [3, 7, 9, 7]
    assert m.validate_tokens([8, a, b]) == 3 and not m.started  # over the marker and through the grammar
    assert m.accept_token(8) and m.accept_token(a) and m.accept_token(b)
    core.shutdown()
    for bad in (("x",), "ab", (-1,), tuple(range(17))):
        with pytest.raises(InvalidRequestError, match="reasoning_end"):
            Guided(regex="a", reasoning_end=bad)
