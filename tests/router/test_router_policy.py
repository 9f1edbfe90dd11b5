"""Routing policies: round robin spreads, least load avoids the busy instance."""
from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest

from services.router.policy import LeastLoad, RoundRobin, RouteRequest, RoutingPolicy, make_policy

from router_harness import wait_until


def route(role="prefill"):
    return RouteRequest("r", role, [1, 2, 3])


def test_round_robin_rotates_per_role():
    a, b, c = (SimpleNamespace(name=n) for n in "abc")
    rr = RoundRobin()
    assert [rr.select([a, b, c], route()).name for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.select([a, b], route("decode")).name == "a"  # its own counter


def test_least_load_picks_the_lowest_score_and_rotates_ties():
    idle1, busy, idle2 = (SimpleNamespace(name=n, load_score=s) for n, s in (("i1", 0), ("b", 500), ("i2", 0)))
    ll = LeastLoad()
    assert [ll.select([idle1, busy, idle2], route()).name for _ in range(4)] == ["i1", "i2", "i1", "i2"]
    idle1.load_score = 10
    assert ll.select([idle1, busy, idle2], route()).name == "i2"


def test_make_policy():
    assert isinstance(make_policy("least_load"), LeastLoad) and make_policy("least_load").needs_load_reports
    assert isinstance(make_policy("round_robin"), RoutingPolicy)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("prefix_aware")


def test_round_robin_spreads_requests_over_instances(make_stack):
    stack = make_stack(prefill=3, decode=2)
    for i in range(6):
        assert stack.post("/v1/completions", {"prompt": f"x {i}", "max_tokens": 2})[0] == 200
    for role, fakes, per in (("prefill", stack.prefills, 2), ("decode", stack.decodes, 3)):
        for fake in fakes:
            assert stack.metric("pdserve:router_routing_decisions_total",
                                {"role": role, "instance": fake.address}) == per
            assert len(fake.engine.requests) == per


def test_least_load_avoids_the_busy_prefill(make_stack):
    stack = make_stack(prefill=2, decode=1, policy="least_load", load_poll_interval_s=0.02)
    busy, idle = stack.prefills
    busy.engine.gate = asyncio.Event()
    reported = stack.router.pool.instances("prefill")[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(stack.post, "/v1/completions", {"prompt": "stuck", "max_tokens": 2})
        wait_until(lambda: busy.engine.running, what="a request held by the busy prefill")
        wait_until(lambda: reported.load is not None and reported.load.outstanding_tokens > 0,
                   what="its load reported")
        for i in range(4):
            assert stack.post("/v1/completions", {"prompt": f"y {i}", "max_tokens": 2})[0] == 200
        assert len(idle.engine.requests) == 4 and len(busy.engine.requests) == 1
        stack.lt.loop.call_soon_threadsafe(busy.engine.gate.set)
        assert stuck.result(30)[0] == 200


def test_max_model_len_comes_from_the_instances(make_stack):
    stack = make_stack(prefill=1, decode=1, prefill_kwargs=[{"max_model_len": 512}])
    assert stack.request("GET", "/v1/models")[2]["data"][0]["max_model_len"] == 512
    status, _, body = stack.post("/v1/completions", {"prompt": [7] * 500, "max_tokens": 20})
    assert status == 400 and "512" in body["error"]["message"]
    # Load reports come from the Engine service, which every instance serves whatever its role.
    assert all("/pdserve.v1.Engine/GetLoad" in fake.calls for fake in stack.prefills + stack.decodes)


def test_a_report_keeps_what_was_routed_while_it_was_on_its_way():
    # The report was made before the engine saw what the router sent after asking for it: those
    # tokens stay on the instance's score; what was routed before the ask is in the report.
    from services.api.pdserve.v1 import pdserve_pb2 as pb
    from services.router.instances import InstancePool
    from services.router.metrics import RouterMetrics

    pool = InstancePool((), (), RouterMetrics(), health_interval_s=1.0, load_interval_s=None)

    async def main():
        asked, answer = asyncio.Event(), asyncio.Event()

        async def get_load(timeout):
            asked.set()
            await answer.wait()
            return pb.LoadReport(outstanding_tokens=300)

        inst = SimpleNamespace(load=None, routed_tokens=300, described=False, get_load=get_load)
        fetch = asyncio.ensure_future(pool._fetch_load(inst))
        await asyncio.wait_for(asked.wait(), 5)
        inst.routed_tokens += 200  # a request routed while the report is on its way
        answer.set()
        await fetch
        assert inst.load.outstanding_tokens == 300 and inst.routed_tokens == 200
        await pool._fetch_load(inst)  # the next report includes it
        assert inst.routed_tokens == 0

    asyncio.run(main())


def test_routing_adds_what_the_engine_will_count():
    # An engine counts a request's prompt and the tokens it may generate (one on a prefill):
    # until the next report the router adds the same to the instance's score.
    inst = SimpleNamespace(name="a", load_score=0)
    ll = LeastLoad()
    assert ll.added_load(inst, RouteRequest("r", "decode", [1] * 100, max_new_tokens=64)) == 164
    assert ll.added_load(inst, RouteRequest("r", "prefill", [1] * 100, max_new_tokens=1)) == 101
