"""e2e/disk_check.py: `make test` refuses at once, naming what is free and needed, when the disk
cannot hold the run (a CI run once failed after 41 minutes with "No space left on device")."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from packaging_helpers import REPO

GIB = 2**30


def disk_check() -> ModuleType:
    directory = str(REPO / "e2e")
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return importlib.import_module("disk_check")


def test_what_the_clone_holds_counts_as_written_and_empty_go_caches_are_added() -> None:
    dc = disk_check()
    cold = dc.assess(22, held=0, go_cache_sizes={"GOMODCACHE": 0, "GOCACHE": 0}, free=25 * GIB)
    assert cold.clone == 22 * GIB and cold.go_caches == int(2.7 * GIB) + int(7.1 * GIB)
    assert not cold.enough
    warm = dc.assess(
        22, held=20 * GIB, go_cache_sizes={"GOMODCACHE": 3 * GIB, "GOCACHE": 8 * GIB}, free=3 * GIB
    )
    assert (warm.clone, warm.go_caches, warm.enough) == (2 * GIB, 0, True)
    # More held than the measured figure (an older build beside the new one): nothing more needed.
    assert dc.assess(22, held=30 * GIB, go_cache_sizes={}, free=0).enough
    # No Go installed: its caches are not this check's business (the build says what is missing).
    assert dc.assess(1, held=0, go_cache_sizes={"GOMODCACHE": None, "GOCACHE": None}, free=GIB).enough


def test_the_message_says_what_is_needed_where_and_how_to_go_on() -> None:
    dc = disk_check()
    need = dc.Need(clone=22 * GIB, go_caches=5 * GIB, free=21 * GIB)
    said = dc.message("make test", need, [".venv", ".cluster"], "/work")
    assert "make test needs about 27.0 GB free on /work" in said
    assert "22.0 GB more in .venv .cluster" in said and "5.0 GB for Go's empty" in said
    assert "21.0 GB is free" in said and "DISK_CHECK=0" in said


def test_files_under_the_paths_are_counted(tmp_path: Path) -> None:
    dc = disk_check()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(os.urandom(3 * 2**20))
    assert 3 * 2**20 <= dc.tree_bytes(tmp_path) < 4 * 2**20
    assert dc.tree_bytes(tmp_path / "missing") == 0


def test_the_command_refuses_with_the_message_and_can_be_told_to_go_on(tmp_path: Path) -> None:
    script = str(REPO / "e2e" / "disk_check.py")
    args = [sys.executable, script, "--gb", "1000000", "--what", "make test", str(tmp_path)]
    refused = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 1 and "make test needs about" in refused.stderr
    env = {**os.environ, "DISK_CHECK": "0"}
    assert subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env).returncode == 0
    small = [sys.executable, script, "--gb", "0.001", "--what", "make test", str(tmp_path)]
    assert subprocess.run(small, capture_output=True, text=True, cwd=tmp_path).returncode == 0


def test_make_test_checks_the_disk_first() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "\ntest: disk-check-test venv lint tools\n" in makefile
    assert (
        'e2e/disk_check.py --gb 22 --what "make test" $(VENV) .cache/images e2e/cluster/bin .cluster'
        in makefile
    )
