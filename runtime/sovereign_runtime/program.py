"""The `sovereign-runtime` program: a table of subcommands, each imported only when it runs.

``serve`` (``cli.py``) needs torch and the engine; ``router`` and ``download`` do not, and start in well
under a second instead of the seconds (tens of seconds on a loaded node) that importing torch takes: a
router pod listens before its first liveness probe, a download Job does not pay for an engine it never
runs. So the table names modules, not functions, and ``main`` registers the flags of the chosen
subcommand only; ``sovereign-runtime --help`` lists every subcommand without importing any.

A subcommand's module has ``add_arguments(parser)`` and ``run(args) -> exit status`` under the names in
its entry; a new subcommand is one entry in ``SUBCOMMANDS``. Usage errors print one line and exit 2.

A SIGTERM that arrives before the subcommand installs its own handler (``serve`` drains on it once it
listens) ends the program at once with status 143: in a container the program is PID 1, whose signals
without a handler the kernel drops, so a pod deleted while it still imports torch would otherwise
ignore the kubelet's SIGTERM and keep the node busy for its whole grace period (minutes for a worker).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn, cast


class UsageError(Exception):
    """A bad flag or flag combination: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block; a CLI error here is one clear line.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


@dataclass(frozen=True)
class Subcommand:
    help: str
    module: str  # under sovereign_runtime; imported only when the subcommand is chosen
    add_arguments: str
    run: str

    def _attr(self, name: str) -> Callable:
        return cast(Callable, getattr(importlib.import_module(f"sovereign_runtime.{self.module}"), name))

    def add(self, parser: argparse.ArgumentParser) -> None:
        self._attr(self.add_arguments)(parser)

    def __call__(self, args: argparse.Namespace) -> int:
        return cast(int, self._attr(self.run)(args))


# `bench` joins here when it lands.
SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(
        "run the OpenAI-compatible server for one model", "cli", "add_serve_arguments", "run_serve"
    ),
    "router": Subcommand(
        "run the PD-aware router in front of workers", "router.cli", "add_router_arguments", "run_command"
    ),
    "download": Subcommand(
        "download a Hugging Face repo revision into a cache directory (resumable, verified)",
        "modelhub.cli",
        "add_download_arguments",
        "run_download",
    ),
}


def build_parser(load: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: every subcommand listed; the flags of those in `load` (all when None)."""
    parser = _Parser(prog="sovereign-runtime", description="Sovereign MLA inference runtime")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, command in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        if load is None or name in load:
            command.add(sub_parser)
    return parser


def chosen_subcommand(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names: its first word that is not an option (the top level has only -h)."""
    return next((word for word in argv if not word.startswith("-")), None)


# 128 + SIGTERM, as a shell reports a process it ended; the operator counts it as a stop, not a crash.
TERMINATED_EXIT_STATUS = 128 + signal.SIGTERM


def _terminated_before_serving(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(TERMINATED_EXIT_STATUS)


def main(argv: Sequence[str] | None = None) -> int:
    # Until the subcommand installs its own (nothing is in flight yet: there is nothing to drain).
    previous = signal.signal(signal.SIGTERM, _terminated_before_serving)
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        chosen = chosen_subcommand(argv)
        args = build_parser(load={chosen} if chosen else set()).parse_args(argv)
        args.serve_argv = argv  # what tensor-parallel workers are started with
        return SUBCOMMANDS[args.command](args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
