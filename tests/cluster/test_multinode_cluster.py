"""Multi-node replicas on the local control plane: the operator renders LeaderWorkerSets, the real
LeaderWorkerSet controller (built from sigs.k8s.io/lws, e2e/cluster/lws.sh) turns them into leader and
worker pods, the real scheduler places them on kwok's fake 8x H100 nodes and kwok makes them Ready.
examples/deepseek-v3-h100.yaml serves Ready with every group whole; scaling moves whole groups; a
deleted worker pod makes LeaderWorkerSet recreate its group, leader included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import Kubectl, OperatorHandle, get_llmd, set_rdma, wait_for, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.fake_gpu_nodes]

REPO = Path(__file__).resolve().parents[2]
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


@pytest.fixture(autouse=True)
def _leader_worker_set(kube: Kubectl) -> None:
    if kube.get_or_none("crd", "leaderworkersets.leaderworkerset.x-k8s.io") is None:
        pytest.skip(
            "LeaderWorkerSet is not installed on this cluster (e2e/cluster/cluster.sh up installs it)"
        )


def h100_example(decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/deepseek-v3-h100.yaml with its volumes where kwok's nodes have them (no PVCs here)."""
    manifest = yaml.safe_load((REPO / "examples" / "deepseek-v3-h100.yaml").read_text())
    manifest["metadata"].pop("namespace")
    spec = manifest["spec"]
    spec["model"]["source"] = {"hostPath": {"path": "/models/deepseek-v3"}}
    spec["startup"]["jitCache"] = {"emptyDir": {"sizeLimit": "20Gi"}}
    if decode is not None:
        spec["decode"] = {**{k: v for k, v in spec["decode"].items() if k != "autoscaling"}, **decode}
    return manifest


def pods(kube: Kubectl, ns: str, name: str, component: str) -> list[dict[str, Any]]:
    return kube.items("pods", "-n", ns, "-l", f"{INSTANCE}={name},{COMPONENT}={component}")


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    ) and not pod["metadata"].get("deletionTimestamp")


def groups_ready(
    kube: Kubectl, ns: str, name: str, component: str, groups: int, size: int
) -> list[dict[str, Any]] | None:
    """The pool's pods once there are exactly ``groups`` whole groups of ``size``, every pod Ready."""
    found = pods(kube, ns, name, component)
    members: dict[str, set[str]] = {}
    for pod in found:
        labels = pod["metadata"]["labels"]
        members.setdefault(labels.get(GROUP_INDEX, "?"), set()).add(labels.get(WORKER_INDEX, "?"))
    whole = sorted(members) == [str(i) for i in range(groups)] and all(
        m == {str(w) for w in range(size)} for m in members.values()
    )
    return found if whole and len(found) == groups * size and all(is_ready(p) for p in found) else None


def test_the_h100_example_serves_from_whole_groups_on_h100_nodes(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    set_rdma(kube, True)
    name = "deepseek-v3-h100"
    kube.apply(h100_example(), namespace)
    obj = wait_ready(kube, operator, namespace, name, timeout=180)
    sets = {s["metadata"]["name"]: s for s in kube.items("leaderworkersets", "-n", namespace)}
    assert set(sets) == {f"{name}-prefill-group", f"{name}-decode-group"}
    for lws in sets.values():
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    h100 = {
        n["metadata"]["name"]
        for n in kube.items("nodes", "-l", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3")
    }
    for component in ("prefill", "decode"):
        members = groups_ready(kube, namespace, name, component, 1, 2)
        assert members is not None, [p["metadata"]["name"] for p in pods(kube, namespace, name, component)]
        assert {p["spec"]["nodeName"] for p in members} <= h100
        assert len({p["spec"]["nodeName"] for p in members}) == 2  # a node each: 8 GPUs per pod
        # LeaderWorkerSet told every member where the group meets.
        env = {e["name"]: e.get("value") for e in members[0]["spec"]["containers"][0]["env"]}
        assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_LEADER_ADDRESS"].startswith(
            f"{name}-{component}-group-0."
        )
        pool = obj["status"]["pools"][component]
        assert pool["nodesPerReplica"] == 2 and pool["readyReplicas"] == 1
        assert [(g["index"], g["readyMembers"], g.get("failedMember")) for g in pool["groups"]] == [
            (0, 2, None)
        ]
    # The router's Service selects the leaders only (kwok's loopback pod IPs get no EndpointSlices: the
    # apiserver refuses loopback endpoints, so the selector is what is checked).
    service = kube.get("service", "-n", namespace, f"{name}-decode")
    selector = ",".join(f"{k}={v}" for k, v in sorted(service["spec"]["selector"].items()))
    selected = [p["metadata"]["name"] for p in kube.items("pods", "-n", namespace, "-l", selector)]
    assert selected == [f"{name}-decode-group-0"]


def test_scaling_moves_whole_groups(kube: Kubectl, operator: OperatorHandle, namespace: str) -> None:
    set_rdma(kube, True)
    name = "deepseek-v3-h100"
    manifest = h100_example(decode={"replicas": 1})
    kube.apply(manifest, namespace)
    wait_ready(kube, operator, namespace, name, timeout=180)
    scaled = copy.deepcopy(manifest)
    scaled["spec"]["decode"]["replicas"] = 2
    kube.apply(scaled, namespace)
    wait_for(
        "two whole decode groups", lambda: groups_ready(kube, namespace, name, "decode", 2, 2), timeout=120
    )
    obj = wait_ready(kube, operator, namespace, name, timeout=120)
    assert obj["status"]["pools"]["decode"]["readyReplicas"] == 2
    kube.apply(manifest, namespace)
    wait_for(
        "one whole decode group", lambda: groups_ready(kube, namespace, name, "decode", 1, 2), timeout=120
    )
    lws = kube.get("leaderworkerset", "-n", namespace, f"{name}-decode-group")
    assert lws["spec"]["replicas"] == 1


def test_deleting_a_worker_pod_recreates_its_group(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    set_rdma(kube, True)
    name = "deepseek-v3-h100"
    kube.apply(h100_example(decode={"replicas": 1}), namespace)
    wait_ready(kube, operator, namespace, name, timeout=180)
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(kube, namespace, name, "decode")}
    worker = f"{name}-decode-group-0-1"
    leader = f"{name}-decode-group-0"
    assert set(before) == {leader, worker}
    kube.run("delete", "pod", "-n", namespace, worker, "--wait=false")

    def recreated() -> list[dict[str, Any]] | None:
        members = groups_ready(kube, namespace, name, "decode", 1, 2)
        if members is None:
            return None
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in members}
        # The whole group restarts: the leader too, not only the deleted worker.
        return members if all(uids[n] != before[n] for n in before) else None

    wait_for("the decode group recreated, leader included, and Ready", recreated, timeout=120)
    obj = wait_ready(kube, operator, namespace, name, timeout=120)
    assert obj["status"]["pools"]["decode"]["groups"][0]["readyMembers"] == 2
    assert get_llmd(kube, namespace, name)["status"]["pools"]["decode"]["nodesPerReplica"] == 2
