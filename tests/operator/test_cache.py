"""The watch cache: what status, prune and the resync read instead of the apiserver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.cache import APPLIED_DIGEST, CHILD_KINDS, ClusterCache
from sovereign_operator.render import ClusterFacts, DeploymentRef, render

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LABELS = {"app.kubernetes.io/instance": "llm", "app.kubernetes.io/component": "unified"}


def _obj(kind: str, name: str, rv: str = "1", **extra: Any) -> dict[str, Any]:
    meta = {
        "name": name,
        "namespace": "ns",
        "labels": LABELS,
        "resourceVersion": rv,
        "uid": f"u-{kind}-{name}",
    }
    meta.update(extra.pop("metadata", {}))
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, **extra}


def _deployment(rv: str, ready: str) -> dict[str, Any]:
    return {
        "apiVersion": "sovereign.ai/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llm", "namespace": "ns", "resourceVersion": rv, "generation": 1},
        "spec": {},
        "status": {"ready": ready},
    }


def test_every_kind_the_renderer_produces_is_watched() -> None:
    """A rendered kind the cache does not hold would be re-applied after every restart."""
    watched = {k.kind for k in CHILD_KINDS}
    specs = [TINY_SPEC, DEEPSEEK_SPEC]
    specs += [d["spec"] for d in yaml.safe_load_all((EXAMPLES / "tiny.yaml").read_text()) if d]
    specs += [d["spec"] for d in yaml.safe_load_all((EXAMPLES / "deepseek-v3-pd.yaml").read_text()) if d]
    ref = DeploymentRef("llm", "ns", "uid-1")
    for spec in specs:
        for facts in (ClusterFacts(), ClusterFacts(frozenset({"rdma/rdma_shared_device_a"}))):
            rendered = render(ref, LLMDeploymentSpec.model_validate(spec), facts)
            assert {c["kind"] for c in rendered.children} <= watched


def test_observed_comes_from_the_cache_without_managed_fields() -> None:
    cache = ClusterCache()
    sts = _obj(
        "StatefulSet", "llm-unified", status={"readyReplicas": 1}, metadata={"managedFields": [{"x": 1}]}
    )
    cache.put(sts)
    cache.put(_obj("Deployment", "llm-router", status={"readyReplicas": 1}))
    cache.put(_obj("Pod", "llm-unified-1", status={"phase": "Running"}))
    cache.put(_obj("Pod", "llm-unified-0", status={"phase": "Pending"}))
    cache.put(_obj("Service", "llm", spec={"ports": []}))
    other = _obj("Pod", "other-0")
    other["metadata"]["labels"] = {"app.kubernetes.io/instance": "other"}
    cache.put(other)
    observed = cache.observed("ns", "llm")
    assert observed.statefulsets["unified"]["status"] == {"readyReplicas": 1}
    assert "managedFields" not in observed.statefulsets["unified"]["metadata"]
    assert observed.router is not None and observed.router["metadata"]["name"] == "llm-router"
    assert [p["metadata"]["name"] for p in observed.pods] == ["llm-unified-0", "llm-unified-1"]
    # Kinds whose status the operator never reads keep only their metadata.
    (service,) = cache.children("ns", "llm", ["Service"])
    assert set(service) == {"apiVersion", "kind", "metadata"}
    cache.remove("Pod", "ns", "llm-unified-0")
    assert [p["metadata"]["name"] for p in cache.observed("ns", "llm").pods] == ["llm-unified-1"]


def test_an_older_version_never_replaces_a_newer_one() -> None:
    cache = ClusterCache()
    cache.put(_obj("StatefulSet", "llm-unified", rv="7", status={"replicas": 2}))
    cache.put(_obj("StatefulSet", "llm-unified", rv="5", status={"replicas": 1}))
    assert cache.observed("ns", "llm").statefulsets["unified"]["status"] == {"replicas": 2}
    # The operator's own status write is newer than the watch event that trails it.
    cache.record(_deployment("10", "True"))
    cache.put(_deployment("9", "False"))
    deployment = cache.deployment("ns", "llm")
    assert deployment is not None and deployment["status"] == {"ready": "True"}
    deployment["status"]["ready"] = "changed by a caller"
    assert cache.deployment("ns", "llm")["status"] == {"ready": "True"}  # type: ignore[index]


def test_a_stale_deployment_is_read_afresh_until_a_newer_version_arrives() -> None:
    cache = ClusterCache()
    cache.put(_deployment("3", "False"))
    cache.forget_deployment("ns", "llm")
    assert cache.deployment("ns", "llm") is None and cache.knows_deployment("ns", "llm")
    cache.put(_deployment("2", "False"))
    assert cache.deployment("ns", "llm") is None
    cache.put(_deployment("4", "True"))
    assert cache.deployment("ns", "llm") is not None


def test_applied_digest_is_read_from_the_live_childs_annotation() -> None:
    cache = ClusterCache()
    cache.put(_obj("ConfigMap", "llm-config", metadata={"annotations": {APPLIED_DIGEST: "abc"}}))
    cache.put(_obj("Service", "llm"))
    assert cache.applied_digest("ns", "ConfigMap", "llm-config") == "abc"
    assert cache.applied_digest("ns", "Service", "llm") is None
    assert cache.applied_digest("ns", "Role", "llm-router") is None


def test_sweep_drops_what_a_relist_no_longer_returns_but_keeps_what_changed_since() -> None:
    cache = ClusterCache()
    for name in ("llm-unified-0", "llm-unified-1", "llm-unified-2"):
        cache.put(_obj("Pod", name))
    other = _obj("Pod", "elsewhere-0")
    other["metadata"]["namespace"] = "other"
    cache.put(other)
    cache.put(_deployment("1", "True"))
    since = cache.mark()
    # An event that arrives after the LIST started is newer than the LIST's answer.
    cache.put(_obj("Pod", "llm-unified-2", rv="2"))
    dropped = cache.sweep("Pod", [("ns", "llm-unified-0")], since, namespace="ns")
    assert [d["metadata"]["name"] for d in dropped] == ["llm-unified-1"]
    assert [p["metadata"]["name"] for p in cache.observed("ns", "llm").pods] == [
        "llm-unified-0",
        "llm-unified-2",
    ]
    assert cache.children("other", "llm")  # another namespace: untouched
    # Every namespace at once (an informer's relist).
    assert [d["metadata"]["name"] for d in cache.sweep("Pod", [], cache.mark())] == [
        "llm-unified-0",
        "llm-unified-2",
        "elsewhere-0",
    ]
    assert [d["metadata"]["name"] for d in cache.sweep("LLMDeployment", [], cache.mark(), "ns")] == ["llm"]
    assert not cache.knows_deployment("ns", "llm")


def test_shared_objects_and_job_pods_are_kept_by_name_and_swept() -> None:
    """Model caches and their Jobs carry no deployment's instance label: kept by name, and the Jobs'
    pods by their Job; a relist sweeps them like any child."""
    cache = ClusterCache()
    owned = {"app.kubernetes.io/managed-by": "sovereign-operator"}
    for kind, name, labels in (
        ("Job", "resolve", owned),
        ("PersistentVolumeClaim", "cache", owned),
        ("Pod", "resolve-abc", {**owned, "batch.kubernetes.io/job-name": "resolve"}),
        ("Pod", "stray", owned),  # neither a deployment's nor a Job's: not kept
    ):
        cache.put({"kind": kind, "metadata": {"name": name, "namespace": "ns", "labels": labels}})
    assert [o["metadata"]["name"] for o in cache.shared("ns", "Job")] == ["resolve"]
    assert [o["metadata"]["name"] for o in cache.shared("ns", "PersistentVolumeClaim")] == ["cache"]
    assert cache.shared("other", "Job") == []
    assert [p["metadata"]["name"] for p in cache.job_pods("ns", "resolve")] == ["resolve-abc"]
    assert cache.shared_object("ns", "Pod", "stray") is None
    since = cache.mark()
    assert [d["metadata"]["name"] for d in cache.sweep("Pod", [], since)] == ["resolve-abc"]
    assert cache.job_pods("ns", "resolve") == []
    cache.remove("Job", "ns", "resolve")
    assert cache.shared_object("ns", "Job", "resolve") is None
