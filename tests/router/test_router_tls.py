"""TLS on the router's fronts (vLLM's --ssl-certfile, --ssl-keyfile, --ssl-ca-certs,
--ssl-cert-reqs): HTTPS for the gateway, TLS for gRPC Generate, client certificates when asked,
bad files refused at start."""
from __future__ import annotations

import http.client
import json
import ssl

import grpc
import pytest
import trustme

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.tls import FrontTls

from router_harness import router_config

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("router-pki")
    ca, stranger = trustme.CA(), trustme.CA()
    paths = {}

    def write(name: str, blob) -> None:
        paths[name] = str(folder / name)
        blob.write_to_path(paths[name])

    write("ca.pem", ca.cert_pem)
    server = ca.issue_cert("127.0.0.1", "localhost")
    write("server.pem", server.cert_chain_pems[0])
    write("server.key", server.private_key_pem)
    for name, issuer in (("client", ca), ("stranger", stranger)):
        cert = issuer.issue_cert(f"{name}.example")
        write(f"{name}.pem", cert.cert_chain_pems[0])
        write(f"{name}.key", cert.private_key_pem)
    return paths


def https_post(port: int, path: str, body: dict, pki: dict, client: str | None = None):
    ctx = ssl.create_default_context(cafile=pki["ca.pem"])
    if client is not None:
        ctx.load_cert_chain(pki[f"{client}.pem"], pki[f"{client}.key"])
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_https_and_grpc_over_tls(make_stack, pki):
    stack = make_stack(prefill=1, decode=1, tls=FrontTls(pki["server.pem"], pki["server.key"]))
    status, body = https_post(stack.port, "/v1/chat/completions", CHAT, pki)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    with pytest.raises((ssl.SSLError, http.client.RemoteDisconnected, ConnectionResetError)):
        stack.post("/v1/chat/completions", CHAT)  # plain HTTP is not spoken there
    creds = grpc.ssl_channel_credentials(root_certificates=open(pki["ca.pem"], "rb").read())
    with grpc.secure_channel(stack.grpc_target, creds) as channel:
        chunks = list(pb_grpc.GenerateStub(channel).Generate(
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=4)), timeout=30))
    assert sum(len(c.token_ids) for c in chunks) == 4


def test_client_certificates_when_required(make_stack, pki):
    stack = make_stack(prefill=1, decode=1, tls=FrontTls(pki["server.pem"], pki["server.key"], pki["ca.pem"], 2))
    assert https_post(stack.port, "/v1/chat/completions", CHAT, pki, client="client")[0] == 200
    for client in (None, "stranger"):
        with pytest.raises((ssl.SSLError, ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError)):
            https_post(stack.port, "/v1/chat/completions", CHAT, pki, client=client)
    assert https_post(stack.port, "/v1/chat/completions", CHAT, pki, client="client")[0] == 200  # still serving


def test_the_flags(tiny_model_path, pki, tmp_path):
    def config(*argv):
        return router_config(tiny_model_path, *argv)

    assert config().tls is None
    tls = config("--ssl-certfile", pki["server.pem"], "--ssl-keyfile", pki["server.key"]).tls
    assert tls == FrontTls(pki["server.pem"], pki["server.key"])
    mismatched = ("--ssl-certfile", pki["server.pem"], "--ssl-keyfile", pki["client.key"])
    (tmp_path / "garbage.pem").write_text("not a certificate")
    for argv, message in (((("--ssl-certfile", pki["server.pem"])), "go together"),
                          (mismatched, "--ssl-certfile/--ssl-keyfile"),
                          (("--ssl-certfile", str(tmp_path / "garbage.pem"), "--ssl-keyfile", pki["server.key"]),
                           "--ssl-certfile/--ssl-keyfile"),
                          (("--ssl-certfile", pki["server.pem"], "--ssl-keyfile", pki["server.key"],
                            "--ssl-cert-reqs", "2"), "needs --ssl-ca-certs"),
                          (("--ssl-cert-reqs", "1"), "need --ssl-certfile")):
        with pytest.raises(ValueError, match=message):
            config(*argv)
