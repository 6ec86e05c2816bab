"""Checking downloaded files before anyone loads them: sizes against the hub's listing, safetensors
headers against the file they describe, and the completion marker written last."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from .failures import DownloadFailure
from .listing import RepoEntry, Resolution

CHECKPOINT_DIR = "checkpoint"
PARTIAL_DIR = ".partial"
MARKER = "complete.json"
# Bits per element of every safetensors dtype (F4 and F6 pack several values into a byte).
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "I64": 64,
    "U64": 64,
    "F64": 64,
}
# The format's own limit on the JSON header (safetensors refuses larger ones).
MAX_HEADER_BYTES = 100_000_000


def check_safetensors(path: Path) -> None:
    """Raise ValueError unless the header parses and its tensors tile the data exactly."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes: too short for a safetensors header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length {header_len} does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_len = size - 8 - header_len
    spans = []
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = tensor["dtype"], tensor["shape"], tensor["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r}: needs dtype, shape and data_offsets") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_len):
            raise ValueError(
                f"tensor {name!r}: data_offsets {[begin, end]} outside the {data_len} data bytes"
            )
        bits = DTYPE_BITS.get(dtype)
        if bits is not None and math.ceil(math.prod(shape) * bits / 8) != end - begin:
            raise ValueError(f"tensor {name!r}: {dtype}{shape} does not take {end - begin} bytes")
        spans.append((begin, end))
    covered = 0
    for begin, end in sorted(spans):
        if begin != covered:
            raise ValueError(f"data bytes {covered}..{begin} belong to no tensor")
        covered = end
    if covered != data_len:
        raise ValueError(f"data bytes {covered}..{data_len} belong to no tensor")


def check_file(root: Path, entry: RepoEntry) -> None:
    """Raise DownloadFailure("VerificationFailed") for a file that is not what the hub listed."""
    path = root / CHECKPOINT_DIR / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DownloadFailure("VerificationFailed", f"{entry.path} is missing") from None
    if size != entry.size:
        raise DownloadFailure(
            "VerificationFailed", f"{entry.path} has {size} bytes, the hub lists {entry.size}"
        )
    if entry.path.endswith(".safetensors"):
        try:
            check_safetensors(path)
        except ValueError as error:
            raise DownloadFailure("VerificationFailed", f"{entry.path}: {error}") from None


def marker_body(resolution: Resolution, seconds: float) -> dict[str, Any]:
    return {
        **resolution.as_json(),
        "paths": [{"path": e.path, "size": e.size} for e in resolution.files],
        "completedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "downloadSeconds": round(seconds, 1),
    }


def write_marker(root: Path, resolution: Resolution, seconds: float) -> None:
    """Written last and atomically: a reader sees no marker or a whole one."""
    tmp = root / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(marker_body(resolution, seconds), indent=1) + "\n")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, root / MARKER)


def read_marker(root: Path) -> dict[str, Any] | None:
    try:
        body = json.loads((root / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return body if isinstance(body, dict) else None


def marker_matches(marker: dict[str, Any] | None, resolution: Resolution) -> bool:
    """The cache already holds exactly these files of this commit (sizes as listed)."""
    if marker is None or marker.get("commit") != resolution.commit:
        return False
    listed = [{"path": e.path, "size": e.size} for e in resolution.files]
    return marker.get("paths") == listed
