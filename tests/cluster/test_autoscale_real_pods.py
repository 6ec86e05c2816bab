"""Autoscaling from the real pods' `/metrics`, on the local cluster's real node (issue 11).

The tiny deployment's pool is autoscaled on queued requests (`decode.autoscaling.waitingRequestsTarget`)
with the default metrics source: the operator (a process on this machine, which routes to the node's pod
network) scrapes each ready runtime pod's `/metrics`. Each worker runs one sequence at a time
(`--max-num-seqs 1`), so clients streaming through `status.endpoint` queue in the runtime: the pool rises to
its maximum (six clients: about two queued per pod at the maximum, so the gaps between one client's
requests never make the loaded pool look idle); once the clients stop the queue empties and the pool comes back to its minimum after the
(short, from spec) scale-down window. Every decision is in `status.pools.unified.autoscaler` and an Event;
`spec` never changes.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from cluster_helpers import (
    Kubectl,
    OperatorHandle,
    condition,
    get_llmd,
    llmd,
    port_forward,
    wait_for,
    wait_ready,
)
from openai import OpenAI
from test_real_pods import (
    READY_TIMEOUT,
    StreamingLoad,
    endpoint_service,
    tiny_spec,
    wait_for_server,
    worker_pods,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "auto"
SCALE_DOWN_WINDOW_S = 15
INTERVAL_S = 5


def autoscaled_tiny() -> dict[str, Any]:
    spec = tiny_spec(args=["--max-num-seqs", "1"])
    spec["decode"] = {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "waitingRequestsTarget": 1}}
    spec["autoscaling"] = {
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW_S,
        "intervalSeconds": INTERVAL_S,
    }
    return spec


def autoscaler(kube: Kubectl, ns: str) -> dict[str, Any]:
    return dict(get_llmd(kube, ns, NAME)["status"]["pools"]["unified"].get("autoscaler") or {})


def ready_workers(kube: Kubectl, ns: str) -> int:
    return sum(
        1
        for p in worker_pods(kube, ns, NAME)
        if any(
            c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", [])
        )
    )


def replicas(kube: Kubectl, ns: str) -> int:
    return int(kube.get("statefulset", f"{NAME}-unified", "-n", ns)["spec"]["replicas"])


def test_load_through_the_endpoint_scales_the_pool_up_and_its_removal_down(
    kube: Kubectl, operator: OperatorHandle, real_pods_namespace: str
) -> None:
    ns = real_pods_namespace
    kube.apply(llmd(NAME, autoscaled_tiny()), ns)
    obj = wait_ready(kube, operator, ns, NAME, timeout=READY_TIMEOUT)
    before = obj["spec"]
    # Idle: the pods' metrics arrive and hold the pool at its minimum.
    idle = wait_for(
        "an idle decision from the pods' metrics",
        lambda: a if (a := autoscaler(kube, ns)).get("signal") not in (None, "none") else None,
        timeout=60,
    )
    assert idle["desiredReplicas"] == 1 and replicas(kube, ns) == 1, idle
    assert (condition(get_llmd(kube, ns, NAME), "MetricsAvailable") or {}).get("status") == "True"

    service, port = endpoint_service(obj)
    with port_forward(kube, ns, service, port) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
        wait_for_server(client)
        load = StreamingLoad(client, obj["spec"]["model"]["name"], clients=6)
        threads = load.run()
        loaded_at = time.monotonic()
        try:
            wait_for("the scale-up to 2", lambda: replicas(kube, ns) == 2, timeout=120, interval=1)
            up_after = time.monotonic() - loaded_at
            up = autoscaler(kube, ns)
            assert up["history"][-1]["to"] == 2 and up["history"][-1]["signal"] == "requests_waiting", up
            wait_for("the second pod Ready", lambda: ready_workers(kube, ns) == 2, timeout=READY_TIMEOUT)
            serving_after = time.monotonic() - loaded_at
            # Loaded and at its maximum, the pool stays there while the clients stream.
            served = load.completed
            wait_for("streams on two pods", lambda: load.completed >= served + 8, timeout=120, interval=1)
            assert replicas(kube, ns) == 2
        finally:
            # No new request from here on; those in flight and queued still finish (the join).
            stopped_at = time.monotonic()
            load.stop.set()
            for thread in threads:
                thread.join(150)
    assert not load.failures, load.failures[:5]

    wait_for("the scale-down to 1", lambda: replicas(kube, ns) == 1, timeout=120, interval=1)
    down_after = time.monotonic() - stopped_at
    # Not before the window: the queues were full until the clients stopped, so a round at most one
    # interval before that recommended 2, and the window keeps it for 15 s.
    assert down_after >= SCALE_DOWN_WINDOW_S - INTERVAL_S, down_after
    obj = get_llmd(kube, ns, NAME)
    auto = obj["status"]["pools"]["unified"]["autoscaler"]
    assert [h["to"] for h in auto["history"]][-2:] == [2, 1], auto["history"]
    assert auto["desiredReplicas"] == 1, auto
    events = kube.items("events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")
    messages = {e["reason"]: e["message"] for e in events if e["reason"] in ("ScaledUp", "ScaledDown")}
    assert "requests_waiting" in messages.get("ScaledUp", ""), messages
    assert f"highest recommendation over {SCALE_DOWN_WINDOW_S}s is 1" in messages.get("ScaledDown", ""), (
        messages
    )
    # GitOps: the decisions live in status, the StatefulSet and Events, never in spec.
    assert obj["spec"] == before
    print(
        f"\nautoscaling from the pods' /metrics: {load.completed} streams, 0 failed; 1 -> 2 replicas "
        f"{up_after:.0f} s after the load began (both pods Ready after {serving_after:.0f} s), "
        f"2 -> 1 {down_after:.0f} s after it stopped; "
        f"events: {messages}"
    )
