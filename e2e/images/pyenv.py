"""The image's Python environment, assembled from the project's virtualenv without downloading anything.

The runtime image needs the distributions of ``sovereign[runtime]`` and the operator image those of
``sovereign``. Both are already installed in ``.venv``, so nothing is fetched again: the dependency
closure is computed from the installed distributions' metadata (requirements with their markers
evaluated for the image's interpreter, extras followed), each distribution's files are taken by its
``RECORD`` into ``/opt/venv`` of the image, console scripts get the image's interpreter in their
``#!`` line, and the project itself is installed from a wheel built from the working tree.

Bytecode is compiled at build time with unchecked-hash invalidation: the image's root filesystem is
read-only at run time and layer entries carry a fixed mtime, so timestamp-based ``.pyc`` files would
never match and every start would compile everything again in memory.

Needs ``packaging`` (in the project's virtualenv).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import posixpath
import py_compile
import zipfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

VENV = "/opt/venv"


class ClosureError(ValueError):
    """The virtualenv cannot provide what the image needs; the message names the distribution."""


@dataclass(frozen=True)
class Layout:
    """Where the image's virtualenv lives and which interpreter it runs."""

    python_version: str  # "3.11.2", the image's interpreter
    root: str = VENV

    @property
    def python(self) -> str:
        return "python" + ".".join(self.python_version.split(".")[:2])

    @property
    def site(self) -> str:
        return f"{self.root}/lib/{self.python}/site-packages"

    @property
    def bin(self) -> str:
        return f"{self.root}/bin"


def marker_environment(python_version: str) -> dict[str, str]:
    """Marker values for the image: this machine's platform (linux x86-64) and the image's Python."""
    env = dict(default_environment())
    env["python_full_version"] = python_version
    env["python_version"] = ".".join(python_version.split(".")[:2])
    env["implementation_version"] = python_version
    return env


def installed(site_packages: Path) -> dict[str, Distribution]:
    """The distributions installed in ``site_packages``, by canonical name."""
    found: dict[str, Distribution] = {}
    for dist in distributions(path=[str(site_packages)]):
        name = canonicalize_name(dist.metadata["Name"])
        found.setdefault(name, dist)
    return found


@dataclass
class Closure:
    """Distributions an image needs, each with the extras asked of it and who asked first."""

    dists: dict[str, Distribution] = field(default_factory=dict)
    extras: dict[str, set[str]] = field(default_factory=dict)
    required_by: dict[str, str] = field(default_factory=dict)


def resolve(
    requirements: Iterable[str],
    available: Mapping[str, Distribution],
    environment: Mapping[str, str],
    *,
    root: str = "the image",
    extras: Iterable[str] = (),
) -> Closure:
    """The closure of ``requirements`` (a project's ``Requires-Dist``, asked with ``extras``) over
    the installed distributions ``available``.

    A requirement whose marker is false for ``environment`` is skipped; a needed distribution that
    is missing or installed at a version outside its specifier is an error naming who needs it.
    """
    closure = Closure()
    queue: list[tuple[Requirement, str]] = []

    def want(text: str, parent: str, extras: Iterable[str]) -> None:
        req = Requirement(text)
        if req.marker is not None and not any(
            req.marker.evaluate({**environment, "extra": e}) for e in extras
        ):
            return
        queue.append((req, parent))

    for text in requirements:
        want(text, root, ["", *extras])
    while queue:
        req, parent = queue.pop(0)
        name = canonicalize_name(req.name)
        dist = available.get(name)
        if dist is None:
            raise ClosureError(
                f"{req} (needed by {parent}) is not installed in the virtualenv; run `make venv`"
            )
        if req.specifier and not req.specifier.contains(Version(dist.version), prereleases=True):
            raise ClosureError(
                f"{name} {dist.version} is installed but {parent} needs {req}; run `make venv`"
            )
        known = closure.extras.get(name)
        asked = {canonicalize_name(e) for e in req.extras}
        new = asked if known is None else asked - known
        if known is not None and not new:
            continue
        if known is None:
            closure.dists[name] = dist
            closure.extras[name] = set()
            closure.required_by[name] = parent
        closure.extras[name] |= new
        # The base requirements once, then those of each newly asked extra.
        for text in dist.requires or []:
            want(text, f"{name} {dist.version}", ([""] if known is None else []) + sorted(new))
    return closure


def image_path(layout: Layout, record_path: str) -> str:
    """Where a RECORD entry (relative to site-packages) lands in the image; it must stay in the venv."""
    path = posixpath.normpath(posixpath.join(layout.site, record_path))
    if not (path == layout.root or path.startswith(layout.root + "/")):
        raise ClosureError(f"RECORD entry {record_path!r} would install outside {layout.root}")
    return path


def is_bytecode(record_path: str) -> bool:
    """Compiled files from the build machine: compiled again for the image instead."""
    return record_path.endswith((".pyc", ".pyo")) and "__pycache__" in record_path


@dataclass(frozen=True)
class Script:
    """A file written by the build (console script, wheel member, metadata) rather than copied."""

    path: str  # in the image
    data: bytes
    mode: int = 0o644


def dist_files(dist: Distribution, layout: Layout, host_python: Path) -> tuple[dict[str, Path], list[Script]]:
    """A distribution's files by its RECORD: image path -> source on this machine, and the console
    scripts whose ``#!`` line named this machine's interpreter, rewritten for the image."""
    if dist.files is None:
        raise ClosureError(f"{dist.metadata['Name']} has no RECORD; reinstall it with pip")
    copied: dict[str, Path] = {}
    scripts: list[Script] = []
    for record in dist.files:
        rel = str(record)
        if is_bytecode(rel):
            continue
        source = Path(str(dist.locate_file(record)))
        if not source.exists() and not source.is_symlink():
            raise ClosureError(f"{dist.metadata['Name']}: {rel} is in its RECORD but not on disk")
        target = image_path(layout, rel)
        if target.startswith(layout.bin + "/"):
            rewritten = rewrite_shebang(source.read_bytes(), host_python, f"{layout.bin}/python")
            if rewritten is not None:
                scripts.append(Script(target, rewritten, 0o755))
                continue
        copied[target] = source
    return copied, scripts


def rewrite_shebang(data: bytes, host_python: Path, python: str) -> bytes | None:
    """``data`` with a ``#!`` naming ``host_python``'s virtualenv replaced by ``python``; None when
    the file does not start with such a line (binaries, scripts for other interpreters)."""
    if not data.startswith(b"#!"):
        return None
    host_bin = str(host_python.parent).encode()
    lines = data.split(b"\n")
    first = lines[0]
    if first.startswith(b"#!" + host_bin + b"/"):
        return b"\n".join([b"#!" + python.encode(), *lines[1:]])
    # pip's form for long interpreter paths: a /bin/sh preamble that execs the interpreter.
    if first.strip() == b"#!/bin/sh" and len(lines) > 2 and host_bin in lines[1] and lines[2] == b"' '''":
        return b"\n".join([b"#!" + python.encode(), *lines[3:]])
    if host_bin in first:
        raise ClosureError(f"unrecognised interpreter line {first!r}")
    return None


def console_script(target: str, python: str) -> bytes:
    """A launcher for the entry point ``module:attr`` (what pip writes, without its Windows parts)."""
    module, _, attr = target.partition(":")
    call = attr.strip() or "main"
    return (
        f"#!{python}\n"
        "import sys\n"
        f"from {module.strip()} import {call.split('.')[0]}\n"
        "if __name__ == '__main__':\n"
        f"    sys.exit({call}())\n"
    ).encode()


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def install_wheel(wheel: Path, layout: Layout) -> list[Script]:
    """The files installing ``wheel`` into the image's venv writes: its members under site-packages
    (``.data/scripts`` into bin), launchers for its console scripts, INSTALLER and a new RECORD."""
    out: list[Script] = []
    record_rows: list[list[str]] = []
    dist_info = ""
    with zipfile.ZipFile(wheel) as zf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            name = info.filename
            data = zf.read(info)
            top = name.split("/", 1)[0]
            if top.endswith(".dist-info"):
                dist_info = top
                if name == f"{top}/RECORD":
                    continue
            if top.endswith(".data"):
                kind, _, rest = name.split("/", 1)[1].partition("/")
                if kind == "scripts":
                    target = f"{layout.bin}/{rest}"
                elif kind in ("purelib", "platlib"):
                    target = f"{layout.site}/{rest}"
                else:
                    raise ClosureError(f"{wheel.name}: unsupported wheel data directory {kind!r}")
            else:
                target = f"{layout.site}/{name}"
            mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
            out.append(Script(target, data, mode))
        if not dist_info:
            raise ClosureError(f"{wheel.name}: no .dist-info directory")
        entry_points = (
            zf.read(f"{dist_info}/entry_points.txt").decode()
            if f"{dist_info}/entry_points.txt" in zf.namelist()
            else ""
        )
    for name, target in _console_scripts(entry_points):
        out.append(Script(f"{layout.bin}/{name}", console_script(target, f"{layout.bin}/python"), 0o755))
    out.append(Script(f"{layout.site}/{dist_info}/INSTALLER", b"sovereign-image-build\n"))
    for script in out:
        rel = posixpath.relpath(script.path, layout.site)
        record_rows.append([rel, _record_hash(script.data), str(len(script.data))])
    record_rows.append([f"{dist_info}/RECORD", "", ""])
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(sorted(record_rows))
    out.append(Script(f"{layout.site}/{dist_info}/RECORD", buffer.getvalue().encode()))
    return out


def _console_scripts(entry_points: str) -> list[tuple[str, str]]:
    section = ""
    found = []
    for raw in entry_points.splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#") and section == "console_scripts" and "=" in line:
            name, _, target = line.partition("=")
            found.append((name.strip(), target.strip()))
    return found


def wheel_requirements(wheel: Path) -> list[str]:
    """``Requires-Dist`` of a wheel's METADATA (the project's dependencies as built)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def venv_skeleton(layout: Layout, base_python: str = "/usr/bin") -> list[Script]:
    """``pyvenv.cfg`` of a venv made with the image's own interpreter (no pip: nothing installs at
    run time). The interpreter links are symlinks, written by the layer builder."""
    cfg = (
        f"home = {base_python}\n"
        "include-system-site-packages = false\n"
        f"version = {layout.python_version}\n"
        f"executable = {base_python}/{layout.python}\n"
        f"command = {base_python}/{layout.python} -m venv --without-pip {layout.root}\n"
    )
    return [Script(f"{layout.root}/pyvenv.cfg", cfg.encode())]


def venv_links(layout: Layout, base_python: str = "/usr/bin") -> dict[str, str]:
    """Symlinks of the venv: its interpreters and ``lib64``, as ``python3.11 -m venv`` makes them."""
    return {
        f"{layout.bin}/python": f"{base_python}/{layout.python}",
        f"{layout.bin}/python3": "python",
        f"{layout.bin}/{layout.python}": "python",
        f"{layout.root}/lib64": "lib",
    }


def _compile_one(job: tuple[str, str, str]) -> str | None:
    source, cfile, dfile = job
    os.makedirs(os.path.dirname(cfile), exist_ok=True)
    try:
        py_compile.compile(
            source,
            cfile=cfile,
            dfile=dfile,
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
    except py_compile.PyCompileError:
        return dfile  # not valid Python 3.11 (templates, test data): never importable, so no .pyc
    return None


def pyc_name(image_source: str, python: str) -> str:
    """The ``__pycache__`` path CPython looks for beside ``image_source``."""
    directory, name = posixpath.split(image_source)
    tag = "cpython-" + python.removeprefix("python").replace(".", "")
    return f"{directory}/__pycache__/{name[:-3]}.{tag}.pyc"


def compile_sources(
    sources: Mapping[str, Path], out: Path, layout: Layout, workers: int = 2
) -> tuple[dict[str, Path], list[str]]:
    """Compile every ``.py`` of ``sources`` (image path -> file) into ``out``; returns the ``.pyc``
    files by image path and the sources that are not valid Python (left without bytecode)."""
    jobs = []
    for image_source, source in sorted(sources.items()):
        if not image_source.endswith(".py"):
            continue
        target = pyc_name(image_source, layout.python)
        jobs.append((str(source), str(out / target.lstrip("/")), image_source))
    failed: list[str] = []
    if jobs:
        with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
            failed = [r for r in pool.map(_compile_one, jobs, chunksize=64) if r is not None]
    bad = set(failed)
    compiled = {pyc_name(d, layout.python): Path(c) for _s, c, d in jobs if d not in bad}
    return compiled, sorted(bad)
