"""kvEvents: both engine roles publish KV cache events (vLLM's --kv-events-config), the router may
subscribe to them (ports, NetworkPolicy) and routes kv_aware; off by default, and then nothing of it
is rendered."""
from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from chart_tools import by_kind, container, render
from engine.kv_events import KVEventsConfig
from services.router.kv_index import resolve_endpoint

ENGINES = ("pd-pdserve-prefill", "pd-pdserve-decode")
FLAG = "--kv-events-config="
POD_IP = "10.4.0.17"


@functools.cache
def rendered(value_set: str | None = "kv-events", sets: tuple = ()) -> list[dict]:
    return render("3", value_set, dict(sets))


def events_config(deployment: dict) -> KVEventsConfig:
    flags = [a for a in container(deployment)["args"] if a.startswith(FLAG)]
    assert len(flags) == 1, container(deployment)["args"]
    return KVEventsConfig(**json.loads(flags[0].removeprefix(FLAG)))


def port_numbers(deployment: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}


def endpoint_port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


@pytest.mark.parametrize("sets", [(), (("kvEvents.port", 6001), ("kvEvents.replayPort", 6002))],
                         ids=["default-ports", "custom-ports"])
def test_both_engines_publish_on_named_ports_the_router_reaches_at_the_pod_ip(sets):
    deployments = by_kind(rendered("kv-events", sets), "Deployment")
    expected = dict(sets) or {"kvEvents.port": 5557, "kvEvents.replayPort": 5558}
    for name in ENGINES:
        config = events_config(deployments[name])
        assert config.active and config.publisher == "zmq"
        assert config.buffer_steps == 2000 and config.hwm == 100_000 and config.max_queue_size == 100_000
        assert config.topic == ""
        ports = port_numbers(deployments[name])
        assert ports["kv-events"] == endpoint_port(config.endpoint) == expected["kvEvents.port"]
        assert ports["kv-events-rp"] == endpoint_port(config.replay_endpoint) == expected["kvEvents.replayPort"]
        # What GetLoad advertises (the bound wildcard endpoint) becomes the pod's own address.
        assert resolve_endpoint(config.endpoint, f"{POD_IP}:50051") == f"tcp://{POD_IP}:{ports['kv-events']}"
        assert resolve_endpoint(config.replay_endpoint, f"{POD_IP}:50051") == \
            f"tcp://{POD_IP}:{ports['kv-events-rp']}"
        assert all(len(p) <= 15 for p in ports), ports  # an IANA_SVC_NAME
    router = container(deployments["pd-pdserve-router"])
    assert "--policy=kv_aware" in router["args"]


def test_router_pods_may_reach_both_event_ports_of_every_engine_and_no_one_else():
    docs = rendered()
    deployments = by_kind(docs, "Deployment")
    router_labels = deployments["pd-pdserve-router"]["spec"]["template"]["metadata"]["labels"]
    for name, policy in by_kind(docs, "NetworkPolicy").items():
        engine_ports = set(port_numbers(deployments[name]))
        allowed = {}
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", []):
                allowed.setdefault(port["port"], []).append(rule.get("from"))
        for port in ("kv-events", "kv-events-rp"):
            assert port in engine_ports  # a named port must exist on the pod to match anything
            (peers,) = allowed[port]
            assert len(peers) == 1 and peers[0]["podSelector"]["matchLabels"].items() <= router_labels.items()


def test_off_by_default_nothing_of_it_is_rendered():
    docs = rendered(None)
    text = json.dumps(docs)
    assert "kv-events" not in text and "5557" not in text and "5558" not in text
    assert "--policy=least_load" in container(by_kind(docs, "Deployment")["pd-pdserve-router"])["args"]


def test_an_explicit_router_policy_is_kept():
    docs = rendered("kv-events", (("router.policy", "auto"),))
    assert "--policy=auto" in container(by_kind(docs, "Deployment")["pd-pdserve-router"])["args"]


def test_the_services_keep_only_their_own_ports():
    """The router dials pod IPs (from the headless Services' DNS or EndpointSlices): the Services need no
    event ports."""
    for name in ENGINES:
        service = by_kind(rendered(), "Service")[name]
        assert not any(p["name"].startswith("kv-events") for p in service["spec"]["ports"])


def test_host_network_engines_bind_any_free_port_and_advertise_it():
    """shm: a prefill and a decode share one node's network, so fixed ports would collide."""
    deployments = by_kind(rendered("kv-events", (("kvTransfer.transport", "shm"),)), "Deployment")
    for name in ENGINES:
        assert deployments[name]["spec"]["template"]["spec"]["hostNetwork"] is True
        config = events_config(deployments[name])
        assert config.active and config.endpoint == "tcp://*:0" and config.replay_endpoint == "tcp://*:0"
        assert not {"kv-events", "kv-events-rp"} & set(port_numbers(deployments[name]))


def test_the_rendered_flag_binds_a_real_publisher():
    """The flag as rendered (ports moved to free ones) starts the engine's publisher."""
    from engine.kv_events import ZmqEventPublisher

    rendered_config = events_config(by_kind(rendered(), "Deployment")["pd-pdserve-decode"])
    config = dataclasses.replace(rendered_config, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    publisher = ZmqEventPublisher(config)
    try:
        assert endpoint_port(publisher.endpoint) > 0 and endpoint_port(publisher.replay_endpoint) > 0
    finally:
        publisher.shutdown()

