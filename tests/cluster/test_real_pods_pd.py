"""More of the operator's pods on the local cluster's real node (test_real_pods.py has the pattern):

- `examples/tiny-pd.yaml` as a user applies it: prefill, decode and router pods Ready through the
  kubelet's real probes, the model answering checkable questions through `status.endpoint` (router ->
  decode -> prefill), and the pods' own `/metrics` proving each answer's prompt was prefilled on the
  prefill pod and its KV cache sent over TCP to the decode pod (no local fallback).
- A rolling update under streaming load: a changed runtime argument rolls the two-replica pool's
  StatefulSet while clients stream through the endpoint; no request fails and the pool never has
  fewer Ready pods than its PodDisruptionBudget allows.
- Bad input on a kubelet: an image the node does not hold (nothing can be pulled here), a memory
  limit far below what the model needs and a startup that never completes each turn into a
  `Degraded` condition with its reason on the `LLMDeployment` within one reconcile of the kubelet
  reporting it, not only into pod events.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from cluster_helpers import (
    EXAMPLES,
    KUBECTL,
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
from prometheus_client.parser import text_string_to_metric_families
from sovereign_operator.api.spec import DEFAULT_RUNTIME_IMAGE
from sovereign_operator.podstatus import observed_startup_seconds
from sovereign_operator.render.children import EXIT_GRACE_SECONDS
from sovereign_runtime.builtin.tasks import make_questions
from test_real_pods import (
    INSTANCE,
    READY_TIMEOUT,
    StreamingLoad,
    ask,
    assert_mostly_correct,
    endpoint_service,
    pods_of,
    restarts,
    tiny_spec,
    wait_for_server,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

COMPONENT = "app.kubernetes.io/component"


def component_pods(kube: Kubectl, ns: str, name: str, component: str) -> list[dict[str, Any]]:
    """The pool's pods, minus those already terminating."""
    pods = kube.items("pods", "-n", ns, "-l", f"{INSTANCE}={name},{COMPONENT}={component}")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pod_metrics(kube: Kubectl, pod: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The pod's /metrics, through a port-forward (the host of a kind cluster has no route to pods)."""
    meta = pod["metadata"]
    with port_forward(kube, meta["namespace"], meta["name"], 8000, kind="pod") as base:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    wanted = set(labels.items())
    return sum(value for (n, have), value in samples.items() if n == name and wanted <= set(have))


def test_tiny_pd_prefills_on_the_prefill_pod_and_streams_the_kv_to_decode(
    kube: Kubectl, operator: OperatorHandle, real_pods_namespace: str, real_nodes: frozenset[str]
) -> None:
    ns, name = real_pods_namespace, "tiny-pd"
    applied = time.monotonic()
    kube.run("apply", "-n", ns, "-f", str(EXAMPLES / "tiny-pd.yaml"))
    obj = wait_ready(kube, operator, ns, name, timeout=READY_TIMEOUT)
    ready_after = time.monotonic() - applied
    assert obj["status"]["mode"] == "disaggregated" and obj["status"]["kvTransport"] == "tcp", obj["status"]
    pods = pods_of(kube, ns, name)
    assert sorted(p["metadata"]["labels"][COMPONENT] for p in pods) == ["decode", "prefill", "router"]
    assert {p["spec"]["nodeName"] for p in pods} <= real_nodes
    for pod in pods:
        assert restarts(pod) == 0, pod["status"]
    print(f"\ntiny-pd: kubectl apply -> Ready in {ready_after:.1f} s")

    (prefill,) = component_pods(kube, ns, name, "prefill")
    (decode,) = component_pods(kube, ns, name, "decode")
    # Fresh pods: nothing was transferred before the questions (the startup self-test runs locally).
    assert metric(pod_metrics(kube, prefill), "sovereign:kv_transfer_seconds_count", role="prefill") == 0

    service, port = endpoint_service(obj)
    questions = make_questions(4, seed=12)
    with port_forward(kube, ns, service, port) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
        wait_for_server(client)
        answers = ask(client, obj["spec"]["model"]["name"], questions)
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            router_text = response.read().decode()
    assert_mostly_correct(questions, answers)

    # The router paired every request with the prefill pool ...
    router = {
        s.name: s.value
        for family in text_string_to_metric_families(router_text)
        for s in family.samples
        if s.name == "sovereign_router_disaggregated_requests_total"
    }
    assert router.get("sovereign_router_disaggregated_requests_total", 0) >= len(questions), router
    # ... the prefill pod computed each prompt and sent its KV cache, the decode pod received it, and
    # none of them fell back to a local prefill on the decode pod.
    sent, received = pod_metrics(kube, prefill), pod_metrics(kube, decode)
    transfers = metric(sent, "sovereign:kv_transfer_seconds_count", role="prefill")
    assert transfers >= len(questions), transfers
    assert metric(sent, "sovereign:kv_transfer_bytes_total", role="prefill") > 0
    assert (
        metric(received, "sovereign:kv_transfer_tokens_total", role="decode")
        == metric(sent, "sovereign:kv_transfer_tokens_total", role="prefill")
        > 0
    )
    assert metric(received, "sovereign:kv_transfer_seconds_count", role="decode") >= len(questions)
    for samples in (sent, received):
        assert metric(samples, "sovereign:kv_transfer_failures_total") == 0
        assert metric(samples, "sovereign:kv_transfer_fallbacks_total") == 0
    # The decode pod generated every answer's tokens; the prefill pod only each one's first.
    generated = metric(received, "vllm:generation_tokens_total")
    assert generated > metric(sent, "vllm:generation_tokens_total"), (generated, sent)
    print(
        f"tiny-pd: {int(transfers)} KV transfers, {int(metric(sent, 'sovereign:kv_transfer_bytes_total'))} bytes"
    )


def ready_now(pod: dict[str, Any]) -> bool:
    ready = next((c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"), {})
    return ready.get("status") == "True"


# One line per watch event: type, pod name, deletionTimestamp (empty while the pod lives), Ready.
WATCH_FORMAT = (
    'jsonpath={.type}{"|"}{.object.metadata.name}{"|"}{.object.metadata.deletionTimestamp}{"|"}'
    '{.object.status.conditions[?(@.type=="Ready")].status}{"\\n"}'
)


class HealthyPodsWatch:
    """Counts a pool's healthy pods (Ready and not being deleted: what a PodDisruptionBudget counts)
    at every change, from a `kubectl get pods --watch`: no transition is missed between two polls, and
    it costs one process instead of one per sample."""

    def __init__(self, kube: Kubectl, ns: str, selector: str) -> None:
        self.healthy: dict[str, bool] = {}
        self.counts: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        get = [KUBECTL, "--kubeconfig", str(kube.kubeconfig), "get", "pods", "-n", ns, "-l", selector]
        self.proc = subprocess.Popen(
            [*get, "--watch", "--output-watch-events", "-o", WATCH_FORMAT],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, name, deleting, ready = line.rstrip("\n").split("|")
            with self.lock:
                if kind == "DELETED":
                    self.healthy.pop(name, None)
                else:
                    self.healthy[name] = not deleting and ready == "True"
                self.counts.append((time.monotonic(), sum(self.healthy.values())))

    def now(self) -> int:
        with self.lock:
            return sum(self.healthy.values())

    def fewest_since(self, since: float) -> int:
        with self.lock:
            return min(count for at, count in self.counts if at >= since) if self.counts else -1

    def changes_since(self, since: float) -> int:
        with self.lock:
            return sum(1 for at, _ in self.counts if at >= since)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.reader.join(10)


def test_rolling_update_under_streaming_load_loses_no_request_and_respects_the_pdb(
    kube: Kubectl, operator: OperatorHandle, real_pods_namespace: str
) -> None:
    ns, name = real_pods_namespace, "roll"
    replicas = 2
    kube.apply(llmd(name, tiny_spec(replicas=replicas)), ns)
    obj = wait_ready(kube, operator, ns, name, timeout=READY_TIMEOUT)
    pool = f"{name}-unified"
    pdb = kube.get("pdb", "-n", ns, pool)
    floor = replicas - int(pdb["spec"]["maxUnavailable"])
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in component_pods(kube, ns, name, "unified")}
    assert len(before) == replicas

    def rolled() -> bool:
        pods = component_pods(kube, ns, name, "unified")
        sts = kube.get("statefulset", "-n", ns, pool)["status"]
        return (
            len(pods) == replicas
            and all(before.get(p["metadata"]["name"]) != p["metadata"]["uid"] for p in pods)
            and all(ready_now(p) for p in pods)
            and sts.get("updateRevision") == sts.get("currentRevision")
            and sts.get("updatedReplicas") == replicas
        )

    service, port = endpoint_service(obj)
    watch = HealthyPodsWatch(kube, ns, f"{INSTANCE}={name},{COMPONENT}=unified")
    try:
        wait_for("the watch to list the pool", lambda: watch.now() == replicas, timeout=30)
        with port_forward(kube, ns, service, port) as base:
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
            wait_for_server(client)
            # Two clients: a third would slow the new pods' start on two CPUs without adding evidence.
            load = StreamingLoad(client, obj["spec"]["model"]["name"], clients=2)
            threads = load.run()
            try:
                wait_for("streams to complete", lambda: load.completed >= 6, timeout=120, interval=0.5)
                patch = {"spec": {"runtime": {"args": ["--max-num-seqs", "32"]}}}
                changed = time.monotonic()
                kube.run("patch", "llmd", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))
                wait_for("the pool to roll onto the new argument", rolled, timeout=300, interval=1)
                rolled_after = time.monotonic() - changed
                during = load.completed
                # New requests keep succeeding on the new pods.
                wait_for("streams after the roll", lambda: load.completed >= during + 6, timeout=120)
            finally:
                load.stop.set()
                for thread in threads:
                    thread.join(150)
        fewest, changes = watch.fewest_since(changed), watch.changes_since(changed)
    finally:
        watch.stop()
    assert not load.failures, load.failures[:5]
    new_pods = component_pods(kube, ns, name, "unified")
    for pod in new_pods:
        (container,) = pod["spec"]["containers"]
        assert container["args"][-2:] == ["--max-num-seqs", "32"], container["args"]
        assert restarts(pod) == 0, pod["status"]
    # Each pod went unhealthy and came back: at least four changes, and never below the floor.
    assert changes >= 2 * replicas and fewest >= floor, (changes, fewest, floor)
    # The router Deployment does not read runtime arguments: it served throughout without a restart.
    (router,) = component_pods(kube, ns, name, "router")
    assert restarts(router) == 0
    starts = [observed_startup_seconds(p) for p in new_pods]
    print(
        f"\nroll: {load.completed} streams, 0 failed; rolled in {rolled_after:.1f} s (new pods started in"
        f" {starts} s); {changes} changes of the pool's healthy pods, fewest {fewest} (PDB floor {floor})"
    )


# Well over the operator's pod watch (instant) and under its periodic loop's second round: the
# condition follows the kubelet's report within one reconcile.
ONE_RECONCILE_S = 10.0


def _waiting_or_ended_reason(pod: dict[str, Any]) -> set[str]:
    reasons = set()
    for status in pod.get("status", {}).get("containerStatuses") or []:
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            for kind in ("waiting", "terminated"):
                if state.get(kind, {}).get("reason"):
                    reasons.add(state[kind]["reason"])
    return reasons


def _restarted_by_startup_probe(pod: dict[str, Any]) -> set[str]:
    return {"StartupProbeRestart"} if restarts(pod) >= 1 else set()


def test_bad_input_on_a_kubelet_is_a_degraded_condition_within_one_reconcile(
    kube: Kubectl, operator: OperatorHandle, real_pods_namespace: str
) -> None:
    ns = real_pods_namespace
    small = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    missing_image = DEFAULT_RUNTIME_IMAGE.rsplit(":", 1)[0] + ":never-imported"
    cases: dict[str, tuple[dict[str, Any], str, Callable[[dict[str, Any]], set[str]], set[str]]] = {
        # No registry is reachable from the node: IfNotPresent of a tag it does not hold fails at once.
        "noimage": (
            tiny_spec(image=missing_image, imagePullPolicy="IfNotPresent"),
            "ImagePullFailed",
            _waiting_or_ended_reason,
            {"ErrImagePull", "ImagePullBackOff"},
        ),
        # Importing torch alone needs more than this.
        "oom": (
            tiny_spec(resources={**small, "limits": {"memory": "96Mi"}}),
            "OOMKilled",
            _waiting_or_ended_reason,
            {"OOMKilled"},
        ),
        # The runtime never leaves `compiling`; the kubelet's startup probe gives up after about 25 s.
        "stuck": (
            {
                **tiny_spec(
                    args=["--enable-fault-injection", "--debug-hold-compiling-s", "3600"],
                    resources={**small, "limits": {"memory": "4Gi"}},
                ),
                "startup": {"budgetSeconds": 25},
            },
            "StartupProbeFailed",
            _restarted_by_startup_probe,
            {"StartupProbeRestart"},
        ),
    }
    for name, (spec, _, _, _) in cases.items():
        kube.apply(llmd(name, spec), ns)

    reported: dict[str, float] = {}
    degraded: dict[str, tuple[float, dict[str, Any]]] = {}

    def all_degraded() -> bool:
        for name, (_, reason, kubelet_says, expected) in cases.items():
            if name in degraded:
                continue
            cond = condition(get_llmd(kube, ns, name), "Degraded")
            now = time.monotonic()
            workers = [p for p in pods_of(kube, ns, name) if p["metadata"]["labels"][COMPONENT] == "unified"]
            if name not in reported and any(kubelet_says(p) & expected for p in workers):
                reported[name] = now
            if cond and cond["status"] == "True" and cond["reason"] == reason:
                degraded[name] = (now, cond)
        return len(degraded) == len(cases)

    wait_for("every deployment Degraded with its reason", all_degraded, timeout=READY_TIMEOUT, interval=0.5)
    messages = {name: cond["message"] for name, (_, cond) in degraded.items()}
    assert missing_image in messages["noimage"] and "imported" in messages["noimage"], messages
    assert "(96Mi)" in messages["oom"] and "spec.decode.resources.limits.memory" in messages["oom"], messages
    # The phase it names depends on how far the start got in the window (on a loaded node it may still
    # import torch); test_real_pods.py proves the phase on a wider window.
    assert "its startup probe failed for" in messages["stuck"], messages
    assert "spec.startup.budgetSeconds (" in messages["stuck"], messages
    lag = {name: round(at - reported.get(name, at), 1) for name, (at, _) in degraded.items()}
    # Each condition followed the kubelet's report (seen by this loop, at most a few seconds late).
    assert set(reported) == set(cases), (reported, messages)
    assert all(seconds <= ONE_RECONCILE_S for seconds in lag.values()), lag
    for name in cases:
        ready = condition(get_llmd(kube, ns, name), "Ready")
        assert ready and ready["status"] == "False", (name, ready)
    # Deleted, none of these pods waits out its grace period (a worker's is the drain timeout + 45 s):
    # whichever phase the runtime is in, even still importing torch, it ends on the kubelet's SIGTERM.
    deleted = time.monotonic()
    kube.run("delete", "llmd", "--all", "-n", ns, "--wait=true", timeout=120)
    wait_for("the pods to be gone", lambda: not kube.items("pods", "-n", ns), timeout=240)
    gone_after = time.monotonic() - deleted
    assert gone_after < EXIT_GRACE_SECONDS, gone_after
    print(
        f"\nbad input: condition after the kubelet's report (s): {lag}; pods gone {gone_after:.1f} s after delete"
        f"\nStartupProbeFailed: {messages['stuck']}"
    )
