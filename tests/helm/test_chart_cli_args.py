"""Every command line the chart renders is one the pdserve CLIs accept: the router's, the
engines' and the planner's own parsers and configs take the rendered args as they are."""
from __future__ import annotations

import argparse

import pytest
import trustme

from chart_tools import by_kind, container, render


TLS_MOUNTS = ("/etc/pdserve/tls", "/etc/pdserve/router-tls")  # the engines' Secret, the router's


def mounted_tls_secret(folder) -> dict[str, bytes]:
    """What a cert-manager Certificate's Secret holds, as files named like its keys."""
    ca = trustme.CA()
    cert = ca.issue_cert("pdserve-engine.llm.svc")
    files = {"ca.crt": ca.cert_pem.bytes(), "tls.crt": cert.cert_chain_pems[0].bytes(),
             "tls.key": cert.private_key_pem.bytes()}
    for key, data in files.items():
        (folder / key).write_bytes(data)
    return files


def _mounted(arg: str, folder) -> str:
    for mount in TLS_MOUNTS:
        arg = arg.replace(mount, str(folder))
    return arg


def parser(*hooks) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve")
    sub = p.add_subparsers(dest="command", required=True)
    for hook in hooks:
        hook(sub)
    return p


@pytest.mark.parametrize("value_set", [None, "gpu-ucx-rdma", "planner", "model-pvc", "cpu-only", "engine-mtls",
                                       "kv-events", "tensor-parallel", "router-tls"],
                         ids=lambda v: v or "defaults")
def test_rendered_args_parse_with_the_pdserve_clis(value_set, tmp_path):
    from services.common.auth import ServerAuth
    from services.decode.cli import add_parsers as add_decode_parsers
    from services.planner.cli import add_planner_parser, config_from_args as planner_config
    from services.prefill.cli import add_parser as add_prefill_parser
    from services.router.cli import add_router_parser, config_from_args as router_config

    cli = parser(add_prefill_parser, add_decode_parsers, add_router_parser, add_planner_parser)
    deployments = by_kind(render("3", value_set), "Deployment")
    tls = mounted_tls_secret(tmp_path)
    for name, deployment in deployments.items():
        # The TLS Secret's files where the chart mounts them, here under tmp_path.
        args = cli.parse_args([_mounted(a, tmp_path) for a in container(deployment)["args"]])
        role = name.rsplit("-", 1)[1]
        assert args.command == role
        if role == "router":
            config = router_config(args)
            assert config.disaggregated and config.discovery in ("dns", "kubernetes")
            assert config.engine_auth.ca_certs == (tls["ca.crt"] if value_set == "engine-mtls" else None)
            assert config.policy == ("kv_aware" if value_set == "kv-events" else "least_load")
            assert [n for n, _ in config.lora_modules] == (["qwen-sql", "qwen-support"] if value_set == "model-pvc"
                                                           else [])
            assert config.allow_runtime_lora_updating == (value_set == "model-pvc")
            assert config.lora_resolver_dir == ("/models/adapters" if value_set == "model-pvc" else None)
            assert config.lora_resolver_max_loras == (8 if value_set == "model-pvc" else 32)
            if value_set == "router-tls":  # the files load, client certificates demanded
                assert config.tls is not None and config.tls.cert_reqs == 2
            else:
                assert config.tls is None
        elif role == "planner":
            assert set(planner_config(args).roles) == {"prefill", "decode"}
        else:
            assert args.metrics_port and args.kv_transport == ("ucx" if value_set in ("gpu-ucx-rdma", "tensor-parallel")
                                                               else "tcp")
            assert args.tensor_parallel_size == ({"prefill": 2, "decode": 4}[role] if value_set == "tensor-parallel"
                                                 else 1)
            from services.common.engine_host import engine_kwargs

            lora = engine_kwargs(args).get("lora_modules")
            assert lora == (["qwen-sql=/models/adapters/sql", "qwen-support=/models/adapters/support"]
                            if value_set == "model-pvc" else None)
            auth = ServerAuth.from_args(args)
            assert auth.describe() == ("mutual TLS" if value_set == "engine-mtls" else "none")
            events = args.kv_events_config  # parsed by the engines' own --kv-events-config type
            assert (events is not None and events.active) == (value_set == "kv-events")
