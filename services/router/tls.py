"""TLS on the router's own fronts (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs): HTTPS for the gateway and TLS for the gRPC Generate front, with the same
certificate. The files are read at start-up: a missing or mismatched one stops the router there."""
from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

CERT_REQS = {0: "none", 1: "optional", 2: "required"}  # ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED


@dataclass(frozen=True)
class FrontTls:
    certfile: str
    keyfile: str
    ca_certs: str | None = None  # CA bundle client certificates are checked against
    cert_reqs: int = 0  # vLLM's: 0 no client certificate asked for, 1 optional, 2 required

    @classmethod
    def from_flags(cls, certfile: str | None, keyfile: str | None, ca_certs: str | None,
                   cert_reqs: int) -> "FrontTls | None":
        if not certfile and not keyfile:
            if ca_certs or cert_reqs:
                raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
            return None
        if not certfile or not keyfile:
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        if cert_reqs not in CERT_REQS:
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}")
        if cert_reqs and not ca_certs:
            raise ValueError("--ssl-cert-reqs 1 or 2 (client certificates) needs --ssl-ca-certs")
        tls = cls(certfile, keyfile, ca_certs, cert_reqs)
        tls.ssl_context()  # the files load now, or the router does not start
        return tls

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile)
            if self.ca_certs:
                ctx.load_verify_locations(self.ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: {e}") from None
        ctx.verify_mode = ssl.VerifyMode(self.cert_reqs)
        return ctx

    def grpc_credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        # gRPC asks for a client certificate or does not: "optional" asks and accepts none too.
        return grpc.ssl_server_credentials([(read(self.keyfile), read(self.certfile))],
                                           root_certificates=read(self.ca_certs) if self.ca_certs else None,
                                           require_client_auth=self.cert_reqs == 2)
