"""The runtime and operator images built on this machine (e2e/images/build.sh, `make images-local`),
shared by the tests that run them: tests/packaging/test_local_images.py (runc, as a kubelet would) and
the cluster tests whose pods run on the local cluster's real node.

The build caches every layer and archive by a key of its inputs, so once built, a call costs about a
second. It needs root (debootstrap, chroot).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "images"


def build_local_images() -> dict[str, Any]:
    """The build's manifest (``.cache/images/images.json``) after e2e/images/build.sh has run; each
    image under ``["images"][name]`` with its ``ref`` and ``archive``."""
    result = subprocess.run(
        [str(REPO / "e2e" / "images" / "build.sh")], capture_output=True, text=True, timeout=3600, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest: dict[str, Any] = json.loads((CACHE / "images.json").read_text())
    return manifest
