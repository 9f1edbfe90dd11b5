#!/usr/bin/env bash
# The system packages the make verbs need besides Python: installed with apt-get when run as root
# on a Debian/Ubuntu machine, else named with the exact command, and nothing else runs.
#
#   PYTHON=python3 VENV=.venv scripts/system-deps.sh [prometheus]
#
# Always checked: a C++ compiler (the CPU kernels are built on first use), Python's headers (they
# are Python extensions), and, before .venv exists, Python's venv module (Debian ships ensurepip
# apart). `prometheus`: the Prometheus server, which the planner's integration test scrapes with.
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

missing "$@"
[ ${#need[@]} -eq 0 ] && exit 0
install=(apt-get install -y -q --no-install-recommends "${need[@]}")
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing the missing system packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  "${install[@]}"
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
