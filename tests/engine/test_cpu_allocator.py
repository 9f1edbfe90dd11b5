"""The engine's process allocator: TCMalloc preloaded into a CPU engine core's process where the
machine has it, the user's choice kept, a clear error when it is insisted on and missing."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from engine import SamplingParams, cpu_allocator
from engine.async_engine import AsyncEngine
from engine.config import ParallelConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def mapped_allocators(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {os.path.basename(line.split()[-1]) for line in f if "malloc" in line.split()[-1]}


@pytest.fixture
def fake_tcmalloc(tmp_path, monkeypatch):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: str(lib))
    return str(lib)


def test_auto_preloads_tcmalloc_for_a_cpu_engine_only(fake_tcmalloc):
    assert cpu_allocator.preload_for("auto", "cpu", {}) == fake_tcmalloc
    # Whatever the user preloads besides is kept, after it.
    assert cpu_allocator.preload_for("auto", "cpu", {"LD_PRELOAD": "/x/libfoo.so"}) == f"{fake_tcmalloc}:/x/libfoo.so"
    assert cpu_allocator.preload_for("auto", "cuda", {}) is None
    assert cpu_allocator.preload_for("tcmalloc", "cuda", {}) == fake_tcmalloc
    assert cpu_allocator.preload_for("system", "cpu", {}) is None
    # An allocator the user chose is left alone, whichever it is.
    for chosen in ("/opt/libjemalloc.so.2", "/usr/lib/libtcmalloc.so.4", "/a/libmimalloc.so"):
        assert cpu_allocator.preload_for("tcmalloc", "cpu", {"LD_PRELOAD": f"/x/libfoo.so {chosen}"}) is None
    with pytest.raises(ValueError, match="auto, tcmalloc or system|one of auto, tcmalloc, system"):
        cpu_allocator.preload_for("jemalloc", "cpu", {})


def test_a_missing_tcmalloc_is_an_error_only_when_insisted_on(monkeypatch, caplog):
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: None)
    with pytest.raises(ValueError, match="libtcmalloc-minimal4"):
        cpu_allocator.preload_for("tcmalloc", "cpu", {})
    with caplog.at_level(logging.WARNING, logger="engine.cpu_allocator"):
        assert cpu_allocator.preload_for("auto", "cpu", {}) is None
    assert "TCMalloc not found" in caplog.text
    with pytest.raises(ValueError, match="cpu_allocator"):
        ParallelConfig(cpu_allocator="jemalloc")


def test_device_type_without_torch():
    assert cpu_allocator.device_type_of("cpu", {}) == "cpu"
    assert cpu_allocator.device_type_of("cuda:1", {}) == "cuda"
    assert cpu_allocator.device_type_of("auto", {"CUDA_VISIBLE_DEVICES": ""}) == "cpu"
    has_gpu = any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")) or os.path.exists("/dev/kfd")
    assert cpu_allocator.device_type_of("auto", {}) == ("cuda" if has_gpu else "cpu")


def test_lookup_reads_the_loader_cache_and_never_scans(tmp_path, monkeypatch):
    import glob

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    cache = (f"\tlibtcmalloc_minimal_debug.so.4 (libc6,x86-64) => /nowhere/libtcmalloc_minimal_debug.so.4\n"
             f"\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => {lib}\n")

    def scan(*args, **kwargs):
        raise AssertionError("a filesystem scan")

    monkeypatch.setattr(glob, "glob", scan)
    monkeypatch.setattr(os, "walk", scan)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, cache, ""))
    assert cpu_allocator.find_tcmalloc() == str(lib)


def _engine_core_allocators(model: str, **kwargs) -> tuple[set[str], list[int]]:
    async def main():
        engine = await AsyncEngine.create(model, multiprocess=True, device="cpu", **kwargs)
        try:
            token_ids = []
            async for out in engine.generate("The old king", GREEDY):
                token_ids += out.delta_token_ids
            return mapped_allocators(engine.client.proc.pid), token_ids
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_a_cpu_engine_core_runs_on_tcmalloc_where_installed(tiny_llama):
    before = os.environ.get("LD_PRELOAD")
    path = cpu_allocator.find_tcmalloc()
    auto, tokens_auto = _engine_core_allocators(tiny_llama)
    system, tokens_system = _engine_core_allocators(tiny_llama, cpu_allocator="system")
    assert os.environ.get("LD_PRELOAD") == before  # the front end's own environment is untouched
    assert tokens_auto == tokens_system and len(tokens_auto) == 4
    assert not any("tcmalloc" in name for name in system)
    if path is None:  # `make test` installs it (scripts/system-deps.sh); a bare machine falls back
        assert not any("tcmalloc" in name for name in auto)
        with pytest.raises(Exception, match="libtcmalloc-minimal4"):
            _engine_core_allocators(tiny_llama, cpu_allocator="tcmalloc")
    else:
        assert os.path.basename(os.path.realpath(path)) in auto


def test_reexec_keeps_pid_and_arguments_and_happens_once(tmp_path):
    """What `pdserve profile` does: re-executed once with TCMalloc (where installed), same pid
    and arguments; without the library it goes on as it is."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        from engine.cpu_allocator import reexec_with_allocator
        print("start", os.getpid(), sys.argv[1:], flush=True)
        reexec_with_allocator("auto", "cpu")
        reexec_with_allocator("auto", "cpu")  # marked: never a second time
        maps = open("/proc/self/maps").read()
        print("done", os.getpid(), sys.argv[1:], "tcmalloc" in maps, flush=True)
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", cpu_allocator.REEXEC_MARK)}
    out = subprocess.run([sys.executable, str(script), "--flag", "a b"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    pid = lines[0].split()[1]
    if cpu_allocator.find_tcmalloc() is None:
        assert lines == [f"start {pid} ['--flag', 'a b']", f"done {pid} ['--flag', 'a b'] False"]
    else:
        assert lines == [f"start {pid} ['--flag', 'a b']"] * 2 + [f"done {pid} ['--flag', 'a b'] True"]
