"""`pdserve colocated --tensor-parallel-size 2` behind the router answers as TP=1 does, and leaves
no worker behind when it stops."""
from __future__ import annotations

import json
import os
import signal
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


def tp_workers(svc: Service) -> list[int]:
    """The service's tensor-parallel worker processes (children of its engine core)."""
    def cmdline(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()

    return [p for p in children_of(svc.proc.pid) if "engine.parallel.worker" in cmdline(p)]


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


def test_a_worker_lost_while_idle_stops_the_service_before_any_request(e2e_model):
    """Between requests nothing steps the engine: the core checks its workers on its own, so the
    service exits (its supervisor restarts it) instead of failing the next request."""
    svc = Service("colocated", e2e_model, "--num-blocks", "128", "--tensor-parallel-size", "2").wait_ready()
    try:
        (worker,) = tp_workers(svc)
        os.kill(worker, signal.SIGKILL)
        assert svc.proc.wait(60) != 0
        out = svc.output()
        assert f"tensor-parallel worker rank 1 (pid {worker}) died (exit code -9)" in out, out
        assert "its engine core died" in out, out
    finally:
        if svc.proc.poll() is None:
            svc.kill()


def test_ctrl_c_drains_a_tp_service_with_every_shard(e2e_model):
    """Ctrl-C reaches the terminal's whole process group (here each process gets SIGINT): the
    service drains its in-flight request to the end and exits 0; the workers stop with their
    engine core, not on the signal (they inherit the core's ignored SIGINT), which would lose a
    shard mid-request and, with the idle liveness check, stop the engine."""
    import grpc

    from services.api.pdserve.v1 import pdserve_pb2 as pb
    from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    svc = Service("colocated", e2e_model, "--num-blocks", "128", "--tensor-parallel-size", "2").wait_ready()
    try:
        stack = children_of(svc.proc.pid)
        assert tp_workers(svc)
        with grpc.insecure_channel(svc.address) as ch:
            stream = pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
                request_id="in-flight", prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)))
            tokens = list(next(stream).token_ids)  # it runs
            for pid in (svc.proc.pid, *stack):
                os.kill(pid, signal.SIGINT)
            last = None
            for last in stream:
                tokens += last.token_ids
        assert (len(tokens), last.finish_reason) == (300, "length")
        assert svc.proc.wait(60) == 0, svc.output()
        out = svc.output()
        assert "died" not in out and "Traceback" not in out, out
        poll_until(lambda: not alive(stack), 10)
        assert not alive(stack)
    finally:
        if svc.proc.poll() is None:
            svc.kill()
