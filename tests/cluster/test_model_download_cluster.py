"""A huggingFace model source on a real control plane: the resolve Job, the cache claim and its
download Job are applied under the operator's least-privilege identity, shared between
deployments, and status follows them.

On kwok's fake nodes no container runs, so the test plays the kubelet's part for the Job pods: it
writes the pod status a finished `sovereign-runtime download` leaves (a terminated container with
the JSON result in its termination message), exactly what the operator reads on a real node. The
cache claim binds to a static PersistentVolume the test creates (the local control plane has no
provisioner); on the real kubelet node `test_download_job_runs_to_completion_on_a_real_node` runs
the Job for real against tests/hubserver.py.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import (
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    Kubectl,
    OperatorHandle,
    audit_log_path,
    audited_writes,
    condition,
    get_llmd,
    llmd,
    wait_for,
    wait_ready,
)

pytestmark = [pytest.mark.cluster, pytest.mark.fake_gpu_nodes]

COMMIT = "5c2b7d1e" * 5
BYTES = 3 * 2**30
JOB_NAME = "batch.kubernetes.io/job-name"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"


def hf_spec(storage_class: str, revision: str = "main") -> dict[str, Any]:
    return {
        "model": {
            "name": "tiny-v3",
            "source": {
                "huggingFace": {
                    "repo": "sovereign-ai/tiny-v3",
                    "revision": revision,
                    # Nothing runs on the fake nodes: the hub is never called.
                    "endpoint": "http://hub.invalid",
                    "tokenSecretRef": {"name": "hf-token"},
                    "cache": {"storageClassName": storage_class, "accessMode": "ReadWriteOnce"},
                }
            },
        },
        "runtime": {"device": "cpu", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
        "mode": "unified",
        "decode": {"replicas": 1},
    }


def static_volume(kube: Kubectl, name: str, modes: list[str]) -> None:
    """A 10Gi hostPath PersistentVolume of the class `name` (the local control plane has no provisioner)."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "10Gi"},
                "accessModes": modes,
                "storageClassName": name,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"/tmp/{name}"},
            },
        }
    )


@pytest.fixture
def storage_class(kube: Kubectl) -> Iterator[str]:
    """A static PersistentVolume of a class of this test's own, for the cache claim to bind to."""
    name = f"sovereign-test-cache-{secrets.token_hex(3)}"
    static_volume(kube, name, ["ReadWriteOnce", "ReadWriteMany"])
    yield name
    kube.run("delete", "pv", name, "--wait=false", check=False)


def model_status(kube: Kubectl, ns: str, name: str) -> dict[str, Any]:
    return dict((get_llmd(kube, ns, name).get("status") or {}).get("model") or {})


def wait_phase(kube: Kubectl, op: OperatorHandle, ns: str, name: str, phase: str) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        op.assert_alive()
        model = model_status(kube, ns, name)
        return model if model.get("phase") == phase else None

    try:
        return wait_for(f"{name} model phase {phase}", reached, timeout=90)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{op.tail()}") from None


def job_pod(kube: Kubectl, ns: str, job: str) -> dict[str, Any]:
    """A pod of the Job once kwok has played all its stages on it (Running, then Ready).

    The test writes the status the kubelet would only after that: kwok queues each stage with a delay
    and plays it with the pod as it was when queued, and a later status that matches no stage (the
    test's) does not cancel the queued one. A pod patched while a stage is pending gets kwok's status
    written over the test's: a failed attempt turned back into a running container, which made
    test_a_failing_download_says_why_in_status time out (whether it lost that race depended on timing).
    """

    def settled() -> dict[str, Any] | None:
        pods = kube.items("pods", "-n", ns, "-l", f"{JOB_NAME}={job}")
        return next((p for p in pods if p["spec"].get("nodeName") and _kwok_ready(p)), None)

    return dict(wait_for(f"a pod of Job {job} started and Ready (kwok's last stage)", settled, timeout=60))


def _kwok_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    containers = status.get("containerStatuses") or []
    return ready.get("status") == "True" and bool(containers) and all(c.get("ready") for c in containers)


def finish(kube: Kubectl, ns: str, pod: dict[str, Any], result: dict[str, Any]) -> None:
    """What the kubelet writes when the download container exits 0 with `result` as its message."""
    terminated = {"exitCode": 0, "reason": "Completed", "message": json.dumps(result)}
    status = {
        "phase": "Succeeded",
        "containerStatuses": [
            {
                "name": "download",
                "image": "i",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": {**terminated, "startedAt": None, "finishedAt": None}},
            }
        ],
    }
    kube.run(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def fail(kube: Kubectl, ns: str, pod: dict[str, Any], reason: str, message: str) -> None:
    """A failed attempt the kubelet is backing off from (the pod keeps its phase, as with OnFailure)."""
    result = {"event": "failed", "reason": reason, "message": message, "transient": False}
    status = {
        "phase": "Running",
        # Ready keeps kwok's stages off this pod (they only match pods that are not Ready; job_pod
        # waited until none is pending).
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {
                "name": "download",
                "image": "i",
                "imageID": "",
                "ready": False,
                "restartCount": 1,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {
                    "terminated": {"exitCode": 1, "reason": "Error", "message": json.dumps(result)}
                },
            }
        ],
    }
    kube.run(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def jobs(kube: Kubectl, ns: str, component: str) -> list[dict[str, Any]]:
    return kube.items("jobs", "-n", ns, "-l", f"app.kubernetes.io/component={component}")


def finish_resolve(kube: Kubectl, ns: str) -> None:
    """The namespace's one resolve Job answers: COMMIT, BYTES in 4 files."""
    (resolve,) = wait_for("the resolve Job", lambda: jobs(kube, ns, "model-resolve"))
    result = {"event": "resolved", "commit": COMMIT, "bytesTotal": BYTES, "files": 4}
    finish(kube, ns, job_pod(kube, ns, resolve["metadata"]["name"]), result)


def test_a_download_is_resolved_cached_shared_and_gates_the_pools(
    kube: Kubectl, operator: OperatorHandle, namespace: str, storage_class: str
) -> None:
    kube.apply(llmd("first", hf_spec(storage_class)), namespace)
    wait_phase(kube, operator, namespace, "first", "Resolving")
    (resolve,) = wait_for("the resolve Job", lambda: jobs(kube, namespace, "model-resolve"))
    first_uid = get_llmd(kube, namespace, "first")["metadata"]["uid"]
    assert [r["uid"] for r in resolve["metadata"]["ownerReferences"]] == [first_uid]
    assert not kube.items("statefulsets", "-n", namespace), "the pools wait for the download"
    ready = condition(get_llmd(kube, namespace, "first"), "Ready")
    assert ready is not None and ready["reason"] == "ModelNotDownloaded"

    finish(
        kube,
        namespace,
        job_pod(kube, namespace, resolve["metadata"]["name"]),
        {"event": "resolved", "commit": COMMIT, "bytesTotal": BYTES, "files": 4},
    )
    model = wait_phase(kube, operator, namespace, "first", "Downloading")
    assert model["commit"] == COMMIT and model["bytesTotal"] == BYTES
    claim = kube.get("pvc", model["cache"], "-n", namespace)
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"  # 3 GiB + 5% + 1 GiB
    assert "ownerReferences" not in claim["metadata"]  # Retain
    wait_for(
        "the claim bound to the static volume",
        lambda: kube.get("pvc", model["cache"], "-n", namespace)["status"].get("phase") == "Bound",
    )
    # The resolve Job had one owner and its answer is in status: it is gone.
    wait_for("the resolve Job released", lambda: not jobs(kube, namespace, "model-resolve"))

    (download,) = jobs(kube, namespace, "model-download")
    container = download["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:5] == ["download", "--repo", "sovereign-ai/tiny-v3", "--revision", COMMIT]
    finish(
        kube,
        namespace,
        job_pod(kube, namespace, download["metadata"]["name"]),
        {"event": "complete", "commit": COMMIT, "bytesTotal": BYTES, "files": 4},
    )
    model = wait_phase(kube, operator, namespace, "first", "Complete")
    assert model["serving"] == {"commit": COMMIT, "cache": model["cache"], "bytesTotal": BYTES}
    obj = wait_ready(kube, operator, namespace, "first")
    assert condition(obj, "ModelDownloaded")["status"] == "True"  # type: ignore[index]
    sts = kube.get("statefulset", "first-unified", "-n", namespace)
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": model["cache"], "readOnly": True},
    } in volumes
    table = kube.run("get", "llmd", "first", "-n", namespace).stdout
    assert "DOWNLOAD" in table and "Complete" in table

    # A second deployment of the same model: once resolved it finds the download done and shares it.
    kube.apply(llmd("second", hf_spec(storage_class)), namespace)
    (resolve,) = wait_for(
        "the second resolve Job", lambda: jobs(kube, namespace, "model-resolve"), timeout=60
    )
    finish(
        kube,
        namespace,
        job_pod(kube, namespace, resolve["metadata"]["name"]),
        {"event": "resolved", "commit": COMMIT, "bytesTotal": BYTES, "files": 4},
    )
    second = wait_phase(kube, operator, namespace, "second", "Complete")
    assert second["cache"] == model["cache"]
    second_uid = get_llmd(kube, namespace, "second")["metadata"]["uid"]
    (download,) = jobs(kube, namespace, "model-download")
    owners = {r["uid"] for r in download["metadata"]["ownerReferences"]}
    assert owners == {first_uid, second_uid}
    # Each owner applied its own reference under its own field manager: neither removed the other's.
    fields = kube.get("job", download["metadata"]["name"], "-n", namespace, "--show-managed-fields")
    managers = {m["manager"] for m in fields["metadata"]["managedFields"]}
    assert {f"sovereign-operator-{first_uid}", f"sovereign-operator-{second_uid}"} <= managers
    wait_ready(kube, operator, namespace, "second")

    # Deleting one user leaves the shared Job to the other (garbage collection by owner references).
    kube.run("delete", "llmd", "first", "-n", namespace)
    wait_for(
        "first's reference gone",
        lambda: (
            {r["uid"] for r in jobs(kube, namespace, "model-download")[0]["metadata"]["ownerReferences"]}
            == {second_uid}
        ),
        timeout=60,
    )


def test_a_failing_download_says_why_in_status(
    kube: Kubectl, operator: OperatorHandle, namespace: str, storage_class: str
) -> None:
    kube.apply(llmd("broken", hf_spec(storage_class, revision="v9")), namespace)
    (resolve,) = wait_for("the resolve Job", lambda: jobs(kube, namespace, "model-resolve"))
    message = "404 Not Found from http://hub.invalid/api/models/sovereign-ai/tiny-v3/revision/v9: Invalid rev id: v9"
    fail(kube, namespace, job_pod(kube, namespace, resolve["metadata"]["name"]), "RevisionNotFound", message)
    model = wait_phase(kube, operator, namespace, "broken", "Retrying")
    assert model["reason"] == "RevisionNotFound" and model["progress"] == "Retrying: RevisionNotFound"
    obj = get_llmd(kube, namespace, "broken")
    degraded = condition(obj, "Degraded")
    assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "RevisionNotFound"
    assert "Invalid rev id: v9" in degraded["message"]
    downloaded = condition(obj, "ModelDownloaded")
    assert (
        downloaded is not None
        and downloaded["status"] == "False"
        and "Invalid rev id" in downloaded["message"]
    )


def test_a_cache_claim_of_a_missing_class_degrades_until_it_binds(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    """A claim the cluster cannot provision leaves the download pod Pending with nothing of its own
    to say; the operator quotes the claim's Warning Event (here the PV controller's) and clears it
    once the claim binds."""
    missing = f"sovereign-test-no-class-{secrets.token_hex(3)}"
    kube.apply(llmd("unbound", hf_spec(missing)), namespace)
    finish_resolve(kube, namespace)

    def pending() -> dict[str, Any] | None:
        operator.assert_alive()
        model = model_status(kube, namespace, "unbound")
        return model if model.get("reason") == "CacheClaimPending" else None

    try:
        model = wait_for("status.model.reason CacheClaimPending", pending, timeout=90)
    except AssertionError as err:
        raise AssertionError(
            f"{err}\n{model_status(kube, namespace, 'unbound')}\n{operator.tail()}"
        ) from None
    said = f'storageclass.storage.k8s.io "{missing}" not found'
    assert model["phase"] == "Downloading" and said in model["message"]
    assert f"{model['cache']} (ReadWriteOnce, StorageClass {missing}) is not bound" in model["message"]
    degraded = condition(get_llmd(kube, namespace, "unbound"), "Degraded")
    assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "CacheClaimPending"
    assert "Downloading: CacheClaimPending" in kube.run("get", "llmd", "unbound", "-n", namespace).stdout

    # The class and a volume of it appear: the claim binds, the reason goes (the old Event stays).
    kube.apply(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": missing},
            "provisioner": "kubernetes.io/no-provisioner",
        }
    )
    static_volume(kube, missing, ["ReadWriteOnce"])
    try:

        def cleared() -> bool:
            operator.assert_alive()
            obj = get_llmd(kube, namespace, "unbound")
            degraded = condition(obj, "Degraded") or {}
            return degraded.get("status") == "False" and not model_status(kube, namespace, "unbound").get(
                "reason"
            )

        wait_for("the claim bound and Degraded cleared", cleared, timeout=90)
    finally:
        kube.run("delete", "pv", missing, "--wait=false", check=False)
        kube.run("delete", "storageclass", missing, "--wait=false", check=False)


def test_a_retained_claim_that_never_bound_goes_with_the_last_deployment_that_applied_it(
    kube: Kubectl, operator: OperatorHandle, namespace: str, storage_class: str
) -> None:
    """A `Retain` claim has no owner reference, so one of a class the cluster lacks stayed Pending
    for ever once the specs that named it moved on or went. It holds no download: it goes once no
    existing deployment applied it, and stays while another may still use it."""
    missing = f"sovereign-test-no-class-{secrets.token_hex(3)}"
    for name in ("a", "b"):
        kube.apply(llmd(name, hf_spec(missing)), namespace)
    finish_resolve(kube, namespace)  # one Job: the two share it
    pending = wait_phase(kube, operator, namespace, "a", "Downloading")["cache"]
    assert wait_phase(kube, operator, namespace, "b", "Downloading")["cache"] == pending
    uids = {name: get_llmd(kube, namespace, name)["metadata"]["uid"] for name in ("a", "b")}

    def appliers() -> set[str] | None:
        found = kube.run(
            "get", "pvc", pending, "-n", namespace, "-o", "json", "--show-managed-fields", check=False
        )
        if found.returncode != 0:
            return None
        fields = json.loads(found.stdout)["metadata"].get("managedFields") or []
        return {f["manager"].removeprefix("sovereign-operator-") for f in fields if f["operation"] == "Apply"}

    assert appliers() == set(uids.values())
    assert kube.get("pvc", pending, "-n", namespace)["status"]["phase"] == "Pending"

    # a moves to a class that binds: a claim of its own; the old one stays for b, without a's fields.
    kube.apply(llmd("a", hf_spec(storage_class)), namespace)

    def moved() -> str | None:
        operator.assert_alive()
        cache = model_status(kube, namespace, "a").get("cache")
        return cache if cache and cache != pending else None

    wait_for("a's new cache claim", moved, timeout=60)
    wait_for("a's fields gone from the claim b still names", lambda: appliers() == {uids["b"]}, timeout=60)
    time.sleep(2)
    assert appliers() == {uids["b"]}, "the claim b applied must stay"

    # b goes: nothing else applied the old claim, and it never bound.
    kube.run("delete", "llmd", "b", "-n", namespace)
    try:
        wait_for("the unbound claim deleted with its last user", lambda: appliers() is None, timeout=60)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{operator.tail()}") from None
    assert model_status(kube, namespace, "a").get("cache") != pending


def test_a_deleted_namespace_ends_the_download_rounds(
    kube: Kubectl, operator: OperatorHandle, namespace: str, storage_class: str
) -> None:
    """The operator's memory of a deployment goes with its namespace: no more rounds, no writes.

    A namespace-restricted kopf stops watching a namespace being deleted before its objects' DELETED
    events arrive, so its index keeps their last bodies; an unsettled download used to be reconciled
    from that stale body every 10 s for as long as the operator ran ("namespace not found")."""
    audit = audit_log_path(kube)
    if audit is None:
        pytest.skip("needs the local control plane's audit log to see the operator's write attempts")
    kube.apply(llmd("orphan", hf_spec(storage_class)), namespace)
    wait_phase(kube, operator, namespace, "orphan", "Resolving")
    wait_for("the resolve Job", lambda: jobs(kube, namespace, "model-resolve"))
    kube.run("delete", "namespace", namespace, "--wait=true", "--timeout=90s", timeout=120)
    gone = time.time()
    # A download interval (10 s) and a loop tick (5 s): before the fix, one write attempt at least.
    time.sleep(15)
    operator.assert_alive()
    tried = [
        f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('name')} -> "
        f"{(e.get('responseStatus') or {}).get('code')}"
        for e in audited_writes(audit, OPERATOR_USER, gone)
        if (e.get("objectRef") or {}).get("namespace") == namespace
    ]
    assert not tried, f"the operator still writes into the deleted namespace: {tried}\n{operator.tail()}"


# ---- the Job for real --------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


def host_address_for_pods(kube: Kubectl) -> str:
    """The address at which pods reach this machine: the apiserver's advertise address (the host side
    of the real node's veth on the local cluster), the endpoint of the `kubernetes` Service."""
    (slice_,) = kube.items("endpointslices", "-n", "default", "-l", "kubernetes.io/service-name=kubernetes")
    return str(slice_["endpoints"][0]["addresses"][0])


def test_download_job_runs_to_completion_on_a_real_node(
    kube: Kubectl,
    operator: OperatorHandle,
    real_pods_namespace: str,
    real_node_name: str,
    real_node_runtime_image: str,
    tmp_path: Path,
) -> None:
    """The real Job against tests/hubserver.py: resolve, download, verify, then a pool serves it."""
    from sovereign_runtime import builtin

    namespace, node = real_pods_namespace, real_node_name
    address = host_address_for_pods(kube)
    checkpoint = builtin.resolve_builtin("builtin:sovereign-tiny")
    hub = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "tests" / "hubserver.py"),
            "--repo",
            f"sovereign-ai/tiny-v3={checkpoint}",
            "--private",
            "--token",
            "hf_node_test",
            "--host",
            "0.0.0.0",
            "--advertise-host",
            address,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    volume = tmp_path / "cache-volume"
    volume.mkdir()
    volume.chmod(0o777)  # the download runs as the image's user; hostPath volumes take no fsGroup
    pv = f"sovereign-node-cache-{secrets.token_hex(3)}"
    try:
        assert hub.stdout is not None
        endpoint = json.loads(hub.stdout.readline())["endpoint"]
        kube.run(
            "create", "secret", "generic", "hf-token", "-n", namespace, "--from-literal=token=hf_node_test"
        )
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv},
                "spec": {
                    "capacity": {"storage": "10Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": pv,
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(volume)},
                    "nodeAffinity": {
                        "required": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                                    ]
                                }
                            ]
                        }
                    },
                },
            }
        )
        spec = hf_spec(pv)
        spec["model"]["source"]["huggingFace"]["endpoint"] = endpoint
        spec["runtime"]["image"] = real_node_runtime_image
        spec["decode"]["nodeSelector"] = {"kubernetes.io/hostname": node}
        kube.apply(llmd("real", spec), namespace)
        model = wait_for(
            "the download Complete",
            lambda: m if (m := model_status(kube, namespace, "real")).get("phase") == "Complete" else None,
            timeout=600,
        )
        files = {p.relative_to(volume / "checkpoint").as_posix() for p in (volume / "checkpoint").rglob("*")}
        assert files == {p.name for p in checkpoint.iterdir()}
        assert json.loads((volume / "complete.json").read_text())["commit"] == model["commit"]
        wait_ready(kube, operator, namespace, "real", timeout=600)
    finally:
        hub.kill()
        hub.wait(10)
        kube.run("delete", "pv", pv, "--wait=false", check=False)
