"""`pdserve decode` and `pdserve colocated` (a decode without a KV connector): flags and service."""
from __future__ import annotations

import asyncio

from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.common import engine_host
from services.common.engine_flags import add_engine_parser, add_kv_flags, kv_connector_config
from services.common.flags import add
from services.common.role import Role
from services.decode.servicer import DecodeServicer

HELP = {Role.DECODE: "serve decodes: pull KV from prefill instances, continue with continuous batching",
        Role.COLOCATED: "one engine that does both (the baseline, and the path for short prompts)"}


def add_parsers(sub) -> None:
    p = add_engine_parser(sub, Role.DECODE, HELP[Role.DECODE])
    add_kv_flags(p)
    add(p, "--kv-timeout", type=float, default=30.0, help="deadline of one KV pull, seconds")
    p.set_defaults(func=lambda args: asyncio.run(serve(args, Role.DECODE)))
    p = add_engine_parser(sub, Role.COLOCATED, HELP[Role.COLOCATED])
    p.set_defaults(func=lambda args: asyncio.run(serve(args, Role.COLOCATED)))


async def serve(args, role: Role) -> int:
    kv = kv_connector_config(args, role, timeout_s=args.kv_timeout) if role is Role.DECODE else None

    def add_servicer(host, server) -> None:
        pb_grpc.add_DecodeServicer_to_server(DecodeServicer(host, pulls_kv=kv is not None), server)

    return await engine_host.serve(args, role, "Decode", add_servicer, kv)
