"""`pdserve prefill`: its flags, and the service they start."""
from __future__ import annotations

import asyncio

from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.common import engine_host
from services.common.engine_flags import add_engine_parser, add_kv_flags, kv_connector_config
from services.common.flags import add
from services.common.role import Role
from services.prefill.servicer import PrefillServicer

HELP = "serve prefills: compute prompts' KV, publish it for decode instances"


def add_parser(sub) -> None:
    p = add_engine_parser(sub, Role.PREFILL, HELP)
    add_kv_flags(p)
    add(p, "--kv-host", default="127.0.0.1", help="address KV pulls connect to")
    add(p, "--kv-port", type=int, default=0,
        help="KV transfer port (0: any free port); with --tensor-parallel-size N, rank r serves port + r")
    add(p, "--kv-advertise-host", default=None,
        help="address written into KV handles for decodes to connect to, when it is not --kv-host "
             "(binding 0.0.0.0, NAT, a proxy in front of the KV port; default: --kv-host)")
    add(p, "--kv-lease-ttl", type=float, default=30.0, help="seconds a published KV stays pinned unpulled")
    p.set_defaults(func=lambda args: asyncio.run(serve(args)))


async def serve(args) -> int:
    if args.speculative_config is not None:
        raise ValueError("--speculative-config is for decode and colocated engines: a prefill instance "
                         "produces only the first token, there is nothing to speculate")
    kv = kv_connector_config(args, Role.PREFILL, host=args.kv_host, port=args.kv_port,
                             advertise_host=args.kv_advertise_host, lease_ttl_s=args.kv_lease_ttl)

    def add_servicer(host, server) -> None:
        pb_grpc.add_PrefillServicer_to_server(PrefillServicer(host, publishes_kv=kv is not None), server)

    return await engine_host.serve(args, Role.PREFILL, "Prefill", add_servicer, kv)
