"""Log configuration every pdserve process shares (services, engine cores, the router, the
planner): PDSERVE_LOG_LEVEL=DEBUG|INFO|WARNING|ERROR|CRITICAL, INFO by default."""
from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> int:
    name = os.environ.get("PDSERVE_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if name not in LEVELS:
        raise ValueError(f"PDSERVE_LOG_LEVEL={name!r}: choose one of {', '.join(LEVELS)}")
    return getattr(logging, name)


def configure_logging(fmt: str = FORMAT) -> None:
    logging.basicConfig(level=log_level(), format=fmt)
