"""`python -m services.planner ...`: the planner on its own (`pdserve planner` once the CLI has it)."""
import argparse
import sys

from engine.log_config import configure_logging
from services.planner.cli import add_planner_parser

if __name__ == "__main__":
    try:
        configure_logging()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    parser = argparse.ArgumentParser(prog="pdserve")
    add_planner_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["planner", *sys.argv[1:]])
    try:
        sys.exit(args.func(args))
    except ValueError as e:
        sys.exit(f"error: {e}")
