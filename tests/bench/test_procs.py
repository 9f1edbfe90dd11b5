"""A benchmark stopped by a signal, or killed outright, leaves no service of its stack running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.services.service_procs import poll_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A stand-in service: records the SIGTERM it drains on, then exits.
CHILD = textwrap.dedent("""
    import signal, sys
    def on_term(signum, frame):
        open(sys.argv[1], "w").write("drained")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(sys.argv[2], "w").write("up")
    while True:
        signal.pause()  # until its SIGTERM
""")

# A benchmark as the bench mains run: signals become SystemExit, the stack stops in `finally`.
PARENT = textwrap.dedent("""
    import signal, sys
    from bench.procs import Proc, exit_on_signals
    exit_on_signals()
    tmp = sys.argv[1]
    child = Proc("child", [sys.executable, "-c", sys.argv[2], tmp + "/drained", tmp + "/up"])
    open(tmp + "/child.pid", "w").write(str(child.proc.pid))
    try:
        while True:
            signal.pause()  # until a signal ends it (exit_on_signals), or SIGKILL
    finally:
        child.stop(timeout=30)
        open(tmp + "/stopped", "w").write(str(child.proc.returncode))
""")


def _start(tmp_path, hangup=signal.SIG_DFL) -> tuple[subprocess.Popen, int]:
    # SIGHUP as a terminal's shell would leave it (this suite may itself run under nohup), or ignored.
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), CHILD], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT),
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))
    def up() -> bool:
        assert parent.poll() is None, "the benchmark exited during start-up"
        return (tmp_path / "up").exists()

    assert poll_until(up, 60), "the child never came up"
    return parent, int((tmp_path / "child.pid").read_text())


def _gone(pid: int, timeout: float = 30) -> bool:
    def exited() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
        except FileNotFoundError:
            return True

    return poll_until(exited, timeout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_benchmark_stops_its_stack_before_it_exits(tmp_path, sig):
    parent, child = _start(tmp_path)
    parent.send_signal(sig)
    assert parent.wait(60) == 128 + sig
    assert (tmp_path / "stopped").read_text() == "0"  # its finally ran and the child exited cleanly
    assert (tmp_path / "drained").read_text() == "drained"
    assert _gone(child, 5)


def test_a_benchmark_killed_outright_still_stops_its_stack(tmp_path):
    parent, child = _start(tmp_path)
    parent.kill()
    parent.wait(60)
    assert _gone(child), "the child outlived its killed benchmark"
    assert (tmp_path / "drained").read_text() == "drained"  # it got SIGTERM, so a service drains
    assert not (tmp_path / "stopped").exists()


def test_a_benchmark_started_under_nohup_keeps_running_through_a_hangup(tmp_path):
    parent, child = _start(tmp_path, hangup=signal.SIG_IGN)
    parent.send_signal(signal.SIGHUP)
    # Had the hangup been taken, it would end the benchmark as 129 (Python runs pending handlers in
    # signal order, and the first one ignores the rest); ignored, only SIGTERM stops it, its stack first.
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(60) == 128 + signal.SIGTERM
    assert (tmp_path / "drained").read_text() == "drained"
    assert _gone(child, 5)
