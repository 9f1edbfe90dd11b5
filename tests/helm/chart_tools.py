"""Render and lint the chart with a real Helm, and validate what it produces offline against
the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors)."""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import yaml
from kubernetes_validate import utils as kv
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
VALUES = Path(__file__).resolve().parent / "values"
sys.path.insert(0, str(ROOT / "helm"))
from fetch_helm import helm_binary  # noqa: E402

RELEASE, NAMESPACE = "pd", "llm"
KUBE_VERSIONS = ("1.30", kv.major_minor(kv.latest_version()))  # the oldest we promise, and the newest the schemas know
# Custom resources have no schema in kubernetes-validate: checked by the tests that use them.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def value_args(value_set: str | None, sets: dict | None = None) -> list[str]:
    args = ["-f", str(VALUES / f"{value_set}.yaml")] if value_set else []
    for key, value in (sets or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def helm(major: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(helm_binary(major)), *args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {major} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def template(major: str, value_set: str | None = None, sets: dict | None = None,
             kube_version: str = KUBE_VERSIONS[0], check: bool = True) -> subprocess.CompletedProcess:
    return helm(major, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version",
                f"{kube_version}.0", *value_args(value_set, sets), check=check)


def render(major: str, value_set: str | None = None, sets: dict | None = None) -> list[dict]:
    return [d for d in yaml.safe_load_all(template(major, value_set, sets).stdout) if d]


def lint(major: str, value_set: str | None = None, sets: dict | None = None, check: bool = True):
    return helm(major, "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *value_args(value_set, sets),
                check=check)


@functools.cache
def _validator(version: str, kind: str, api_version: str) -> jsonschema.Validator:
    """kubernetes_validate.validate(), with each schema loaded once (they are megabytes)."""
    version = [v for v in kv.all_versions() if kv.major_minor(v) == version][-1]
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # rbac.authorization.k8s.io/v1 -> rbac-v1
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kv.schema_contents(f"{folder}/{kind.lower()}-{api}.json", version)
    definitions = kv.schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(doc: dict, version: str) -> list[str]:
    """Every strict-schema error of one manifest, as 'Kind/name: path: message'."""
    if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
        return []
    validator = _validator(version, doc["kind"], doc["apiVersion"])
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict, name: str | None = None) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def normalized(docs: list[dict]) -> str:
    """A stable text of the manifests: sorted by kind and name, keys sorted (Helm 3 and 4 alike)."""
    ordered = sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))
    return yaml.safe_dump_all(ordered, sort_keys=True, default_flow_style=False, width=120)
