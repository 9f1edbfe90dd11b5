"""Pre-flight pair validation: a prefill x decode pair that cannot move KV (another model, KV block
size, dtype, transport, sharding) is refused at the first GetLoad, never chosen, logged once, counted,
listed by /readyz; with no compatible pair at all a request gets a 503 at once."""
from __future__ import annotations

import logging
import time

import grpc
import pytest

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.pairing import pair_incompatibility, valid_sharding

from router_fakes import fake_pairing, toy_generate
from router_harness import wait_until


@pytest.mark.parametrize("tp, heads, valid", [
    (1, 8, True), (2, 8, True), (8, 8, True),  # heads sharded
    (16, 8, True), (4, 2, True), (4, 1, True),  # heads replicated
    (3, 8, False), (6, 4, False), (4, 6, False), (0, 8, False), (2, 0, False),
])
def test_valid_sharding(tp, heads, valid):
    assert valid_sharding(tp, heads) is valid


@pytest.mark.parametrize("prefill, decode, reason", [
    ({}, {}, None),
    ({"tp": 2}, {"tp": 1}, None),  # TP 2 -> 1: the decode pulls both prefill ranks' heads
    ({"tp": 1, "kv_heads": 8}, {"tp": 4, "kv_heads": 8}, None),
    ({"tp": 4, "kv_heads": 2}, {"tp": 2, "kv_heads": 2}, None),  # replicated on the prefill side
    ({"model": "tiny"}, {"model": "other"}, "model tiny (fp-tiny) vs other (fp-other)"),
    ({"block_size": 16}, {"block_size": 32}, "KV block size 16 vs 32"),
    ({"dtype": "float32"}, {"dtype": "float16"}, "KV dtype float32 vs float16"),
    ({"kv_heads": 2}, {"kv_heads": 4}, "total KV heads 2 vs 4"),
    ({"num_layers": 2}, {"num_layers": 3}, "KV layout "),  # the layers differ: only the fingerprint says so
    ({"transport": "tcp"}, {"transport": "shm"}, "KV transport tcp vs shm"),
    ({}, {"transport": ""}, "KV transport tcp vs none"),  # a colocated engine is no decode to pull into
    ({"tp": 3, "kv_heads": 8}, {"kv_heads": 8}, "prefill tensor-parallel size 3 cannot shard 8 KV heads"),
    ({"kv_heads": 4}, {"tp": 3, "kv_heads": 4}, "decode tensor-parallel size 3 cannot shard 4 KV heads"),
    ({"block_size": 16, "dtype": "float32"}, {"block_size": 32, "dtype": "bfloat16"},
     "KV block size 16 vs 32; KV dtype float32 vs bfloat16"),
])
def test_pair_rule(prefill, decode, reason):
    got = pair_incompatibility(fake_pairing(**prefill), fake_pairing(**decode))
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got
    # The rule is symmetric in what it refuses.
    assert (pair_incompatibility(fake_pairing(**decode), fake_pairing(**prefill)) is None) == (reason is None)


MISFITS = {"other model": fake_pairing(model="other"), "block size": fake_pairing(block_size=32),
           "dtype": fake_pairing(dtype="float16"), "transport": fake_pairing(transport="shm")}
WHY = {"other model": "model tiny (fp-tiny) vs other (fp-other)", "block size": "KV block size 16 vs 32",
       "dtype": "KV dtype float32 vs float16", "transport": "KV transport tcp vs shm"}


def test_requests_go_only_to_the_compatible_decode(make_stack, tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="services.router.pairing")
    stack = make_stack(prefill=1, decode=5, decode_kwargs=[{}] + [{"pairing": p} for p in MISFITS.values()])
    prompt = tokenizer.encode("Hello world")
    for _ in range(8):
        status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
        assert status == 200, body
        assert body["choices"][0]["text"] == tokenizer.decode(toy_generate(prompt, 4)[0])
    good, *misfits = stack.decodes
    assert len(good.engine.requests) == 8
    assert all(not d.engine.requests for d in misfits)
    # Logged once per pair, with both addresses and what differs.
    prefill = stack.prefills[0].address
    for decode, name in zip(misfits, MISFITS):
        line = f"prefill {prefill} and decode {decode.address} cannot pair: {WHY[name]}"
        assert sum(r.getMessage() == line for r in caplog.records) == 1, (line, caplog.text)
    assert stack.metric("pdserve:router_incompatible_pairs") == 4
    status, _, ready = stack.request("GET", "/readyz")
    assert status == 200
    assert sorted((p["decode"], p["reason"]) for p in ready["incompatible_pairs"]) == sorted(
        (d.address, WHY[name]) for d, name in zip(misfits, MISFITS))


@pytest.mark.parametrize("misfit", ["other model", "block size"])
def test_no_compatible_pair_is_a_503_at_once(make_stack, misfit):
    stack = make_stack(prefill=1, decode=2, decode_kwargs=[{"pairing": MISFITS[misfit]}] * 2)
    start = time.monotonic()
    status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
    assert time.monotonic() - start < 2.0
    assert status == 503, body
    assert body["error"]["code"] == "no_compatible_pair"
    assert body["error"]["type"] == "service_unavailable"
    for d in stack.decodes:
        assert f"decode {d.address} cannot pair: {WHY[misfit]}" in body["error"]["message"]
    assert all(not s.engine.requests for s in stack.prefills + stack.decodes)  # no prefill ran for nothing
    status, _, ready = stack.request("GET", "/readyz")
    assert status == 503 and ready["error"]["code"] == "no_compatible_pair"
    with grpc.insecure_channel(stack.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerateStub(channel).Generate(
                pb.GenerateRequest(text="Hello world", sampling=pb.SamplingParams(max_tokens=4)), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert WHY[misfit] in err.value.details()


def test_an_instance_is_paired_only_once_its_descriptor_arrives(make_stack, loop_thread):
    stack = make_stack(prefill=1, decode=1)
    decode = stack.decodes[0]
    inst = stack.router.pool.instances("decode")[0]
    # The pod is replaced: while the new one has no load report it is not paired.
    decode.engine.load_unavailable = True
    loop_thread.run(decode.set_serving(False))
    wait_until(lambda: not inst.healthy, what="the decode to be seen down")
    asked = decode.engine.load_requests
    loop_thread.run(decode.set_serving(True))
    # Several health checks of the serving instance, each asking again for the report, refused.
    wait_until(lambda: decode.engine.load_requests >= asked + 2, what="the report asked for again")
    status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
    assert status == 503 and body["error"]["code"] == "no_compatible_pair", body
    assert f"decode {decode.address} cannot pair: not described yet" in body["error"]["message"]
    assert not decode.engine.requests
    # Its report comes, from a version with another block size: refused; then the right one: paired.
    decode.engine.pairing = fake_pairing(block_size=32)
    decode.engine.load_unavailable = False
    wait_until(lambda: stack.metric("pdserve:router_incompatible_pairs") == 1, what="the pair refused")
    status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
    assert status == 503 and "KV block size 16 vs 32" in body["error"]["message"], body
    decode.engine.pairing = fake_pairing()
    loop_thread.run(decode.set_serving(False))
    wait_until(lambda: not inst.healthy, what="the decode to be seen down")
    loop_thread.run(decode.set_serving(True))
    # The report is read before the instance is marked healthy again: wait for both.
    wait_until(lambda: stack.metric("pdserve:router_incompatible_pairs") == 0 and inst.healthy,
               what="the pair accepted")
    status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
    assert status == 200, body
    assert len(decode.engine.requests) == 1


def test_colocated_instances_are_not_paired(make_stack, tokenizer):
    stack = make_stack(prefill=0, decode=2, decode_kwargs=[{"pairing": fake_pairing(transport="")},
                                                           {"pairing": fake_pairing(model="other", transport="")}])
    for _ in range(4):
        status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
        assert status == 200, body
    assert stack.metric("pdserve:router_incompatible_pairs") == 0
    assert sum(len(d.engine.requests) for d in stack.decodes) == 4


def test_a_refused_pair_is_logged_once_across_restarts(make_stack, loop_thread, caplog):
    caplog.set_level(logging.WARNING, logger="services.router.pairing")
    stack = make_stack(prefill=1, decode=2, decode_kwargs=[{}, {"pairing": MISFITS["dtype"]}])
    odd, inst = stack.decodes[1], stack.router.pool.instances("decode")[1]
    for _ in range(2):  # restarted as the same version: refused again, not logged again
        loop_thread.run(odd.set_serving(False))
        wait_until(lambda: not inst.healthy, what="the decode to be seen down")
        loop_thread.run(odd.set_serving(True))
        wait_until(lambda: inst.healthy and inst.described, what="the decode back with its report")
    assert stack.metric("pdserve:router_incompatible_pairs") == 1
    assert sum("cannot pair" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_an_engine_without_a_descriptor_is_paired_unchecked(make_stack, caplog):
    """An engine older than the router reports no descriptor: served as before, with a warning."""
    caplog.set_level(logging.WARNING, logger="services.router.pairing")
    stack = make_stack(prefill=1, decode=1, decode_kwargs=[{"pairing": None}])
    assert not stack.router.pool.instances("decode")[0].load.HasField("pairing")
    status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
    assert status == 200, body
    assert f"decode instance {stack.decodes[0].address} reports no pairing descriptor" in caplog.text
    assert len(stack.decodes[0].engine.requests) == 1


def test_a_changed_descriptor_is_seen_at_the_next_load_report(make_stack):
    """With load polling (least_load) a descriptor that changes under the same address (a pod of
    another version behind it) is checked at the next report, with no health flap in between."""
    stack = make_stack(prefill=1, decode=2, policy="least_load", load_poll_interval_s=0.05)
    changed = stack.decodes[1]
    changed.engine.pairing = fake_pairing(block_size=32)
    wait_until(lambda: stack.metric("pdserve:router_incompatible_pairs") == 1, what="the pair refused")
    before = len(changed.engine.requests)
    for _ in range(6):
        status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 4})
        assert status == 200, body
    assert len(changed.engine.requests) == before
    changed.engine.pairing = fake_pairing()
    wait_until(lambda: stack.metric("pdserve:router_incompatible_pairs") == 0, what="the pair accepted again")
