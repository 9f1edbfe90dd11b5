"""bench/gpu_check.py names the tests that fail on the GPU, from pytest's own short summary."""
from __future__ import annotations

import subprocess
import sys

from bench.gpu_check import failing_tests


def test_failing_tests_names_each_failure_and_error(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_wrong_token():\n    assert [1, 2] == [1, 3], 'token 1 differs'\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no CUDA device')\n"
        "def test_setup_error(broken):\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    failed = failing_tests(proc.stdout)
    assert len(failed) == 2
    assert failed[0].startswith("FAILED test_sample.py::test_wrong_token") and "token 1 differs" in failed[0]
    assert failed[1].startswith("ERROR test_sample.py::test_setup_error") and "no CUDA device" in failed[1]


def test_failing_tests_caps_a_long_list():
    out = "\n".join(f"FAILED tests/t.py::test_{i} - AssertionError" for i in range(50))
    failed = failing_tests(out, limit=40)
    assert len(failed) == 41 and failed[-1] == "... 10 more" and failed[39].endswith("test_39 - AssertionError")
