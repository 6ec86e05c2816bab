#!/usr/bin/env python3
"""Container images without a registry or a Docker engine: layers and image archives, written here.

An archive this module writes is at once an OCI image layout (``oci-layout``, ``index.json``,
``blobs/sha256/...``), which ``ctr images import`` reads, and a ``docker save`` archive
(``manifest.json`` with ``RepoTags``), which ``docker load`` and ``kind load image-archive`` read.
Layers stay uncompressed: gzip would cost minutes of CPU on a small machine for no gain on one disk.

Layers are deterministic (entries sorted, fixed mtime, numeric owners), so the same tree gives the
same digest and a runtime that already holds a layer does not store it twice.

Standard library only: the build scripts run it with any Python 3.11.

    oci.py --ref registry.k8s.io/pause:3.10 --file pause=/pause --entrypoint /pause --out pause.tar
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
# Every entry's mtime: a fixed instant keeps digests stable from one build to the next.
EPOCH = 1_700_000_000
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layer:
    """An uncompressed layer tar on disk; for an uncompressed layer the digest is also the diff id.

    The tar is the whole of ``path``, or ``size`` bytes from ``offset`` when it is a blob inside an
    image archive (``blob_in_archive``): a multi-GB layer need not be kept twice on disk.
    """

    path: Path
    digest: str  # "sha256:<hex>"
    size: int
    offset: int = 0

    def save_digest(self) -> None:
        """Record the digest beside the tar, so a cached layer is not hashed again."""
        Path(f"{self.path}.sha256").write_text(f"{self.digest} {self.size}\n")

    @classmethod
    def load(cls, path: Path) -> Layer | None:
        """The layer cached at ``path`` with its recorded digest, or None when either is missing."""
        record = Path(f"{path}.sha256")
        if not (path.is_file() and record.is_file()):
            return None
        digest, size = record.read_text().split()
        if int(size) != path.stat().st_size:
            return None
        return cls(path=path, digest=digest, size=int(size))


def blob_in_archive(archive: Path, digest: str) -> Layer | None:
    """The blob ``digest`` of an image archive this module wrote, as a Layer reading it in place;
    None when the archive or the blob is missing. Only tar headers are read, not the blob."""
    if not archive.is_file():
        return None
    try:
        with tarfile.open(archive) as tar:
            member = tar.getmember(f"blobs/sha256/{digest.split(':')[1]}")
    except (KeyError, tarfile.TarError, OSError):
        return None
    return Layer(path=archive, digest=digest, size=member.size, offset=member.offset_data)


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._sink.write(view)
        self.sha.update(view)
        self.size += len(view)
        return len(view)


@dataclass(frozen=True)
class Entry:
    """One path in a layer: ``source`` on this machine (None for a directory made up here) at ``name``."""

    name: str  # path inside the image, no leading slash
    source: Path | None = None
    mode: int | None = None  # permission bits; default: the source's
    uid: int = 0
    gid: int = 0


def _tarinfo(entry: Entry) -> tuple[tarfile.TarInfo, IO[bytes] | None]:
    info = tarfile.TarInfo(entry.name)
    info.mtime = EPOCH
    info.uid, info.gid = entry.uid, entry.gid
    info.uname = info.gname = ""
    if entry.source is None:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755 if entry.mode is None else entry.mode
        return info, None
    st = entry.source.lstat()
    info.mode = stat.S_IMODE(st.st_mode) if entry.mode is None else entry.mode
    if stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(entry.source)
        return info, None
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        return info, None
    if stat.S_ISREG(st.st_mode):
        info.size = st.st_size
        return info, entry.source.open("rb")
    # Device nodes, sockets and fifos: the container runtime makes /dev itself.
    raise _Skip


class _Skip(Exception):
    pass


def walk_tree(root: Path, prefix: str = "", uid: int | None = 0, gid: int | None = 0) -> Iterator[Entry]:
    """Every directory, file and symlink below ``root`` (not following links), sorted, as entries
    named ``prefix/relative``; owners are forced to ``uid``/``gid`` (a tree built as any user), or
    kept as they are on disk where None (a root filesystem built as root, e.g. by debootstrap)."""
    root = root.resolve()
    prefix = prefix.strip("/")

    def entry(name: str, path: Path) -> Entry:
        if uid is None or gid is None:
            st = path.lstat()
            return Entry(
                name, path, uid=st.st_uid if uid is None else uid, gid=st.st_gid if gid is None else gid
            )
        return Entry(name, path, uid=uid, gid=gid)

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        here = Path(dirpath)
        rel = here.relative_to(root).as_posix()
        parts = [p for p in (prefix, "" if rel == "." else rel) if p]
        if parts:
            yield entry("/".join(parts), here)
        for name in sorted(filenames + [d for d in dirnames if (here / d).is_symlink()]):
            yield entry("/".join([*parts, name]), here / name)
        # os.walk does not descend into symlinked directories; they were listed as entries above.
        dirnames[:] = [d for d in dirnames if not (here / d).is_symlink()]


def write_layer(entries: Iterable[Entry], out: Path) -> Layer:
    """Write ``entries`` as an uncompressed layer tar at ``out`` and return it with its digest.

    A regular file seen twice (same device and inode) becomes a hard link, as ``docker build`` does.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    seen_inodes: dict[tuple[int, int], str] = {}
    with tmp.open("wb") as sink:
        hashing = _HashingWriter(sink)
        with tarfile.open(fileobj=hashing, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            tar.copybufsize = _CHUNK  # multi-GB layers: fewer, larger writes through the hash
            for entry in entries:
                try:
                    info, fileobj = _tarinfo(entry)
                except _Skip:
                    continue
                if fileobj is not None and entry.source is not None:
                    st = entry.source.lstat()
                    key = (st.st_dev, st.st_ino)
                    if st.st_nlink > 1 and key in seen_inodes:
                        fileobj.close()
                        info.type = tarfile.LNKTYPE
                        info.linkname = seen_inodes[key]
                        info.size = 0
                        fileobj = None
                    elif st.st_nlink > 1:
                        seen_inodes[key] = entry.name
                try:
                    tar.addfile(info, fileobj)
                finally:
                    if fileobj is not None:
                        fileobj.close()
        sink.flush()
    os.replace(tmp, out)
    layer = Layer(path=out, digest=f"sha256:{hashing.sha.hexdigest()}", size=hashing.size)
    layer.save_digest()
    return layer


def image_config(
    layers: list[Layer],
    *,
    env: dict[str, str] | None = None,
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
    user: str | None = None,
    workdir: str | None = None,
    exposed_ports: Iterable[str] = (),
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An OCI image config (also what Docker reads) for linux/amd64."""
    config: dict[str, Any] = {}
    if env:
        config["Env"] = [f"{k}={v}" for k, v in env.items()]
    if entrypoint:
        config["Entrypoint"] = list(entrypoint)
    if cmd:
        config["Cmd"] = list(cmd)
    if user:
        config["User"] = user
    if workdir:
        config["WorkingDir"] = workdir
    ports = sorted(exposed_ports)
    if ports:
        config["ExposedPorts"] = {p if "/" in p else f"{p}/tcp": {} for p in ports}
    if labels:
        config["Labels"] = dict(sorted(labels.items()))
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": "2023-11-14T22:13:20Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
        "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "e2e/images/oci.py"} for _ in layers],
    }


def _blob(data: bytes) -> tuple[str, bytes]:
    return f"sha256:{hashlib.sha256(data).hexdigest()}", data


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), EPOCH, 0o644
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mtime, info.mode = tarfile.DIRTYPE, EPOCH, 0o755
    tar.addfile(info)


def write_image_archive(out: Path, ref: str, layers: list[Layer], config: dict[str, Any]) -> str:
    """Write the image ``ref`` (``registry/name:tag``) as an archive at ``out``; returns the manifest
    digest, which a runtime reports as the image's id after import."""
    if ":" not in ref.rsplit("/", 1)[-1]:
        raise ValueError(f"image reference {ref!r} has no tag (expected registry/name:tag)")
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": len(config_bytes)},
        "layers": [
            {"mediaType": LAYER_MEDIA_TYPE, "digest": layer.digest, "size": layer.size} for layer in layers
        ],
    }
    manifest_digest, manifest_bytes = _blob(
        json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    )
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [
            {
                "mediaType": MANIFEST_MEDIA_TYPE,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {
                    # containerd names the imported image after the first; the OCI spec's is the tag.
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1],
                },
                "platform": {"architecture": "amd64", "os": "linux"},
            }
        ],
    }
    docker_manifest = [
        {
            "Config": f"blobs/sha256/{config_digest.split(':')[1]}",
            "RepoTags": [ref],
            "Layers": [f"blobs/sha256/{layer.digest.split(':')[1]}" for layer in layers],
        }
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.copybufsize = _CHUNK
        _add_bytes(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _add_dir(tar, "blobs")
        _add_dir(tar, "blobs/sha256")
        written: set[str] = set()
        for layer in layers:
            if layer.digest in written:
                continue
            written.add(layer.digest)
            info = tarfile.TarInfo(f"blobs/sha256/{layer.digest.split(':')[1]}")
            info.size, info.mtime, info.mode = layer.size, EPOCH, 0o644
            with layer.path.open("rb") as f:
                f.seek(layer.offset)
                tar.addfile(info, f)
        _add_bytes(tar, f"blobs/sha256/{config_digest.split(':')[1]}", config_bytes)
        _add_bytes(tar, f"blobs/sha256/{manifest_digest.split(':')[1]}", manifest_bytes)
        _add_bytes(tar, "index.json", json.dumps(index, sort_keys=True).encode())
        _add_bytes(tar, "manifest.json", json.dumps(docker_manifest, sort_keys=True).encode())
    os.replace(tmp, out)
    return manifest_digest


def _parse_file(spec: str) -> tuple[str, Path]:
    source, sep, target = spec.partition("=")
    if not sep or not target.startswith("/"):
        raise argparse.ArgumentTypeError(f"--file takes SOURCE=/path/in/image, got {spec!r}")
    return target, Path(source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a one-layer image archive of a few files.")
    parser.add_argument("--ref", required=True, help="image reference, registry/name:tag")
    parser.add_argument("--file", action="append", type=_parse_file, default=[], metavar="SOURCE=/PATH")
    parser.add_argument("--entrypoint", nargs="+", default=None)
    parser.add_argument("--user", default=None, help="numeric uid[:gid] the image runs as")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if not args.file:
        parser.error("at least one --file is needed")
    entries: list[Entry] = []
    made: set[str] = set()
    for target, source in sorted(args.file):
        if not source.is_file():
            parser.error(f"--file {source}: no such file")
        parts = target.strip("/").split("/")
        for i in range(1, len(parts)):
            directory = "/".join(parts[:i])
            if directory not in made:
                made.add(directory)
                entries.append(Entry(directory))
        entries.append(Entry("/".join(parts), source))
    with tempfile.TemporaryDirectory() as tmp:
        layer = write_layer(entries, Path(tmp) / "layer.tar")
        config = image_config([layer], entrypoint=args.entrypoint, user=args.user)
        digest = write_image_archive(args.out, args.ref, [layer], config)
    print(f"{args.ref} {digest} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "Entry",
    "Layer",
    "blob_in_archive",
    "image_config",
    "main",
    "walk_tree",
    "write_image_archive",
    "write_layer",
]
