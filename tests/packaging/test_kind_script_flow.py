"""`e2e/kind/up.sh` run from start to end, with docker, kind, kubectl, helm, curl and make replaced
by recording stand-ins (no Docker engine here). This is not the kind run itself; it proves that the
script, under `set -euo pipefail`, reaches every step in order with the arguments a real run needs:
the cluster config, the image names and tag it builds, loads and hands to the chart, the models it
applies, the Ready wait, the chat completion through each router, and the suite's environment for
`up.sh test`."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

from packaging_helpers import REPO

KIND = REPO / "e2e" / "kind"
VERSION = re.search(r'^version = "(.*)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]

# One stand-in for every tool: it appends its argv to $SHIM_LOG and answers what up.sh reads back.
SHIM = r"""#!/usr/bin/env bash
name="$(basename "$0")"
{ printf '%s' "$name"; printf ' %s' "$@"; echo; } >>"$SHIM_LOG"
case "$name" in
  kind)
    case "$1 $2" in
      "get clusters") cat "$SHIM_STATE/clusters" 2>/dev/null ;;
      "create cluster")
        while [[ $# -gt 0 ]]; do
          [[ "$1" == --kubeconfig ]] && echo "apiVersion: v1" >"$2"
          [[ "$1" == --config ]] && sed -n 's/^name: //p' "$2" >>"$SHIM_STATE/clusters"
          shift
        done ;;
      "get nodes") echo "$4-control-plane"; echo "$4-worker"; [[ "$4" == sovereign-cpu ]] && echo "$4-worker2" ;;
      "get kubeconfig") echo "apiVersion: v1" ;;
    esac ;;
  kubectl)
    args=" $* "
    if [[ "$args" == *" --dry-run=client "* ]]; then
      while [[ $# -gt 0 && "$1" != -f ]]; do shift; done
      sed -n 's/^  name: //p' "$2" | head -1
    elif [[ "$1" == port-forward || "$3" == port-forward ]]; then
      exec sleep 30
    elif [[ "$args" == *"get nodes"* ]]; then
      echo 8
    elif [[ "$args" == *"{.spec.model.name}"* ]]; then
      echo "served-model"
    elif [[ "$args" == *" wait --for=condition=Ready "* && -n "${SHIM_NEVER_READY:-}" ]]; then
      echo "error: timed out waiting for the condition" >&2; exit 1
    fi ;;
  curl)
    # 127.0.0.1 answers only once a port-forward has started, as the real one does (under load the
    # backgrounded port-forward may start after up.sh's first try).
    if [[ "$*" == *127.0.0.1* ]] && ! grep -q " port-forward " "$SHIM_LOG"; then exit 7; fi
    [[ "$*" == */v1/chat/completions* ]] && echo '{"choices":[{"message":{"content":"hello"}}]}' ;;
  pytest)
    env | grep -E '^(KUBECONFIG|SOVEREIGN_[A-Z_]+)=' | sort >"$SHIM_STATE/pytest-env" ;;
esac
exit 0
"""

TOOLS = ("docker", "kind", "kubectl", "helm", "curl", "make", "nvidia-smi")


def make_repo(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of what up.sh reads, stand-ins on PATH; returns (repo, shim dir, state dir)."""
    repo = tmp_path / "repo"
    (repo / "e2e").mkdir(parents=True)
    shutil.copytree(KIND, repo / "e2e" / "kind")
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    shutil.copytree(REPO / "examples", repo / "examples")
    (repo / "charts" / "sovereign").mkdir(parents=True)
    shims, state = tmp_path / "shims", tmp_path / "state"
    shims.mkdir()
    state.mkdir()
    shim = shims / "shim"
    shim.write_text(SHIM)
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    for tool in TOOLS:
        (shims / tool).symlink_to(shim)
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "pytest").symlink_to(shim)
    return repo, shims, state


def run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str], Path]:
    repo_dir = tmp_path / "repo"
    if not repo_dir.exists():
        make_repo(tmp_path)
    shims, state = tmp_path / "shims", tmp_path / "state"
    log = state / "calls.log"
    proc = subprocess.run(
        ["bash", str(repo_dir / "e2e" / "kind" / "up.sh"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": f"{shims}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "SHIM_LOG": str(log),
            "SHIM_STATE": str(state),
            **env,
        },
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, repo_dir


def index_of(calls: list[str], prefix: str, start: int = 0) -> int:
    for i in range(start, len(calls)):
        if calls[i].startswith(prefix):
            return i
    raise AssertionError(f"no call starting with {prefix!r} after #{start}:\n" + "\n".join(calls))


def in_order(calls: list[str], *prefixes: str) -> None:
    at = 0
    for prefix in prefixes:
        at = index_of(calls, prefix, at) + 1


def test_cpu_run_reaches_every_step_in_order(tmp_path: Path) -> None:
    proc, calls, repo = run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    operator = f"ghcr.io/sovereign-ai/sovereign-operator:{VERSION}"
    runtime = f"ghcr.io/sovereign-ai/sovereign-runtime:{VERSION}"
    in_order(
        calls,
        "docker info",
        f"kind create cluster --config {repo}/e2e/kind/kind-cpu.yaml --kubeconfig "
        f"{repo}/.cluster/kind-sovereign-cpu.kubeconfig",
        f"make images IMAGE_REPO=ghcr.io/sovereign-ai IMAGE_TAG={VERSION}",
        f"kind load docker-image --name sovereign-cpu --nodes sovereign-cpu-worker,sovereign-cpu-worker2 "
        f"{operator} {runtime}",
        f"helm upgrade --install sovereign {repo}/charts/sovereign --namespace sovereign-system",
        "kubectl wait --for=condition=Established crd/llmdeployments.sovereign.ai",
        f"kubectl apply -n default -f {repo}/examples/tiny.yaml",
        "kubectl -n default patch llmdeployment tiny --type merge -p "
        f'{{"spec":{{"runtime":{{"image":"{runtime}"}}}}}}',
        "kubectl -n default wait --for=condition=Ready llmdeployment/tiny",
        "kubectl -n default port-forward service/tiny",
        "curl -fsS http://127.0.0.1:",
    )
    helm = calls[index_of(calls, "helm upgrade")]
    for value in (
        "image.repository=ghcr.io/sovereign-ai/sovereign-operator",
        f"image.tag={VERSION}",
        "runtimeImage.repository=ghcr.io/sovereign-ai/sovereign-runtime",
        f"runtimeImage.tag={VERSION}",
    ):
        assert f"--set {value}" in helm, helm
    chat = calls[index_of(calls, "curl", index_of(calls, "kubectl -n default get llmdeployment tiny"))]
    assert "/v1/chat/completions" in chat and '"model":"served-model"' in chat, chat
    # The CPU cluster never touches GPU plumbing.
    assert not any("nvidia" in c or "gpu-tiny" in c for c in calls), calls
    assert "tiny answered" in proc.stderr


def test_gpu_run_adds_the_toolkit_device_plugin_and_gpu_model(tmp_path: Path) -> None:
    proc, calls, repo = run(tmp_path, "--gpu")
    assert proc.returncode == 0, proc.stderr
    in_order(
        calls,
        f"kind create cluster --config {repo}/e2e/kind/kind-gpu.yaml",
        "docker exec sovereign-gpu-worker nvidia-ctk runtime configure --runtime=containerd --set-as-default",
        "helm upgrade --install nvidia-device-plugin nvdp/nvidia-device-plugin",
        "make images",
        "kind load docker-image --name sovereign-gpu --nodes sovereign-gpu-worker ",
        "helm upgrade --install sovereign",
        f"kubectl apply -n default -f {repo}/examples/tiny.yaml",
        f"kubectl apply -n default -f {repo}/e2e/kind/gpu-tiny.yaml",
        "kubectl -n default wait --for=condition=Ready llmdeployment/tiny ",
        "kubectl -n default wait --for=condition=Ready llmdeployment/tiny-gpu",
    )
    assert sum("/v1/chat/completions" in c for c in calls) == 2


def test_a_model_that_never_becomes_ready_fails_the_run(tmp_path: Path) -> None:
    proc, calls, _ = run(tmp_path, SHIM_NEVER_READY="1")
    assert proc.returncode != 0
    assert "llmdeployment/tiny did not become Ready" in proc.stderr
    assert not any("/v1/chat/completions" in c for c in calls)


def test_test_action_runs_the_cluster_suite_with_the_charts_operator(tmp_path: Path) -> None:
    proc, _, repo = run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc, calls, _ = run(tmp_path, "test")
    assert proc.returncode == 0, proc.stderr
    assert calls[-2:] == [
        "make venv",
        "pytest -m cluster tests/cluster tests/packaging/test_chart_install.py",
    ], calls[-3:]
    env = (tmp_path / "state" / "pytest-env").read_text().splitlines()
    assert f"KUBECONFIG={repo}/.cluster/kind-sovereign-cpu.kubeconfig" in env
    assert "SOVEREIGN_TEST_OPERATOR=external" in env
    assert "SOVEREIGN_OPERATOR_NAMESPACE=sovereign-system" in env


def test_test_action_without_a_cluster_says_to_create_one(tmp_path: Path) -> None:
    proc, calls, _ = run(tmp_path, "test")
    assert proc.returncode != 0 and "run e2e/kind/up.sh first" in proc.stderr
    assert not any(c.startswith("pytest") for c in calls)


def test_down_deletes_only_existing_clusters(tmp_path: Path) -> None:
    run(tmp_path)
    proc, calls, _ = run(tmp_path, "down")
    assert proc.returncode == 0, proc.stderr
    assert "kind delete cluster --name sovereign-cpu" in calls
    assert "kind delete cluster --name sovereign-gpu" not in calls


def test_a_local_node_image_is_passed_to_kind(tmp_path: Path) -> None:
    """make e2e-kind builds its own node image and names it in KIND_NODE_IMAGE; nothing else changes."""
    proc, calls, _ = run(tmp_path, KIND_NODE_IMAGE="sovereign.local/kind/node:v1.36.3", SKIP_BUILD="true")
    assert proc.returncode == 0, proc.stderr
    create = calls[index_of(calls, "kind create cluster")]
    assert create.endswith(" --image sovereign.local/kind/node:v1.36.3"), create
    assert not any(c.startswith("make images") for c in calls), calls
    in_order(
        calls, "kind create cluster", "kind load docker-image --name sovereign-cpu", "helm upgrade --install"
    )
