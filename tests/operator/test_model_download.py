"""A huggingFace model source: the resolve Job, the shared cache claim and its download Job, the pools
waiting for them, status.model from the Jobs, and the reconciler taking a deployment through it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from operator_fakes import FakeKube, body_for
from operator_specs import with_changes
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.downloadmonitor import DownloadMonitor, unsettled
from sovereign_operator.modeldownload import JobView, assess, facts_from_status, latest_progress
from sovereign_operator.reconcile import Reconciler
from sovereign_operator.render import DeploymentRef, render
from sovereign_operator.render.modelcache import (
    ModelFacts,
    Resolved,
    Serving,
    cache_objects,
    cache_size,
    source_hash,
)
from sovereign_operator.render.plan import OperatorDefaults, with_operator_defaults

COMMIT = "3f5a1c9e" * 5
GIB = 2**30
HF_SPEC: dict[str, Any] = {
    "model": {
        "name": "deepseek-v3",
        "source": {
            "huggingFace": {
                "repo": "deepseek-ai/DeepSeek-V3",
                "revision": "main",
                "tokenSecretRef": {"name": "hf-token"},
                "allowPatterns": ["*.safetensors", "*.json"],
            }
        },
        "precision": "fp8",
    },
    "runtime": {"image": "registry.example/sovereign-runtime:1", "tensorParallelSize": 8},
    "mode": "unified",
    "decode": {"replicas": 2},
}
REF = DeploymentRef("llm", "ns", "uid-1")


def _spec(raw: dict[str, Any] = HF_SPEC) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate(raw)


def _kinds(children: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["kind"], c["metadata"]["name"]) for c in children]


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


# ---- rendering -------------------------------------------------------------------------------


def test_first_the_resolve_job_and_no_pools() -> None:
    rendered = render(REF, _spec())
    assert not any(kind == "StatefulSet" for kind, _ in _kinds(rendered.children))
    assert rendered.waiting_for_model
    (job,) = rendered.shared
    assert job["kind"] == "Job" and job["metadata"]["name"].startswith("hf-resolve-deepseek-ai-deepseek-v3-")
    assert job["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "sovereign.ai/v1alpha1",
            "kind": "LLMDeployment",
            "name": "llm",
            "uid": "uid-1",
            "controller": False,
            "blockOwnerDeletion": False,
        }
    ]
    container = _container(job)
    assert container["args"] == [
        "download",
        "--repo",
        "deepseek-ai/DeepSeek-V3",
        "--revision",
        "main",
        "--endpoint",
        "https://huggingface.co",
        "--allow-pattern",
        "*.safetensors",
        "--allow-pattern",
        "*.json",
        "--resolve-only",
    ]
    assert container["image"] == "registry.example/sovereign-runtime:1"
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert not any(v.get("persistentVolumeClaim") for v in job["spec"]["template"]["spec"]["volumes"])


def test_once_resolved_a_claim_sized_from_the_files_and_a_job_filling_it_by_commit() -> None:
    facts = ModelFacts(resolved=Resolved(COMMIT, 642 * GIB, 170))
    rendered = render(REF, _spec(), model=facts)
    claim, job = rendered.shared
    assert claim["kind"] == "PersistentVolumeClaim" and job["kind"] == "Job"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "676Gi"}},  # 642 GiB + 5% + 1 GiB, whole GiB
        "volumeMode": "Filesystem",
    }
    assert "ownerReferences" not in claim["metadata"]  # Retain: it outlives its users
    assert claim["metadata"]["annotations"]["sovereign.ai/commit"] == COMMIT
    assert job["metadata"]["name"].startswith(claim["metadata"]["name"] + "-")
    assert "--resolve-only" not in _container(job)["args"]
    assert _container(job)["args"][3:5] == ["--revision", COMMIT]
    assert _container(job)["args"][-2:] == ["--dest", "/cache"]
    volumes = job["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in volumes
    assert rendered.waiting_for_model  # not complete yet: still no pools
    assert rendered.budget.weight_load_seconds == 658  # measured bytes at 1000 MiB/s


def test_a_complete_download_starts_the_pools_reading_the_cache_read_only() -> None:
    facts = ModelFacts(
        resolved=Resolved(COMMIT, 642 * GIB, 170),
        complete=True,
        serving=Serving(COMMIT, "hf-cache", 642 * GIB),
    )
    rendered = render(REF, _spec(), model=facts)
    sts = next(c for c in rendered.children if c["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache", "readOnly": True}} in pod[
        "volumes"
    ]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/checkpoint"
    assert rendered.keep_shared == {("PersistentVolumeClaim", "hf-cache")}


def test_retention_delete_storage_class_and_size_override() -> None:
    raw = with_changes(
        HF_SPEC,
        model__source__huggingFace__cache={"storageClassName": "nfs", "retention": "Delete", "size": "1Ti"},
    )
    claim = render(REF, _spec(raw), model=ModelFacts(resolved=Resolved(COMMIT, 642 * GIB, 170))).shared[0]
    assert claim["spec"]["storageClassName"] == "nfs"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # goes with the last user
    assert cache_size(10, None) == "2Gi"


def test_deployments_of_the_same_model_share_the_cache_and_its_job() -> None:
    facts = ModelFacts(resolved=Resolved(COMMIT, GIB, 3))
    a = render(DeploymentRef("a", "ns", "uid-a"), _spec(), model=facts).shared
    b = render(DeploymentRef("b", "ns", "uid-b"), _spec(), model=facts).shared
    assert _kinds(a) == _kinds(b)
    for x, y in zip(a, b, strict=True):
        assert x["spec"] == y["spec"]  # only the owner reference differs
    other_class = with_changes(HF_SPEC, model__source__huggingFace__cache={"storageClassName": "fast"})
    assert _kinds(render(REF, _spec(other_class), model=facts).shared)[0] != _kinds(a)[0]
    # Another token downloads into the same cache with a Job of its own (the downloader locks the cache).
    other_token = with_changes(HF_SPEC, model__source__huggingFace__tokenSecretRef={"name": "other"})
    claim, job = _kinds(render(REF, _spec(other_token), model=facts).shared)
    assert claim == _kinds(a)[0] and job != _kinds(a)[1]


def test_names_fit_kubernetes_limits_for_long_repo_ids() -> None:
    raw = with_changes(
        HF_SPEC, model__source__huggingFace__repo="an-organisation-with-a-long-name/" + "m" * 90
    )
    facts = ModelFacts(resolved=Resolved(COMMIT, GIB, 1))
    for obj in render(REF, _spec(raw)).shared + render(REF, _spec(raw), model=facts).shared:
        assert len(obj["metadata"]["name"]) <= 63


def test_the_endpoint_comes_from_the_spec_or_the_operator() -> None:
    mirror = OperatorDefaults(hf_endpoint="https://hf-mirror.internal/")
    job = render(REF, _spec(), defaults=mirror).shared[0]
    assert _container(job)["args"][6] == "https://hf-mirror.internal"
    own = with_changes(HF_SPEC, model__source__huggingFace__endpoint="https://hub.corp")
    assert _container(render(REF, _spec(own), defaults=mirror).shared[0])["args"][6] == "https://hub.corp"


# ---- status from the Jobs --------------------------------------------------------------------


def _objects(facts: ModelFacts) -> Any:
    spec = with_operator_defaults(_spec(), OperatorDefaults())
    return cache_objects("llm", "uid-1", "ns", spec, "https://huggingface.co", facts)


def _pod(
    state: dict[str, Any], last: dict[str, Any] | None = None, restarts: int = 0, **status: Any
) -> dict[str, Any]:
    container = {"name": "download", "state": state, "restartCount": restarts}
    if last is not None:
        container["lastState"] = last
    return {
        "metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {"containerStatuses": [container], **status},
    }


def _assess(facts: ModelFacts, view: JobView, previous: dict[str, Any] | None = None) -> Any:
    source = _spec().model.source.hugging_face
    assert source is not None
    return assess(source, "https://huggingface.co", previous, facts, _objects(facts), view)


def test_the_resolve_jobs_termination_message_resolves_the_commit() -> None:
    message = json.dumps({"event": "resolved", "commit": COMMIT, "bytesTotal": 5 * GIB, "files": 7})
    pod = _pod({"terminated": {"exitCode": 0, "message": message}})
    result = _assess(ModelFacts(), JobView(job={"status": {}}, pods=[pod]))
    assert result.facts.resolved == Resolved(COMMIT, 5 * GIB, 7)
    assert result.status.phase == "Downloading" and result.status.commit == COMMIT
    assert result.status.progress == "0% of 5.0GiB"


def test_a_failed_attempt_names_the_hubs_reason_and_retries() -> None:
    failed = json.dumps(
        {
            "event": "failed",
            "reason": "Unauthorized",
            "transient": False,
            "message": "401 Unauthorized from https://huggingface.co/api/...: Invalid credentials",
        }
    )
    pod = _pod(
        {"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"exitCode": 1, "message": failed}}, 2
    )
    result = _assess(ModelFacts(), JobView(job={"status": {}}, pods=[pod]))
    status = result.status
    assert (status.phase, status.reason, status.attempts) == ("Retrying", "Unauthorized", 3)
    assert "Invalid credentials" in (status.message or "") and status.progress == "Retrying: Unauthorized"
    gave_up = {"status": {"conditions": [{"type": "Failed", "status": "True"}]}, "metadata": {"name": "j"}}
    result = _assess(ModelFacts(), JobView(job=gave_up, pods=[]), previous=status.to_api())
    assert result.status.phase == "Failed" and result.status.reason == "Unauthorized"
    assert "kubectl delete job j" in (result.status.message or "")


def test_download_progress_comes_from_the_latest_log_line() -> None:
    facts = ModelFacts(resolved=Resolved(COMMIT, 100 * GIB, 10))
    lines = [
        '{"event":"progress","bytesDone":1,"bytesTotal":107374182400,"filesDone":0,"files":10}',
        "a warning from a library",
        '{"event":"progress","bytesDone":40000000000,"bytesTotal":107374182400,"filesDone":3,"files":10,'
        '"rateBytesPerSecond":500000000,"etaSeconds":134}',
    ]
    running = _pod({"running": {"startedAt": "2026-01-01T00:00:00Z"}}, status="Running")
    status = _assess(facts, JobView(job={"status": {}}, pods=[running], log_lines=lines)).status
    assert (status.bytes_done, status.files_done, status.rate_bytes_per_second, status.eta_seconds) == (
        40_000_000_000,
        3,
        500_000_000,
        134,
    )
    assert status.progress == "37% of 100.0GiB, ETA 2m"
    # An unreadable log keeps the last figures instead of falling back to zero.
    again = _assess(facts, JobView(job={"status": {}}, pods=[running]), previous={**status.to_api()})
    assert again.status.bytes_done == 40_000_000_000
    assert latest_progress(["{not json", '{"event":"resolved"}']) is None


def test_a_complete_job_makes_its_cache_the_one_the_pools_read() -> None:
    facts = ModelFacts(resolved=Resolved(COMMIT, 100 * GIB, 10), serving=Serving("0" * 40, "old-cache", GIB))
    done = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    result = _assess(facts, JobView(job=done))
    assert result.facts.complete and result.facts.serving is not None
    assert result.facts.serving.commit == COMMIT and result.facts.serving.cache == _objects(facts).cache_name
    assert result.status.phase == "Complete" and result.status.progress == "Complete"


UNSCHEDULED = {
    "metadata": {"name": "p"},
    "spec": {},
    "status": {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
            }
        ],
    },
}


def test_an_unschedulable_download_pod_is_named() -> None:
    facts = ModelFacts(resolved=Resolved(COMMIT, GIB, 1))
    status = _assess(facts, JobView(job={"status": {}}, pods=[UNSCHEDULED])).status
    assert status.reason == "Unschedulable" and "unbound immediate PersistentVolumeClaims" in (
        status.message or ""
    )


def _claim(phase: str, class_name: str | None = "fast") -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"]}
    if class_name is not None:
        spec["storageClassName"] = class_name
    return {"metadata": {"name": "cache-x"}, "spec": spec, "status": {"phase": phase}}


def _event(type_: str, reason: str, message: str, at: str) -> dict[str, Any]:
    return {"type": type_, "reason": reason, "message": message, "lastTimestamp": at}


def test_a_cache_claim_its_class_refuses_says_why_in_the_provisioners_words() -> None:
    facts = ModelFacts(resolved=Resolved(COMMIT, GIB, 1))
    events = [
        _event("Warning", "ProvisioningFailed", "an older attempt", "2026-01-01T00:00:00Z"),
        _event(
            "Warning",
            "ProvisioningFailed",
            'failed to provision volume with StorageClass "fast": Only support ReadWriteOnce access mode',
            "2026-01-01T00:01:00Z",
        ),
        _event(
            "Normal", "ExternalProvisioning", "Waiting for a volume to be created", "2026-01-01T00:02:00Z"
        ),
    ]
    view = JobView(job={"status": {}}, pods=[UNSCHEDULED], claim=_claim("Pending"), claim_events=events)
    status = _assess(facts, view).status
    assert status.phase == "Downloading" and status.reason == "CacheClaimPending"
    message = status.message or ""
    assert "cache-x (ReadWriteMany, StorageClass fast) is not bound" in message
    # The newest Warning, in the provisioner's own words; Normal events are progress, not reasons.
    assert "ProvisioningFailed: failed to provision volume" in message and "older" not in message
    assert "huggingFace.cache (storageClassName, accessMode)" in message
    assert status.progress == "Downloading: CacheClaimPending"

    # No class named: the cluster's default class is the one that refused.
    unnamed = JobView(
        job={"status": {}}, pods=[UNSCHEDULED], claim=_claim("Pending", None), claim_events=events[:1]
    )
    assert "(ReadWriteMany, the default StorageClass)" in (_assess(facts, unnamed).status.message or "")


def test_a_claim_that_binds_or_has_not_complained_is_no_reason() -> None:
    facts = ModelFacts(resolved=Resolved(COMMIT, GIB, 1))
    refused = [_event("Warning", "ProvisioningFailed", "no", "2026-01-01T00:00:00Z")]
    # Bound (an old Warning may outlive the failure it was about): the pod's own state counts.
    bound = JobView(job={"status": {}}, pods=[UNSCHEDULED], claim=_claim("Bound"), claim_events=refused)
    assert _assess(facts, bound).status.reason == "Unschedulable"
    # Pending but nothing has complained (a provisioner at work): the scheduler's message.
    quiet = JobView(job={"status": {}}, pods=[UNSCHEDULED], claim=_claim("Pending"), claim_events=[])
    status = _assess(facts, quiet).status
    assert status.reason == "Unschedulable" and status.progress == "Downloading: Unschedulable"
    # The pod already has a node: the claim is being provisioned for it, nothing to report.
    placed = {**UNSCHEDULED, "spec": {"nodeName": "n1"}, "status": {"phase": "Pending"}}
    waiting = JobView(job={"status": {}}, pods=[placed], claim=_claim("Pending"), claim_events=refused)
    assert _assess(facts, waiting).status.reason is None


def test_status_keeps_the_resolution_only_for_the_same_source() -> None:
    source = _spec().model.source.hugging_face
    assert source is not None
    recorded = {
        "sourceHash": source_hash(source, "https://huggingface.co"),
        "commit": COMMIT,
        "bytesTotal": 9,
        "files": 1,
        "serving": {"commit": COMMIT, "cache": "c", "bytesTotal": 9},
    }
    assert facts_from_status(source, "https://huggingface.co", recorded).resolved == Resolved(COMMIT, 9, 1)
    moved = source.model_copy(update={"revision": "v2"})
    facts = facts_from_status(moved, "https://huggingface.co", recorded)
    assert facts.resolved is None and facts.serving == Serving(COMMIT, "c", 9)


# ---- the reconciler through a download -------------------------------------------------------


def _clock() -> str:
    return "2026-01-01T00:00:00Z"


def _condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == kind)


def _resolved_view(commit: str = COMMIT, size: int = 3 * GIB) -> JobView:
    message = json.dumps({"event": "resolved", "commit": commit, "bytesTotal": size, "files": 4})
    return JobView(job={"status": {}}, pods=[_pod({"terminated": {"exitCode": 0, "message": message}})])


COMPLETE = JobView(job={"status": {"conditions": [{"type": "Complete", "status": "True"}]}})


def _name(kube: FakeKube, kind: str) -> str:
    return next(name for k, name in kube.shared if k == kind)


def test_the_reconciler_takes_a_deployment_from_resolve_to_serving() -> None:
    kube = FakeKube(body_for(HF_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        resolve_job = _name(kube, "Job")
        assert not any(kind == "StatefulSet" for kind, _ in kube.children)
        model = kube.body["status"]["model"]
        assert model["phase"] == "Resolving" and model["progress"] == "Resolving"
        assert _condition(kube.body, "Ready")["reason"] == "ModelNotDownloaded"
        assert _condition(kube.body, "Progressing")["reason"] == "DownloadingModel"
        assert _condition(kube.body, "ModelDownloaded")["status"] == "False"

        # Steady while nothing moves: no writes.
        applies, writes = kube.shared_applies + kube.applies, len(kube.status_writes)
        await reconciler.reconcile(kube.body)
        assert (kube.shared_applies + kube.applies, len(kube.status_writes)) == (applies, writes)

        kube.jobs[resolve_job] = _resolved_view()
        await reconciler.reconcile(kube.body)
        claim, download = _name(kube, "PersistentVolumeClaim"), None
        download = next(n for k, n in kube.shared if k == "Job" and n != resolve_job)
        assert f"Job/{resolve_job}" in kube.released  # its answer is in status; the Job goes
        model = kube.body["status"]["model"]
        assert (model["phase"], model["commit"], model["cache"]) == ("Downloading", COMMIT, claim)
        assert not any(kind == "StatefulSet" for kind, _ in kube.children)

        kube.jobs[download] = COMPLETE
        await reconciler.reconcile(kube.body)
        sts = kube.children[("StatefulSet", "llm-unified")]
        volumes = sts["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}} in volumes
        model = kube.body["status"]["model"]
        assert model["phase"] == "Complete" and model["serving"] == {
            "commit": COMMIT,
            "cache": claim,
            "bytesTotal": 3 * GIB,
        }
        assert _condition(kube.body, "ModelDownloaded")["status"] == "True"
        assert _condition(kube.body, "Ready")["status"] == "True"
        assert not unsettled(kube.body)

    asyncio.run(scenario())


def test_a_refused_token_degrades_the_deployment_with_the_hubs_message() -> None:
    kube = FakeKube(body_for(HF_SPEC))
    reconciler = Reconciler(kube, clock=_clock)
    failed = json.dumps(
        {
            "event": "failed",
            "reason": "Unauthorized",
            "transient": False,
            "message": "401 Unauthorized from http://hub/api/models/x: Invalid credentials in Authorization header",
        }
    )

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        kube.jobs[_name(kube, "Job")] = JobView(
            job={"status": {}},
            pods=[
                _pod(
                    {"waiting": {"reason": "CrashLoopBackOff"}},
                    {"terminated": {"exitCode": 1, "message": failed}},
                )
            ],
        )
        await reconciler.reconcile(kube.body)
        degraded = _condition(kube.body, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "Unauthorized"
        assert "Invalid credentials in Authorization header" in degraded["message"]
        assert kube.body["status"]["model"]["progress"] == "Retrying: Unauthorized"

    asyncio.run(scenario())


def test_a_refused_cache_claim_degrades_the_deployment_until_it_binds() -> None:
    kube = FakeKube(body_for(HF_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        resolve_job = _name(kube, "Job")
        assert kube.job_claims[resolve_job] is None  # the resolve Job fills no claim
        kube.jobs[resolve_job] = _resolved_view()
        await reconciler.reconcile(kube.body)
        claim = _name(kube, "PersistentVolumeClaim")
        download = next(n for k, n in kube.shared if k == "Job" and n != resolve_job)

        said = 'storageclass.storage.k8s.io "fast" not found'
        kube.jobs[download] = JobView(
            job={"status": {}},
            pods=[UNSCHEDULED],
            claim={**_claim("Pending"), "metadata": {"name": claim}},
            claim_events=[_event("Warning", "ProvisioningFailed", said, "2026-01-01T00:00:00Z")],
        )
        await reconciler.reconcile(kube.body)
        assert kube.job_claims[download] == claim  # the download is observed with its claim
        degraded = _condition(kube.body, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "CacheClaimPending"
        assert claim in degraded["message"] and said in degraded["message"]
        assert _condition(kube.body, "ModelDownloaded")["reason"] == "CacheClaimPending"
        assert kube.body["status"]["model"]["progress"] == "Downloading: CacheClaimPending"

        kube.jobs[download] = JobView(
            job={"status": {}}, claim={**_claim("Bound"), "metadata": {"name": claim}}
        )
        await reconciler.reconcile(kube.body)
        assert _condition(kube.body, "Degraded")["status"] == "False"
        assert kube.body["status"]["model"].get("reason") is None

    asyncio.run(scenario())


def test_a_new_revision_downloads_while_the_pools_keep_serving_the_old_one() -> None:
    kube = FakeKube(body_for(HF_SPEC))
    reconciler = Reconciler(kube, clock=_clock)
    new_commit = "9" * 40

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        kube.jobs[_name(kube, "Job")] = _resolved_view()
        await reconciler.reconcile(kube.body)
        old_claim = _name(kube, "PersistentVolumeClaim")
        kube.jobs[next(n for k, n in kube.shared if k == "Job")] = COMPLETE
        await reconciler.reconcile(kube.body)

        kube.body["spec"] = with_changes(HF_SPEC, model__source__huggingFace__revision="v2")
        kube.body["metadata"]["generation"] = 2
        await reconciler.reconcile(kube.body)
        resolve_v2 = next(n for k, n in kube.shared if k == "Job" and n.startswith("hf-resolve-"))
        kube.jobs[resolve_v2] = _resolved_view(new_commit)
        await reconciler.reconcile(kube.body)
        claims = [n for k, n in kube.shared if k == "PersistentVolumeClaim"]
        assert len(claims) == 2 and old_claim in claims  # the serving cache stays while the new one fills
        sts = kube.children[("StatefulSet", "llm-unified")]
        assert old_claim in json.dumps(sts["spec"]["template"]["spec"]["volumes"])
        assert "the pools serve commit" in _condition(kube.body, "Progressing")["message"]
        assert _condition(kube.body, "Ready")["status"] == "True"
        assert unsettled(kube.body)

    asyncio.run(scenario())


def test_the_download_monitor_polls_only_unsettled_sources() -> None:
    now = [0.0]
    calls: list[str] = []

    async def reconcile(body: Any) -> None:
        calls.append(body["metadata"]["name"])

    monitor = DownloadMonitor(reconcile, interval_s=10, clock=lambda: now[0])
    body = body_for(HF_SPEC)
    assert monitor.due("ns", "llm", body)
    asyncio.run(monitor.tick("ns", "llm", body))
    assert not monitor.due("ns", "llm", body)
    now[0] = 10
    assert monitor.due("ns", "llm", body)
    settled = {
        **body,
        "status": {
            "observedGeneration": 1,
            "model": {"phase": "Complete", "commit": COMMIT, "serving": {"commit": COMMIT}},
        },
    }
    assert not monitor.due("ns", "llm", settled)
    assert not unsettled(body_for({"model": {"name": "t", "source": {"builtin": "sovereign-tiny"}}}))
    assert calls == ["llm"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"repo": "not a repo"}, "String should match pattern"),
        ({"revision": "has space"}, "String should match pattern"),
        ({"endpoint": "ftp://hub"}, "String should match pattern"),
    ],
)
def test_bad_source_fields_are_refused(change: dict[str, Any], says: str) -> None:
    raw = with_changes(HF_SPEC, **{f"model__source__huggingFace__{k}": v for k, v in change.items()})
    with pytest.raises(ValueError, match=says):
        _spec(raw)


# ---- sovereign-operator render ----------------------------------------------------------------


def _hub_repo() -> Any:
    from hubserver import HubFile, HubRepo

    header = json.dumps({"w": {"dtype": "U8", "shape": [1024], "data_offsets": [0, 1024]}}).encode()
    shard = len(header).to_bytes(8, "little") + header + bytes(1024)
    files = {
        "config.json": HubFile("config.json", b'{"model_type": "deepseek_v3"}'),
        "model.safetensors": HubFile("model.safetensors", shard),
        "original/consolidated.pth": HubFile("original/consolidated.pth", bytes(4096)),
    }
    return HubRepo("deepseek-ai/DeepSeek-V3", files, private=True)


def test_render_shows_the_resolve_job_or_with_the_hubs_answer_everything(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml
    from hubserver import HubServer, HubState
    from sovereign_operator.cli import main

    repo = _hub_repo()
    with HubServer(HubState({repo.repo_id: repo}, token="hf_secret")) as hub:
        raw = with_changes(HF_SPEC, model__source__huggingFace__endpoint=hub.endpoint)
        document = {
            "apiVersion": "sovereign.ai/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "ds"},
            "spec": raw,
        }
        path = tmp_path / "llmd.yaml"
        path.write_text(yaml.safe_dump(document))

        assert main(["render", "-f", str(path)]) == 0
        out = capsys.readouterr()
        kinds = [c["kind"] for c in yaml.safe_load_all(out.out)]
        assert "StatefulSet" not in kinds and kinds.count("Job") == 1
        assert "--resolve-models" in out.err

        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert main(["render", "-f", str(path), "--resolve-models"]) == 0
        children = list(yaml.safe_load_all(capsys.readouterr().out))
        claim = next(c for c in children if c["kind"] == "PersistentVolumeClaim")
        assert claim["metadata"]["annotations"]["sovereign.ai/commit"] == repo.commit
        assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"  # 1.1 KB of json + safetensors
        job = next(c for c in children if c["kind"] == "Job")
        assert _container(job)["args"][4] == repo.commit
        sts = next(c for c in children if c["kind"] == "StatefulSet")
        assert claim["metadata"]["name"] in json.dumps(sts["spec"]["template"]["spec"]["volumes"])

        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        assert main(["render", "-f", str(path), "--resolve-models"]) == 1
        err = capsys.readouterr().err
        assert "spec.model.source.huggingFace: Unauthorized" in err and "Invalid credentials" in err


def test_the_models_doc_example_is_valid() -> None:
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert block is not None
    document = yaml.safe_load(block.group(1))
    spec = LLMDeploymentSpec.model_validate(document["spec"])
    assert spec.model.source.hugging_face is not None
    assert render(REF, spec).shared[0]["kind"] == "Job"


def test_a_deleted_job_is_applied_again_and_a_missing_secret_is_named() -> None:
    kube = FakeKube(body_for(HF_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        job = _name(kube, "Job")
        await kube.delete_job("ns", job)  # as `kubectl delete job` after the Job gave up
        await reconciler.reconcile(kube.body)
        assert ("Job", job) in kube.shared
        waiting = {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}
        kube.jobs[job] = JobView(job={"status": {}}, pods=[_pod({"waiting": waiting})])
        await reconciler.reconcile(kube.body)
        degraded = _condition(kube.body, "Degraded")
        assert degraded["reason"] == "CreateContainerConfigError"
        assert 'secret "hf-token" not found' in degraded["message"]

    asyncio.run(scenario())


def test_a_deleted_cache_claim_is_applied_again_while_its_download_runs() -> None:
    """Deleted by hand, or by another deployment's release of an unbound claim it shared: the
    download's pod would wait for it for ever."""
    kube = FakeKube(body_for(HF_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        kube.jobs[_name(kube, "Job")] = _resolved_view()
        await reconciler.reconcile(kube.body)
        claim = _name(kube, "PersistentVolumeClaim")
        applies = kube.shared_applies
        await reconciler.reconcile(kube.body)
        assert kube.shared_applies == applies  # all in place: nothing applied again
        del kube.shared[("PersistentVolumeClaim", claim)]
        await reconciler.reconcile(kube.body)
        assert ("PersistentVolumeClaim", claim) in kube.shared
        assert kube.body["status"]["model"]["cache"] == claim

    asyncio.run(scenario())


def test_a_deleted_deployments_sync_releases_the_claims_it_left_unbound() -> None:
    kube = FakeKube(body_for(HF_SPEC))
    reconciler = Reconciler(kube, clock=_clock)

    async def gone(namespace: str, name: str) -> None:
        return None

    async def scenario() -> None:
        await reconciler.sync("ns", "llm")
        assert kube.unbound_sweeps == []  # a live deployment's sweep is part of its reconcile
        kube.get_deployment = gone  # type: ignore[method-assign]
        await reconciler.sync("ns", "llm")
        assert kube.unbound_sweeps == [("ns", None)]

    asyncio.run(scenario())
