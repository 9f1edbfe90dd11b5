"""PDSERVE_LOG_LEVEL: every pdserve process's log level, checked before anything starts."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from engine.log_config import log_level

ROOT = __file__.rsplit("/tests/", 1)[0]


@pytest.mark.parametrize("value,level", [(None, logging.INFO), ("", logging.INFO), ("debug", logging.DEBUG),
                                         (" WARNING ", logging.WARNING), ("Error", logging.ERROR)])
def test_levels_by_name_info_by_default(monkeypatch, value, level):
    if value is None:
        monkeypatch.delenv("PDSERVE_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_LOG_LEVEL", value)
    assert log_level() == level


def test_an_unknown_level_is_refused_before_any_service_starts():
    env = {"PDSERVE_LOG_LEVEL": "verbose", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "router", "--model", "nowhere"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "PDSERVE_LOG_LEVEL='VERBOSE': choose one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_planner_on_its_own_refuses_an_unknown_level_too():
    env = {"PDSERVE_LOG_LEVEL": "loud", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "services.planner", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "PDSERVE_LOG_LEVEL='LOUD': choose one of" in proc.stderr and "Traceback" not in proc.stderr

