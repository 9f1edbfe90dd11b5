"""Engine authentication, black-box: a shared token and mutual TLS on the engines' gRPC services, the
token end to end through the router's HTTP gateway (and its KV handshakes), and the router's probes
while its engines are down."""
from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from service_procs import Service, free_port, poll_until
from stack import RouterProcess, Stack, StackSpec

pytestmark = pytest.mark.e2e

TOKEN = "engine-token-0123456789"
GREEDY = pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def health(channel: grpc.Channel, metadata=()) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5,
                                                     metadata=metadata).status


# ---- token ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def token_engine(e2e_model):
    """A colocated engine given its token the way the chart gives it: an environment variable."""
    svc = Service("colocated", e2e_model, "--num-blocks", "256", env={"PDSERVE_AUTH_TOKEN": TOKEN}).wait_ready()
    yield svc
    assert svc.stop() == 0


def test_token_is_required_on_every_service_but_health(token_engine):
    with grpc.insecure_channel(token_engine.address) as ch:
        engine, decode = pb_grpc.EngineStub(ch), pb_grpc.DecodeStub(ch)
        load = lambda md=(): engine.GetLoad(pb.LoadRequest(), timeout=10, metadata=md)  # noqa: E731
        stream = lambda md=(): list(decode.Decode(pb.DecodeRequest(  # noqa: E731
            request_id="auth-1", prompt_token_ids=[1, 2, 3], sampling=GREEDY), timeout=30, metadata=md))
        for md in ((), bearer("wrong-token"), bearer(TOKEN[:-1]), (("authorization", TOKEN),)):
            assert code_of(lambda: load(md)) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: stream(md)) == grpc.StatusCode.UNAUTHENTICATED
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
        listing = lambda md=(): list(reflection.ServerReflectionInfo(  # noqa: E731
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10, metadata=md))
        assert code_of(listing) == grpc.StatusCode.UNAUTHENTICATED
        # kubelet's probes carry no token: health answers; a wrong token is refused there too
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        assert code_of(lambda: health(ch, bearer("wrong-token"))) == grpc.StatusCode.UNAUTHENTICATED
        # the right token: everything works, after all those refusals
        assert load(bearer(TOKEN)).role == "colocated"
        replies = stream(bearer(TOKEN))
        assert sum(len(r.token_ids) for r in replies) == GREEDY.max_tokens
        services = listing(bearer(TOKEN))[0].list_services_response.service
        assert "pdserve.v1.Decode" in {s.name for s in services}
        assert health(ch, bearer(TOKEN)) == health_pb2.HealthCheckResponse.SERVING
    assert "missing or wrong bearer token" in token_engine.output(200)


def test_token_from_a_file(e2e_model, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")  # as `kubectl create secret --from-file` keeps it
    svc = Service("colocated", e2e_model, "--num-blocks", "64", "--auth-token-file", str(tmp_path / "token")
                  ).wait_ready()
    try:
        with grpc.insecure_channel(svc.address) as ch:
            engine = pb_grpc.EngineStub(ch)
            assert code_of(lambda: engine.GetLoad(pb.LoadRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            assert engine.GetLoad(pb.LoadRequest(), timeout=10, metadata=bearer(TOKEN)).role == "colocated"
    finally:
        assert svc.stop() == 0


def test_unreadable_credentials_stop_the_engine_with_a_message(e2e_model, tmp_path):
    svc = Service("colocated", e2e_model, "--inproc", "--auth-token-file", str(tmp_path / "missing"))
    assert svc.proc.wait(timeout=60) == 2
    assert "--auth-token-file: cannot read" in svc.output()
    svc = Service("colocated", e2e_model, "--inproc", "--ssl-certfile", str(tmp_path / "missing.pem"))
    assert svc.proc.wait(timeout=60) == 2
    assert "--ssl-certfile: cannot read" in svc.output()


# ---- mutual TLS -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A deployment CA with an engine certificate and a router (client) certificate, and a stranger CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    files = {}

    def write(name: str, blob) -> str:
        files[name] = path = str(folder / name)
        blob.write_to_path(path)
        return path

    write("ca.pem", ca.cert_pem)
    engine = ca.issue_cert("pdserve-engine")
    write("engine.pem", engine.cert_chain_pems[0])
    write("engine.key", engine.private_key_pem)
    for name, issuer in (("router", ca), ("stranger", stranger)):
        cert = issuer.issue_cert(name)
        write(f"{name}.pem", cert.cert_chain_pems[0])
        write(f"{name}.key", cert.private_key_pem)
    return {k: open(v, "rb").read() for k, v in files.items()} | {"paths": files}


@pytest.fixture(scope="module")
def mtls_engine(e2e_model, pki):
    paths, health_port = pki["paths"], free_port()
    svc = Service("colocated", e2e_model, "--num-blocks", "64", "--ssl-certfile", paths["engine.pem"],
                  "--ssl-keyfile", paths["engine.key"], "--ssl-ca-certs", paths["ca.pem"],
                  "--health-port", str(health_port))
    svc.health_address = f"127.0.0.1:{health_port}"

    def serving() -> bool:  # on the plaintext health port, as kubelet probes it
        assert svc.proc.poll() is None, svc.output()
        with grpc.insecure_channel(svc.health_address) as ch:
            try:
                return health(ch) == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

    assert poll_until(serving, 240, interval=0.2), svc.output()
    yield svc
    assert svc.stop() == 0


def tls_channel(pki, address: str, client: str | None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(pki["ca.pem"], pki.get(f"{client}.key"), pki.get(f"{client}.pem"))
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "pdserve-engine")])


def test_mutual_tls_refuses_clients_without_the_deployments_certificate(mtls_engine, pki):
    for client in (None, "stranger"):
        with tls_channel(pki, mtls_engine.address, client) as ch:
            load = pb_grpc.EngineStub(ch).GetLoad
            assert code_of(lambda: load(pb.LoadRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(mtls_engine.address) as ch:  # plaintext to the TLS port
        assert code_of(lambda: health(ch)) == grpc.StatusCode.UNAVAILABLE
    with tls_channel(pki, mtls_engine.address, "router") as ch:
        assert pb_grpc.EngineStub(ch).GetLoad(pb.LoadRequest(), timeout=10).role == "colocated"
        replies = list(pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
            request_id="tls-1", prompt_token_ids=[5, 6, 7], sampling=GREEDY), timeout=30))
        assert sum(len(r.token_ids) for r in replies) == GREEDY.max_tokens
    # the plaintext health port answers health only: kubelet's probe, nothing an attacker could use
    with grpc.insecure_channel(mtls_engine.health_address) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        load = pb_grpc.EngineStub(ch).GetLoad
        assert code_of(lambda: load(pb.LoadRequest(), timeout=10)) == grpc.StatusCode.UNIMPLEMENTED


def test_router_reaches_mtls_engines_with_its_client_certificate(mtls_engine, pki, e2e_model):
    """The router dials engines by address and checks the name the certificate holds instead."""
    paths = pki["paths"]
    with pytest.MonkeyPatch.context() as mp:
        for flag, value in (("CA_CERTS", paths["ca.pem"]), ("CERTFILE", paths["router.pem"]),
                            ("KEYFILE", paths["router.key"]), ("SERVER_NAME", "pdserve-engine")):
            mp.setenv(f"PDSERVE_ROUTER_ENGINE_SSL_{flag}", value)
        router = RouterProcess(e2e_model, [], [mtls_engine.address])
    try:
        router.wait_ready(1)
        body = json.dumps({"model": "tiny", "prompt": "The old king", "max_tokens": 5, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{router.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 5
    finally:
        assert router.stop() == 0


# ---- end to end -------------------------------------------------------------------------------

def http_get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.fixture(scope="module")
def token_stack(e2e_model):
    """prefill + decode over tcp and a router, every process holding the token (from the environment)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_AUTH_TOKEN", TOKEN)
        stack = Stack(e2e_model, StackSpec("tcp", prefills=1, decodes=1))
    yield stack
    stack.stop()


def test_token_end_to_end_through_the_gateway(token_stack, e2e_model):
    stack = token_stack
    before = stack.kv_counts()  # from /metrics: the helpers' gRPC load reports hold no token
    for prompt in ("The old king", "Once upon a time"):
        status, body = stack.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    # the decode's KV handshakes carried the token: each prompt's KV pulled once, none recomputed
    want = {"published": 2, "transfers": 2, "recomputed": 0}
    assert stack.kv_delta(before, want, timeout=30) == want
    assert http_get(f"{stack.url}/readyz") == (200, {"status": "ok"})


def test_router_with_the_wrong_token_sees_why_its_engines_are_down(token_stack, e2e_model):
    stack = token_stack
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_AUTH_TOKEN", "not-the-token")
        router = RouterProcess(e2e_model, [s.address for s in stack.prefills], [s.address for s in stack.decodes])
    try:
        def refused() -> bool:
            try:
                status, body = http_get(f"http://127.0.0.1:{router.port}/readyz")
            except OSError:
                return False
            return status == 503 and "UNAUTHENTICATED" in body["error"]["message"]

        assert poll_until(refused, 120, interval=0.2), router.output()
        assert http_get(f"http://127.0.0.1:{router.port}/livez")[0] == 200
    finally:
        assert router.stop() == 0


def test_router_probes_during_an_engine_outage(token_stack):
    """Liveness stays up (a restart would not bring the engines back); readiness and /health go down,
    and come back with the engines."""
    stack = token_stack
    decode = stack.decodes[0]
    decode.proc.send_signal(signal.SIGSTOP)  # hung, as an overloaded or partitioned engine
    try:
        assert poll_until(lambda: http_get(f"{stack.url}/readyz")[0] == 503, 60, interval=0.2)
        assert http_get(f"{stack.url}/health")[0] == 503
        status, body = http_get(f"{stack.url}/livez")
        assert (status, body) == (200, {"status": "ok"})
    finally:
        decode.proc.send_signal(signal.SIGCONT)
    assert poll_until(lambda: http_get(f"{stack.url}/readyz")[0] == 200, 60, interval=0.2)
    assert http_get(f"{stack.url}/livez")[0] == 200


def test_router_credential_flags_are_checked_at_start(pki, tmp_path):
    import argparse

    from services.router.cli import add_router_parser, config_from_args

    cli = argparse.ArgumentParser()
    add_router_parser(cli.add_subparsers())
    paths = pki["paths"]

    def config(*flags: str):
        return config_from_args(cli.parse_args(["router", "--decode", "127.0.0.1:50061", *flags]))

    for flags, message in (
            (("--engine-ssl-certfile", paths["router.pem"]), "--engine-ssl-certfile and --engine-ssl-keyfile go together"),
            (("--engine-ssl-certfile", paths["router.pem"], "--engine-ssl-keyfile", paths["router.key"]),
             "need --engine-ssl-ca-certs"),
            (("--engine-ssl-ca-certs", str(tmp_path / "missing.pem")), "--engine-ssl-ca-certs: cannot read"),
            (("--engine-auth-token", "a", "--engine-auth-token-file", paths["ca.pem"]), "not both")):
        with pytest.raises(ValueError, match=message):
            config(*flags)
    (tmp_path / "token").write_text(TOKEN + "\n")
    auth = config("--engine-auth-token-file", str(tmp_path / "token"), "--engine-ssl-ca-certs", paths["ca.pem"],
                  "--engine-ssl-certfile", paths["router.pem"], "--engine-ssl-keyfile", paths["router.key"]).engine_auth
    assert (auth.token, auth.ca_certs, auth.describe()) == (TOKEN.encode(), pki["ca.pem"], "mutual TLS + token")
    assert TOKEN not in repr(auth) and "PRIVATE KEY" not in repr(auth)
