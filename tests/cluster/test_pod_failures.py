"""A pod's failure shows on its LLMDeployment within seconds of the kubelet reporting it.

The operator watches its pods (kopf), so a pod status change refreshes the deployment's status at once,
not at some periodic resync. kwok's pods run no containers, so the test writes the pod's status as a
kubelet would report an OOM kill and then an image it cannot pull. kwok re-runs its start stages on a
pod that is not Ready, so the patches leave the pod's conditions as kwok made them and change the
container's state only: that is what the operator reads. The real node's end-to-end tests show the same
with a real pull and a real OOM.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
from cluster_helpers import Kubectl, OperatorHandle, condition, get_llmd, llmd, wait_for, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.fake_gpu_nodes]

INSTANCE = "app.kubernetes.io/instance"
# Well under the operator loop's 5 s tick: only the pod watch can be this fast.
PROMPT_S = 4.0
SPEC: dict[str, Any] = {
    "model": {"name": "sovereign-tiny", "source": {"builtin": "sovereign-tiny"}},
    "mode": "unified",
    "runtime": {
        "image": "ghcr.io/sovereign-ai/sovereign-runtime:does-not-exist",
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "4Gi"}},
    },
    "decode": {"replicas": 1},
}


def _degraded(kube: Kubectl, ns: str, reason: str) -> dict[str, Any] | None:
    cond = condition(get_llmd(kube, ns, "bad"), "Degraded")
    return cond if cond and cond["status"] == "True" and cond["reason"] == reason else None


def _set_container_state(kube: Kubectl, ns: str, pod: dict[str, Any], **fields: Any) -> float:
    status = copy.deepcopy(pod["status"]["containerStatuses"][0])
    status.update(fields)
    patch = {"status": {"containerStatuses": [status]}}
    kube.run(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(patch),
    )
    return time.monotonic()


def test_a_failing_pod_shows_on_the_deployment_within_seconds(
    kube: Kubectl, operator: OperatorHandle, namespace: str
) -> None:
    kube.apply(llmd("bad", SPEC), namespace)
    wait_ready(kube, operator, namespace, "bad")
    (pod,) = [
        p
        for p in kube.items("pods", "-n", namespace, "-l", f"{INSTANCE}=bad")
        if p["metadata"]["labels"].get("app.kubernetes.io/component") == "unified"
    ]
    running = pod["status"]["containerStatuses"][0]

    # The container is OOM-killed at its limit, and the kubelet backs off before restarting it.
    killed_at = _set_container_state(
        kube,
        namespace,
        pod,
        ready=False,
        started=False,
        restartCount=1,
        state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        lastState={
            "terminated": {
                "reason": "OOMKilled",
                "exitCode": 137,
                "startedAt": running["state"]["running"]["startedAt"],
                "finishedAt": running["state"]["running"]["startedAt"],
            }
        },
    )
    cond = wait_for("Degraded OOMKilled", lambda: _degraded(kube, namespace, "OOMKilled"), timeout=30)
    oom_s = time.monotonic() - killed_at
    assert "(4Gi)" in cond["message"] and "spec.decode.resources.limits.memory" in cond["message"], cond
    # The kill of a life the operator saw run is an Event on the LLMDeployment too.
    events = wait_for(
        "an OOMKilled Event",
        lambda: [
            e
            for e in kube.items("events", "-n", namespace, "--field-selector", "involvedObject.name=bad")
            if e["reason"] == "OOMKilled"
        ],
        timeout=30,
    )
    assert events[0]["type"] == "Warning" and "(4Gi)" in events[0]["message"]
    # Recreated, the pod's image cannot be pulled (say, on another node).
    pulled_at = _set_container_state(
        kube,
        namespace,
        pod,
        ready=False,
        started=False,
        state={"waiting": {"reason": "ErrImagePull", "message": "failed to resolve reference: not found"}},
    )
    cond = wait_for(
        "Degraded ImagePullFailed", lambda: _degraded(kube, namespace, "ImagePullFailed"), timeout=30
    )
    pull_s = time.monotonic() - pulled_at
    assert "does-not-exist" in cond["message"] and "imported" in cond["message"], cond
    # Its back-off state says the same: no second write of the condition.
    before = get_llmd(kube, namespace, "bad")["metadata"]["resourceVersion"]
    _set_container_state(
        kube,
        namespace,
        pod,
        ready=False,
        started=False,
        state={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
    )
    time.sleep(2)
    assert get_llmd(kube, namespace, "bad")["metadata"]["resourceVersion"] == before

    assert pull_s < PROMPT_S and oom_s < PROMPT_S, (pull_s, oom_s)
