"""The images built here (e2e/images/build.sh) run as the operator's pods will run them.

Builds the images when they are missing (cached afterwards: a warm build is a no-op), unpacks the
archives and runs them with runc the way a kubelet would run the rendered pods of
``examples/tiny.yaml``: the pod's command, args, env and security context (uid 65532, read-only root,
no capabilities, no privilege escalation) and emptyDirs. Then: the rendered startup and readiness
probe paths pass within the startup budget, the built-in model answers through its OpenAI API and
through the router, the rendered preStop hook (``python3 -c ...``) drains the server and it exits; the
operator image's entrypoint runs and it writes the same CRD as the operator here.

Needs root (debootstrap, chroot and runc); skipped otherwise, with that reason.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from local_images import CACHE, build_local_images
from packaging_helpers import REPO
from sovereign_runtime.builtin.tasks import check_answer, make_questions
from test_images import IMAGES as DOCKERFILES
from test_images import final_stage

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="building and running images needs root (debootstrap, chroot, runc)"
    ),
]

WORK = CACHE / "test-runs"
FIELDS = {"metadata.name": "tiny-unified-0", "metadata.namespace": "default", "status.podIP": "127.0.0.1"}


def images_module(name: str) -> ModuleType:
    directory = str(REPO / "e2e" / "images")
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    """The build's manifest (images.json) after e2e/images/build.sh (a no-op when nothing changed)."""
    return build_local_images()


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    out = subprocess.run(
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
    return [d for d in yaml.safe_load_all(out) if d]


def _unpacked(built: dict[str, Any], name: str) -> tuple[Path, dict[str, Any]]:
    run_image = images_module("run_image")
    return run_image.unpack(Path(built["images"][name]["archive"]), CACHE / "run")


def _pod(rendered: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (workload,) = [d for d in rendered if d["kind"] == kind]
    return workload["spec"]["template"]["spec"]


def _config_maps(rendered: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["data"] for d in rendered if d["kind"] == "ConfigMap"}


# A client run with this machine's Python inside the pod's network namespace (nsenter): the startup
# probe's path until 200 within the budget, then readiness, then one question.
CLIENT = r"""
import json, sys, time, urllib.request, urllib.error
base, startup, ready, budget, model, question = sys.argv[1:7]
def status(path):
    try:
        return urllib.request.urlopen(base + path, timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None
started = time.monotonic()
for path in (startup, ready):
    while status(path) != 200:
        if time.monotonic() - started > float(budget):
            print(json.dumps({"error": f"{path} not 200 after {budget} s"}))
            sys.exit(0)
        time.sleep(0.25)
ready_s = time.monotonic() - started
body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0}
request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=60))
print(json.dumps({"ready_s": ready_s, "content": answer["choices"][0]["message"]["content"]}))
"""


def ask(
    pid: int, port: int, startup: str, ready: str, budget: float, model: str
) -> tuple[dict[str, Any], str]:
    run_image = images_module("run_image")
    (question,) = make_questions(1, seed=7)
    out = run_image.in_netns(
        pid,
        [
            sys.executable,
            "-c",
            CLIENT,
            f"http://127.0.0.1:{port}",
            startup,
            ready,
            str(budget),
            model,
            question.prompt,
        ],
        timeout=budget + 90,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), question.prompt


def _probe_path(container: dict[str, Any], probe: str) -> str:
    return container[probe]["httpGet"]["path"]


def _budget(container: dict[str, Any]) -> float:
    probe = container["startupProbe"]
    return float(probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))


@contextmanager
def _tiny_pod(built: dict[str, Any], rendered: list[dict[str, Any]]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The tiny example's unified pod running from the runtime image as rendered, once it passed
    its startup and readiness probe paths within the startup budget."""
    run_image = images_module("run_image")
    rootfs, config = _unpacked(built, "runtime")
    pod = _pod(rendered, "StatefulSet")
    container = run_image.container_from_pod(pod, "runtime", _config_maps(rendered), FIELDS)
    spec = pod["containers"][0]
    with run_image.running(config, rootfs, container, WORK) as running:
        first, _ = ask(
            running.pid,
            8000,
            _probe_path(spec, "startupProbe"),
            _probe_path(spec, "readinessProbe"),
            _budget(spec),
            "sovereign-tiny",
        )
        assert "error" not in first, first["error"] + "\n" + running.output()[-3000:]
        yield running, pod


@pytest.fixture(scope="module")
def runtime_pod(
    built: dict[str, Any], rendered: list[dict[str, Any]]
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """One serving pod for the tests that leave it running."""
    with _tiny_pod(built, rendered) as pod:
        yield pod


def test_the_image_config_is_the_dockerfiles_final_stage(built: dict[str, Any]) -> None:
    """Checked against test_images' own reading of the Dockerfiles, not the build's parser."""
    dockerfile = images_module("dockerfile")
    for name, file in (("runtime", "runtime.Dockerfile"), ("operator", "operator.Dockerfile")):
        _rootfs, config = _unpacked(built, name)
        steps = final_stage(DOCKERFILES[file])
        got = config["config"]
        (entrypoint,) = [json.loads(r) for w, r in steps if w == "ENTRYPOINT"]
        cmds = [json.loads(r) for w, r in steps if w == "CMD"]
        assert got["Entrypoint"] == entrypoint and got.get("Cmd") == (cmds[-1] if cmds else None)
        assert got["User"] == [r for w, r in steps if w == "USER"][-1]
        assert set(got["ExposedPorts"]) == {f"{r}/tcp" for w, r in steps if w == "EXPOSE"}
        env = dict(e.split("=", 1) for e in got["Env"])
        for word, rest in steps:
            if word == "ENV":
                for pair in shlex.split(rest):
                    key, value = pair.split("=", 1)
                    assert env[key] == value.replace("$PATH", dockerfile.BASE_ENV["PATH"]), key
        workdirs = [r for w, r in steps if w == "WORKDIR"]
        assert got.get("WorkingDir") == (workdirs[-1] if workdirs else None)
    # The names pods render, and a label that says which flavour a node holds.
    assert built["images"]["runtime"]["ref"] == "ghcr.io/sovereign-ai/sovereign-runtime:0.1.0"
    assert built["images"]["operator"]["ref"] == "ghcr.io/sovereign-ai/sovereign-operator:0.1.0"
    _rootfs, runtime = _unpacked(built, "runtime")
    assert runtime["config"]["Labels"]["ai.sovereign.image.flavour"] == "cpu"


def test_the_tiny_pod_serves_from_the_image(runtime_pod: tuple[Any, dict[str, Any]]) -> None:
    running, pod = runtime_pod
    spec = pod["containers"][0]
    startup, ready = _probe_path(spec, "startupProbe"), _probe_path(spec, "readinessProbe")
    result, prompt = ask(running.pid, 8000, startup, ready, _budget(spec), "sovereign-tiny")
    assert "error" not in result, result["error"] + "\n" + running.output()[-3000:]
    assert check_answer(prompt, result["content"]), (prompt, result)

    # Locked down as the pod asks: uid 65532, no capabilities, read-only root.
    status = Path(f"/proc/{running.pid}/status").read_text()
    assert "Uid:\t65532\t65532\t65532\t65532" in status and "CapEff:\t0000000000000000" in status
    assert running.exec(["touch", "/opt/venv/x"]).returncode != 0
    assert running.exec(["python3", "-c", "open('/tmp/x', 'w').write('ok')"]).returncode == 0

    # The CPU flavour: no triton, and none of cuDNN's engine libraries (dlopened on GPUs only).
    probe = running.exec(["python3", "-c", "import importlib.util as u; print(u.find_spec('triton'))"])
    assert probe.stdout.strip() == "None", probe
    maps = Path(f"/proc/{running.pid}/maps").read_text()
    assert "libcudnn_engines" not in maps and "triton" not in maps


def test_the_router_routes_to_the_worker(
    runtime_pod: tuple[Any, dict[str, Any]], built: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    run_image = images_module("run_image")
    running = runtime_pod[0]
    rootfs, config = _unpacked(built, "runtime")
    router_pod = _pod(rendered, "Deployment")
    router = run_image.container_from_pod(router_pod, "router", {}, FIELDS)
    # Workers come from EndpointSlices in a cluster; here the worker is given statically.
    assert router.args is not None and router.args[0] == "router"
    router.args = ["router", "--host", "127.0.0.1", "--port", "8001", "--worker", "http://127.0.0.1:8000"]
    with run_image.running(config, rootfs, router, WORK, net_ns=running.net_ns) as routing:
        health = _probe_path(router_pod["containers"][0], "readinessProbe")
        result, prompt = ask(routing.pid, 8001, health, health, 60, "sovereign-tiny")
        assert "error" not in result, result["error"] + "\n" + routing.output()[-3000:]
        assert check_answer(prompt, result["content"]), (prompt, result)


def test_the_prestop_hook_drains_and_the_server_exits(
    built: dict[str, Any], rendered: list[dict[str, Any]]
) -> None:
    with _tiny_pod(built, rendered) as (running, pod):
        hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[0] == "python3"
        grace = pod["terminationGracePeriodSeconds"]
        started = time.monotonic()
        done = running.exec(hook, timeout=grace)
        assert done.returncode == 0, done.stderr
        assert running.wait_exit(grace - (time.monotonic() - started)), running.output()[-2000:]
        output = running.output()
        assert "drain finished" in output and "in-flight request(s) completed" in output, output[-2000:]
        assert "shutting down" in output, output[-2000:]


def test_the_operator_image_runs_its_entrypoint_and_writes_the_crd(built: dict[str, Any]) -> None:
    run_image = images_module("run_image")
    rootfs, config = _unpacked(built, "operator")
    locked = {"run_as_non_root": True, "read_only_root": True, "empty_dirs": ["/tmp"]}
    # The image's own entrypoint (`sovereign-operator run`) with --help: it resolves and starts.
    rc, out = run_image.run_once(config, rootfs, run_image.PodContainer(args=["--help"], **locked), WORK)
    assert rc == 0 and "usage: sovereign-operator run" in out, out
    check = "import importlib.util as u, kopf, lightkube; assert u.find_spec('torch') is None"
    rc, out = run_image.run_once(
        config, rootfs, run_image.PodContainer(command=["python3", "-c", check], **locked), WORK
    )
    assert rc == 0, f"the operator image has kopf and lightkube, not torch: {out}"
    here = subprocess.run(
        [str(Path(sys.executable).parent / "sovereign-operator"), "crd"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rc, out = run_image.run_once(
        config, rootfs, run_image.PodContainer(command=["sovereign-operator", "crd"], **locked), WORK
    )
    assert rc == 0 and out == here, "the image's operator generates the same CRD"
