#!/usr/bin/env bash
# The system packages the make verbs need besides Python: installed with apt-get when run as root
# on a Debian/Ubuntu machine, else named with the exact command, and nothing else runs.
#
#   PYTHON=python3 VENV=.venv scripts/system-deps.sh [prometheus]
#
# Always checked: a C++ compiler (the CPU kernels are built on first use), Python's headers (they
# are Python extensions), and, before .venv exists, Python's venv module (Debian ships ensurepip
# apart). `prometheus`: the Prometheus server, which the planner's integration test scrapes with.
# Wanted, not needed: TCMalloc, the allocator a CPU engine core preloads (engine/cpu_allocator.py);
# installed alongside when this runs as root with apt-get, else the engine warns at start and runs
# on glibc's malloc.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
missing() {
  need=()
  command -v g++ >/dev/null || need+=(g++)
  "$PYTHON" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' || need+=("python$version-dev")
  [ -x "$VENV/bin/python" ] || "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || need+=("python$version-venv")
  for extra in "$@"; do
    case $extra in
      prometheus) command -v prometheus >/dev/null || need+=(prometheus) ;;
      *) echo "system-deps.sh: unknown check '$extra'" >&2; exit 2 ;;
    esac
  done
}

tcmalloc_found() {  # where distributions put it (engine/cpu_allocator.py asks the loader's cache)
  local lib
  for lib in /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /lib/*-linux-gnu/libtcmalloc_minimal.so.4 \
             /usr/lib64/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4 /usr/local/lib/libtcmalloc_minimal.so.4; do
    [ -e "$lib" ] && return 0
  done
  return 1
}

missing "$@"
want=()
as_root=false
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  as_root=true
  tcmalloc_found || want+=(libtcmalloc-minimal4)
fi
[ ${#need[@]} -eq 0 ] && [ ${#want[@]} -eq 0 ] && exit 0
install=(apt-get install -y -q --no-install-recommends "${need[@]}")
if $as_root; then
  echo "installing the missing system packages: ${need[*]}${need[*]:+ }${want[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  [ ${#need[@]} -eq 0 ] || "${install[@]}"
  if [ ${#want[@]} -gt 0 ]; then  # wanted ones: a failure is reported, never fatal
    apt-get install -y -q --no-install-recommends "${want[@]}" ||
      echo "could not install ${want[*]}: CPU engines run on glibc's malloc" >&2
  fi
  missing "$@"
  [ ${#need[@]} -eq 0 ] && exit 0
  echo "still missing after apt-get: ${need[*]}" >&2
  exit 1
fi
echo "missing system packages: ${need[*]}" >&2
if command -v apt-get >/dev/null; then
  echo "install them, then run make again:" >&2
  echo "  sudo apt-get update && sudo ${install[*]}" >&2
else
  echo "install them (these are Debian's names) with your system's package manager, then run make again" >&2
fi
exit 1
