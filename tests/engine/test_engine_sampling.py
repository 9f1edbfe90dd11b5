"""Sampling: seeded reproducibility, batch independence, filters against a plain reference."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sampler import Sampler, apply_top_k_top_p_min_p


def reference_filter(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The surviving token ids, computed the slow obvious way."""
    ids = sorted(range(len(row)), key=lambda i: -row[i])
    keep = set(range(len(row)))
    z = sum(math.exp(v) for v in row)
    probs = [math.exp(v) / z for v in row]
    if min_p > 0:
        keep = {i for i in keep if probs[i] >= min_p * max(probs)}
    if top_k > 0:
        keep &= set(ids[:top_k])
    if top_p < 1.0:
        kept = [i for i in ids if i in keep]
        zk = sum(probs[i] for i in kept)
        mass, nucleus = 0.0, set()
        for i in kept:
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += probs[i] / zk
        keep = nucleus
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.9, 0.0),
                                               (0, 1.0, 0.2), (8, 0.7, 0.05), (1, 1.0, 0.0)])
def test_filters_match_reference(top_k, top_p, min_p, device):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g) * 2
    n = logits.shape[0]
    out = apply_top_k_top_p_min_p(
        logits.to(device),
        torch.full((n,), top_k if top_k else 40, device=device) if top_k else None,
        torch.full((n,), top_p, device=device) if top_p < 1 else None,
        torch.full((n,), min_p, device=device) if min_p > 0 else None).cpu()
    for row_in, row_out in zip(logits.tolist(), out):
        survivors = set(torch.nonzero(torch.isfinite(row_out)).flatten().tolist())
        assert survivors == reference_filter(row_in, top_k, top_p, min_p)


def test_sampling_follows_the_distribution(device):
    sampler = Sampler(seed=0, device=device)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]], device=device)).repeat(4000, 1)
    reqs = [Request(str(i), [1], SamplingParams(temperature=1.0, max_tokens=1)) for i in range(4000)]
    tokens, _ = sampler(logits, reqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03)


def test_logprobs_are_log_softmax_of_the_logits(device):
    sampler = Sampler(device=device)
    logits = torch.randn(2, 10)
    reqs = [Request(rid, [1], SamplingParams(temperature=0, max_tokens=1, logprobs=3)) for rid in "ab"]
    tokens, lps = sampler(logits.to(device), reqs)
    ref = torch.log_softmax(logits, -1)
    for i, (tok, (lp, top)) in enumerate(zip(tokens, lps)):
        assert tok == int(ref[i].argmax())
        assert lp == pytest.approx(float(ref[i, tok]))
        assert [t for t, _ in top] == ref[i].topk(3).indices.tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama, device):
    llm = LLM(tiny_llama, device=device)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The old king"], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["Green river stone", "The old king", "a b c d e f"], [noise, seeded, noise])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["The old king"], seeded)[0].outputs[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate(["The old king"], other_seed)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("moved_after", [1, 5])
def test_a_seeded_request_resumed_elsewhere_goes_on_with_its_random_stream(tiny_llama, device, moved_after):
    """After a migration the router resends prompt + output so far with resumed_tokens: the
    seeded request skips the draws those tokens used, so its answer is the undisturbed one."""
    llm = LLM(tiny_llama, device=device)
    kw = dict(temperature=0.9, top_k=40, seed=77, ignore_eos=True, frequency_penalty=0.3)
    whole = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, **kw))[0].outputs[0].token_ids
    before = whole[:moved_after]
    rest = llm.generate([[5, 6, 7, 8, *before]], SamplingParams(max_tokens=12 - moved_after, resumed_tokens=moved_after,
                                                               **kw))[0].outputs[0].token_ids
    assert before + rest == whole
    fresh = llm.generate([[5, 6, 7, 8, *before]], SamplingParams(max_tokens=12 - moved_after, **kw))[0].outputs[0]
    assert before + fresh.token_ids != whole  # without it: the stream restarts at the move


def test_prompt_logprobs_match_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama, max_num_batched_tokens=16)  # chunked: logprobs come chunk by chunk
    prompt = list(range(5, 45))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) - 1
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    ranks = out.prompt_logprob_ranks
    assert len(ranks) == len(entries)
    for i, entry in enumerate(entries):
        token = prompt[i + 1]
        assert entry[token] == pytest.approx(float(ref[i, token]), abs=1e-4)
        assert len(entry) >= 2
        # vLLM's rank: 1 + the tokens likelier than the prompt's own (a random model's prompt
        # tokens are rarely its likeliest: the ranks spread).
        assert ranks[i] == 1 + int((ref[i] > ref[i, token]).sum())
    assert len(set(ranks)) > 5
    llm.engine.check_integrity(expect_all_free=True)


def test_whole_vocabulary_logprobs_are_the_distribution(tiny_llama):
    """logprobs and prompt_logprobs as wide as the vocabulary (vLLM's -1 under --max-logprobs -1)
    are each position's whole distribution, transformers' log-softmax entry by entry; one more is
    refused."""
    from transformers import AutoModelForCausalLM

    from engine.request import InvalidRequestError

    llm = LLM(tiny_llama)
    vocab = llm.engine.vocab_size
    prompt = list(range(5, 17))
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=vocab,
                                                prompt_logprobs=vocab))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    rows = list(out.prompt_logprobs) + list(out.outputs[0].logprobs)
    assert len(rows) == len(prompt) - 1 + len(tokens)
    for i, entry in enumerate(rows):
        assert len(entry) == vocab
        got = torch.tensor([entry[t] for t in range(vocab)])
        torch.testing.assert_close(got, ref[i], atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequestError, match="vocabulary size"):
        llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=vocab + 1))
    llm.engine.check_integrity(expect_all_free=True)


def test_min_tokens_hides_eos_until_reached(device):
    sampler = Sampler(device=device)
    logits = torch.zeros(1, 8, device=device)
    logits[0, 3] = 10.0  # EOS is by far the most likely
    req = Request("m", [1, 2], SamplingParams(temperature=0, max_tokens=5, min_tokens=2), eos_token_id=3)
    assert sampler(logits, [req])[0][0] != 3
    req.append_token(5)
    req.append_token(6)  # min_tokens reached: EOS is allowed again
    assert sampler(logits, [req])[0] == [3]
