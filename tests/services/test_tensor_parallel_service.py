"""`pdserve colocated --tensor-parallel-size 2` behind the router answers as TP=1 does, and leaves
no worker behind when it stops."""
from __future__ import annotations

import json
import urllib.request

import pytest

from service_procs import Service, alive, children_of, poll_until
from stack import SERVED_MODEL, RouterProcess

pytestmark = pytest.mark.e2e


def completion(router: RouterProcess, prompt: str) -> dict:
    body = json.dumps({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{router.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)["choices"][0]


def test_colocated_tp2_behind_the_router_answers_as_tp1(e2e_model):
    answers, processes = {}, {}
    for tp in (1, 2):
        svc = Service("colocated", e2e_model, "--num-blocks", "128", "--tensor-parallel-size", str(tp)).wait_ready()
        router = RouterProcess(e2e_model, [], [svc.address])
        try:
            router.wait_ready(1)
            answers[tp] = [completion(router, p) for p in ("The old king", "Once upon a time in a castle")]
            processes[tp] = children_of(svc.proc.pid)  # the engine core, and at TP=2 its worker
        finally:
            assert router.stop() == 0
            code = svc.stop()
        assert code == 0, svc.output()
        poll_until(lambda: not alive(processes[tp]), 10)  # exited children are reaped by init shortly after
        left = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in alive(processes[tp])}
        assert not left, f"processes outlived their service: {left}"
        if tp == 2:
            assert "tensor_parallel_size=2" in svc.output()
    assert len(processes[2]) > len(processes[1])  # the worker of rank 1
    assert answers[2] == answers[1]
    assert all(a["text"] and a["finish_reason"] == "length" for a in answers[2])
