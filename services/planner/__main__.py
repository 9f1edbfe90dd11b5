"""`python -m services.planner ...`: the planner on its own (`pdserve planner` once the CLI has it)."""
import argparse
import logging
import sys

from services.planner.cli import add_planner_parser

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve")
    add_planner_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["planner", *sys.argv[1:]])
    try:
        sys.exit(args.func(args))
    except ValueError as e:
        sys.exit(f"error: {e}")
