"""The operator, for real, on a real control plane with fake 8x H200 nodes (kwok).

It runs as a subprocess with exactly the chart's RBAC (see conftest). The scheduler places the pods
on the fake GPU nodes by their nvidia.com/gpu and RDMA capacity, the controller manager creates the
StatefulSets' pods and collects garbage, and kwok starts the pods and makes them Ready after a few
seconds, so every transition below is the one a real cluster would show.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest
from cluster_helpers import (
    CLUSTER_SH,
    DEEPSEEK_V3_FP8,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    RDMA_RESOURCE,
    RUNTIME_IMAGE,
    Kubectl,
    OperatorHandle,
    audit_log_path,
    audited_writes,
    condition,
    get_llmd,
    llmd,
    set_rdma,
    wait_for,
    wait_ready,
)

# The GPU example needs fake 8x H200 nodes and RDMA capacity the tests can switch (kwok's).
pytestmark = [pytest.mark.cluster, pytest.mark.fake_gpu_nodes]

INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
CHILD_KINDS = "statefulsets,deployments,services,poddisruptionbudgets"
IMAGE = RUNTIME_IMAGE
IMAGE_2 = "ghcr.io/sovereign-ai/sovereign-runtime:0.1.1"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"


def gpu_llmd(name: str, mode: str = "disaggregated", prefill: int = 1, decode: int = 2) -> dict[str, Any]:
    spec: dict[str, Any] = {**copy.deepcopy(DEEPSEEK_V3_FP8), "mode": mode, "decode": {"replicas": decode}}
    if mode != "unified":
        spec["prefill"] = {"replicas": prefill}
    return llmd(name, spec)


def children(kube: Kubectl, ns: str, name: str, kinds: str = CHILD_KINDS) -> list[dict[str, Any]]:
    return kube.items(kinds, "-n", ns, "-l", f"{INSTANCE}={name}")


def statefulsets(kube: Kubectl, ns: str, name: str) -> dict[str, dict[str, Any]]:
    """The LLMDeployment's StatefulSets by component."""
    out: dict[str, dict[str, Any]] = {}
    for sts in children(kube, ns, name, "statefulsets"):
        component = sts["metadata"]["labels"][COMPONENT]
        assert component not in out, f"two StatefulSets for component {component}"
        out[component] = sts
    return out


def worker_container(sts: dict[str, Any]) -> dict[str, Any]:
    containers = sts["spec"]["template"]["spec"]["containers"]
    return next((c for c in containers if c["image"].startswith("ghcr.io/sovereign-ai/")), containers[0])


def owned_by(obj: dict[str, Any], llmd: dict[str, Any]) -> bool:
    return any(
        ref.get("uid") == llmd["metadata"]["uid"] and ref.get("controller")
        for ref in obj["metadata"].get("ownerReferences", [])
    )


def resource_versions(kube: Kubectl, ns: str, name: str) -> dict[str, str]:
    objs = [*children(kube, ns, name, CHILD_KINDS + ",pods"), get_llmd(kube, ns, name)]
    return {f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["resourceVersion"] for o in objs}


@pytest.fixture(autouse=True)
def _rdma_on(kube: Kubectl) -> None:
    # Every test starts on a cluster with RDMA; the auto-mode test takes it away and gives it back.
    set_rdma(kube, True)


def test_create_schedules_gpu_pods_and_becomes_ready(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    kube.apply(gpu_llmd("ds"), namespace)
    llmd = get_llmd(kube, namespace, "ds")

    sts = wait_for(
        "prefill and decode StatefulSets",
        lambda: (s := statefulsets(kube, namespace, "ds")).keys() >= {"prefill", "decode"} and s,
    )
    # Right after the children appear nothing can be Ready: kwok takes seconds to start a pod.
    assert (condition(get_llmd(kube, namespace, "ds"), "Ready") or {}).get("status") != "True"

    assert set(sts) == {"prefill", "decode"}
    assert sts["prefill"]["spec"]["replicas"] == 1
    assert sts["decode"]["spec"]["replicas"] == 2
    for component, s in sts.items():
        labels = s["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] and labels["app.kubernetes.io/managed-by"], labels
        assert owned_by(s, llmd), f"{component} StatefulSet is not controlled by the LLMDeployment"
        container = worker_container(s)
        assert container["image"] == IMAGE
        limits = container["resources"]["limits"]
        assert str(limits["nvidia.com/gpu"]) == "8", limits
        assert int(str(limits[RDMA_RESOURCE])) >= 1, limits
    router = [
        d
        for d in children(kube, namespace, "ds", "deployments")
        if d["metadata"]["labels"].get(COMPONENT) == "router"
    ]
    assert len(router) == 1 and owned_by(router[0], llmd)

    obj = wait_ready(kube, operator, namespace, "ds")
    status = obj["status"]
    assert status["mode"] == "disaggregated"
    assert status["endpoint"].startswith("http://"), status
    services = {s["metadata"]["name"] for s in children(kube, namespace, "ds", "services")}
    assert any(svc in status["endpoint"] for svc in services), (status["endpoint"], services)

    # The real scheduler placed every worker on a GPU node that had the GPUs and RDMA devices.
    gpu_nodes = {n["metadata"]["name"] for n in kube.items("nodes", "-l", "nvidia.com/gpu.present=true")}
    workers = [
        p
        for p in kube.items("pods", "-n", namespace, "-l", f"{INSTANCE}=ds")
        if p["metadata"]["labels"].get(COMPONENT) in ("prefill", "decode")
    ]
    assert len(workers) == 3
    for pod in workers:
        assert pod["spec"]["nodeName"] in gpu_nodes, pod["spec"].get("nodeName")
        assert pod["status"]["phase"] == "Running"
    # Each worker takes all 8 GPUs of a node, so a scheduler that counts them puts each on its own node.
    assert len({p["spec"]["nodeName"] for p in workers}) == len(workers)


def test_update_image_replicas_and_resources_reach_the_statefulsets(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    kube.apply(gpu_llmd("ds", prefill=1, decode=1), namespace)
    wait_ready(kube, operator, namespace, "ds")

    updated = gpu_llmd("ds", prefill=1, decode=1)
    updated["spec"]["runtime"]["image"] = IMAGE_2
    updated["spec"]["decode"] = {"replicas": 1, "resources": {"requests": {"memory": "1Ti", "cpu": "64"}}}
    kube.apply(updated, namespace)

    def rolled() -> dict[str, dict[str, Any]] | None:
        sts = statefulsets(kube, namespace, "ds")
        images = {c: worker_container(s)["image"] for c, s in sts.items()}
        return sts if set(images.values()) == {IMAGE_2} else None

    sts = wait_for("both StatefulSets on the new image", rolled)
    requests = worker_container(sts["decode"])["resources"]["requests"]
    assert requests["memory"] == "1Ti" and str(requests["cpu"]) == "64", requests
    obj = wait_ready(kube, operator, namespace, "ds")
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]

    # Scale decode; prefill stays.
    scaled = copy.deepcopy(updated)
    scaled["spec"]["decode"]["replicas"] = 2
    kube.apply(scaled, namespace)
    wait_for(
        "decode StatefulSet at 2",
        lambda: statefulsets(kube, namespace, "ds")["decode"]["spec"]["replicas"] == 2,
    )
    obj = wait_ready(kube, operator, namespace, "ds")
    wait_for(
        "status.pools.decode.readyReplicas == 2",
        lambda: (
            (get_llmd(kube, namespace, "ds")["status"].get("pools") or {})
            .get("decode", {})
            .get("readyReplicas")
            == 2
        ),
    )
    assert statefulsets(kube, namespace, "ds")["prefill"]["spec"]["replicas"] == 1


def test_delete_lets_the_garbage_collector_remove_every_child(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    kube.apply(gpu_llmd("ds", decode=1), namespace)
    wait_ready(kube, operator, namespace, "ds")
    assert children(kube, namespace, "ds")

    kube.run("delete", "llmd", "ds", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        "every child and pod gone",
        lambda: not children(kube, namespace, "ds", CHILD_KINDS + ",pods,configmaps"),
        timeout=90,
    )


def test_deleting_the_namespace_completes_under_the_namespace_restricted_operator(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    # The session's operator serves only `--namespace=<prefix>*`: kopf observes the Namespaces and
    # stops serving one marked for deletion. With no finalizer on the objects that cannot hang.
    kube.apply(gpu_llmd("ds", decode=1), namespace)
    wait_ready(kube, operator, namespace, "ds")
    time.sleep(6)  # past the first autoscaling tick (a kopf timer had added its finalizer by now)
    assert not get_llmd(kube, namespace, "ds")["metadata"].get("finalizers")

    started = time.monotonic()
    kube.run("delete", "namespace", namespace, "--wait=false")
    wait_for(
        f"namespace {namespace} gone",
        lambda: kube.get_or_none("namespace", namespace) is None,
        timeout=60,
    )
    operator.assert_alive()
    assert time.monotonic() - started < 60


def test_steady_state_makes_no_writes(kube: Kubectl, operator: OperatorHandle, namespace: str) -> None:
    kube.apply(gpu_llmd("ds", decode=1), namespace)
    wait_ready(kube, operator, namespace, "ds")
    # Steady means every monitor has reported once (their first probes come some seconds after Ready, later
    # on a loaded host), then the last status write and the pods' Ready transitions settle.
    monitors = {"KVTransferHealthy", "OutputHealthy"}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        conditions = get_llmd(kube, namespace, "ds").get("status", {}).get("conditions", [])
        if monitors <= {c.get("type") for c in conditions}:
            break
        time.sleep(1)
    # The StatefulSet controller writes availableReplicas minReadySeconds after a pod turned Ready, and a
    # monitor's first round may have seen fewer pods than its second: settled is nothing changing for
    # longer than a monitor's interval (15 s).
    settle_until = time.monotonic() + 120
    before = resource_versions(kube, namespace, "ds")
    while time.monotonic() < settle_until:
        time.sleep(16)
        again = resource_versions(kube, namespace, "ds")
        if again == before:
            break
        before = again
    llmd_before = get_llmd(kube, namespace, "ds")
    since = time.time()
    time.sleep(30)
    operator.assert_alive()
    after = resource_versions(kube, namespace, "ds")
    changed = {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
    assert not changed, (
        f"objects changed in a steady state: {changed}\n"
        f"LLMDeployment before: {json.dumps(llmd_before)}\n"
        f"LLMDeployment after: {json.dumps(get_llmd(kube, namespace, 'ds'))}\n{operator.tail()}"
    )
    audit = audit_log_path(kube)
    if audit is not None:
        writes = [
            f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('name')}"
            for e in audited_writes(audit, OPERATOR_USER, since)
            if e.get("objectRef", {}).get("namespace") == namespace
        ]
        assert not writes, f"the operator wrote in a steady state: {writes}"


def test_operator_restart_mid_rollout_converges_without_duplicates(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    kube.apply(gpu_llmd("ds", decode=1), namespace)
    wait_for("the first child", lambda: children(kube, namespace, "ds"))
    # Crash the operator in the middle of creating, change the spec while it is down, restart it.
    operator.kill()
    try:
        updated = gpu_llmd("ds", decode=2)
        updated["spec"]["runtime"]["image"] = IMAGE_2
        kube.apply(updated, namespace)
    finally:
        operator.start()
    obj = wait_ready(kube, operator, namespace, "ds")
    sts = wait_for(
        "StatefulSets converged",
        lambda: (
            (s := statefulsets(kube, namespace, "ds"))
            and s.get("decode", {}).get("spec", {}).get("replicas") == 2
            and {worker_container(x)["image"] for x in s.values()} == {IMAGE_2}
            and s
        ),
    )
    assert set(sts) == {"prefill", "decode"}
    for child in children(kube, namespace, "ds"):
        assert owned_by(child, obj), f"orphan {child['kind']}/{child['metadata']['name']}"
    names = [f"{c['kind']}/{c['metadata']['name']}" for c in children(kube, namespace, "ds")]
    assert len(names) == len(set(names))
    # Nothing the operator made is left without the instance label either.
    for kind in ("statefulsets", "deployments", "services"):
        for other in kube.items(kind, "-n", namespace):
            assert other["metadata"].get("labels", {}).get(INSTANCE) == "ds", other["metadata"]["name"]


@pytest.mark.parametrize(
    ("rdma", "expected"), [(False, "unified"), (True, "disaggregated")], ids=["no-rdma", "rdma"]
)
def test_auto_mode_follows_the_clusters_rdma(
    kube: Kubectl, operator: OperatorHandle, namespace: str, rdma: bool, expected: str
) -> None:
    set_rdma(kube, rdma)
    try:
        kube.apply(gpu_llmd("ds", mode="auto"), namespace)
        obj = wait_ready(kube, operator, namespace, "ds")
    finally:
        set_rdma(kube, True)
    status = obj["status"]
    assert status["mode"] == expected, status
    assert status.get("modeReason"), status
    if not rdma:
        assert "rdma" in status["modeReason"].lower(), status["modeReason"]
    components = set(statefulsets(kube, namespace, "ds"))
    assert components == ({"unified"} if expected == "unified" else {"prefill", "decode"}), components


# ---- control-plane faults ----------------------------------------------------------------------------


def _restart_control_plane(kube: Kubectl) -> None:
    if not kube.local:
        pytest.skip("restarting the control plane needs the project's local one (cluster.sh)")
    subprocess.run([str(CLUSTER_SH), "restart"], check=True, capture_output=True, timeout=120)


def _decode_replicas_converge(kube: Kubectl, operator: OperatorHandle, namespace: str, want: int) -> None:
    wait_for(
        f"decode StatefulSet at {want}",
        lambda: statefulsets(kube, namespace, "ds")["decode"]["spec"]["replicas"] == want,
        timeout=90,
    )
    obj = wait_ready(kube, operator, namespace, "ds")
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]


def test_the_operator_rides_out_an_apiserver_and_etcd_restart(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    kube.apply(gpu_llmd("ds", decode=1), namespace)
    wait_ready(kube, operator, namespace, "ds")
    starts = getattr(operator, "starts", None)
    _restart_control_plane(kube)
    # Its watches broke with the apiserver; a change right after the restart must still be seen.
    kube.apply(gpu_llmd("ds", decode=2), namespace)
    _decode_replicas_converge(kube, operator, namespace, 2)
    operator.assert_alive()
    assert getattr(operator, "starts", None) == starts  # recovered in place, not by a restart


def test_a_change_made_while_the_operators_watch_expired_is_not_missed(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    # Frozen across a control-plane restart, the operator comes back to broken watches whose
    # resourceVersion the new apiserver's watch cache never held: resuming them is answered 410 Gone
    # ("too old resource version", checked by hand against this control plane), and the change made
    # meanwhile reaches the operator only through the relist that follows.
    proc = getattr(operator, "proc", None)
    if proc is None:
        pytest.skip("freezing the operator needs the process this session started")
    kube.apply(gpu_llmd("ds", decode=1), namespace)
    wait_ready(kube, operator, namespace, "ds")
    starts = getattr(operator, "starts", None)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        _restart_control_plane(kube)
        kube.apply(gpu_llmd("ds", decode=3), namespace)
        time.sleep(2)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _decode_replicas_converge(kube, operator, namespace, 3)
    operator.assert_alive()
    assert getattr(operator, "starts", None) == starts
