"""Layers only reach downward: services -> engine -> kernels; services -> kvtransfer -> kernels."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "kernels": {"engine", "services", "kvtransfer"},
    "engine": {"services", "kvtransfer"},
    "kvtransfer": {"engine", "services"},
}


def imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    files = list((ROOT / package).rglob("*.py"))
    if package in ("kernels", "engine"):
        assert files, f"{package}/ should exist"
    for path in files:
        bad = imported_roots(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: a layer reaching upward"
