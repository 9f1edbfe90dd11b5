"""A prefill of TP=a feeding a decode of TP=b through the real services and the router: the same greedy
completions as one TP=1 engine, every prompt's KV pulled (exactly the model's bytes, once), nothing
pinned afterwards, and no process left behind."""
from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import LLM, SamplingParams
from service_procs import alive, children_of, poll_until
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

# (transport, prefill TP, decode TP): every pair of sizes over tcp, a mismatched pair over the others.
PAIRS = [("tcp", 1, 2), ("tcp", 2, 1), ("tcp", 2, 2), ("shm", 2, 1), ("ucx", 1, 2), ("nccl", 2, 1)]
MAX_TOKENS = 10


def tp(size: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(size))


def tp_workers(pid: int) -> list[int]:
    """The tensor-parallel worker ranks among a service's descendants."""
    workers = []
    for p in children_of(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"engine.parallel.worker" in f.read():
                    workers.append(p)
        except OSError:  # gone meanwhile
            pass
    return workers


@pytest.fixture(scope="module", params=PAIRS, ids=lambda p: f"{p[0]}-prefill_tp{p[1]}-decode_tp{p[2]}")
def pd_stack(request, e2e_model):
    transport, prefill_tp, decode_tp = request.param
    stack = Stack(e2e_model, StackSpec(transport, prefills=1, decodes=1, prefill_args=tp(prefill_tp),
                                       decode_args=tp(decode_tp)))
    (prefill,), (decode,) = stack.prefills, stack.decodes
    try:
        # Each rank beyond the first is a worker process under the engine core.
        assert len(tp_workers(prefill.proc.pid)) == prefill_tp - 1
        assert len(tp_workers(decode.proc.pid)) == decode_tp - 1
        processes = [p for s in stack.processes for p in [s.proc.pid, *children_of(s.proc.pid)]]
    except BaseException:
        stack.stop()
        raise
    yield stack
    stack.close()  # every process exits with code 0
    assert poll_until(lambda: not alive(processes), 10), f"left behind: {alive(processes)}"


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(15)
    # One token; a whole block; past the prefill's 64-token budget (chunked there); several blocks.
    return [[rng.randrange(500) for _ in range(n)] for n in (1, 16, 70, 45)]


@pytest.fixture(scope="module")
def expected(e2e_model, prompts):
    """One TP=1 engine, colocated."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(e2e_model).generate(prompts, params)]


def block_bytes(model: str) -> int:
    """One block of the model's whole KV cache (every layer, K and V, every KV head), float32."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["dtype"] == "float32"
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"] * head_dim * 4


def test_greedy_completions_through_the_router_match_tp1_and_pull_the_kv(pd_stack, e2e_model, prompts, expected):
    stack = pd_stack
    (prefill,), (decode,) = stack.prefills, stack.decodes
    sent, received = (prefill.metric("pdserve:kv_transfer_bytes_sent_total"),
                      decode.metric("pdserve:kv_transfer_bytes_total"))

    def complete(prompt):
        status, body = stack.post("/v1/completions", {"model": SERVED_MODEL, "prompt": prompt,
                                                      "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        return body["choices"][0]["text"]

    # Each prompt published once and pulled once, none recomputed; afterwards no block is pinned
    # at the prefill (every rank's lease ended) nor used anywhere.
    with stack.one_transfer_per_request(len(prompts)):
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
    assert got == expected
    # Every prompt block crossed once: each decode rank took its heads, from the prefill ranks holding them.
    want = sum(-(-len(p) // 16) for p in prompts) * block_bytes(e2e_model)
    moved = {}

    def counted() -> bool:
        moved.update(sent=prefill.metric("pdserve:kv_transfer_bytes_sent_total") - sent,
                     received=decode.metric("pdserve:kv_transfer_bytes_total") - received)
        return moved == {"sent": want, "received": want}

    assert poll_until(counted, 10), f"{moved} != {want} bytes each way"
