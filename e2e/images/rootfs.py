"""The images' base root filesystem, from Debian's packages (debootstrap), with no registry involved.

Debian bookworm from the machine's own apt mirror (``/etc/apt/sources.list.d/``), variant minbase,
plus what the runtime and the operator need at run time and what ``python:3.11-slim-bookworm``
(the operator Dockerfile's base) installs: Python 3.11 (the ABI of the project's ``cp311`` wheels),
CA certificates, netbase and tzdata. No compiler. Security updates from the same sources are applied,
then what a container never reads (apt lists and caches, documentation except copyright files, man
pages, message catalogues, logs, the build machine's hostname) is removed, and the standard library's
bytecode is compiled again with unchecked-hash invalidation (layer entries carry a fixed mtime, so
Debian's timestamp-based ``.pyc`` files would never match on a read-only root).

Needs root (debootstrap and chroot); runs niced from build.sh. Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SUITE = "bookworm"
# Beyond minbase: the interpreter, TLS roots, /etc/services and time zones (what python:*-slim adds).
PACKAGES = ("python3.11", "python3", "ca-certificates", "netbase", "tzdata")
LIBRARY_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib")
# Removed after installation: nothing in a container reads them.
REMOVED = (
    "var/lib/apt/lists",
    "var/cache/apt",
    "var/cache/debconf/config.dat-old",
    "var/cache/debconf/templates.dat-old",
    "var/lib/dpkg/status-old",
    "var/lib/dpkg/diversions-old",
    "usr/share/man",
    "usr/share/info",
    "usr/share/lintian",
    "usr/share/linda",
    "etc/hostname",
    "etc/resolv.conf",
)


class BaseError(RuntimeError):
    """The base root filesystem cannot be built here; the message says why and what to do."""


def debian_sources(apt_dir: Path = Path("/etc/apt")) -> list[dict[str, str]]:
    """The machine's Debian apt sources as deb822 stanzas (Types, URIs, Suites, Components, ...),
    one-line ``sources.list`` entries converted; only stanzas for this suite's family are kept."""
    stanzas: list[dict[str, str]] = []
    for path in sorted((apt_dir / "sources.list.d").glob("*.sources")):
        stanzas += parse_deb822(path.read_text())
    one_line = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]
    for path in one_line:
        if path.is_file():
            stanzas += parse_one_line(path.read_text())
    return [s for s in stanzas if "deb" in s.get("Types", "").split() and _is_debian(s)]


# Debian's archive areas: a third-party repository for the same suite (Docker's `bookworm stable`)
# names other components and stays out of the image.
DEBIAN_COMPONENTS = frozenset({"main", "contrib", "non-free", "non-free-firmware"})


def _is_debian(stanza: dict[str, str]) -> bool:
    suites = stanza.get("Suites", "").split()
    components = set(stanza.get("Components", "").split())
    return (
        any(s == SUITE or s.startswith(f"{SUITE}-") for s in suites)
        and bool(components)
        and components <= DEBIAN_COMPONENTS
    )


def parse_deb822(text: str) -> list[dict[str, str]]:
    """Stanzas of a ``.sources`` file (comments dropped, continuation lines joined)."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = ""
    for raw in [*text.splitlines(), ""]:
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current and current.get("Enabled", "yes").lower() != "no":
                stanzas.append(current)
            current, key = {}, ""
            continue
        if raw[0] in " \t" and key:
            current[key] += "\n" + raw.strip()
            continue
        key, _, value = raw.partition(":")
        key = key.strip()
        current[key] = value.strip()
    return stanzas


def parse_one_line(text: str) -> list[dict[str, str]]:
    """``deb [options] URI suite component...`` lines as deb822 stanzas."""
    stanzas = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        kind, rest = words[0], words[1:]
        options: dict[str, str] = {}
        if rest and rest[0].startswith("["):
            opts = []
            while rest:
                word = rest.pop(0)
                opts.append(word.strip("[]"))
                if word.endswith("]"):
                    break
            for opt in opts:
                name, _, value = opt.partition("=")
                if name == "signed-by":
                    options["Signed-By"] = value
        if len(rest) < 2:
            continue
        stanza = {"Types": kind, "URIs": rest[0], "Suites": rest[1], "Components": " ".join(rest[2:])}
        stanzas.append({**stanza, **options})
    return stanzas


def main_mirror(stanzas: list[dict[str, str]]) -> str:
    """The URI serving the suite itself (not -security/-updates): debootstrap's mirror."""
    for stanza in stanzas:
        if SUITE in stanza.get("Suites", "").split():
            return stanza["URIs"].split()[0]
    raise BaseError(
        f"no apt source for Debian {SUITE} in /etc/apt/sources.list(.d): the base root filesystem "
        "is built from this machine's Debian mirror"
    )


def render_deb822(stanzas: list[dict[str, str]]) -> str:
    return "\n".join("".join(f"{k}: {v}\n" for k, v in s.items()) for s in stanzas)


def _run(args: list[str], log: Path) -> None:
    with log.open("ab") as out:
        result = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BaseError(
            f"{' '.join(args[:4])} ... failed ({result.returncode}); last lines of {log}:\n" + "\n".join(tail)
        )


@contextmanager
def _mounted_proc(rootfs: Path) -> Iterator[None]:
    target = rootfs / "proc"
    target.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "proc", "proc", str(target)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def ensure_debootstrap() -> None:
    """Install Debian's debootstrap package when it is missing (as root, with apt)."""
    if shutil.which("debootstrap") is not None:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BaseError("debootstrap is missing and cannot be installed here (needs root and apt-get)")
    print("images: installing debootstrap (Debian package)", flush=True)
    result = subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "debootstrap"],
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0 or shutil.which("debootstrap") is None:
        raise BaseError(
            f"apt-get install debootstrap failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )


def build(rootfs: Path, log: Path, stanzas: list[dict[str, str]]) -> None:
    """debootstrap into ``rootfs`` (which must not exist), update, slim down, compile bytecode."""
    if os.geteuid() != 0:
        raise BaseError("debootstrap and chroot need root: run the image build as root")
    ensure_debootstrap()
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(rootfs),
            main_mirror(stanzas),
        ],
        log,
    )
    sources = rootfs / "etc/apt/sources.list.d/debian.sources"
    (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
    sources.write_text(render_deb822(stanzas))
    shutil.copyfile("/etc/resolv.conf", rootfs / "etc/resolv.conf")
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    with _mounted_proc(rootfs):
        for args in (
            ["apt-get", "-q", "update"],
            ["apt-get", "-q", "-y", "--no-install-recommends", "upgrade"],
        ):
            _run(["chroot", str(rootfs), "env", *[f"{k}={v}" for k, v in env.items()], *args], log)
        _run(["chroot", str(rootfs), "apt-get", "clean"], log)
    slim(rootfs)
    # Bytecode of the standard library, valid whatever the files' mtimes (see the module docstring).
    _run(
        [
            "chroot",
            str(rootfs),
            "python3",
            "-m",
            "compileall",
            "-q",
            "-f",
            "-j",
            "2",
            "--invalidation-mode",
            "unchecked-hash",
            "/usr/lib/python3.11",
            "/usr/lib/python3/dist-packages",
        ],
        log,
    )


def slim(rootfs: Path) -> None:
    """Remove what a container never reads (see REMOVED); keep each package's copyright file."""
    for rel in REMOVED:
        path = rootfs / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            if rel.startswith("var/"):
                path.mkdir(parents=True)  # apt expects the directories to exist
        else:
            path.unlink(missing_ok=True)
    (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    doc = rootfs / "usr/share/doc"
    for path in sorted(doc.rglob("*"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.name != "copyright":
            path.unlink()
    locale = rootfs / "usr/share/locale"
    for path in locale.iterdir() if locale.is_dir() else []:
        if path.name != "locale.alias":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for log in (rootfs / "var/log").rglob("*"):
        if log.is_file():
            log.unlink()


def python_version(rootfs: Path) -> str:
    """The base's Python version (``3.11.2``), asked of its own interpreter."""
    out = subprocess.run(
        ["chroot", str(rootfs), "python3", "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def packages(rootfs: Path) -> dict[str, str]:
    """Installed Debian packages and their versions, from dpkg's status file."""
    found: dict[str, str] = {}
    text = (rootfs / "var/lib/dpkg/status").read_text()
    for block in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", block, flags=re.M))
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            found[fields["Package"]] = fields.get("Version", "")
    return dict(sorted(found.items()))


def system_libraries(rootfs: Path) -> set[str]:
    """File names in the base's library directories: what the dynamic loader finds by name."""
    names: set[str] = set()
    for rel in LIBRARY_DIRS:
        directory = rootfs / rel
        if directory.is_dir():
            names.update(p.name for p in directory.iterdir() if ".so" in p.name)
    return names
