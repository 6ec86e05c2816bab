"""What went wrong with a download, in the terms a person acts on: a reason word and the hub's message.

The reason becomes the operator's condition reason; `transient` says whether retrying the same
request can help (a hub outage) or something must change first (a token, a revision, the disk).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass


@dataclass
class DownloadFailure(Exception):
    reason: str
    message: str
    transient: bool = False

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def _hub_message(error: BaseException) -> str:
    """The error's text in one paragraph: huggingface_hub puts the server's own message in it."""
    return " ".join(str(error).split())


def classify(error: BaseException) -> DownloadFailure:
    """Map an exception raised while talking to the hub or writing the cache to a DownloadFailure."""
    if isinstance(error, DownloadFailure):
        return error
    # Imported here: the operator's CLI imports this package without the runtime extra.
    import httpx2
    from huggingface_hub import errors

    text = _hub_message(error)
    if isinstance(error, errors.RevisionNotFoundError):
        return DownloadFailure("RevisionNotFound", text)
    if isinstance(error, errors.GatedRepoError):
        return DownloadFailure(
            "GatedRepo", f"{text} (accept the model's terms on the hub with the token's account)"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        return DownloadFailure("RepositoryNotFound", text)
    if isinstance(error, errors.RemoteEntryNotFoundError):
        return DownloadFailure("FileNotFound", text)
    if isinstance(error, errors.HfHubHTTPError):
        code = error.response.status_code if error.response is not None else None
        if error.server_message and error.response is not None:
            # Shorter than the library's text and still the hub's own words.
            text = (
                f"{code} {error.response.reason_phrase} from {error.response.request.url}:"
                f" {' '.join(error.server_message.split())}"
            )
        if code == 401:
            return DownloadFailure("Unauthorized", text)
        if code == 403:
            return DownloadFailure("Forbidden", text)
        if code in (408, 429) or (code is not None and code >= 500):
            return DownloadFailure("HubUnavailable", text, transient=True)
        return DownloadFailure("HubError", text)
    if isinstance(error, httpx2.TransportError):
        return DownloadFailure("HubUnavailable", f"cannot reach the hub: {text}", transient=True)
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DownloadFailure("DiskFull", f"the cache volume is full: {text}")
    if isinstance(error, OSError) and "Consistency check failed" in text:
        # A body shorter than its Content-Length: the connection broke, the part file resumes.
        return DownloadFailure("HubUnavailable", text, transient=True)
    return DownloadFailure("DownloadError", f"{type(error).__name__}: {text}")
