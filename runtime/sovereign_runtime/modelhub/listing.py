"""Resolving a revision to its commit and listing the files a download takes, through huggingface_hub."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

COMMIT_PATTERN = re.compile(r"^[0-9a-f]{40}$")


def safe_relative_path(path: str) -> bool:
    """A repo path that stays inside the directory it is joined to."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


@dataclass(frozen=True)
class RepoEntry:
    """One file of the repo at the resolved commit."""

    path: str
    size: int


@dataclass(frozen=True)
class Resolution:
    """A revision resolved to its commit, and the files the patterns select there (sorted by path)."""

    repo: str
    revision: str
    commit: str
    files: tuple[RepoEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def as_json(self) -> dict[str, Any]:
        return {
            "repo": self.repo,
            "revision": self.revision,
            "commit": self.commit,
            "files": len(self.files),
            "bytesTotal": self.total_bytes,
        }


def resolve(
    repo: str,
    revision: str,
    *,
    endpoint: str | None,
    token: str | None,
    allow_patterns: list[str] | None = None,
    ignore_patterns: list[str] | None = None,
) -> Resolution:
    """Ask the hub what `revision` is now and which files it holds; raises huggingface_hub's errors
    (RevisionNotFoundError, RepositoryNotFoundError, HfHubHTTPError) for classify() to name."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    from .failures import DownloadFailure

    api = HfApi(endpoint=endpoint, token=token)
    commit = revision
    if not COMMIT_PATTERN.fullmatch(revision):
        info = api.model_info(repo, revision=revision)
        if not info.sha:
            raise DownloadFailure("HubError", f"the hub did not say which commit {repo}@{revision} is")
        commit = info.sha
    entries = [
        item
        for item in api.list_repo_tree(repo, recursive=True, revision=commit)
        if isinstance(item, RepoFile)
    ]
    selected = filter_repo_objects(
        entries, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns, key=lambda f: f.path
    )
    files = tuple(sorted((RepoEntry(f.path, int(f.size)) for f in selected), key=lambda e: e.path))
    for entry in files:
        if not safe_relative_path(entry.path):
            raise DownloadFailure("HubError", f"the hub listed a file outside the repo: {entry.path!r}")
    if not files:
        raise DownloadFailure(
            "NoFiles",
            f"no file of {repo}@{revision} ({len(entries)} files at {commit[:12]}) matches"
            f" allowPatterns {allow_patterns or ['*']} and ignorePatterns {ignore_patterns or []}",
        )
    return Resolution(repo=repo, revision=revision, commit=commit, files=files)
