"""The memory allocator of a process that runs an engine on the CPU: TCMalloc where the machine has it.

A CPU step allocates and frees every op's output (hundreds of tensors a decode step); TCMalloc's
per-thread caches hand the same, still cached, buffers back where glibc's malloc searches its bins
and returns the heap's top to the kernel. vLLM's CPU backend and PyTorch's CPU tuning guide both
preload it (LD_PRELOAD). An allocator has to be in place before the process starts, so it is
chosen where an engine's process is started: the engine core's process (and the tensor-parallel
workers it starts, which inherit its environment), and `pdserve profile`, which re-executes itself
so that it measures the engine the services run. An engine inside the caller's process (LLM(...),
--inproc) keeps the caller's allocator: preload it there by hand.

  auto      TCMalloc for an engine on the CPU when the library is found, else the system's (logged)
  tcmalloc  TCMalloc whatever the device; an error when the library is missing
  system    glibc's malloc (whatever LD_PRELOAD already names is kept)

An allocator the user preloaded already (tcmalloc, jemalloc, mimalloc) is left alone.
"""
from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig

logger = logging.getLogger(__name__)

CHOICES = ("auto", "tcmalloc", "system")
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
INSTALL_HINT = "apt-get install libtcmalloc-minimal4 (Debian, Ubuntu) or dnf install gperftools-libs"
# Set in a process `pdserve profile` re-executed, so it never re-executes twice.
REEXEC_MARK = "PDSERVE_ALLOCATOR_REEXEC"
_ALLOCATOR = re.compile(r"lib(tc|je|mi)malloc")


def find_tcmalloc() -> str | None:
    """The dynamic loader's cache, then the folders distributions install it in: never a scan of
    the filesystem (a recursive glob of /usr/lib* takes minutes on some machines)."""
    try:
        out = subprocess.run([shutil.which("ldconfig") or "/sbin/ldconfig", "-p"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for name in LIBRARIES:
        for line in out.splitlines():
            if line.strip().startswith(name + " ") and "=>" in line and "x86-32" not in line:
                path = line.split("=>")[1].strip()
                if os.path.exists(path):
                    return path
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    for name in LIBRARIES:
        for folder in (f"/usr/lib/{arch}", f"/lib/{arch}", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def preloaded(environ=os.environ) -> str | None:
    """The allocator library LD_PRELOAD already names, if any."""
    for entry in re.split(r"[:\s]+", environ.get("LD_PRELOAD", "")):
        if _ALLOCATOR.search(os.path.basename(entry)):
            return entry
    return None


def device_type_of(spec: str, environ=os.environ) -> str:
    """"cpu" or "cuda" for a --device spec, without importing torch (a service's front end never
    does): auto counts as CUDA where the machine shows a GPU to this process (an NVIDIA or ROCm
    device node, CUDA_VISIBLE_DEVICES not empty). A CPU-only torch on a GPU machine is counted as
    CUDA: its engine keeps the system allocator (pass --cpu-allocator tcmalloc there)."""
    if spec == "cpu":
        return "cpu"
    if spec.startswith("cuda"):
        return "cuda"
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    gpu = any(re.fullmatch(r"nvidia\d+", name) for name in _listdir("/dev")) or os.path.exists("/dev/kfd")
    return "cuda" if gpu else "cpu"


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def preload_for(choice: str, device_type: str, environ=os.environ) -> str | None:
    """The LD_PRELOAD an engine's process on `device_type` should start with; None: leave it as is.
    Raises ValueError for an unknown choice, or tcmalloc asked for and not installed."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_allocator must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "system" or (choice == "auto" and device_type != "cpu") or preloaded(environ):
        return None
    path = find_tcmalloc()
    if path is None:
        if choice == "tcmalloc":
            raise ValueError(f"--cpu-allocator tcmalloc: {' or '.join(LIBRARIES)} not found; install it "
                             f"({INSTALL_HINT}) or pass --cpu-allocator system")
        logger.warning("TCMalloc not found: the engine runs on the system allocator, measurably slower on "
                       "the CPU; install it (%s) or pass --cpu-allocator system to silence this", INSTALL_HINT)
        return None
    return ":".join(filter(None, [path, environ.get("LD_PRELOAD", "")]))


class preloading:
    """`with preloading(value): start a process` — the child starts with LD_PRELOAD = value (None:
    unchanged); this process's environment is restored on exit. For process starters that take no
    environment of their own (multiprocessing's spawn)."""

    def __init__(self, value: str | None) -> None:
        self.value = value
        self.before: str | None = None

    def __enter__(self) -> None:
        if self.value is not None:
            self.before = os.environ.get("LD_PRELOAD")
            os.environ["LD_PRELOAD"] = self.value

    def __exit__(self, *exc) -> None:
        if self.value is not None:
            if self.before is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = self.before


def reexec_with_allocator(choice: str, device_type: str) -> None:
    """Re-execute this process (same pid, same arguments) with the allocator preloaded, when
    `preload_for` asks for one and this process is not a re-execution already; else return."""
    if os.environ.get(REEXEC_MARK):
        return
    value = preload_for(choice, device_type)
    if value is None:
        return
    logger.info("re-executing with %s preloaded", value.split(":")[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**os.environ, "LD_PRELOAD": value, REEXEC_MARK: "1"})
