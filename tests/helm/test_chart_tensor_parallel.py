"""tensorParallelSize per engine role: the flag, one accelerator per rank, /dev/shm for NCCL, the KV
listeners of a sharded prefill, and the values the chart refuses (Helm 3 and 4)."""
from __future__ import annotations

import argparse

import pytest

from chart_tools import CHART, KUBE_VERSIONS, by_kind, container, helm, lint, render, template, validate, value_args

ENGINES = ("prefill", "decode")


def engine_pods(docs: list[dict]) -> dict[str, dict]:
    deployments = by_kind(docs, "Deployment")
    return {role: deployments[f"pd-pdserve-{role}"]["spec"]["template"]["spec"] for role in ENGINES}


def tp_flags(c: dict) -> list[str]:
    return [a for a in c["args"] if a.startswith("--tensor-parallel-size")]


def test_tensor_parallel_size_one_renders_no_flag_and_one_gpu_per_pod():
    pods = engine_pods(render("3", sets={"prefill.tensorParallelSize": 1, "decode.tensorParallelSize": 1}))
    for role, spec in pods.items():
        c = container({"spec": {"template": {"spec": spec}}})
        assert tp_flags(c) == [], role  # the engine's default: today's single-device path
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("major", ["3", "4"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 4), (4, 2), (2, 1), (1, 4)])
def test_each_role_gets_its_flag_and_one_gpu_per_rank(major, prefill_tp, decode_tp):
    sizes = {"prefill": prefill_tp, "decode": decode_tp}
    docs = render(major, sets={f"{role}.tensorParallelSize": n for role, n in sizes.items()})
    assert [e for v in KUBE_VERSIONS for d in docs for e in validate(d, v)] == []
    for role, spec in engine_pods(docs).items():
        c = container({"spec": {"template": {"spec": spec}}})
        n = sizes[role]
        assert tp_flags(c) == ([f"--tensor-parallel-size={n}"] if n > 1 else []), role
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == n
        # NCCL's shared memory: a memory-backed /dev/shm in the engine container
        [dshm] = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    router = container(by_kind(docs, "Deployment")["pd-pdserve-router"])
    assert not tp_flags(router) and "nvidia.com/gpu" not in str(router["resources"])


def test_accelerators_are_per_rank_and_none_on_the_cpu():
    sets = {"decode.tensorParallelSize": 4, "decode.accelerator": {"resourceName": "amd.com/gpu", "count": 2},
            "prefill.tensorParallelSize": 2, "prefill.accelerator": {"resourceName": "nvidia.com/gpu", "count": 0},
            "engine.device": "auto", "kvTransfer.shm.sizeLimit": "16Gi"}
    pods = engine_pods(render("3", sets=sets))
    decode = container({"spec": {"template": {"spec": pods["decode"]}}})
    assert decode["resources"]["limits"]["amd.com/gpu"] == decode["resources"]["requests"]["amd.com/gpu"] == 8
    prefill = container({"spec": {"template": {"spec": pods["prefill"]}}})
    # count 0: the ranks share the pod's cores (gloo); no accelerator asked, the flag still passed
    assert "gpu" not in str(prefill["resources"]) and tp_flags(prefill) == ["--tensor-parallel-size=2"]
    for spec in pods.values():
        assert next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "16Gi"


def test_gpus_written_into_resources_by_hand_are_kept_when_the_accelerator_count_is_zero():
    sets = {"decode.tensorParallelSize": 4, "decode.accelerator.count": 0,
            "decode.resources": {"limits": {"nvidia.com/gpu": 4, "memory": "64Gi"}}}
    decode = container(by_kind(render("3", sets=sets), "Deployment")["pd-pdserve-decode"])
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == decode["resources"]["requests"]["nvidia.com/gpu"] == 4


def test_the_70b_example_shards_prefill_over_2_gpus_and_decode_over_4():
    docs = render("3", "tensor-parallel")
    deployments = by_kind(docs, "Deployment")
    for role, n in (("prefill", 2), ("decode", 4)):
        c = container(deployments[f"pd-pdserve-{role}"])
        assert tp_flags(c) == [f"--tensor-parallel-size={n}"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == n
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1  # a shared NIC per pod, not per rank
        assert "--kv-transport=ucx" in c["args"] and "--kv-cache-memory-gb=40" in c["args"]


def kv_ingress_from_decode(docs: list[dict]) -> list[dict]:
    policy = by_kind(docs, "NetworkPolicy")["pd-pdserve-prefill"]
    return [rule for rule in policy["spec"]["ingress"]
            if any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "decode"
                   for p in rule.get("from", []))]


def test_a_sharded_prefill_lets_decode_pods_reach_every_rank_listener_and_tp_one_only_the_kv_port():
    [single] = kv_ingress_from_decode(render("3", sets={"decode.tensorParallelSize": 4}))
    assert single["ports"] == [{"port": "kv", "protocol": "TCP"}]  # a sharded decode pulls; it listens on nothing
    docs = render("3", sets={"prefill.tensorParallelSize": 3, "kvTransfer.port": 50100})
    [sharded] = kv_ingress_from_decode(docs)
    # each rank's KV listener (rank r on the port + r) is named on the pod and opened, and nothing else
    assert sharded["ports"] == [{"port": name, "protocol": "TCP"} for name in ("kv", "kv-1", "kv-2")]
    prefill = container(by_kind(docs, "Deployment")["pd-pdserve-prefill"])
    assert [(p["name"], p["containerPort"]) for p in prefill["ports"] if p["name"].startswith("kv")] == [
        ("kv", 50100), ("kv-1", 50101), ("kv-2", 50102)]
    assert [e for v in KUBE_VERSIONS for d in docs for e in validate(d, v)] == []


@pytest.mark.parametrize("sets,message", [
    ({"kvTransfer.port": 65534}, "kvTransfer.port 65534: the prefill's 4 tensor-parallel ranks listen on ports "
                                 "65534..65537, past 65535"),
    ({"kvTransfer.port": 8999, "engine.metricsPort": 9001},
     "kvTransfer.port 8999: prefill tensor-parallel rank 2 listens on port 9001, which is already engine.metricsPort's"),
])
def test_rank_ports_that_overflow_or_collide_are_refused(sets, message):
    result = template("3", sets={"prefill.tensorParallelSize": 4, **sets}, check=False)
    assert result.returncode != 0 and message in result.stdout + result.stderr, result.stderr


REFUSED = {0: "minimum: got 0, want 1", -2: "minimum: got -2, want 1", 1.5: "got number, want integer",
           "2": "got string, want integer"}


@pytest.mark.parametrize("major", ["3", "4"])
@pytest.mark.parametrize("role", ENGINES)
@pytest.mark.parametrize("size", list(REFUSED), ids=repr)
def test_schema_refuses_a_size_below_one_or_not_an_integer(major, role, size):
    sets = {f"{role}.tensorParallelSize": size}
    for result in (template(major, sets=sets, check=False), lint(major, sets=sets, check=False)):
        out = result.stdout + result.stderr
        assert result.returncode != 0 and f"at '/{role}/tensorParallelSize'" in out and REFUSED[size] in out, out


def test_the_router_has_no_tensor_parallel_size():
    result = template("3", sets={"router.tensorParallelSize": 2}, check=False)
    assert result.returncode != 0 and "additional properties 'tensorParallelSize' not allowed" in result.stderr


@pytest.mark.parametrize("major", ["3", "4"])
def test_a_device_index_beyond_the_pods_gpus_fails_with_the_reason(major):
    sets = {"engine.device": "cuda:1", "decode.tensorParallelSize": 2, "prefill.accelerator.count": 0}
    result = template(major, sets=sets, check=False)
    assert result.returncode != 0
    assert ("engine.device cuda:1 puts decode's ranks on cuda:1..cuda:2, but its pods see 2 GPU(s), numbered from "
            "cuda:0 (decode.accelerator.count 1 x tensorParallelSize 2): use cuda or auto") in result.stderr
    assert template(major, sets={**sets, "decode.accelerator.count": 2}).returncode == 0  # 4 GPUs: cuda:1, cuda:2 exist


def test_notes_say_how_many_gpus_each_scaled_pod_holds():
    # Helm 4 renders NOTES without a cluster (`install --dry-run=client`)
    out = helm("4", "install", "pd", str(CHART), "--namespace", "llm", "--dry-run=client",
               *value_args("tensor-parallel", {"prefill.accelerator.count": 0})).stdout
    notes = out[out.index("NOTES:"):]
    assert "  decode (tensor parallel 4: 4 nvidia.com/gpu per pod): 2 replica(s), fixed" in notes
    assert "  prefill (tensor parallel 2: the ranks share the pod's CPUs): 2 replica(s), fixed" in notes
    assert "  router: 1 replica(s)" in notes


def engine_cli() -> argparse.ArgumentParser:
    """The engines' own parsers: a rendered command line means what they make of it."""
    from services.decode.cli import add_parsers as add_decode_parsers
    from services.prefill.cli import add_parser as add_prefill_parser
    cli = argparse.ArgumentParser(prog="pdserve")
    sub = cli.add_subparsers(dest="command", required=True)
    add_prefill_parser(sub)
    add_decode_parsers(sub)
    return cli


def parsed_args(role: str, sets: dict, major: str = "3") -> argparse.Namespace:
    deployment = by_kind(render(major, sets=sets), "Deployment")[f"pd-pdserve-{role}"]
    return engine_cli().parse_args(container(deployment)["args"])


@pytest.mark.parametrize("major", ["3", "4"])
@pytest.mark.parametrize("cpu_limit,tp,threads", [("2", 2, 1), ("1500m", 2, 1), ("9", 2, 4), (16, 4, 4), (3.5, 2, 1)])
def test_cpu_ranks_split_the_pods_cpu_limit_and_the_engine_cli_takes_it(major, cpu_limit, tp, threads):
    sets = {"prefill.tensorParallelSize": tp, "prefill.accelerator.count": 0,
            "prefill.resources": {"requests": {"cpu": "1"}, "limits": {"cpu": cpu_limit, "memory": "8Gi"}}}
    args = parsed_args("prefill", sets, major)
    assert (args.tensor_parallel_size, args.num_threads) == (tp, threads)


def test_threads_are_left_to_the_engine_on_gpus_without_a_cpu_limit_and_to_the_user_in_extra_args():
    docs = render("3", sets={"decode.tensorParallelSize": 2, "decode.resources.limits.cpu": "8",
                             "prefill.tensorParallelSize": 2, "prefill.accelerator.count": 0,
                             "prefill.resources": {"requests": {"cpu": "4"}}})
    deployments = by_kind(docs, "Deployment")
    for role in ENGINES:  # decode: on GPUs; prefill: on the CPU but with no limit to split
        assert not any(a.startswith("--num-threads") for a in container(deployments[f"pd-pdserve-{role}"])["args"])
    sets = {"prefill.tensorParallelSize": 2, "prefill.accelerator.count": 0, "prefill.resources.limits.cpu": "8",
            "prefill.extraArgs": ["--num-threads=3"]}
    args = parsed_args("prefill", sets)
    assert args.num_threads == 3  # extraArgs come last: the user's flag wins
