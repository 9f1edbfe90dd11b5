"""Every engine flag a service takes reaches its engine (--linear-backend was parsed and dropped)."""
from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from services.common.engine_flags import add_engine_parser
from services.common.engine_host import engine_kwargs
from services.common.role import Role

# The service's own flags: where it listens, who it is, how it stops, its TLS and tokens.
SERVICE_FLAGS = {"cmd", "model", "served_model_name", "host", "port", "metrics_port", "health_port", "engine_id",
                 "drain_timeout", "inproc", "auth_token", "auth_token_file", "ssl_ca_certs", "ssl_certfile",
                 "ssl_keyfile"}


def parse(role: Role, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="cmd"), role, role.value)
    return parser.parse_args([role.value, *flags])


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_every_engine_flag_is_read_into_the_engine_arguments(role):
    read = set()

    class Recording(argparse.Namespace):
        def __getattribute__(self, name):
            read.add(name)
            return object.__getattribute__(self, name)

    args = parse(role)
    engine_kwargs(Recording(**vars(args)))
    assert set(vars(args)) - read == SERVICE_FLAGS


def test_cpu_and_linear_backends_reach_the_engine_config(tiny_llama):
    args = parse(Role.DECODE, "--model", tiny_llama, "--linear-backend", "torch", "--cpu-allocator", "system",
                 "--stream-interval", "8")
    config = EngineConfig.create(tiny_llama, **engine_kwargs(args))
    assert (config.model.linear_backend, config.parallel.cpu_allocator) == ("torch", "system")
    assert config.stream_interval == 8
    assert EngineConfig.create(tiny_llama, **engine_kwargs(parse(Role.DECODE))).parallel.cpu_allocator == "auto"
