"""CLI flags that also read PDSERVE_* environment variables (the flag wins)."""
from __future__ import annotations

import argparse
import os


def env_name(prefix: str, flag: str) -> str:
    return f"{prefix}{flag.lstrip('-').replace('-', '_').upper()}"


def add(parser: argparse.ArgumentParser, flag: str, *, env_prefix: str = "PDSERVE_", **kwargs) -> None:
    """Like add_argument; the default comes from $PDSERVE_<FLAG> when set, and --help says so."""
    env = env_name(env_prefix, flag)
    raw = os.environ.get(env)
    if raw is not None:
        if kwargs.get("action") in ("store_true", argparse.BooleanOptionalAction):
            kwargs["default"] = raw.lower() in ("1", "true", "yes", "on")
        else:
            conv = kwargs.get("type", str)
            kwargs["default"] = conv(raw)
    help_text = kwargs.pop("help", "")
    default = kwargs.get("default")
    hidden = any(word in flag for word in ("secret", "key", "token"))
    shown = "" if hidden or default in (None, False, "") else f" (default: {default})"
    kwargs["help"] = f"{help_text}{shown} [env {env}]"
    parser.add_argument(flag, **kwargs)
