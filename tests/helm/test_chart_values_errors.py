"""Wrong values stop `helm lint` and `helm template` (Helm 3 and 4) with a message saying what is wrong."""
from __future__ import annotations

import pytest

from chart_tools import lint, template

CASES = {
    "negative replicas": ({"prefill.replicas": -1}, "at '/prefill/replicas': minimum: got -1, want 0"),
    "HPA and planner both on for decode": (
        {"decode.autoscaling.enabled": True, "planner.enabled": True},
        "decode: its HorizontalPodAutoscaler (decode.autoscaling.enabled) and the planner (planner.decode.enabled) "
        "would both scale it, they are mutually exclusive: turn one off"),
    "unknown transport": ({"kvTransfer.transport": "rdma"},
                          "at '/kvTransfer/transport': value must be one of 'tcp', 'shm', 'ucx', 'nccl'"),
    "RDMA without a transport that uses it": ({"kvTransfer.rdma.enabled": True}, "at '/kvTransfer/transport'"),
    "PVC source without a claim": ({"model.source": "pvc"}, "/model/pvc"),
    "typo in a role block": ({"decode.replica": 2}, "additional properties 'replica' not allowed"),
    "accelerator count below zero": ({"prefill.accelerator.count": -1}, "at '/prefill/accelerator/count'"),
    "typo in engineAuth": ({"engineAuth.tls.secret": "x"}, "additional properties 'secret' not allowed"),
    "typo in kvEvents": ({"kvEvents.replay_port": 5558}, "additional properties 'replay_port' not allowed"),
    "KV events replay buffer of zero": ({"kvEvents.bufferSteps": 0}, "at '/kvEvents/bufferSteps'"),
    "unknown router policy": ({"router.policy": "prefix"}, "at '/router/policy'"),
    "GPU memory share above 1": ({"engine.gpuMemoryUtilization": 1.5}, "at '/engine/gpuMemoryUtilization'"),
}
# What a schema cannot compare, the templates check (`fail`); helm lint reports those as [INFO] only.
TEMPLATE_CASES = {
    "min above max": ({"prefill.autoscaling.minReplicas": 5, "prefill.autoscaling.maxReplicas": 2},
                      "prefill.autoscaling: minReplicas (5) is above maxReplicas (2)"),
    "two KV cache sizes": ({"engine.kvCacheMemoryGb": 40, "engine.gpuMemoryUtilization": 0.9},
                           "engine.kvCacheMemoryGb sizes the KV cache too: give one"),
    "planner with no role": ({"planner.enabled": True, "planner.prefill.enabled": False,
                              "planner.decode.enabled": False}, "the planner scales nothing"),
    "TLS without its Secret": ({"engineAuth.tls.enabled": True}, "name the Secret holding tls.crt, tls.key and ca.crt"),
    "KV events on the metrics port": ({"kvEvents.enabled": True, "kvEvents.port": 9090},
                                      "kvEvents.port: port 9090 is already engine.metricsPort's"),
    "KV events replay on the events port": ({"kvEvents.enabled": True, "kvEvents.replayPort": 5557},
                                            "kvEvents.replayPort: port 5557 is already kvEvents.port's"),
}


@pytest.mark.parametrize("major", ["3", "4"])
@pytest.mark.parametrize("case", list(CASES))
def test_wrong_values_fail_with_the_reason(major, case):
    sets, message = CASES[case]
    for result in (template(major, sets=sets, check=False), lint(major, sets=sets, check=False)):
        assert result.returncode != 0
        assert message in result.stdout + result.stderr, result.stdout + result.stderr


def test_hpa_on_one_role_and_the_planner_on_the_other_is_fine():
    sets = {"prefill.autoscaling.enabled": True, "planner.enabled": True, "planner.prefill.enabled": False}
    assert template("3", sets=sets).returncode == 0


@pytest.mark.parametrize("major", ["3", "4"])
@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
def test_values_the_schema_cannot_compare_fail_helm_template(major, case):
    sets, message = TEMPLATE_CASES[case]
    result = template(major, sets=sets, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    linted = lint(major, sets=sets, check=False)
    assert message in linted.stdout + linted.stderr
