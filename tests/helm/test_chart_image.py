"""The image the chart runs: built from what the Dockerfile copies (and .dockerignore lets
through), it generates the gRPC code and answers `pdserve <role>`; it runs as the chart's user.
(No Docker daemon is needed: the build context is assembled and exercised as the build would.)"""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns we use: root-relative globs, `**/` for any depth."""
    parts = path.split("/")
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(p, pattern[3:]) for p in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            return True
    return False


def build_context() -> list[str]:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    return [p for p in tracked if (ROOT / p).is_file() and not ignored(p, patterns)]


def test_image_runs_as_the_charts_non_root_user_with_pdserve_as_entrypoint():
    values = yaml.safe_load((ROOT / "helm" / "pdserve" / "values.yaml").read_text())
    user = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M)
    assert user == [(str(values["podSecurityContext"]["runAsUser"]), str(values["podSecurityContext"]["runAsGroup"]))]
    assert json.loads(re.search(r"^ENTRYPOINT (.+)$", DOCKERFILE, re.M).group(1)) == ["pdserve"]
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:[\w.]+-cuda[\d.]+-cudnn\d+-runtime$", DOCKERFILE, re.M)
    run = DOCKERFILE[DOCKERFILE.index("RUN pip install grpcio-tools"):]
    assert run.index("python -m services.api.generate") < run.index('pip install -e ".[triton,ucx]"')


def test_build_context_generates_the_grpc_code_and_serves_every_role(tmp_path):
    context = build_context()
    assert not any(p.startswith(("services/api/pdserve/", ".venv/", "tests/")) for p in context)
    copied = [src for src in re.findall(r"^COPY (\S+)", DOCKERFILE, re.M) if not src.startswith("--")]
    for src in copied:
        assert any(p == src or p.startswith(src + "/") for p in context), f"COPY {src}: not in the build context"
    for path in context:
        if any(path == src or path.startswith(src + "/") for src in copied):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, tmp_path / path)
    subprocess.run([sys.executable, "-m", "services.api.generate"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "services/api/pdserve/v1/pdserve_pb2_grpc.py").exists()
    probe = ("import services, services.cli as c; assert services.__file__.startswith(%r), services.__file__; "
             "print(' '.join(c.build_parser()._subparsers._group_actions[0].choices))" % str(tmp_path))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert {"prefill", "decode", "colocated", "router"} <= set(out.stdout.split())
    planner = subprocess.run([sys.executable, "-m", "services.planner", "--help"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert planner.returncode == 0 and "--prefill-deployment" in planner.stdout, planner.stderr
