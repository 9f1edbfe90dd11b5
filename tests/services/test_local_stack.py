"""`pdserve up` (what `make run` starts): serves, answers completions and chat, stops cleanly."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from service_procs import alive, children_of, poll_until

pytestmark = pytest.mark.e2e


def test_pdserve_up_serves_and_stops_every_process(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=512)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", model, "--prefill", "1",
                             "--decode", "1", "--port", "0", "--demo", "--router-arg=--served-model-name=demo-model"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, lines = None, []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"pdserve is serving at (http://\S+)", line)
            if m:
                url = m.group(1)
            if "serving; Ctrl-C to stop" in line:
                break
        assert url, "".join(lines[-30:])
        assert any(line.startswith("demo completion (streamed)") for line in lines)
        children = children_of(proc.pid)
        assert len(children) >= 3 + 2, "router + prefill + decode, and each engine core"

        model_id = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=10))["data"][0]["id"]
        assert model_id == "demo-model"  # --router-arg reached the router
        body = {"model": model_id, "prompt": "The old king", "max_tokens": 8, "temperature": 0, "stream": True}
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [x.decode().strip() for x in r if x.strip()]
        assert events[-1] == "data: [DONE]"
        streamed = "".join(c["text"] for e in events[:-1] for c in json.loads(e[6:])["choices"])
        body.update(stream=False)
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        whole = json.load(urllib.request.urlopen(req, timeout=60))
        assert whole["choices"][0]["text"] == streamed and whole["usage"]["completion_tokens"] == 8
        chat = {"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
        req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(chat).encode(),
                                     {"Content-Type": "application/json"})
        reply = json.load(urllib.request.urlopen(req, timeout=60))
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
    assert rc == 0
    poll_until(lambda: not alive(children), 15)
    assert not alive(children), "processes outlived `pdserve up`"
