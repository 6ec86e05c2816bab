"""The `sovereign-runtime` program: `router` and `download` start without importing torch (a router pod
must listen long before its liveness probe gives up, even on a loaded node); `serve` still gets every flag;
a SIGTERM while it still imports ends it at once (a container's PID 1 would otherwise drop it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest
from sovereign_runtime.program import (
    SUBCOMMANDS,
    TERMINATED_EXIT_STATUS,
    build_parser,
    chosen_subcommand,
    main,
)

# Modules a torch-free start must not load (the engine's dependencies, each seconds to import).
HEAVY = ("torch", "triton", "numpy", "transformers", "sovereign_runtime.cli", "sovereign_runtime.engine")


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `python -X importtime` output (`import time: self | cumulative | name`)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header line
                names.add(name)
    return names


def heavy_among(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY))


def run_program(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "sovereign_runtime", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("command", ["router", "download"])
def test_help_of_a_light_subcommand_imports_no_torch(command: str) -> None:
    done = run_program([command, "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"sovereign-runtime {command}" in done.stdout
    names = imported_modules(done.stderr)
    assert "sovereign_runtime.program" in names  # the parser really ran through -X importtime
    assert heavy_among(names) == []


def test_top_level_help_lists_every_subcommand_and_imports_none() -> None:
    done = run_program(["--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    for name, command in SUBCOMMANDS.items():
        assert name in done.stdout and command.help.split()[0] in done.stdout
    names = imported_modules(done.stderr)
    assert not {"sovereign_runtime.router.cli", "sovereign_runtime.modelhub.cli"} & names
    assert heavy_among(names) == []


ROUTER_FLAGS = ("--host", "127.0.0.1", "--port", "0", "--worker", "http://127.0.0.1:9")


def test_a_started_router_listens_without_having_imported_torch() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "sovereign_runtime", "router", *ROUTER_FLAGS],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "router listening on" in line:
                break
        assert any("router listening on" in line for line in lines), "".join(lines[-20:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert heavy_among(imported_modules("".join(lines))) == []


def test_serve_registers_its_flags_when_chosen() -> None:
    args = build_parser(load={"serve"}).parse_args(["serve", "--model", "builtin:sovereign-tiny"])
    assert args.command == "serve" and args.port == 8000 and args.max_num_seqs == 64


def test_the_chosen_subcommand_is_the_first_word_that_is_not_an_option() -> None:
    assert chosen_subcommand(["router", "--worker", "http://w"]) == "router"
    assert chosen_subcommand(["--help"]) is None
    assert chosen_subcommand([]) is None


def test_usage_errors_are_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router"]) == 2  # no workers
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: router: give workers")
    assert main(["no-such-command"]) == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


def test_a_sigterm_while_serve_still_imports_torch_ends_it_at_once_with_status_143() -> None:
    # As a container's PID 1 the program would never see a SIGTERM it has no handler for: the kernel
    # drops it, and the kubelet waits out the grace period. Status 143 (not -15, death by the signal)
    # shows the program's own handler ended it, so the same holds as PID 1.
    serve = ["serve", "--model", "builtin:sovereign-tiny", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "sovereign_runtime", *serve],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        # importtime prints a module once it is imported: a torch module means main() runs and imports
        # the serve subcommand (program.py is imported, and main called, before anything of torch).
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip().startswith("torch"):
                break
        assert proc.poll() is None, "".join(lines[-20:])
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert status == TERMINATED_EXIT_STATUS == 143, status
    assert not any("listening on" in line for line in lines)


def test_main_gives_the_sigterm_handler_back_when_it_returns() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert main(["no-such-command"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before
