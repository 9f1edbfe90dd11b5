"""`pdserve`: one command line for the engine tools, the services, the router and the stack."""
from __future__ import annotations

import argparse
import sys

from engine import cli as engine_cli


def build_parser() -> argparse.ArgumentParser:
    from services.version import version

    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    p.add_argument("--version", action="version", version=f"pdserve {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    engine_cli.add_engine_commands(sub)
    try:
        from services.decode import cli as decode_cli
        from services.prefill import cli as prefill_cli
    except ImportError as e:
        raise SystemExit(f"error: the gRPC code is not generated ({e}); run `make proto`") from None
    prefill_cli.add_parser(sub)
    decode_cli.add_parsers(sub)
    for module, hook in (("services.router.cli", "add_router_parser"), ("services.launcher", "add_up_parser"),
                         ("bench.serve", "add_bench_parser"), ("services.planner.cli", "add_planner_parser"),
                         ("services.planner.profile", "add_profile_parser"),
                         ("services.planner.plan", "add_plan_parser"),
                         ("services.planner.plan", "add_simulate_parser")):
        try:
            mod = __import__(module, fromlist=[hook])
        except ModuleNotFoundError as e:
            if not module.startswith(e.name or "\0"):
                raise
            continue
        getattr(mod, hook)(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    return engine_cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
