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
    quantized = parse(Role.PREFILL, "--quantization", "compressed-tensors")
    assert EngineConfig.create(tiny_llama, **engine_kwargs(quantized)).model.quantization == "compressed-tensors"
    assert EngineConfig.create(tiny_llama, **engine_kwargs(parse(Role.DECODE))).parallel.cpu_allocator == "auto"


@pytest.mark.parametrize("flags, prefix, chunked", [
    ((), True, True), (("--enable-prefix-caching", "--enable-chunked-prefill"), True, True),
    (("--no-enable-prefix-caching",), False, True), (("--no-prefix-caching",), False, True),
    (("--no-enable-chunked-prefill",), True, False), (("--no-chunked-prefill",), True, False),
])
def test_vllms_spellings_of_the_cache_switches(flags, prefix, chunked):
    kwargs = engine_kwargs(parse(Role.DECODE, *flags))
    assert (kwargs["enable_prefix_caching"], kwargs["enable_chunked_prefill"]) == (prefix, chunked)


def test_contradictions_are_refused_and_the_cache_dtype_reaches_the_engine():
    with pytest.raises(ValueError, match="contradict"):
        engine_kwargs(parse(Role.DECODE, "--enable-prefix-caching", "--no-prefix-caching"))
    for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED):
        assert engine_kwargs(parse(role, "--kv-cache-dtype", "fp8"))["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(parse(Role.PREFILL))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        parse(Role.DECODE, "--kv-cache-dtype", "int8")
