"""A small Hugging Face hub for tests: the part of the hub's HTTP API that `huggingface_hub` calls to
resolve a revision, list a repo and download its files, served from files the tests make.

- `GET /api/models/{repo}[/revision/{rev}]`: the repo's info (`sha` = the commit, `siblings`;
  with `?blobs=true` their sizes and LFS data);
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=`: the file list, paginated with a `Link`
  header like the hub's (cursor-based);
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: small files inline (ETag = git blob id); LFS files
  (safetensors and anything over 1 MiB) answer 302 to a second listener standing in for the CDN,
  with `X-Linked-Size`, `X-Linked-Etag` (sha256) and `X-Repo-Commit`, as the hub does;
- the CDN serves a signed URL (the hub's token is not sent there) with byte ranges (206,
  `Content-Range`, 416) and an optional bandwidth limit, so a test can kill the server mid-file.

Errors carry the hub's headers and messages (`X-Error-Code` RepoNotFound / RevisionNotFound /
EntryNotFound, `X-Error-Message`), so huggingface_hub raises the same exceptions it raises against
huggingface.co: a wrong token is 401 "Invalid credentials in Authorization header", a private repo
without a token 401 RepoNotFound, an unknown revision 404 "Invalid rev id".

Run in-process (`HubServer`, for most tests) or as a process the test can kill:
`python tests/hubserver.py --repo org/name=DIR [--token T] [--throttle BYTES_PER_S] --port P --cdn-port Q`.
`GET /_stats` returns the requests seen (method, path, Range, status) for assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from aiohttp import web

LFS_THRESHOLD = 1 << 20
CHUNK = 64 * 1024
SIGNING_KEY = b"test-hub-cdn"


@dataclass(frozen=True)
class HubFile:
    path: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % self.size + self.data).hexdigest()

    @property
    def lfs(self) -> bool:
        return self.path.endswith(".safetensors") or self.size > LFS_THRESHOLD


@dataclass
class HubRepo:
    """One model repo at one commit; `refs` are extra branch or tag names for it ("main" always)."""

    repo_id: str
    files: dict[str, HubFile]
    private: bool = False
    refs: tuple[str, ...] = ()

    @classmethod
    def from_dir(cls, repo_id: str, root: Path, **kwargs: Any) -> HubRepo:
        files = {
            p.relative_to(root).as_posix(): HubFile(p.relative_to(root).as_posix(), p.read_bytes())
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }
        return cls(repo_id, files, **kwargs)

    @property
    def commit(self) -> str:
        listing = "".join(
            f"{f.path}\0{f.git_oid}\n" for f in sorted(self.files.values(), key=lambda f: f.path)
        )
        return hashlib.sha1(f"{self.repo_id}\n{listing}".encode()).hexdigest()

    def knows(self, revision: str) -> bool:
        return revision in ("main", self.commit, *self.refs)


@dataclass
class HubState:
    repos: dict[str, HubRepo]
    token: str | None = None  # what private repos accept
    throttle_bps: int | None = None
    page_size: int = 1000
    cdn_base: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)


STATE = web.AppKey("state", HubState)


def _error(
    status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    extra = {"X-Error-Message": message, **(headers or {})}
    if code:
        extra["X-Error-Code"] = code
    return web.json_response({"error": message}, status=status, headers=extra)


def _auth_problem(state: HubState, request: web.Request, repo: HubRepo | None) -> web.Response | None:
    header = request.headers.get("Authorization", "")
    sent = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else None
    if sent is not None and sent != state.token:
        return _error(401, None, "Invalid credentials in Authorization header")
    if repo is None or (repo.private and sent is None):
        # The hub does not say whether a repo it will not show exists.
        return _error(401 if sent is None else 404, "RepoNotFound", "Repository not found")
    return None


def _repo(state: HubState, request: web.Request) -> tuple[HubRepo | None, web.Response | None]:
    repo = state.repos.get(f"{request.match_info['org']}/{request.match_info['name']}")
    problem = _auth_problem(state, request, repo)
    return repo, problem


def _revision(repo: HubRepo, raw: str) -> web.Response | None:
    revision = unquote(raw)
    if not repo.knows(revision):
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    return None


def _entry(f: HubFile, blobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"rfilename": f.path}
    if blobs:
        body.update(size=f.size, blobId=f.git_oid)
        if f.lfs:
            body["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
    return body


async def model_info(request: web.Request) -> web.Response:
    state: HubState = request.app[STATE]
    repo, problem = _repo(state, request)
    if problem is not None:
        return problem
    assert repo is not None
    problem = _revision(repo, request.match_info.get("rev", "main"))
    if problem is not None:
        return problem
    blobs = request.query.get("blobs", "").lower() in ("1", "true")
    return web.json_response(
        {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "private": repo.private,
            "sha": repo.commit,
            "siblings": [_entry(f, blobs) for f in sorted(repo.files.values(), key=lambda f: f.path)],
            "lastModified": "2025-01-01T00:00:00.000Z",
            "tags": ["safetensors", "deepseek_v3"],
        }
    )


def _tree_items(repo: HubRepo, prefix: str, recursive: bool) -> list[dict[str, Any]]:
    base = prefix.strip("/")
    items: dict[str, dict[str, Any]] = {}
    for f in sorted(repo.files.values(), key=lambda f: f.path):
        if base and not f.path.startswith(base + "/"):
            continue
        rest = f.path[len(base) + 1 :] if base else f.path
        parts = rest.split("/")
        for depth in range(1, len(parts)):
            if depth > 1 and not recursive:
                break
            folder = "/".join(([base] if base else []) + parts[:depth])
            items.setdefault(
                folder,
                {
                    "type": "directory",
                    "oid": hashlib.sha1(folder.encode()).hexdigest(),
                    "size": 0,
                    "path": folder,
                },
            )
        if len(parts) == 1 or recursive:
            entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            items[f.path] = entry
    return [items[k] for k in sorted(items)]


async def tree(request: web.Request) -> web.Response:
    state: HubState = request.app[STATE]
    repo, problem = _repo(state, request)
    if problem is not None:
        return problem
    assert repo is not None
    problem = _revision(repo, request.match_info["rev"])
    if problem is not None:
        return problem
    recursive = request.query.get("recursive", "").lower() in ("1", "true")
    items = _tree_items(repo, unquote(request.match_info.get("path", "")), recursive)
    start = int(request.query.get("cursor", "0"))
    page = items[start : start + state.page_size]
    headers = {}
    if start + state.page_size < len(items):
        query = f"recursive={str(recursive).lower()}&expand=false&cursor={start + state.page_size}"
        headers["Link"] = f'<{request.url.with_query(None)}?{query}>; rel="next"'
    return web.json_response(page, headers=headers)


def _signature(sha256: str) -> str:
    return hmac.new(SIGNING_KEY, sha256.encode(), hashlib.sha256).hexdigest()[:32]


async def resolve(request: web.Request) -> web.StreamResponse:
    state: HubState = request.app[STATE]
    repo, problem = _repo(state, request)
    if problem is not None:
        return problem
    assert repo is not None
    problem = _revision(repo, request.match_info["rev"])
    if problem is not None:
        return problem
    path = unquote(request.match_info["path"])
    f = repo.files.get(path)
    commit_header = {"X-Repo-Commit": repo.commit}
    if f is None:
        return _error(404, "EntryNotFound", f'{path} does not exist on "{repo.commit}"', commit_header)
    if f.lfs:
        location = f"{state.cdn_base}/blobs/{f.sha256}?sig={_signature(f.sha256)}"
        return web.Response(
            status=302,
            headers={
                **commit_header,
                "Location": location,
                "ETag": f'"{f.git_oid}"',
                "X-Linked-Etag": f'"{f.sha256}"',
                "X-Linked-Size": str(f.size),
            },
        )
    return await _send(state, request, f.data, {**commit_header, "ETag": f'"{f.git_oid}"'})


async def cdn_blob(request: web.Request) -> web.StreamResponse:
    state: HubState = request.app[STATE]
    sha256 = request.match_info["sha256"]
    if request.headers.get("Authorization"):
        return web.Response(status=400, text="the CDN takes signed URLs, not the hub's token")
    if not hmac.compare_digest(request.query.get("sig", ""), _signature(sha256)):
        return web.Response(status=403, text="bad signature")
    blob = next((f for r in state.repos.values() for f in r.files.values() if f.sha256 == sha256), None)
    if blob is None:
        return web.Response(status=404, text="no such blob")
    return await _send(state, request, blob.data, {"ETag": f'"{sha256}"'})


async def _send(
    state: HubState, request: web.Request, data: bytes, headers: dict[str, str]
) -> web.StreamResponse:
    total = len(data)
    start, end = 0, total - 1
    status = 200
    wanted = request.headers.get("Range")
    if wanted:
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
        if match is None or int(match.group(1)) >= total:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{total}"})
        start = int(match.group(1))
        end = min(total - 1, int(match.group(2))) if match.group(2) else total - 1
        status = 206
        headers = {**headers, "Content-Range": f"bytes {start}-{end}/{total}"}
    response = web.StreamResponse(
        status=status, headers={**headers, "Accept-Ranges": "bytes", "Content-Length": str(end - start + 1)}
    )
    await response.prepare(request)
    if request.method == "HEAD":
        return response
    position = start
    while position <= end:
        chunk = data[position : min(end + 1, position + CHUNK)]
        await response.write(chunk)
        position += len(chunk)
        if state.throttle_bps:
            await asyncio.sleep(len(chunk) / state.throttle_bps)
    await response.write_eof()
    return response


@web.middleware
async def record(request: web.Request, handler: Any) -> web.StreamResponse:
    state: HubState = request.app[STATE]
    response = await handler(request)
    if request.path != "/_stats":
        state.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "range": request.headers.get("Range"),
                "status": response.status,
                "auth": bool(request.headers.get("Authorization")),
            }
        )
    return response


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].requests)


def hub_app(state: HubState) -> web.Application:
    app = web.Application(middlewares=[record])
    app[STATE] = state
    repo = "/{org}/{name}"
    app.router.add_get("/_stats", stats)
    app.router.add_get(f"/api/models{repo}", model_info)
    app.router.add_get(f"/api/models{repo}/revision/{{rev}}", model_info)
    app.router.add_get(f"/api/models{repo}/tree/{{rev}}", tree)
    app.router.add_get(f"/api/models{repo}/tree/{{rev}}/{{path:.*}}", tree)
    app.router.add_route("GET", f"{repo}/resolve/{{rev}}/{{path:.*}}", resolve)
    app.router.add_route("HEAD", f"{repo}/resolve/{{rev}}/{{path:.*}}", resolve)
    return app


def cdn_app(state: HubState) -> web.Application:
    app = web.Application(middlewares=[record])
    app[STATE] = state
    app.router.add_get("/_stats", stats)
    app.router.add_route("GET", "/blobs/{sha256}", cdn_blob)
    app.router.add_route("HEAD", "/blobs/{sha256}", cdn_blob)
    return app


async def start(
    state: HubState, host: str, port: int, cdn_port: int, advertise: str | None = None
) -> tuple[web.AppRunner, web.AppRunner, int]:
    """Start both listeners; returns the runners and the hub's port (0 picks free ports). The CDN's
    URLs name `advertise` (default: the bind address, 127.0.0.1 for a wildcard one)."""
    cdn = web.AppRunner(cdn_app(state), access_log=None)
    await cdn.setup()
    cdn_site = web.TCPSite(cdn, host, cdn_port)
    await cdn_site.start()
    cdn_port = cdn_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    named = advertise or ("127.0.0.1" if host in ("0.0.0.0", "") else host)
    state.cdn_base = f"http://{named}:{cdn_port}"
    hub = web.AppRunner(hub_app(state), access_log=None)
    await hub.setup()
    hub_site = web.TCPSite(hub, host, port)
    await hub_site.start()
    return hub, cdn, hub_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


class HubServer:
    """The hub in a background thread of the test process: `with HubServer(state) as hub: hub.endpoint`."""

    def __init__(self, state: HubState, host: str = "127.0.0.1") -> None:
        self.state = state
        self.host = host
        self.endpoint = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test hub", daemon=True)
        self._runners: tuple[web.AppRunner, web.AppRunner] | None = None

    def __enter__(self) -> HubServer:
        self._thread.start()
        hub, cdn, port = asyncio.run_coroutine_threadsafe(
            start(self.state, self.host, 0, 0), self._loop
        ).result(10)
        self._runners = (hub, cdn)
        self.endpoint = f"http://{self.host}:{port}"
        return self

    def __exit__(self, *_: object) -> None:
        async def stop() -> None:
            for runner in self._runners or ():
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", required=True, metavar="ORG/NAME=DIR")
    parser.add_argument("--private", action="store_true", help="every repo needs --token")
    parser.add_argument("--token")
    parser.add_argument("--throttle", type=int, metavar="BYTES_PER_S")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cdn-port", type=int, default=0)
    parser.add_argument("--advertise-host", help="the address clients reach this machine at (pods)")
    args = parser.parse_args()
    repos = {}
    for spec in args.repo:
        repo_id, _, directory = spec.partition("=")
        repos[repo_id] = HubRepo.from_dir(repo_id, Path(directory), private=args.private)
    state = HubState(repos, token=args.token, throttle_bps=args.throttle)

    async def serve() -> None:
        _, _, port = await start(state, args.host, args.port, args.cdn_port, args.advertise_host)
        host = args.advertise_host or args.host
        print(json.dumps({"endpoint": f"http://{host}:{port}", "cdn": state.cdn_base}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()


def write_sharded_repo(checkpoint: Path, dest: Path, shards: int = 2) -> Path:
    """A hub-style repo from a one-file checkpoint: the tensors split over `shards` safetensors files
    with a `model.safetensors.index.json`, the other files copied, plus what real repos also carry
    (a README and an `original/` folder that allowPatterns usually leave out)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    for source in checkpoint.iterdir():
        if source.is_file() and source.name != "model.safetensors":
            (dest / source.name).write_bytes(source.read_bytes())
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        tensors = {name: f.get_tensor(name) for name in names}
    weight_map = {}
    for index in range(shards):
        shard = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = names[index::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(dest / shard), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index_body, indent=2))
    (dest / "README.md").write_text("---\nlicense: mit\n---\n# A tiny DeepSeek-V3 for tests\n")
    (dest / "original").mkdir(exist_ok=True)
    (dest / "original" / "consolidated.pth").write_bytes(b"\0" * 4096)
    return dest
