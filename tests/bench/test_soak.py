"""A short `make soak`: every fault injected once under twice the stack's capacity, nothing lost,
greedy outputs exact, no KV block left pinned, every service stopping cleanly."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = __file__.rsplit("/tests/", 1)[0]


@pytest.mark.e2e
@pytest.mark.timeout(1500)  # three restarts of engines that warm up for tens of seconds on a busy box
def test_short_soak_loses_nothing(e2e_model, tmp_path):
    result = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "soak.py"), "--model", e2e_model, "--duration", "30", "--overtime", "180",
         "--capacity-seconds", "6", "--greedy-prompts", "8", "--kv-lease-ttl", "10",
         "--log-dir", str(tmp_path / "logs"), "--result-file", str(result)],
        cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert result.exists(), f"no result:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    s = json.loads(result.read_text())
    report = f"{proc.stdout[-4000:]}\n{json.dumps(s, indent=1)[:4000]}"
    events = " | ".join(f["event"] for f in s["faults"])
    for fault in ("kill -9 prefill-0", "KV connection reset mid-pull", "kill -9 decode-0",
                  "kill -9 decode-1's engine core", "decode-1 exited (code"):
        assert fault in events, report
    assert events.count("back in the router's pool") == 3, report
    assert not s["faults_missed"], report
    assert s["lost"] == 0, report
    assert s["completed"] > 0 and s["disconnected"] > 0, report
    assert s["sent"] == s["completed"] + s["rejected"] + s["failed"] + s["disconnected"], report
    assert s["greedy_checked"] > 0 and s["greedy_mismatches"] == 0, report
    assert s["pinned_blocks"] == 0 and s["left_in_engines"] == 0, report
    assert all(code == 0 for code in s["exit_codes"].values()), report
    assert proc.returncode == 0, report
