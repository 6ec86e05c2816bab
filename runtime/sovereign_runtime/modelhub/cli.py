"""`sovereign-runtime download`: flags, the run, and the result the operator reads.

The operator's download Job runs it; so can a person (a laptop, a bastion host filling a volume).
The token comes from $HF_TOKEN (the Job sets it from `huggingFace.tokenSecretRef`), the hub from
--endpoint or $HF_ENDPOINT. The result is one JSON object written to the container's termination
log (the kubelet copies it into the pod's status, where the operator reads it with no write
access to anything) and printed as the last line: `resolved`, `complete` or `failed` with a reason
and the hub's message. Exit status 0 on success, 1 on failure, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from .failures import DownloadFailure, classify
from .fetch import Fetcher, FetchOptions, exclusive
from .listing import Resolution, resolve
from .progress import Progress, Reporter, emit
from .verify import CHECKPOINT_DIR, MARKER, check_file, marker_matches, read_marker, write_marker

DEFAULT_ENDPOINT = "https://huggingface.co"
TERMINATION_LOG = "/dev/termination-log"
# The kubelet keeps at most 4096 bytes of a termination message.
TERMINATION_LOG_BYTES = 4096
COMMIT_FILE = ".commit"


def add_download_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", required=True, metavar="ORG/NAME", help="the model repository")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--dest", metavar="DIR", help="the cache directory (checkpoint/ holds the files)")
    target.add_argument(
        "--resolve-only",
        action="store_true",
        help="resolve the revision and list the files; download nothing",
    )
    p.add_argument("--allow-pattern", action="append", metavar="GLOB", help="download only matching paths")
    p.add_argument("--ignore-pattern", action="append", metavar="GLOB", help="skip matching paths")
    p.add_argument("--endpoint", help=f"the hub or a mirror (default $HF_ENDPOINT, else {DEFAULT_ENDPOINT})")
    p.add_argument("--workers", type=_positive, default=8, metavar="N", help="files downloaded at once")
    p.add_argument(
        "--attempts",
        type=_positive,
        default=8,
        metavar="N",
        help="tries per file while the hub is unreachable (backoff 1, 2, 4, ... 60 s)",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between progress lines",
    )
    p.add_argument(
        "--termination-log",
        metavar="PATH",
        help=f"where the result goes (default {TERMINATION_LOG} when it exists, as in a pod)",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _write_result(path: str | None, result: dict[str, Any]) -> None:
    target = path or (TERMINATION_LOG if os.path.exists(TERMINATION_LOG) else None)
    text = json.dumps(result, separators=(",", ":"))
    if len(text.encode()) > TERMINATION_LOG_BYTES and "message" in result:
        over = len(text.encode()) - TERMINATION_LOG_BYTES + 3
        result = {**result, "message": result["message"][: max(0, len(result["message"]) - over)] + "..."}
        text = json.dumps(result, separators=(",", ":"))
    if target:
        try:
            Path(target).write_text(text)
        except OSError as error:
            logging.getLogger(__name__).warning("cannot write the result to %s: %s", target, error)


def _claim(root: Path, commit: str) -> None:
    """A cache holds one commit: refuse a directory another commit is being (or was) written into."""
    root.mkdir(parents=True, exist_ok=True)
    claimed = root / COMMIT_FILE
    if claimed.is_file():
        held = claimed.read_text().strip()
        if held != commit:
            raise DownloadFailure(
                "CacheMismatch", f"{root} holds commit {held}, not {commit}: a cache holds one commit"
            )
        return
    claimed.write_text(commit + "\n")


def drop_unverified(root: Path, resolution: Resolution) -> list[str]:
    """Delete every file that fails verification (so the next fetch downloads it); their paths."""
    dropped = []
    for entry in resolution.files:
        try:
            check_file(root, entry)
        except DownloadFailure as failure:
            emit("unverified", file=entry.path, message=failure.message)
            (root / CHECKPOINT_DIR / entry.path).unlink(missing_ok=True)
            dropped.append(entry.path)
    return dropped


def fill_cache(
    resolution: Resolution, root: Path, options: FetchOptions, interval_s: float
) -> dict[str, Any]:
    """Download and verify everything `resolution` lists into `root`; the marker is written last."""
    started = time.monotonic()
    with exclusive(root):
        _claim(root, resolution.commit)
        if marker_matches(read_marker(root), resolution):
            if not drop_unverified(root, resolution):
                return {"event": "complete", **resolution.as_json(), "alreadyComplete": True}
            (root / MARKER).unlink()  # no longer true: the dropped files come again below
        progress = Progress(resolution.total_bytes, len(resolution.files))
        with Reporter(progress, interval_s):
            Fetcher(resolution, root, options, progress).run()
        emit("verifying", files=len(resolution.files))
        if drop_unverified(root, resolution):
            # Files that were already in place but are not what the hub lists: fetch them once more.
            progress = Progress(resolution.total_bytes, len(resolution.files))
            with Reporter(progress, interval_s):
                Fetcher(resolution, root, options, progress).run()
        for entry in resolution.files:
            check_file(root, entry)
        seconds = time.monotonic() - started
        write_marker(root, resolution, seconds)
    return {"event": "complete", **resolution.as_json(), "seconds": round(seconds, 1)}


def run_download(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Progress lines replace the library's bars in a pod's log.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    endpoint = (args.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token = os.environ.get("HF_TOKEN") or None
    try:
        resolution = resolve(
            args.repo,
            args.revision,
            endpoint=endpoint,
            token=token,
            allow_patterns=args.allow_pattern,
            ignore_patterns=args.ignore_pattern,
        )
        emit("resolved", **resolution.as_json())
        if args.resolve_only:
            result: dict[str, Any] = {"event": "resolved", **resolution.as_json()}
        else:
            options = FetchOptions(
                endpoint=endpoint, token=token, workers=args.workers, attempts=args.attempts
            )
            result = fill_cache(resolution, Path(args.dest), options, args.progress_interval)
            emit("complete", **{k: v for k, v in result.items() if k != "event"})
    except Exception as error:  # every failure ends as one reason and message, never a traceback
        failure = classify(error)
        result = {
            "event": "failed",
            "reason": failure.reason,
            "message": failure.message,
            "transient": failure.transient,
        }
        emit("failed", reason=failure.reason, message=failure.message, transient=failure.transient)
        _write_result(args.termination_log, result)
        return 1
    _write_result(args.termination_log, result)
    return 0


__all__ = ["CHECKPOINT_DIR", "add_download_arguments", "fill_cache", "main", "run_download"]


def main(argv: list[str] | None = None) -> int:
    """`python -m sovereign_runtime.modelhub ...`: the same command without the serving stack's imports."""
    parser = argparse.ArgumentParser(prog="sovereign-runtime download", description=__doc__.splitlines()[0])
    add_download_arguments(parser)
    return run_download(parser.parse_args(argv))
