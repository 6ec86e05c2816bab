#!/usr/bin/env python3
"""Run an image archive the way a kubelet would, without a kubelet: unpack it, run it with runc.

The archive's layers are unpacked in order into a root filesystem (cached by the manifest digest),
and ``runc`` (Debian's package) runs a container from it with what a pod's spec asks for: command
and args with Kubernetes' semantics over the image's entrypoint and command, the image's env plus the
pod's, ``runAsUser``/``runAsGroup``, a read-only root, tmpfs at the emptyDir paths, all capabilities
dropped, no privilege escalation, and its own pid, ipc, uts, mount and network namespaces (a second
container can join the first one's network, as containers of one pod do). The caller reaches the
container's loopback with ``nsenter --net`` (``in_netns``).

Needs root. Standard library only.

    run_image.py unpack ARCHIVE DEST          # prints the root filesystem path
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# What `runc spec` masks and makes read-only in /proc and /sys (containerd's defaults are the same).
MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/sys/firmware",
    "/proc/scsi",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


class RunError(RuntimeError):
    """The archive cannot be unpacked or the container cannot run; the message says why."""


# ---- unpacking ------------------------------------------------------------------------------------


def _read_member(tar: tarfile.TarFile, name: str) -> bytes:
    member = tar.extractfile(name)
    if member is None:
        raise RunError(f"{name} is not a file in the archive")
    return member.read()


def read_image(archive: Path) -> tuple[str, dict[str, Any], list[str]]:
    """(manifest digest, image config, layer blob names in order) of a one-image OCI archive."""
    with tarfile.open(archive) as tar:
        index = json.loads(_read_member(tar, "index.json"))
        digests = {m["digest"] for m in index["manifests"]}
        if len(digests) != 1:
            raise RunError(f"{archive}: expected one image, found manifests {sorted(digests)}")
        digest = digests.pop()
        manifest = json.loads(_read_member(tar, f"blobs/sha256/{digest.split(':')[1]}"))
        config = json.loads(_read_member(tar, f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"))
        layers = [f"blobs/sha256/{layer['digest'].split(':')[1]}" for layer in manifest["layers"]]
    return digest, config, layers


def _apply_layer(stream: IO[bytes], dest: Path) -> None:
    """Extract one layer tar onto ``dest``, applying OCI whiteouts (``.wh.name``, ``.wh..wh..opq``)."""
    with tarfile.open(fileobj=stream, mode="r|") as layer:
        for member in layer:
            parent, _, base = member.name.rpartition("/")
            if base == ".wh..wh..opq":
                directory = dest / parent
                for child in directory.iterdir() if directory.is_dir() else []:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                continue
            if base.startswith(".wh."):
                victim = dest / parent / base[4:]
                if victim.is_dir() and not victim.is_symlink():
                    shutil.rmtree(victim)
                elif victim.exists() or victim.is_symlink():
                    victim.unlink()
                continue
            target = dest / member.name
            if (target.is_symlink() or target.exists()) and not (member.isdir() and target.is_dir()):
                shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
            # Our own archives: owners, modes and links are extracted as recorded (we run as root).
            layer.extract(member, dest, set_attrs=True, numeric_owner=True, filter="fully_trusted")


def unpack(archive: Path, cache: Path) -> tuple[Path, dict[str, Any]]:
    """The image's root filesystem under ``cache/<manifest digest>/rootfs`` (unpacked once) and its
    config. Other images' root filesystems in ``cache`` are removed (one is kept per archive name)."""
    digest, config, layers = read_image(archive)
    home = cache / digest.split(":")[1][:16]
    rootfs = home / "rootfs"
    done = home / ".unpacked"
    if done.is_file():
        return rootfs, config
    for old in cache.glob("*/.archive"):
        if old.read_text() == archive.name:
            shutil.rmtree(old.parent)
    shutil.rmtree(home, ignore_errors=True)
    rootfs.mkdir(parents=True)
    (home / ".archive").write_text(archive.name)
    with tarfile.open(archive) as tar:
        for name in layers:
            blob = tar.extractfile(name)
            if blob is None:
                raise RunError(f"{archive}: layer {name} missing")
            _apply_layer(blob, rootfs)
    done.write_text(digest)
    return rootfs, config


# ---- the container's spec -------------------------------------------------------------------------


@dataclass
class PodContainer:
    """The parts of a Kubernetes container (and its pod) that decide how the image runs."""

    command: list[str] | None = None
    args: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    run_as_user: int | None = None
    run_as_group: int | None = None
    fs_group: int | None = None
    run_as_non_root: bool = False
    read_only_root: bool = True
    empty_dirs: list[str] = field(default_factory=list)  # mount paths of emptyDir volumes
    hostname: str = "pod"


def container_from_pod(
    pod_spec: dict[str, Any],
    name: str,
    config_maps: dict[str, dict[str, str]],
    field_values: dict[str, str],
) -> PodContainer:
    """The container ``name`` of a rendered pod spec as this module runs it: env from ``envFrom``
    ConfigMaps then ``env`` (downward-API fields from ``field_values``), the pod's and container's
    security context, and its emptyDir mounts. What this module cannot provide (other volume kinds,
    Secrets) is an error."""
    (spec,) = [c for c in pod_spec.get("containers", []) if c["name"] == name]
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref is None:
            raise RunError(f"container {name}: envFrom {source} is not supported here")
        for key, value in config_maps[ref["name"]].items():
            env[source.get("prefix", "") + key] = value
    for item in spec.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = field_values[item["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = config_maps[ref["name"]][ref["key"]]
        else:
            raise RunError(
                f"container {name}: env {item['name']} from {item.get('valueFrom')} is not supported here"
            )
    pod_sc = pod_spec.get("securityContext", {})
    sc = spec.get("securityContext", {})
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    empty_dirs = []
    for mount in spec.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "emptyDir" not in volume:
            raise RunError(
                f"container {name}: volume {mount['name']} is not an emptyDir (not supported here)"
            )
        empty_dirs.append(mount["mountPath"])
    return PodContainer(
        command=spec.get("command"),
        args=spec.get("args"),
        env=env,
        run_as_user=uid,
        run_as_group=sc.get("runAsGroup", pod_sc.get("runAsGroup")),
        fs_group=pod_sc.get("fsGroup"),
        run_as_non_root=bool(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot", False))),
        read_only_root=bool(sc.get("readOnlyRootFilesystem", False)),
        empty_dirs=empty_dirs,
    )


def process_args(
    image_config: dict[str, Any], command: list[str] | None, args: list[str] | None
) -> list[str]:
    """Kubernetes' rule: ``command`` replaces the entrypoint (and drops the image's CMD), ``args``
    replaces the CMD."""
    config = image_config.get("config", {})
    entrypoint = command if command is not None else config.get("Entrypoint") or []
    if args is not None:
        rest = args
    elif command is not None:
        rest = []
    else:
        rest = config.get("Cmd") or []
    full = [*entrypoint, *rest]
    if not full:
        raise RunError("neither the image nor the container names a command")
    return full


def _user(image_config: dict[str, Any], container: PodContainer) -> tuple[int, int]:
    user, _, group = (image_config.get("config", {}).get("User") or "0").partition(":")
    if not user.isdigit() or (group and not group.isdigit()):
        raise RunError(f"image user {user!r}:{group!r} is not numeric (runAsNonRoot cannot verify it)")
    uid = container.run_as_user if container.run_as_user is not None else int(user)
    gid = container.run_as_group if container.run_as_group is not None else int(group or 0)
    if container.run_as_non_root and uid == 0:
        raise RunError("runAsNonRoot is set but the container would run as uid 0 (the kubelet refuses it)")
    return uid, gid


def volume_dir(bundle: Path, index: int) -> Path:
    """Where the ``index``-th emptyDir of a container lives on this machine."""
    return bundle / "volumes" / str(index)


def runc_config(
    image_config: dict[str, Any],
    rootfs: Path,
    container: PodContainer,
    bundle: Path,
    net_ns: str | None = None,
) -> dict[str, Any]:
    """An OCI runtime spec for ``container`` on the image: what containerd would hand runc for it.
    The files it names in ``bundle`` (hosts, hostname, emptyDir folders) are made by ``prepare_bundle``."""
    env = dict(e.split("=", 1) for e in image_config.get("config", {}).get("Env", []))
    env.update(container.env)
    uid, gid = _user(image_config, container)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        {
            "destination": "/etc/hosts",
            "type": "bind",
            "source": str(bundle / "hosts"),
            "options": ["rbind", "ro"],
        },
        {
            "destination": "/etc/hostname",
            "type": "bind",
            "source": str(bundle / "hostname"),
            "options": ["rbind", "ro"],
        },
    ]
    if "/dev/shm" not in container.empty_dirs:
        mounts.append(
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            }
        )
    # An emptyDir is a folder the kubelet makes (0777; group fsGroup and setgid when the pod has one)
    # and bind-mounts into the container.
    for i, path in enumerate(container.empty_dirs):
        mounts.append(
            {
                "destination": path,
                "type": "bind",
                "source": str(volume_dir(bundle, i)),
                "options": ["rbind", "rw", "nosuid", "nodev"],
            }
        )
    namespaces: list[dict[str, str]] = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    namespaces.append({"type": "network", "path": net_ns} if net_ns else {"type": "network"})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": process_args(image_config, container.command, container.args),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": image_config.get("config", {}).get("WorkingDir") or "/",
            # securityContext: capabilities.drop [ALL], allowPrivilegeEscalation false.
            "capabilities": {"bounding": [], "effective": [], "permitted": [], "ambient": []},
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs.resolve()), "readonly": container.read_only_root},
        "hostname": container.hostname,
        "mounts": mounts,
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": namespaces,
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
        },
    }


# ---- running --------------------------------------------------------------------------------------


@dataclass
class Container:
    """A running container: its id, runc's state folder, its bundle and its init process's pid."""

    id: str
    state: Path
    bundle: Path
    pid: int
    log: Path

    @property
    def net_ns(self) -> str:
        return f"/proc/{self.pid}/ns/net"

    def runc(
        self, *args: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["runc", "--root", str(self.state), *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            input=input,
        )

    def exec(
        self, argv: Sequence[str], user: str | None = None, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container (as a kubelet runs an exec probe or a preStop hook)."""
        options = ["--user", user] if user else []
        return self.runc("exec", *options, self.id, *argv, check=False, timeout=timeout, input=input)

    def running(self) -> bool:
        state = self.runc("state", self.id, check=False)
        return state.returncode == 0 and json.loads(state.stdout).get("status") == "running"

    def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                return True
            time.sleep(0.2)
        return False

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


def prepare_bundle(bundle: Path, container: PodContainer) -> None:
    """The files a container's spec names: /etc/hosts and /etc/hostname (the kubelet writes both) and
    one folder per emptyDir."""
    (bundle / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{container.hostname}\n")
    (bundle / "hostname").write_text(container.hostname + "\n")
    for i, _path in enumerate(container.empty_dirs):
        folder = volume_dir(bundle, i)
        folder.mkdir(parents=True)
        if container.fs_group is not None:
            os.chown(folder, 0, container.fs_group)
            folder.chmod(0o2777)
        else:
            folder.chmod(0o777)


def require_runc() -> str:
    """runc's path; installs Debian's package when missing (as root, with apt)."""
    found = shutil.which("runc")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RunError("runc is missing and cannot be installed here (needs root and apt-get)")
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "runc"],
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        capture_output=True,
        check=False,
    )
    found = shutil.which("runc")
    if not found:
        raise RunError("apt-get install runc failed")
    return found


@contextmanager
def running(
    image_config: dict[str, Any], rootfs: Path, container: PodContainer, work: Path, net_ns: str | None = None
) -> Iterator[Container]:
    """Start ``container`` detached; on exit kill it and delete it (bundle and state too)."""
    require_runc()
    cid = f"sovereign-{uuid.uuid4().hex[:10]}"
    work = work.resolve()
    bundle = work / cid
    state = work / "runc-state"
    bundle.mkdir(parents=True)
    state.mkdir(parents=True, exist_ok=True)
    prepare_bundle(bundle, container)
    (bundle / "config.json").write_text(
        json.dumps(runc_config(image_config, rootfs, container, bundle, net_ns), indent=1)
    )
    log = bundle / "output.log"
    with log.open("wb") as out:
        started = subprocess.run(
            ["runc", "--root", str(state), "run", "--detach", "--bundle", str(bundle), cid],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            check=False,
            timeout=120,
        )
    if started.returncode != 0:
        text = log.read_text(errors="replace")
        shutil.rmtree(bundle, ignore_errors=True)
        raise RunError(f"runc run failed ({started.returncode}): {text[-2000:]}")
    info = json.loads(
        subprocess.run(
            ["runc", "--root", str(state), "state", cid], capture_output=True, text=True, check=True
        ).stdout
    )
    handle = Container(id=cid, state=state, bundle=bundle, pid=int(info["pid"]), log=log)
    try:
        yield handle
    finally:
        handle.runc("kill", cid, "KILL", check=False)
        handle.wait_exit(10)
        handle.runc("delete", "--force", cid, check=False)
        # The log stays readable for the caller's error messages until the bundle goes.
        shutil.rmtree(bundle, ignore_errors=True)


def run_once(
    image_config: dict[str, Any], rootfs: Path, container: PodContainer, work: Path, timeout: float = 120
) -> tuple[int, str]:
    """Run ``container`` to completion; its exit status and output (stdout and stderr together)."""
    require_runc()
    cid = f"sovereign-{uuid.uuid4().hex[:10]}"
    work = work.resolve()
    bundle = work / cid
    state = work / "runc-state"
    bundle.mkdir(parents=True)
    state.mkdir(parents=True, exist_ok=True)
    try:
        prepare_bundle(bundle, container)
        (bundle / "config.json").write_text(json.dumps(runc_config(image_config, rootfs, container, bundle)))
        result = subprocess.run(
            ["runc", "--root", str(state), "run", "--bundle", str(bundle), cid],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
            timeout=timeout,
        )
        return result.returncode, result.stdout
    finally:
        subprocess.run(
            ["runc", "--root", str(state), "delete", "--force", cid], capture_output=True, check=False
        )
        shutil.rmtree(bundle, ignore_errors=True)


def in_netns(
    pid: int, argv: Sequence[str], timeout: float = 120, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a program of this machine) in the network namespace of process ``pid``."""
    return subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "--", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        input=input,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "unpack":
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    rootfs, _config = unpack(Path(args[1]), Path(args[2]))
    print(rootfs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
