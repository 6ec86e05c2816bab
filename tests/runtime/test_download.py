"""`sovereign-runtime download` against a hub-compatible server the tests start (tests/hubserver.py),
with the real huggingface_hub client: resolution, listing, patterns, resume after the hub or the
downloader dies mid-file, verification, and the failures a person must act on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hubserver import HubRepo, HubServer, HubState, write_sharded_repo
from sovereign_runtime.modelhub import cli as download_cli
from sovereign_runtime.modelhub import fetch as fetch_module
from sovereign_runtime.modelhub.fetch import FetchOptions
from sovereign_runtime.modelhub.listing import resolve
from sovereign_runtime.modelhub.progress import Progress
from sovereign_runtime.modelhub.verify import check_safetensors

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_test_token"
TIGHT = ["--attempts", "1", "--progress-interval", "0.2"]


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sharded_repo(tiny_checkpoint, tmp_path_factory.mktemp("hub-repo"))


@pytest.fixture
def hub(sharded: Path) -> Iterator[HubServer]:
    repo = HubRepo.from_dir("sovereign-ai/tiny-v3", sharded, private=True, refs=("v1.0",))
    with HubServer(HubState({repo.repo_id: repo}, token=TOKEN, page_size=3)) as server:
        yield server


def run(
    endpoint: str, tmp_path: Path, *args: str, token: str | None = TOKEN, repo: str = "sovereign-ai/tiny-v3"
) -> tuple[int, dict[str, Any]]:
    """The command in-process, as the Job runs it; returns its exit status and termination message."""
    log = tmp_path / "termination-log"
    previous = os.environ.pop("HF_TOKEN", None)
    if token is not None:
        os.environ["HF_TOKEN"] = token
    try:
        code = download_cli.main(
            ["--repo", repo, "--endpoint", endpoint, "--termination-log", str(log), *TIGHT, *args]
        )
    finally:
        os.environ.pop("HF_TOKEN", None)
        if previous is not None:
            os.environ["HF_TOKEN"] = previous
    return code, json.loads(log.read_text())


def test_a_sharded_repo_downloads_verified_with_the_real_client(
    hub: HubServer, sharded: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "cache"
    code, result = run(
        hub.endpoint, tmp_path, "--dest", str(dest), "--revision", "v1.0", "--ignore-pattern", "original/*"
    )
    repo = hub.state.repos["sovereign-ai/tiny-v3"]
    assert code == 0 and result["event"] == "complete"
    assert result["commit"] == repo.commit  # the tag resolved to its commit
    wanted = sorted(p for p in repo.files if not p.startswith("original/"))
    got = sorted(
        p.relative_to(dest / "checkpoint").as_posix() for p in (dest / "checkpoint").rglob("*") if p.is_file()
    )
    assert got == wanted
    for path in wanted:
        assert (dest / "checkpoint" / path).read_bytes() == (sharded / path).read_bytes()
    assert result["bytesTotal"] == sum(repo.files[p].size for p in wanted) and result["files"] == len(wanted)
    marker = json.loads((dest / "complete.json").read_text())
    assert marker["commit"] == repo.commit and [e["path"] for e in marker["paths"]] == wanted
    assert not (dest / ".partial").exists()
    # Large files came from the CDN by signed URL, never with the hub's token; the listing was paginated.
    blobs = [r for r in hub.state.requests if r["path"].startswith("/blobs/")]
    assert len(blobs) == 2 and not any(r["auth"] for r in blobs)
    assert sum(1 for r in hub.state.requests if "/tree/" in r["path"]) > 1
    # Downloads went by commit, so a branch moving meanwhile cannot mix two revisions.
    resolves = [r["path"] for r in hub.state.requests if "/resolve/" in r["path"]]
    assert resolves and all(f"/resolve/{repo.commit}/" in p for p in resolves)

    # A second run finds the marker and the files as listed: nothing is downloaded again.
    before = len(hub.state.requests)
    code, again = run(
        hub.endpoint, tmp_path, "--dest", str(dest), "--revision", "v1.0", "--ignore-pattern", "original/*"
    )
    assert code == 0 and again["alreadyComplete"] is True
    assert not any("/resolve/" in r["path"] for r in hub.state.requests[before:])


def test_allow_patterns_pick_the_files(hub: HubServer, tmp_path: Path) -> None:
    code, result = run(hub.endpoint, tmp_path, "--resolve-only", "--allow-pattern", "*.json")
    assert code == 0 and result["event"] == "resolved"
    assert result["files"] == 2  # config.json and the index; no shards, no README, nothing in original/
    code, result = run(hub.endpoint, tmp_path, "--resolve-only", "--allow-pattern", "*.bin")
    assert code == 1 and result["reason"] == "NoFiles" and "*.bin" in result["message"]


def test_snapshot_download_itself_works_against_the_test_hub(hub: HubServer, tmp_path: Path) -> None:
    # The server implements what the library's own snapshot path calls, not only what ours does.
    from huggingface_hub import snapshot_download

    path = snapshot_download(
        "sovereign-ai/tiny-v3",
        endpoint=hub.endpoint,
        token=TOKEN,
        local_dir=tmp_path / "snap",
        allow_patterns=["*.json", "*.safetensors"],
    )
    assert (Path(path) / "model.safetensors.index.json").is_file()
    assert (Path(path) / "model-00002-of-00002.safetensors").stat().st_size > 0


@pytest.mark.parametrize(
    ("token", "reason", "says"),
    [
        ("hf_wrong", "Unauthorized", "Invalid credentials in Authorization header"),
        (None, "RepositoryNotFound", "private or gated repo"),
    ],
    ids=["wrong-token", "no-token"],
)
def test_a_refused_token_fails_with_the_hubs_message(
    hub: HubServer, tmp_path: Path, token: str | None, reason: str, says: str
) -> None:
    code, result = run(hub.endpoint, tmp_path, "--dest", str(tmp_path / "cache"), token=token)
    assert code == 1
    assert result["reason"] == reason and says in result["message"] and result["transient"] is False
    assert "401" in result["message"]
    assert not (tmp_path / "cache" / "checkpoint").exists()


def test_an_unknown_revision_is_revision_not_found(hub: HubServer, tmp_path: Path) -> None:
    code, result = run(hub.endpoint, tmp_path, "--resolve-only", "--revision", "v9.9")
    assert code == 1 and result["reason"] == "RevisionNotFound"
    assert "Invalid rev id: v9.9" in result["message"] and "404" in result["message"]
    code, result = run(hub.endpoint, tmp_path, "--resolve-only", "--revision", "0" * 40)
    assert code == 1 and result["reason"] == "RevisionNotFound"


def test_an_unreachable_hub_is_transient(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, result = run(f"http://127.0.0.1:{port}", tmp_path, "--resolve-only")
    assert code == 1 and result["reason"] == "HubUnavailable" and result["transient"] is True


def test_a_full_disk_is_named_before_anything_is_written(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_module.shutil, "disk_usage", lambda _: _Usage(free=1024))
    code, result = run(hub.endpoint, tmp_path, "--dest", str(tmp_path / "cache"))
    assert code == 1 and result["reason"] == "DiskFull"
    assert "huggingFace.cache.size" in result["message"] and "GiB" in result["message"]


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_a_cache_holds_one_commit(hub: HubServer, tmp_path: Path) -> None:
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / ".commit").write_text("f" * 40 + "\n")
    code, result = run(hub.endpoint, tmp_path, "--dest", str(dest))
    assert code == 1 and result["reason"] == "CacheMismatch" and "f" * 40 in result["message"]


def test_a_corrupted_file_in_the_cache_is_fetched_again(
    hub: HubServer, sharded: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "cache"
    assert run(hub.endpoint, tmp_path, "--dest", str(dest))[0] == 0
    shard = dest / "checkpoint" / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:16] = b"{garbage"  # same size, broken header
    shard.write_bytes(bytes(data))
    code, result = run(hub.endpoint, tmp_path, "--dest", str(dest))
    assert code == 0 and "alreadyComplete" not in result
    assert shard.read_bytes() == (sharded / shard.name).read_bytes()


def test_safetensors_headers_are_checked_against_the_data(sharded: Path, tmp_path: Path) -> None:
    good = sharded / "model-00001-of-00002.safetensors"
    check_safetensors(good)
    raw = good.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])

    def write(body: dict[str, Any], data: bytes) -> Path:
        text = json.dumps(body).encode()
        path = tmp_path / "bad.safetensors"
        path.write_bytes(len(text).to_bytes(8, "little") + text + data)
        return path

    data = raw[8 + header_len :]
    with pytest.raises(ValueError, match="belong to no tensor"):
        check_safetensors(write(header, data + b"\0" * 16))  # trailing bytes no tensor owns
    name = next(k for k in header if k != "__metadata__")
    wrong = {**header, name: {**header[name], "dtype": "F16"}}
    with pytest.raises(ValueError, match="does not take"):
        check_safetensors(write(wrong, data))
    outside = {**header, name: {**header[name], "data_offsets": [0, len(data) + 4]}}
    with pytest.raises(ValueError, match="outside"):
        check_safetensors(write(outside, data))
    path = tmp_path / "short.safetensors"
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="does not fit"):
        check_safetensors(path)


def test_progress_counts_growing_part_files_and_the_rate(tmp_path: Path) -> None:
    now = [100.0]
    progress = Progress(total_bytes=1000, files=2, clock=lambda: now[0])
    part = tmp_path / "a.part"
    part.write_bytes(b"x" * 100)
    progress.growing(part)
    first = progress.snapshot()
    assert first["bytesDone"] == 100 and first["rateBytesPerSecond"] == 0 and "etaSeconds" not in first
    now[0] += 10
    part.write_bytes(b"x" * 300)
    second = progress.snapshot()
    assert second["bytesDone"] == 300 and second["rateBytesPerSecond"] == 20 and second["etaSeconds"] == 35
    progress.settled(part)
    progress.finished(300)
    assert progress.snapshot()["filesDone"] == 1


def test_the_runtime_cli_has_the_download_command() -> None:
    from sovereign_runtime import program

    assert program.main(["download", "--dest", "/tmp/x"]) == 2  # --repo is required: a usage error


# ---- resume ----------------------------------------------------------------------------------

# huggingface_hub writes a download in 10 MiB chunks: a file of a few chunks, sent slowly enough to
# interrupt after the first chunk; the rest comes unthrottled once the test has interrupted it.
BIG_BYTES = 24 * 2**20
THROTTLE = 3 * 2**20  # bytes/s


@pytest.fixture(scope="module")
def big_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repo with one 24 MiB safetensors file (one U8 tensor) and a config."""
    root = tmp_path_factory.mktemp("big-repo")
    header = json.dumps(
        {"blob": {"dtype": "U8", "shape": [BIG_BYTES], "data_offsets": [0, BIG_BYTES]}}
    ).encode()
    (root / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + os.urandom(BIG_BYTES)
    )
    (root / "config.json").write_text('{"model_type": "deepseek_v3"}')
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stats(endpoint: str) -> list[dict[str, Any]]:
    import urllib.request

    with urllib.request.urlopen(f"{endpoint}/_stats", timeout=5) as response:
        return list(json.loads(response.read()))


class HubProcess:
    """tests/hubserver.py as its own process on fixed ports, so a test can kill it and start it again."""

    def __init__(self, root: Path, throttle: int) -> None:
        self.root = root
        self.port, self.cdn_port, self.throttle = _free_port(), _free_port(), throttle
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None

    def start(self, throttled: bool = True) -> None:
        throttle = ["--throttle", str(self.throttle)] if throttled else []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "hubserver.py"),
                "--repo",
                f"sovereign-ai/big={self.root}",
                *throttle,
                "--port",
                str(self.port),
                "--cdn-port",
                str(self.cdn_port),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert json.loads(self.proc.stdout.readline())["endpoint"] == self.endpoint

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def cdn_stats(self) -> list[dict[str, Any]]:
        return _stats(f"http://127.0.0.1:{self.cdn_port}")


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _part(dest: Path) -> Path:
    return dest / ".partial" / "model.safetensors.part"


def test_killing_the_hub_mid_file_resumes_by_byte_range(big_repo: Path, tmp_path: Path) -> None:
    hub = HubProcess(big_repo, THROTTLE)
    hub.start()
    dest = tmp_path / "cache"
    size = (big_repo / "model.safetensors").stat().st_size
    resolution = resolve("sovereign-ai/big", "main", endpoint=hub.endpoint, token=None)
    outcome: dict[str, Any] = {}

    def download() -> None:
        try:
            outcome["result"] = download_cli.fill_cache(
                resolution, dest, FetchOptions(endpoint=hub.endpoint, token=None, attempts=20), 0.2
            )
        except Exception as error:  # reported by the assertion below
            outcome["error"] = error

    worker = threading.Thread(target=download)
    worker.start()
    try:
        _wait_for(lambda: _part(dest).is_file() and _part(dest).stat().st_size > 0, 30, "a first chunk")
        hub.kill()
        time.sleep(1.5)  # the downloader finds the hub gone and backs off
        had = _part(dest).stat().st_size
        assert 0 < had < size
        hub.start(throttled=False)
        worker.join(60)
        gets = [r for r in hub.cdn_stats() if r["method"] == "GET"]
    finally:
        if hub.proc is not None and hub.proc.poll() is None:
            hub.kill()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"]["event"] == "complete"
    assert (dest / "checkpoint" / "model.safetensors").read_bytes() == (
        big_repo / "model.safetensors"
    ).read_bytes()
    # The restarted hub was asked only for the rest of the file.
    assert len(gets) == 1 and gets[0]["range"] is not None
    assert int(gets[0]["range"].removeprefix("bytes=").rstrip("-")) >= had


def test_a_killed_downloader_resumes_its_part_file(big_repo: Path, tmp_path: Path) -> None:
    repo = HubRepo.from_dir("sovereign-ai/big", big_repo)
    dest = tmp_path / "cache"
    size = (big_repo / "model.safetensors").stat().st_size
    with HubServer(HubState({repo.repo_id: repo}, throttle_bps=THROTTLE)) as hub:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sovereign_runtime.modelhub",
                "--repo",
                repo.repo_id,
                "--endpoint",
                hub.endpoint,
                "--dest",
                str(dest),
                "--termination-log",
                str(tmp_path / "log"),
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            _wait_for(
                lambda: _part(dest).is_file() and _part(dest).stat().st_size > size // 4, 60, "a quarter"
            )
        finally:
            proc.send_signal(signal.SIGKILL)  # as a pod's container dies: no cleanup runs
            proc.wait(10)
        had = _part(dest).stat().st_size
        assert 0 < had < size
        hub.state.throttle_bps = None
        code, result = run(hub.endpoint, tmp_path, "--dest", str(dest), token=None, repo=repo.repo_id)
    assert code == 0 and result["event"] == "complete"
    assert (dest / "checkpoint" / "model.safetensors").read_bytes() == (
        big_repo / "model.safetensors"
    ).read_bytes()
    blob_gets = [r for r in hub.state.requests if r["path"].startswith("/blobs/") and r["method"] == "GET"]
    assert blob_gets[-1]["range"] is not None and int(blob_gets[-1]["range"][6:-1]) >= had
