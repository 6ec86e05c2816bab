"""Downloading the listed files into the cache with byte-range resume, retries and verification.

huggingface_hub does the talking: `get_hf_file_metadata` (the HEAD on `resolve/<commit>/<path>`,
its redirect, ETag and X-Repo-Commit) and `http_get` (the GET, resumed with a Range header from the
bytes already on disk). What is ours: a part file per repo file that survives a restart (the
library's own temporary files are per process and dropped on failure, so a 5 GB shard would start
over), retries with exponential backoff while the hub is unreachable, and the checks before a file
takes its final name.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .failures import DownloadFailure, classify
from .listing import RepoEntry, Resolution
from .progress import Progress, emit
from .verify import CHECKPOINT_DIR, PARTIAL_DIR, check_safetensors

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class FetchOptions:
    endpoint: str | None
    token: str | None
    workers: int = 8
    # Attempts per file while the hub is unreachable (backoff 1, 2, 4, ... 60 s between them).
    attempts: int = 8
    sleep: Callable[[float], bool] | None = None  # returns True when told to stop (tests pass their own)


def backoff_s(attempt: int) -> float:
    return min(MAX_BACKOFF_S, 2.0**attempt)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """One writer per cache: a second downloader (another Job on the same volume) waits here."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            emit("waiting", reason="another downloader holds this cache; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bytes_still_needed(root: Path, files: tuple[RepoEntry, ...]) -> int:
    """Bytes not on disk yet: finished files count whole, part files by what they hold."""
    needed = 0
    for entry in files:
        final = root / CHECKPOINT_DIR / entry.path
        if final.is_file() and final.stat().st_size == entry.size:
            continue
        part = root / PARTIAL_DIR / f"{entry.path}.part"
        have = part.stat().st_size if part.is_file() else 0
        needed += entry.size - min(have, entry.size)
    return needed


def check_space(root: Path, files: tuple[RepoEntry, ...]) -> None:
    needed = bytes_still_needed(root, files)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise DownloadFailure(
            "DiskFull",
            f"the download needs {needed / 2**30:.2f} GiB more but the cache volume has"
            f" {free / 2**30:.2f} GiB free: give the cache more room (huggingFace.cache.size)",
        )


class Fetcher:
    def __init__(self, resolution: Resolution, root: Path, options: FetchOptions, progress: Progress) -> None:
        self.resolution = resolution
        self.root = root
        self.options = options
        self.progress = progress
        self.stop = threading.Event()

    def _sleep(self, seconds: float) -> bool:
        if self.options.sleep is not None:
            return self.options.sleep(seconds)
        return self.stop.wait(seconds)

    def run(self) -> None:
        """Every file, `workers` at a time; the first failure that retrying cannot fix stops the rest."""
        check_space(self.root, self.resolution.files)
        with ThreadPoolExecutor(max_workers=self.options.workers, thread_name_prefix="fetch") as pool:
            futures = [pool.submit(self._fetch_with_retries, entry) for entry in self.resolution.files]
            failures = []
            for future in futures:
                error = future.exception()
                if error is not None:
                    failures.append(classify(error))
                    self.stop.set()
        if failures:
            # A permanent failure names the cause; transient ones only say the hub stayed away.
            raise next((f for f in failures if not f.transient), failures[0])
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.root / PARTIAL_DIR)

    def _fetch_with_retries(self, entry: RepoEntry) -> None:
        final = self.root / CHECKPOINT_DIR / entry.path
        if final.is_file() and final.stat().st_size == entry.size:
            self.progress.finished(entry.size)
            return
        attempt = 0
        while True:
            if self.stop.is_set():
                raise DownloadFailure("Stopped", f"{entry.path}: stopped after another file failed")
            try:
                self._transfer(entry, final)
            except Exception as error:
                failure = classify(error)
                attempt += 1
                if not failure.transient or attempt >= self.options.attempts:
                    raise failure from error
                delay = backoff_s(attempt - 1)
                emit(
                    "retry",
                    file=entry.path,
                    attempt=attempt,
                    inSeconds=delay,
                    reason=failure.reason,
                    message=failure.message,
                )
                if self._sleep(delay):
                    raise failure from error
                continue
            self.progress.finished(entry.size)
            return

    def _transfer(self, entry: RepoEntry, final: Path) -> None:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        repo, commit = self.resolution.repo, self.resolution.commit
        url = hf_hub_url(repo, entry.path, revision=commit, endpoint=self.options.endpoint)
        meta = get_hf_file_metadata(url, token=self.options.token, endpoint=self.options.endpoint)
        if meta.commit_hash is not None and meta.commit_hash != commit:
            raise DownloadFailure(
                "HubError", f"the hub served {entry.path} from commit {meta.commit_hash}, not {commit}"
            )
        if meta.size is not None and meta.size != entry.size:
            raise DownloadFailure(
                "HubError", f"the hub lists {entry.path} with {entry.size} bytes but serves {meta.size}"
            )
        part = self.root / PARTIAL_DIR / f"{entry.path}.part"
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.is_file() else 0
        if have > entry.size:
            part.unlink()
            have = 0
        headers = build_hf_headers(token=self.options.token)
        headers["Accept-Encoding"] = "identity"  # sizes and ranges count stored bytes
        if _origin(meta.location) != _origin(url):
            # A CDN's signed URL authorises itself; the hub token stays with the hub.
            headers.pop("authorization", None)
        self.progress.growing(part)
        try:
            with part.open("ab") as out:
                http_get(
                    meta.location,
                    out,
                    resume_size=have,
                    headers=headers,
                    expected_size=entry.size,
                    displayed_filename=entry.path,
                )
                out.flush()
                os.fsync(out.fileno())
        finally:
            self.progress.settled(part)
        if entry.path.endswith(".safetensors"):
            try:
                check_safetensors(part)
            except ValueError as error:
                part.unlink()
                raise DownloadFailure(
                    "VerificationFailed", f"{entry.path}: {error}; downloading it again", transient=True
                ) from None
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
