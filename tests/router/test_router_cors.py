"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials, with
Starlette's rules): preflights answered before the API key is asked for, allowed origins on every
answer (streamed too), nothing allowed by default."""
from __future__ import annotations


import pytest

from services.router.cors import CorsPolicy

from router_harness import router_config

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
APP = "https://chat.example.com"


def preflight(stack, origin: str, method: str = "POST", headers: str | None = "authorization, content-type"):
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        h["Access-Control-Request-Headers"] = headers
    return stack.request("OPTIONS", "/v1/chat/completions", None, h)


def test_no_origin_is_allowed_by_default(make_stack):
    stack = make_stack(prefill=1, decode=1)
    status, headers, body = preflight(stack, APP)
    assert status == 400 and body == b"Disallowed CORS origin" and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = stack.post("/v1/chat/completions", CHAT, {"Origin": APP})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers and headers["Vary"] == "Origin"


def test_listed_origins_behind_an_api_key(make_stack):
    stack = make_stack(prefill=1, decode=1, api_key="sekrit", cors=CorsPolicy(origins=(APP,)))
    # The preflight needs no key (browsers send none); the origin is named back, not "*".
    status, headers, body = preflight(stack, APP)
    assert status == 200 and body == b"OK", body
    assert headers["Access-Control-Allow-Origin"] == APP and headers["Access-Control-Max-Age"] == "600"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"  # any: mirrored
    assert preflight(stack, "https://evil.example")[0] == 400
    # The request itself: the key is still asked for; allowed answers carry the origin, errors too.
    key = {"Authorization": "Bearer sekrit", "Origin": APP}
    status, headers, _ = stack.post("/v1/chat/completions", CHAT, key)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP and "Origin" in headers["Vary"]
    status, headers, _ = stack.post("/v1/chat/completions", CHAT, {"Origin": APP})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == APP  # the browser may read the error
    status, headers, data = stack.request("POST", "/v1/chat/completions", {**CHAT, "stream": True}, key)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP and data.endswith(b"data: [DONE]\n\n")
    status, headers, _ = stack.post("/v1/chat/completions", CHAT, {**key, "Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers  # served; the browser hides it


def test_any_origin_credentials_methods_and_headers(make_stack):
    stack = make_stack(prefill=1, decode=1, cors=CorsPolicy(origins=("*",)))
    status, headers, _ = preflight(stack, "https://anywhere.example")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert stack.post("/v1/chat/completions", CHAT, {"Origin": "https://x.example"})[1]["Access-Control-Allow-Origin"] == "*"
    # With credentials, "*" cannot be used: the origin is named.
    creds = make_stack(prefill=1, decode=1, cors=CorsPolicy(origins=("*",), credentials=True))
    status, headers, _ = preflight(creds, APP)
    assert headers["Access-Control-Allow-Origin"] == APP and headers["Access-Control-Allow-Credentials"] == "true"
    # Methods and headers held to lists.
    strict = make_stack(prefill=1, decode=1, cors=CorsPolicy(origins=(APP,), methods=("GET", "POST"),
                                                             headers=("Authorization",)))
    assert preflight(strict, APP, "DELETE")[2] == b"Disallowed CORS method"
    assert preflight(strict, APP, "POST", "authorization, x-custom")[2] == b"Disallowed CORS headers"
    status, headers, _ = preflight(strict, APP, "POST", "Authorization, Content-Type")
    assert status == 200 and headers["Access-Control-Allow-Headers"] == \
        "accept, accept-language, authorization, content-language, content-type"


def test_the_flags(tiny_model_path, monkeypatch):
    def config(*argv):
        return router_config(tiny_model_path, *argv)

    assert config().cors == CorsPolicy()
    c = config("--allowed-origins", f'["{APP}"]', "--allowed-methods", '["GET", "POST"]', "--allow-credentials")
    assert c.cors == CorsPolicy((APP,), ("GET", "POST"), ("*",), True)
    monkeypatch.setenv("PDSERVE_ROUTER_ALLOWED_ORIGINS", '["*"]')
    assert config().cors.any_origin
    with pytest.raises(SystemExit):
        config("--allowed-origins", APP)  # not JSON
