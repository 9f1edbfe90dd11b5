"""Thinking budgets (vLLM's thinking_token_budget): once an output has reasoned for `budget` tokens
without closing its reasoning, the engine forces the closing tokens. The rule on token ids, the
logits processor, the overlapped decode step, and greedy decoding with budgets token-exact against
transformers' model run with the budget spelled out (reason greedily, then the closing tokens,
then answer greedily), plain, speculative and across the engine core process."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_core import next_decode_step
from engine.logits_processors import apply_logits_processors
from engine.processor import validate_sampling
from engine.request import InvalidRequestError, Request, RequestStatus
from engine.thinking_budget import ThinkingBudget

START, END = 8, 9  # one-token markers for the rule's tables


# ---- the rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("output, want", [
    ([], None), ([1, 2], None),
    ([1, 2, 3], END),  # three reasoning tokens spent: the fourth closes
    ([1, 2, 3, END], None), ([1, END, 2, 3, 4, 5], None),  # closed before the budget: for good
    ([START, 1, 2], None), ([START, 1, 2, 3], END),  # a redundant opening marker is not reasoning
])
def test_an_output_that_starts_in_reasoning(output, want):
    assert ThinkingBudget(3, end=(END,), start=(START,)).forced_token(output) == want


@pytest.mark.parametrize("output, want", [
    ([], None), ([1, 2, 3, 4, 5], None),  # not reasoning (yet): nothing to spend
    ([1, START], None), ([1, START, 2], END), ([1, START, 2, END], None), ([1, START, 2, END, 3, 4], None),
])
def test_an_output_that_opens_its_reasoning(output, want):
    assert ThinkingBudget(1, end=(END,), start=(START,), starts_in_reasoning=False).forced_token(output) == want


def test_a_closing_phrase_and_a_multi_token_marker_are_forced_token_by_token():
    tb = ThinkingBudget(2, end=(9, 10), forced=(4, 5, 9, 10))
    assert [tb.forced_token(o) for o in ([1], [1, 2], [1, 2, 4], [1, 2, 4, 5], [1, 2, 4, 5, 9], [1, 2, 4, 5, 9, 10])] \
        == [None, 4, 5, 9, 10, None]
    # The marker the model writes by itself, token by token, closes the reasoning as well.
    assert tb.forced_token([9, 10, 1, 2, 3]) is None
    # A budget of 0 closes at once.
    assert ThinkingBudget(0, end=(9, 10)).forced_token([]) == 9


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=-1, end=(END,)), "integer >= 0"), (dict(budget=True, end=(END,)), "integer >= 0"),
    (dict(budget=1, end=()), "end marker"),
    (dict(budget=1, end=(END,), starts_in_reasoning=False), "start marker"),
    (dict(budget=1, end=(END,), forced=(END, 1)), "must end with the end marker"),
    (dict(budget=1, end=(END,), forced=(1, END, 2, END)), "hold it only there"),
    (dict(budget=1, end=("</think>",)), "token ids"), (dict(budget=1, end=tuple(range(65))), "at most 64"),
])
def test_malformed_budgets_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        ThinkingBudget(**kwargs)


def test_marker_ids_are_checked_against_the_vocabulary():
    with pytest.raises(InvalidRequestError, match=r"thinking budget token ids \[700\] are outside"):
        validate_sampling(SamplingParams(thinking_budget=ThinkingBudget(4, end=(700,))), vocab_size=512)
    with pytest.raises(InvalidRequestError, match="thinking_budget must be a ThinkingBudget"):
        SamplingParams(thinking_budget={"budget": 4})


# ---- the processor and the overlapped step -------------------------------------------------------

def request(rid: str, output: list[int], **kwargs) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=50, **kwargs))
    r.status = RequestStatus.RUNNING
    for t in output:
        r.append_token(t)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_a_spent_budget_leaves_only_the_closing_token(device):
    vocab = 32
    logits = torch.randn(4, vocab, device=device)
    tb = ThinkingBudget(2, end=(END,))
    rows = [request("spent", [4, 5], thinking_budget=tb),
            request("within", [4], thinking_budget=tb),
            # The closing token is forced over what the processors did to it (a bad word here).
            request("banned", [4, 5], thinking_budget=tb, bad_words_token_ids=[[END]], logit_bias={3: 5.0}),
            request("plain", [4, 5])]
    out = apply_logits_processors(logits, rows).cpu()
    ref = logits.cpu()
    for i in (0, 2):
        assert out[i, END] == ref[i, END] and torch.isneginf(out[i, torch.arange(vocab) != END]).all()
    assert torch.equal(out[1], ref[1]) and torch.equal(out[3], ref[3])
    # A grammar that refuses the token has the last word (its mask, in the input, stays).
    masked = ref[:1].clone()
    masked[0, END] = -math.inf
    assert torch.isneginf(apply_logits_processors(masked.to(device), rows[:1])).all()
    # Nothing spent anywhere: no work, the input itself.
    assert apply_logits_processors(logits, rows[1:2]) is logits


def test_speculative_rows_see_their_drafts(device):
    """One request scored at three positions (its output plus 0, 1, 2 draft tokens): only the
    position whose history spends the budget is forced."""
    tb = ThinkingBudget(3, end=(END,))
    r = request("spec", [4, 5], thinking_budget=tb)
    logits = torch.zeros(3, 16, device=device)
    out = apply_logits_processors(logits, [r, r, r], [[4, 5], [4, 5, 6], [4, 5, 6, END]]).cpu()
    assert not torch.isneginf(out[0]).any() and not torch.isneginf(out[2]).any()
    assert torch.isneginf(out[1]).sum() == 15 and out[1, END] == 0


def test_rows_a_budget_may_close_are_not_launched_ahead():
    """Async scheduling launches step n+1 before n's token is read back: a budgeted row only when
    no token n could make n+1 forced."""
    from engine.model_runner import LaunchedStep
    from engine.scheduler import SchedulerOutput

    tb = ThinkingBudget(4, end=(END,))
    opens = ThinkingBudget(4, end=(END,), start=(START,), starts_in_reasoning=False)
    rows = [request("far", [4], thinking_budget=tb),  # 1 spent; n makes 2, n+1 is free
            request("near", [4, 5, 6], thinking_budget=tb),  # n makes 4: n+1 may be forced
            request("closed", [4, END, 5, 6], thinking_budget=tb),
            request("unopened", [4, 5, 6], thinking_budget=opens),  # n may open it, with 4 to go
            request("unopened-0", [4, 5, 6], thinking_budget=ThinkingBudget(0, end=(END,), start=(START,),
                                                                            starts_in_reasoning=False))]
    so = SchedulerOutput(scheduled=rows, num_scheduled_tokens=[1] * len(rows), new_block_ids=[[] for _ in rows])
    following = next_decode_step(LaunchedStep(so, requests=rows), max_model_len=512, block_size=16)
    assert [r.request_id for r in following.scheduled] == ["far", "closed", "unopened"]


def test_a_closed_reasoning_is_remembered_and_the_output_read_in_place():
    """Once the committed output closed its reasoning, the request says so and is not scanned
    again; before, the rule reads the request's token ids from where its output starts (a
    resumed tail included) without copying them."""
    from engine.thinking_budget import for_request

    tb = ThinkingBudget(2, end=(END,))
    r = request("r", [4], thinking_budget=tb)
    assert for_request(r) == (r.all_token_ids, 3) and not r.thinking_closed
    r.append_token(END)
    assert for_request(r) is None and r.thinking_closed
    # A resumed request: the prompt's last 2 tokens are its earlier output (one reasoning token, then 5).
    resumed = Request("m", [1, 2, 4, 5], SamplingParams(max_tokens=9, resumed_tokens=2, thinking_budget=tb))
    seq, begin = for_request(resumed)
    assert begin == 2 and tb.forced_token(seq, begin) == END
    assert for_request(request("plain", [4])) is None


# ---- the engine, against transformers --------------------------------------------------------------

class HFGreedy:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def extend(self, ids: list[int], n: int) -> list[int]:
        """`n` greedy tokens after `ids`."""
        out: list[int] = []
        for _ in range(n):
            out.append(int(self.model(torch.tensor([ids + out])).logits[0, -1].argmax()))
        return out


MAX_TOKENS = 20


def budgeted_reference(hf: HFGreedy, prompt: list[int], reason_for: int, forced: list[int]) -> list[int]:
    """Greedy for `reason_for` tokens, then `forced`, then greedy to MAX_TOKENS."""
    head = hf.extend(prompt, reason_for) + forced
    return head + hf.extend(prompt + head, MAX_TOKENS - len(head))


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return HFGreedy(tiny_llama)


@pytest.fixture(scope="module")
def cases(hf):
    """(prompt, ThinkingBudget, expected output): budgets of 0, 3 and 7, a closing phrase, a
    two-token marker, and an output that opens its reasoning itself (the marker being a token its
    greedy output writes)."""
    prompts = [[5, 6, 7, 8], [40, 41, 3, 99, 17, 23], [300 + k for k in range(30)]]
    plain = [hf.extend(p, MAX_TOKENS) for p in prompts]
    unused = [t for t in range(100, 512) if all(t not in o for o in plain)]
    end, end2, phrase = (unused[0],), (unused[1], unused[2]), (unused[3], unused[4])
    out = []
    for p, o in zip(prompts, plain):
        out.append((p, ThinkingBudget(3, end=end), budgeted_reference(hf, p, 3, list(end))))
        out.append((p, ThinkingBudget(0, end=end2, forced=phrase + end2), list(phrase + end2)
                    + hf.extend(p + list(phrase + end2), MAX_TOKENS - 4)))
        out.append((p, ThinkingBudget(7, end=end2, forced=phrase + end2),
                    budgeted_reference(hf, p, 7, list(phrase + end2))))
        j = next(i for i in range(2, 10) if o[i] not in o[:i])  # its greedy output opens at j
        opens = ThinkingBudget(2, end=end, start=(o[j],), starts_in_reasoning=False)
        out.append((p, opens, budgeted_reference(hf, p, j + 1 + 2, list(end))))
    return out


def params_of(tb: ThinkingBudget) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, thinking_budget=tb)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_budgeted_greedy_matches_transformers(tiny_llama, cases, async_scheduling, device):
    engine = LLM(tiny_llama, device=device, async_scheduling=async_scheduling)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [p for p, _, _ in cases]
    outs = engine.generate(prompts + prompts[:1], [params_of(tb) for _, tb, _ in cases] + [plain])
    for (p, tb, want), out in zip(cases, outs):
        assert out.outputs[0].token_ids == want, tb
    # In the same batch, a request without a budget is its plain greedy self.
    assert outs[-1].outputs[0].token_ids == HFGreedy(tiny_llama).extend(prompts[0], MAX_TOKENS)


def test_budgets_under_speculative_decoding(tiny_llama, cases):
    """The drafter proposes the model's greedy tokens, never the forced ones: the verifier's rows
    see the drafts as output, force where the budget is spent, and reject what follows."""
    spec = LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama,
                                               "num_speculative_tokens": 3})
    outs = spec.generate([p for p, _, _ in cases], [params_of(tb) for _, tb, _ in cases])
    assert [o.outputs[0].token_ids for o in outs] == [want for _, _, want in cases]
    assert spec.engine.stats()["spec_decode_num_drafts"] > 0


def test_a_resumed_request_keeps_its_budget(tiny_llama, cases):
    """A request resent with its first k tokens as the prompt's tail (resumed_tokens k), as the
    router does when a decode is lost: the budget counts them, so the rest is the same."""
    engine = LLM(tiny_llama)
    for p, tb, want in cases[:4]:
        for k in (1, 3, 5):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - k, ignore_eos=True, thinking_budget=tb,
                                    resumed_tokens=k)
            assert engine.generate([p + want[:k]], params)[0].outputs[0].token_ids == want[k:], (tb, k)


def test_the_engine_core_process_gets_the_budget(tiny_llama, cases):
    """AddRequest crosses to the core process as msgpack: the budget survives it."""
    from engine.async_engine import AsyncEngine

    p, tb, want = cases[2]

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=True, num_blocks=256)
        try:
            return [t async for out in engine.generate(p, params_of(tb)) for t in out.delta_token_ids]
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == want
