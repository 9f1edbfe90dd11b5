"""The serving path's cost per generated token, measured through a live engine service.

The step model times steps inside one process. A served token also leaves the engine core
(outputs to the engine host over ZMQ) and the host's gRPC stream, and on an instance's own cores
that CPU time lengthens every step. Here one `pdserve colocated` runs on this process's cores
with the profile's threads; a few requests, one at a time, are streamed straight from its gRPC
Decode API; the overhead is the median of (client TPOT - the step model's decode step at the
request's mean context), charged by the simulator per sequence per step.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from services.planner.costmodel import StepCost

LENGTHS = ((128, 48), (1024, 48))  # prompt, output: a short and a long context
REPEATS = 3


def _tpot(stub, pb, prompt: list[int], max_tokens: int, rid: str) -> float:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    times = []
    for r in stub.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling), timeout=600):
        now = time.perf_counter()
        times.extend([now] * len(r.token_ids))
    if len(times) < 2:
        raise RuntimeError(f"the service streamed {len(times)} tokens for a {max_tokens}-token request")
    return (times[-1] - times[0]) / (len(times) - 1)


def measure_token_overhead(model: str, step: StepCost, num_threads: int, dtype: str, max_model_len: int,
                           vocab_size: int, tick=lambda: None) -> tuple[float, list[dict]]:
    """(seconds per sequence per step, the points). The service runs on this process's cores."""
    import grpc

    from services.api.pdserve.v1 import pdserve_pb2 as pb
    from services.common.grpc_server import health_serving
    from services.launcher import free_port
    from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "colocated", "--model", model, "--num-threads", str(num_threads),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--port", str(port), "--host", "127.0.0.1",
           "--metrics-port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_AUTH", "PDSERVE_SSL"))}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    address = f"127.0.0.1:{port}"
    points = []
    try:
        deadline = time.monotonic() + 600
        while not health_serving(address):
            if proc.poll() is not None:
                raise RuntimeError(f"the colocated service exited during start-up: "
                                   f"{proc.stderr.read().decode(errors='replace')[-500:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the colocated service did not start within 600 s")
            time.sleep(0.5)
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.DecodeStub(ch)
            _tpot(stub, pb, [11, 12, 13, 14], 8, "warm-up")
            for i, (prompt_len, out_len) in enumerate(LENGTHS):
                prompt_len = min(prompt_len, max_model_len - out_len - 1)
                for k in range(REPEATS):
                    prompt = [(i * 7919 + k * 104729 + j * 31) % (vocab_size - 10) + 10 for j in range(prompt_len)]
                    tpot = _tpot(stub, pb, prompt, out_len, f"overhead-{i}-{k}")
                    context = prompt_len + out_len / 2
                    predicted = step.decode_seconds(1, round(context))
                    points.append({"prompt": prompt_len, "output": out_len, "tpot_s": tpot, "step_s": predicted})
                tick()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    overhead = max(0.0, statistics.median(p["tpot_s"] - p["step_s"] for p in points))
    return overhead, points
