"""Thinking budgets at the router: chat's and completions' thinking_token_budget (vLLM's) and
Messages' thinking.budget_tokens become the engines' ThinkingBudget, with the markers of the
--reasoning-parser, where the output starts as the prompt says, and --reasoning-end-str's phrase;
what cannot be honoured is a 400 that names the field."""
from __future__ import annotations

import pytest

from services.router.config import RouterConfig
from services.router.reasoning import END, START
from test_router_reasoning import MESSAGES, THINKING


def budgets(stack) -> list:
    """The ThinkingBudget each engine got for the last request (None where it got none)."""
    return [e.requests[-1].sampling.thinking_budget if e.requests[-1].sampling.HasField("thinking_budget") else None
            for e in (stack.prefills[0].engine, stack.decodes[0].engine)]


def test_chat_budget_reaches_prefill_and_decode_with_the_markers(make_stack, tokenizer):
    stack = make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1")
    status, _, body = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                                          "thinking_token_budget": 5})
    assert status == 200, body
    end = tokenizer.encode(END, add_special_tokens=False)
    start = tokenizer.encode(START, add_special_tokens=False)
    for tb in budgets(stack):  # the prefill samples the first token: it may be the one forced
        assert tb.budget == 5 and list(tb.end_token_ids) == end and list(tb.start_token_ids) == start
        assert tb.starts_in_reasoning and not tb.forced_token_ids  # deepseek_r1 thinks unprompted
    # -1 (vLLM's "unlimited") and no field: no budget.
    for extra in ({"thinking_token_budget": -1}, {}):
        assert stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})[0] == 200
        assert budgets(stack) == [None, None]
    # A budget of 0 is a budget (the first token closes the reasoning).
    stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "thinking_token_budget": 0})
    assert [tb.budget for tb in budgets(stack)] == [0, 0]


def test_where_the_output_starts_follows_the_prompt(make_stack):
    """qwen3 thinks only where it (or its template) opens <think>: a prompt that left it open
    starts in reasoning; one that did not waits for the model's own marker."""
    stack = make_stack(prefill=1, decode=1, reasoning_parser="qwen3")
    stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "thinking_token_budget": 3})
    assert [tb.starts_in_reasoning for tb in budgets(stack)] == [False, False]
    stack.post("/v1/completions", {"prompt": f"Q: 2 + 2?\nA: {START}", "max_tokens": 4, "thinking_token_budget": 3})
    assert [tb.starts_in_reasoning for tb in budgets(stack)] == [True, True]
    stack.post("/v1/completions", {"prompt": f"Q: 2 + 2?\nA: {START} no {END}", "max_tokens": 4,
                                   "thinking_token_budget": 3})
    assert [tb.starts_in_reasoning for tb in budgets(stack)] == [False, False]


def test_completions_of_token_ids_read_their_text(make_stack, tokenizer):
    stack = make_stack(prefill=1, decode=1, reasoning_parser="qwen3")
    opened = tokenizer.encode(f"Q: hi {START}", add_special_tokens=False)
    status, _, body = stack.post("/v1/completions", {"prompt": [opened, opened[:3]], "max_tokens": 4,
                                                     "thinking_token_budget": 2})
    assert status == 200, body
    sent = [r.sampling.thinking_budget.starts_in_reasoning for r in stack.decodes[0].engine.requests[-2:]]
    assert sorted(sent) == [False, True]


def test_reasoning_end_str_is_forced_before_the_marker(make_stack, tokenizer):
    phrase = "Time is up, so I answer now."
    stack = make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1", reasoning_end_str=phrase + END)
    stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "thinking_token_budget": 3})
    end = tokenizer.encode(END, add_special_tokens=False)
    for tb in budgets(stack):
        assert list(tb.forced_token_ids) == tokenizer.encode(phrase, add_special_tokens=False) + end
        assert list(tb.end_token_ids) == end


@pytest.mark.parametrize("kwargs, message", [
    (dict(reasoning_end_str=f"Stop.{END}"), "needs --reasoning-parser"),
    (dict(reasoning_parser="qwen3", reasoning_end_str="Stop."), "must end with </think>"),
    (dict(reasoning_parser="qwen3", reasoning_end_str=f"{END} again {END}"), "hold it only there"),
])
def test_a_bad_reasoning_end_str_stops_the_router_at_start(tiny_model_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(model=tiny_model_path, served_model_name="tiny", prefill=("a:1",), decode=("b:1",), **kwargs)


@pytest.mark.parametrize("value, message", [
    (-2, "non-negative integer or -1"), (2.5, "must be an integer"), (True, "must be an integer"),
    ("5", "must be an integer"),
])
def test_bad_budgets_are_400s(make_stack, value, message):
    stack = make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1")
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        status, _, err = stack.post(path, {**body, "max_tokens": 4, "thinking_token_budget": value})
        assert status == 400 and message in err["error"]["message"] and err["error"]["param"] == "thinking_token_budget"
    assert stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})[0] == 200


def test_a_budget_without_a_reasoning_parser_is_refused(make_stack):
    """vLLM's rule: with no reasoning configured there is no reasoning to bound."""
    stack = make_stack(prefill=1, decode=1)
    status, _, err = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4,
                                                         "thinking_token_budget": 5})
    assert status == 400 and "--reasoning-parser" in err["error"]["message"]
    assert err["error"]["param"] == "thinking_token_budget"


def test_messages_budget_tokens(make_stack, tokenizer):
    script = tokenizer.encode(THINKING, add_special_tokens=False)  # a short answer (the fakes end it)
    fakes = dict(prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])
    stack = make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1", **fakes)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 1500}
    status, _, body = stack.post("/v1/messages", {**ask, "thinking": {"type": "enabled", "budget_tokens": 1200}})
    assert status == 200, body
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]
    assert [tb.budget for tb in budgets(stack)] == [1200, 1200]
    for thinking in ({"type": "disabled"}, {"type": "adaptive"}):
        assert stack.post("/v1/messages", {**ask, "thinking": thinking})[0] == 200
        assert budgets(stack) == [None, None]
    # Anthropic's (and vLLM's) rules: at least 1024, and less than max_tokens.
    for thinking, message in (({"type": "enabled"}, "integer >= 1024"),
                              ({"type": "enabled", "budget_tokens": 1000}, "integer >= 1024"),
                              ({"type": "enabled", "budget_tokens": "2000"}, "integer >= 1024"),
                              ({"type": "enabled", "budget_tokens": 4096}, "less than max_tokens")):
        status, _, err = stack.post("/v1/messages", {**ask, "thinking": thinking})
        assert status == 400 and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error" and message in err["error"]["message"]
        assert "thinking.budget_tokens" in err["error"]["message"]
    # count_tokens takes the same thinking (and checks it) without generating.
    status, _, err = stack.post("/v1/messages/count_tokens", {**ask, "thinking": {"type": "enabled"}})
    assert status == 400 and "thinking.budget_tokens" in err["error"]["message"]
    # A router without a parser has no reasoning to bound: the template still gets enable_thinking,
    # and the whole output is text bounded by max_tokens.
    plain = make_stack(prefill=1, decode=1, **fakes)
    status, _, body = plain.post("/v1/messages", {**ask, "max_tokens": 1100,
                                                  "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert status == 200 and budgets(plain) == [None, None]


def test_generate_takes_a_budget_with_its_token_ids(make_stack):
    """The gRPC front: the caller spells the markers out (no parser needed); a malformed budget or
    ids outside the vocabulary are INVALID_ARGUMENT naming it, and the front keeps serving."""
    import grpc

    from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

    stack = make_stack(prefill=1, decode=1)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)

        def generate(tb: pb.ThinkingBudget):
            return list(stub.Generate(pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(
                max_tokens=4, thinking_budget=tb)), timeout=30))

        assert generate(pb.ThinkingBudget(budget=2, end_token_ids=[7, 8], starts_in_reasoning=True))
        for tb in budgets(stack):
            assert (tb.budget, list(tb.end_token_ids), tb.starts_in_reasoning) == (2, [7, 8], True)
        for tb, message in ((pb.ThinkingBudget(budget=2), "end marker"),
                            (pb.ThinkingBudget(budget=-3, end_token_ids=[7]), "integer >= 0"),
                            (pb.ThinkingBudget(budget=2, end_token_ids=[7], starts_in_reasoning=False), "start marker"),
                            (pb.ThinkingBudget(budget=2, end_token_ids=[99999], starts_in_reasoning=True),
                             "outside the vocabulary")):
            with pytest.raises(grpc.RpcError) as e:
                generate(tb)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
        assert generate(pb.ThinkingBudget(budget=0, end_token_ids=[7], starts_in_reasoning=True))
