"""pdserve's version, for `pdserve --version` and the router's GET /version: the installed
distribution's, else pyproject.toml's beside the source (a checkout run without installing)."""
from __future__ import annotations

import functools
import os
import tomllib
from importlib import metadata

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


@functools.cache
def version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        pass
    try:
        with open(PYPROJECT, "rb") as f:
            return tomllib.load(f)["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
