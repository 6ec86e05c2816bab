"""The autoscaler on the local control plane: a Prometheus-compatible endpoint on 127.0.0.1 replays
a KV-cache load series (the operator runs as a local subprocess, so it reaches it); the real
StatefulSet controller, scheduler and kwok move the pods. Replicas must follow the policy, status
must say why, and `spec` must never change (GitOps sees no drift)."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from cluster_helpers import DEEPSEEK_V3_FP8, Kubectl, OperatorHandle, condition, llmd, wait_for

# The operator must reach the replayed Prometheus on 127.0.0.1, and the pods need fake GPU nodes.
pytestmark = [pytest.mark.cluster, pytest.mark.fake_gpu_nodes, pytest.mark.local_operator]


class FakePrometheus:
    """Answers the autoscaler's instant queries from `load` (KV demand in pods at 100 %) and
    `pods` (ready pods, kept current by the test)."""

    def __init__(self) -> None:
        self.load = 0.2
        self.pods = 1
        self.up = True
        self.queries = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query).get("query", [""])[0]
                outer.queries += 1
                value = outer.answer(query)
                result = [] if value is None else [{"metric": {}, "value": [time.time(), str(value)]}]
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, query: str) -> float | None:
        if not self.up:
            return None
        n = max(1, self.pods)
        if query.startswith("count("):
            return float(n)
        if query.startswith("min(timestamp("):
            return time.time()
        if query.startswith(("avg(vllm:kv_cache_usage_perc", "max(vllm:kv_cache_usage_perc")):
            return min(1.0, self.load / n)
        if query.startswith("sum(vllm:num_requests"):
            return 0.0
        return None  # latency and backlog series: none (idle)


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()


def autoscaled_llmd(name: str, prometheus_url: str) -> dict[str, Any]:
    spec = {
        **copy.deepcopy(DEEPSEEK_V3_FP8),
        "mode": "unified",
        "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 3, "kvCacheUsageTarget": 0.5}},
        "autoscaling": {
            "metrics": {"source": "prometheus", "prometheusUrl": prometheus_url},
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 20,
            "intervalSeconds": 5,
        },
    }
    return llmd(name, spec)


def pool(kube: Kubectl, ns: str, name: str, fake: FakePrometheus) -> tuple[int, int]:
    """(StatefulSet replicas, ready replicas); keeps the fake's pod count in step."""
    sts = kube.get_or_none("statefulset", "-n", ns, f"{name}-unified")
    if sts is None:
        return 0, 0
    ready = int(sts.get("status", {}).get("readyReplicas") or 0)
    fake.pods = max(1, ready)
    return int(sts["spec"]["replicas"]), ready


def test_replicas_follow_replayed_load_and_status_explains(
    kube: Kubectl, operator: OperatorHandle, namespace: str, prometheus: FakePrometheus
) -> None:
    kube.apply(autoscaled_llmd("auto", prometheus.url), namespace)
    wait_for(
        "the pool at its minimum", lambda: pool(kube, namespace, "auto", prometheus) == (1, 1), timeout=120
    )
    before = kube.get("llmd", "-n", namespace, "auto")

    # Load for 2.4 pods at 100 % with a 0.5 target: 3 replicas (the max), one step at a time.
    prometheus.load = 2.4
    seen: list[int] = []

    def at_max() -> bool:
        replicas, ready = pool(kube, namespace, "auto", prometheus)
        if not seen or seen[-1] != replicas:
            seen.append(replicas)
        return replicas == 3 and ready == 3

    wait_for("scale-up to 3 ready replicas", at_max, timeout=180)
    assert seen == sorted(seen), f"replicas went down while load rose: {seen}"
    obj = kube.get("llmd", "-n", namespace, "auto")
    auto = obj["status"]["pools"]["unified"]["autoscaler"]
    assert auto["desiredReplicas"] == 3 and auto["signal"] == "kv_cache_usage", auto
    assert [h["to"] for h in auto["history"]][-1] == 3, auto["history"]
    assert (condition(obj, "MetricsAvailable") or {}).get("status") == "True"
    # GitOps: the decision lives in status and the StatefulSet, never in spec.
    assert obj["spec"] == before["spec"] and obj["metadata"]["generation"] == before["metadata"]["generation"]
    reasons = {
        e.get("reason")
        for e in kube.items("events", "-n", namespace, "--field-selector", "involvedObject.name=auto")
    }
    assert "ScaledUp" in reasons, reasons

    # Metrics vanish: nothing moves, and the condition says why.
    prometheus.up = False
    wait_for(
        "MetricsAvailable=False",
        lambda: (
            (condition(kube.get("llmd", "-n", namespace, "auto"), "MetricsAvailable") or {}).get("status")
            == "False"
        ),
        timeout=60,
    )
    time.sleep(12)
    assert pool(kube, namespace, "auto", prometheus)[0] == 3

    # Metrics back (still loaded): the condition recovers; then the load goes away and the pool
    # comes down to its minimum only after the 20 s window, one pod per round.
    prometheus.up = True

    def metrics_back() -> bool:
        obj = kube.get("llmd", "-n", namespace, "auto")
        return (condition(obj, "MetricsAvailable") or {}).get("status") == "True"

    wait_for("MetricsAvailable=True again", metrics_back, timeout=60)
    time.sleep(6)  # one more round with the load present
    prometheus.load = 0.1
    started = time.monotonic()
    wait_for("scale-down to 1", lambda: pool(kube, namespace, "auto", prometheus)[0] == 1, timeout=180)
    # The last loaded round was at most one interval (5 s) before `started`.
    assert time.monotonic() - started >= 15
    obj = kube.get("llmd", "-n", namespace, "auto")
    history = obj["status"]["pools"]["unified"]["autoscaler"]["history"]
    assert [h["to"] for h in history][-2:] == [2, 1], history
    assert obj["spec"] == before["spec"]
