"""The `slidedp` command: one verb per subcommand; bad input exits 2 with a one-line message."""

from __future__ import annotations

import argparse
import sys

from slidedp.commands import listing, plan, predict, profile, simulate, sweep, train, validate
from slidedp.spec.errors import InfeasiblePlan, SpecError

COMMANDS = [predict, simulate, sweep, train, listing, profile, validate, plan]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slidedp", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (SpecError, InfeasiblePlan) as e:
        print(f"slidedp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
