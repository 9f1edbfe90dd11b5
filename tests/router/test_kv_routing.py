"""kv_aware routing and conditional disaggregation: the cost and the decisions with fake instances,
then through the HTTP gateway with fake engines that publish real KV events."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
from types import SimpleNamespace

import pytest

from engine.block_hash import hash_request_tokens
from engine.kv_events import BlockStored, KVEventBatch, KVEventsConfig, ZmqEventPublisher
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.router.cli import add_router_parser
from services.router.config import RouterConfig
from services.router.instances import Instance
from services.router.kv_index import KvIndex
from services.router.metrics import RouterMetrics
from services.router.pd_policy import PdPolicy
from services.router.policy import Auto, KvAware, RouteRequest, make_policy
from services.router.server import Router

from router_fakes import FakeEngine, FakeServer, KVRegistry
from router_harness import Stack, wait_until

BS = 4
PROMPT = list(range(100, 140))  # 10 blocks


def inst(address: str, load: int = 0, streams: int = 0, prefilling: dict | None = None, **report):
    fake = SimpleNamespace(address=address, load_score=load, load=pb.LoadReport(**report) if report else None,
                           streams=streams, prefilling=prefilling or {})
    fake.queued_tokens = Instance.queued_tokens.fget(fake)  # the router's own rule
    return fake


def index_with(holdings: dict[str, list[int]], salt: str | None = None, gap_before: dict | None = None) -> KvIndex:
    """An index where instance -> the leading tokens of PROMPT it caches (in blocks of BS)."""
    index = KvIndex()
    for address, tokens in holdings.items():
        stream = index.add_stream(address, "tcp://x:1", "", epoch=1, block_size=BS)
        hashes = hash_request_tokens(tokens, BS, salt)
        batch = KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, tokens, BS, None, "GPU", None)], epoch=1)
        assert index.apply(stream, 0, batch)
        if gap_before and address in gap_before:
            index.lost_gap(stream, gap_before[address])
    return index


def route(prompt=PROMPT, role="decode", salt=None) -> RouteRequest:
    return RouteRequest("r", role, prompt, cache_salt=salt)


def test_cost_is_tokens_left_to_prefill_plus_load():
    index = index_with({"warm": PROMPT[:32], "cold": []})
    policy = KvAware(index, overlap_weight=1.0)
    warm, cold = inst("warm", load=0), inst("cold", load=0)
    assert policy.costs([warm, cold], route()) == [8, 40]
    assert policy.select([cold, warm], route()) is warm
    warm.load_score = 33  # busier than the cache saves: 8 + 33 > 40 + 0
    assert policy.select([cold, warm], route()) is cold
    assert KvAware(index, overlap_weight=2.0).select([cold, warm], route()) is warm  # 16 + 33 < 80
    assert policy.uncached_tokens(warm, route()) == 8 and policy.uncached_tokens(inst("unknown"), route()) is None


def test_by_default_a_tenant_stays_on_its_warm_instance_while_it_computes_a_prompt_as_long():
    # A tenant's prefix (32 of 40 tokens) is cached on "warm", which is busy with another
    # tenant's cold prompt as long as this whole one (40 tokens + 16 to generate); "cold" is
    # idle. Moving costs as much time as waiting, and computes the prefix a second time into a
    # second cache: the router's default weight keeps the tenant where its prefix is.
    index = index_with({"warm": PROMPT[:32], "cold": []})
    parser = add_router_parser(argparse.ArgumentParser().add_subparsers())
    default = parser.parse_args(["--model", "m", "--decode", "d:1"]).kv_overlap_score_weight  # what `pdserve router` runs with
    assert default == next(f.default for f in dataclasses.fields(RouterConfig) if f.name == "kv_overlap_score_weight")
    policy = make_policy("kv_aware", index, overlap_weight=default)
    warm, cold = inst("warm", load=40 + 16), inst("cold", load=0)
    assert policy.select([cold, warm], route()) is warm
    warm.load_score = 40 * 3  # several prompts queued there: it is worth moving
    assert policy.select([cold, warm], route()) is cold


def test_only_the_leading_run_of_blocks_counts_and_salts_isolate():
    index = index_with({"a": PROMPT[:8] + [0] * 4 + PROMPT[12:40]})  # block 2 differs: the run stops there
    assert KvAware(index, overlap_weight=1.0).costs([inst("a")], route()) == [32]
    salted = index_with({"a": PROMPT}, salt="tenant-1")
    policy = KvAware(salted, overlap_weight=1.0)
    assert policy.costs([inst("a")], route(salt="tenant-1")) == [0]
    assert policy.costs([inst("a")], route(salt="tenant-2")) == [40]
    assert policy.costs([inst("a")], route()) == [40]


def test_entries_older_than_an_unreplayed_gap_count_less():
    index = index_with({"stale": PROMPT, "fresh": PROMPT[:20]}, gap_before={"stale": 5})
    index.low_confidence_weight = 0.5
    policy = KvAware(index, overlap_weight=1.0)
    # stale: 40 cached tokens at half confidence -> 20 left; fresh: 20 certain -> 20 left; a tie.
    assert policy.costs([inst("stale"), inst("fresh")], route()) == [20, 20]
    index.low_confidence_weight = 0.25
    assert policy.select([inst("stale"), inst("fresh")], route()).address == "fresh"


def test_ties_rotate_and_temperature_spreads_near_ties():
    index = index_with({"a": [], "b": []})
    a, b = inst("a"), inst("b")
    policy = KvAware(index)
    assert [policy.select([a, b], route()).address for _ in range(4)] == ["a", "b", "a", "b"]
    near = index_with({"a": PROMPT[:36], "b": PROMPT[:32]})  # costs 4 and 8
    assert {KvAware(near).select([a, b], route()).address for _ in range(20)} == {"a"}
    hot = KvAware(near, temperature=1.0, rng=random.Random(3))
    picks = [hot.select([a, b], route()).address for _ in range(400)]
    # softmax(-normalised cost / T): a has weight e^0, b e^-1 -> about 73% / 27%.
    assert 0.62 < picks.count("a") / 400 < 0.84


def test_auto_is_round_robin_until_instances_publish_events():
    index = KvIndex()
    policy = make_policy("auto", index)
    assert isinstance(policy, Auto) and policy.needs_load_reports
    a, b = inst("a"), inst("b")
    assert [policy.select([a, b], route()).address for _ in range(3)] == ["a", "b", "a"]
    stream = index.add_stream("b", "tcp://x:1", "", epoch=1, block_size=BS)
    index.apply(stream, 0, KVEventBatch(0.0, [BlockStored(hash_request_tokens(PROMPT, BS), None, PROMPT, BS,
                                                          None, "GPU", None)], epoch=1))
    assert {policy.select([a, b], route()).address for _ in range(3)} == {"b"}
    with pytest.raises(ValueError, match="kv_aware"):
        make_policy("prefix_magic")


class FakePool:
    def __init__(self, prefill: list, decode: list, refused: tuple = ()) -> None:
        self.roles = {"prefill": prefill, "decode": decode}
        # (prefill, decode) addresses that cannot pair (pairing.PairTable's verdicts)
        self.pairs = SimpleNamespace(can_pair=lambda p, d: (p.address, d.address) not in refused)

    def healthy(self, role: str) -> list:
        return self.roles[role]


def decide(mode: str, index: KvIndex, prefill_load: int = 0, decode_report=None, prompt=PROMPT,
           refused: tuple = (), prefill_report=None, **kw):
    metrics = RouterMetrics()
    decode = inst("d", **(decode_report or {}))
    pool = FakePool([inst("p", load=prefill_load, **(prefill_report or {}))], [decode], refused)
    pd = PdPolicy(mode, make_policy("auto", index), pool, metrics, **kw)
    decision = pd.decide(route(prompt))
    return decision, metrics


@pytest.mark.parametrize("cached,prefill_load,report,expect", [
    (36, 0, None, (False, "short_uncached")),  # 4 tokens left to compute here
    (0, 0, None, (True, "long_uncached")),
    (0, 50_000, dict(num_waiting=0, kv_cache_usage=0.3), (False, "prefill_queue")),
    (0, 50_000, dict(num_waiting=3, kv_cache_usage=0.3), (True, "long_uncached")),  # the decode has no room
    (0, 50_000, dict(num_waiting=0, kv_cache_usage=0.95), (True, "long_uncached")),
])
def test_conditional_decisions(cached, prefill_load, report, expect):
    index = index_with({"d": PROMPT[:cached]})
    decision, metrics = decide("conditional", index, prefill_load, report, max_local_prefill_tokens=16,
                               max_prefill_queue_tokens=10_000)
    assert (decision.disaggregate, decision.reason) == expect
    if not decision.disaggregate:
        assert decision.route.prefer == "d"  # the decode the decision was made for serves it
    label = "prefill_remote" if expect[0] else "decode_local"
    assert metrics.registry.get_sample_value("pdserve:router_pd_decisions_total",
                                             {"decision": label, "reason": expect[1]}) == 1


@pytest.mark.parametrize("cached,prefill_load,expect", [
    (0, 40, (True, "long_uncached")),  # a queue as long as the prompt: still worth the wait
    (0, 41, (False, "prefill_queue")),  # longer than computing it takes: the decode computes it
    (24, 17, (False, "prefill_queue")),  # 16 tokens left to compute here: the bound is what is uncached
    (24, 16, (True, "long_uncached")),
])
def test_by_default_the_prefill_queue_bound_is_the_prompts_own_uncached_tokens(cached, prefill_load, expect):
    decision, _ = decide("conditional", index_with({"d": PROMPT[:cached]}), prefill_load,
                         dict(num_waiting=0, kv_cache_usage=0.3), max_local_prefill_tokens=8)
    assert (decision.disaggregate, decision.reason) == expect


@pytest.mark.parametrize("running,prefill_load,expect", [
    (0, 41, (False, "prefill_queue")),  # an idle decode: the prompt's own 40 tokens
    (1, 41, (True, "long_uncached")),  # one stream decoding there would stall for the prompt's compute
    (1, 80, (True, "long_uncached")),
    (1, 81, (False, "prefill_queue")),  # the wait saved exceeds the prompt's compute, once per stream held up
    (3, 160, (True, "long_uncached")),
    (3, 161, (False, "prefill_queue")),
])
def test_the_default_queue_bound_counts_the_streams_a_local_prompt_would_stall(running, prefill_load, expect):
    decision, _ = decide("conditional", index_with({"d": []}), prefill_load,
                         dict(num_waiting=0, num_running=running, kv_cache_usage=0.3), max_local_prefill_tokens=8)
    assert (decision.disaggregate, decision.reason) == expect


@pytest.mark.parametrize("reported,streams,prefill_load,expect", [
    (0, 2, 120, (True, "long_uncached")),  # the report is a poll old: the router's own open streams count
    (0, 2, 121, (False, "prefill_queue")),
    (3, 1, 160, (True, "long_uncached")),  # other routers' requests: the report's count, the larger
    (3, 1, 161, (False, "prefill_queue")),
])
def test_the_streams_counted_are_the_more_of_the_report_and_the_routers_own(reported, streams, prefill_load, expect):
    metrics = RouterMetrics()
    decode = inst("d", streams=streams, num_waiting=0, num_running=reported, kv_cache_usage=0.3)
    pd = PdPolicy("conditional", make_policy("auto", index_with({"d": []})),
                  FakePool([inst("p", load=prefill_load)], [decode]), metrics, max_local_prefill_tokens=8)
    decision = pd.decide(route(PROMPT))
    assert (decision.disaggregate, decision.reason) == expect


@pytest.mark.parametrize("prefilling,prefill_load,decodes,expect", [
    # The 40-token prompt on an idle decode, the prefill's queue 70 tokens: worth computing here
    # alone, but "a" (10 tokens) reaches the decode 10 tokens into it and waits out the other 30.
    ({"a": 10, "b": 60}, 70, 1, (True, "long_uncached")),  # bound 40 + 30
    ({"a": 10, "b": 60}, 71, 1, (False, "prefill_queue")),  # one token over the bound
    ({"a": 10, "b": 60}, 70, 2, (False, "prefill_queue")),  # "a" goes to either decode: 15 expected here
    ({"a": 50, "b": 50}, 100, 1, (False, "prefill_queue")),  # both finish after the local prompt: bound 40
    # Its load report no longer counts 15 of "a"'s 30 tokens: "a" ends at 15, stalled for 25.
    ({"a": 30, "b": 45}, 60, 1, (True, "long_uncached")),  # bound 40 + 25 = 65 > 60
    ({"a": 5, "b": 5, "c": 100}, 111, 1, (False, "prefill_queue")),  # two arrive, stalled 35 + 30: bound 105
    # The load shows 106 of their 110 tokens: "a" ends at 1 (stalled 39), "b" at 6 (34): bound 113.
    ({"a": 5, "b": 5, "c": 100}, 106, 1, (True, "long_uncached")),
])
def test_prompts_the_prefill_finishes_during_a_local_prompt_count_as_streams_it_stalls(prefilling, prefill_load,
                                                                                   decodes, expect):
    metrics = RouterMetrics()
    pool = FakePool([inst("p", load=prefill_load, prefilling=prefilling)],
                    [inst(f"d{i}", num_waiting=0, kv_cache_usage=0.3) for i in range(decodes)])
    index = index_with({f"d{i}": [] for i in range(decodes)})
    decision = PdPolicy("conditional", make_policy("auto", index), pool, metrics,
                        max_local_prefill_tokens=8).decide(route(PROMPT))
    assert (decision.disaggregate, decision.reason) == expect


def test_a_fixed_queue_bound_is_the_operators_whatever_runs_on_the_decode():
    decision, _ = decide("conditional", index_with({"d": []}), 10_001,
                         dict(num_waiting=0, num_running=50, kv_cache_usage=0.3), max_local_prefill_tokens=8,
                         max_prefill_queue_tokens=10_000)
    assert (decision.disaggregate, decision.reason) == (False, "prefill_queue")


def test_a_fixed_queue_bound_does_not_weigh_the_prompts_arriving_from_the_prefill():
    # By default "a" arriving 10 tokens into the 40-token local prompt raises the bound to 70;
    # an operator's bound of 69 is the bound.
    pool = FakePool([inst("p", load=70, prefilling={"a": 10, "b": 60})],
                    [inst("d0", num_waiting=0, kv_cache_usage=0.3)])
    for fixed, expect in ((None, (True, "long_uncached")), (69, (False, "prefill_queue"))):
        decision = PdPolicy("conditional", make_policy("auto", index_with({"d0": []})), pool, RouterMetrics(),
                            max_local_prefill_tokens=8, max_prefill_queue_tokens=fixed).decide(route(PROMPT))
        assert (decision.disaggregate, decision.reason) == expect


@pytest.mark.parametrize("prefill_load,expect", [
    (2048 + 40, (True, "long_uncached")),  # one step's worth may be running now: 40 queued, as long as the prompt
    (2048 + 41, (False, "prefill_queue")),  # 41 surely wait behind the running step
    (1100, (True, "long_uncached")),  # a long prompt in the running step is computing, not queueing
])
def test_the_prefill_queue_leaves_out_what_its_running_step_may_hold(prefill_load, expect):
    decision, _ = decide("conditional", index_with({"d": []}), prefill_load, dict(num_waiting=0, kv_cache_usage=0.3),
                         prefill_report=dict(max_num_batched_tokens=2048), max_local_prefill_tokens=8)
    assert (decision.disaggregate, decision.reason) == expect


def test_a_decode_no_prefill_pairs_with_computes_long_prompts_itself():
    decision, _ = decide("conditional", index_with({"d": []}), refused=(("p", "d"),), max_local_prefill_tokens=16)
    assert (decision.disaggregate, decision.reason) == (False, "no_prefill")


def test_short_prompts_stay_local_even_when_the_decode_cache_is_cold():
    decision, _ = decide("conditional", index_with({"d": []}), prompt=PROMPT[:12], max_local_prefill_tokens=16)
    assert (decision.disaggregate, decision.reason) == (False, "short_uncached")


def test_fixed_and_auto_pd_policies():
    index = index_with({"d": PROMPT})
    assert decide("always", index)[0].disaggregate and decide("always", index)[0].reason == "always"
    assert not decide("never", index)[0].disaggregate
    assert (decide("auto", index, max_local_prefill_tokens=16)[0].reason) == "short_uncached"
    assert decide("auto", KvIndex())[0].reason == "no_kv_events"  # no events: every prompt to a prefill
    with pytest.raises(ValueError, match="pd policy"):
        PdPolicy("sometimes", make_policy("auto", KvIndex()), FakePool([], []), RouterMetrics())


# -- through the HTTP gateway, with fakes publishing real KV events ---------------------------------


class PublishingFake(FakeEngine):
    """A fake engine that caches what it computes and says so in KV events, as an engine does."""

    def __init__(self, role: str, registry: KVRegistry, name: str) -> None:
        super().__init__(role, registry, name=name)
        self.publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                                                          replay_endpoint="tcp://127.0.0.1:0"))
        self.extra_load = 0  # tokens queued elsewhere, added to what GetLoad reports
        self.salts: list[str] = []

    def _cache(self, prompt, sampling: pb.SamplingParams) -> None:
        self.salts.append(sampling.cache_salt)
        hashes = hash_request_tokens(list(prompt), BS, sampling.cache_salt or None)
        self.publisher.publish([BlockStored(hashes, None, list(prompt)[:len(hashes) * BS], BS, None, "GPU", None)])

    async def Prefill(self, request, context):
        self._cache(request.prompt_token_ids, request.sampling)
        return await super().Prefill(request, context)

    async def Decode(self, request, context):
        self._cache(request.prompt_token_ids, request.sampling)  # computed here, or pulled: cached here
        async for msg in super().Decode(request, context):
            yield msg

    async def GetLoad(self, request, context):
        report = await super().GetLoad(request, context)
        report.block_size = BS
        report.outstanding_tokens += self.extra_load
        report.kv_events_endpoint = self.publisher.endpoint.replace("127.0.0.1", "0.0.0.0")  # a wildcard bind
        report.kv_events_replay_endpoint = self.publisher.replay_endpoint
        report.kv_events_epoch = self.publisher.epoch
        return report


@pytest.fixture
def kv_stack(loop_thread, tiny_model_path, tokenizer):
    made = []

    def make(prefill: int, decode: int, **config) -> Stack:
        async def build():
            registry = KVRegistry()
            fakes = [PublishingFake("prefill", registry, f"prefill-{i}") for i in range(prefill)]
            fakes += [PublishingFake("decode", registry, f"decode-{i}") for i in range(decode)]
            servers = [await FakeServer(f).start() for f in fakes]
            cfg = dict(model=tiny_model_path, served_model_name="tiny", host="127.0.0.1", port=0, grpc_port=-1,
                       prefill=tuple(s.address for s in servers[:prefill]),
                       decode=tuple(s.address for s in servers[prefill:]),
                       health_check_interval_s=0.1, load_poll_interval_s=0.05, drain_timeout_s=5.0)
            cfg.update(config)
            router = Router(RouterConfig(**cfg), tokenizer=tokenizer)
            await router.start()
            return Stack(loop_thread, router, servers[:prefill], servers[prefill:])

        stack = loop_thread.run(build())
        made.append(stack)
        wait_until(lambda: len(stack.router.kv_index.streams) == prefill + decode, what="KV subscriptions")
        return stack

    yield make
    for stack in made:
        async def teardown(stack=stack):
            await stack.router.stop()
            for s in stack.prefills + stack.decodes:
                await s.stop(0)
                s.engine.publisher.shutdown()
        loop_thread.run(teardown())


def complete(stack: Stack, prompt: list[int], **extra) -> dict:
    status, _, body = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, **extra})
    assert status == 200, body
    return body


def indexed(stack: Stack, server, prompt, salt=None) -> bool:
    hashes = hash_request_tokens(prompt, BS, salt)
    return stack.router.kv_index.matched_tokens(server.address, hashes) == len(hashes) * BS


def test_kv_aware_sends_shared_prefixes_to_the_instance_that_caches_them(kv_stack):
    stack = kv_stack(0, 3, policy="kv_aware", kv_overlap_score_weight=4.0)  # the fakes report 100 tokens a request
    tenant = [7] * 48
    complete(stack, tenant + [8, 9, 10, 11])
    owner = next(d for d in stack.decodes if d.engine.requests)
    wait_until(lambda: indexed(stack, owner, tenant), what="the first prompt's blocks in the index")
    for i in range(6):
        complete(stack, tenant + [20 + i] * 5)
    assert len(owner.engine.requests) == 7 and sum(len(d.engine.requests) for d in stack.decodes) == 7
    assert stack.metric("pdserve:router_kv_index_blocks", {"instance": owner.address}) >= 12


def test_cache_salt_reaches_the_engines_and_isolates_tenants_in_routing(kv_stack):
    stack = kv_stack(0, 2, policy="kv_aware")
    prompt = [9] * 40
    complete(stack, prompt, cache_salt="tenant-a")
    owner = next(d for d in stack.decodes if d.engine.requests)
    other = next(d for d in stack.decodes if d is not owner)
    assert owner.engine.salts == ["tenant-a"]
    wait_until(lambda: indexed(stack, owner, prompt, "tenant-a"), what="tenant-a's blocks")
    assert not indexed(stack, owner, prompt, "tenant-b")
    complete(stack, prompt, cache_salt="tenant-b")  # no shared cache: the idle instance gets it
    assert other.engine.salts == ["tenant-b"]
    status, _, body = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "cache_salt": ""})
    assert status == 400 and body["error"]["param"] == "cache_salt"
    status, _, body = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "cache_salt": 5})
    assert status == 400 and "cache_salt" in body["error"]["message"]


def test_conditional_disaggregation_through_the_gateway(kv_stack):
    stack = kv_stack(1, 1, pd_policy="conditional", max_local_prefill_length=16, max_prefill_queue_tokens=5000)
    (prefill,), (decode,) = stack.prefills, stack.decodes

    def local_requests():
        return [r for r in decode.engine.requests if not r.HasField("first_token_id")]

    complete(stack, [11] * 8)  # short: the decode computes it
    assert not prefill.engine.requests and len(local_requests()) == 1
    long_prompt = list(range(200, 260))
    complete(stack, long_prompt)  # long and cold: prefilled remotely
    assert len(prefill.engine.requests) == 1 and len(decode.engine.requests) == 2
    wait_until(lambda: indexed(stack, decode, long_prompt), what="the decode's cache in the index")
    complete(stack, long_prompt + [5, 6])  # 2 tokens uncached at the decode: local
    assert len(prefill.engine.requests) == 1 and len(local_requests()) == 2
    prefill.engine.extra_load = 100_000  # the prefill pool queues; the decode has room
    wait_until(lambda: stack.router.pool.instances("prefill")[0].load_score >= 100_000, what="a load report")
    complete(stack, list(range(400, 460)))
    assert len(prefill.engine.requests) == 1 and len(local_requests()) == 3
    counts = {(d, r): stack.metric("pdserve:router_pd_decisions_total", {"decision": d, "reason": r})
              for d, r in [("decode_local", "short_uncached"), ("prefill_remote", "long_uncached"),
                           ("decode_local", "prefill_queue")]}
    assert counts == {("decode_local", "short_uncached"): 2, ("prefill_remote", "long_uncached"): 1,
                      ("decode_local", "prefill_queue"): 1}


@pytest.mark.parametrize("mode,served", [("conditional", True), ("always", False)])
def test_no_healthy_prefill_is_served_locally_where_the_pd_policy_allows(kv_stack, mode, served):
    """A prefill outage: conditional disaggregation keeps serving (the decode computes every
    prompt); always-disaggregate answers 503 up front."""
    stack = kv_stack(1, 1, pd_policy=mode, max_local_prefill_length=16)
    (prefill,), (decode,) = stack.prefills, stack.decodes
    stack.lt.run(prefill.stop(0))
    wait_until(lambda: not stack.router.pool.instances("prefill")[0].healthy, what="the prefill unhealthy")
    status, _, body = stack.post("/v1/completions", {"prompt": list(range(200, 260)), "max_tokens": 3})
    if served:
        assert status == 200, body
        assert [r for r in decode.engine.requests if not r.HasField("first_token_id")], "computed on the decode"
        assert stack.metric("pdserve:router_pd_decisions_total",
                            {"decision": "decode_local", "reason": "no_prefill"}) == 1
    else:
        assert status == 503 and body["error"]["code"] == "no_healthy_instance", body


@pytest.mark.parametrize("mode,remote", [("always", 2), ("never", 0)])
def test_always_and_never(kv_stack, mode, remote):
    stack = kv_stack(1, 1, pd_policy=mode)
    complete(stack, [11] * 8)
    complete(stack, list(range(200, 260)))
    assert len(stack.prefills[0].engine.requests) == remote and len(stack.decodes[0].engine.requests) == 2
