"""Download progress as the operator reads it: one JSON line on stdout every few seconds.

The operator tails the download pod's log (no write access to anything is needed for that) and
keeps the latest `progress` line in the LLMDeployment's status. Bytes are counted from the files
themselves (finished files plus the part files growing on disk), so the figure is right after a
restart too; the rate is over the last minute of this process.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

RATE_WINDOW_S = 60.0


def emit(event: str, stream: TextIO | None = None, **fields: Any) -> None:
    """One event line: {"event": ..., ...}; flushed so a log tail sees it at once."""
    out = stream or sys.stdout
    out.write(json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")
    out.flush()


class Progress:
    """Bytes done of total across every file of one download; safe to update from worker threads."""

    def __init__(self, total_bytes: int, files: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_bytes = total_bytes
        self.files = files
        self.clock = clock
        self._lock = threading.Lock()
        self._finished_bytes = 0
        self._finished_files = 0
        self._growing: dict[Path, int] = {}  # part file -> its size when last seen
        self._samples: deque[tuple[float, int]] = deque()

    def finished(self, size: int) -> None:
        with self._lock:
            self._finished_bytes += size
            self._finished_files += 1

    def growing(self, part: Path) -> None:
        with self._lock:
            self._growing[part] = 0

    def settled(self, part: Path) -> None:
        with self._lock:
            self._growing.pop(part, None)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            for part in self._growing:
                with contextlib.suppress(FileNotFoundError):
                    self._growing[part] = part.stat().st_size
            done = min(self.total_bytes, self._finished_bytes + sum(self._growing.values()))
            files_done = self._finished_files
            now = self.clock()
            self._samples.append((now, done))
            while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
        first_t, first_done = self._samples[0]
        rate = (done - first_done) / (now - first_t) if now > first_t else 0.0
        remaining = self.total_bytes - done
        body: dict[str, Any] = {
            "bytesDone": done,
            "bytesTotal": self.total_bytes,
            "filesDone": files_done,
            "files": self.files,
            "rateBytesPerSecond": round(max(rate, 0.0)),
        }
        if rate > 0:
            body["etaSeconds"] = round(remaining / rate)
        return body


class Reporter:
    """Emits a `progress` line every `interval_s` until stopped, and a last one when stopped."""

    def __init__(self, progress: Progress, interval_s: float, stream: TextIO | None = None) -> None:
        self.progress = progress
        self.interval_s = interval_s
        self.stream = stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="download progress", daemon=True)

    def __enter__(self) -> Reporter:
        emit("progress", self.stream, **self.progress.snapshot())
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        emit("progress", self.stream, **self.progress.snapshot())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            emit("progress", self.stream, **self.progress.snapshot())
