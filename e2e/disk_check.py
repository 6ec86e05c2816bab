"""Refuse to start a long run the disk cannot hold.

A fresh clone's `make test` fails after 40 minutes with "No space left on device" when the disk is
short (the image tests come last); this says so at once, with what is free and what is needed.

    python3 e2e/disk_check.py --gb 22 --what "make test" PATH...

`--gb`: what the run writes into the PATHs (under the clone) starting from nothing, measured
(docs/BENCHMARKS.md). What the PATHs hold already counts as written, so a warm rerun needs little.
Go's module and build caches are added while they are still empty: the local control plane's binaries
fill them on their first build. `DISK_CHECK=0` skips the check. Standard library only: it runs before
the virtualenv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
# Measured on a new machine (docs/BENCHMARKS.md): what a first build of the local control plane's
# binaries leaves in Go's caches, and the size below which a cache counts as empty.
GO_CACHES = {"GOMODCACHE": 2.7 * GIB, "GOCACHE": 7.1 * GIB}
EMPTY_BELOW = 0.5 * GIB


@dataclass(frozen=True)
class Need:
    clone: int  # bytes still to be written into the PATHs
    go_caches: int  # bytes Go's empty caches will take
    free: int

    @property
    def total(self) -> int:
        return self.clone + self.go_caches

    @property
    def enough(self) -> bool:
        return self.free >= self.total


def tree_bytes(path: Path, enough: float = float("inf")) -> int:
    """Bytes the files under `path` occupy (0 when it is missing); links are not followed. The walk
    stops once `enough` is reached: the checks only compare against a threshold."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # gone while walking
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
        if total >= enough:
            break
    return total


def assess(gb: float, held: int, go_cache_sizes: dict[str, int | None], free: int) -> Need:
    """`go_cache_sizes`: each Go cache's size, None where Go is not installed (nothing to add)."""
    clone = max(0, int(gb * GIB) - held)
    go = sum(
        int(GO_CACHES[name])
        for name, size in go_cache_sizes.items()
        if size is not None and size < EMPTY_BELOW
    )
    return Need(clone=clone, go_caches=go, free=free)


def go_cache_sizes() -> dict[str, int | None]:
    go = shutil.which("go")
    sizes: dict[str, int | None] = {}
    for name in GO_CACHES:
        if go is None:
            sizes[name] = None
            continue
        where = subprocess.run([go, "env", name], capture_output=True, text=True).stdout.strip()
        sizes[name] = tree_bytes(Path(where), enough=EMPTY_BELOW) if where else 0
    return sizes


def message(what: str, need: Need, paths: list[str], mount: str) -> str:
    def gb(n: int) -> str:
        return f"{n / GIB:.1f} GB"

    parts = [f"{gb(need.clone)} more in {' '.join(paths)}"]
    if need.go_caches:
        parts.append(f"{gb(need.go_caches)} for Go's empty module and build caches")
    return (
        f"disk_check.py: {what} needs about {gb(need.total)} free on {mount} ({', '.join(parts)});"
        f" {gb(need.free)} is free. Free some space (an older clone's .cache and .cluster, `make clean`),"
        " or set DISK_CHECK=0 to try anyway."
    )


def mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, required=True, help="what the run writes from nothing, in GB")
    parser.add_argument("--what", required=True, help="the run, for the message (e.g. 'make test')")
    parser.add_argument("paths", nargs="+", help="where it writes, under the clone")
    args = parser.parse_args(argv)
    if os.environ.get("DISK_CHECK", "1") == "0":
        return 0
    held = 0
    for path in args.paths:  # no further than the figure: beyond it, nothing more is needed
        held += tree_bytes(Path(path), enough=args.gb * GIB - held)
    need = assess(args.gb, held, go_cache_sizes(), shutil.disk_usage(".").free)
    if need.enough:
        return 0
    print(message(args.what, need, args.paths, str(mount_point(Path(".")))), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
