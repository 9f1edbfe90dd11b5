"""The planner on a real stack: `pdserve prefill`, `pdserve decode` and the router on 127.0.0.1,
scraped by a real Prometheus; the planner, in dry-run, reads the load through PromQL and decides
to grow the role the load falls on, and only that one."""
from __future__ import annotations

import argparse
import logging
import os
import time

import pytest

from planner_stack import (Load, Process, free_port, grpc_serving, http_get, pdserve, prometheus_binary,
                           start_prometheus, targets_up, wait_for)
from services.planner.cli import add_planner_parser, build_planner

STARTUP_S = 240


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    prometheus_binary()  # no Prometheus is a failure with the install command, never a skip
    logs = tmp_path_factory.mktemp("planner-stack")
    env = dict(os.environ, PDSERVE_KV_SECRET="planner-test-secret")
    ports = {role: (free_port(), free_port()) for role in ("prefill", "decode")}
    procs = [Process(role, pdserve(role, "--model", tiny_llama, "--port", str(grpc), "--metrics-port", str(metrics),
                                   "--engine-id", f"{role}-0", "--kv-cache-memory-gb", "0.05", "--inproc",
                                   "--num-threads", "1"), logs, env)
             for role, (grpc, metrics) in ports.items()]
    router_port = free_port()
    try:
        wait_for(lambda: all(grpc_serving(g) for g, _ in ports.values()), "the engines to report SERVING", procs,
                 STARTUP_S)
        procs.append(Process("router", pdserve(
            "router", "--model", tiny_llama, "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(router_port), "--grpc-port", "-1",
            "--prefill", f"127.0.0.1:{ports['prefill'][0]}", "--decode", f"127.0.0.1:{ports['decode'][0]}"), logs, env))
        url = f"http://127.0.0.1:{router_port}"
        wait_for(lambda: http_get(f"{url}/health") is not None, "the router", procs, STARTUP_S)
        targets = [f"127.0.0.1:{m}" for _, m in ports.values()] + [f"127.0.0.1:{router_port}"]
        prometheus, prom_url = start_prometheus(targets, logs)
        procs.append(prometheus)
        wait_for(lambda: targets_up(prom_url, len(targets)), "Prometheus to scrape the stack", procs, 60)
        yield url, prom_url, "tiny"
    finally:
        for p in reversed(procs):
            p.stop()


def planner_from_flags(prom_url: str):
    """Capacities far apart from what each phase puts on the other role: 500 prompt tokens/s per
    prefill replica, 20 generated tokens/s per decode replica; latency targets out of the way
    (this machine's CPU is shared)."""
    parser = argparse.ArgumentParser()
    add_planner_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "planner", "--dry-run", "--metrics-source", "prometheus", "--prometheus-url", prom_url,
        "--interval", "1", "--window", "8", "--prefill-capacity", "500", "--decode-capacity", "20",
        "--prefill-target-ttft", "60", "--decode-target-itl", "10", "--scale-up-cooldown", "0"])
    return build_planner(args)


def run_until(planner, role: str, timeout: float, log: list, load: Load) -> dict:
    """Planning rounds until `role` would grow; -> every role's last decision."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert not load.errors, load.errors[:3]
        decisions = {d.role: d for d in planner.step()}
        log += [d for d in decisions.values() if d.direction != "hold"]
        if decisions[role].direction == "up":
            return decisions
        time.sleep(1)
    raise AssertionError(f"the planner never grew {role} ({load.done} requests done); last: {decisions}")


def test_planner_reads_prometheus_and_grows_the_loaded_role(stack, caplog, capsys):
    url, prom_url, model = stack
    planner = planner_from_flags(prom_url)
    caplog.set_level(logging.INFO, logger="pdserve.planner")
    idle = {d.role: d for d in planner.step()}
    assert idle["prefill"].direction == idle["decode"].direction == "hold"

    changes: list = []
    long_prompt = " ".join(f"word{i % 97}" for i in range(300))
    with Load(url, model, long_prompt, max_tokens=2, concurrency=3) as load:  # long prompts, tiny answers
        decisions = run_until(planner, "prefill", 90, changes, load)
    assert load.done > 0 and not load.errors, load.errors[:3]
    assert decisions["prefill"].desired > decisions["prefill"].current == 1
    assert "prompt" in decisions["prefill"].reason
    assert [d.role for d in changes] == ["prefill"] * len(changes)  # decode never grew

    # The prompt load leaves the window before the next phase, so that it cannot be mistaken for it.
    deadline = time.monotonic() + 60
    while {d.role: d for d in planner.step()}["prefill"].recommended > 1:
        assert time.monotonic() < deadline, "the prefill recommendation never came back down"
        time.sleep(1)

    changes.clear()
    with Load(url, model, "Once upon a time", max_tokens=200, concurrency=6) as load:  # long generations
        decisions = run_until(planner, "decode", 90, changes, load)
    assert load.done > 0 and not load.errors, load.errors[:3]
    assert decisions["decode"].desired > decisions["decode"].current == 1
    assert "generation" in decisions["decode"].reason
    assert [d.role for d in changes] == ["decode"] * len(changes)  # prefill never grew

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[dry-run]")]
    assert any(line.startswith("[dry-run] would scale prefill 1 -> ") for line in lines)
    assert any(line.startswith("[dry-run] would scale decode 1 -> ") for line in lines)
    registry = planner.metrics.registry
    assert registry.get_sample_value("pdserve:planner_scaling_decisions_total",
                                     {"role": "decode", "direction": "up", "dry_run": "true"}) >= 1
    with capsys.disabled():
        print("\n[planner on Prometheus]\n  " + "\n  ".join(lines))
