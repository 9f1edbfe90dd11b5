"""Golden renders: a change in what the chart produces must come with updated golden files.

Regenerate after an intended change, then review the diff like code:
    PDSERVE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/helm/test_chart_golden.py
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from chart_tools import normalized, render

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("major", ["3", "4"])
@pytest.mark.parametrize("value_set", ["cpu-only", "gpu-ucx-rdma", "engine-mtls", "kv-events", "tensor-parallel"])
def test_render_matches_golden(value_set, major):
    path = GOLDEN / f"{value_set}.yaml"
    text = normalized(render(major, value_set))
    if UPDATE and major == "3":
        path.write_text(text)
    expected = path.read_text() if path.exists() else ""
    if text != expected:
        diff = "".join(list(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                                 f"golden/{path.name}", f"helm {major} template"))[:80])
        pytest.fail(f"the chart's output for {value_set} changed (Helm {major}). If intended, regenerate with\n"
                    f"  PDSERVE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/helm/test_chart_golden.py\n"
                    f"and commit tests/helm/golden/.\n{diff}")
