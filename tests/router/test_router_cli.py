"""`pdserve router`: flags and their env vars, and a real process that drains on SIGTERM."""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from services.router.cli import add_router_parser, config_from_args

from router_harness import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    add_router_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["router", *argv])


def test_flags_and_env_vars(monkeypatch):
    args = parse(["--decode", "h:1,h:2", "--port", "9000"], monkeypatch,
                 {"PDSERVE_ROUTER_PORT": "1234", "PDSERVE_ROUTER_PREFILL": "p:7", "PDSERVE_API_KEY": "abc",
                  "PDSERVE_ROUTER_POLICY": "least_load", "PDSERVE_ROUTER_REQUEST_TIMEOUT": "5"})
    c = config_from_args(args)
    assert (c.port, c.prefill, c.decode, c.api_key, c.policy) == (9000, ("p:7",), ("h:1", "h:2"), "abc", "least_load")
    assert c.request_timeout_s == 5.0 and c.served_model_name == "tiny" and c.disaggregated
    monkeypatch.setenv("PDSERVE_ROUTER_API_KEY", "router-key")
    assert config_from_args(parse(["--decode", "h:1"])).api_key == "router-key"
    c = config_from_args(parse(["--decode", "h:1", "--api-key", "k1", "k2"]))
    assert c.api_key == ("k1", "k2") and c.api_keys == (b"k1", b"k2")
    monkeypatch.setenv("PDSERVE_ROUTER_API_KEY", "a, b")
    assert config_from_args(parse(["--decode", "h:1"])).api_keys == (b"a", b"b")


def test_runtime_lora_updating_by_flag_or_vllms_variable(monkeypatch):
    assert not config_from_args(parse(["--decode", "h:1"])).allow_runtime_lora_updating
    assert config_from_args(parse(["--decode", "h:1", "--allow-runtime-lora-updating"])).allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert config_from_args(parse(["--decode", "h:1"])).allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", "/adapters")
    assert config_from_args(parse(["--decode", "h:1"])).lora_resolver_dir == "/adapters"
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not config_from_args(parse(["--decode", "h:1"])).allow_runtime_lora_updating


def test_several_served_model_names(monkeypatch):
    c = config_from_args(parse(["--decode", "h:1", "--served-model-name", "llama", "meta/llama-8b"]))
    assert (c.served_model_name, c.served_model_aliases) == ("llama", ("meta/llama-8b",))
    c = config_from_args(parse(["--decode", "h:1"], monkeypatch, {"PDSERVE_ROUTER_SERVED_MODEL_NAME": "a, b a"}))
    assert (c.served_model_name, c.served_model_aliases) == ("a", ("b",))


def test_help_documents_every_env_var(capsys):
    p = argparse.ArgumentParser()
    add_router_parser(p.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        p.parse_args(["router", "--help"])
    text = capsys.readouterr().out
    flags = [f for f in re.findall(r"^\s+(--[a-z-]+)", text, re.M) if f != "--help"]
    assert len(flags) >= 15
    for flag in flags:
        assert "PDSERVE_ROUTER_" + flag[2:].upper().replace("-", "_") in text.replace("\n", "").replace(" ", ""), flag


@pytest.mark.parametrize("argv,message", [
    ([], "at least one --decode"),
    (["--decode", "nohost"], "host:port"),
    (["--decode", "h:1", "--max-attempts", "0"], "--max-attempts"),
])
def test_bad_flags(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(parse(argv))


@pytest.mark.e2e
def test_router_process_serves_and_drains_on_sigterm(make_stack, tiny_model_path):
    """A real `pdserve router` process in front of fake engines: it serves, and SIGTERM lets an
    in-flight stream finish before the process exits 0."""
    fakes = make_stack(prefill=1, decode=1, decode_kwargs=[{"token_delay": 0.05}])
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "router", "--model", tiny_model_path, "--host", "127.0.0.1",
         "--port", "0", "--grpc-port", "0", "--prefill", fakes.prefills[0].address],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PDSERVE_ROUTER_DECODE": fakes.decodes[0].address, "PDSERVE_ROUTER_SERVED_MODEL_NAME": "m"})
    log = []
    try:
        for line in proc.stderr:
            log.append(line)
            found = re.search(r"router serving m .* on http://127\.0\.0\.1:(\d+)", line)
            if found:
                break
        assert found, "".join(log)
        fakes.router.http_port = int(found.group(1))  # point the helpers at the process
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        assert fakes.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})[0] == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            inflight = pool.submit(fakes.sse, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 20,
                                                                  "stream": True})
            wait_until(lambda: fakes.decodes[0].engine.running, what="a stream in flight")
            proc.send_signal(signal.SIGTERM)
            events = inflight.result(30)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait(10)
    text = "".join(log)
    for event in ("router received a stop signal", "router draining", "router stopped"):
        assert event in text, text
