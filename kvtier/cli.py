"""The ``kvtier`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a tiered, persistent KV cache for LLM inference engines.",
    )
    from kvtier import __version__

    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from kvtier.sim.cli import add_parser as add_sim

    add_sim(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
