"""What the CPU runtime image keeps of the virtualenv, and what serving the built-in model loads.

Peer: the same runtime served from the project's ``.venv`` (PyPI's CUDA torch with every CUDA
library and triton), on this machine, in the same run. Subject: the image built by
``e2e/images/build.sh`` (CPU flavour, e2e/images/lean.py), run with runc as the rendered tiny pod
(``e2e/images/run_image.py``). Rounds alternate between the two; each round starts a fresh server
and measures, once ``/health/ready`` is 200: the seconds from process start, the files under the
virtualenv's site-packages that the process maps (/proc/PID/maps), their size, and VmRSS.

    sudo .venv/bin/python bench/image_footprint.py [--rounds 3]   # after e2e/images/build.sh
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "e2e" / "images"))

import run_image  # noqa: E402

CACHE = REPO / ".cache" / "images"
SITE_HOST = Path(sysconfig.get_paths()["purelib"]).resolve()
SITE_IMAGE = "/opt/venv/lib/python3.11/site-packages"
POLL = r"""
import sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.05)
sys.exit(1)
"""


@dataclass
class Sample:
    ready_s: float
    mapped_files: int
    mapped_bytes: int
    rss_mib: float
    mapped: set[str]


def _mapped(pid: int, site: str) -> set[str]:
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(site + "/"):
            paths.add(fields[5][len(site) + 1 :])
    return paths


def _sample(pid: int, started: float, site: str, files_root: Path) -> Sample:
    ready = time.monotonic() - started
    mapped = _mapped(pid, site)
    size = sum((files_root / p).stat().st_size for p in mapped)
    rss = next(
        int(x.split()[1])
        for x in Path(f"/proc/{pid}/status").read_text().splitlines()
        if x.startswith("VmRSS")
    )
    return Sample(ready, len(mapped), size, rss / 1024, mapped)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def venv_round() -> Sample:
    port = _free_port()
    started = time.monotonic()
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "sovereign-runtime"),
            "serve",
            "--model",
            "builtin:sovereign-tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        subprocess.run([sys.executable, "-c", POLL, f"http://127.0.0.1:{port}/health/ready"], check=True)
        return _sample(server.pid, started, str(SITE_HOST), SITE_HOST)
    finally:
        server.terminate()
        server.wait(30)


def image_round(rootfs: Path, config: dict, container: run_image.PodContainer) -> Sample:
    started = time.monotonic()
    with run_image.running(config, rootfs, container, CACHE / "bench-runs") as running:
        out = run_image.in_netns(
            running.pid, [sys.executable, "-c", POLL, "http://127.0.0.1:8000/health/ready"]
        )
        assert out.returncode == 0, running.output()[-2000:]
        # The server is the container's init process (pid 1 inside, running.pid here).
        return _sample(running.pid, started, SITE_IMAGE, rootfs / SITE_IMAGE.lstrip("/"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("image_footprint.py: needs root (runc)", file=sys.stderr)
        return 2
    manifest = json.loads((CACHE / "images.json").read_text())
    image = manifest["images"]["runtime"]
    rootfs, config = run_image.unpack(Path(image["archive"]), CACHE / "run")
    docs = [
        d
        for d in yaml.safe_load_all(
            subprocess.run(
                [
                    str(Path(sys.executable).parent / "sovereign-operator"),
                    "render",
                    "-f",
                    str(REPO / "examples" / "tiny.yaml"),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        if d
    ]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    fields = {"metadata.name": "tiny-unified-0", "metadata.namespace": "default", "status.podIP": "127.0.0.1"}
    container = run_image.container_from_pod(sts["spec"]["template"]["spec"], "runtime", config_maps, fields)

    venv: list[Sample] = []
    img: list[Sample] = []
    for _ in range(args.rounds):
        venv.append(venv_round())
        img.append(image_round(rootfs, config, container))

    def med(samples: list[Sample], attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in samples)

    python = image["python"]
    print(f"load average at the end: {os.getloadavg()[0]:.1f}; rounds: {args.rounds} (alternating)")
    print("| | .venv (full CUDA torch + triton) | image (CPU flavour) | ratio image/.venv |")
    print("| --- | --- | --- | --- |")
    print(
        f"| site-packages of the runtime closure on disk | {python['closure_bytes'] / 2**30:.2f} GiB | "
        f"{python['kept_bytes'] / 2**30:.2f} GiB | {python['kept_bytes'] / python['closure_bytes']:.2f} |"
    )
    for label, attr, fmt in (
        ("files under site-packages mapped at ready (median)", "mapped_files", "{:.0f}"),
        ("their size (median)", "mapped_bytes", "{:.0f} MiB"),
        ("VmRSS at ready (median)", "rss_mib", "{:.0f} MiB"),
        ("process start to /health/ready (median)", "ready_s", "{:.1f} s"),
    ):
        a, b = med(venv, attr), med(img, attr)
        scale = 2**20 if attr == "mapped_bytes" else 1
        print(f"| {label} | {fmt.format(a / scale)} | {fmt.format(b / scale)} | {b / a:.2f} |")
    only_venv = sorted(set.union(*(s.mapped for s in venv)) - set.union(*(s.mapped for s in img)))
    only_img = sorted(set.union(*(s.mapped for s in img)) - set.union(*(s.mapped for s in venv)))
    print(f"\nmapped from .venv only ({len(only_venv)}): {', '.join(only_venv)}")
    print(f"mapped from the image only ({len(only_img)}): {', '.join(only_img) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
