"""Build-on-first-use C++ kernels for CPUs (torch cpp_extension); None when no compiler."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil

logger = logging.getLogger(__name__)
_SRC = os.path.join(os.path.dirname(__file__), "csrc", "cpu_attention.cpp")


def _cpu_tag() -> str:
    """-march=native code must not run on another CPU: key the build on the CPU's flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module, or None (then callers use the pure torch path)."""
    if os.environ.get("PDSERVE_NO_CPU_EXTENSION"):
        return None
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension

        root = os.environ.get("PDSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))
        with open(_SRC, "rb") as f:  # keyed by content and flags: an upgrade never meets a stale build
            source = hashlib.sha1(f.read() + repr((_CFLAGS, _LDFLAGS)).encode()).hexdigest()[:10]
        build = os.path.join(root, "cpu-ext", f"{_cpu_tag()}-{source}")
        os.makedirs(build, exist_ok=True)
        built = _import_built(build)
        if built is not None:  # the common case: no lock, no ninja (processes starting together queue on both)
            return built
        with _build_lock(build):
            # The source is copied into the build directory: ninja's rules name the source's path,
            # so two checkouts of the same source share one build instead of rebuilding each other's.
            src = os.path.join(build, os.path.basename(_SRC))
            if not os.path.exists(src):
                shutil.copyfile(_SRC, src + ".tmp")
                os.replace(src + ".tmp", src)
            module = cpp_extension.load(
                name=_MODULE, sources=[src], build_directory=build,
                extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, verbose=False)
            # Written last, under the lock: the library next to it is complete.
            open(os.path.join(build, _BUILT), "w").close()
            return module
    except Exception as e:  # no compiler, no ninja, ...
        logger.warning("CPU attention extension unavailable (%s); using the pure torch path", e)
        return None


# -ffast-math compiles this file's loops only: linking with it would add crtfastmath.o, whose
# constructor flushes denormals to zero in the whole process (torch's matmuls and SiLU included).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
_LDFLAGS = ["-fopenmp"]
_MODULE = "pdserve_cpu_attention"
_BUILT = "pdserve.built"


def _import_built(build: str):
    """The module a finished build left in `build` (its marker is written after the library), or None."""
    if not os.path.exists(os.path.join(build, _BUILT)):
        return None
    spec = importlib.util.spec_from_file_location(_MODULE, os.path.join(build, f"{_MODULE}.so"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(build: str):
    """One builder at a time, by an flock the kernel drops when its holder dies. torch's own lock
    (a `lock` file in the build directory) outlives a builder killed mid-build and makes every later
    engine wait for it forever; under our flock any such file is stale, so it goes."""
    with open(os.path.join(build, "pdserve.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build, "lock"))
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
