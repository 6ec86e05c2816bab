"""`sovereign-operator`: print the CRD, render children offline, or run the operator."""

from __future__ import annotations

import argparse
import sys

from sovereign_operator import yamlio
from sovereign_operator.api import custom_resource_definition


def _cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(yamlio.dump(custom_resource_definition()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sovereign-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    crd = commands.add_parser("crd", help="print the LLMDeployment CustomResourceDefinition")
    crd.set_defaults(func=_cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
