#!/usr/bin/env python3
"""Build the runtime and operator images on this machine: no registry, no Docker engine.

Each image is three layers, so a code change rebuilds only the small top one:

1. ``base``: a Debian bookworm root filesystem from Debian's packages (``rootfs.py``), shared by
   both images;
2. ``python``: ``/opt/venv`` with the image's dependency closure, copied by RECORD from the
   project's ``.venv`` (``pyenv.py``; nothing is downloaded again), the runtime's in its CPU
   flavour (``lean.py``), with bytecode compiled;
3. ``app``: the project installed from a wheel of the working tree, and the accounts and directories
   the Dockerfile's final stage creates.

Environment, user, entrypoint, command, ports and working directory are read from
``images/<name>.Dockerfile`` (``dockerfile.py``). Every layer is cached under ``.cache/images`` by a
key of its inputs; the archives (``oci.py``: OCI layout and ``docker save`` at once) and
``images.json``, a manifest of what was built, go there too.

    e2e/images/build.sh [--image runtime|operator ...] [--repo R] [--tag T]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dockerfile  # noqa: E402
import elf  # noqa: E402
import lean  # noqa: E402
import oci  # noqa: E402
import pyenv  # noqa: E402
import rootfs  # noqa: E402

REPO = HERE.parents[1]
PROJECT = "sovereign"
DEFAULT_REPO = "ghcr.io/sovereign-ai"


@dataclass(frozen=True)
class ImageDef:
    dockerfile: str
    name: str
    extras: tuple[str, ...]
    flavour: str | None  # "cpu": the lean CPU build of the runtime (lean.py); None: as the Dockerfile
    description: str


IMAGES = {
    "runtime": ImageDef(
        "images/runtime.Dockerfile",
        "sovereign-runtime",
        ("runtime",),
        "cpu",
        "Sovereign runtime, CPU flavour built locally from Debian packages and the project's virtualenv "
        "(the GPU release image is images/runtime.Dockerfile)",
    ),
    "operator": ImageDef(
        "images/operator.Dockerfile",
        "sovereign-operator",
        (),
        None,
        "Sovereign operator, built locally from Debian packages and the project's virtualenv",
    ),
}


class BuildError(RuntimeError):
    """The build cannot go on; the message says why."""


def log(message: str) -> None:
    print(f"images: {message}", flush=True)


def _sha(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _code_key(*names: str) -> str:
    """The build code a layer depends on: a change to how it is made rebuilds it."""
    return _sha(*[(HERE / n).read_text() for n in names])


class Tree:
    """The entries of one layer: files copied from this machine, files written here (into a staging
    folder), symlinks and directories, all under image paths (absolute, no trailing slash)."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.entries: dict[str, oci.Entry] = {}
        self.file_bytes = 0

    def _name(self, path: str) -> str:
        return path.strip("/")

    def file(self, path: str, source: Path) -> None:
        self.entries[self._name(path)] = oci.Entry(self._name(path), source)
        if not source.is_symlink():
            self.file_bytes += source.stat().st_size

    def data(self, path: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0) -> None:
        target = self.staging / self._name(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        self.entries[self._name(path)] = oci.Entry(self._name(path), target, mode=mode, uid=uid, gid=gid)
        self.file_bytes += len(data)

    def link(self, path: str, target: str) -> None:
        staged = self.staging / self._name(path)
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.unlink(missing_ok=True)
        staged.symlink_to(target)
        self.entries[self._name(path)] = oci.Entry(self._name(path), staged)

    def directory(self, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        self.entries[self._name(path)] = oci.Entry(self._name(path), None, mode=mode, uid=uid, gid=gid)

    def write(self, out: Path) -> oci.Layer:
        # Every parent directory is an entry of its own (root, 0755) unless given one.
        for name in list(self.entries):
            parts = name.split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                self.entries.setdefault(parent, oci.Entry(parent, None, mode=0o755))
        return oci.write_layer((self.entries[n] for n in sorted(self.entries)), out)


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another build holds .cache/images/.lock; waiting")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---- base -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    layer: oci.Layer
    info: dict[str, Any]  # python_version, packages, system_libraries, etc (account files), ...


def ensure_base(cache: Path) -> Base:
    stanzas = rootfs.debian_sources()
    key = _sha((HERE / "rootfs.py").read_text(), rootfs.render_deb822(stanzas))[:16]
    directory = cache / "base"
    layer_path = directory / f"base-{key}.tar"
    info_path = directory / f"base-{key}.json"
    cached = oci.Layer.load(layer_path)
    if cached is not None and info_path.is_file():
        log(f"base {cached.digest[7:19]} (cached)")
        return Base(cached, json.loads(info_path.read_text()))
    if directory.exists():
        shutil.rmtree(directory)  # an older base: one is kept at a time
    directory.mkdir(parents=True)
    tree = directory / "rootfs"
    log(
        f"base: debootstrap {rootfs.SUITE} from {rootfs.main_mirror(stanzas)} (log: {directory / 'build.log'})"
    )
    start = time.monotonic()
    rootfs.build(tree, directory / "build.log", stanzas)
    built = time.monotonic() - start
    etc = {n: (tree / "etc" / n).read_text() for n in ("passwd", "group", "shadow", "gshadow")}
    info = {
        "suite": rootfs.SUITE,
        "mirror": rootfs.main_mirror(stanzas),
        "python_version": rootfs.python_version(tree),
        "packages": rootfs.packages(tree),
        "system_libraries": sorted(rootfs.system_libraries(tree)),
        "etc": etc,
        "debootstrap_seconds": round(built, 1),
        "file_bytes": sum(p.lstat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink()),
    }
    start = time.monotonic()
    layer = oci.write_layer(oci.walk_tree(tree, uid=None, gid=None), layer_path)
    info["layer_seconds"] = round(time.monotonic() - start, 1)
    info_path.write_text(json.dumps(info, indent=1, sort_keys=True))
    shutil.rmtree(tree)
    log(f"base {layer.digest[7:19]}: {layer.size >> 20} MiB in {built:.0f} s")
    return Base(layer, info)


# ---- python dependencies --------------------------------------------------------------------------


def _site_relative(layout: pyenv.Layout, path: str) -> str:
    return posixpath.relpath(path, layout.site)


def python_layer(
    image: ImageDef, requirements: list[str], base: Base, cache: Path, host_python: Path
) -> tuple[oci.Layer, dict[str, Any]]:
    layout = pyenv.Layout(base.info["python_version"])
    site = Path(
        subprocess.run(
            [str(host_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    available = pyenv.installed(site)
    closure = pyenv.resolve(
        requirements,
        available,
        pyenv.marker_environment(layout.python_version),
        root=f"{PROJECT}[{','.join(image.extras)}]" if image.extras else PROJECT,
        extras=image.extras,
    )
    closure.dists.pop(PROJECT, None)
    pins = sorted((n, d.version, sorted(closure.extras[n])) for n, d in closure.dists.items())
    # The base enters through its Python and its libraries only: a new debootstrap of the same
    # packages does not rebuild 3 GB.
    code = _code_key("build.py", "elf.py", "lean.py", "oci.py", "pyenv.py")
    key = _sha(pins, image.flavour, layout, base.info["system_libraries"], code)[:16]
    path = cache / "layers" / f"{image.name}-python-{key}.tar"
    stats_path = Path(f"{path}.json")
    cached = _cached(path, cache / f"{image.name}.tar")
    if cached is not None:
        log(f"{image.name}: python layer {cached[0].digest[7:19]} (cached)")
        return cached

    start = time.monotonic()
    files: dict[str, Path] = {}
    scripts: list[pyenv.Script] = []
    distribution_of: dict[str, str] = {}
    closure_bytes = 0
    for name, dist in sorted(closure.dists.items()):
        copied, written = pyenv.dist_files(dist, layout, host_python)
        for target, source in copied.items():
            rel = _site_relative(layout, target)
            files[rel] = source
            distribution_of[rel] = name
            closure_bytes += source.lstat().st_size
        for script in written:
            distribution_of[_site_relative(layout, script.path)] = name
            closure_bytes += len(script.data)
        scripts += written
    dropped: dict[str, str] = {}
    if image.flavour == "cpu":
        selection = lean.select_cpu(files, distribution_of)
        files, dropped = selection.kept, selection.dropped
        scripts = [
            s
            for s in scripts
            if distribution_of[_site_relative(layout, s.path)] not in lean.CPU_DROPPED_DISTRIBUTIONS
        ]
    missing = lean.missing_libraries(
        files,
        set(base.info["system_libraries"]),
        skip=frozenset() if image.flavour == "cpu" else lean.DRIVER_LIBRARIES,
    )
    if missing:
        lines = [f"  {rel}: {', '.join(names)}" for rel, names in sorted(missing.items())]
        raise BuildError(f"{image.name}: shared libraries the loader would not find:\n" + "\n".join(lines))

    work = cache / "work" / path.stem
    shutil.rmtree(work, ignore_errors=True)
    tree = Tree(work / "tree")
    for target, source in files.items():
        tree.file(posixpath.normpath(posixpath.join(layout.site, target)), source)
    for script in scripts:
        tree.data(script.path, script.data, script.mode)
    for script in pyenv.venv_skeleton(layout):
        tree.data(script.path, script.data, script.mode)
    for link, target in pyenv.venv_links(layout).items():
        tree.link(link, target)
    sources = {posixpath.normpath(posixpath.join(layout.site, r)): s for r, s in files.items()}
    compiled, invalid = pyenv.compile_sources(sources, work / "pyc", layout)
    for target, pyc in compiled.items():
        tree.file(target, pyc)
    layer = tree.write(path)
    shutil.rmtree(work)
    dropped_bytes: dict[str, int] = {}
    for rel, reason in dropped.items():
        source = Path(str(closure.dists[distribution_of[rel]].locate_file(rel)))
        dropped_bytes[reason] = dropped_bytes.get(reason, 0) + source.lstat().st_size
    stats = {
        "distributions": {n: v for n, v, _ in pins},
        "closure_bytes": closure_bytes,
        "kept_bytes": closure_bytes - sum(dropped_bytes.values()),
        "dropped_bytes_by_reason": dropped_bytes,
        "dropped_files": len(dropped),
        "pyc_files": len(compiled),
        "sources_without_bytecode": invalid,  # not valid Python 3.11 (templates, test data)
        "layer_file_bytes": tree.file_bytes,
        "seconds": round(time.monotonic() - start, 1),
    }
    stats_path.write_text(json.dumps(stats, indent=1, sort_keys=True))
    _prune(cache / "layers", f"{image.name}-python-", keep=path)
    log(
        f"{image.name}: python layer {layer.digest[7:19]}: {layer.size >> 20} MiB in {stats['seconds']:.0f} s"
    )
    return layer, stats


def _prune(directory: Path, prefix: str, keep: Path) -> None:
    """Drop older layers of the same kind: one is kept per image."""
    for old in directory.glob(f"{prefix}*"):
        if not old.name.startswith(keep.name):
            old.unlink()


# ---- the project ----------------------------------------------------------------------------------


def project_sources() -> list[str]:
    """What the Dockerfiles copy into the build (the same list in both, checked by a test)."""
    return dockerfile.context_sources(REPO / IMAGES["operator"].dockerfile)


def _ignored(rel: Path) -> bool:
    # .dockerignore's exclusions inside the copied folders.
    return any(p == "__pycache__" or p.endswith(".egg-info") for p in rel.parts) or rel.suffix == ".pyc"


def sources_key() -> str:
    digest = hashlib.sha256()
    for name in project_sources():
        top = REPO / name
        paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in paths:
            rel = path.relative_to(REPO)
            if _ignored(rel):
                continue
            digest.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_wheel(host_python: Path, out: Path) -> Path:
    """``pip wheel`` of a copy of the build context, with the virtualenv's setuptools (no download)."""
    with tempfile.TemporaryDirectory(prefix="sovereign-src-") as tmp:
        for name in project_sources():
            source = REPO / name
            if source.is_dir():
                shutil.copytree(
                    source,
                    Path(tmp) / name,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
                )
            else:
                shutil.copy2(source, Path(tmp) / name)
        out.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [
                str(host_python),
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-cache-dir",
                "--no-index",
                "--wheel-dir",
                str(out),
                tmp,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if result.returncode != 0:
        raise BuildError(f"pip wheel of the project failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    (wheel,) = out.glob(f"{PROJECT}-*.whl")
    return wheel


def account_files(base: Base, accounts: list[dockerfile.Account]) -> dict[str, str]:
    """/etc/passwd, group, shadow and gshadow with the Dockerfile's accounts added as useradd would."""
    etc = dict(base.info["etc"])
    for a in accounts:
        for name, line in (
            ("group", f"{a.group}:x:{a.gid}:"),
            ("gshadow", f"{a.group}:!::"),
            ("passwd", f"{a.name}:x:{a.uid}:{a.gid}::{a.home}:{a.shell}"),
            ("shadow", f"{a.name}:!:19000::::::"),
        ):
            key = line.split(":", 1)[0] + ":"
            if any(existing.startswith(key) for existing in etc[name].splitlines()):
                raise BuildError(f"{name}: the base already has an entry for {key[:-1]}")
            etc[name] = etc[name].rstrip("\n") + "\n" + line + "\n"
    return etc


def _cached(path: Path, archive: Path | None = None) -> tuple[oci.Layer, dict[str, Any]] | None:
    """A layer cached at ``path`` with its stats, or None. A layer moved into the image's archive
    (only its ``.sha256`` and ``.json`` records stay beside ``path``) is read from there."""
    stats = Path(f"{path}.json")
    if not stats.is_file():
        return None
    layer = oci.Layer.load(path)
    record = Path(f"{path}.sha256")
    if layer is None and archive is not None and record.is_file():
        digest, size = record.read_text().split()
        layer = oci.blob_in_archive(archive, digest)
        if layer is not None and layer.size != int(size):
            layer = None
    if layer is None:
        return None
    return layer, json.loads(stats.read_text())


def _app_layer_path(
    image: ImageDef, spec: dockerfile.FinalStage, base: Base, cache: Path, source_key: str
) -> Path:
    code = _code_key("build.py", "dockerfile.py", "oci.py", "pyenv.py")
    key = _sha(source_key, spec.accounts, spec.directories, base.layer.digest, code)[:16]
    return cache / "layers" / f"{image.name}-app-{key}.tar"


def app_layer(
    image: ImageDef, spec: dockerfile.FinalStage, wheel: Path | None, base: Base, path: Path
) -> tuple[oci.Layer, dict[str, Any]]:
    cached = _cached(path)
    if cached is not None:
        log(f"{image.name}: app layer {cached[0].digest[7:19]} (cached)")
        return cached
    if wheel is None:
        raise BuildError(f"{image.name}: no cached app layer and no wheel built")
    layout = pyenv.Layout(base.info["python_version"])
    start = time.monotonic()
    work = path.parent.parent / "work" / path.stem
    shutil.rmtree(work, ignore_errors=True)
    tree = Tree(work / "tree")
    sources: dict[str, Path] = {}
    for script in pyenv.install_wheel(wheel, layout):
        tree.data(script.path, script.data, script.mode)
        sources[script.path] = tree.staging / script.path.lstrip("/")
    compiled, _invalid = pyenv.compile_sources(sources, work / "pyc", layout)
    for target, pyc in compiled.items():
        tree.file(target, pyc)
    shadow_gid = _gid_of(base, "shadow")
    for name, text in account_files(base, spec.accounts).items():
        secret = name in ("shadow", "gshadow")
        tree.data(f"/etc/{name}", text.encode(), 0o640 if secret else 0o644, 0, shadow_gid if secret else 0)
    for d in spec.directories:
        tree.directory(d.path, 0o755, d.uid, d.gid)
    layer = tree.write(path)
    shutil.rmtree(work)
    stats = {
        "layer_file_bytes": tree.file_bytes,
        "pyc_files": len(compiled),
        "seconds": round(time.monotonic() - start, 1),
    }
    Path(f"{path}.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    _prune(path.parent, f"{image.name}-app-", keep=path)
    log(f"{image.name}: app layer {layer.digest[7:19]}: {layer.size >> 10} KiB in {stats['seconds']:.1f} s")
    return layer, stats


def _gid_of(base: Base, group: str) -> int:
    for line in base.info["etc"]["group"].splitlines():
        fields = line.split(":")
        if fields[0] == group:
            return int(fields[2])
    return 0


# ---- images ---------------------------------------------------------------------------------------


def config_of(
    image: ImageDef, spec: dockerfile.FinalStage, layers: list[oci.Layer], tag: str, base: Base
) -> dict[str, Any]:
    labels = {
        "org.opencontainers.image.title": image.name,
        "org.opencontainers.image.version": tag,
        "org.opencontainers.image.description": image.description,
        "org.opencontainers.image.base.name": f"debian:{base.info['suite']} (debootstrap minbase)",
    }
    if image.flavour:
        labels["ai.sovereign.image.flavour"] = image.flavour
    return oci.image_config(
        layers,
        env=spec.env,
        entrypoint=spec.entrypoint,
        cmd=spec.cmd,
        user=spec.user,
        workdir=spec.workdir,
        exposed_ports=spec.exposed_ports,
        labels=labels,
    )


def build(names: list[str], repo: str, tag: str, cache: Path, host_python: Path) -> dict[str, Any]:
    started = time.monotonic()
    manifest_path = cache / "images.json"
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest.setdefault("images", {})
    base = ensure_base(cache)
    if ".".join(base.info["python_version"].split(".")[:2]) != ".".join(map(str, sys.version_info[:2])):
        raise BuildError(
            f"the virtualenv runs Python {sys.version_info.major}.{sys.version_info.minor} but the image's "
            f"Debian Python is {base.info['python_version']}: its wheels would not load (recreate .venv with python3.11)"
        )
    source_key = sources_key()
    specs = {name: dockerfile.final_stage(REPO / IMAGES[name].dockerfile) for name in names}
    app_paths = {name: _app_layer_path(IMAGES[name], specs[name], base, cache, source_key) for name in names}
    requirements_path = cache / "layers" / f"requirements-{source_key[:16]}.json"
    with tempfile.TemporaryDirectory(prefix="sovereign-wheel-") as wheel_dir:
        wheel: Path | None = None
        if not requirements_path.is_file() or any(_cached(p) is None for p in app_paths.values()):
            step = time.monotonic()
            wheel = build_wheel(host_python, Path(wheel_dir))
            log(f"project wheel {wheel.name} in {time.monotonic() - step:.1f} s")
            requirements_path.parent.mkdir(parents=True, exist_ok=True)
            for old in requirements_path.parent.glob("requirements-*.json"):
                old.unlink()
            requirements_path.write_text(json.dumps(pyenv.wheel_requirements(wheel)))
        requirements = json.loads(requirements_path.read_text())
        for name in names:
            image, spec = IMAGES[name], specs[name]
            step = time.monotonic()
            deps, deps_stats = python_layer(image, requirements, base, cache, host_python)
            app, app_stats = app_layer(image, spec, wheel, base, app_paths[name])
            layers = [base.layer, deps, app]
            config = config_of(image, spec, layers, tag, base)
            ref = f"{repo}/{image.name}:{tag}"
            archive = cache / f"{image.name}.tar"
            inputs = _sha(ref, config, [layer.digest for layer in layers])
            previous = manifest["images"].get(name, {})
            archive_start = time.monotonic()
            if archive.is_file() and previous.get("inputs") == inputs:
                digest = previous["manifest_digest"]
                log(f"{image.name}: archive unchanged ({digest[7:19]})")
            else:
                digest = oci.write_image_archive(archive, ref, layers, config)
                log(
                    f"{image.name}: {ref} -> {archive} ({archive.stat().st_size >> 20} MiB) "
                    f"in {time.monotonic() - archive_start:.0f} s"
                )
            # The archive holds the big python layer now: keep it once on disk (_cached finds it there).
            if deps.path != archive and oci.blob_in_archive(archive, deps.digest) is not None:
                deps.path.unlink()
            manifest["images"][name] = {
                "ref": ref,
                "archive": str(archive),
                "archive_bytes": archive.stat().st_size,
                "manifest_digest": digest,
                "inputs": inputs,
                "flavour": image.flavour,
                "dockerfile": image.dockerfile,
                "file_bytes": base.info["file_bytes"]
                + deps_stats["layer_file_bytes"]
                + app_stats["layer_file_bytes"],
                "layers": [
                    {"role": role, "digest": layer.digest, "size": layer.size}
                    for role, layer in zip(("base", "python", "app"), layers, strict=True)
                ],
                "python": deps_stats,
                "replaced_run_steps": sorted(set(spec.replaced)),
                "seconds": round(time.monotonic() - step, 1),
            }
    manifest["base"] = {k: v for k, v in base.info.items() if k not in ("etc", "system_libraries")}
    manifest["base"]["digest"] = base.layer.digest
    manifest["base"]["size"] = base.layer.size
    manifest["seconds"] = round(time.monotonic() - started, 1)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the runtime and operator images (no registry, no Docker)."
    )
    parser.add_argument("--image", action="append", choices=sorted(IMAGES), help="default: both")
    parser.add_argument("--repo", default=os.environ.get("IMAGE_REPO") or DEFAULT_REPO)
    parser.add_argument(
        "--tag", default=os.environ.get("IMAGE_TAG") or None, help="default: the package version"
    )
    parser.add_argument("--cache", type=Path, default=REPO / ".cache" / "images")
    args = parser.parse_args(argv)
    tag = args.tag or tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    host_python = Path(sys.executable)
    try:
        with _locked(args.cache):
            manifest = build(args.image or ["runtime", "operator"], args.repo, tag, args.cache, host_python)
    except (
        BuildError,
        rootfs.BaseError,
        pyenv.ClosureError,
        dockerfile.DockerfileError,
        elf.ElfError,
    ) as err:
        print(f"images: {err}", file=sys.stderr)
        return 1
    log(f"done in {manifest['seconds']:.0f} s; manifest {args.cache / 'images.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
